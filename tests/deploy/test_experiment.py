"""An experiment's checkpoint deployed as its policy says (``factory.deploy.experiment``): live
without an experiment file, a candidate shadowing the policy's route under ``deploy: {shadow:
...}`` (the rule written with the deployer's session), live when the caller says so, and nothing
shadowed when the version is refused.

The deployer, the lake and the gateway tables are the real ones; the servers run on the fake
Kubernetes API server of tests/deploy/test_kubernetes_deployer.py (no process to boot).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from factory.deploy import DeployConfig, Deployer, DeploymentError
from factory.deploy.experiment import deploy_experiment
from factory.gateway import load_routes
from factory.gateway.shadow import load_shadows
from factory.lake import Lake
from tests.deploy.test_kubernetes_deployer import (  # noqa: F401 (the fixtures cluster, setup)
    FakeCluster,
    Setup,
    _host,
    cluster,
    setup,
)

SHADOW = """name: exp
data: {where: "true"}
recipe: smollm2-135m-lora
deploy: {shadow: {route: gpt-4o-mini, share: 0.25}}
"""


@pytest.fixture()
def experiments(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The experiments folder, empty until a test writes ``exp.yaml``."""
    folder = factory_home / "experiments"
    folder.mkdir()
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(folder))
    return folder


def _deployer(cluster: FakeCluster) -> Deployer:  # noqa: F811
    cluster.auto_ready = True
    return Deployer(config=DeployConfig(drain_s=0.0, startup_timeout_s=60.0),
                    host=_host(cluster),
                    session=Lake().session(run_id="run-1", asset_key="deployment"))


def test_without_an_experiment_file_the_checkpoint_goes_live(
        cluster: FakeCluster, setup: Setup, experiments: Path) -> None:  # noqa: F811
    deployer = _deployer(cluster)
    served = deploy_experiment(deployer, "exp", str(setup.checkpoints[0]))
    dep = served.deployment
    assert (dep.version, dep.status, served.policy, served.shadows) == ("v1", "live", None, "")
    assert deployer.serving_size is not None
    assert served.sizing == deployer.serving_size.metadata() and served.sizing
    assert load_routes(Lake())["factory/exp"].base_url == dep.endpoint
    assert load_shadows(Lake()) == {}


def test_a_shadow_policy_serves_a_candidate_that_shadows_its_route(
        cluster: FakeCluster, setup: Setup, experiments: Path) -> None:  # noqa: F811
    (experiments / "exp.yaml").write_text(SHADOW)
    live = deploy_experiment(_deployer(cluster), "exp", str(setup.checkpoints[0]),
                             candidate=False)
    assert (live.deployment.status, live.shadows) == ("live", "")
    assert live.policy is not None and live.policy.route == "gpt-4o-mini"
    assert load_shadows(Lake()) == {}

    served = deploy_experiment(_deployer(cluster), "exp", str(setup.checkpoints[1]))
    dep = served.deployment
    assert (dep.version, dep.status, served.shadows) == ("v2", "candidate", "gpt-4o-mini")
    rule = load_shadows(Lake())["gpt-4o-mini"]
    assert (rule.experiment, rule.version, rule.base_url, rule.deployment, rule.share) == \
        ("exp", "v2", dep.endpoint, dep.adapter, 0.25)
    assert Lake().snapshot_info("shadows")["run_id"] == "run-1"
    # the stable name still reaches the live version
    assert load_routes(Lake())["factory/exp"].base_url == live.deployment.endpoint


def test_a_refused_checkpoint_shadows_nothing(cluster: FakeCluster, setup: Setup,  # noqa: F811
                                              experiments: Path, tmp_path: Path) -> None:
    (experiments / "exp.yaml").write_text(SHADOW)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "adapter_config.json").write_text(
        f'{{"base_model_name_or_path": "{setup.base}"}}')
    with pytest.raises(DeploymentError, match="is not on the shared volume"):
        deploy_experiment(_deployer(cluster), "exp", str(outside))
    assert load_shadows(Lake()) == {} and cluster.calls == []


def test_the_deployment_asset_fails_naming_the_refusal(
        cluster: FakeCluster, setup: Setup, experiments: Path,  # noqa: F811
        tmp_path: Path) -> None:
    """The asset over ``deploy_experiment``: a refused version fails the step with the
    deployer's reason, and nothing is created or shadowed."""
    import dagster as dg

    from factory.assets.deployment import deployment
    from factory.resources.deployer import KubernetesCPUDeployerResource
    from factory.resources.lake import LakeResource

    (experiments / "exp.yaml").write_text(SHADOW)
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "adapter_config.json").write_text(
        f'{{"base_model_name_or_path": "{setup.base}"}}')
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["exp"])
    result: Any = dg.materialize(
        [deployment], instance=instance, partition_key="exp",
        resources={"lake": LakeResource(), "deployer": KubernetesCPUDeployerResource(
            api_server=cluster.url, image="ghcr.io/example/factory:1", namespace="ml",
            shared_claim="factory-shared", poll_s=0.02, drain_s=0.0)},
        run_config={"ops": {"deployment": {"config": {"checkpoint": str(outside)}}}},
        raise_on_error=False)
    assert not result.success
    failure = next(e for e in result.all_events if e.event_type_value == "STEP_FAILURE")
    assert "is not on the shared volume" in failure.event_specific_data.error.message
    assert load_shadows(Lake()) == {} and cluster.calls == []


def test_the_cli_deploys_as_the_policy_says_unless_told(
        cluster: FakeCluster, setup: Setup, experiments: Path,  # noqa: F811
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``factory deploy`` as the ``deployment`` asset: a candidate shadowing the policy's
    route under ``deploy: {shadow: ...}``, live with ``--live``."""
    import json

    from factory.app.cli import main

    (experiments / "exp.yaml").write_text(SHADOW)
    cluster.auto_ready = True
    monkeypatch.setenv("FACTORY_DEPLOYER", json.dumps({
        "api_server": cluster.url, "image": "ghcr.io/example/factory:1", "namespace": "ml",
        "shared_claim": "factory-shared", "poll_s": 0.02, "drain_s": 0.0}))
    assert main(["deploy", "exp", "--checkpoint", str(setup.checkpoints[0]), "--live",
                 "--format", "json"]) == 0
    assert load_shadows(Lake()) == {}
    assert main(["deploy", "exp", "--checkpoint", str(setup.checkpoints[1]),
                 "--format", "json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["version"], o["status"]) for o in out] == [("v1", "live"), ("v2", "candidate")]
    rule = load_shadows(Lake())["gpt-4o-mini"]
    assert (rule.experiment, rule.version, rule.share) == ("exp", "v2", 0.25)
    assert load_routes(Lake())["factory/exp"].base_url == out[0]["endpoint"]
    with pytest.raises(SystemExit) as usage:  # one or the other
        main(["deploy", "exp", "--candidate", "--live"])
    assert usage.value.code == 2
