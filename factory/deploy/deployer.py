"""Deploying a checkpoint: boot its server, wait until it serves, record it, route the stable name.

``Deployer.deploy(name)`` serves the experiment's best checkpoint (or a chosen one) as the next
version ``vN``: the inference server (the factory's CPU server, or vLLM on a GPU; the argv comes
from the same ``InferenceServer`` the evals use) is started by a ``ServerHost``
(``factory.deploy.hosts``: a detached process on this machine, or a Kubernetes Deployment and
Service) so it outlives the caller, and only once the host reports it ready is the version
recorded ``live`` in ``deployments`` and the gateway route ``factory/<name>`` pointed at it. The
version it replaces is then drained (left serving until every gateway has re-read its routes
and its in-flight requests finished) and stopped. ``undeploy`` removes the route and stops the
live version; ``rollback`` serves the previous version's checkpoint again under its old tag.

Operations on one name are serialized by a file lock (in the host's lock folder), so two deploys
cannot interleave.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import re
import time
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from factory.deploy.hosts import (
    KUBERNETES,
    PROCESS,
    HostError,
    Placement,
    ProcessHost,
    ServerHost,
    ServerSpec,
    base_name,
    engine_key,
    placement_of,
    served_adapters,
)
from factory.errors import FactoryError
from factory.gateway import Route, load_routes, register_route, unregister_route
from factory.inference import ServeSizing
from factory.inference.sizing import DEFAULTS, ServingSize, plan_of_run, serving_size_for
from factory.lake import Lake, LakeSession
from factory.process import is_alive, runs_command

NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
CHECKPOINT_KEY_RE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]{0,127}):(\d+)$")
VERSION_RE = re.compile(r"^v(\d+)$")
ROUTE_PREFIX = "factory/"
LIVE = "live"
CANDIDATE = "candidate"
"""Serving, but not behind ``factory/<name>``: what shadow mode compares with the frontier model
before ``promote`` moves the route to it."""
ACTIVE = ("starting", LIVE, CANDIDATE, "draining")


class DeploymentError(FactoryError):
    """A deploy, undeploy or rollback that cannot be done (the message says why)."""


@dataclass(frozen=True, kw_only=True)
class DeployConfig:
    """How deployed servers are run and how a replaced version is retired."""

    backend: str = "transformers"
    """``transformers`` (the factory's CPU server) or ``vllm`` (GPU machines)."""
    sizing: ServeSizing | None = None
    """Serving limits (vLLM flags; the CPU server uses max_model_len and max_num_seqs). None:
    the eval serving size of the checkpoint's run plan, with ``overrides`` winning."""
    overrides: Mapping[str, Any] = field(default_factory=dict)
    """ServingSize fields (``factory.inference.sizing.FIELDS``) forced over the plan's."""
    host: str = "127.0.0.1"
    """Interface local server processes listen on (the gateway reaches them there)."""
    threads: int | None = None
    """torch intra-op threads of the CPU server; None lets torch decide."""
    startup_timeout_s: float = 600.0
    """Longest wait for a new server to be ready (its health check; on Kubernetes, an available
    replica)."""
    drain_s: float = 10.0
    """How long a replaced version keeps serving after the route moved: running gateways
    re-read routes every 2 s (``routes_poll_s``), so 10 s covers a few missed polls."""
    stop_timeout_s: float = 120.0
    """After the drain, a server gets this long to finish in-flight requests on SIGTERM."""

    def validate(self) -> None:
        if self.backend not in ("transformers", "vllm"):
            raise ValueError(f"backend: must be transformers or vllm, got {self.backend!r}")
        for name in ("startup_timeout_s", "stop_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name}: must be > 0, got {getattr(self, name)!r}")
        if self.drain_s < 0:
            raise ValueError(f"drain_s: must be >= 0, got {self.drain_s!r}")
        if self.sizing is not None:
            self.sizing.validate()
        else:
            serving_size_for(None, self.overrides)  # bad overrides fail here, not at deploy time


@dataclass(frozen=True, kw_only=True)
class Checkpoint:
    """An adapter directory to serve and where it came from."""

    path: str
    """Absolute adapter directory (adapter_config.json, weights, tokenizer)."""
    base_model: str
    """Base model the adapter applies to (from adapter_config.json)."""
    run_id: str | None = None
    """Training run that wrote it, when known."""
    step: int | None = None
    """Optimizer step of the checkpoint, when known."""
    source: str = "path"
    """How it was chosen: ``best`` (best_checkpoints), ``key`` (RUN:STEP) or ``path``."""


@dataclass(frozen=True, kw_only=True)
class Deployment:
    """One version of a deployment (the latest ``deployments`` row of ``(name, version)``)."""

    name: str
    version: str
    checkpoint: str
    base_model: str
    adapter: str
    route_model: str
    endpoint: str
    backend: str
    status: str
    pid: int | None
    port: int | None
    log_path: str
    run_id: str | None = None
    step: int | None = None
    reason: str | None = None
    started_at: datetime | None = None
    stopped_at: datetime | None = None
    updated_at: datetime | None = None
    structured_outputs: str | None = None
    """JSON of the decoding constraint its route adds (``Route.structured_outputs``), or None."""
    engine: str | None = None
    """The shared engine (``factory.deploy.hosts.engine_key``) it is an adapter of: its pid,
    port and endpoint are the engine's, which other versions share. None: a server of its
    own."""

    @property
    def constraint(self) -> dict[str, Any] | None:
        return json.loads(self.structured_outputs) if self.structured_outputs else None

    @property
    def number(self) -> int:
        m = VERSION_RE.match(self.version)
        return int(m.group(1)) if m else 0

    @property
    def server_alive(self) -> bool:
        """The recorded server process still runs (and is still our server: a pid recorded
        long ago may have been recycled); False for a version served on Kubernetes, which has
        no process here."""
        return bool(self.pid) and is_alive(self.pid) and runs_command(
            int(self.pid or 0), ["--port", str(self.port)])

    @property
    def alive(self) -> bool:
        """The version serves here: its server runs and, on a shared engine, its adapter is
        loaded (an engine that does not answer the question counts as serving it)."""
        if not self.server_alive:
            return False
        if not self.engine:
            return True
        adapters = served_adapters(self.endpoint, base_name(self.engine))
        return adapters is None or self.adapter in adapters

    def row(self, **changes: Any) -> dict[str, Any]:
        values = {k: getattr(self, k) for k in self.__dataclass_fields__}
        values.update(changes)
        values["updated_at"] = datetime.now(UTC)
        return values

    def as_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        for k, v in out.items():
            if isinstance(v, datetime):
                out[k] = v.isoformat()
        return out


def route_model(name: str) -> str:
    """The stable model name clients send for deployment ``name``."""
    return f"{ROUTE_PREFIX}{name}"


def check_name(name: str) -> str:
    """``name`` itself, or ``ValueError`` (``factory/<name>`` is accepted and stripped)."""
    if name.startswith(ROUTE_PREFIX):
        name = name[len(ROUTE_PREFIX):]
    if not NAME_RE.match(name):
        raise ValueError(f"deployment name {name!r}: use lowercase letters, digits, '-' and "
                         "'_' (an experiment name), at most 64 characters")
    return name


def _adapter_base(path: Path) -> str:
    cfg = path / "adapter_config.json"
    if not cfg.is_file():
        raise DeploymentError(f"checkpoint {str(path)!r} has no adapter_config.json: not a "
                              "LoRA adapter directory")
    try:
        base = json.loads(cfg.read_text())["base_model_name_or_path"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise DeploymentError(f"{cfg}: no base_model_name_or_path ({e})") from None
    if not isinstance(base, str) or not base:
        raise DeploymentError(f"{cfg}: base_model_name_or_path is empty")
    return base


class Deployer:
    """Deploys, retires and rolls back versions of named deployments.

    ``host`` runs the servers (default: detached processes on this machine, ``ProcessHost``).
    ``session`` stamps writes with a Dagster run and asset (lineage); without one the writes are
    stamped as the CLI's.
    """

    def __init__(self, lake: Lake | None = None, config: DeployConfig | None = None, *,
                 session: LakeSession | None = None, host: ServerHost | None = None) -> None:
        self.config = config or DeployConfig()
        self.config.validate()
        if session is None:
            lake = lake or Lake()
            session = lake.session(run_id=f"cli-{uuid.uuid4().hex[:12]}", asset_key="deployment")
        self.session = session
        self.lake = session.lake
        self.root = self.lake.settings.home / "deployments"
        self.host = host or ProcessHost(listen=self.config.host, log_root=self.root)
        self.serving_size: ServingSize | None = None
        """How the last server this deployer started was sized, and why."""

    # -- reading state -----------------------------------------------------------------------------
    def versions(self, name: str | None = None) -> list[Deployment]:
        """Every version (its latest row), newest first; one deployment or all."""
        if not self.lake.exists("deployments"):
            return []
        # Read without lineage: the state table is not an input of the deployment it records.
        rows = self.lake.sql(
            "SELECT * FROM deployments QUALIFY row_number() OVER (PARTITION BY name, version "
            "ORDER BY updated_at DESC) = 1").to_pylist()
        out = [Deployment(**{k: r.get(k) for k in Deployment.__dataclass_fields__})
               for r in rows if name is None or r["name"] == name]
        out.sort(key=lambda d: (d.name, -d.number))
        return out

    def live(self, name: str) -> Deployment | None:
        """The version serving ``factory/<name>`` (recorded live), if any."""
        live = [d for d in self.versions(name) if d.status == LIVE]
        return max(live, key=lambda d: d.updated_at or datetime.min.replace(tzinfo=UTC)) \
            if live else None

    # -- choosing a checkpoint -------------------------------------------------------------------
    def resolve(self, name: str, checkpoint: str | None = None) -> Checkpoint:
        """The checkpoint to serve: ``None`` = the experiment's best checkpoint, ``RUN:STEP`` =
        that verified row of ``checkpoints``, anything else = an adapter directory."""
        if not checkpoint:
            if not self.lake.exists("best_checkpoints"):
                raise DeploymentError(f"no best checkpoint for {name!r}: materialize "
                                      "best_checkpoint first, or pass --checkpoint PATH|RUN:STEP")
            rows = self.session.sql(
                "SELECT run_id, step, path FROM best_checkpoints WHERE experiment = ? "
                "ORDER BY selected_at DESC LIMIT 1", [name]).to_pylist()
            if not rows:
                raise DeploymentError(f"no best checkpoint for {name!r}: materialize "
                                      "best_checkpoint first, or pass --checkpoint PATH|RUN:STEP")
            path = Path(rows[0]["path"])
            return Checkpoint(path=str(path), base_model=self._base_of(path),
                              run_id=rows[0]["run_id"], step=rows[0]["step"], source="best")
        m = CHECKPOINT_KEY_RE.match(checkpoint)
        if m and not Path(checkpoint).exists():
            key_run, key_step = m.group(1), int(m.group(2))
            rows = self.session.sql(
                "SELECT path FROM checkpoints WHERE run_id = ? AND step = ? AND verified "
                "ORDER BY received_at DESC LIMIT 1", [key_run, key_step]).to_pylist() \
                if self.lake.exists("checkpoints") else []
            if not rows:
                raise DeploymentError(f"checkpoint {checkpoint!r} is not a verified row of "
                                      "checkpoints (RUN:STEP), nor an existing directory")
            path = Path(rows[0]["path"])
            return Checkpoint(path=str(path), base_model=self._base_of(path), run_id=key_run,
                              step=key_step, source="key")
        path = Path(checkpoint).expanduser().absolute()
        if not path.is_dir():
            raise DeploymentError(f"checkpoint {checkpoint!r}: no such directory (give an "
                                  "adapter directory or RUN:STEP)")
        run_id: str | None = None
        step: int | None = None
        if self.lake.exists("checkpoints"):
            rows = self.session.sql("SELECT run_id, step FROM checkpoints WHERE path = ? "
                                    "ORDER BY received_at DESC LIMIT 1", [str(path)]).to_pylist()
            if rows:
                run_id, step = rows[0]["run_id"], rows[0]["step"]
        return Checkpoint(path=str(path), base_model=self._base_of(path), run_id=run_id,
                          step=step)

    def _base_of(self, path: Path) -> str:
        if not path.is_dir():
            raise DeploymentError(f"checkpoint directory {str(path)!r} does not exist")
        base = _adapter_base(path)
        if self.config.backend == "transformers" and not Path(base).is_dir():
            raise DeploymentError(f"base model {base!r} of checkpoint {str(path)!r} is not a "
                                  "local directory (the CPU server loads local models only)")
        return base

    # -- operations ------------------------------------------------------------------------------
    def deploy(self, name: str, checkpoint: str | None = None, *,
               candidate: bool = False,
               structured_outputs: Mapping[str, Any] | None = None) -> Deployment:
        """Serve ``checkpoint`` (default: the best one) as the next version of ``name``.

        ``candidate``: serve it beside the live version without moving ``factory/<name>``
        (status ``candidate``, replacing an earlier candidate); ``promote`` moves the route.
        ``structured_outputs``: the decoding constraint its route adds to requests that send
        none (the closed answer set its run was evaluated under); kept with the version, so a
        promotion or a rollback routes it the same way.
        """
        name = check_name(name)
        with self._lock(name):
            ckpt = self.resolve(name, checkpoint)
            numbers = [d.number for d in self.versions(name)]
            version = f"v{max(numbers, default=0) + 1}"
            return self._launch(name, version, ckpt, candidate=candidate,
                                reason=f"{'candidate' if candidate else 'deploy'} "
                                       f"({ckpt.source})",
                                structured_outputs=json.dumps(dict(structured_outputs),
                                                              sort_keys=True)
                                if structured_outputs else None)

    def candidate(self, name: str) -> Deployment | None:
        """The newest version serving as a candidate, if any."""
        found = [d for d in self.versions(check_name(name)) if d.status == CANDIDATE]
        return max(found, key=lambda d: d.number) if found else None

    def promote(self, name: str, version: str | None = None) -> Deployment:
        """Move ``factory/<name>`` to a candidate (default: the newest) and retire the version
        it replaces."""
        name = check_name(name)
        with self._lock(name):
            candidates = [d for d in self.versions(name) if d.status == CANDIDATE]
            chosen = next((d for d in candidates if d.version == version), None) if version \
                else max(candidates, key=lambda d: d.number, default=None)
            if chosen is None:
                known = ", ".join(d.version for d in candidates) or "none"
                raise DeploymentError(f"{name!r} has no candidate {version or ''} to promote "
                                      f"(candidates: {known}); deploy one with "
                                      f"factory deploy {name} --candidate".replace("  ", " "))
            try:
                running = self._host_of(chosen).running(chosen)
            except HostError as exc:
                raise DeploymentError(str(exc)) from None
            if not running:
                where = f"pid {chosen.pid}" if chosen.pid else chosen.log_path
                raise DeploymentError(f"candidate {name} {chosen.version} is not running "
                                      f"({where}); deploy it again")
            previous = [d for d in self.versions(name)
                        if d.status in ACTIVE and d.status != CANDIDATE]
            self._hosts_of(previous)
            dep = Deployment(**chosen.row(status=LIVE, reason=f"promoted from {CANDIDATE}"))
            self._write([dep.row()])
            register_route(Route(model=dep.route_model, provider="openai",
                                 base_url=dep.endpoint, deployment=dep.adapter,
                                 version=dep.version, structured_outputs=dep.constraint),
                           lake=self.lake, lineage=self.session.lineage)
            self._retire_all(previous, reason=f"replaced by {dep.version} (promoted)")
            return dep

    def undeploy(self, name: str) -> Deployment:
        """Remove the route ``factory/<name>`` and stop the live version."""
        name = check_name(name)
        with self._lock(name):
            live = self.live(name)
            if live is None:
                raise DeploymentError(f"{name!r} has no live deployment")
            active = [d for d in self.versions(name) if d.status in ACTIVE]
            self._hosts_of(active)  # before the route goes: every version can be stopped
            if live.route_model in load_routes(self.lake):
                unregister_route(live.route_model, lake=self.lake, lineage=self.session.lineage)
            stopped = self._retire_all(active, reason="undeployed")
            return next(d for d in stopped if d.version == live.version)

    def rollback(self, name: str, to: str | None = None) -> Deployment:
        """Serve an earlier version again (default: the newest one older than the live one)."""
        name = check_name(name)
        with self._lock(name):
            live = self.live(name)
            if live is None:
                raise DeploymentError(f"{name!r} has no live deployment to roll back; use "
                                      "factory deploy")
            earlier = [d for d in self.versions(name)
                       if d.version != live.version and d.status == "stopped"]
            if to is not None:
                target = next((d for d in earlier if d.version == to), None)
                if target is None:
                    known = ", ".join(d.version for d in earlier) or "none"
                    raise DeploymentError(f"{name!r} has no stopped version {to!r} to roll back "
                                          f"to (stopped versions: {known})")
            else:
                older = [d for d in earlier if d.number < live.number]
                if not older:
                    raise DeploymentError(f"{name!r} has no version older than {live.version} "
                                          "to roll back to")
                target = max(older, key=lambda d: d.number)
            ckpt = Checkpoint(path=target.checkpoint, base_model=self._base_of(
                Path(target.checkpoint)), run_id=target.run_id, step=target.step,
                source="rollback")
            self.resolve(name, target.checkpoint)  # records the checkpoint read for lineage
            return self._launch(name, target.version, ckpt,
                                reason=f"rollback from {live.version}",
                                structured_outputs=target.structured_outputs)

    # -- internals -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        """Serializes the operations on deployment ``name``."""
        with self._file_lock(f"{name}.lock"):
            yield

    @contextlib.contextmanager
    def _file_lock(self, filename: str) -> Iterator[None]:
        """An exclusive lock on ``filename`` in the host's lock folder, for the block."""
        folder = self.host.lock_dir(self.lake.settings.home)
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / filename, "w") as fh:
            fcntl.flock(fh, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    def _write(self, rows: list[dict[str, Any]]) -> None:
        self.session.append("deployments", rows)

    def _launch(self, name: str, version: str, ckpt: Checkpoint, *, reason: str,
                candidate: bool = False, structured_outputs: str | None = None) -> Deployment:
        cfg = self.config
        # Every version still marked active (normally the one live version; more only after a
        # deploy was interrupted) is retired once the new one serves; a new candidate replaces
        # only earlier candidates.
        previous = [d for d in self.versions(name) if d.status in ACTIVE
                    and (not candidate or d.status == CANDIDATE)]
        self._hosts_of(previous)  # before a server starts: each one can be retired after
        adapter = f"{name}-{version}"
        self.serving_size = self.serving_size_of(name, ckpt)
        engine = engine_key(ckpt.base_model, cfg.backend) if self.host.shares_engines else None
        with self._engine_lock(engine):
            join = self._engine(engine) if engine else None
            now = datetime.now(UTC)
            spec = ServerSpec(name=name, version=version, adapter=adapter,
                              checkpoint=ckpt.path, base_model=ckpt.base_model,
                              backend=cfg.backend, sizing=self.serving_size.sizing,
                              threads=cfg.threads, stop_timeout_s=cfg.stop_timeout_s,
                              started_at=now, engine=engine, join=join)
            try:
                placed = self.host.start(spec)
            except HostError as exc:
                raise DeploymentError(self._refused(str(exc), join)) from None
            dep = Deployment(name=name, version=version, checkpoint=ckpt.path,
                             base_model=ckpt.base_model, adapter=adapter,
                             route_model=route_model(name), endpoint=placed.endpoint,
                             backend=cfg.backend, status="starting", pid=placed.pid,
                             port=placed.port, log_path=placed.log_path, run_id=ckpt.run_id,
                             step=ckpt.step, reason=reason, started_at=now,
                             structured_outputs=structured_outputs, engine=placed.engine)
            self._write([dep.row()])
            try:
                self.host.wait_ready(dep, cfg.startup_timeout_s)
            except HostError as exc:
                reason = str(exc)
                try:
                    # A version that started its engine is its only one (the lock is held).
                    self.host.stop(dep, timeout_s=10, last=join is None)
                except HostError as stop_exc:
                    reason += f"\n(and it could not be stopped: {stop_exc})"
                self._write([dep.row(status="failed", reason=reason[:2000],
                                     stopped_at=datetime.now(UTC))])
                raise DeploymentError(reason) from None
            dep = Deployment(**dep.row(status=CANDIDATE if candidate else LIVE))
            self._write([dep.row()])
        if candidate:
            self._retire_all(previous, reason=f"replaced by candidate {version}")
            return dep
        # The route moves only now that the new version answers: no request sees a cold server.
        register_route(Route(model=dep.route_model, provider="openai", base_url=dep.endpoint,
                             deployment=adapter, version=version,
                             structured_outputs=dep.constraint),
                       lake=self.lake, lineage=self.session.lineage)
        self._retire_all(previous, reason=f"replaced by {version}")
        return dep

    @contextlib.contextmanager
    def _engine_lock(self, engine: str | None) -> Iterator[None]:
        """Serializes what starts, joins and stops shared engine ``engine`` (none: no lock),
        so a version never joins an engine its last other version is stopping."""
        if engine is None:
            yield
            return
        with self._file_lock(f"{engine}.engine-lock"):
            yield

    def _engine(self, engine: str) -> Placement | None:
        """The running shared engine ``engine``, from the newest active version on it whose
        engine still runs (``ServerHost.engine_running``); None when there is none (a new one is
        started)."""
        on = sorted((d for d in self.versions() if d.engine == engine and d.status in ACTIVE),
                    key=lambda d: d.updated_at or datetime.min.replace(tzinfo=UTC),
                    reverse=True)
        found = next((d for d in on if self.host.engine_running(d)), None)
        if found is None or found.port is None:
            return None
        return Placement(endpoint=found.endpoint, port=found.port, log_path=found.log_path,
                         pid=found.pid, engine=engine)

    def _refused(self, error: str, join: Placement | None) -> str:
        """A start's error; for an engine that refused an adapter, with what to do: the
        versions on it keep serving, and an engine started for this adapter takes it."""
        if join is None:
            return error
        users = sorted({d.name for d in self.versions()
                        if d.engine == join.engine and d.status in ACTIVE})
        return (f"{error}\nThe versions it serves keep serving. An adapter the engine was not "
                f"started for (a LoRA rank above its maximum) needs a new engine: it starts "
                f"with the next deploy once its versions are undeployed (factory undeploy "
                f"{' / '.join(users) or 'NAME'}), sized for the plan of the checkpoint it "
                f"starts with or by the deployer resource's max_lora_rank.")

    def serving_size_of(self, name: str, ckpt: Checkpoint) -> ServingSize:
        """How the server for ``ckpt`` is sized: ``config.sizing`` if given, else the eval
        serving size of the plan its run was built from (devices, memory share, sequences, LoRA
        rank: what its evals ran with; not the eval set's max length), with
        ``config.overrides`` winning."""
        if self.config.sizing is not None:
            sizing = self.config.sizing
            return ServingSize(sizing=sizing, batch_size=sizing.max_num_seqs,
                           max_new_tokens=DEFAULTS["max_new_tokens"], decisions={"sizing": {
                               "value": repr(sizing), "source": "override",
                               "reason": "override: DeployConfig.sizing"}})
        plan = plan_of_run(self.session, ckpt.run_id, name) if ckpt.run_id else None
        why = f"run {ckpt.run_id} has no plan in training_plans" if ckpt.run_id \
            else "the checkpoint's run is not known"
        return serving_size_for(plan, self.config.overrides, no_plan_reason=why, not_from_plan={
            "max_model_len": "serving: clients' prompts are not bounded by the eval set's "
                             "longest sample, so the default context is kept"})

    def _host_of(self, dep: Deployment) -> ServerHost:
        """The host that follows and stops ``dep``: this deployer's when the version runs where
        it runs servers; a local process needs no configuration to stop, anything else does."""
        placement = placement_of(dep)
        if placement == self.host.kind:
            return self.host
        if placement == PROCESS:
            return ProcessHost(listen=self.config.host, log_root=self.root)
        where = {KUBERNETES: "on Kubernetes"}.get(placement, placement)
        raise DeploymentError(f"{dep.name} {dep.version} runs {where} ({dep.log_path}): act on "
                              f"it with a deployer configured for it (its {placement} "
                              "settings), not this one")

    def _hosts_of(self, deps: list[Deployment]) -> list[ServerHost]:
        return [self._host_of(d) for d in deps]

    def _retire(self, dep: Deployment, *, reason: str) -> Deployment:
        """Drain (the route already moved away) and stop one version."""
        return self._retire_all([dep], reason=reason)[0]

    def _retire_all(self, deps: list[Deployment], *, reason: str) -> list[Deployment]:
        if not deps:
            return []
        hosts = self._hosts_of(deps)
        self._write([d.row(status="draining", reason=reason) for d in deps])
        try:
            running = [(d, h) for d, h in zip(deps, hosts, strict=True) if h.running(d)]
            if running:
                time.sleep(self.config.drain_s)  # one drain for all: gateways re-read routes
            # The versions each shared engine still serves once these are stopped, by the rows.
            on_engine: dict[str, set[tuple[str, str]]] = {}
            for v in self.versions() if any(d.engine for d in deps) else []:
                if v.engine and v.status in ACTIVE:
                    on_engine.setdefault(v.engine, set()).add((v.name, v.version))
            for d, h in running:
                with self._engine_lock(d.engine):
                    others = on_engine.get(d.engine or "", set()) - {(d.name, d.version)}
                    h.stop(d, timeout_s=self.config.stop_timeout_s, last=not others)
                if d.engine:
                    on_engine.get(d.engine, set()).discard((d.name, d.version))
        except HostError as exc:
            # Left draining: the next deploy or undeploy of the name retires them again.
            versions = ", ".join(d.version for d in deps)
            raise DeploymentError(f"retiring {deps[0].name} {versions}: {exc}") from None
        stopped = [Deployment(**d.row(status="stopped", reason=reason,
                                      stopped_at=datetime.now(UTC))) for d in deps]
        self._write([d.row() for d in stopped])
        return stopped
