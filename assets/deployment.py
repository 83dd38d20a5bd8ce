"""``deployment`` (per experiment): the best checkpoint (or one chosen) served behind the stable
model name ``factory/<experiment>`` in the gateway.

Each materialization boots the inference server for the checkpoint as the next version, waits
for its health check, records it in ``deployments``, moves the gateway route to it and then
drains and stops the version it replaced. The server outlives the run (a detached process, or
a Deployment on the cluster ``$FACTORY_DEPLOYER`` names); ``factory undeploy`` / ``factory
rollback`` act on it later.

With ``deploy: {shadow: ...}`` in the experiment (or ``candidate`` in the config) the new version
is a candidate instead: served beside the live one, the route untouched; the shadow rule sends a
share of the named route's calls to it, and ``shadow_scores`` promotes it. The work is
``factory.deploy.experiment.deploy_experiment``'s.
"""

import dagster as dg
from pydantic import Field

from factory.deploy import DeploymentError
from factory.deploy.experiment import deploy_experiment
from factory.evals.judging import serving_constraint
from factory.partitions import EXPERIMENTS
from factory.resources.deployer import DeployerResource
from factory.resources.lake import LakeResource


class DeploymentConfig(dg.Config):
    """Which checkpoint to serve."""

    checkpoint: str = Field(
        default="",
        description="Empty: the experiment's row of best_checkpoints. Otherwise an adapter "
                    "directory, or RUN:STEP naming a verified row of checkpoints.")
    candidate: bool | None = Field(
        default=None,
        description="Serve it as a candidate beside the live version, without moving "
                    "factory/<experiment> (promote it later). Empty: as the experiment's deploy "
                    "policy says (a candidate shadowing its route for deploy: {shadow: ...}).")


@dg.asset(
    partitions_def=EXPERIMENTS,
    deps=["best_checkpoint"],
    group_name="deploy",
    kinds={"python", "iceberg"},
    description="The experiment's live endpoint: the best (or chosen) checkpoint on an "
                "inference server (CPU server here, vLLM on GPUs), healthy before the gateway "
                "route factory/<experiment> moves to it; the previous version drains and stops. "
                "Table deployments.",
    code_version="1",
)
def deployment(context: dg.AssetExecutionContext, config: DeploymentConfig,
               lake: LakeResource, deployer: DeployerResource) -> dg.MaterializeResult:
    session = lake.session(context)
    target = deployer.deployer(session)
    try:
        served = deploy_experiment(target, context.partition_key, config.checkpoint or None,
                                   candidate=config.candidate,
                                   structured_outputs=serving_constraint(
                                       session, context.partition_key))
    except (DeploymentError, ValueError) as exc:
        raise dg.Failure(description=str(exc), allow_retries=False) from None
    dep, policy = served.deployment, served.policy
    if served.shadows and policy is not None:
        context.log.info(f"candidate {dep.version} ({dep.endpoint}) shadows {policy.route} "
                         f"(share {policy.share:g})")
    else:
        context.log.info(f"{dep.route_model} -> {dep.endpoint} ({dep.version}, pid {dep.pid})")
    return dg.MaterializeResult(metadata={
        "model": dep.route_model,
        "version": dep.version,
        "status": dep.status,
        "shadows": served.shadows,
        "endpoint": dep.endpoint,
        "checkpoint": dg.MetadataValue.path(dep.checkpoint),
        "run_id": dep.run_id or "",
        "step": dep.step if dep.step is not None else -1,
        "backend": dep.backend,
        "pid": dep.pid or 0,
        "log": dg.MetadataValue.path(dep.log_path),
        "serve_sizing": dg.MetadataValue.json(served.sizing),
        "structured_outputs": dep.structured_outputs or "",
        **session.metadata(),
    })
