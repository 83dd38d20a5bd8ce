"""The vision-language path on the tiny random-init Qwen2.5-VL (``build_tiny("qwen2_5_vl")``):
images stored in the blob store go through the model's processor (PIL backend) and render as
its placeholder tokens, the same for curation's counts, the trainer's encode and the server;
training feeds the pixels with the vision tower frozen bitwise; the server answers OpenAI
``image_url`` parts; a missing blob is a counted drop or a clear 400."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import pytest

from factory.blobs import BlobStore
from factory.curation.tokens import RenderCounter
from factory.trainer.chat import CHATML, chat_template
from factory.trainer.vision import (
    IMAGE_PAD,
    blob_path,
    blob_reader,
    has_vision,
    image_text,
    load_vision,
)

pytestmark = pytest.mark.filterwarnings(
    "ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")


@pytest.fixture(scope="module")
def vl_dir() -> Path:
    from factory.trainer.base_models import build_tiny
    from tests.conftest import _models_cache

    return build_tiny("qwen2_5_vl", _models_cache() / "tiny-qwen2_5_vl")


def _png(size: tuple[int, int], colors: list[tuple[int, int, int]]) -> bytes:
    """A PNG of ``size`` (width, height) made of vertical bands of ``colors``."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", size, (255, 255, 255))
    draw = ImageDraw.Draw(img)
    band = size[0] // len(colors)
    for k, color in enumerate(colors):
        draw.rectangle([k * band, 0, (k + 1) * band - 1, size[1] - 1], fill=color)
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


RED_GREEN = _png((56, 84), [(255, 0, 0), (0, 255, 0)])
BLUE_YELLOW = _png((56, 84), [(0, 0, 255), (255, 255, 0)])


def _sample(sha256: str, answer: str = "two squares, red and green") -> dict[str, Any]:
    return {"sample_id": f"s-{sha256[:8]}-{len(answer)}", "tools": [], "messages": [
        {"role": "system", "content": [{"type": "text", "text": "Describe images."}]},
        {"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "media_type": "image/png", "sha256": sha256}]},
        {"role": "assistant", "content": [{"type": "text", "text": answer}]}]}


def test_only_models_with_a_vision_tower_render_images_as_tokens(
        vl_dir: Path, tiny_model_dir: Path, factory_home: Path) -> None:
    assert has_vision(vl_dir) and not has_vision(tiny_model_dir)
    assert load_vision(str(tiny_model_dir), None) is None
    store = BlobStore()
    sha = store.put(RED_GREEN)
    # The trainer reads the store's own layout without importing it.
    assert blob_path(store.root, sha) == store.path(sha)
    assert blob_reader(store.root)(sha) == RED_GREEN
    # A text-only model keeps ``[image]`` (curation and trainer alike).
    counter = RenderCounter(tiny_model_dir)
    counts = counter.count([_sample(sha)["messages"]], [[]])
    from factory.trainer.chat import encode
    from factory.trainer.data import plan_tokenizer

    tok = plan_tokenizer(str(tiny_model_dir))
    ids, _ = encode(_sample(sha)["messages"], [], tok)
    assert counts[0] is not None and counts[0][0] == len(ids)
    assert "[image]" in tok.decode(ids)
    assert tok.chat_template == chat_template(CHATML)


def test_curation_counts_the_trainers_tokens_images_included(vl_dir: Path,
                                                             factory_home: Path) -> None:
    from factory.trainer.data import plan_tokenizer, tokenize
    from factory.trainer.vision import encode

    store = BlobStore()
    shas = [store.put(RED_GREEN), store.put(_png((28, 28), [(9, 9, 9)])),
            store.put(_png((300, 40), [(1, 2, 3), (200, 100, 0), (0, 90, 200)]))]
    missing = "ab" * 32
    samples = [_sample(s) for s in [*shas, missing]]
    tok = plan_tokenizer(str(vl_dir))
    vision = load_vision(str(vl_dir), store.root)
    assert vision is not None
    counter = RenderCounter(vl_dir)
    counts = counter.count([s["messages"] for s in samples], [s["tools"] for s in samples])
    for s, count in zip(samples[:3], counts[:3], strict=True):
        ids, labels, images = encode(s["messages"], s["tools"], tok, vision)
        assert count is not None and count[0] == len(ids)
        (image,) = images
        g = image.grid_thw[0].tolist()
        assert image.num_tokens == g[0] * g[1] * g[2] // 4 == vision.num_tokens(
            s["messages"][1]["content"][1])
        pad = tok.convert_tokens_to_ids(IMAGE_PAD)
        assert ids.count(pad) == image.num_tokens
        assert image_text(image.num_tokens) in tok.decode(ids)
        assert all(lab == -100 for t, lab in zip(ids, labels, strict=True) if t == pad)
    # A missing blob: no count, a named reason (curation); a counted drop (trainer).
    assert counts[3] is None and counter.failures == {3: "missing_image"}
    examples, stats = tokenize(samples, tok, max_seq_len=512, vision=vision)
    assert len(examples) == 3 and stats.num_dropped_by_reason["missing_image"] == 1
    # The Jinja twin writes one pad per image, which the server expands.
    assert chat_template(CHATML, vision=True) == tok.chat_template


def _vl_plan(vl_dir: Path, **over: Any) -> dict[str, Any]:
    plan = {"base_model": str(vl_dir), "max_seq_len": 128, "micro_batch_size": 2,
            "grad_accum_steps": 1, "num_steps": 3, "learning_rate": 5e-2, "warmup_steps": 0,
            "lora_rank": 4, "lora_alpha": 8, "lora_dropout": 0.0, "precision": "fp32",
            "lora_target_modules": ["all-linear"], "frozen_modules": ["model.visual"],
            "checkpoint_every_steps": 3, "seed": 7, "packing": True}
    plan.update(over)
    return plan


def _job(vl_dir: Path, tmp_path: Path, samples: list[dict[str, Any]], blob_dir: Path,
         **over: Any) -> Any:
    from factory.trainer.config import TrainerJob

    payload = tmp_path / "data.jsonl"
    payload.write_text("".join(json.dumps(s) + "\n" for s in samples))
    return TrainerJob.from_dict({"run_id": "vision", "payload_file": str(payload),
                          "plan": _vl_plan(vl_dir, **over), "blob_dir": str(blob_dir),
                          "output_dir": str(tmp_path / "out"), "tracker": {"backend": "none"}})


def test_training_feeds_the_pixels_and_keeps_the_vision_tower_frozen(
        vl_dir: Path, tmp_path: Path, factory_home: Path) -> None:
    import torch

    from factory.trainer.tracking import NullTracker
    from factory.trainer.train import Reporter, Trainer

    torch.set_num_threads(1)  # the tiny models run fastest on one thread; the cores are shared
    store = BlobStore()
    red, blue = store.put(RED_GREEN), store.put(BLUE_YELLOW)
    samples = [_sample(red), _sample(blue, "two squares, blue and yellow"),
               _sample(red, "red and green"), _sample(blue, "blue, yellow"),
               _sample("cd" * 32)]
    job = _job(vl_dir, tmp_path, samples, store.root)
    trainer = Trainer(job)
    trainer.setup()
    assert trainer.data_stats.num_dropped_by_reason["missing_image"] == 1
    batch = trainer.stream.batch(0)
    assert batch.pixel_values is not None and batch.image_grid_thw is not None
    # Packed rows hold several image samples; each has its own 3-D positions.
    assert batch.image_grid_thw.shape[0] == int((batch.input_ids == trainer.loss_module
                                                 .multimodal.config.vision_start_token_id).sum())

    # The loss depends on the image: each image swapped for the other (the same size, so the
    # same tokens) changes it.
    base = trainer.model.get_base_model()
    vision = load_vision(str(vl_dir), store.root)
    assert vision is not None
    red_px, blue_px = (vision.image({"sha256": s}).pixel_values for s in (red, blue))
    chunks = batch.pixel_values.split(red_px.shape[0])
    assert all(torch.equal(c, red_px) or torch.equal(c, blue_px) for c in chunks)
    swapped = torch.cat([blue_px if torch.equal(c, red_px) else red_px for c in chunks])
    with torch.no_grad():
        args = (batch.input_ids, batch.position_ids, batch.attention_mask, batch.labels)
        loss = trainer.loss_module(*args, pixel_values=batch.pixel_values,
                                   image_grid_thw=batch.image_grid_thw)
        other = trainer.loss_module(*args, pixel_values=swapped,
                                    image_grid_thw=batch.image_grid_thw)
    assert float(loss) != float(other)

    # Packed image samples score as they do alone (each segment's own 3-D positions).
    from factory.trainer.data import collate, tokenize

    examples, _ = tokenize(samples[:2], trainer.tokenizer, max_seq_len=128, vision=vision)
    with torch.no_grad():
        packed = collate(examples, [[0, 1]], packed=True, pad_id=0)
        alone = collate(examples, [[0], [1]], packed=False, pad_id=0)
        losses = [trainer.loss_module(b.input_ids, b.position_ids, b.attention_mask, b.labels,
                                      pixel_values=b.pixel_values,
                                      image_grid_thw=b.image_grid_thw)
                  for b in (packed, alone)]
    # fp32 over ~20 label tokens: summation order alone moves the last bits.
    assert torch.allclose(losses[0], losses[1], rtol=1e-5)

    visual = {n: p.detach().clone() for n, p in base.model.visual.named_parameters()}
    lora = {n: p.detach().clone() for n, p in trainer.model.named_parameters()
            if p.requires_grad}
    assert lora and not [n for n in lora if ".visual." in n]
    reporter = Reporter(job, rank=0, tracker=NullTracker())
    try:
        trainer.run(reporter)
    finally:
        trainer.close()
    assert trainer.step == 3
    after = dict(base.model.visual.named_parameters())
    assert visual.keys() == after.keys()
    for name, before in visual.items():
        assert torch.equal(before, after[name].detach()), name
    changed = [n for n, p in trainer.model.named_parameters()
               if p.requires_grad and not torch.equal(lora[n], p.detach())]
    assert changed


def test_the_server_answers_image_url_parts(vl_dir: Path, tmp_path: Path,
                                            factory_home: Path) -> None:
    import httpx

    from factory.inference import InferenceServer
    from factory.trainer.chat import render
    from factory.trainer.data import plan_tokenizer
    from factory.trainer.vision import encode

    store = BlobStore()
    stored = store.put(BLUE_YELLOW)
    url = "data:image/png;base64," + base64.b64encode(RED_GREEN).decode()
    question = [{"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": url}}]}]
    tok = plan_tokenizer(str(vl_dir))
    vision = load_vision(str(vl_dir), store.root)
    assert vision is not None
    with InferenceServer(vl_dir, served_model_name="base", threads=1, startup_timeout_s=240,
                         log_path=tmp_path / "server.log") as server:
        def chat(messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
            return httpx.post(server.base_url + "/chat/completions", timeout=120, json={
                "model": "base", "messages": messages, "max_tokens": 3, "temperature": 0,
                **extra})

        r = chat(question, return_token_ids=True)
        assert r.status_code == 200, r.text
        out = r.json()
        assert isinstance(out["choices"][0]["message"]["content"], str)
        assert len(out["choices"][0]["token_ids"]) >= 1
        # The prompt is the trainer's rendering: the image's pads, as many as its grid gives.
        sha = store.put(RED_GREEN)
        canonical = [{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "media_type": "image/png", "sha256": sha}]},
            {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]
        ids, _, images = encode(canonical, [], tok, vision)
        expected = tok(render(canonical[:1], [], tok, add_generation_prompt=True,
                              image=lambda part: image_text(images[0].num_tokens)),
                       add_special_tokens=False)["input_ids"]
        prompt = out["prompt_token_ids"]
        assert prompt == expected and prompt == ids[:len(prompt)]
        assert prompt.count(tok.convert_tokens_to_ids(IMAGE_PAD)) == images[0].num_tokens

        # The evals' client sends a canonical image as a data URL of its blob (what vLLM
        # takes too), and the server renders the whole conversation as the trainer encodes it.
        client = server.client()
        assert client.image_url is not None
        assert client.rendered_ids("base", canonical) == ids
        with pytest.raises(ValueError, match="not in the blob store"):
            client.chat("base", [{"role": "user", "content": [
                {"type": "image", "media_type": "image/png", "sha256": "ab" * 32}]}])

        # An image the server holds in its blob store, sent canonically, is read from there;
        # the same question with the other image is answered from other pixels.
        lp = {"prompt_logprobs": 0}
        seen = chat([{"role": "user", "content": [
            {"type": "text", "text": "What is in this picture?"},
            {"type": "image", "media_type": "image/png", "sha256": stored}]}], **lp)
        assert seen.status_code == 200, seen.text
        first = chat(question, **lp)
        assert first.status_code == 200
        assert seen.json()["prompt_logprobs"] != first.json()["prompt_logprobs"]

        # A missing blob, or a remote URL (not fetched), is a clear 400.
        missing = chat([{"role": "user", "content": [
            {"type": "image", "media_type": "image/png", "sha256": "ef" * 32}]}])
        assert missing.status_code == 400
        assert "not in the blob store" in missing.json()["error"]["message"]
        remote = chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}}]}])
        assert remote.status_code == 400
        assert "remote image is not fetched" in remote.json()["error"]["message"]


def test_the_wire_carries_images_as_data_urls_only_for_a_vision_model(factory_home: Path
                                                                       ) -> None:
    from factory.normalize.request import image_data_urls, wire_messages

    sha = BlobStore().put(RED_GREEN)
    message = {"role": "user", "content": [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "reasoning", "text": "look"},
        {"type": "image", "media_type": "image/png", "sha256": sha}]}
    [text_only] = wire_messages([message])
    assert text_only["content"] == "What is in this picture?\n<think>\nlook\n</think>\n[image]"
    [vision] = wire_messages([message], image_data_urls(BlobStore().root))
    assert vision["content"] == [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "text", "text": "<think>\nlook\n</think>"},
        {"type": "image_url", "image_url": {
            "url": "data:image/png;base64," + base64.b64encode(RED_GREEN).decode()}}]


def test_the_gate_scores_image_samples_with_their_pixels(vl_dir: Path, tmp_path: Path,
                                                         factory_home: Path) -> None:
    """A checkpoint trained on image samples passes the train/serve gate on them: the server
    gets the pixels (data URLs) and scores the prompt through its chat completion; a trainer
    view that reads other pixels under the same sha256 fails it."""
    import torch

    from factory.evals import check_equivalence
    from factory.inference import InferenceServer
    from factory.trainer.checkpoint import latest_checkpoint
    from factory.trainer.train import ExitCode, run_job

    torch.set_num_threads(1)
    store = BlobStore()
    red, blue = store.put(RED_GREEN), store.put(BLUE_YELLOW)
    samples = [_sample(red), _sample(blue, "two squares, blue and yellow")]
    assert run_job(_job(vl_dir, tmp_path, samples * 2, store.root)) == ExitCode.FINISHED
    info = latest_checkpoint(str(tmp_path / "out"))
    assert info is not None
    # another store whose blob under the red image's sha256 holds the blue image's bytes
    other = tmp_path / "other-blobs"
    blob_path(other, red).parent.mkdir(parents=True)
    blob_path(other, red).write_bytes(BLUE_YELLOW)
    with InferenceServer(vl_dir, served_model_name="base", threads=1, startup_timeout_s=240,
                         log_path=tmp_path / "server.log") as server:
        client = server.client()
        client.load_adapter("ckpt", info.path)
        good = check_equivalence(client, "ckpt", info.path, samples, base_model=str(vl_dir))
        assert good.passed, good.problems
        assert good.num_tokens > 5 and good.max_abs_diff is not None
        bad = check_equivalence(client, "ckpt", info.path, samples[:1], base_model=str(vl_dir),
                                blob_dir=str(other))
    assert not bad.passed and "log-probs differ" in bad.problems[0]

