"""Deployments on Kubernetes, followed through a fake API server on 127.0.0.1 that keeps the
objects posted to it and reports the status a test sets: one engine (a Deployment and a
Service) per base model whose versions are adapters published on the shared volume (the
default), and a Deployment and Service per version (``share=False``).

The deployer, the lake, the gateway routes and the adapter folder are the real ones; only the
cluster is a stand-in. Its service proxy answers a completion the way the engine's resolver
would (``factory.inference.resolver.find`` on the folder and ``--model`` the Deployment names),
or forwards it to a real CPU server (``engine_url``). Tests wait on the fake's state (an object
created, a status read), never on the clock.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest
import yaml

from factory.control.providers import SecretEnv
from factory.deploy import DeployConfig, Deployer, Deployment, DeploymentError
from factory.deploy.hosts import engine_key
from factory.deploy.kubernetes import KubernetesHost, object_name
from factory.gateway import load_routes
from factory.inference import InferenceServer
from factory.inference.resolver import RESOLVER_DIR_ENV, find, published, resolver_env
from factory.inference.vllm import VLLM_ENV
from factory.lake import Lake
from tests.inference.conftest import make_adapter
from tests.kube_schema import assert_valid

ROOT = Path(__file__).resolve().parents[2]
PROXY = re.compile(r"^/api/v1/namespaces/([^/]+)/services/([^/:]+):http/proxy(/.*)$")
PATH = re.compile(r"^/(api/v1|apis/apps/v1)/namespaces/([^/]+)/([a-z]+)(?:/([^/]+))?(?:/([a-z]+))?$")
GROUPS = {"api/v1": "", "apis/apps/v1": "apps"}


# --- the fake API server ------------------------------------------------------------------------

class FakeCluster:
    """Objects by (resource, name); a Deployment has an available replica once its name is in
    ``available`` (or at once with ``auto_ready``); pods come from ``pods_for(object name)``.
    Every call is recorded (``calls``, ``bodies``)."""

    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str, str]] = []  # method, group, resource, name
        self.bodies: list[dict[str, Any]] = []  # of each call
        self.status_reads: dict[str, int] = {}
        self.available: set[str] = set()
        self.auto_ready = False
        self.pods_for: Callable[[str], list[dict[str, Any]]] = lambda obj: []
        self.log = ""
        """Every pod's log."""
        self.refuse: set[str] = set()
        """Adapters an engine finds and cannot load (its proxy answers 400)."""
        self.engine_url: str | None = None
        """A real server the service proxy forwards to (None: it answers as the resolver)."""
        self.changed = threading.Condition()
        self.url = ""

    def wait_for(self, predicate: Callable[[], bool]) -> None:
        with self.changed:
            assert self.changed.wait_for(predicate, timeout=60), "the fake cluster never got there"

    def names(self, resource: str) -> set[str]:
        with self.changed:
            return {name for (r, name) in self.objects if r == resource}

    def created(self, resource: str) -> list[dict[str, Any]]:
        """Bodies posted for ``resource``, oldest first (deleted ones too)."""
        with self.changed:
            return [body for (method, _, r, _), body in zip(self.calls, self.bodies, strict=True)
                    if method == "POST" and r == resource]


def _handler(cluster: FakeCluster) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def _reply(self, body: Any, code: int = 200, content_type: str = "application/json"
                   ) -> None:
            raw = body.encode() if isinstance(body, str) else json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(raw)))
            self.end_headers()
            self.wfile.write(raw)

        def _not_found(self, resource: str, name: str) -> None:
            self._reply({"kind": "Status", "apiVersion": "v1", "status": "Failure",
                         "reason": "NotFound", "code": 404,
                         "message": f'{resource} "{name}" not found'}, 404)

        def _route(self, method: str) -> tuple[str, str, str, str, dict[str, Any]]:
            parts = urlsplit(self.path)
            m = PATH.match(parts.path)
            assert m, f"unexpected path {self.path}"
            group, _, resource, name, sub = m.groups()
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            full = f"{resource}/{sub}" if sub else resource
            with cluster.changed:
                cluster.calls.append((method, GROUPS[group], full, name or ""))
                cluster.bodies.append(body)
                cluster.changed.notify_all()
            return resource, name or "", sub or "", parts.query, body

        def _proxy(self, m: re.Match[str]) -> None:
            """A request to a Service through the API server: forwarded to ``engine_url``, or
            answered as the engine's resolver would (503 while its Deployment has no ready
            replica)."""
            namespace, service, path = m.groups()
            n = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(n)) if n else {}
            with cluster.changed:
                cluster.calls.append(("POST", "", "services/proxy", service))
                cluster.bodies.append(body)
                cluster.changed.notify_all()
                deployment = cluster.objects.get(("deployments", service))
                ready = service in cluster.available
            if cluster.engine_url is not None:
                r = httpx.post(cluster.engine_url + path, json=body, timeout=120)
                self._reply(r.text, r.status_code)
                return
            if deployment is None or not ready:
                self._reply({"kind": "Status", "code": 503, "message": "no endpoints available"},
                            503)
                return
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            env = {e["name"]: e.get("value") for e in container.get("env") or []}
            model = body.get("model", "")
            if model in cluster.refuse:
                self._reply({"error": {"message": f"cannot load {model}"}}, 400)
            elif find(env.get(RESOLVER_DIR_ENV) or "/nonexistent", model,
                      _model_of(container["command"])):
                self._reply({"object": "text_completion", "model": model,
                             "choices": [{"index": 0, "text": "k"}]})
            else:
                self._reply({"error": {"message": f"The model `{model}` does not exist."}}, 404)

        def do_POST(self) -> None:  # noqa: N802
            proxied = PROXY.match(urlsplit(self.path).path)
            if proxied:
                self._proxy(proxied)
                return
            resource, _, _, _, body = self._route("POST")
            name = body["metadata"]["name"]
            with cluster.changed:
                if (resource, name) in cluster.objects:
                    self._reply({"kind": "Status", "code": 409, "reason": "AlreadyExists",
                                 "message": f'{resource} "{name}" already exists'}, 409)
                    return
                body["metadata"]["uid"] = f"uid-{name}"
                cluster.objects[(resource, name)] = body
                if resource == "deployments" and cluster.auto_ready:
                    cluster.available.add(name)
                cluster.changed.notify_all()
            self._reply(body, 201)

        def do_GET(self) -> None:  # noqa: N802
            resource, name, sub, query, _ = self._route("GET")
            if resource == "pods" and sub == "log":
                self._reply(cluster.log, content_type="text/plain")
                return
            if resource == "pods":
                selector = parse_qs(query)["labelSelector"][0]
                self._reply({"kind": "PodList", "items": cluster.pods_for(selector.split("=")[1])})
                return
            with cluster.changed:
                obj = cluster.objects.get((resource, name))
                if sub == "status" and obj is not None:
                    cluster.status_reads[name] = cluster.status_reads.get(name, 0) + 1
                    cluster.changed.notify_all()
                    ready = name in cluster.available
                    obj = {**obj, "status": {"replicas": 1, "unavailableReplicas": 0 if ready else 1,
                                             **({"availableReplicas": 1, "readyReplicas": 1}
                                                if ready else {})}}
            if obj is None:
                self._not_found(resource, name)
            else:
                self._reply(obj)

        def do_DELETE(self) -> None:  # noqa: N802
            resource, name, _, _, _ = self._route("DELETE")
            with cluster.changed:
                gone = cluster.objects.pop((resource, name), None)
                cluster.changed.notify_all()
            if gone is None:
                self._not_found(resource, name)
            else:
                self._reply({"kind": "Status", "status": "Success"})

        def log_message(self, *args: object) -> None:
            pass

    return Handler


def _model_of(argv: list[str]) -> str:
    """The base model a server's argv serves: ``vllm serve MODEL``, ``... -m
    factory.inference MODEL``."""
    if argv[:2] == ["vllm", "serve"]:
        return argv[2]
    return argv[argv.index("factory.inference") + 1]


@pytest.fixture()
def cluster() -> Iterator[FakeCluster]:
    fake = FakeCluster()
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _handler(fake))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    fake.url = f"http://127.0.0.1:{srv.server_address[1]}"
    try:
        yield fake
    finally:
        srv.shutdown()
        srv.server_close()


# --- a factory whose checkpoints are on the shared volume -----------------------------------------

@dataclass
class Setup:
    shared: Path
    base: Path
    checkpoints: list[Path]


@pytest.fixture()
def setup(factory_home: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Setup:
    shared = tmp_path / "shared"
    monkeypatch.setenv("FACTORY_SHARED_DIR", str(shared))
    base = shared / "models" / "base"
    base.mkdir(parents=True)
    checkpoints = []
    for step in (2, 4):
        ckpt = shared / "runs" / "r1" / f"step-{step}"
        ckpt.mkdir(parents=True)
        (ckpt / "adapter_config.json").write_text(
            json.dumps({"base_model_name_or_path": str(base)}))
        checkpoints.append(ckpt)
    Lake().existing_tables()
    return Setup(shared=shared, base=base, checkpoints=checkpoints)


def _host(cluster: FakeCluster, **changes: Any) -> KubernetesHost:
    values: dict[str, Any] = {
        "api_server": cluster.url, "image": "ghcr.io/example/factory:1", "namespace": "ml",
        "node_selector": {"pool": "serving"},
        "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        "secrets": [SecretEnv(env="HF_TOKEN", secret="hub", key="token")],
        "shared_claim": "factory-shared", "poll_s": 0.02}
    return KubernetesHost(**{**values, **changes})


def _deployer(cluster: FakeCluster, *, share: bool = True, **config: Any) -> Deployer:
    cfg = DeployConfig(**{"drain_s": 0.0, "startup_timeout_s": 60.0, **config})
    return Deployer(config=cfg, host=_host(cluster, share=share))


def _rows(name: str = "exp") -> dict[str, Deployment]:
    return {d.version: d for d in Deployer().versions(name)}


def _obj(dep: Deployment) -> str:
    return dep.log_path.rsplit("/", 1)[1]


# --- tests ----------------------------------------------------------------------------------------

def test_deploy_waits_for_an_available_replica_then_routes_to_the_service(
        cluster: FakeCluster, setup: Setup) -> None:
    deployer = _deployer(cluster, share=False)
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(deployer.deploy, "exp", str(setup.checkpoints[0]))
        cluster.wait_for(lambda: bool(cluster.names("deployments")))
        [obj] = cluster.names("deployments")
        cluster.wait_for(lambda: cluster.status_reads.get(obj, 0) >= 2)
        # Polled twice and not available: recorded as starting, the route not moved.
        assert _rows()["v1"].status == "starting"
        assert "factory/exp" not in load_routes(Lake())
        with cluster.changed:
            cluster.available.add(obj)
            cluster.changed.notify_all()
        dep = future.result(timeout=60)

    assert dep.status == "live" and dep.version == "v1" and dep.pid is None
    assert dep.endpoint == f"http://{obj}.ml.svc:8000/v1" and dep.port == 8000
    assert dep.log_path == f"kubernetes://ml/{obj}"
    assert _rows()["v1"].status == "live"
    route = load_routes(Lake())["factory/exp"]
    assert (route.base_url, route.deployment, route.version) == (dep.endpoint, "exp-v1", "v1")

    [deployment] = cluster.created("deployments")
    [service] = cluster.created("services")
    assert cluster.created("configmaps") == []  # the CPU server needs no template file
    assert_valid(deployment)
    assert_valid(service)
    labels = {"app.kubernetes.io/name": "factory-inference", "app.kubernetes.io/instance": obj,
              "factory/deployment": "exp", "factory/version": "v1"}
    assert deployment["metadata"]["labels"] == labels
    assert service["metadata"]["labels"] == labels
    assert deployment["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/instance": obj}
    assert service["spec"]["selector"] == {"app.kubernetes.io/instance": obj}
    assert service["spec"]["ports"] == [{"name": "http", "port": 8000, "targetPort": "http"}]
    assert service["metadata"]["ownerReferences"][0] == {
        "apiVersion": "apps/v1", "kind": "Deployment", "name": obj, "uid": f"uid-{obj}",
        "controller": True}
    pod = deployment["spec"]["template"]["spec"]
    [c] = pod["containers"]
    # The same argv the evals' and the local deployments' servers run, on the pod's interface.
    assert deployer.serving_size is not None
    assert c["command"] == InferenceServer(
        str(setup.base), adapters={"exp-v1": str(setup.checkpoints[0])},
        served_model_name="exp-base", sizing=deployer.serving_size.sizing, host="0.0.0.0",
        port=8000).command()
    assert c["image"] == "ghcr.io/example/factory:1"
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert "nvidia.com/gpu" not in c["resources"]["limits"]
    assert {"name": "shared", "mountPath": str(setup.shared)} in c["volumeMounts"]
    assert pod["volumes"] == [{"name": "shared",
                               "persistentVolumeClaim": {"claimName": "factory-shared"}}]
    assert pod["nodeSelector"] == {"pool": "serving"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["automountServiceAccountToken"] is False
    assert pod["terminationGracePeriodSeconds"] == 120
    assert c["env"] == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {
        "name": "hub", "key": "token"}}}]


def test_a_new_version_retires_the_old_ones_objects_and_rollback_and_undeploy_work(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = _deployer(cluster, share=False)
    v1 = deployer.deploy("exp", str(setup.checkpoints[0]))
    v2 = deployer.deploy("exp", str(setup.checkpoints[1]))
    rows = _rows()
    assert (rows["v1"].status, rows["v2"].status) == ("stopped", "live")
    assert rows["v1"].reason == "replaced by v2"
    assert cluster.names("deployments") == cluster.names("services") == {_obj(v2)}
    assert ("DELETE", "apps", "deployments", _obj(v1)) in cluster.calls
    assert ("DELETE", "", "services", _obj(v1)) in cluster.calls
    assert load_routes(Lake())["factory/exp"].base_url == v2.endpoint

    # A rollback serves v1's checkpoint again under its tag, in objects of its own.
    back = deployer.rollback("exp")
    assert (back.version, back.checkpoint, back.status) == ("v1", v1.checkpoint, "live")
    assert _obj(back) != _obj(v1) and cluster.names("deployments") == {_obj(back)}
    assert _rows()["v2"].status == "stopped"
    assert load_routes(Lake())["factory/exp"].base_url == back.endpoint

    gone = deployer.undeploy("exp")
    assert (gone.version, gone.status) == ("v1", "stopped")
    assert "factory/exp" not in load_routes(Lake())
    assert cluster.names("deployments") == cluster.names("services") == set()


def test_a_candidate_serves_beside_the_live_version_until_promoted(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = _deployer(cluster, share=False)
    live = deployer.deploy("exp", str(setup.checkpoints[0]))
    candidate = deployer.deploy("exp", str(setup.checkpoints[1]), candidate=True)
    assert candidate.status == "candidate"
    assert cluster.names("deployments") == {_obj(live), _obj(candidate)}
    assert load_routes(Lake())["factory/exp"].base_url == live.endpoint
    promoted = deployer.promote("exp")
    assert (promoted.version, promoted.status) == ("v2", "live")
    assert cluster.names("deployments") == cluster.names("services") == {_obj(candidate)}
    assert load_routes(Lake())["factory/exp"].base_url == candidate.endpoint
    # A candidate whose objects are gone is not promoted.
    again = deployer.deploy("exp", str(setup.checkpoints[0]), candidate=True)
    with cluster.changed:
        cluster.objects.pop(("deployments", _obj(again)))
    with pytest.raises(DeploymentError, match=f"candidate exp v3 is not running "
                                              f"\\(kubernetes://ml/{_obj(again)}\\)"):
        deployer.promote("exp")


def test_a_version_that_never_gets_ready_fails_with_the_pods_status(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    live = _deployer(cluster, share=False).deploy("exp", str(setup.checkpoints[0]))
    cluster.auto_ready = False
    cluster.pods_for = lambda obj: [] if obj == _obj(live) else [{
        "metadata": {"name": f"{obj}-7d9f-x2"},
        "status": {"phase": "Pending", "conditions": [{
            "type": "PodScheduled", "status": "False", "reason": "Unschedulable",
            "message": "0/3 nodes are available: 3 Insufficient nvidia.com/gpu."}]}}]
    with pytest.raises(DeploymentError, match="was not ready after 1 s") as err:
        _deployer(cluster, share=False, startup_timeout_s=1.0).deploy(
            "exp", str(setup.checkpoints[1]))
    assert "PodScheduled=False Unschedulable: 0/3 nodes are available: 3 Insufficient " \
           "nvidia.com/gpu." in str(err.value)
    rows = _rows()
    assert rows["v2"].status == "failed" and "Insufficient nvidia.com/gpu" in (
        rows["v2"].reason or "")
    # Its objects are deleted; the live version keeps its objects and the route.
    assert cluster.names("deployments") == cluster.names("services") == {_obj(live)}
    assert rows["v1"].status == "live"
    assert load_routes(Lake())["factory/exp"].base_url == live.endpoint


def test_a_crash_looping_server_fails_at_once_with_its_log(cluster: FakeCluster,
                                                          setup: Setup) -> None:
    def crashing(obj: str) -> list[dict[str, Any]]:
        return [{"metadata": {"name": f"{obj}-abc"}, "status": {
            "phase": "Running", "containerStatuses": [{
                "name": "server", "image": "i", "imageID": "", "ready": False,
                "restartCount": 3,
                "state": {"waiting": {"reason": "CrashLoopBackOff",
                                      "message": "back-off 40s restarting failed container"}},
                "lastState": {"terminated": {"exitCode": 2, "reason": "Error"}}}]}}]

    cluster.pods_for = crashing
    cluster.log = "--lora-modules: adapter exp-v1: no such directory\n"
    # The startup timeout is ten minutes: only the pod's state can end this deploy.
    with pytest.raises(DeploymentError, match=r"cannot start \(CrashLoopBackOff\)") as err:
        _deployer(cluster, share=False, startup_timeout_s=600.0).deploy(
            "exp", str(setup.checkpoints[0]))
    text = str(err.value)
    assert "exited 2 (Error), 3 restart(s)" in text
    assert "--lora-modules: adapter exp-v1: no such directory" in text
    [log_call] = [c for c in cluster.calls if c[2] == "pods/log"]
    assert log_call[0] == "GET"
    assert _rows()["v1"].status == "failed"
    assert cluster.names("deployments") == cluster.names("services") == set()


def test_vllm_servers_get_gpus_and_their_chat_template(cluster: FakeCluster,
                                                       setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = Deployer(config=DeployConfig(backend="vllm", drain_s=0.0,
                                            overrides={"tensor_parallel_size": 2}),
                        host=_host(cluster, share=False))
    dep = deployer.deploy("exp", str(setup.checkpoints[0]))
    [deployment] = cluster.created("deployments")
    [config_map] = cluster.created("configmaps")
    assert_valid(deployment)
    assert_valid(config_map)
    pod = deployment["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert c["command"][:3] == ["vllm", "serve", str(setup.base)]
    assert c["command"][c["command"].index("--tensor-parallel-size") + 1] == "2"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["requests"]["nvidia.com/gpu"] == "2"
    for key, value in VLLM_ENV.items():
        assert {"name": key, "value": value} in c["env"]
    # The template file the argv names is in the ConfigMap, mounted where the argv looks.
    template = Path(c["command"][c["command"].index("--chat-template") + 1])
    assert config_map["data"] == {template.name: template.read_text()}
    assert config_map["metadata"]["ownerReferences"][0]["name"] == _obj(dep)
    assert {"name": "chat-template", "mountPath": str(template.parent), "readOnly": True} \
        in c["volumeMounts"]
    assert {"name": "chat-template", "configMap": {"name": _obj(dep)}} in pod["volumes"]
    deployer.undeploy("exp")
    assert cluster.names("configmaps") == set()


def test_a_checkpoint_off_the_shared_volume_is_refused_before_anything_is_created(
        cluster: FakeCluster, setup: Setup, tmp_path: Path) -> None:
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(setup.base)}))
    with pytest.raises(DeploymentError, match="is not on the shared volume"):
        _deployer(cluster).deploy("exp", str(outside))
    assert cluster.calls == [] and _rows() == {}


def test_an_api_server_that_cannot_be_reached_is_a_clear_error(setup: Setup) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = KubernetesHost(api_server=f"http://127.0.0.1:{port}", image="i",
                          shared_claim="factory-shared", share=False)
    with pytest.raises(DeploymentError, match="creating Deployment inference-exp-v1-.*: the "
                                              "Kubernetes API cannot be reached"):
        Deployer(config=DeployConfig(drain_s=0.0), host=host).deploy(
            "exp", str(setup.checkpoints[0]))
    assert _rows() == {}


def test_a_local_deployer_refuses_to_retire_a_version_on_the_cluster(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    live = _deployer(cluster).deploy("exp", str(setup.checkpoints[0]))
    with pytest.raises(DeploymentError, match="runs on Kubernetes .*act on it with a deployer "
                                              "configured for it"):
        Deployer(config=DeployConfig(drain_s=0.0)).undeploy("exp")
    assert _rows()["v1"].status == "live" and cluster.names("deployments") == {_obj(live)}
    assert load_routes(Lake())["factory/exp"].base_url == live.endpoint


# --- one engine per base model ------------------------------------------------------------------

def _folder(setup: Setup, backend: str = "transformers") -> Path:
    return _host_folder(engine_key(str(setup.base), backend))


def _host_folder(engine: str) -> Path:
    return KubernetesHost(api_server="http://unused", image="i",
                          shared_claim="factory-shared").adapter_folder(engine)


def test_versions_of_every_deployment_on_one_base_are_adapters_of_one_engine(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = _deployer(cluster)
    v1 = deployer.deploy("exp", str(setup.checkpoints[0]))
    [obj] = cluster.names("deployments")
    engine = engine_key(str(setup.base), "transformers")
    assert obj.startswith("inference-transformers-base-") and len(obj) <= 63
    assert (v1.engine, _obj(v1), v1.endpoint) == (engine, obj, f"http://{obj}.ml.svc:8000/v1")
    folder = _folder(setup)
    assert str(folder).startswith(str(setup.shared))  # on the volume every replica mounts
    assert published(folder) == ["exp-v1"]
    # The route names the adapter; the engine answered for it through the service proxy first.
    route = load_routes(Lake())["factory/exp"]
    assert (route.base_url, route.deployment) == (v1.endpoint, "exp-v1")
    assert ("POST", "", "services/proxy", obj) in cluster.calls
    [deployment] = cluster.created("deployments")
    assert_valid(deployment)
    assert deployment["metadata"]["labels"]["factory/engine"] == engine[:63].strip("-_.")
    [c] = deployment["spec"]["template"]["spec"]["containers"]
    # The engine starts without adapters and finds each one in its folder by name.
    assert "--lora-modules" not in c["command"]
    assert c["command"][c["command"].index("--served-model-name") + 1] == f"{engine}-base"
    assert {"name": RESOLVER_DIR_ENV, "value": str(folder)} in c["env"]

    # A new version, another experiment on the same base, a rollback: adapters, no new objects.
    v2 = deployer.deploy("exp", str(setup.checkpoints[1]))
    other = deployer.deploy("other", str(setup.checkpoints[0]))
    assert cluster.names("deployments") == cluster.names("services") == {obj}
    assert (v2.endpoint, other.endpoint) == (v1.endpoint, v1.endpoint)
    assert published(folder) == ["exp-v2", "other-v1"]  # v1 withdrawn when v2 replaced it
    back = deployer.rollback("exp")
    assert (back.version, back.endpoint) == ("v1", v1.endpoint)
    assert published(folder) == ["exp-v1", "other-v1"]
    rows = _rows()
    assert (rows["v1"].status, rows["v2"].status) == ("live", "stopped")
    assert len(cluster.created("deployments")) == 1

    # The engine outlives every version but its last.
    deployer.undeploy("exp")
    assert cluster.names("deployments") == {obj} and published(folder) == ["other-v1"]
    deployer.undeploy("other")
    assert cluster.names("deployments") == cluster.names("services") == set()
    assert published(folder) == []
    # The checkpoints themselves are untouched: only links were published and withdrawn.
    assert all((ck / "adapter_config.json").is_file() for ck in setup.checkpoints)


def test_an_adapter_the_engine_refuses_fails_its_deploy_and_the_live_version_keeps_serving(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = _deployer(cluster)
    live = deployer.deploy("exp", str(setup.checkpoints[0]))
    cluster.refuse = {"exp-v2"}
    with pytest.raises(DeploymentError, match="refused adapter exp-v2") as err:
        deployer.deploy("exp", str(setup.checkpoints[1]))
    assert "400" in str(err.value) and "cannot load exp-v2" in str(err.value)
    rows = _rows()
    assert (rows["v1"].status, rows["v2"].status) == ("live", "failed")
    assert published(_folder(setup)) == ["exp-v1"]
    assert cluster.names("deployments") == {_obj(live)}
    assert load_routes(Lake())["factory/exp"].deployment == "exp-v1"


def test_a_vllm_engine_refuses_an_adapter_above_its_rank_before_publishing_it(
        cluster: FakeCluster, setup: Setup) -> None:
    cluster.auto_ready = True
    deployer = Deployer(config=DeployConfig(backend="vllm", drain_s=0.0), host=_host(cluster))
    live = deployer.deploy("exp", str(setup.checkpoints[0]))
    [c] = cluster.created("deployments")[0]["spec"]["template"]["spec"]["containers"]
    maximum = int(c["command"][c["command"].index("--max-lora-rank") + 1])
    config = setup.checkpoints[1] / "adapter_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "r": maximum * 2}))
    with pytest.raises(DeploymentError, match=f"started with --max-lora-rank {maximum}; adapter "
                                              f"exp-v2 .* has rank {maximum * 2}") as err:
        deployer.deploy("exp", str(setup.checkpoints[1]))
    assert "factory undeploy exp" in str(err.value)  # what to do: a new engine sized for it
    assert published(_folder(setup, "vllm")) == ["exp-v1"]
    assert _rows()["v1"].status == "live" and cluster.names("deployments") == {_obj(live)}


def test_a_failed_engine_start_withdraws_its_adapter(setup: Setup) -> None:
    import socket

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = KubernetesHost(api_server=f"http://127.0.0.1:{port}", image="i",
                          shared_claim="factory-shared")
    with pytest.raises(DeploymentError, match="creating Deployment inference-transformers-base-"
                                              ".*: the Kubernetes API cannot be reached"):
        Deployer(config=DeployConfig(drain_s=0.0), host=host).deploy(
            "exp", str(setup.checkpoints[0]))
    assert published(_folder(setup)) == [] and _rows() == {}


def test_a_real_engine_behind_the_service_serves_the_version_it_resolved(
        cluster: FakeCluster, factory_home: Path, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch, tiny_model_dir: Path) -> None:
    """The proxy forwards to a real CPU server started as the engine's pod would be (no
    adapter, the engine's folder in its environment): the deploy waits until it answers for
    the published adapter, and it then serves it by name."""
    shared = tmp_path / "shared"
    monkeypatch.setenv("FACTORY_SHARED_DIR", str(shared))
    (shared / "models").mkdir(parents=True)
    base = shared / "models" / "tiny"
    base.symlink_to(tiny_model_dir)
    ckpt = make_adapter(base, shared / "runs" / "r1" / "step-2", seed=1)
    Lake().existing_tables()
    engine = engine_key(str(base), "transformers")
    folder = _host_folder(engine)
    folder.mkdir(parents=True)
    cluster.auto_ready = True
    with InferenceServer(str(base), served_model_name=f"{engine}-base", threads=1,
                         log_path=tmp_path / "engine.log", startup_timeout_s=240,
                         env=resolver_env(folder)) as server:
        cluster.engine_url = server.url
        dep = _deployer(cluster).deploy("exp", str(ckpt))
        assert dep.status == "live" and dep.engine == engine
        client = server.client()
        assert client.models() == [f"{engine}-base", "exp-v1"]  # loaded by the deploy's probe
        answer = client.chat("exp-v1", [{"role": "user", "content": "hi"}], max_tokens=4)
        assert answer["model"] == "exp-v1"


def test_object_names_are_dns_labels() -> None:
    name = object_name("a_" + "x" * 62, "v12", "abc123")
    assert len(name) <= 63 and name.endswith("-v12-abc123")
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name)


def test_every_call_is_allowed_by_the_deployer_role(cluster: FakeCluster, setup: Setup) -> None:
    """The calls of a deploy, a replacement, a failure and an undeploy, a Deployment per version
    and one engine per base model (its adapter probed through the service proxy, its rank
    read), each allowed by the Role ``deploy/k8s/rbac.yaml`` binds to the code location's
    account."""
    for share in (False, True):
        cluster.auto_ready = True
        cluster.pods_for = lambda obj: []
        deployer = Deployer(config=DeployConfig(backend="vllm", drain_s=0.0),
                            host=_host(cluster, share=share))
        deployer.deploy("exp", str(setup.checkpoints[0]))
        deployer.deploy("exp", str(setup.checkpoints[1]))
        if not share:
            cluster.auto_ready = False
            cluster.pods_for = lambda obj: [{"metadata": {"name": "p"}, "status": {
                "phase": "Running", "containerStatuses": [{
                    "name": "server", "image": "i", "imageID": "", "ready": False,
                    "restartCount": 1, "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1}}}]}}]
            with pytest.raises(DeploymentError):
                deployer.deploy("exp", str(setup.checkpoints[0]))
        deployer.undeploy("exp")

    docs = [d for d in yaml.safe_load_all((ROOT / "deploy/k8s/rbac.yaml").read_text()) if d]
    [role] = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "factory-deployer"]
    allowed = {(group, resource, verb) for rule in role["rules"] for group in rule["apiGroups"]
               for resource in rule["resources"] for verb in rule["verbs"]}
    verbs = {"POST": "create", "DELETE": "delete"}
    used = {(group, resource, verbs.get(method) or ("get" if name else "list"))
            for method, group, resource, name in cluster.calls}
    assert used - allowed == set()
    assert {("apps", "deployments", "create"), ("", "services", "delete"),
            ("", "pods/log", "get"), ("", "services/proxy", "create"),
            ("apps", "deployments", "get")} <= used


def test_the_deployment_asset_runs_on_the_cluster_factory_deployer_names(
        cluster: FakeCluster, setup: Setup, monkeypatch: pytest.MonkeyPatch) -> None:
    """``$FACTORY_DEPLOYER`` picks the Kubernetes deployer in the composition root (its server
    by the deployment, as without it); a materialization of ``deployment`` serves through it."""
    import dagster as dg

    from factory.assets.deployment import deployment
    from factory.definitions import build_resources
    from factory.resources.deployer import (
        CPUDeployerResource,
        KubernetesCPUDeployerResource,
        KubernetesVLLMDeployerResource,
    )
    from factory.resources.lake import LakeResource

    monkeypatch.delenv("FACTORY_DEPLOYER", raising=False)
    assert type(build_resources("embedded")["deployer"]) is CPUDeployerResource
    config = {"api_server": cluster.url, "image": "ghcr.io/example/factory:1", "namespace": "ml",
              "shared_claim": "factory-shared", "poll_s": 0.02, "drain_s": 0.0,
              "secrets": [{"env": "HF_TOKEN", "secret": "hub", "key": "token"}]}
    monkeypatch.setenv("FACTORY_DEPLOYER", json.dumps(config))
    assert isinstance(build_resources("gpu")["deployer"], KubernetesVLLMDeployerResource)
    resource = build_resources("embedded")["deployer"]
    assert isinstance(resource, KubernetesCPUDeployerResource)
    assert resource.host() == _host(cluster, node_selector={}, tolerations=[])

    cluster.auto_ready = True
    instance = dg.DagsterInstance.ephemeral()
    instance.add_dynamic_partitions("experiments", ["exp"])
    result = dg.materialize(
        [deployment], instance=instance, partition_key="exp",
        resources={"lake": LakeResource(), "deployer": resource},
        run_config={"ops": {"deployment": {"config": {
            "checkpoint": str(setup.checkpoints[0]), "candidate": False}}}})
    assert result.success
    [obj] = cluster.names("deployments")
    meta = result.asset_materializations_for_node("deployment")[0].metadata
    assert meta["endpoint"].value == f"http://{obj}.ml.svc:8000/v1"
    assert _rows()["v1"].status == "live"
    assert load_routes(Lake())["factory/exp"].base_url == f"http://{obj}.ml.svc:8000/v1"


def test_the_cli_deploys_rolls_back_and_undeploys_on_the_cluster_factory_deployer_names(
        cluster: FakeCluster, setup: Setup, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from factory.app.cli import main

    cluster.auto_ready = True
    monkeypatch.setenv("FACTORY_DEPLOYER", json.dumps({
        "api_server": cluster.url, "image": "ghcr.io/example/factory:1", "namespace": "ml",
        "shared_claim": "factory-shared", "poll_s": 0.02, "drain_s": 0.0}))
    for ckpt in setup.checkpoints:
        assert main(["deploy", "exp", "--checkpoint", str(ckpt), "--drain-s", "0",
                     "--format", "json"]) == 0
    assert main(["rollback", "exp", "--drain-s", "0", "--format", "json"]) == 0
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(o["version"], o["status"]) for o in out] == [("v1", "live"), ("v2", "live"),
                                                          ("v1", "live")]
    assert out[-1]["endpoint"].endswith(".ml.svc:8000/v1")
    [obj] = cluster.names("deployments")
    assert out[-1]["endpoint"] == f"http://{obj}.ml.svc:8000/v1"
    # `deployments` asks the cluster whether each version's Deployment exists
    assert main(["deployments", "exp", "--all", "--format", "json"]) == 0
    listed = {r["version"]: r for r in json.loads(capsys.readouterr().out)}
    assert (listed["v1"]["status"], listed["v1"]["alive"]) == ("live", True)
    assert (listed["v2"]["status"], listed["v2"]["alive"]) == ("stopped", False)
    assert main(["undeploy", "exp", "--drain-s", "0"]) == 0
    assert cluster.names("deployments") == cluster.names("services") == set()
    assert {d.status for d in _rows().values()} == {"stopped"}
    monkeypatch.setenv("FACTORY_DEPLOYER", "[1]")
    assert main(["undeploy", "exp"]) == 2
    assert "FACTORY_DEPLOYER: must be a JSON object" in capsys.readouterr().err
