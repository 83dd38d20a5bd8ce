"""Deployed versions on Kubernetes: one ``apps/v1`` Deployment and ``v1`` Service per base model,
every version an adapter of it (or, with ``share`` off, a Deployment and Service per version).

``KubernetesHost`` is the ``ServerHost`` (``factory.deploy.hosts``) of a cluster. A version's
pod runs exactly the argv ``InferenceServer(...).command()`` builds (the factory's CPU server
from the factory image, or ``vllm serve`` from a vLLM image with the GPUs its tensor
parallelism needs), listening on ``0.0.0.0:<port>``, with a readiness probe on ``/health``. It
opens the checkpoint and base model on the shared-artifacts volume the trainer writes them to,
mounted at the path this process sees them at; vLLM's chat-template file travels in a ConfigMap
mounted where the argv names it. Node selector, tolerations, secrets, the shared volume and the
API login are the trainer Jobs' (``factory.control.providers``).

The version is ready when the Deployment reports an available replica (through the API); its
endpoint is the Service's in-cluster URL, ``http://<name>.<namespace>.svc:<port>/v1``, which the
gateway route points at. A pod that cannot start for good (crash loop, image that cannot be
pulled, a secret it cannot read) fails the deploy at once; otherwise the deployer's startup
timeout does, and either way the reason is the pods' status as the API reports it. Stopping a
version deletes its Deployment, Service and ConfigMap (the Service and ConfigMap are also owned
by the Deployment, so the cluster's garbage collector removes them if a delete is missed).

**One engine per base model** (``share``, the default where the shared volume is mounted): the
versions of every deployment on one base model and backend (``factory.deploy.hosts.engine_key``)
are adapters of one engine, a Deployment started without adapters whose servers find them by
name in a folder of the shared volume, ``<shared>/engines/<engine>/adapters`` (vLLM's
filesystem LoRA resolver; the CPU server reads the same folder the same way:
``factory.inference.resolver``). A version is published there (``publish``: links to its
checkpoint's files), so every replica, and one started later, serves it by name with no call to
each replica; the deploy is ready once the engine's Service answers a one-token completion for
it through the API server's service proxy (the request that makes a replica load it), and the
route then moves. A version retired is withdrawn from the folder; the engine's objects are
deleted with the last one. A vLLM engine's ``--max-lora-rank`` is fixed at its start: an adapter
of a higher rank is refused before it is published, the versions on it untouched. The engine
belongs to the versions published in its folder (their ``deployments`` rows), never to the run
that started it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from factory.control.providers import SecretEnv, api_client, secret_env, shared_volume, toleration
from factory.deploy.hosts import (
    KUBERNETES,
    KUBERNETES_SCHEME,
    HostError,
    Placement,
    ServerHost,
    ServerSpec,
)
from factory.inference.resolver import adapter_rank, publish, published, resolver_env, withdraw
from factory.inference.vllm import IMAGE
from factory.settings import env_json_object, get_settings

if TYPE_CHECKING:
    from factory.deploy.deployer import Deployment

DEPLOYER_ENV = "FACTORY_DEPLOYER"
"""A JSON object: the cluster deployed servers run on (``KubernetesHost``'s fields, beside the
deployer resource's own); unset, they run as processes on this machine."""
APP = "factory-inference"
"""``app.kubernetes.io/name`` of every deployed server's objects."""
CONTAINER = "server"
FATAL_WAITING = ("CrashLoopBackOff", "ImagePullBackOff", "InvalidImageName",
                 "ErrImageNeverPull", "CreateContainerConfigError", "CreateContainerError")
"""Reasons a container waits that do not resolve by waiting longer: the deploy fails at once."""
LOG_LINES = 20
"""Lines of a crashed container's log quoted in a failure's reason."""


def _label_value(text: str) -> str:
    """``text`` as a label value: at most 63 characters, alphanumeric at both ends."""
    return text[:63].strip("-_.")


def object_name(name: str, version: str, suffix: str) -> str:
    """``inference-<name>-<version>-<suffix>``: a DNS label (a Service's name must be one), at
    most 63 characters. The suffix keeps a rolled-back version's new objects apart from its
    old ones, which may still be terminating."""
    tail = f"-{version}-{suffix}"
    safe = name.lower().replace("_", "-")[:63 - len("inference-") - len(tail)].strip("-")
    return f"inference-{safe}{tail}"


def engine_object_name(engine: str, suffix: str) -> str:
    """``inference-<backend>-<base>-<digest>-<suffix>`` for shared engine ``engine``
    (``<backend>-<base folder name>-<digest>``): a DNS label of at most 63 characters, the base's
    name cut first."""
    head, _, digest = engine.rpartition("-")
    tail = f"-{digest}-{suffix}"
    safe = re.sub(r"[^a-z0-9-]+", "-", f"inference-{head}".lower())
    return safe[:63 - len(tail)].strip("-") + tail


def _located(dep: Deployment) -> tuple[str, str]:
    """``(namespace, object name)`` of a version from its ``log_path``."""
    try:
        return _located_path(dep.log_path)
    except HostError as exc:
        raise HostError(f"{dep.name} {dep.version}: {exc}") from None


def _located_path(log_path: str | None) -> tuple[str, str]:
    rest = (log_path or "")[len(KUBERNETES_SCHEME):]
    namespace, _, obj = rest.partition("/")
    if not (log_path or "").startswith(KUBERNETES_SCHEME) or not namespace or not obj:
        raise HostError(f"{log_path!r} does not name a Kubernetes object "
                        "(kubernetes://<namespace>/<name>)")
    return namespace, obj


@contextlib.contextmanager
def _calling(what: str) -> Iterator[None]:
    """API errors inside as ``HostError``s saying ``what`` failed: the API's status, reason
    and message, or that it could not be reached."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        yield
    except ApiException as exc:
        try:
            message = json.loads(exc.body or "{}").get("message", "")
        except (ValueError, AttributeError):
            message = str(exc.body or "")[:500]
        raise HostError(f"{what}: the Kubernetes API answered {exc.status} {exc.reason}"
                        + (f": {message}" if message else "")) from None
    except HTTPError as exc:
        raise HostError(f"{what}: the Kubernetes API cannot be reached ({exc})") from None


def _missing(exc: Any) -> bool:
    """True for an ``ApiException`` saying the object does not exist."""
    return getattr(exc, "status", None) == 404


@dataclass(kw_only=True)
class KubernetesHost(ServerHost):
    """Deployed servers as Deployments and Services in one namespace of a cluster."""

    api_server: str
    """API server URL (``https://kubernetes.default.svc`` in the cluster; the tests use a fake
    one on 127.0.0.1)."""
    image: str
    """Server image: the factory image (``docker/factory.Dockerfile``) for the CPU server, whose
    argv starts with this interpreter's path; a vLLM image for ``vllm``, ``vllm`` on its PATH."""
    namespace: str = "factory"
    """Namespace of the Deployments and Services."""
    port: int = 8000
    """Port the server listens on in its pod, and the Service's port."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU (vLLM servers ask for their tensor-parallel size)."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node pool selector of the server pods."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Tolerations of the pool's taints (Kubernetes field names)."""
    priority_class: str | None = None
    """PriorityClass of the server pods (None: the cluster's default)."""
    shared_claim: str | None = None
    """PersistentVolumeClaim of the shared artifacts (``FACTORY_SHARED_DIR``) the trainer
    writes checkpoints to, mounted at the path this process sees it at, because the argv names
    the checkpoint and base model by path. None: no volume (models baked into the image)."""
    secrets: list[SecretEnv] = field(default_factory=list)
    """Env vars from secrets (a hub token for vLLM to download a base model...)."""
    cpu: str = "4"
    """CPU request per server."""
    memory: str = "16Gi"
    """Memory request and limit per server."""
    service_account: str | None = None
    """Service account of the server pods; they get no API token either way."""
    token_env: str | None = None
    """Environment variable holding a bearer token for the API server."""
    token_file: str | None = None
    """File holding a bearer token, read at every call (in a pod, the service account's
    ``/var/run/secrets/kubernetes.io/serviceaccount/token``)."""
    verify_ssl: bool = True
    """Verify the API server's certificate."""
    ca_cert: str | None = None
    """CA bundle path for the API server."""
    poll_s: float = 2.0
    """Seconds between two reads of a starting version's Deployment and pods."""
    share: bool = True
    """One engine per base model, each version an adapter of it (the module's docstring); it
    needs ``shared_claim`` (the adapters are published on the shared volume): without one, or
    with False, a Deployment per version."""
    probe_timeout_s: float = 300.0
    """Longest wait for one probe of a joining adapter through the service proxy (its load)."""

    kind = KUBERNETES

    def __post_init__(self) -> None:
        self.shares_engines = self.share and self.shared_claim is not None
        if not 0 < self.port < 65536:
            raise ValueError(f"port: must be 1-65535, got {self.port!r}")
        if self.poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {self.poll_s!r}")
        if self.token_env and self.token_file:
            raise ValueError("token_file: set token_env or token_file, not both")

    def lock_dir(self, home: Path) -> Path:
        # Run workers are pods with homes of their own: deploys of one name from two of them
        # are serialized through the volume they share.
        return get_settings().shared / "deployments"

    def _api(self) -> Any:
        return api_client(self.api_server, verify_ssl=self.verify_ssl, ca_cert=self.ca_cert,
                          token_env=self.token_env, token_file=self.token_file)

    # -- the objects -----------------------------------------------------------------------------
    def build(self, spec: ServerSpec, *, suffix: str) -> tuple[Any, Any, Any | None]:
        """The ``V1Deployment``, ``V1Service`` and (vLLM: the chat template) ``V1ConfigMap`` of
        one version (no API call). The Service and ConfigMap get their owner reference to the
        Deployment when it exists."""
        from kubernetes import client as k

        self._check_paths(spec)
        extra = dict(spec.env())
        if spec.engine:
            # The engine starts without adapters: it finds each one by name in its folder.
            obj = engine_object_name(spec.engine, suffix)
            labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": obj,
                      "factory/engine": _label_value(spec.engine)}
            extra.update(resolver_env(self.adapter_folder(spec.engine)))
        else:
            obj = object_name(spec.name, spec.version, suffix)
            labels = {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": obj,
                      "factory/deployment": _label_value(spec.name),
                      "factory/version": spec.version}
        server = spec.server(host="0.0.0.0", port=self.port,  # noqa: S104 - the pod's interface
                             with_adapter=not spec.engine)
        argv = server.command(vllm=IMAGE)  # the pod runs a vLLM image, not this machine's venv
        env = [*secret_env(self.secrets), *(k.V1EnvVar(name=key, value=value)
                                            for key, value in sorted(extra.items()))]
        gpus = ({self.gpu_resource: str(spec.sizing.tensor_parallel_size)}
                if spec.backend == "vllm" else {})
        mounts: list[Any] = []
        volumes: list[Any] = []
        if self.shared_claim:
            volume, mount = shared_volume(self.shared_claim)
            mounts.append(mount)
            volumes.append(volume)
        config_map = None
        if spec.backend == "vllm":
            template = server.chat_template_file()
            config_map = k.V1ConfigMap(
                api_version="v1", kind="ConfigMap",
                metadata=k.V1ObjectMeta(name=obj, namespace=self.namespace, labels=labels),
                data={template.name: template.read_text()})
            mounts.append(k.V1VolumeMount(name="chat-template", mount_path=str(template.parent),
                                          read_only=True))
            volumes.append(k.V1Volume(name="chat-template",
                                      config_map=k.V1ConfigMapVolumeSource(name=obj)))
        container = k.V1Container(
            name=CONTAINER, image=self.image, command=argv, env=env or None,
            ports=[k.V1ContainerPort(name="http", container_port=self.port)],
            readiness_probe=k.V1Probe(
                http_get=k.V1HTTPGetAction(path="/health", port="http"),
                period_seconds=5, failure_threshold=3),
            resources=k.V1ResourceRequirements(
                requests={"cpu": self.cpu, "memory": self.memory, **gpus},
                limits={"memory": self.memory, **gpus}),
            volume_mounts=mounts or None)
        pod = k.V1PodSpec(
            containers=[container], node_selector=self.node_selector or None,
            tolerations=[toleration(t) for t in self.tolerations] or None,
            priority_class_name=self.priority_class,
            service_account_name=self.service_account,
            automount_service_account_token=False,
            # The server finishes in-flight requests on SIGTERM: the deployer's stop timeout.
            termination_grace_period_seconds=math.ceil(spec.stop_timeout_s),
            volumes=volumes or None)
        deployment = k.V1Deployment(
            api_version="apps/v1", kind="Deployment",
            metadata=k.V1ObjectMeta(name=obj, namespace=self.namespace, labels=labels),
            spec=k.V1DeploymentSpec(
                replicas=1,
                selector=k.V1LabelSelector(match_labels={"app.kubernetes.io/instance": obj}),
                template=k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=labels),
                                             spec=pod)))
        service = k.V1Service(
            api_version="v1", kind="Service",
            metadata=k.V1ObjectMeta(name=obj, namespace=self.namespace, labels=labels),
            spec=k.V1ServiceSpec(
                selector={"app.kubernetes.io/instance": obj},
                ports=[k.V1ServicePort(name="http", port=self.port, target_port="http")]))
        return deployment, service, config_map

    def adapter_folder(self, engine: str) -> Path:
        """The folder shared engine ``engine``'s servers resolve adapters from, on the shared
        volume."""
        return get_settings().shared / "engines" / engine / "adapters"

    def _check_paths(self, spec: ServerSpec) -> None:
        """Refuse a checkpoint or local base model the pod could not open."""
        if not self.shared_claim:
            return
        shared = get_settings().shared
        for what, path in (("checkpoint", spec.checkpoint), ("base model", spec.base_model)):
            if Path(path).is_absolute() and not Path(path).is_relative_to(shared):
                raise HostError(f"{what} {path!r} is not on the shared volume "
                                f"(FACTORY_SHARED_DIR={shared}, claim {self.shared_claim}): "
                                "the server's pod could not open it")

    # -- ServerHost ------------------------------------------------------------------------------
    def start(self, spec: ServerSpec) -> Placement:
        if spec.engine is None:
            return self._create(spec)
        folder = self.adapter_folder(spec.engine)
        self._check_paths(spec)  # before anything is published
        if spec.join is not None:
            self._check_rank(spec, spec.join)
            self._publish(folder, spec)
            return spec.join
        self._publish(folder, spec)
        try:
            return self._create(spec)
        except HostError:
            withdraw(folder, spec.adapter)
            raise

    @staticmethod
    def _publish(folder: Path, spec: ServerSpec) -> None:
        try:
            publish(folder, spec.adapter, spec.checkpoint, spec.base_model)
        except (ValueError, OSError) as exc:
            raise HostError(f"cannot publish adapter {spec.adapter} in {folder}: {exc}") from None

    def _check_rank(self, spec: ServerSpec, engine: Placement) -> None:
        """Refuse an adapter of a rank above the running vLLM engine's ``--max-lora-rank``
        (fixed when it started), before anything is published."""
        if spec.backend != "vllm":
            return
        from kubernetes import client as k

        namespace, obj = _located_path(engine.log_path)
        with self._api() as api, _calling(f"reading Deployment {obj}"):
            found = k.AppsV1Api(api).read_namespaced_deployment(obj, namespace)
        argv = found.spec.template.spec.containers[0].command or []
        if "--max-lora-rank" not in argv:
            return
        maximum = int(argv[argv.index("--max-lora-rank") + 1])
        rank = adapter_rank(Path(spec.checkpoint))
        if rank is not None and rank > maximum:
            raise HostError(f"the shared vllm engine {obj} was started with --max-lora-rank "
                            f"{maximum}; adapter {spec.adapter} from {spec.checkpoint} has rank "
                            f"{rank}")

    def _create(self, spec: ServerSpec) -> Placement:
        from kubernetes import client as k

        deployment, service, config_map = self.build(spec, suffix=uuid.uuid4().hex[:6])
        obj = deployment.metadata.name
        with self._api() as api:
            apps, core = k.AppsV1Api(api), k.CoreV1Api(api)
            with _calling(f"creating Deployment {obj}"):
                created = apps.create_namespaced_deployment(self.namespace, deployment)
            owner = k.V1OwnerReference(api_version="apps/v1", kind="Deployment", name=obj,
                                       uid=created.metadata.uid, controller=True)
            owned = [(service, core.create_namespaced_service)]
            if config_map is not None:
                owned.append((config_map, core.create_namespaced_config_map))
            for body, create in owned:
                body.metadata.owner_references = [owner]
                try:
                    with _calling(f"creating {body.kind} {obj}"):
                        create(self.namespace, body)
                except HostError:
                    self._delete(core, apps, self.namespace, obj)
                    raise
        return Placement(endpoint=f"http://{obj}.{self.namespace}.svc:{self.port}/v1",
                         port=self.port, log_path=f"{KUBERNETES_SCHEME}{self.namespace}/{obj}",
                         engine=spec.engine)

    def wait_ready(self, dep: Deployment, timeout_s: float) -> None:
        from kubernetes import client as k

        namespace, obj = _located(dep)
        what = f"the {dep.backend} server for {dep.name} {dep.version} (Deployment {obj})"
        deadline = time.monotonic() + timeout_s
        while True:
            with self._api() as api:
                apps, core = k.AppsV1Api(api), k.CoreV1Api(api)
                with _calling(f"reading Deployment {obj}"):
                    status = apps.read_namespaced_deployment_status(obj, namespace).status
                if status is not None and (status.available_replicas or 0) >= 1:
                    if not dep.engine:
                        return
                    answer = self._probe(api, namespace, obj, dep.adapter)
                    if answer is None:
                        return
                    if time.monotonic() > deadline:
                        raise HostError(f"{what} did not serve adapter {dep.adapter} after "
                                        f"{timeout_s:.0f} s: {answer}")
                    time.sleep(self.poll_s)
                    continue
                with _calling(f"listing the pods of {obj}"):
                    pods = core.list_namespaced_pod(
                        namespace, label_selector=f"app.kubernetes.io/instance={obj}").items
                fatal = [reason for reason in map(_waiting_reason, pods)
                         if reason in FATAL_WAITING]
                if fatal or time.monotonic() > deadline:
                    why = (f"cannot start ({fatal[0]})" if fatal
                           else f"was not ready after {timeout_s:.0f} s")
                    with _calling(f"reading the pods of {obj}"):
                        report = _report(core, namespace, status, pods)
                    raise HostError(f"{what} {why}: {report}")
            time.sleep(self.poll_s)

    def _probe(self, api: Any, namespace: str, obj: str, adapter: str) -> str | None:
        """Ask engine ``obj``'s Service, through the API server's service proxy, for one token
        from ``adapter`` (a replica that has not loaded it resolves it now): None when it
        answers, else what it said; ``HostError`` when the engine refused the adapter (400: it
        found it and could not load it)."""
        from kubernetes.client.exceptions import ApiException
        from urllib3.exceptions import HTTPError

        path = f"/api/v1/namespaces/{namespace}/services/{obj}:http/proxy/v1/completions"
        try:
            response = api.call_api(
                path, "POST", header_params={"Content-Type": "application/json",
                                             "Accept": "application/json"},
                body={"model": adapter, "prompt": "ok", "max_tokens": 1},
                auth_settings=["BearerToken"], _preload_content=False,
                _return_http_data_only=True, _request_timeout=self.probe_timeout_s)
            response.release_conn()
            return None
        except ApiException as exc:
            said = f"{exc.status} {exc.reason}: {str(exc.body or '')[:500]}"
            if exc.status == 400:
                raise HostError(f"the engine {obj} refused adapter {adapter}: {said}") from None
            return said
        except HTTPError as exc:
            return f"the Kubernetes API cannot be reached ({exc})"

    def engine_running(self, dep: Deployment) -> bool:
        return self._exists(dep)

    def running(self, dep: Deployment) -> bool:
        if dep.engine:
            return (dep.adapter in published(self.adapter_folder(dep.engine))
                    and self._exists(dep))
        return self._exists(dep)

    def _exists(self, dep: Deployment) -> bool:
        """Whether the Deployment ``dep``'s row names exists."""
        from kubernetes import client as k
        from kubernetes.client.exceptions import ApiException

        namespace, obj = _located(dep)
        with self._api() as api, _calling(f"reading Deployment {obj}"):
            try:
                k.AppsV1Api(api).read_namespaced_deployment(obj, namespace)
            except ApiException as exc:
                if _missing(exc):
                    return False
                raise
        return True

    def stop(self, dep: Deployment, *, timeout_s: float, last: bool = False) -> None:
        # The pods' grace period (the stop timeout at creation) is what in-flight requests get.
        # An engine's versions are the adapters published in its folder, which say whether
        # others remain (``last`` is not needed).
        from kubernetes import client as k

        namespace, obj = _located(dep)
        if dep.engine:
            folder = self.adapter_folder(dep.engine)
            withdraw(folder, dep.adapter)
            if published(folder):
                return  # other versions are adapters of the engine
        with self._api() as api:
            self._delete(k.CoreV1Api(api), k.AppsV1Api(api), namespace, obj)

    @staticmethod
    def _delete(core: Any, apps: Any, namespace: str, obj: str) -> None:
        """Delete a version's Deployment (its pods with it), Service and ConfigMap; those
        already gone are skipped."""
        from kubernetes.client.exceptions import ApiException

        for kind, delete in (("Deployment", apps.delete_namespaced_deployment),
                             ("Service", core.delete_namespaced_service),
                             ("ConfigMap", core.delete_namespaced_config_map)):
            with _calling(f"deleting {kind} {obj}"):
                try:
                    delete(obj, namespace, propagation_policy="Background")
                except ApiException as exc:
                    if not _missing(exc):
                        raise


def _waiting_reason(pod: Any) -> str | None:
    """Why the pod's server container waits (``CrashLoopBackOff``...), if it does."""
    for cs in (pod.status.container_statuses if pod.status else None) or []:
        if cs.name == CONTAINER and cs.state and cs.state.waiting:
            return str(cs.state.waiting.reason or "")
    return None


def _report(core: Any, namespace: str, status: Any, pods: list[Any]) -> str:
    """What the API says about a version that is not ready: each pod's phase, its failing
    conditions and its container's state (with the log tail of a container that exited), or
    the Deployment's conditions when it has no pod."""
    from kubernetes.client.exceptions import ApiException

    if not pods:
        conditions = [f"{c.type}={c.status} {c.reason or ''}: {c.message or ''}".strip()
                      for c in ((status.conditions if status else None) or [])]
        return "no pod" + (f" ({'; '.join(conditions)})" if conditions else "")
    parts = []
    for pod in pods:
        st = pod.status
        bits = [f"pod {pod.metadata.name} {st.phase if st else 'unknown'}"]
        for c in (st.conditions if st else None) or []:
            if c.status != "True" and (c.reason or c.message):
                bits.append(f"{c.type}={c.status} {c.reason or ''}: {c.message or ''}".strip())
        for cs in (st.container_statuses if st else None) or []:
            state = cs.state
            if state and state.waiting:
                bits.append(f"container {cs.name} waiting: {state.waiting.reason or ''}"
                            + (f" ({state.waiting.message})" if state.waiting.message else ""))
            elif state and state.running:
                bits.append(f"container {cs.name} running, not ready")
            last = (state.terminated if state and state.terminated
                    else cs.last_state.terminated if cs.last_state else None)
            if last is not None:
                bits.append(f"exited {last.exit_code} ({last.reason or 'no reason'}), "
                            f"{cs.restart_count} restart(s)")
                try:
                    log = core.read_namespaced_pod_log(
                        pod.metadata.name, namespace, container=cs.name, tail_lines=LOG_LINES,
                        previous=not (state and state.terminated))
                    bits.append(f"log tail:\n{log}")
                except ApiException as exc:
                    bits.append(f"(no log: {exc.status} {exc.reason})")
        parts.append("; ".join(bits))
    return "\n".join(parts)


def host_from_env() -> KubernetesHost | None:
    """The cluster ``$FACTORY_DEPLOYER`` configures, for the CLI (the composition root builds
    the deployer resource from the same object); None when it is unset or empty."""
    config = env_json_object(DEPLOYER_ENV)
    if config is None:
        return None
    names = {f.name for f in dataclasses.fields(KubernetesHost)}
    values = {key: value for key, value in config.items() if key in names}
    values["secrets"] = [SecretEnv(**s) for s in values.get("secrets", [])]
    return KubernetesHost(**values)
