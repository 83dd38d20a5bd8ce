"""``factory deploy``, ``promote``, ``shadow``, ``undeploy``, ``rollback``, ``deployments`` and
``chat``.

Deploy commands act directly (no Dagster run) and record every change in ``deployments``; the
``deployment`` asset does the same from the UI. Servers run detached: they outlive the command
that started them and ``factory undeploy`` stops them from any later process.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from factory.errors import FactoryError
from factory.evals.judging import serving_constraint
from factory.experiments import ExperimentError, load_experiment
from factory.gateway.keys import client_headers
from factory.gateway.shadow import ShadowRule, end_shadow, load_shadows, register_shadow
from factory.lake import Lake
from factory.output import print_rows
from factory.settings import get_settings

COLUMNS = ["name", "version", "status", "alive", "endpoint", "route_model", "checkpoint",
           "run_id", "step", "engine", "pid", "started_at", "stopped_at", "reason"]


def register(sub: Any) -> None:
    p = sub.add_parser("deploy", help="serve an experiment's best (or a chosen) checkpoint "
                                      "behind the stable model name factory/EXPERIMENT")
    p.add_argument("experiment")
    p.add_argument("--checkpoint", default=None, metavar="PATH|RUN:STEP",
                   help="adapter directory or RUN:STEP from `checkpoints` (default: the row of "
                        "best_checkpoints)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--candidate", action="store_true",
                       help="serve it beside the live version without moving "
                            "factory/EXPERIMENT (shadow it with `factory shadow`, then "
                            "`factory promote`)")
    which.add_argument("--live", action="store_true",
                       help="move factory/EXPERIMENT to it even where the experiment's deploy "
                            "policy shadows first (default: as the policy says)")
    _server_options(p)
    p.set_defaults(func=_deploy)

    p = sub.add_parser("promote", help="move factory/EXPERIMENT to its candidate version and "
                                       "retire the version it replaces")
    p.add_argument("experiment")
    p.add_argument("--version", default=None, help="the candidate (default: the newest)")
    p.add_argument("--drain-s", type=float, default=None,
                   help="seconds the replaced version keeps serving after the switch (10)")
    p.add_argument("--format", choices=["text", "json"], default="text")
    p.set_defaults(func=_promote)

    p = sub.add_parser("shadow", help="send a share of a model's live calls to EXPERIMENT's "
                                      "candidate (or live) deployment too, for comparison")
    p.add_argument("experiment", nargs="?", default=None)
    p.add_argument("--route", default=None, metavar="MODEL",
                   help="the model name whose calls are shadowed (default: the route of the "
                        "experiment's deploy: {shadow: ...} policy)")
    p.add_argument("--share", type=float, default=None,
                   help="share of the route's calls shadowed, 0 < share <= 1 (default: the "
                        "policy's, else 1)")
    p.add_argument("--stop", action="store_true", help="stop shadowing the route")
    p.add_argument("--list", action="store_true", help="list the shadow rules")
    p.set_defaults(func=_shadow)

    p = sub.add_parser("undeploy", help="remove factory/EXPERIMENT's route and stop its server")
    p.add_argument("experiment")
    p.add_argument("--drain-s", type=float, default=None,
                   help="seconds the server keeps serving after the route is removed (10)")
    p.set_defaults(func=_undeploy)

    p = sub.add_parser("rollback", help="serve the previous version of a deployment again")
    p.add_argument("experiment")
    p.add_argument("--to", default=None, metavar="VERSION",
                   help="the version to restore (default: the newest one before the live one)")
    _server_options(p)
    p.set_defaults(func=_rollback)

    p = sub.add_parser("deployments", help="list deployment versions: status, endpoint, pid")
    p.add_argument("experiment", nargs="?", default=None)
    p.add_argument("--all", action="store_true", help="also stopped and failed versions")
    p.add_argument("--format", choices=["table", "json"], default="table")
    p.set_defaults(func=_deployments)

    if "chat" not in sub.choices:  # another module may own `factory chat`
        p = sub.add_parser("chat", help="talk to a model through the gateway (e.g. "
                                        "factory/EXPERIMENT)")
        p.add_argument("model")
        p.add_argument("-m", "--message", default=None,
                       help="send one message, print the answer and exit")
        p.add_argument("--system", default=None, help="system prompt")
        p.add_argument("--gateway", default=None,
                       help="gateway URL (default $FACTORY_GATEWAY_URL or "
                            "http://127.0.0.1:8787); it is sent the factory key "
                            "$FACTORY_GATEWAY_KEY")
        p.add_argument("--direct", action="store_true",
                       help="bypass the gateway: call the live deployment's server itself "
                            "(not captured)")
        p.add_argument("--max-tokens", type=int, default=256)
        p.set_defaults(func=_chat)


def _server_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", choices=["transformers", "vllm"], default="transformers",
                   help="inference server: the factory's CPU server or vLLM on a GPU")
    p.add_argument("--threads", type=int, default=None, help="CPU server torch threads")
    p.add_argument("--drain-s", type=float, default=None,
                   help="seconds the replaced version keeps serving after the switch (10)")
    p.add_argument("--startup-timeout-s", type=float, default=None,
                   help="longest wait for the new server's health check (600)")
    p.add_argument("--format", choices=["text", "json"], default="text")


def _deploy_package() -> Any:
    """``factory.deploy`` with its ``hosts`` and ``kubernetes`` modules, loaded when a deploy
    command runs."""
    # the deployer brings httpx and the inference client (0.2 s): other commands start without
    import factory.deploy.kubernetes

    return factory.deploy


def _deployer(args: argparse.Namespace) -> Any:
    deploy = _deploy_package()
    values: dict[str, Any] = {}
    for name in ("backend", "threads", "drain_s", "startup_timeout_s"):
        value = getattr(args, name, None)
        if value is not None:
            values[name] = value
    # Servers run on the cluster $FACTORY_DEPLOYER names, as the deployment asset's do.
    return deploy.Deployer(config=deploy.DeployConfig(**values),
                           host=deploy.kubernetes.host_from_env())


def _report(dep: Any, fmt: str, verb: str) -> None:
    if fmt == "text":
        on = f"engine {dep.engine}, " if dep.engine else ""
        print(f"{verb} {dep.name} {dep.version}: {dep.route_model} -> {dep.endpoint} "
              f"(checkpoint {dep.checkpoint}, {on}pid {dep.pid})", file=sys.stderr)
    print(json.dumps({"name": dep.name, "version": dep.version, "status": dep.status,
                      "model": dep.route_model, "endpoint": dep.endpoint,
                      "checkpoint": dep.checkpoint, "pid": dep.pid, "engine": dep.engine}))


def _deploy(args: argparse.Namespace) -> int:
    deployer = _deployer(args)
    if args.format == "text":
        what = (f"loading it into the {deployer.config.backend} engine of its base model "
                "(started first when none runs)" if deployer.host.shares_engines
                else f"starting the {deployer.config.backend} server")
        print(f"deploying {args.experiment}: {what}...", file=sys.stderr, flush=True)
    # As the deployment asset does: the experiment's deploy policy (a candidate shadowing its
    # route under deploy: {shadow: ...}) unless --candidate or --live says, and the answer
    # constraint its evals ran under on the route.
    candidate = True if args.candidate else False if args.live else None
    served = _deploy_package().deploy_experiment(
        deployer, args.experiment, args.checkpoint, candidate=candidate,
        structured_outputs=serving_constraint(deployer.session, args.experiment))
    dep = served.deployment
    _report(dep, args.format, "deployed candidate" if dep.status == "candidate" else "deployed")
    if served.shadows and args.format == "text":
        print(f"it shadows {served.shadows}'s calls (share {served.policy.share:g}); "
              f"shadow_scores promotes it", file=sys.stderr)
    return 0


def _promote(args: argparse.Namespace) -> int:
    deploy = _deploy_package()
    cfg = deploy.DeployConfig(**({"drain_s": args.drain_s} if args.drain_s is not None else {}))
    deployer = deploy.Deployer(config=cfg, host=deploy.kubernetes.host_from_env())
    _report(deployer.promote(args.experiment, args.version), args.format, "promoted")
    return 0


def _shadow(args: argparse.Namespace) -> int:
    deploy = _deploy_package()
    lake = Lake()
    if args.list or args.experiment is None:
        rules = load_shadows(lake)
        print_rows([vars(r) | {"candidate_url": r.base_url} for r in rules.values()], "table",
                   columns=["route", "experiment", "version", "deployment", "share",
                            "candidate_url"])
        return 0
    name = deploy.check_name(args.experiment)
    try:
        policy = load_experiment(name).shadow
    except ExperimentError:
        policy = None
    route = args.route or (policy.route if policy else None)
    if not route:
        raise FactoryError(f"which model's calls should {name} shadow? pass --route MODEL (or "
                           "set deploy: {shadow: {route: MODEL}} in the experiment)")
    if args.stop:
        end_shadow(route, lake=lake)
        print(f"stopped shadowing {route}", file=sys.stderr)
        return 0
    deployer = deploy.Deployer(lake)
    dep = deployer.candidate(name) or deployer.live(name)
    if dep is None:
        raise FactoryError(f"{name!r} has no candidate or live deployment to shadow with; "
                           f"deploy one first: factory deploy {name} --candidate")
    share = args.share if args.share is not None else (policy.share if policy else 1.0)
    try:
        rule = ShadowRule(route=route, experiment=name, version=dep.version,
                          base_url=dep.endpoint, deployment=dep.adapter, share=share)
    except ValueError as exc:
        raise FactoryError(str(exc)) from None
    register_shadow(rule, lake=lake)
    print(f"{name} {dep.version} ({dep.status}) now shadows {share:.0%} of {route}'s calls; "
          f"gateways pick it up within their routes poll", file=sys.stderr)
    print(json.dumps(vars(rule)))
    return 0


def _undeploy(args: argparse.Namespace) -> int:
    deploy = _deploy_package()
    cfg = deploy.DeployConfig(**({"drain_s": args.drain_s} if args.drain_s is not None else {}))
    deployer = deploy.Deployer(config=cfg, host=deploy.kubernetes.host_from_env())
    _report(deployer.undeploy(args.experiment), "text", "undeployed")
    return 0


def _rollback(args: argparse.Namespace) -> int:
    _report(_deployer(args).rollback(args.experiment, args.to), args.format, "rolled back to")
    return 0


def _deployments(args: argparse.Namespace) -> int:
    deploy = _deploy_package()
    name = deploy.check_name(args.experiment) if args.experiment else None
    deployer = deploy.Deployer(host=deploy.kubernetes.host_from_env())
    rows = [{**d.as_dict(), "alive": _alive(deploy.hosts, deployer.host, d)}
            for d in deployer.versions(name)
            if args.all or d.status in ("starting", "live", "candidate", "draining")]
    print_rows(rows, args.format, columns=COLUMNS)
    return 0


def _alive(hosts: Any, host: Any, dep: Any) -> bool | None:
    """Whether what runs ``dep`` exists where it is hosted: a process on this machine, or a
    Deployment on the cluster ``$FACTORY_DEPLOYER`` names; None when that cannot be asked (a
    cluster this node is not configured for, or an API that does not answer: said on
    stderr). ``hosts``: the module ``factory.deploy.hosts``."""
    where = hosts.placement_of(dep)
    if where == hosts.PROCESS:
        return bool(dep.alive)
    if where != host.kind:
        return None
    try:
        return bool(host.running(dep))
    except hosts.HostError as e:
        print(f"{dep.name} {dep.version}: {e}", file=sys.stderr)
        return None


def _chat(args: argparse.Namespace) -> int:
    """A conversation through the gateway (with the factory key of the settings, which a keyed
    gateway requires), or with ``--direct`` with the live deployment's server (never sent the
    key: a factory key is for the gateway alone)."""
    import openai

    headers: dict[str, str] = {}
    if args.direct:
        deploy = _deploy_package()
        live = deploy.Deployer().live(deploy.check_name(args.model))  # factory/NAME or NAME
        if live is None:
            raise FactoryError(f"{args.model!r} has no live deployment")
        base_url, model = live.endpoint, live.adapter
    else:
        settings = get_settings()
        gateway = args.gateway or settings.gateway_url
        base_url, model = gateway.rstrip("/") + "/v1", args.model
        headers = client_headers(settings)
    client = openai.OpenAI(base_url=base_url, api_key=os.environ.get("OPENAI_API_KEY", "factory"),
                           max_retries=0, default_headers=headers)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None
    if interactive:
        print(f"chatting with {model} at {base_url} (empty line or Ctrl-D ends)",
              file=sys.stderr)
    while True:
        if interactive:
            try:
                text = input("> ")
            except EOFError:
                return 0
            if not text.strip():
                return 0
        else:
            text = args.message
        messages.append({"role": "user", "content": text})
        try:
            stream: Any = client.chat.completions.create(
                model=model, messages=messages,  # type: ignore[arg-type]
                max_tokens=args.max_tokens, stream=True)
            parts = []
            for chunk in stream:
                delta = chunk.choices[0].delta.content if chunk.choices else None
                if delta:
                    parts.append(delta)
                    print(delta, end="", flush=True)
            print()
        except openai.APIConnectionError:
            raise FactoryError(f"cannot reach {base_url}; start the gateway with `factory "
                               "serve` (or pass --gateway URL / --direct)") from None
        except openai.APIStatusError as e:
            hint = ""
            if e.status_code == 401 and not headers and not args.direct:
                hint = ("; set FACTORY_GATEWAY_KEY to a factory key (`factory keys create`) "
                        "for the factory's own clients")
            raise FactoryError(f"{base_url} answered {e.status_code}: "
                               f"{e.message}{hint}") from None
        messages.append({"role": "assistant", "content": "".join(parts)})
        if not interactive:
            return 0
