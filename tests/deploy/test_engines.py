"""One engine per base model on this machine: every deployed version of every experiment is an
adapter of the same server process. A second experiment and a new version are adapter loads
into it, a retired version's adapter is unloaded, a rollback loads the old adapter again, an
adapter the engine refuses fails its deploy with the reason while the versions on it keep
serving, and the engine stops with its last adapter."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import httpx
import pytest

from factory.deploy import DeployConfig, Deployer, DeploymentError
from factory.process import is_alive
from tests.inference.conftest import make_adapter

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
MESSAGES = [{"role": "user", "content": "Extract the fields: Hi, I am Ana from Acme."}]


@pytest.fixture()
def models(factory_home: Path, tiny_model_dir: Path, tmp_path: Path) -> dict[str, Path]:
    """Two adapters of the tiny model (the second naming it through a link, as a trainer whose
    models folder links to it does) and one whose config names layers it does not have."""
    a = make_adapter(tiny_model_dir, tmp_path / "a", seed=1)
    b = make_adapter(tiny_model_dir, tmp_path / "b", seed=2)
    link = tmp_path / "models" / "smollm2-135m-instruct"
    link.parent.mkdir()
    link.symlink_to(tiny_model_dir)
    config = json.loads((b / "adapter_config.json").read_text())
    (b / "adapter_config.json").write_text(json.dumps({**config,
                                                       "base_model_name_or_path": str(link)}))
    broken = tmp_path / "broken"
    shutil.copytree(a, broken)
    config = json.loads((broken / "adapter_config.json").read_text())
    config["target_modules"] = ["no_such_proj"]
    (broken / "adapter_config.json").write_text(json.dumps(config))
    return {"a": a, "b": b, "broken": broken}


def _served(endpoint: str) -> list[str]:
    listed = httpx.get(endpoint + "/models", timeout=30).json()["data"]
    return sorted(m["id"] for m in listed if m.get("parent"))


def _answers(endpoint: str, model: str) -> str:
    reply = httpx.post(endpoint + "/chat/completions", timeout=120,
                       json={"model": model, "messages": MESSAGES, "max_tokens": 4})
    assert reply.status_code == 200, reply.text
    return str(reply.json()["model"])


def test_versions_of_one_base_are_adapters_of_one_engine(models: dict[str, Path]) -> None:
    deployer = Deployer(config=DeployConfig(threads=1, drain_s=0.0))
    a1 = deployer.deploy("alpha", str(models["a"]))
    assert a1.engine and a1.engine.startswith("transformers-tiny") and is_alive(a1.pid)
    # Another experiment on the same base (named through a link): its adapter joins the
    # running engine.
    b1 = deployer.deploy("beta", str(models["b"]))
    assert (b1.engine, b1.pid, b1.endpoint) == (a1.engine, a1.pid, a1.endpoint)
    assert _served(a1.endpoint) == ["alpha-v1", "beta-v1"]
    # A new version: an adapter load, then the route moves and v1's adapter is unloaded.
    a2 = deployer.deploy("alpha", str(models["b"]))
    assert a2.pid == a1.pid and _served(a1.endpoint) == ["alpha-v2", "beta-v1"]
    assert _answers(a1.endpoint, "alpha-v2") == "alpha-v2"
    assert _answers(a1.endpoint, "beta-v1") == "beta-v1"
    versions = {(d.name, d.version): d for d in deployer.versions()}
    assert versions[("alpha", "v1")].status == "stopped" and not versions[("alpha", "v1")].alive
    assert versions[("alpha", "v2")].alive and versions[("beta", "v1")].alive

    # An adapter the engine refuses: the deploy fails saying why and what to do; nothing that
    # serves is touched.
    with pytest.raises(DeploymentError) as refused:
        deployer.deploy("beta", str(models["broken"]))
    message = str(refused.value)
    assert "refused adapter beta-v2" in message and "no_such_proj" in message
    assert "keep serving" in message and "factory undeploy alpha / beta" in message
    assert deployer.live("beta") == versions[("beta", "v1")]
    assert _answers(a1.endpoint, "beta-v1") == "beta-v1"

    # Rollback: v1's adapter loaded into the same engine again, in seconds (no server start),
    # even where a failed unload left another checkpoint under v1's name.
    httpx.post(a1.endpoint + "/load_lora_adapter", timeout=60,
               json={"lora_name": "alpha-v1", "lora_path": str(models["b"])}).raise_for_status()
    started = time.monotonic()
    back = deployer.rollback("alpha")
    assert back.version == "v1" and back.pid == a1.pid and time.monotonic() - started < 30
    assert _served(a1.endpoint) == ["alpha-v1", "beta-v1"]
    roots = {m["id"]: m["root"] for m in httpx.get(a1.endpoint + "/models").json()["data"]}
    assert roots["alpha-v1"] == str(models["a"])

    # The engine outlives every version but its last.
    deployer.undeploy("alpha")
    assert is_alive(a1.pid) and _served(a1.endpoint) == ["beta-v1"]
    deployer.undeploy("beta")
    deadline = time.monotonic() + 60
    while is_alive(a1.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not is_alive(a1.pid)


def test_an_engine_that_stops_answering_is_stopped_with_its_last_version(
        models: dict[str, Path]) -> None:
    """A hung engine cannot say which adapters it serves: while another version's row names it,
    it is kept; once none does, undeploying the last version stops it (no process left)."""
    import os
    import signal

    deployer = Deployer(config=DeployConfig(threads=1, drain_s=0.0, stop_timeout_s=2.0))
    a1 = deployer.deploy("alpha", str(models["a"]))
    deployer.deploy("beta", str(models["b"]))
    assert a1.pid is not None
    os.kill(a1.pid, signal.SIGSTOP)  # it keeps its port and answers nothing
    try:
        deployer.undeploy("alpha")
        assert is_alive(a1.pid)  # beta's row still names it
        deployer.undeploy("beta")
        deadline = time.monotonic() + 60
        while is_alive(a1.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_alive(a1.pid)
    finally:
        if is_alive(a1.pid):
            os.kill(a1.pid, signal.SIGCONT)
            os.killpg(a1.pid, signal.SIGKILL)
    assert {d.status for d in deployer.versions()} == {"stopped"}
