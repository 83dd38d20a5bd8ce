"""An experiment's checkpoint deployed as its policy says (the ``deployment`` asset).

The next version of ``factory/<experiment>`` serves the best checkpoint (or one chosen). With
``deploy: {shadow: ...}`` in the experiment (or ``candidate`` asked for) it is a candidate:
served beside the live version, the route untouched, and, under a shadow policy, a shadow rule
sends a share of the policy's route's calls to it (``shadow_scores`` promotes it). A checkpoint
deployed by hand needs no experiment file: without one the version goes live.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from factory.deploy.deployer import Deployer, Deployment
from factory.experiments import ExperimentError, ShadowPolicy, load_experiment
from factory.gateway.shadow import ShadowRule, register_shadow


@dataclass(frozen=True, kw_only=True)
class Served:
    """A version ``deploy_experiment`` started."""

    deployment: Deployment
    """The version: ``live``, or ``candidate`` beside the live one."""
    sizing: dict[str, Any]
    """How its server was sized, with each value's source (``ServingSize.metadata``); empty
    when the deployer sized none."""
    policy: ShadowPolicy | None
    """The experiment's shadow policy; None without one (or without an experiment file)."""
    shadows: str
    """The route whose calls the candidate shadows; empty when it shadows none."""


def deploy_experiment(deployer: Deployer, experiment: str, checkpoint: str | None = None, *,
                      candidate: bool | None = None,
                      structured_outputs: dict[str, Any] | None = None) -> Served:
    """Serve ``checkpoint`` (None: the experiment's row of ``best_checkpoints``; else an
    adapter directory or ``RUN:STEP``) as the next version of ``experiment``.

    ``candidate``: serve it beside the live version without moving ``factory/<experiment>``;
    None: as the experiment's deploy policy says (a candidate under a shadow policy, live
    otherwise). A candidate under a shadow policy gets the policy's shadow rule, written with
    the deployer's session. ``structured_outputs``: the constraint its route adds
    (``Deployer.deploy``). Raises ``DeploymentError`` or ``ValueError`` (from
    ``Deployer.deploy``) when the version cannot be served; nothing is shadowed then."""
    try:
        policy = load_experiment(experiment).shadow
    except ExperimentError:
        policy = None
    as_candidate = candidate if candidate is not None else policy is not None
    dep = deployer.deploy(experiment, checkpoint, candidate=as_candidate,
                          structured_outputs=structured_outputs)
    sizing = deployer.serving_size.metadata() if deployer.serving_size else {}
    shadows = ""
    if as_candidate and policy is not None:
        register_shadow(ShadowRule(route=policy.route, experiment=dep.name, version=dep.version,
                                   base_url=dep.endpoint, deployment=dep.adapter,
                                   share=policy.share),
                        lake=deployer.session.lake, lineage=deployer.session.lineage)
        shadows = policy.route
    return Served(deployment=dep, sizing=sizing, policy=policy, shadows=shadows)
