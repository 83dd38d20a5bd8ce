"""Compute providers: the rungs of the ladder the control plane launches trainers on.

Every provider speaks ``factory.control.base.Provider``: capacity in GPU slots, ``launch(job)``
returning a JSON-able ``Handle``, ``status``, ``stop`` (SIGTERM, the trainer checkpoints and
exits 75; SIGKILL after the grace period), ``max_runtime_s`` and ``cost_per_gpu_hour``.

- ``LocalProvider``: ``python -m factory.trainer --job FILE`` as a subprocess (the embedded default).
- ``SandboxProvider``: a serverless-style sandbox with a hard wall-clock limit: at the deadline
  it gets SIGTERM, then SIGKILL after ``grace_s``. Locally each sandbox is a real process, so
  rollover is tested for real with limits of seconds. ``warm_start`` forks sandboxes from a
  server that has already imported torch/transformers/peft (what memory-snapshot sandboxes do):
  on a loaded 2-core machine a cold ``import transformers`` alone took 20 s, more than a whole
  test sandbox lives.
- ``KubernetesProvider``: a ``batch/v1`` Job per segment (GPU limits, node selector,
  tolerations, a priority class and preemption policy, secrets as env from Kubernetes secrets,
  the shared-artifacts volume, the job file from a ConfigMap owned by the Job, ``--job`` as the
  argument), created through the kubernetes client against the configured API server;
  ``status`` follows the Job and its pod.

Process handles live in a module-level registry, so providers rebuilt every sensor tick still
see the processes an earlier tick launched (in the same code-server process).
"""


import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import factory
from factory import codepin
from factory.control.base import Handle, ProviderStatus
from factory.process import is_alive, runs_command, stop_group
from factory.settings import get_settings
from factory.trainer.__main__ import main
from factory.trainer.config import TrainerJob

_REGISTRY: dict[str, dict[str, tuple[Any, int]]] = {}  # provider -> handle id -> (proc, gpus)
_LOCK = threading.Lock()
TRAINER = "factory.trainer"
"""The trainer package, run as ``python -m factory.trainer`` (the image runs ``-m trainer``)."""
WARM_MODULES = ["torch", "transformers", "peft", *(f"{TRAINER}.{m}" for m in (
    "train", "model", "data", "chat", "checkpoint"))]


def _trainer_child(job_path: str, env: dict[str, str], log_path: str) -> None:
    """Entry point of a warm-started sandbox (runs in a process forked by the forkserver).
    ``env`` is the launcher's whole environment at launch, as a cold start would inherit it:
    the forkserver's own is the launcher's of when it started."""
    os.environ.clear()
    os.environ.update(env)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    if env.get("OMP_NUM_THREADS"):
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))

    code = 1
    try:
        code = main(["--job", job_path])
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class _Proc:
    """A Popen or a forkserver Process behind one small interface."""

    def __init__(self, proc: Any) -> None:
        self.proc = proc

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def returncode(self) -> int | None:
        if isinstance(self.proc, subprocess.Popen):
            return self.proc.poll()
        return self.proc.exitcode  # type: ignore[no-any-return]

    def signal(self, sig: int) -> None:
        if self.returncode() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass


@dataclass(kw_only=True)
class _ProcessProvider:
    """Shared subprocess machinery of the local and sandbox providers."""

    name: str = "local"
    """Rung name (unique in the ladder)."""
    max_gpus: int = 1
    """GPU slots (concurrent single-device jobs); CPU-only machines count jobs."""
    cost_per_gpu_hour: float = 0.0
    """For reports and the ladder's order."""
    grace_s: float = 10.0
    """Seconds between SIGTERM and SIGKILL on stop."""
    env: dict[str, str] = field(default_factory=dict)
    """Extra environment for the trainer (webhook secret, OMP_NUM_THREADS...)."""
    workdir: str | None = None
    """Where job files and logs go (default ``$FACTORY_HOME/runs/segments``)."""
    python: str = sys.executable
    """Interpreter running ``-m factory.trainer``."""
    warm_start: bool = False
    """Fork trainers from a server with torch/transformers already imported. A forked trainer
    keeps the server's allocator: ``python -m factory.trainer`` preloads jemalloc, a fork
    cannot (``factory.trainer.__main__.preload_jemalloc``)."""
    clock: Callable[[], float] = field(default=time.time, repr=False, compare=False,
                                       metadata={"config": False})
    """Seconds a sandbox's life is measured in (launch time, deadline); the control plane's
    ``clock`` must be the same. Not a setting: tests pass a clock that counts training steps,
    so a sandbox's life is the work it did, not how long a loaded machine took to start it."""

    @property
    def max_runtime_s(self) -> float | None:
        return None

    def _dir(self, segment_id: str) -> Path:
        base = Path(self.workdir) if self.workdir else get_settings().runs / "segments"
        d = base / segment_id
        d.mkdir(parents=True, exist_ok=True)
        return d

    def _live(self) -> dict[str, tuple[Any, int]]:
        with _LOCK:
            mine = _REGISTRY.setdefault(self.name, {})
            for hid in [h for h, (p, _) in mine.items() if p.returncode() is not None]:
                del mine[hid]
            return dict(mine)

    def capacity(self) -> int:
        return max(0, self.max_gpus - sum(g for _, g in self._live().values()))

    def warm_up(self) -> None:
        """Start the forkserver now (its imports take seconds), not at the first launch."""
        if self.warm_start:
            ctx = _forkserver()
            p = ctx.Process(target=_noop)
            p.start()
            p.join()

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        if num_gpus > self.max_gpus:
            raise ValueError(f"num_gpus: {self.name} has {self.max_gpus} GPU slot(s), "
                             f"the job needs {num_gpus}")
        d = self._dir(segment_id)
        job_path = d / "job.json"
        job_path.write_text(json.dumps(job.to_dict(), indent=1, sort_keys=True))
        log_path = d / "trainer.log"
        codepin.check()  # the trainer imports the factory: the run's code, or a refusal
        env = {k: str(v) for k, v in self.env.items()}
        root = str(Path(factory.__file__).resolve().parent.parent)  # the folder above factory/
        if self.warm_start:
            proc: Any = _forkserver().Process(target=_trainer_child,
                                              args=(str(job_path), {**os.environ, **env},
                                                    str(log_path)),
                                              name=f"sandbox-{segment_id}")
            proc.start()
        else:
            full_env = {**os.environ, **env}
            full_env["PYTHONPATH"] = os.pathsep.join(
                p for p in (root, os.environ.get("PYTHONPATH")) if p)
            with open(log_path, "ab") as log:
                proc = subprocess.Popen([self.python, "-m", TRAINER, "--job", str(job_path)],
                                        env=full_env, stdout=log, stderr=subprocess.STDOUT,
                                        cwd=str(d), start_new_session=True)
        wrapped = _Proc(proc)
        handle_id = f"{self.name}-{uuid.uuid4().hex[:12]}"
        with _LOCK:
            _REGISTRY.setdefault(self.name, {})[handle_id] = (wrapped, num_gpus)
        now = self.clock()
        runtime = self.max_runtime_s
        handle = Handle(provider=self.name, handle_id=handle_id, launched_at=now,
                        deadline=now + runtime if runtime is not None else None,
                        info={"pid": wrapped.pid, "log": str(log_path), "job": str(job_path)})
        if runtime is not None:
            threading.Thread(target=self._enforce_deadline, args=(wrapped, now + runtime),
                             name=f"deadline-{handle_id}", daemon=True).start()
        return handle

    def _enforce_deadline(self, proc: _Proc, deadline: float) -> None:
        while proc.returncode() is None and self.clock() < deadline:
            time.sleep(min(0.2, max(0.0, deadline - self.clock())))
        self._terminate(proc)

    def _terminate(self, proc: _Proc) -> None:
        proc.signal(signal.SIGTERM)
        end = time.time() + self.grace_s
        while proc.returncode() is None and time.time() < end:
            time.sleep(0.05)
        proc.signal(signal.SIGKILL)

    def _find(self, handle: Handle) -> _Proc | None:
        with _LOCK:
            entry = _REGISTRY.get(self.name, {}).get(handle.handle_id)
        return entry[0] if entry else None

    def status(self, handle: Handle) -> ProviderStatus:
        proc = self._find(handle)
        if proc is None:
            pid = int(handle.info.get("pid", 0))
            alive = is_alive(pid)
            # Launched by another process (or finished and forgotten): all we can see is the pid.
            return ProviderStatus(state="running" if alive else "lost",
                                  detail="not launched by this process")
        code = proc.returncode()
        if code is None:
            return ProviderStatus(state="running")
        if code == 0:
            return ProviderStatus(state="succeeded", exit_code=0)
        detail = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit {code}"
        return ProviderStatus(state="failed", exit_code=code, detail=detail)

    def stop(self, handle: Handle) -> None:
        proc = self._find(handle)
        if proc is None:
            self._stop_by_pid(handle)
        elif proc.returncode() is None:
            threading.Thread(target=self._terminate, args=(proc,), daemon=True).start()

    def _stop_by_pid(self, handle: Handle) -> None:
        """Stop a trainer this process did not launch (an interrupted ``factory run``, a
        restarted control plane) by its recorded pid: SIGTERM to its process group now, SIGKILL
        after ``grace_s``. Only when the pid still runs this segment's job: a pid recorded
        long ago may have been recycled for someone else's process."""
        pid, job = handle.info.get("pid"), handle.info.get("job")
        if not (isinstance(pid, int) and job and is_alive(pid)
                and runs_command(pid, ["--job", str(job)])):
            return
        try:
            os.killpg(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        threading.Thread(target=stop_group, args=(pid,), kwargs={"timeout_s": self.grace_s},
                         name=f"stop-{handle.handle_id}", daemon=True).start()


def _noop() -> None:
    return None


_FORKSERVER: Any = None


def _forkserver() -> Any:
    global _FORKSERVER
    if _FORKSERVER is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(WARM_MODULES)
        _FORKSERVER = ctx
    return _FORKSERVER


@dataclass(kw_only=True)
class LocalProvider(_ProcessProvider):
    """``python -m factory.trainer`` as a subprocess on this machine."""


@dataclass(kw_only=True)
class SandboxProvider(_ProcessProvider):
    """A sandbox with a hard wall-clock limit (SIGTERM at the deadline, SIGKILL after grace)."""

    name: str = "sandbox"
    """Rung name."""
    max_gpus: int = 8
    """Concurrent sandboxes (one GPU each unless the plan asks for more)."""
    cost_per_gpu_hour: float = 4.0
    """Serverless is dearer than our cluster."""
    limit_s: float = 24 * 3600.0
    """Hard wall-clock limit of one sandbox."""
    grace_s: float = 30.0
    """Seconds between SIGTERM (at the deadline or on stop) and SIGKILL."""
    warm_start: bool = True
    """Fork sandboxes from a warm server (see the module docstring)."""

    @property
    def max_runtime_s(self) -> float | None:
        return self.limit_s


# --- Kubernetes ---------------------------------------------------------------------------------

JOB_MOUNT = "/etc/factory"
PREEMPTION_POLICIES = ("PreemptLowerPriority", "Never")
"""The values of a pod's (and a PriorityClass's) ``preemptionPolicy``."""


def toleration(fields: dict[str, Any]) -> Any:
    """A ``V1Toleration`` from its Kubernetes field names (``tolerationSeconds``...)."""
    from kubernetes import client as k

    names = {json_key: name for name, json_key in k.V1Toleration.attribute_map.items()}
    unknown = sorted(set(fields) - set(names))
    if unknown:
        raise ValueError(f"tolerations: unknown field(s) {', '.join(unknown)}")
    return k.V1Toleration(**{names[key]: value for key, value in fields.items()})


@dataclass(frozen=True, kw_only=True)
class SecretEnv:
    """An environment variable of the trainer taken from a Kubernetes secret."""

    env: str
    """Variable name in the container."""
    secret: str
    """Kubernetes secret name."""
    key: str
    """Key inside the secret."""


def secret_env(secrets: list[SecretEnv]) -> list[Any]:
    """``V1EnvVar``s reading each of ``secrets`` from its Kubernetes secret."""
    from kubernetes import client as k

    return [k.V1EnvVar(name=s.env, value_from=k.V1EnvVarSource(
        secret_key_ref=k.V1SecretKeySelector(name=s.secret, key=s.key))) for s in secrets]


def shared_volume(claim: str) -> tuple[Any, Any]:
    """The ``V1Volume`` of the shared-artifacts claim and its ``V1VolumeMount`` at the path
    this process sees ``FACTORY_SHARED_DIR`` at: job files and deployments name base models,
    data and checkpoints by that path."""
    from kubernetes import client as k

    volume = k.V1Volume(name="shared", persistent_volume_claim=(
        k.V1PersistentVolumeClaimVolumeSource(claim_name=claim)))
    return volume, k.V1VolumeMount(name="shared", mount_path=str(get_settings().shared))


def api_client(api_server: str, *, verify_ssl: bool = True, ca_cert: str | None = None,
               token_env: str | None = None, token_file: str | None = None) -> Any:
    """A kubernetes ``ApiClient`` for ``api_server``, its bearer token read from ``token_env``
    or ``token_file`` now (a service-account token file is rotated by the kubelet, so build one
    per use)."""
    from kubernetes import client as k

    cfg = k.Configuration()
    cfg.host = api_server
    cfg.verify_ssl = verify_ssl
    if ca_cert:
        cfg.ssl_ca_cert = ca_cert
    token = (os.environ[token_env] if token_env
             else Path(token_file).read_text().strip() if token_file else None)
    if token:
        # The whole header value: this client version ignores ``api_key_prefix``.
        cfg.api_key = {"authorization": f"Bearer {token}"}
    return k.ApiClient(cfg)


@dataclass(kw_only=True)
class KubernetesProvider:
    """Trainer Jobs on a Kubernetes cluster's GPU node pool."""

    api_server: str
    """API server URL (``https://...``; the tests use a fake one on 127.0.0.1)."""
    image: str
    """Trainer image (``docker/trainer.Dockerfile``)."""
    namespace: str = "factory"
    """Namespace of the Jobs."""
    name: str = "kubernetes"
    """Rung name."""
    max_gpus: int = 8
    """GPUs of the node pool this factory may use."""
    cost_per_gpu_hour: float = 2.0
    """For reports and the ladder's order."""
    gpu_resource: str = "nvidia.com/gpu"
    """Extended resource name of a GPU."""
    node_selector: dict[str, str] = field(default_factory=dict)
    """Node pool selector (e.g. ``{"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}``)."""
    tolerations: list[dict[str, Any]] = field(default_factory=list)
    """Tolerations of the GPU pool's taints (Kubernetes field names)."""
    priority_class: str | None = None
    """PriorityClass of the trainer pods (``deploy/k8s`` defines ``factory-trainer``): where
    the pool is shared, it decides who waits and who is evicted."""
    preemption_policy: str | None = None
    """``PreemptLowerPriority`` (a pending trainer may evict lower-priority pods) or ``Never``
    (it waits). It must equal the policy of ``priority_class``: the API server's priority
    admission refuses a pod whose policy differs from its class's. None takes the class's."""
    shared_claim: str | None = None
    """PersistentVolumeClaim holding the factory's shared artifacts (``FACTORY_SHARED_DIR``:
    built base models, job data, checkpoints), mounted in the trainer pod at the path this
    process sees them at, because the job file names them by path. None: no volume (a job
    whose paths are all object-store URLs)."""
    secrets: list[SecretEnv] = field(default_factory=list)
    """Env vars from secrets (webhook secret, object-store credentials, hub token)."""
    cpu: str = "8"
    """CPU request per Job."""
    memory: str = "64Gi"
    """Memory request and limit per Job."""
    service_account: str | None = None
    """Service account of the pod (object-store access through workload identity)."""
    active_deadline_s: int | None = None
    """Kubernetes kills the Job after this (None: no limit)."""
    grace_s: int = 60
    """terminationGracePeriodSeconds: SIGTERM to SIGKILL."""
    token_env: str | None = None
    """Environment variable holding a bearer token for the API server."""
    token_file: str | None = None
    """File holding a bearer token, read at every call: in a pod, the service account's
    ``/var/run/secrets/kubernetes.io/serviceaccount/token``, which the kubelet rotates. With
    neither ``token_env`` nor this, calls carry no credentials."""
    verify_ssl: bool = True
    """Verify the API server's certificate."""
    ca_cert: str | None = None
    """CA bundle path for the API server."""

    def __post_init__(self) -> None:
        if self.preemption_policy not in (None, *PREEMPTION_POLICIES):
            raise ValueError(f"preemption_policy: must be one of {', '.join(PREEMPTION_POLICIES)}"
                             f", got {self.preemption_policy!r}")
        if self.token_env and self.token_file:
            raise ValueError("token_file: set token_env or token_file, not both")
        if self.preemption_policy and not self.priority_class:
            raise ValueError("preemption_policy: set priority_class too (the policy must match "
                             "that class's own)")

    @property
    def max_runtime_s(self) -> float | None:
        return float(self.active_deadline_s) if self.active_deadline_s else None

    def job_name(self, segment_id: str) -> str:
        safe = "".join(c if c.isalnum() else "-" for c in segment_id.lower()).strip("-")
        return f"trainer-{safe}"[:63].rstrip("-")

    def build_job(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Any:
        """The ``V1Job`` for one segment (no API call)."""
        from kubernetes import client as k

        name = self.job_name(segment_id)
        labels = {"app.kubernetes.io/name": "factory-trainer", "factory/run-id": job.run_id[:63],
                  "factory/segment-id": segment_id[:63]}
        env = secret_env(self.secrets)
        env.append(k.V1EnvVar(name="FACTORY_SEGMENT_ID", value=segment_id))
        gpus = {self.gpu_resource: str(num_gpus)} if num_gpus else {}
        mounts = [k.V1VolumeMount(name="job", mount_path=JOB_MOUNT, read_only=True)]
        volumes = [k.V1Volume(name="job", config_map=k.V1ConfigMapVolumeSource(name=name))]
        if self.shared_claim:
            volume, mount = shared_volume(self.shared_claim)
            mounts.append(mount)
            volumes.append(volume)
        container = k.V1Container(
            name="trainer", image=self.image, command=["python", "-m", "trainer"],
            args=["--job", f"{JOB_MOUNT}/job.json"], env=env,
            resources=k.V1ResourceRequirements(
                requests={"cpu": self.cpu, "memory": self.memory, **gpus},
                limits={"memory": self.memory, **gpus}),
            volume_mounts=mounts)
        pod = k.V1PodSpec(
            restart_policy="Never", containers=[container],
            node_selector=self.node_selector or None,
            tolerations=[toleration(t) for t in self.tolerations] or None,
            priority_class_name=self.priority_class, preemption_policy=self.preemption_policy,
            service_account_name=self.service_account,
            termination_grace_period_seconds=self.grace_s, volumes=volumes)
        return k.V1Job(
            api_version="batch/v1", kind="Job",
            metadata=k.V1ObjectMeta(name=name, namespace=self.namespace, labels=labels),
            spec=k.V1JobSpec(
                # Retries are the control plane's (resume from a checkpoint), never a blind rerun.
                backoff_limit=0, active_deadline_seconds=self.active_deadline_s,
                ttl_seconds_after_finished=24 * 3600,
                template=k.V1PodTemplateSpec(metadata=k.V1ObjectMeta(labels=labels),
                                             spec=pod)))

    def _api(self) -> Any:
        return api_client(self.api_server, verify_ssl=self.verify_ssl, ca_cert=self.ca_cert,
                          token_env=self.token_env, token_file=self.token_file)

    def _owned(self) -> list[Any]:
        from kubernetes import client as k

        jobs = k.BatchV1Api(self._api()).list_namespaced_job(
            self.namespace, label_selector="app.kubernetes.io/name=factory-trainer")
        return [j for j in jobs.items if not (j.status and (j.status.succeeded or j.status.failed))]

    def capacity(self) -> int:
        used = 0
        for j in self._owned():
            for c in j.spec.template.spec.containers:
                limits = (c.resources.limits or {}) if c.resources else {}
                used += int(limits.get(self.gpu_resource, 0))
        return max(0, self.max_gpus - used)

    def launch(self, job: TrainerJob, *, segment_id: str, num_gpus: int = 1) -> Handle:
        from kubernetes import client as k

        api = self._api()
        body = self.build_job(job, segment_id=segment_id, num_gpus=num_gpus)
        created = k.BatchV1Api(api).create_namespaced_job(self.namespace, body)
        owner = k.V1OwnerReference(api_version="batch/v1", kind="Job", name=created.metadata.name,
                                   uid=created.metadata.uid, controller=True)
        k.CoreV1Api(api).create_namespaced_config_map(self.namespace, k.V1ConfigMap(
            api_version="v1", kind="ConfigMap", metadata=k.V1ObjectMeta(name=created.metadata.name, namespace=self.namespace,
                                    owner_references=[owner]),
            data={"job.json": json.dumps(job.to_dict(), indent=1, sort_keys=True)}))
        now = time.time()
        return Handle(provider=self.name, handle_id=created.metadata.name, launched_at=now,
                      deadline=now + self.active_deadline_s if self.active_deadline_s else None,
                      info={"namespace": self.namespace, "uid": created.metadata.uid})

    def status(self, handle: Handle) -> ProviderStatus:
        from kubernetes import client as k
        from kubernetes.client.exceptions import ApiException

        api = self._api()
        try:
            j = k.BatchV1Api(api).read_namespaced_job_status(handle.handle_id, self.namespace)
        except ApiException as e:
            if e.status == 404:
                return ProviderStatus(state="lost", detail="job not found")
            raise
        pods = k.CoreV1Api(api).list_namespaced_pod(
            self.namespace, label_selector=f"job-name={handle.handle_id}").items
        pod = pods[-1] if pods else None
        code = None
        detail = pod.status.phase if pod and pod.status else "no pod yet"
        if pod and pod.status and pod.status.container_statuses:
            term = pod.status.container_statuses[0].state.terminated \
                if pod.status.container_statuses[0].state else None
            if term is not None:
                code = term.exit_code
                detail = f"{detail}: {term.reason or ''} exit {code}".strip()
        st = j.status
        if st and st.succeeded:
            return ProviderStatus(state="succeeded", exit_code=code or 0, detail=detail)
        if st and st.failed:
            return ProviderStatus(state="failed", exit_code=code, detail=detail)
        if st and st.active and pod and pod.status and pod.status.phase == "Running":
            return ProviderStatus(state="running", detail=detail)
        return ProviderStatus(state="pending", detail=detail)

    def stop(self, handle: Handle) -> None:
        from kubernetes import client as k
        from kubernetes.client.exceptions import ApiException

        try:
            # Deleting the Job sends SIGTERM to its pod; kubelet kills after the grace period.
            k.BatchV1Api(self._api()).delete_namespaced_job(
                handle.handle_id, self.namespace, propagation_policy="Background",
                grace_period_seconds=self.grace_s)
        except ApiException as e:
            if e.status != 404:
                raise
