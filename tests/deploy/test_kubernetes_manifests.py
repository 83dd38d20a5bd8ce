"""The installable deployment, checked without a cluster: ``deploy/k8s`` (the factory's own
objects) rendered and validated against the Kubernetes API schema, ``deploy/helm/values.yaml``
checked against the documented values of Dagster's chart, the two wired to each other, and the
Jobs that run on it (a run worker from dagster-k8s's ``K8sRunLauncher``, a trainer from
``KubernetesProvider``) and the deployed models' objects (``KubernetesHost``, configured as
``deploy/README.md`` shows) valid against the schema.

Neither Helm nor Dagster's chart can be fetched here: the factory's manifests are plain
Kustomize, rendered by ``render`` below and, where ``kubectl`` exists, by ``kubectl kustomize``
too (the two must agree).
"""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml

from factory.control.providers import KubernetesProvider
from factory.gateway.app import TRAINER_EVENTS_PATH
from factory.resources.providers import ProviderResource
from factory.trainer.config import TrainerJob
from tests.kube_schema import assert_valid, model_errors

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "deploy" / "k8s"
VALUES = ROOT / "deploy" / "helm" / "values.yaml"
CLUSTER_SCOPED = {"Namespace", "PriorityClass"}


# --- rendering ----------------------------------------------------------------------------------

def _env_file(path: Path) -> dict[str, str]:
    pairs = [line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.startswith("#")]
    return {key: value for key, value in pairs}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` prints, for the features ``deploy/k8s`` uses:
    resources, a namespace, and Secrets generated from env files without a name hash."""
    kustomization = yaml.safe_load((folder / "kustomization.yaml").read_text())
    assert set(kustomization) <= {"apiVersion", "kind", "namespace", "resources",
                                  "generatorOptions", "secretGenerator"}, "render: new feature"
    assert kustomization["generatorOptions"] == {"disableNameSuffixHash": True}
    objects = [doc for name in kustomization["resources"]
               for doc in yaml.safe_load_all((folder / name).read_text()) if doc]
    for gen in kustomization["secretGenerator"]:
        data = {key: base64.b64encode(value.encode()).decode()
                for env in gen["envs"] for key, value in _env_file(folder / env).items()}
        objects.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                        "type": "Opaque", "data": data})
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj["metadata"]["namespace"] = kustomization["namespace"]
    return objects


@pytest.fixture(scope="module")
def manifests(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """``deploy/k8s`` rendered with its example secrets (what an install copies and edits)."""
    folder = tmp_path_factory.mktemp("k8s") / "k8s"
    shutil.copytree(K8S, folder)
    for example in folder.glob("*.env.example"):
        shutil.copy(example, folder / example.name.removesuffix(".example"))
    return render(folder)


@pytest.fixture(scope="module")
def values() -> dict[str, Any]:
    loaded: dict[str, Any] = yaml.safe_load(VALUES.read_text())
    return loaded


def _find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    [found] = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    return found


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def test_manifests_are_valid_objects(manifests: list[dict[str, Any]]) -> None:
    kinds = sorted(_key(o) for o in manifests)
    assert kinds == sorted([
        ("Namespace", "factory"), ("PriorityClass", "factory-trainer"),
        ("PersistentVolumeClaim", "factory-shared"),
        ("PersistentVolumeClaim", "factory-gateway-home"),
        ("ServiceAccount", "factory-trainer"), ("Role", "factory-control-plane"),
        ("RoleBinding", "factory-control-plane"), ("Role", "factory-deployer"),
        ("RoleBinding", "factory-deployer"), ("Deployment", "factory-gateway"),
        ("Service", "factory-gateway"), ("Secret", "factory-secrets"),
        ("Secret", "factory-postgresql")])
    for obj in manifests:
        assert_valid(obj)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")
def test_kubectl_kustomize_renders_the_same(manifests: list[dict[str, Any]],
                                            tmp_path: Path) -> None:
    folder = tmp_path / "k8s"
    shutil.copytree(K8S, folder)
    for example in folder.glob("*.env.example"):
        shutil.copy(example, folder / example.name.removesuffix(".example"))
    out = subprocess.run(["kubectl", "kustomize", str(folder)], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    rendered = [doc for doc in yaml.safe_load_all(out) if doc]
    assert sorted(map(_decoded, rendered), key=_key) == sorted(map(_decoded, manifests), key=_key)


def _decoded(obj: dict[str, Any]) -> dict[str, Any]:
    """A Secret with its data decoded (kubectl wraps long base64 lines)."""
    if obj["kind"] != "Secret":
        return obj
    return {**obj, "data": {k: base64.b64decode(v).decode() for k, v in obj["data"].items()}}


# --- the Helm values ------------------------------------------------------------------------------

ENV: Any = [("V1EnvVar",)]
IMAGE = {"repository": str, "tag": str, "pullPolicy": str}
DOCUMENTED: dict[str, Any] = {
    "global": {"postgresqlSecretName": str, "dagsterHome": str, "serviceAccountName": str,
               "celeryConfigSecretName": str},
    "serviceAccount": {"create": bool, "name": str, "annotations": dict},
    "postgresql": {"image": IMAGE, "enabled": bool, "postgresqlHost": str,
                   "postgresqlUsername": str, "postgresqlPassword": str,
                   "postgresqlDatabase": str, "postgresqlParams": dict, "postgresqlScheme": str,
                   "service": {"port": int}},
    "generatePostgresqlPasswordSecret": bool,
    "dagster-user-deployments": {
        "enabled": bool, "enableSubchart": bool, "imagePullSecrets": list,
        "deployments": [{
            "name": str, "image": IMAGE, "dagsterApiGrpcArgs": [str], "codeServerArgs": [str],
            "includeConfigInLaunchedRuns": {"enabled": bool}, "deploymentNamespace": str,
            "port": int, "env": ENV, "envConfigMaps": [("V1ConfigMapEnvSource",)],
            "envSecrets": [("V1SecretEnvSource",)], "annotations": dict, "labels": dict,
            "nodeSelector": dict, "affinity": ("V1Affinity",),
            "tolerations": [("V1Toleration",)],
            "podSecurityContext": ("V1PodSecurityContext",),
            "securityContext": ("V1SecurityContext",),
            "resources": ("V1ResourceRequirements",), "livenessProbe": ("V1Probe",),
            "readinessProbe": ("V1Probe",), "startupProbe": ("V1Probe",),
            "volumeMounts": [("V1VolumeMount",)], "volumes": [("V1Volume",)],
            "schedulerName": str, "initContainers": [("V1Container",)],
            "sidecarContainers": [("V1Container",)]}]},
    "runLauncher": {
        "type": str,
        "config": {"k8sRunLauncher": {
            "image": IMAGE, "imagePullPolicy": str, "jobNamespace": str,
            "loadInclusterConfig": bool, "kubeconfigFile": str,
            "envConfigMaps": [("V1ConfigMapEnvSource",)],
            "envSecrets": [("V1SecretEnvSource",)], "envVars": [str],
            "volumeMounts": [("V1VolumeMount",)], "volumes": [("V1Volume",)], "labels": dict,
            "failPodOnRunFailure": bool, "resources": ("V1ResourceRequirements",),
            "schedulerName": str, "securityContext": ("V1SecurityContext",),
            "runK8sConfig": {"containerConfig": ("V1Container",),
                             "podSpecConfig": ("V1PodSpec",),
                             "podTemplateSpecMetadata": ("V1ObjectMeta",),
                             "jobSpecConfig": ("V1JobSpec",),
                             "jobMetadata": ("V1ObjectMeta",)}}}},
    "dagsterDaemon": {
        "enabled": bool, "image": IMAGE, "heartbeatTolerance": int, "env": ENV,
        "envConfigMaps": [("V1ConfigMapEnvSource",)], "envSecrets": [("V1SecretEnvSource",)],
        "resources": ("V1ResourceRequirements",), "runMonitoring": dict, "runRetries": dict,
        "runCoordinator": {"enabled": bool, "type": str, "config": {"queuedRunCoordinator": {
            "maxConcurrentRuns": int, "tagConcurrencyLimits": list,
            "dequeueIntervalSeconds": int, "dequeueNumWorkers": int,
            "dequeueUseThreads": bool}}}},
}
"""The keys of Dagster's chart (``helm/dagster/values.schema.json`` of dagster-io/dagster, its
``additionalProperties: false`` sections included) in the sections the factory sets, with their
types. Tuples name a Kubernetes model (``runK8sConfig``'s parts are partial objects: keys and
types are checked, not required fields)."""


def _walk(value: Any, spec: Any, path: str) -> list[str]:
    if isinstance(spec, tuple):
        return model_errors(value, spec[0], path)
    if isinstance(spec, list):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [e for i, v in enumerate(value) for e in _walk(v, spec[0], f"{path}[{i}]")] \
            if spec else []
    if isinstance(spec, dict):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        return [e for key, v in value.items()
                for e in (_walk(v, spec[key], f"{path}.{key}") if key in spec
                          else [f"{path}.{key}: not a documented value of the chart"])]
    ok = isinstance(value, spec) and not (spec is int and isinstance(value, bool))
    return [] if ok else [f"{path}: expected {spec.__name__}, got {value!r}"]


def test_values_keys_are_the_charts(values: dict[str, Any]) -> None:
    found = _walk(values, DOCUMENTED, "values")
    assert not found, "\n".join(found)
    assert values["runLauncher"]["type"] == "K8sRunLauncher"
    assert values["postgresql"]["enabled"] is False


def test_a_typo_in_the_values_is_caught(values: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(values))
    broken["dagster-user-deployments"]["deployments"][0]["volumeMount"] = []
    broken["runLauncher"]["config"]["k8sRunLauncher"]["runK8sConfig"]["jobSpecConfig"][
        "backofLimit"] = 0
    assert _walk(broken, DOCUMENTED, "values") == [
        "values.dagster-user-deployments.deployments[0].volumeMount: not a documented value of "
        "the chart",
        "values.runLauncher.config.k8sRunLauncher.runK8sConfig.jobSpecConfig.backofLimit: not a "
        "field of V1JobSpec"]


# --- wiring: values <-> manifests <-> providers ---------------------------------------------------

def _user_deployment(values: dict[str, Any]) -> dict[str, Any]:
    [deployment] = values["dagster-user-deployments"]["deployments"]
    return deployment  # type: ignore[no-any-return]


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["env"]}


def _kubernetes_rung(values: dict[str, Any], monkeypatch: pytest.MonkeyPatch
                     ) -> KubernetesProvider:
    for name, value in _env(_user_deployment(values)).items():
        if name.startswith("FACTORY_") and name != "FACTORY_PROVIDERS":
            monkeypatch.setenv(name, value)
    config = json.loads(_env(_user_deployment(values))["FACTORY_PROVIDERS"])
    [rung] = ProviderResource(**config).ladder()
    assert isinstance(rung, KubernetesProvider)
    return rung


def test_values_and_manifests_refer_to_each_other(
        values: dict[str, Any], manifests: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    deployment = _user_deployment(values)
    env = _env(deployment)
    config = json.loads(env["FACTORY_PROVIDERS"])
    rung = _kubernetes_rung(values, monkeypatch)
    # No rung runs trainers as processes in the code-location pod or a run worker.
    assert config["order"] == ["kubernetes"]

    # Trainer webhooks reach the gateway the manifests deploy.
    url = urlsplit(config["webhook_url"])
    service = _find(manifests, "Service", "factory-gateway")
    assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    assert url.port == service["spec"]["ports"][0]["port"] and url.path == TRAINER_EVENTS_PATH
    gateway = _find(manifests, "Deployment", "factory-gateway")["spec"]["template"]["spec"]
    [container] = gateway["containers"]
    assert container["command"][:2] == ["factory", "serve"]
    image = deployment["image"]
    assert container["image"] == f"{image['repository']}:{image['tag']}"
    assert str(service["spec"]["ports"][0]["port"]) in container["command"]

    # The priority class exists with the policy the trainer pods ask for.
    priority = _find(manifests, "PriorityClass", rung.priority_class or "")
    assert priority["preemptionPolicy"] == rung.preemption_policy

    # One shared volume, mounted at FACTORY_SHARED_DIR everywhere, readable from many nodes.
    claim = _find(manifests, "PersistentVolumeClaim", rung.shared_claim or "")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    [volume] = deployment["volumes"]
    [mount] = deployment["volumeMounts"]
    assert volume["persistentVolumeClaim"]["claimName"] == rung.shared_claim
    assert mount["mountPath"] == env["FACTORY_SHARED_DIR"]
    gateway_mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    gateway_claims = {v["name"]: v["persistentVolumeClaim"]["claimName"]
                      for v in gateway["volumes"]}
    assert gateway_claims["shared"] == rung.shared_claim
    assert gateway_mounts["shared"] == env["FACTORY_SHARED_DIR"]
    gateway_env = {e["name"]: e["value"] for e in container["env"]}
    for name in ("FACTORY_SHARED_DIR", "FACTORY_WAREHOUSE"):
        assert gateway_env[name] == env[name]

    # Secrets: the webhook key and the database URL for the factory, the password for Dagster.
    secrets = {o["metadata"]["name"]: set(o["data"]) for o in manifests if o["kind"] == "Secret"}
    assert {"FACTORY_WEBHOOK_SECRET", "FACTORY_DATABASE_URL"} <= secrets["factory-secrets"]
    assert [s["name"] for s in deployment["envSecrets"]] == ["factory-secrets"]
    assert container["envFrom"] == [{"secretRef": {"name": "factory-secrets"}}]
    for ref in rung.secrets:
        assert ref.key in secrets[ref.secret]
    assert secrets[values["global"]["postgresqlSecretName"]] == {"postgresql-password"}

    # Identities: the trainer's account exists; the chart's account may launch trainer Jobs.
    _find(manifests, "ServiceAccount", rung.service_account or "")
    binding = _find(manifests, "RoleBinding", "factory-control-plane")
    assert binding["subjects"][0]["name"] == values["serviceAccount"]["name"] \
        == values["global"]["serviceAccountName"]
    # The filled-in secret files stay out of git.
    assert (K8S / ".gitignore").read_text().split() == ["secrets.env", "postgresql.env"]


def test_trainer_job_from_the_values_is_valid(values: dict[str, Any], tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    from kubernetes import client as k

    rung = _kubernetes_rung(values, monkeypatch)
    data = tmp_path / "data.parquet"
    data.write_bytes(b"")
    plan = {"base_model": "org/model", "max_seq_len": 256, "micro_batch_size": 2,
            "grad_accum_steps": 2, "learning_rate": 3e-3, "warmup_steps": 2, "num_steps": 10,
            "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.1, "checkpoint_every_steps": 2}
    job = TrainerJob.from_dict({"run_id": "r1", "plan": plan,
                         "data_files": [str(data)], "output_dir": "s3://bucket/r1",
                         "events_file": str(tmp_path / "events.jsonl"),
                         "tracker": {"backend": "none"}})
    job = k.ApiClient().sanitize_for_serialization(
        rung.build_job(job, segment_id="r1-s000", num_gpus=8))
    assert_valid(job)
    pod = job["spec"]["template"]["spec"]
    assert pod["priorityClassName"] == "factory-trainer"
    assert pod["serviceAccountName"] == "factory-trainer"
    assert {"name": "shared", "mountPath": "/mnt/factory-shared"} \
        in pod["containers"][0]["volumeMounts"]


# --- the run worker Job dagster-k8s creates ------------------------------------------------------

class _ApiServer(BaseHTTPRequestHandler):
    posted: list[tuple[str, dict[str, Any]]] = []

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        self.posted.append((self.path, body))
        body.setdefault("metadata", {})["uid"] = "uid-1"
        raw = json.dumps(body).encode()
        self.send_response(201)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def log_message(self, *args: object) -> None:
        pass


_SNAKE = {"containerConfig": "container_config", "podSpecConfig": "pod_spec_config",
          "podTemplateSpecMetadata": "pod_template_spec_metadata",
          "jobSpecConfig": "job_spec_config", "jobMetadata": "job_metadata"}
"""``runK8sConfig``'s keys as the chart writes them into the instance's run launcher config."""


def test_run_worker_job_from_the_values(values: dict[str, Any], tmp_path: Path) -> None:
    """``K8sRunLauncher`` configured as the chart configures it from these values launches a
    run of the factory's code location against a fake API server; the Job it posts is valid and
    carries the user deployment's env, secrets and shared volume."""
    import dagster as dg
    from dagster._core.code_pointer import ModuleCodePointer
    from dagster._core.launcher import LaunchRunContext
    from dagster._core.origin import JobPythonOrigin, RepositoryPythonOrigin
    from dagster_k8s import K8sRunLauncher

    deployment = _user_deployment(values)
    launcher_values = values["runLauncher"]["config"]["k8sRunLauncher"]
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ApiServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "fake",
        "clusters": [{"name": "fake", "cluster": {
            "server": f"http://127.0.0.1:{server.server_address[1]}"}}],
        "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake"}}],
        "users": [{"name": "fake", "user": {"token": "t"}}]}))
    try:
        with dg.instance_for_test() as instance:
            launcher = K8sRunLauncher(
                service_account_name=values["serviceAccount"]["name"],
                instance_config_map="factory-dagster-instance",
                postgres_password_secret=values["global"]["postgresqlSecretName"],
                dagster_home="/opt/dagster/dagster_home", load_incluster_config=False,
                kubeconfig_file=str(kubeconfig), job_namespace=launcher_values["jobNamespace"],
                run_k8s_config={_SNAKE[key]: part
                                 for key, part in launcher_values["runK8sConfig"].items()})
            launcher.register_instance(instance)
            # includeConfigInLaunchedRuns: the chart hands the code location's env, secrets
            # and volumes to its runs as the repository origin's container context.
            origin = JobPythonOrigin("__ASSET_JOB", RepositoryPythonOrigin(
                executable_path="/usr/local/bin/python",
                code_pointer=ModuleCodePointer("factory.definitions", "defs", None),
                container_image="ghcr.io/example/factory:0.1.0",
                container_context={"k8s": {
                    "env": deployment["env"],
                    "env_secrets": [s["name"] for s in deployment["envSecrets"]],
                    "volumes": deployment["volumes"],
                    "volume_mounts": deployment["volumeMounts"]}}))
            run = instance.add_run(dg.DagsterRun(job_name="__ASSET_JOB", job_code_origin=origin))
            launcher.launch_run(LaunchRunContext(dagster_run=run, workspace=None))
    finally:
        server.shutdown()
        server.server_close()
    [(path, job)] = _ApiServer.posted
    assert path == "/apis/batch/v1/namespaces/factory/jobs"
    assert_valid(job)
    pod = job["spec"]["template"]["spec"]
    [container] = pod["containers"]
    assert container["image"] == "ghcr.io/example/factory:0.1.0"
    assert pod["serviceAccountName"] == "factory-dagster"
    assert job["spec"]["backoffLimit"] == 0
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["FACTORY_SHARED_DIR"] == "/mnt/factory-shared"
    assert json.loads(env["FACTORY_PROVIDERS"])["order"] == ["kubernetes"]
    assert {"secretRef": {"name": "factory-secrets"}} in container["envFrom"]
    assert {"name": "shared", "mountPath": "/mnt/factory-shared"} in container["volumeMounts"]
    assert container["resources"]["limits"]["memory"] == "8Gi"


# --- deployed models: the deployer configured as deploy/README.md shows ---------------------------

def _readme_deployer_config() -> dict[str, Any]:
    """The ``FACTORY_DEPLOYER`` example of ``deploy/README.md``."""
    import re

    blocks = re.findall(r"```json\n(.*?)\n```", (ROOT / "deploy" / "README.md").read_text(),
                        re.S)
    [example] = [json.loads(b) for b in blocks if '"api_server"' in b]
    return example  # type: ignore[no-any-return]


def test_deployed_models_from_the_readme_are_valid_and_wired(
        values: dict[str, Any], manifests: list[dict[str, Any]],
        monkeypatch: pytest.MonkeyPatch) -> None:
    from datetime import UTC, datetime

    from kubernetes import client as k

    from factory.definitions import build_resources
    from factory.deploy.hosts import ServerSpec
    from factory.deploy.kubernetes import KubernetesHost
    from factory.inference import ServeSizing
    from factory.resources.deployer import KubernetesCPUDeployerResource

    deployment = _user_deployment(values)
    env = _env(deployment)
    monkeypatch.setenv("FACTORY_SHARED_DIR", env["FACTORY_SHARED_DIR"])
    # the values deploy models on the cluster, configured as the README shows
    assert json.loads(env["FACTORY_DEPLOYER"]) == _readme_deployer_config()
    monkeypatch.setenv("FACTORY_DEPLOYER", env["FACTORY_DEPLOYER"])
    resource = build_resources("embedded")["deployer"]
    assert isinstance(resource, KubernetesCPUDeployerResource)
    host = resource.host()
    assert isinstance(host, KubernetesHost)

    # The CPU server runs from the code location's own image, in the manifests' namespace, off
    # the shared claim the trainer writes checkpoints to.
    image = deployment["image"]
    assert host.image == f"{image['repository']}:{image['tag']}"
    assert host.namespace == _find(manifests, "Namespace", "factory")["metadata"]["name"]
    assert host.shared_claim == _kubernetes_rung(values, monkeypatch).shared_claim
    _find(manifests, "PersistentVolumeClaim", host.shared_claim or "")
    shared = env["FACTORY_SHARED_DIR"]
    spec = ServerSpec(name="support_bot", version="v3", adapter="support_bot-v3",
                      checkpoint=f"{shared}/runs/r1/checkpoints/step-100",
                      base_model=f"{shared}/models/smollm2-135m-instruct",
                      backend="transformers", sizing=ServeSizing(), started_at=datetime.now(UTC))
    built, service, config_map = host.build(spec, suffix="0a1b2c")
    assert config_map is None
    for obj in (built, service):
        assert_valid(k.ApiClient().sanitize_for_serialization(obj))
    pod = k.ApiClient().sanitize_for_serialization(built)["spec"]["template"]["spec"]
    assert {"name": "shared", "mountPath": shared} in pod["containers"][0]["volumeMounts"]

    # The chart's account (code location and run workers) may manage them.
    binding = _find(manifests, "RoleBinding", "factory-deployer")
    assert binding["roleRef"]["name"] == _find(manifests, "Role", "factory-deployer")[
        "metadata"]["name"]
    assert binding["subjects"][0]["name"] == values["serviceAccount"]["name"]
