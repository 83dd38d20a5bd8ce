"""KubernetesProvider: the exact Job spec, valid against the Kubernetes API schema, and its HTTP
calls against a fake API server."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from kubernetes import client as k

from factory.control.providers import KubernetesProvider, SecretEnv
from tests.kube_schema import assert_valid


def _provider(url: str = "http://127.0.0.1:1") -> KubernetesProvider:
    return KubernetesProvider(
        api_server=url, image="ghcr.io/example/factory-trainer:1", namespace="ml",
        node_selector={"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"},
        tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
        secrets=[SecretEnv(env="FACTORY_WEBHOOK_SECRET", secret="factory-webhook", key="secret")],
        priority_class="factory-trainer", preemption_policy="PreemptLowerPriority",
        shared_claim="factory-shared", active_deadline_s=86400)


def test_job_spec(make_job, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_SHARED_DIR", str(tmp_path / "shared"))
    job = make_job("r1")
    spec = k.ApiClient().sanitize_for_serialization(
        _provider().build_job(job, segment_id="r1-s000", num_gpus=2))
    assert_valid(spec)
    pod = spec["spec"]["template"]["spec"]
    [c] = pod["containers"]
    assert spec["metadata"]["name"] == "trainer-r1-s000"
    assert spec["spec"]["backoffLimit"] == 0 and spec["spec"]["activeDeadlineSeconds"] == 86400
    assert c["command"] == ["python", "-m", "trainer"]
    assert c["args"] == ["--job", "/etc/factory/job.json"]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["tolerations"][0]["key"] == "nvidia.com/gpu"
    assert pod["restartPolicy"] == "Never"
    assert {"name": "FACTORY_WEBHOOK_SECRET", "valueFrom": {"secretKeyRef": {
        "name": "factory-webhook", "key": "secret"}}} in c["env"]
    assert pod["priorityClassName"] == "factory-trainer"
    assert pod["preemptionPolicy"] == "PreemptLowerPriority"
    assert pod["volumes"][0]["configMap"]["name"] == "trainer-r1-s000"
    # The job file names data, base model and output by path: the claim is mounted at the path
    # the control plane sees the shared folder at.
    assert pod["volumes"][1] == {"name": "shared",
                                 "persistentVolumeClaim": {"claimName": "factory-shared"}}
    assert {"name": "shared", "mountPath": str(tmp_path / "shared")} in c["volumeMounts"]


def test_tolerations_take_kubernetes_field_names(make_job) -> None:
    p = _provider()
    p.tolerations = [{"key": "node.kubernetes.io/unreachable", "operator": "Exists",
                      "effect": "NoExecute", "tolerationSeconds": 300}]
    spec = k.ApiClient().sanitize_for_serialization(p.build_job(make_job("r1"), segment_id="s"))
    assert_valid(spec)
    assert spec["spec"]["template"]["spec"]["tolerations"][0]["tolerationSeconds"] == 300
    p.tolerations = [{"key": "x", "tolerationSecond": 300}]
    with pytest.raises(ValueError, match="unknown field.*tolerationSecond"):
        p.build_job(make_job("r1"), segment_id="s")


def test_preemption_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="preemption_policy: must be one of"):
        KubernetesProvider(api_server="http://x", image="i", priority_class="p",
                           preemption_policy="Always")
    with pytest.raises(ValueError, match="set priority_class too"):
        KubernetesProvider(api_server="http://x", image="i", preemption_policy="Never")


class _Fake(BaseHTTPRequestHandler):
    calls: list[tuple[str, str, dict]] = []
    tokens: set[str | None] = set()

    def _reply(self, body: dict, code: int = 200) -> None:
        raw = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def _body(self) -> dict:
        self.tokens.add(self.headers.get("Authorization"))
        n = int(self.headers.get("Content-Length") or 0)
        return json.loads(self.rfile.read(n)) if n else {}

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        self.calls.append(("POST", self.path, body))
        body.setdefault("metadata", {})["uid"] = "uid-1"
        self._reply(body, 201)

    def do_GET(self) -> None:  # noqa: N802
        self.tokens.add(self.headers.get("Authorization"))
        self.calls.append(("GET", self.path, {}))
        if "/pods" in self.path:
            self._reply({"items": [{"metadata": {"name": "p"}, "status": {
                "phase": "Failed", "containerStatuses": [{"name": "trainer", "image": "i",
                "imageID": "", "ready": False, "restartCount": 0, "state": {
                    "terminated": {"exitCode": 3, "reason": "Error"}}}]}}]})
        elif self.path.endswith("/status"):
            self._reply({"metadata": {"name": "trainer-r1-s000"}, "status": {"failed": 1}})
        else:
            self._reply({"items": []})

    def do_DELETE(self) -> None:  # noqa: N802
        self.calls.append(("DELETE", self.path, self._body()))
        self._reply({"kind": "Status", "status": "Success"})

    def log_message(self, *args: object) -> None:
        pass


def test_calls_against_a_fake_api_server(make_job, tmp_path: Path) -> None:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Fake)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    token = tmp_path / "token"
    token.write_text("sa-token\n")  # a pod's service-account token, as the kubelet writes it
    try:
        p = _provider(f"http://127.0.0.1:{srv.server_address[1]}")
        p.token_file = str(token)
        assert p.capacity() == 8
        handle = p.launch(make_job("r1"), segment_id="r1-s000")
        st = p.status(handle)
        p.stop(handle)
    finally:
        srv.shutdown()
        srv.server_close()
    calls = [(m, path.split("?")[0]) for m, path, _ in _Fake.calls]
    assert calls == [("GET", "/apis/batch/v1/namespaces/ml/jobs"),
                     ("POST", "/apis/batch/v1/namespaces/ml/jobs"),
                     ("POST", "/api/v1/namespaces/ml/configmaps"),
                     ("GET", "/apis/batch/v1/namespaces/ml/jobs/trainer-r1-s000/status"),
                     ("GET", "/api/v1/namespaces/ml/pods"),
                     ("DELETE", "/apis/batch/v1/namespaces/ml/jobs/trainer-r1-s000")]
    job_body, cm = _Fake.calls[1][2], _Fake.calls[2][2]
    assert_valid(job_body)
    assert_valid(cm)
    assert cm["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    assert json.loads(cm["data"]["job.json"])["run_id"] == "r1"
    assert st.state == "failed" and st.exit_code == 3
    assert _Fake.tokens == {"Bearer sa-token"}
    assert handle.deadline is not None
