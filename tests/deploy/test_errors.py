"""Bad deploy input gets one clear error and changes nothing (no server, no row, no route)."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from factory.app.cli import main
from factory.deploy import DeployConfig, Deployer, DeploymentError, check_name
from factory.lake import Lake


def _nothing_changed() -> None:
    lake = Lake()
    assert not lake.exists("deployments") or lake.read("deployments").num_rows == 0
    assert not lake.exists("routes")


def test_names_are_experiment_names() -> None:
    assert check_name("factory/support-bot") == "support-bot"
    for bad in ("", "Upper", "a b", "../x", "x" * 65):
        with pytest.raises(ValueError, match="deployment name"):
            check_name(bad)


def test_checkpoint_choices_are_checked(factory_home: Path, tmp_path: Path,
                                        tiny_model_dir: Path) -> None:
    deployer = Deployer()
    with pytest.raises(DeploymentError, match="no best checkpoint for 'exp'"):
        deployer.deploy("exp")
    with pytest.raises(DeploymentError, match="not a verified row of checkpoints"):
        deployer.deploy("exp", "run-1:20")
    with pytest.raises(DeploymentError, match="no such directory"):
        deployer.deploy("exp", str(tmp_path / "missing"))
    with pytest.raises(DeploymentError, match="no adapter_config.json"):
        deployer.deploy("exp", str(tmp_path))
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tmp_path / "no-base")}))
    with pytest.raises(DeploymentError, match="is not a local directory"):
        deployer.deploy("exp", str(adapter))
    with pytest.raises(DeploymentError, match="has no live deployment"):
        deployer.undeploy("exp")
    with pytest.raises(DeploymentError, match="no live deployment to roll back"):
        deployer.rollback("exp")
    _nothing_changed()

    # RUN:STEP and the best checkpoint resolve through the lake, with the run and step.
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    now = datetime.now(UTC)
    Lake().append("checkpoints", [{"run_id": "run-1", "experiment": "exp", "step": 20,
                                   "path": str(adapter), "manifest_sha256": "0" * 64,
                                   "verified": True, "received_at": now, "event_id": "e"}])
    by_key = deployer.resolve("exp", "run-1:20")
    assert (by_key.path, by_key.run_id, by_key.step, by_key.source) == (
        str(adapter), "run-1", 20, "key")
    by_path = deployer.resolve("exp", str(adapter))
    assert (by_path.run_id, by_path.step, by_path.base_model) == ("run-1", 20,
                                                                  str(tiny_model_dir))


def test_a_server_that_cannot_start_is_a_clear_error(factory_home: Path, tmp_path: Path,
                                                     tiny_model_dir: Path,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(
        json.dumps({"base_model_name_or_path": str(tiny_model_dir)}))
    # A vLLM that is not there (a Python that does not exist): the vllm backend refuses to
    # start, naming the fix, before anything is recorded.
    monkeypatch.setenv("FACTORY_VLLM_PYTHON", str(tmp_path / "no-such-venv" / "bin" / "python"))
    deployer = Deployer(config=DeployConfig(backend="vllm"))
    with pytest.raises(DeploymentError, match="cannot start the vllm server: .*`make vllm`"):
        deployer.deploy("exp", str(adapter))
    _nothing_changed()


def test_cli_prints_one_line_errors(factory_home: Path, capsys: pytest.CaptureFixture[str]
                                    ) -> None:
    assert main(["deploy", "Bad Name"]) == 2
    assert main(["rollback", "exp"]) == 2
    assert main(["deployments", "--format", "json"]) == 0
    captured = capsys.readouterr()
    assert "factory deploy: error: deployment name 'Bad Name'" in captured.err
    assert "factory rollback: error: 'exp' has no live deployment" in captured.err
    assert json.loads(captured.out.strip()) == []
    with pytest.raises(ValueError, match="backend"):
        DeployConfig(backend="tgi").validate()


def test_run_refuses_an_unknown_experiment(factory_home: Path, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("FACTORY_EXPERIMENTS_DIR", str(tmp_path))
    assert main(["run", "nope"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("factory run: error:") and "nope" in err[0]


def test_replay_upstream_and_chat_through_the_gateway(factory_home: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    """The demo's upstream answers recorded requests with their reference answers (streamed
    or not) through the gateway, and `factory chat -m` prints the streamed answer."""
    import openai

    from factory.deploy.replay import ReplayUpstream
    from factory.gateway import ServerThread, gateway_in_thread
    from factory.tasks import generate_records

    records = generate_records(3, 7)
    with ServerThread(ReplayUpstream(records)) as upstream:
        gateway = gateway_in_thread(openai_base_url=upstream.url + "/v1", flush=False)
        try:
            client = openai.OpenAI(base_url=gateway.url + "/v1", api_key="k", max_retries=0)
            request = records[0]["request"]
            reference = records[0]["response"]["choices"][0]["message"]["content"]
            answer = client.chat.completions.create(model="m", messages=request["messages"])
            assert answer.choices[0].message.content == reference
            stream = client.chat.completions.create(model="m", messages=request["messages"],
                                                    stream=True)
            assert "".join(c.choices[0].delta.content or "" for c in stream
                           if c.choices) == reference
            with pytest.raises(openai.NotFoundError, match="no recorded answer"):
                client.chat.completions.create(
                    model="m", messages=[{"role": "user", "content": "unseen"}])

            prompt = records[1]["request"]["messages"][-1]["content"]
            system = records[1]["request"]["messages"][0]["content"]
            assert main(["chat", "m", "-m", prompt, "--system", system,
                         "--gateway", gateway.url]) == 0
            out = capsys.readouterr().out
            assert out.strip() == records[1]["response"]["choices"][0]["message"]["content"]
        finally:
            gateway.stop()
    assert main(["chat", "m", "-m", "hi", "--gateway", gateway.url]) == 2
    assert "cannot reach" in capsys.readouterr().err
