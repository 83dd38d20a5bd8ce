"""Runs pin their code (``factory.codepin``).

End to end on a copy of the factory's tree (the checkout's own files are never edited): a real
``dagster dev`` (webserver, daemon, code server) serves a code location of two assets that pins
the copy's code as ``factory/definitions.py`` does, and runs are created as ``factory run``
submits and as the UI's buttons launch. A run whose tree stays as it was succeeds; a module
edited while a run's first step works fails the second step, before it works, naming the file
and the fix; a run launched afterwards from the code location that still holds the old code
fails at once; reloaded, the code location's runs succeed again. Below, the pure parts:
manifests, fingerprints, the pin as Dagster's loads take it, and runs without a pin.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from dagster._core.definitions.definitions_load_context import (
    DefinitionsLoadContext,
    DefinitionsLoadType,
)
from dagster._core.definitions.metadata.metadata_value import (
    CodeLocationReconstructionMetadataValue,
)
from dagster._core.definitions.repository_definition import RepositoryLoadData

from factory import codepin
from factory.app.client import REQUEST_TAG
from factory.app.instance import instance
from factory.codepin import CodeChangedError
from factory.dagster_runs import FINISHED, failure_message
from tests.app import code_pin_location
from tests.deploy.dagster_ui import LAUNCH, LOCATIONS, free_port, gql
from tests.waiting import wait_until

ROOT = Path(__file__).resolve().parents[2]
LOCATION_FILE = Path(code_pin_location.__file__)
LINKED = ("assets", "resources", "sensors", "trainer", "kernels")
"""The top-level folders ``factory/`` links to."""
RELOAD = """mutation($name: String!) { reloadRepositoryLocation(repositoryLocationName: $name) {
  __typename ... on WorkspaceLocationEntry { locationOrLoadError { __typename } } } }"""


@pytest.fixture(autouse=True)
def no_pin(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process imports the definitions as a plain module: it holds no pin, and a test
    that takes one leaves none behind."""
    monkeypatch.setattr(codepin, "_pin", None)


def copy_tree(dest: Path) -> Path:
    """A copy of the checkout's ``factory`` package with the folders it links to; its root."""
    ignore = shutil.ignore_patterns("__pycache__")
    shutil.copytree(ROOT / "factory", dest / "factory", symlinks=True, ignore=ignore)
    for name in LINKED:
        shutil.copytree(ROOT / name, dest / name, ignore=ignore)
    return dest


@dataclass
class DevServer:
    """``dagster dev`` on the test location: its GraphQL URL and the location's names."""

    url: str
    location: str
    repo: str

    def launch(self, job: str, assets: list[str] | None = None) -> str:
        """What a click on Launch (``job``) or on Materialize (``__ASSET_JOB`` with the
        selected ``assets``) sends; the new run's id."""
        selector: dict[str, Any] = {"repositoryLocationName": self.location,
                                    "repositoryName": self.repo, "jobName": job}
        if assets is not None:
            selector["assetSelection"] = [{"path": [a]} for a in assets]
        launched = gql(self.url, LAUNCH, {"p": {"selector": selector, "runConfigData": {}}})
        assert launched["launchRun"]["__typename"] == "LaunchRunSuccess", launched
        return str(launched["launchRun"]["run"]["runId"])

    def loaded(self) -> bool:
        entries = gql(self.url, LOCATIONS)["workspaceOrError"]["locationEntries"]
        for entry in entries:
            loc = entry["locationOrLoadError"]
            assert not loc or loc["__typename"] != "PythonError", loc
            if loc and loc["__typename"] == "RepositoryLocation":
                self.location, self.repo = entry["name"], loc["repositories"][0]["name"]
                return True
        return False

    def reload(self) -> None:
        """The UI's Deployment > Reload of the location."""
        gql(self.url, RELOAD, {"name": self.location})
        wait_until(self.loaded, 120, what="the reloaded code location")


@dataclass
class Site:
    """A running ``dagster dev`` on the test location, the copied tree it loads and the gate
    its ``first`` step waits at."""

    server: DevServer
    tree: Path
    gate: Path
    inst: Any
    env: dict[str, str]

    def submit(self, job: str) -> str:
        """Queue a run of ``job`` as ``factory run`` submits its chain's first run (``dagster
        job launch``, which loads the code location itself); the run's id."""
        import dagster as dg

        request = uuid.uuid4().hex
        subprocess.run([sys.executable, "-m", "dagster", "job", "launch", "-f",
                        str(LOCATION_FILE), "-d", str(self.tree), "-j", job,
                        "--tags", json.dumps({REQUEST_TAG: request})],
                       cwd=self.tree, env=self.env, check=True, capture_output=True)
        [run] = self.inst.get_runs(filters=dg.RunsFilter(tags={REQUEST_TAG: request}))
        return str(run.run_id)

    def through_gate(self, run_id: str, mid_run: Callable[[], object] | None = None) -> None:
        """Once ``first`` of run ``run_id`` has passed its check and waits at the gate, call
        ``mid_run`` and let the step go on."""
        def waiting() -> tuple[int] | None:
            try:
                return (os.open(self.gate, os.O_WRONLY | os.O_NONBLOCK),)
            except OSError as exc:  # ENXIO: no reader yet
                if exc.errno != errno.ENXIO:
                    raise
            run = self.inst.get_run_by_id(run_id)
            assert run is None or run.status not in FINISHED, failure_message(self.inst, run_id)
            return None

        opened = wait_until(waiting, 240, what=f"run {run_id}'s first step at the gate")
        assert opened is not None
        fd = opened[0]
        try:
            if mid_run is not None:
                mid_run()
            os.write(fd, b"go")
        finally:
            os.close(fd)

    def ended(self, run_id: str) -> Any:
        def done() -> Any:
            run = self.inst.get_run_by_id(run_id)
            return run if run is not None and run.status in FINISHED else None
        return wait_until(done, 240, what=f"run {run_id} to end")

    def pin(self, run_id: str) -> str:
        """The code a run was created with: its code location's reconstruction metadata,
        stored with the run's execution plan."""
        run = self.inst.get_run_by_id(run_id)
        plan = self.inst.get_execution_plan_snapshot(run.execution_plan_snapshot_id)
        value = plan.repository_load_data.reconstruction_metadata[codepin.PIN_KEY]
        return str(getattr(value, "data", value))

    def steps(self, run_id: str, kind: str) -> list[str]:
        import dagster as dg

        return [e.step_key for e in self.inst.all_logs(
            run_id, of_type=getattr(dg.DagsterEventType, kind))]


@pytest.fixture()
def site(factory_home: Path, tmp_path: Path) -> Iterator[Site]:
    tree = copy_tree(tmp_path / "tree")
    gate = tmp_path / "gate"
    os.mkfifo(gate)
    inst = instance()  # writes the factory's dagster.yaml: queued runs, launched by the daemon
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(tree), code_pin_location.GATE_ENV: str(gate)}
    log = open(factory_home / "dagster-dev.log", "ab")  # noqa: SIM115 - closed below
    proc = subprocess.Popen(
        [sys.executable, "-m", "dagster", "dev", "-f", str(LOCATION_FILE), "-d", str(tree),
         "-h", "127.0.0.1", "-p", str(port)],
        cwd=tree, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        start_new_session=True)
    try:
        server = DevServer(url=f"http://127.0.0.1:{port}/graphql", location="", repo="")

        def up() -> bool:
            assert proc.poll() is None, (factory_home / "dagster-dev.log").read_text()[-3000:]
            try:
                return server.loaded()
            except (httpx.HTTPError, ValueError, KeyError, TypeError):
                return False

        wait_until(up, 240, what="the test code location in dagster dev")
        yield Site(server=server, tree=tree, gate=gate, inst=inst, env=env)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.mark.slow
def test_a_run_uses_the_code_it_started_with(site: Site, factory_home: Path) -> None:
    loaded = codepin.manifest(site.tree / "factory")
    code = codepin.fingerprint(loaded)
    assert (factory_home / "code" / f"{code}.json").exists()

    # Nothing edited: the run succeeds, pinned to the copy's code.
    run_id = site.submit("pinned_job")
    site.through_gate(run_id)
    assert site.ended(run_id).status.value == "SUCCESS", failure_message(site.inst, run_id)
    assert site.pin(run_id) == code

    # A module the step imports is edited while the first step works (the UI's Materialize):
    # the second step refuses to start, and says which file and what to do.
    edited = site.tree / "factory" / "lake.py"
    run_id = site.server.launch("__ASSET_JOB", assets=["first", "second"])
    site.through_gate(run_id, lambda: edited.write_text(edited.read_text() + "# edited\n"))
    assert site.ended(run_id).status.value == "FAILURE"
    assert site.steps(run_id, "STEP_SUCCESS") == ["first"]
    assert site.steps(run_id, "STEP_FAILURE") == ["second"]
    message = failure_message(site.inst, run_id)
    assert message.startswith("the factory's code changed since this run started "
                              "(changed: factory/lake.py)"), message
    assert "start a new run: a run uses the code it started with" in message

    # The code location still holds the old code: its next run fails at its first step, since
    # its worker imports the edited tree.
    run_id = site.server.launch("pinned_job")
    assert site.ended(run_id).status.value == "FAILURE"
    assert site.steps(run_id, "STEP_FAILURE") == ["first"]
    message = failure_message(site.inst, run_id)
    assert message.startswith("the factory's code changed between the code location's load "
                              "and the start of this run worker (changed: factory/lake.py)")
    assert "reload its code location first" in message

    # Reloaded, as the message says: the code location's runs use the edited code.
    site.server.reload()
    run_id = site.server.launch("__ASSET_JOB", assets=["first", "second"])
    site.through_gate(run_id)
    assert site.ended(run_id).status.value == "SUCCESS", failure_message(site.inst, run_id)
    edited_code = codepin.fingerprint(codepin.manifest(site.tree / "factory"))
    assert edited_code != code and site.pin(run_id) == edited_code


# -- the pure parts, on a small package tree ---------------------------------------------------

def _package(root: Path) -> Path:
    """A tree shaped like the factory's: modules, a subpackage, a linked folder, a bytecode
    cache and a file that is not Python."""
    pkg = root / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "a.py").write_text("A = 1\n")
    (pkg / "sub" / "b.py").write_text("B = 2\n")
    (pkg / "__pycache__").mkdir()
    (pkg / "__pycache__" / "a.cpython-311.pyc").write_bytes(b"\0")
    (pkg / "notes.yaml").write_text("not: code\n")
    (root / "linked").mkdir()
    (root / "linked" / "c.py").write_text("C = 3\n")
    (pkg / "linked").symlink_to("../linked")
    return pkg


def _load(load_type: DefinitionsLoadType, metadata: dict[str, str] | None = None) -> Any:
    """Dagster's load context as a code server (initialization) or a run worker
    (reconstruction, with the reconstruction metadata of the run's code location) sets it."""
    data = None if metadata is None else RepositoryLoadData(reconstruction_metadata={
        k: CodeLocationReconstructionMetadataValue(v) for k, v in metadata.items()})
    return DefinitionsLoadContext.scoped(DefinitionsLoadContext(load_type=load_type,
                                                                repository_load_data=data))


@pytest.fixture()
def pkg(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The small tree, as the package whose code is pinned."""
    root = _package(tmp_path)
    monkeypatch.setattr(codepin, "package_dir", lambda: root)
    return root


def test_the_manifest_hashes_every_python_source_the_links_included(tmp_path: Path) -> None:
    pkg = _package(tmp_path)
    files = codepin.manifest(pkg)
    assert sorted(files) == ["a.py", "linked/c.py", "sub/b.py"]
    assert files["a.py"] == hashlib.sha256(b"A = 1\n").hexdigest()
    code = codepin.fingerprint(files)
    assert len(code) == 16 and codepin.fingerprint(dict(reversed(files.items()))) == code

    (pkg / "notes.yaml").write_text("edited: true\n")
    (pkg / "__pycache__" / "b.cpython-311.pyc").write_bytes(b"\1")
    assert codepin.manifest(pkg) == files  # neither is Python source

    (tmp_path / "linked" / "c.py").write_text("C = 4\n")
    (pkg / "sub" / "new.py").write_text("")
    (pkg / "a.py").unlink()
    after = codepin.manifest(pkg)
    assert codepin.fingerprint(after) != code
    assert codepin.changed_files(files, after) == ["a.py", "linked/c.py", "sub/new.py"]


def test_a_code_location_pins_its_code_and_its_runs_keep_to_it(factory_home: Path,
                                                                pkg: Path) -> None:
    with _load(DefinitionsLoadType.INITIALIZATION) as context:
        code = codepin.pin()
        assert context.get_pending_reconstruction_metadata() == {codepin.PIN_KEY: code}
    assert code == codepin.fingerprint(codepin.manifest(pkg))
    kept = json.loads((factory_home / "code" / f"{code}.json").read_text())
    assert kept == codepin.manifest(pkg)

    # A run it created, in the run's worker: the same tree goes on; an edited one is refused.
    with _load(DefinitionsLoadType.RECONSTRUCTION, {codepin.PIN_KEY: code}):
        assert codepin.pin() == code
    pin = codepin.pinned()
    assert pin is not None and pin.in_run and pin.code == code
    codepin.check_run()
    (pkg / "sub" / "b.py").write_text("B = 2\n# edited\n")
    with pytest.raises(CodeChangedError) as refused:
        codepin.check_run()
    assert str(refused.value) == ("the factory's code changed since this run started "
                                  f"(changed: factory/sub/b.py); {codepin.FIX}")


def test_a_worker_that_imported_other_code_than_its_run_refuses(factory_home: Path,
                                                                pkg: Path) -> None:
    with _load(DefinitionsLoadType.INITIALIZATION):
        code = codepin.pin()
    (pkg / "a.py").write_text("A = 2\n")
    with _load(DefinitionsLoadType.RECONSTRUCTION, {codepin.PIN_KEY: str(code)}):
        codepin.pin()
    with pytest.raises(CodeChangedError, match=r"^the factory's code changed between the code "
                       r"location's load and the start of this run worker \(changed: "
                       r"factory/a\.py\); start a new run"):
        codepin.check_run()


def test_a_code_location_refuses_to_start_processes_on_other_code(factory_home: Path,
                                                                  pkg: Path) -> None:
    with _load(DefinitionsLoadType.INITIALIZATION):
        codepin.pin()
    added = pkg / "sub" / "more.py"
    added.write_text("")
    codepin.check_run()  # its sensors' ticks go on: the runs they request carry its version
    with pytest.raises(CodeChangedError, match=r"since this code location started \(changed: "
                                               r"factory/sub/more\.py\)"):
        codepin.check()
    added.unlink()
    codepin.check()


def test_many_changes_are_counted_and_an_unknown_manifest_is_said(factory_home: Path,
                                                                  pkg: Path) -> None:
    with _load(DefinitionsLoadType.RECONSTRUCTION, {codepin.PIN_KEY: "0123456789abcdef"}):
        codepin.pin()  # a run from a code location on another node: no manifest here
    with pytest.raises(CodeChangedError, match="the changed files are not named: no manifest "
                                               "of the run's code on this node"):
        codepin.check_run()

    with _load(DefinitionsLoadType.INITIALIZATION):
        codepin.pin()
    for i in range(codepin.MAX_NAMED + 2):
        (pkg / f"m{i}.py").write_text("")
    with pytest.raises(CodeChangedError, match=r"\(changed: factory/m0\.py, factory/m1\.py, "
                                               r"factory/m2\.py, factory/m3\.py, "
                                               r"factory/m4\.py and 2 more\)"):
        codepin.check()


def test_only_the_most_recently_loaded_manifests_are_kept(factory_home: Path) -> None:
    versions = [{"m.py": f"{i:064x}"} for i in range(5)]
    paths = [codepin.save_manifest(v, keep=3) for v in versions[:3]]
    codepin.save_manifest(versions[0], keep=3)  # loaded again: the newest now
    codepin.save_manifest(versions[3], keep=3)
    kept = {p.name for p in (factory_home / codepin.MANIFEST_DIR).glob("*.json")}
    assert kept == {paths[0].name, paths[2].name, codepin.manifest_path(
        codepin.fingerprint(versions[3])).name}
    assert codepin.load_manifest(codepin.fingerprint(versions[1])) is None
    assert codepin.load_manifest(codepin.fingerprint(versions[0])) == versions[0]


def test_nothing_pinned_refuses_nothing(factory_home: Path, pkg: Path,
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    # A plain import (tests, the CLI's in-process materializations): no load context.
    monkeypatch.setattr(DefinitionsLoadContext, "_instance", None)
    assert codepin.pin() is None
    # A run whose code location pinned nothing (an older one), or a reconstruction without
    # a run (``dagster asset materialize``).
    for metadata in ({"other": "x"}, None):
        with _load(DefinitionsLoadType.RECONSTRUCTION, metadata):
            assert codepin.pin() is None
    assert codepin.pinned() is None
    (pkg / "a.py").write_text("A = 5\n")
    codepin.check_run()
    codepin.check()
    assert not (factory_home / "code").exists()


@pytest.mark.slow
def test_the_composition_root_pins_when_loaded_as_a_code_location(factory_home: Path) -> None:
    """``factory.definitions`` loaded as Dagster loads a code location: its reconstruction
    metadata carries the fingerprint of the code it imported."""
    script = (
        "from dagster._core.code_pointer import CodePointer\n"
        "from dagster._core.definitions.reconstruct import "
        "initialize_repository_def_from_pointer\n"
        "repo = initialize_repository_def_from_pointer("
        "CodePointer.from_module('factory.definitions', 'defs', None))\n"
        "import factory.definitions\n"
        "value = repo.repository_load_data.reconstruction_metadata['factory/code']\n"
        "print(factory.definitions.CODE, getattr(value, 'data', value))\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         check=True, cwd=factory_home)
    code, carried = out.stdout.split()
    assert code == carried
    assert (factory_home / "code" / f"{code}.json").exists()
