"""Static checks of the images and the Helm values (no image can be built here): the
Dockerfiles parse and copy what exists, the trainer image holds no orchestration, and the
values' provider config renders to the Job spec the Kubernetes tests expect."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from kubernetes import client as k

from factory.control.providers import KubernetesProvider
from tests.conftest import ROOT

INSTRUCTIONS = {"FROM", "RUN", "CMD", "LABEL", "EXPOSE", "ENV", "ADD", "COPY", "ENTRYPOINT",
                "VOLUME", "USER", "WORKDIR", "ARG", "ONBUILD", "STOPSIGNAL", "HEALTHCHECK",
                "SHELL"}


def parse_dockerfile(path: Path) -> list[tuple[str, str]]:
    """(instruction, arguments) per logical line; ValueError on anything Docker would reject."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        word, _, rest = line.partition(" ")
        if word.upper() not in INSTRUCTIONS or word != word.upper():
            raise ValueError(f"{path.name}: unknown instruction {word!r}")
        out.append((word, rest.strip()))
    if pending:
        raise ValueError(f"{path.name}: dangling line continuation")
    first = next(i for i, _ in out if i != "ARG")
    if first != "FROM":
        raise ValueError(f"{path.name}: must start with FROM")
    for ins, rest in out:
        if ins in ("CMD", "ENTRYPOINT"):
            json.loads(rest)  # exec form only: signals reach python, not a shell
        if ins == "COPY":
            for src in rest.split()[:-1]:
                if not (ROOT / src).exists():
                    raise ValueError(f"{path.name}: COPY of missing {src}")
    return out


def test_trainer_image_runs_the_trainer_and_nothing_else() -> None:
    steps = parse_dockerfile(ROOT / "docker" / "trainer.Dockerfile")
    assert ("ENTRYPOINT", '["python", "-m", "trainer"]') in steps
    text = " ".join(rest for _, rest in steps)
    for forbidden in ("dagster", "pyiceberg", "factory/", "sensors/", "assets/"):
        assert forbidden not in text, forbidden
    assert any(i == "USER" for i, _ in steps)


def test_factory_image_serves_the_code_location() -> None:
    steps = parse_dockerfile(ROOT / "docker" / "factory.Dockerfile")
    cmd = json.loads(next(rest for i, rest in steps if i == "CMD"))
    assert cmd[:3] == ["dagster", "api", "grpc"] and cmd[-2:] == ["-m", "factory.definitions"]


def test_bad_dockerfile_is_rejected(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text("RUN echo hi\n")
    with pytest.raises(ValueError, match="FROM"):
        parse_dockerfile(bad)
    bad.write_text("FROM x\nCOPY nothing-here/ /app\n")
    with pytest.raises(ValueError, match="missing"):
        parse_dockerfile(bad)


def test_helm_values_render_to_the_expected_job_spec(make_job, monkeypatch) -> None:
    from factory.definitions import build_resources

    values = yaml.safe_load((ROOT / "deploy" / "helm" / "values.yaml").read_text())
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    launcher = values["runLauncher"]["config"]["k8sRunLauncher"]
    [dep] = values["dagster-user-deployments"]["deployments"]
    assert dep["dagsterApiGrpcArgs"] == ["-m", "factory.definitions"]
    env = {e["name"]: e["value"] for e in dep["env"]}
    monkeypatch.setenv("FACTORY_PROVIDERS", env["FACTORY_PROVIDERS"])
    resource = build_resources()["provider"]
    ladder = resource.ladder()
    assert [p.name for p in ladder] == ["kubernetes"]
    kube = ladder[0]
    assert isinstance(kube, KubernetesProvider)
    assert kube.namespace == launcher["jobNamespace"]
    spec = k.ApiClient().sanitize_for_serialization(
        kube.build_job(make_job("r1"), segment_id="r1-s000", num_gpus=1))
    pod = spec["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["image"] == "ghcr.io/example/factory-trainer:0.1.0"
    assert c["command"] == ["python", "-m", "trainer"]
    assert c["args"] == ["--job", "/etc/factory/job.json"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"] == [{"key": "nvidia.com/gpu", "operator": "Exists",
                                   "effect": "NoSchedule"}]
    assert pod["serviceAccountName"] == "factory-trainer"
    assert pod["priorityClassName"] == "factory-trainer"
    assert pod["preemptionPolicy"] == "PreemptLowerPriority"
    secret_refs = {e["valueFrom"]["secretKeyRef"]["name"] for e in c["env"] if "valueFrom" in e}
    assert secret_refs <= {s["name"] for s in dep["envSecrets"]}
    # The webhook secret the trainers sign with comes from the same Kubernetes secret.
    assert resource.webhook_secret_env == "FACTORY_WEBHOOK_SECRET"
    assert {"FACTORY_WEBHOOK_SECRET"} <= {e["name"] for e in c["env"]}
