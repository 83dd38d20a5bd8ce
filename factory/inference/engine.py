"""The CPU inference engine: one transformers base model, any number of PEFT LoRA adapters.

Prompts are rendered with the chat template of the tokenizer that belongs to the model asked
for: an adapter directory written by the trainer carries its tokenizer and the trainer's
template of its chat format (the Jinja twin of ``factory.trainer.chat.render``), and the base model is
served with the template of its tokenizer's format unless told otherwise. Generation stops at
the tokenizer's end-of-sequence token and at the format's end-of-turn token. This is what vLLM does too (``--chat-template``), and
it is why a checkpoint with a wrong template shows up in the train/serve equivalence check
instead of silently serving a different prompt than the one trained on.

A vision-language base model (``factory.trainer.vision.has_vision``) takes images: a request's
image parts go through the model's processor (``Engine.vision``), the template's one
``<|image_pad|>`` per image is expanded to the image's tokens (the trainer's rendering), and the
pixels are fed with the prompt, with Qwen2.5-VL's 3-D rotary positions from the model's
``get_rope_index``. A text-only model renders an image as ``[image]``, as it was trained.

Generation is a hand-written KV-cached loop over a left-padded batch (greedy, or sampled when a
request sets ``temperature > 0``), so one pass serves several requests, streams tokens as they
come, and reads each token's log-probability at no extra cost. A request's ``constraint``
(``factory.inference.constrain``: a choice, a JSON Schema) masks the tokens its row may pick,
each row on its own, so constrained and free requests share a batch. Requests for the same
model are batched together by ``BatchScheduler``; the model itself is used by one thread at a
time.

Prompts that start the same way share their keys and values (``PrefixCache``): a request whose
prompt begins with a recent prompt's first tokens (the system prompt and tools block a task's
requests all carry) prefills only the rest of it, on its own or in a batch whose rows all share
that prefix. Greedy outputs are the same token ids with the cache and without
(tests/inference/test_prefix_cache.py, on the tiny model and on SmolLM2's real weights).

A greedy request served alone checks several tokens a forward pass (prompt lookup decoding, as
vLLM's ``ngram`` speculative method): what followed the latest earlier occurrence of the text's
last tokens is fed as a draft with the token just chosen, and is kept for as long as it agrees
with what the model chooses at each position. A tool call's names and keys come from the tools
block, its values from the user's turn, so a draft often holds; a pass of several tokens costs
less than as many passes of one (reading the weights once). Before the prompt, the model's own
recent completions are looked in (as suffix decoding does): answers to one task share their
format, so what followed the answer's last tokens in the latest completion that holds them is
drafted, up to ``RECENT_LOOKUP_TOKENS``. The outputs are the tokens one-a-pass decoding chooses
(tests/inference/test_prompt_lookup.py).

A decode pass reads every weight for a handful of tokens: with ``bf16_linears`` (the server's
``--bf16-linears``, off by default) generation runs the linear layers from bf16 copies of their
weights packed for oneDNN (``Bf16Linears``), half the bytes a pass.
"""

from __future__ import annotations

import contextlib
import hashlib
import threading
import warnings
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from factory.blobs import BlobStore
from factory.trainer.chat import chat_format, chat_template
from factory.trainer.cores import CoreShare
from factory.trainer.model import auto_model_class
from factory.trainer.precision import cpu_bf16
from factory.trainer.progress import quiet_progress_bars
from factory.trainer.token_rows import fast_token_rows
from factory.trainer.vision import ImageInput, Vision, blob_reader, has_vision, stack

TokenCallback = Callable[[int, str], None]
"""Called with (token id, text delta) for every generated token of one request."""


class EngineError(ValueError):
    """A request the engine cannot serve (unknown model, bad adapter, prompt too long)."""


class TokenConstraint(Protocol):
    """What a request's tokens may be (``factory.inference.constrain``): asked before each
    token is picked, told the token picked."""

    def mask(self) -> torch.Tensor:
        """The tokens allowed next: a bool tensor over the tokenizer's ids."""

    def advance(self, token_id: int) -> None:
        """``token_id`` was generated."""


@dataclass(kw_only=True)
class GenerationRequest:
    """One completion to generate."""

    model: str
    """Served model name: the base model's or a loaded adapter's."""
    prompt_ids: list[int]
    """Token ids of the rendered prompt."""
    max_tokens: int = 256
    """Most new tokens."""
    temperature: float = 0.0
    """0 is greedy; above 0 samples from the tempered distribution."""
    top_p: float = 1.0
    """Nucleus sampling mass (only when sampling)."""
    seed: int | None = None
    """Seed of this request's sampling generator."""
    stop: list[str] = field(default_factory=list)
    """Strings that end the completion (not included in it)."""
    top_logprobs: int | None = None
    """None: no log-probs; k >= 0: the chosen token's log-prob plus the k most likely."""
    images: list[ImageInput] = field(default_factory=list)
    """The prompt's images in the order of their tokens (a vision model's requests only)."""
    on_token: TokenCallback | None = None
    """Streaming callback."""
    constraint: TokenConstraint | None = None
    """Tokens outside its mask are never picked (None: unconstrained). Log-probs stay the
    model's own, before the mask, as vLLM reports them."""


@dataclass(kw_only=True)
class GenerationResult:
    """What one request produced."""

    text: str
    """Completion text (stop string and end-of-turn token excluded)."""
    token_ids: list[int]
    """Generated token ids, including a final end-of-turn token if one was produced."""
    finish_reason: str
    """``stop`` (end-of-turn token or stop string) or ``length``."""
    num_prompt_tokens: int
    """Prompt length in tokens."""
    logprobs: list[TokenLogprob] | None = None
    """Per generated token: its log-prob, rank and the most likely alternatives (when asked)."""


@dataclass(frozen=True, kw_only=True)
class TokenLogprob:
    """One position's log-probs, as vLLM's engine reports them (the server writes them in the
    response's shape, ``factory.inference.contract``)."""

    token_id: int
    """The token at this position (generated, or given in the prompt)."""
    logprob: float
    """Its log-probability given the tokens before it."""
    rank: int
    """1 + the number of tokens more likely than it at this position."""
    top: list[tuple[int, float]] = field(default_factory=list)
    """The k most likely tokens at this position and their log-probs, most likely first."""


def _load_tokenizer(path: str | Path, template: str | None, *, vision: bool = False) -> Any:
    """The tokenizer in ``path`` with ``template``: a Jinja string, ``"trainer"`` (the trainer's
    template of its format; ``vision``: of a vision model), or None (its own template, the
    trainer's when it ships none)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    if template == "trainer" or (template is None and not getattr(tok, "chat_template", None)):
        tok.chat_template = chat_template(chat_format(tok), vision=vision)
    elif template is not None:
        tok.chat_template = template
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                    "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt",
                    "tokenizer.model")


def _tokenizer_digest(path: Path) -> str:
    """The sha256 of the tokenizer files in ``path``: equal digests, the same tokenizer."""
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        file = path / name
        if file.is_file():
            digest.update(name.encode() + b"\0" + file.read_bytes() + b"\0")
    return digest.hexdigest()


def _peft_name(name: str) -> str:
    """PEFT's name for the adapter served as ``name``: PEFT refuses a '.' in adapter names
    (they become module names), and run ids carry one whenever a sweep point has a decimal
    value (``sweep-learning_rate-0.001-...``)."""
    return name.replace("%", "%25").replace(".", "%2E")


PROMPT_LOOKUP_TOKENS = 3
"""Draft tokens a greedy request checks a forward pass by default (``Engine``'s
``prompt_lookup_tokens``). Chosen on the tool-calling adapter's answers to 16 agent requests
(BENCHMARKS.md, "Serving"): 3 is within about 10% of the best length both where a pass of n
tokens costs what a pass of one does and on the AVX2 host, where each drafted token adds a
third of a pass."""

PROMPT_LOOKUP_NGRAM = 3
"""Longest run of last tokens ``_lookup`` looks for earlier in the text."""

RECENT_OUTPUTS = 16
"""Completions of each served model kept to draft from (``_recent_lookup``): answers to one
task repeat their format (``<tool_call>\n{"name": "...", "arguments": {...`` ), which the
prompt holds only in pieces."""

RECENT_LOOKUP_TOKENS = 8
"""Most tokens drafted from a recent completion a pass. Chosen on 80 of the agent task's held-out
requests answered in turn by its SmolLM2 adapter (lr 2e-3, 198 steps), passes simulated from the
one-a-pass answers: prompt lookup alone (3 tokens) 20.5 passes a request of 39.6 tokens; the 16
latest completions first, **8** tokens 14.2, 12 13.6 (every earlier completion: 4 tokens 16.0,
8 13.7, 12 13.3; 12 drafts a quarter more tokens for 3% fewer passes); ``BENCHMARKS.md``,
"Serving", has the measured latency."""

RECENT_LOOKUP_CONTEXT = (8, 2)
"""Longest and shortest run of the answer's last tokens ``_recent_lookup`` matches (fewer than 2
drafts from a single token, which recurs everywhere in a format: 14.6 passes at 1)."""

MIN_PREFIX_TOKENS = 32
"""Shortest cached prefix a prompt reuses. Every prompt of a chat format opens with the same few
tokens (``<|im_start|>system\\n``): reusing those saves nothing and would count as a hit. 32
tokens are 5% of the agent task's ~600-token shared system prompt and tools block."""


@dataclass
class PrefixCacheStats:
    """One served model's prefix-cache counters since the engine started."""

    queries: int = 0
    """Prompt tokens looked up (vLLM's ``prefix_cache_queries``)."""
    hits: int = 0
    """Prompt tokens whose keys and values came from the cache (vLLM's ``prefix_cache_hits``)."""
    hit_requests: int = 0
    """Requests that reused a cached prefix."""
    miss_requests: int = 0
    """Requests prefilled in full."""


@dataclass
class LookupStats:
    """Prompt lookup's counters since the engine started (vLLM's ``spec_decode`` ones)."""

    drafts: int = 0
    """Forward passes that checked a draft of at least one token."""
    draft_tokens: int = 0
    """Tokens drafted."""
    accepted_tokens: int = 0
    """Drafted tokens the model chose too (each a forward pass saved)."""

    def record(self, drafted: int, accepted: int) -> None:
        if drafted:
            self.drafts += 1
            self.draft_tokens += drafted
            self.accepted_tokens += accepted


def bf16_linears_available() -> tuple[bool, str]:
    """(whether generation may run the linear layers in oneDNN's packed bf16 here, why)."""
    native, what = cpu_bf16()
    if not native:
        return False, f"bf16 is not native on this CPU ({what})"
    if not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return False, "this torch's oneDNN has no bf16"
    return True, what


class Bf16Linears:
    """The model's ``nn.Linear`` layers computed in bf16 from weights packed once in oneDNN's
    blocked layout, while ``active`` (generation only; everything else computes in float32).

    A float32 CPU model reads 4 bytes a weight every forward pass; a decode pass of SmolLM2-135M
    reads all 540 MB of them for one to four tokens, and its time is that read. Packed bf16
    halves the bytes and runs on the CPU's bf16 units (AMX, AVX512-BF16): 30 layers and the
    head, 2 threads of the bf16 host, 18 ms a pass for 1 or 4 tokens against 25.5 and 49 ms in
    float32; one 1536x576 layer's product for a 600-token prefill ~10x faster. Each layer's pack is made the first time the layer
    runs after ``changed()`` (an adapter merged or taken out rewrites the weights): ~270 MB for
    SmolLM2-135M beside its float32 weights. The answers are the model's in bf16, the precision
    the trainer's matrix products ran in (bf16 autocast); the log-probs the train/serve
    equivalence check reads (``Engine.prompt_logprobs``) stay float32.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.active = False
        self._version = 0
        self._packs: dict[int, tuple[int, torch.Tensor, torch.Tensor | None]] = {}
        for layer in [m for m in model.modules() if type(m) is torch.nn.Linear]:
            layer.forward = self._forward_of(layer)  # type: ignore[method-assign]

    def changed(self) -> None:
        """The weights were rewritten: every layer packs again when it next runs."""
        self._version += 1

    @contextlib.contextmanager
    def generating(self) -> Iterator[None]:
        """The layers compute from their packs inside the block."""
        self.active = True
        try:
            yield
        finally:
            self.active = False

    def _forward_of(self, layer: torch.nn.Linear) -> Callable[..., torch.Tensor]:
        plain = layer.forward

        def forward(x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
            if not self.active or x.dtype != torch.float32:
                return plain(x, *args, **kwargs)
            pack = self._packs.get(id(layer))
            if pack is None or pack[0] != self._version:
                bias = layer.bias
                pack = (self._version,
                        torch.ops.mkldnn._reorder_linear_weight(
                            layer.weight.detach().to(torch.bfloat16)),
                        None if bias is None else bias.detach().to(torch.bfloat16))
                self._packs[id(layer)] = pack
            out = torch.ops.mkldnn._linear_pointwise(
                x.to(torch.bfloat16).contiguous(), pack[1], pack[2], "none", [], "")
            return out.to(torch.float32)

        return forward


@dataclass(frozen=True)
class _Prefix:
    """The keys and values of one prompt's tokens, per layer ``[1, heads, len(ids), dim]``."""

    model: str
    ids: tuple[int, ...]
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    nbytes: int


def _common_length(a: tuple[int, ...] | list[int], b: tuple[int, ...] | list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class PrefixCache:
    """Recent prompts' keys and values, per served model, reused by prompts that start the same.

    An entry is one whole prompt's KV cache, exact (not block-aligned), keyed by the served
    model's name and the prompt's token ids. A prompt reuses the entry it shares the longest
    common token prefix with, when that is at least ``MIN_PREFIX_TOKENS`` long: the keys and
    values of a causal model's first k tokens depend only on those k tokens, so the entry's
    first k positions are what a full prefill computes there (up to the float rounding of
    matrix products of another shape), and only the rest of the prompt is prefilled (at least
    its last token, whose logits pick the first new one). So a shared system prompt and tools
    block is computed once, wherever the prompts diverge.

    Bounded by ``max_entries`` and ``max_bytes`` (tensor bytes of all entries), least recently
    used evicted first; an entry above ``max_bytes`` is not kept. A stored prompt replaces the
    model's entries that are prefixes of it (they hold nothing it lacks). ``drop`` forgets a
    model's entries: an adapter unloaded or loaded under a name served before. Either cap at 0
    turns the cache off. Thread-safe; the engine's lock orders it with generation.
    """

    def __init__(self, *, max_entries: int, max_bytes: int) -> None:
        if max_entries < 0:
            raise ValueError(f"prefix_cache_entries: must be >= 0, got {max_entries}")
        if max_bytes < 0:
            raise ValueError(f"prefix_cache_bytes: must be >= 0, got {max_bytes}")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[tuple[str, tuple[int, ...]], _Prefix] = OrderedDict()
        self._stats: dict[str, PrefixCacheStats] = {}
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self.max_entries > 0 and self.max_bytes > 0

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(e.nbytes for e in self._entries.values())

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def match(self, model: str, prompts: list[list[int]]) -> tuple[_Prefix | None, int]:
        """The entry of ``model`` whose longest prefix every one of ``prompts`` starts with, and
        that prefix's length (capped so each prompt keeps a token to prefill); (None, 0) when
        none reaches ``MIN_PREFIX_TOKENS``. Counts every prompt as a hit or a miss."""
        best: _Prefix | None = None
        length = 0
        cap = min(len(p) for p in prompts) - 1
        with self._lock:
            for entry in self._entries.values():
                if entry.model != model:
                    continue
                k = min(cap, *(_common_length(entry.ids, p) for p in prompts))
                if k > length:
                    best, length = entry, k
            if length < MIN_PREFIX_TOKENS:
                best, length = None, 0
            if best is not None:
                self._entries.move_to_end((best.model, best.ids))
            stats = self._stats.setdefault(model, PrefixCacheStats())
            stats.queries += sum(len(p) for p in prompts)
            stats.hits += length * len(prompts)
            if best is None:
                stats.miss_requests += len(prompts)
            else:
                stats.hit_requests += len(prompts)
        return best, length

    def store(self, model: str, ids: list[int],
              layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Keep ``layers``, the keys and values of the prompt ``ids`` (not copied: the caller
        hands over tensors nothing writes to again)."""
        nbytes = sum(t.numel() * t.element_size() for kv in layers for t in kv)
        if not self.enabled or nbytes > self.max_bytes:
            return
        key = (model, tuple(ids))
        with self._lock:
            for old in [k for k, e in self._entries.items()
                        if e.model == model and len(e.ids) <= len(ids)
                        and e.ids == key[1][:len(e.ids)]]:
                del self._entries[old]
            self._entries[key] = _Prefix(model=model, ids=key[1], layers=tuple(layers),
                                         nbytes=nbytes)
            total = sum(e.nbytes for e in self._entries.values())
            while len(self._entries) > self.max_entries or total > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                total -= evicted.nbytes

    def drop(self, model: str | None = None) -> None:
        """Forget ``model``'s entries (None: every model's); the counters stay."""
        with self._lock:
            for k in [k for k in self._entries if model is None or k[0] == model]:
                del self._entries[k]

    def stats(self) -> dict[str, PrefixCacheStats]:
        """A copy of each served model's counters."""
        with self._lock:
            return {m: PrefixCacheStats(**vars(s)) for m, s in self._stats.items()}


class Engine:
    """A base model with hot-loadable LoRA adapters.

    ``base_chat_template``: ``"trainer"`` (default) serves the base model with the trainer's
    template of its tokenizer's chat format, ``"tokenizer"`` with the template the base
    tokenizer ships, or a Jinja string. Adapters always use the template saved in their directory when there is one.

    ``merge_adapters`` (float32 only): while requests for one LoRA adapter follow each other, its
    weights are added into the base's (PEFT's ``merge_adapter``) and a forward pass computes as
    a plain model, without the LoRA layers' extra products (a SmolLM2 agent tool call's p50
    0.88x on the AVX2 host, the same tokens); a request for the base or another adapter takes
    them out first. Each merge and unmerge rounds the base's weights (within an ulp of float32
    each time: a base request's greedy tokens are the same after hundreds of switches,
    tests/inference/test_merge.py). An adapter with trained token rows is never merged.

    ``prefix_cache_entries`` and ``prefix_cache_bytes`` bound the ``PrefixCache`` of recent
    prompts' keys and values (either at 0: off). 8 entries and 128 MiB by default: a ~630-token
    agent prompt of SmolLM2-135M in float32 is 29 MB (30 layers x 2 x 192 x 4 bytes a token),
    so 4 of them fit. A model whose cache layers are not all full attention (Gemma 3's sliding
    window layers cannot be cut to a prefix) and a vision-language model (a prompt's image
    tokens stand for pixels their ids do not name) are served without it.
    """

    def __init__(self, model: str | Path, *, served_model_name: str | None = None,
                 dtype: str = "float32", max_model_len: int = 4096,
                 base_chat_template: str = "trainer", prefix_cache_entries: int = 8,
                 prefix_cache_bytes: int = 128 * 2**20,
                 prompt_lookup_tokens: int = PROMPT_LOOKUP_TOKENS,
                 recent_lookup_tokens: int = RECENT_LOOKUP_TOKENS,
                 merge_adapters: bool = True, bf16_linears: bool = False) -> None:
        if dtype not in ("float32", "bfloat16"):
            raise ValueError(f"dtype: must be float32 or bfloat16, got {dtype!r}")
        if bf16_linears:
            available, why = bf16_linears_available()
            if dtype != "float32" or not available:
                raise ValueError("bf16_linears: needs dtype float32 and native bf16"
                                 + ("" if available else f": {why}"))
        if prompt_lookup_tokens < 0:
            raise ValueError(f"prompt_lookup_tokens: must be >= 0, got {prompt_lookup_tokens}")
        if recent_lookup_tokens < 0:
            raise ValueError(f"recent_lookup_tokens: must be >= 0, got {recent_lookup_tokens}")
        self.prompt_lookup = prompt_lookup_tokens
        """Most draft tokens a greedy request checks a forward pass (0: one token a pass)."""
        self.recent_lookup = recent_lookup_tokens if prompt_lookup_tokens > 0 else 0
        """Most draft tokens taken from the model's recent completions first (0: none kept)."""
        self.lookup_stats = LookupStats()
        """Drafts checked and their tokens taken since the engine started."""
        self._recent: dict[str, deque[list[int]]] = {}
        """Each served model's latest completions (``RECENT_OUTPUTS``), newest last: drafts."""
        self.model_path = str(model)
        self.served_model_name = served_model_name or self.model_path
        self.max_model_len = max_model_len
        template = None if base_chat_template == "tokenizer" else base_chat_template
        self.vision: Vision | None = None
        """The image processor of a vision-language model (None: images are ``[image]``)."""
        if has_vision(model):
            self.vision = Vision(model, blob_reader(BlobStore().root))
        self.tokenizer = _load_tokenizer(model, template, vision=self.vision is not None)
        self.dtype = torch.float32 if dtype == "float32" else torch.bfloat16
        quiet_progress_bars()
        self.base = auto_model_class(self.model_path).from_pretrained(self.model_path,
                                                                      dtype=self.dtype)
        self.base.eval()
        self.bf16_linears = Bf16Linears(self.base) if bf16_linears else None
        """Generation's linear layers in packed bf16 (None: float32, as the weights)."""
        self.model: Any = self.base
        self.adapters: dict[str, str] = {}
        self.adapter_tokenizers: dict[str, Any] = {}
        self._tokenizer_digests: dict[str, str | None] = {}
        """Each adapter's ``_tokenizer_digest`` (None: it has the base's tokenizer)."""
        self.merge_adapters = merge_adapters and self.dtype == torch.float32
        """Whether an adapter's weights are added into the base's while it is served."""
        self._mergeable: dict[str, bool] = {}
        """Each adapter's: whether it can be merged (LoRA layers only, no trained token rows)."""
        self._token_rows: dict[str, bool] = {}
        """Each adapter's: whether it trains token rows (served in float32 throughout)."""
        self._merged: str | None = None
        """The adapter whose weights are in the base's now (None: the base's own)."""
        self.lock = threading.RLock()
        self.prefix_cache = PrefixCache(max_entries=prefix_cache_entries,
                                        max_bytes=prefix_cache_bytes)
        """Recent prompts' keys and values, reused by prompts that start the same way."""
        self._prefix_cacheable = self.vision is None and all(
            type(layer) is DynamicLayer for layer in self._new_cache().layers)
        """Whether this model's KV cache can be cut to a prefix (every layer full attention)."""

    # --- models -------------------------------------------------------------------------------

    def model_names(self) -> list[str]:
        return [self.served_model_name, *self.adapters]

    def tokenizer_for(self, model: str) -> Any:
        if model == self.served_model_name:
            return self.tokenizer
        if model in self.adapters:
            return self.adapter_tokenizers[model]
        raise EngineError(f"The model `{model}` does not exist.")

    def load_adapter(self, name: str, path: str | Path) -> None:
        """Load a PEFT adapter directory under ``name`` (vLLM's ``load_lora_adapter``)."""
        from peft import PeftModel

        if not name:
            raise EngineError("lora_name: must be non-empty")
        if name == self.served_model_name or name in self.adapters:
            raise EngineError(f"The lora adapter '{name}' has already been loaded.")
        p = Path(path)
        if not (p / "adapter_config.json").is_file():
            raise EngineError(f"lora_path: {path} has no adapter_config.json")
        digest = _tokenizer_digest(p) if (p / "tokenizer_config.json").is_file() else None
        # Adapters of one base written by the trainer carry the same tokenizer files: one
        # tokenizer object for all of them (~20 MiB each for SmolLM2's).
        tok = (self.tokenizer if digest is None
               else next((self.adapter_tokenizers[n] for n, d in self._tokenizer_digests.items()
                          if d == digest), None)
               or _load_tokenizer(p, None, vision=self.vision is not None))
        if len(tok) != len(self.tokenizer):
            raise EngineError(f"lora_path: {path} has a tokenizer of {len(tok)} tokens, the "
                              f"base model has {len(self.tokenizer)}")
        with self.lock, warnings.catch_warnings():
            # peft 0.21 probes transformers' deprecated `is_gradient_checkpointing`.
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*",
                                    category=FutureWarning)
            self._unmerge()
            try:
                if self.model is self.base:
                    self.model = PeftModel.from_pretrained(self.base, str(p),
                                                           adapter_name=_peft_name(name),
                                                           is_trainable=False)
                else:
                    self.model.load_adapter(str(p), adapter_name=_peft_name(name),
                                            is_trainable=False)
            except (ValueError, KeyError, RuntimeError, OSError) as e:
                raise EngineError(f"lora_path: cannot load {path}: {e}") from None
            fast_token_rows(self.model)  # an adapter with trained token rows: no matrix copies
            self.model.eval()
            self._token_rows[name] = any(type(m).__name__ == "TrainableTokensLayer"
                                         for m in self.model.modules())
            self._mergeable[name] = self.merge_adapters and not self._token_rows[name]
            self.adapters[name] = str(p)
            self.adapter_tokenizers[name] = tok
            self._tokenizer_digests[name] = digest
            self._forget(name)  # a name served before computed other keys and answers

    def unload_adapter(self, name: str) -> None:
        if name not in self.adapters:
            raise EngineError(f"The lora adapter '{name}' cannot be found.")
        with self.lock:
            self._unmerge()
            if len(self.adapters) == 1:
                self.base = self.model.unload()  # strips the LoRA layers; base weights untouched
                self.model = self.base
            else:
                if self.model.active_adapter == _peft_name(name):
                    self.model.set_adapter(_peft_name(next(a for a in self.adapters
                                                           if a != name)))
                self.model.delete_adapter(_peft_name(name))
            del self.adapters[name]
            del self._mergeable[name]
            del self._token_rows[name]
            del self.adapter_tokenizers[name]
            del self._tokenizer_digests[name]
            self._forget(name)

    def _forget(self, name: str) -> None:
        """Drop what was computed for the model served as ``name``: its cached prompts' keys
        and values and its recent completions (the drafts)."""
        self.prefix_cache.drop(name)
        self._recent.pop(name, None)

    def _new_cache(self) -> DynamicCache:
        """An empty KV cache of the layer kinds the model's config names."""
        return DynamicCache(config=self.base.config)

    def _unmerge(self) -> None:
        """Take the merged adapter's weights out of the base's (with ``self.lock`` held)."""
        if self._merged is not None:
            self.model.unmerge_adapter()
            self._merged = None
            if self.bf16_linears is not None:
                self.bf16_linears.changed()

    def _forward_model(self, model: str) -> Any:
        """Context manager that makes ``self.model`` compute as ``model`` (with ``self.lock``
        held: it may merge or unmerge an adapter)."""
        if model == self.served_model_name:
            self._unmerge()
            return self.model.disable_adapter() if self.adapters else contextlib.nullcontext()
        if model not in self.adapters:
            raise EngineError(f"The model `{model}` does not exist.")
        if self._merged != model:
            self._unmerge()
            self.model.set_adapter(_peft_name(model))
            if self._mergeable[model]:
                self.model.merge_adapter()
                self._merged = model
                if self.bf16_linears is not None:
                    self.bf16_linears.changed()
        return contextlib.nullcontext()

    def _generation_linears(self, model: str) -> Any:
        """Context manager: ``model``'s linear layers in packed bf16 while it generates, where
        the engine has them (not for an adapter with trained token rows)."""
        if self.bf16_linears is None or self._token_rows.get(model, False):
            return contextlib.nullcontext()
        return self.bf16_linears.generating()

    # --- prompts ------------------------------------------------------------------------------

    def render(self, model: str, messages: list[dict[str, Any]], tools: list[Any] | None = None,
               *, add_generation_prompt: bool = True) -> str:
        tok = self.tokenizer_for(model)
        try:
            text = tok.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                           add_generation_prompt=add_generation_prompt)
        except Exception as e:  # jinja raises many types; the message is what the user needs
            raise EngineError(f"messages: the chat template cannot render them: {e}") from None
        return str(text)

    def encode(self, model: str, text: str) -> list[int]:
        return self.check_prompt(
            model, list(self.tokenizer_for(model)(text, add_special_tokens=False)["input_ids"]))

    def check_prompt(self, model: str, ids: list[int]) -> list[int]:
        """``ids`` if ``model`` can take them as a prompt, else ``EngineError`` saying why."""
        vocab = len(self.tokenizer_for(model))
        if not ids:
            raise EngineError("prompt: must not be empty")
        bad = next((t for t in ids if not 0 <= t < vocab), None)
        if bad is not None:
            raise EngineError(f"prompt: token id {bad} is not in the vocabulary ({vocab} tokens)")
        if len(ids) >= self.max_model_len:
            raise EngineError(f"This model's maximum context length is {self.max_model_len} "
                              f"tokens; the prompt has {len(ids)}.")
        return ids

    def stop_token_ids(self, model: str) -> set[int]:
        tok = self.tokenizer_for(model)
        ids = {tok.eos_token_id}
        try:
            end = tok.convert_tokens_to_ids(chat_format(tok).turn_end)
        except ValueError:  # a tokenizer of no known chat format: its eos alone
            end = None
        if isinstance(end, int) and end != tok.unk_token_id:
            ids.add(end)
        return {i for i in ids if i is not None}

    def images(self, messages: list[dict[str, Any]], blobs: dict[str, bytes]
               ) -> list[ImageInput]:
        """The image parts of the canonical ``messages``, in the order they render, through
        the processor: the bytes from ``blobs`` (the request's inline images) or the blob
        store. ``EngineError`` when an image's bytes are in neither (a remote URL, a blob this
        machine lacks); [] for a model without a vision tower."""
        if self.vision is None:
            return []
        out = []
        for m in messages:
            for part in m.get("content") or []:
                if part.get("type") != "image":
                    continue
                data = blobs.get(part.get("sha256") or "")
                try:
                    out.append(self.vision.image(part) if data is None
                               else self.vision.process(data))
                except ValueError as e:
                    raise EngineError(f"messages: {e}") from None
        return out

    # --- prompt log-probs --------------------------------------------------------------------

    def _image_inputs(self, ids: torch.Tensor, mask: torch.Tensor,
                      images: list[ImageInput]) -> dict[str, Any]:
        """The model's image arguments for the left-padded rows ``ids``: the pixels, the grids
        and the positions (the text positions, then the 3-D ones of ``get_rope_index``)."""
        pixels, grids = stack(images)
        if pixels is None:
            return {}
        assert self.vision is not None and grids is not None
        body = self.base.model
        is_image = (ids == self.vision.image_token_id).int()
        rope, _ = body.get_rope_index(ids, is_image, image_grid_thw=grids, attention_mask=mask)
        text = (mask.cumsum(-1) - 1).clamp(min=0)
        return {"pixel_values": pixels.to(self.dtype), "image_grid_thw": grids,
                "position_ids": torch.cat([text[None], rope])}

    @torch.no_grad()
    def prompt_logprobs(self, model: str, token_ids: list[int], k: int = 0,
                        images: list[ImageInput] | None = None) -> list[TokenLogprob | None]:
        """Each prompt token's log-prob given the ones before it (and ``images``, the prompt's
        images), with its rank and the ``k`` most likely tokens there; None for the first
        token (nothing precedes it)."""
        if not token_ids:
            raise EngineError("prompt: must not be empty")
        with self.lock, self._forward_model(model):
            ids = torch.tensor([token_ids])
            extra = self._image_inputs(ids, torch.ones_like(ids), images or [])
            logits = self.model(input_ids=ids, use_cache=False, **extra).logits[0, :-1].float()
        lsm = torch.log_softmax(logits, dim=-1)
        out: list[TokenLogprob | None] = [None]
        out += [_token_logprob(lsm[i], token_ids[i + 1], k) for i in range(len(token_ids) - 1)]
        return out

    # --- generation ---------------------------------------------------------------------------

    def _lookup_decode(self, prompt: list[int], generated: list[int], logits: torch.Tensor,
                       cache: DynamicCache, position: int, budget: int,
                       choose: Callable[[int, torch.Tensor], int],
                       emit: Callable[[int, int, torch.Tensor], bool],
                       recent: Sequence[list[int]] = ()) -> None:
        """Greedy decoding of one request, checking several drafted tokens a forward pass: the
        draft is what followed the answer's last few tokens in the latest of the model's
        ``recent`` completions that holds them (``_recent_lookup``, up to
        ``self.recent_lookup``), else what followed the latest earlier occurrence of the
        text's last few tokens (prompt lookup, ``_lookup``, up to ``self.prompt_lookup``); the
        pass feeds the token just
        chosen and the draft, and each position's logits choose the next token as a pass of
        one would, through the request's constraint; the draft's tokens count while they agree,
        the first that does not is replaced by the chosen one, and the keys and values of the
        rest are cut from ``cache``. ``generated``: the request's tokens so far, which ``emit``
        appends to; ``logits``: the prompt's last position's; ``position``: the first generated
        token's; ``budget``: most tokens to generate."""
        t = choose(0, logits)
        if emit(0, t, logits):
            return
        while True:
            left = budget - len(generated) - 1
            draft = (_recent_lookup(generated, recent, min(self.recent_lookup, left))
                     or _lookup(prompt + generated, min(self.prompt_lookup, left)))
            length = cache.get_seq_length()
            ids = torch.tensor([[t, *draft]])
            out = self.model(input_ids=ids,
                             attention_mask=torch.ones((1, length + ids.shape[1]),
                                                       dtype=torch.long),
                             position_ids=torch.arange(position, position + ids.shape[1])[None],
                             cache=cache, use_cache=True)
            rows = out.logits[0].float()
            agreed = 0
            for j in range(len(draft) + 1):
                t = choose(0, rows[j])
                taken = j < len(draft) and t == draft[j]
                agreed += taken
                if emit(0, t, rows[j]):
                    self.lookup_stats.record(len(draft), agreed)
                    return
                if not taken:
                    break
            position += agreed + 1
            self.lookup_stats.record(len(draft), agreed)
            if agreed < len(draft):
                cache.crop(agreed - len(draft))  # a negative count: tokens off the end

    def _keep_prompts(self, model: str, prompts: list[list[int]], cache: DynamicCache,
                      mask: torch.Tensor) -> None:
        """Store the prompts of a batch just prefilled into ``cache`` (``mask``: their tokens)
        in the prefix cache: the first, and every other that shares fewer than
        ``MIN_PREFIX_TOKENS`` with the ones stored before it (a batch of one system prompt
        stores one entry). The tensors a prefill leaves are never written again (the cache
        grows by concatenation): a lone row's are kept as they are, a batch's rows copied out
        without their padding."""
        prefilled: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer in cache.layers:
            assert isinstance(layer, DynamicLayer)  # _prefix_cacheable
            assert layer.keys is not None and layer.values is not None
            prefilled.append((layer.keys, layer.values))
        kept: list[list[int]] = []
        for i, p in enumerate(prompts):
            if any(_common_length(p, q) >= MIN_PREFIX_TOKENS for q in kept):
                continue
            kept.append(p)
            if len(prompts) == 1:
                layers = prefilled
            else:
                at = mask[i].nonzero().squeeze(1)
                layers = [(keys[i:i + 1].index_select(2, at), values[i:i + 1].index_select(2, at))
                          for keys, values in prefilled]
            self.prefix_cache.store(model, p, layers)

    @torch.no_grad()
    def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Run ``requests`` (all for the same model) as one batch; the longest prefix they
        all share with a prompt in the prefix cache is not computed again."""
        if not requests:
            return []
        model = requests[0].model
        assert all(r.model == model for r in requests), "a batch serves one model"
        tok = self.tokenizer_for(model)
        stops = self.stop_token_ids(model)
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        n = len(requests)
        prompts = [r.prompt_ids for r in requests]
        gens = [torch.Generator().manual_seed(r.seed if r.seed is not None else 0)
                for r in requests]
        out_ids: list[list[int]] = [[] for _ in requests]
        texts = [""] * n
        emitted = [0] * n
        finish: list[str | None] = [None] * n
        logprobs: list[list[TokenLogprob]] = [[] for _ in requests]
        budget = [min(r.max_tokens, self.max_model_len - len(r.prompt_ids)) for r in requests]
        for i in range(n):
            if budget[i] <= 0:
                finish[i] = "length"
        with self.lock, self._forward_model(model), self._generation_linears(model):
            caching = (self._prefix_cacheable and self.prefix_cache.enabled
                       and not any(r.images for r in requests))
            cache = self._new_cache()
            prefix, k = self.prefix_cache.match(model, prompts) if caching else (None, 0)
            if prefix is not None:
                for layer, (keys, values) in enumerate(prefix.layers):
                    cache.update(keys[..., :k, :].expand(n, -1, -1, -1),
                                 values[..., :k, :].expand(n, -1, -1, -1), layer)
            # Each row: the k cached tokens, left padding, the rest of its prompt. The padding
            # sits between the two when the rows' rests differ in length; the mask hides it and
            # the positions skip it, as they skip a left padding.
            width = max(len(p) for p in prompts) - k
            ids = torch.full((n, width), pad, dtype=torch.long)
            mask = torch.zeros((n, k + width), dtype=torch.long)
            mask[:, :k] = 1
            for i, p in enumerate(prompts):
                ids[i, width - (len(p) - k):] = torch.tensor(p[k:])
                mask[i, k + width - (len(p) - k):] = 1
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, k:]
            extra = self._image_inputs(ids, mask, [x for r in requests for x in r.images])
            if extra:
                # [4, B, L]: the text positions, then the 3-D ones; every dimension of a token
                # generated after the prompt is the last one's plus one.
                positions = extra.pop("position_ids")
            # Only the last position's logits choose a token: the vocabulary projection of the
            # other prompt tokens (49,152 x 576 products a token for SmolLM2) is not computed.
            out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                             cache=cache, use_cache=True, logits_to_keep=1, **extra)
            if caching:
                self._keep_prompts(model, prompts, cache, mask)
            logits = out.logits[:, -1].float()

            def emit(i: int, t: int, row: torch.Tensor) -> bool:
                """Take ``t`` as row ``i``'s next token (``row``: the logits it was chosen
                from, for its log-prob); whether the row has finished."""
                r = requests[i]
                out_ids[i].append(t)
                if r.constraint is not None:
                    r.constraint.advance(t)
                if r.top_logprobs is not None:
                    logprobs[i].append(_token_logprob(torch.log_softmax(row, dim=-1), t,
                                                      r.top_logprobs))
                if t in stops:
                    finish[i] = "stop"
                    return True
                text = tok.decode(out_ids[i], skip_special_tokens=False)
                cut = _first_stop(text, r.stop)
                if cut is not None:
                    text, finish[i] = text[:cut], "stop"
                elif len(out_ids[i]) >= budget[i]:
                    finish[i] = "length"
                texts[i] = text
                # Hold back a trailing partial UTF-8 character (and text a stop string might
                # still claim) until the next token completes it.
                safe = len(text) if finish[i] else _safe_prefix(text, r.stop)
                if r.on_token is not None and safe > emitted[i]:
                    r.on_token(t, text[emitted[i]:safe])
                    emitted[i] = safe
                elif r.on_token is not None and finish[i] is None:
                    r.on_token(t, "")
                return finish[i] is not None

            def choose(i: int, row: torch.Tensor) -> int:
                r = requests[i]
                if r.constraint is not None and finish[i] is None:
                    row = _masked(row, r.constraint.mask(), stops)
                if r.temperature > 0:
                    return int(_sample(row, r.temperature, r.top_p, gens[i]))
                return int(row.argmax())

            if (n == 1 and finish[0] is None and requests[0].temperature <= 0
                    and self.prompt_lookup > 0 and self._prefix_cacheable and not extra):
                self._lookup_decode(prompts[0], out_ids[0], logits[0], cache,
                                    int(positions[0, -1]) + 1, budget[0], choose, emit,
                                    self._recent.get(model, ()))
            while any(f is None for f in finish):
                next_ids = torch.tensor([choose(i, logits[i]) for i in range(n)])
                for i in range(n):
                    if finish[i] is None:
                        emit(i, int(next_ids[i]), logits[i])
                if all(f is not None for f in finish):
                    break
                mask = torch.cat([mask, torch.ones((n, 1), dtype=torch.long)], dim=1)
                positions = positions[..., -1:] + 1
                out = self.model(input_ids=next_ids[:, None], attention_mask=mask,
                                 position_ids=positions, cache=cache, use_cache=True)
                logits = out.logits[:, -1].float()
            if self.recent_lookup > 0:
                self._recent.setdefault(model, deque(maxlen=RECENT_OUTPUTS)).extend(
                    ids for ids in out_ids if ids)
        results = []
        for i, r in enumerate(requests):
            if r.on_token is not None and len(texts[i]) > emitted[i]:
                r.on_token(out_ids[i][-1] if out_ids[i] else -1, texts[i][emitted[i]:])
            results.append(GenerationResult(
                text=texts[i], token_ids=out_ids[i], finish_reason=finish[i] or "length",
                num_prompt_tokens=len(r.prompt_ids),
                logprobs=logprobs[i] if r.top_logprobs is not None else None))
        return results


def _lookup(history: list[int], most: int, longest: int = PROMPT_LOOKUP_NGRAM) -> list[int]:
    """Up to ``most`` tokens that followed the latest earlier occurrence of ``history``'s last
    ``longest`` tokens (or fewer, down to its last token alone): a tool call's names and keys
    are in the tools block, its values in the user's turn, a label in the system prompt's list.
    A copy that reaches the end of ``history`` goes on from its own start (text that repeats
    itself is drafted ``most`` tokens at a time). [] when nothing matches."""
    if most <= 0:
        return []
    end = len(history)
    for n in range(min(longest, end - 1), 0, -1):
        tail = history[end - n:]
        last = tail[-1]
        for at in range(end - 2, n - 2, -1):
            if history[at] == last and history[at - n + 1:at + 1] == tail:
                draft: list[int] = []
                for i in range(at + 1, at + 1 + most):
                    draft.append(history[i] if i < end else draft[i - end])
                return draft
    return []


def _recent_lookup(generated: list[int], recent: Sequence[list[int]], most: int) -> list[int]:
    """Up to ``most`` tokens that followed ``generated``'s last tokens in the newest of
    ``recent`` (completions, oldest first) that holds them: within one completion the longest
    run of last tokens it holds (``RECENT_LOOKUP_CONTEXT``: 8 down to 2), its first occurrence
    (the longest continuation where the text repeats itself; on the agent task's answers the
    first and the latest draft alike). [] when none holds even the shortest run, or ``most``
    <= 0."""
    longest, shortest = RECENT_LOOKUP_CONTEXT
    if most <= 0 or len(generated) < shortest:
        return []
    last, reach = generated[-1], min(longest, len(generated))
    for out in reversed(recent):
        found, at_found = 0, -1
        for at in [i for i in range(len(out) - 1) if out[i] == last]:
            n = 1
            while n < min(reach, at + 1) and out[at - n] == generated[-1 - n]:
                n += 1
            if n > found:
                found, at_found = n, at
                if n == reach:
                    break
        if found >= shortest:
            return out[at_found + 1:at_found + 1 + most]
    return []


def _masked(logits: torch.Tensor, allowed: torch.Tensor, stops: set[int]) -> torch.Tensor:
    """``logits`` with every token outside ``allowed`` at -inf (the model's rows may be longer
    than the tokenizer's ids: the extra ones are never allowed); a mask that allows nothing
    allows the stop tokens, so a constraint with nothing left to say ends the completion."""
    n = min(len(allowed), len(logits))
    keep = torch.zeros(len(logits), dtype=torch.bool)
    keep[:n] = allowed[:n]
    if not keep.any():
        keep[[t for t in stops if t < len(logits)]] = True
    return logits.masked_fill(~keep, float("-inf"))


def _sample(logits: torch.Tensor, temperature: float, top_p: float,
            gen: torch.Generator) -> int:
    probs = torch.softmax(logits / temperature, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p
        sorted_p = sorted_p * keep
        return int(order[torch.multinomial(sorted_p / sorted_p.sum(), 1, generator=gen)])
    return int(torch.multinomial(probs, 1, generator=gen))


def _token_logprob(lsm: torch.Tensor, token_id: int, k: int) -> TokenLogprob:
    """``token_id``'s entry at a position whose log-softmax is ``lsm``."""
    lp = float(lsm[token_id])
    top: list[tuple[int, float]] = []
    if k > 0:
        values, idx = torch.topk(lsm, k)
        top = [(int(j), float(v)) for v, j in zip(values, idx, strict=True)]
    return TokenLogprob(token_id=token_id, logprob=lp, rank=int((lsm > lsm[token_id]).sum()) + 1,
                        top=top)


def _first_stop(text: str, stops: list[str]) -> int | None:
    found = [text.find(s) for s in stops if s and s in text]
    return min(found) if found else None


def _safe_prefix(text: str, stops: list[str]) -> int:
    end = len(text)
    if text.endswith("\ufffd"):
        end -= 1
    for s in stops:
        for k in range(min(len(s) - 1, end), 0, -1):
            if text[:end].endswith(s[:k]):
                end -= k
                break
    return end


class BatchScheduler:
    """Collects requests from many callers and runs them in batches on one worker thread.

    A caller gets a ``concurrent.futures.Future``. The worker takes the oldest waiting request,
    and every other waiting request for the same model up to ``max_batch_size``; requests that
    arrive while a batch runs wait for the next one (static batching: simple, and on 2 CPU
    cores the batch is compute-bound anyway). ``call`` runs other model work (a prompt's
    log-probs) on the same thread, alone, in turn with the batches.

    With ``cores``, the server claims its share of the machine's cores while it has work: from
    the moment a request is submitted to an idle scheduler until the last one in flight is
    done, released before that one's caller is answered (``factory.trainer.cores``). An idle
    server holds no claim, so a trainer beside it keeps every core.
    """

    def __init__(self, engine: Engine, *, max_batch_size: int = 8,
                 cores: CoreShare | None = None) -> None:
        self.engine = engine
        self.max_batch_size = max_batch_size
        self.cores = cores
        """This server's share of the machine's cores: claimed while requests are in flight,
        adjusted before every batch."""
        self._pending: list[tuple[GenerationRequest | Callable[[], Any], Any]] = []
        self._in_flight = 0
        """Submitted and not yet answered (waiting or running)."""
        self._cv = threading.Condition()
        self._closed = False
        if cores is not None:
            cores.release()  # no work yet
        self._thread = threading.Thread(target=self._run, name="batch-scheduler", daemon=True)
        self._thread.start()

    def submit(self, request: GenerationRequest) -> Any:
        """Queue ``request``; a future of its ``GenerationResult``."""
        return self._queue(request)

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Queue ``fn(*args)`` (model work that is not a generation); a future of its result."""
        return self._queue(lambda: fn(*args))

    def _queue(self, item: GenerationRequest | Callable[[], Any]) -> Any:
        from concurrent.futures import Future

        fut: Future[Any] = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("scheduler is closed")
            if self._in_flight == 0 and self.cores is not None:
                self.cores.join()  # the first request in flight: the server works from now
            self._pending.append((item, fut))
            self._in_flight += 1
            self._cv.notify()
        return fut

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)
        if self.cores is not None:  # the server is going: its cores are free for the others
            self.cores.leave()

    def _next(self) -> list[tuple[GenerationRequest | Callable[[], Any], Any]]:
        """The next work to run (the caller holds ``_cv``): a call alone, or a batch of the
        oldest request's model."""
        first = self._pending[0][0]
        if not isinstance(first, GenerationRequest):
            batch = [self._pending[0]]
        else:
            batch = [p for p in self._pending if isinstance(p[0], GenerationRequest)
                     and p[0].model == first.model][:self.max_batch_size]
        for p in batch:
            self._pending.remove(p)
        return batch

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._pending and not self._closed:
                    self._cv.wait()
                if self._closed and not self._pending:
                    return
                batch = self._next()
            outcome: list[Any] | Exception
            try:
                if self.cores is not None:
                    self.cores.adjust()
                first = batch[0][0]
                if isinstance(first, GenerationRequest):
                    outcome = list(self.engine.generate(
                        [r for r, _ in batch if isinstance(r, GenerationRequest)]))
                else:
                    outcome = [first()]
            except Exception as e:  # delivered to every caller of the batch, which reports it
                outcome = e
            with self._cv:
                self._in_flight -= len(batch)
                if self._in_flight == 0 and self.cores is not None:
                    # Released before the callers hear back: one answered finds the cores free.
                    self.cores.release()
            for i, (_, fut) in enumerate(batch):
                if isinstance(outcome, Exception):
                    fut.set_exception(outcome)
                else:
                    fut.set_result(outcome[i])
