"""Samples in, micro-batches out: reading, tokenizing, packing, and a resumable order.

The order of micro-batches is a pure function of (data, plan, seed): epoch ``e`` shuffles the
examples with a generator seeded by ``seed`` and ``e``, packs them, and groups rows into
micro-batches. So the data position of a checkpoint is one integer (the global micro-batch
index), and a resumed run recomputes the same batches instead of saving iterator state.

Packing puts several samples in one row with position ids restarting at 0 per sample and no
attention mask: transformers 5 then builds a block-diagonal causal mask from the position resets
(``masking_utils.find_packed_sequence_indices``), and on CPU ``model.packed_sdpa_attention``
attends within each segment instead, so packed samples never attend to each other;
tests/trainer/test_model.py checks the per-sample loss against unpacked rows. Row padding is a
segment of its own (positions restart there too), unlabeled.

With ``share_prefix`` a micro-batch whose samples all begin with the same tokens (the usual
case of logged traffic: one system prompt) becomes one row: the shared tokens once, then each
sample's rest with its positions continuing after the prefix (``collate_shared``).
``model.packed_sdpa_attention`` reads a segment that starts at position ``p > 0`` as a rest that
attends to the row's first ``p`` tokens and causally to itself, so every sample sees exactly
the context it has alone: the loss and gradient are those of separate rows (without LoRA
dropout, whose mask on the prefix is then one for the micro-batch), for a fraction of the tokens
when the prompt is long and the rests are short. tests/trainer/test_model.py holds the two equal.

A sample is trained whole or not at all: one longer than the plan's ``max_seq_len`` is dropped
(``too_long_for_plan``), never cut, because the cut falls at the end of the conversation, on the
assistant turn the sample exists for. ``check_plan_data`` is the pre-launch check the
``training_run`` asset runs with this same ``tokenize``: it refuses a plan that would drop more
than ``MAX_DROP_FRACTION`` of the samples before any compute is spent.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .chat import IGNORE_INDEX, common_prefix, encode
from .config import MIN_SHARED_PREFIX, Job

# First-fit packing looks at this many open rows: 99%+ fill on realistic length mixes while
# staying linear in the number of samples.
_OPEN_ROWS = 64

DROP_REASONS = ("unrenderable", "too_long_for_plan", "no_target")
"""Why ``tokenize`` drops a sample: its messages cannot be rendered; it is longer than the plan's
``max_seq_len``; it has no assistant token to train on."""
MAX_DROP_FRACTION = 0.01
"""The share of the training samples a plan may drop: the planner sizes ``max_seq_len`` to cover
99% of them, so dropping more means the plan does not fit its data."""


@dataclass(frozen=True, kw_only=True)
class Example:
    """One tokenized sample."""

    sample_id: str
    """The canonical sample id (or the row number for payloads without one)."""
    input_ids: list[int]
    """Token ids of the rendered conversation."""
    labels: list[int]
    """Targets at each position (``IGNORE_INDEX`` outside assistant turns)."""


@dataclass(frozen=True, kw_only=True)
class DataStats:
    """What tokenizing the data kept and dropped."""

    num_samples: int
    """Rows read."""
    num_examples: int
    """Rows kept."""
    num_dropped: int
    """Rows dropped, for any reason (``num_samples - num_examples``)."""
    num_dropped_by_reason: dict[str, int]
    """Rows dropped, by reason: every one of ``DROP_REASONS``, zeros included."""
    max_sample_tokens: int
    """Tokens of the longest renderable row, kept or dropped (0: none renders)."""
    num_tokens: int
    """Tokens of the kept rows."""
    num_label_tokens: int
    """Trained (assistant) tokens of the kept rows."""

    def describe_drops(self) -> str:
        """The drops by reason, e.g. ``37 too_long_for_plan (longest 475 tokens)``."""
        parts = []
        for reason in DROP_REASONS:
            n = self.num_dropped_by_reason.get(reason, 0)
            if n:
                longest = f" (longest {self.max_sample_tokens} tokens)" \
                    if reason == "too_long_for_plan" else ""
                parts.append(f"{n} {reason}{longest}")
        return ", ".join(parts) or "none dropped"


def read_rows(*, data_files: Sequence[str] = (), payload_file: str | None = None
              ) -> list[dict[str, Any]]:
    """Rows with ``sample_id``, ``messages``, ``tools`` from Parquet files or a JSONL payload."""
    import fsspec

    rows: list[dict[str, Any]] = []
    if payload_file:
        with fsspec.open(payload_file, "rt", encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"payload_file: line {n} is not JSON ({e})") from None
                if not isinstance(obj, dict) or "messages" not in obj:
                    raise ValueError(f"payload_file: line {n} has no 'messages'")
                rows.append({"sample_id": str(obj.get("sample_id") or f"line-{n}"),
                             "messages": obj["messages"], "tools": obj.get("tools") or []})
        return rows
    import pyarrow.parquet as pq

    for path in data_files:
        with fsspec.open(path, "rb") as f:
            table = pq.read_table(f)
        missing = {"sample_id", "messages", "tools"} - set(table.column_names)
        if missing:
            raise ValueError(f"data_files: {path} lacks columns {sorted(missing)}")
        rows.extend(table.select(["sample_id", "messages", "tools"]).to_pylist())
    return rows


def tokenize(rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_seq_len: int
             ) -> tuple[list[Example], DataStats]:
    """Rows to examples with ``trainer.chat.encode``; a row that cannot train whole is dropped
    and counted by its reason (``DROP_REASONS``)."""
    examples: list[Example] = []
    dropped = dict.fromkeys(DROP_REASONS, 0)
    longest = 0
    for row in rows:
        try:
            ids, labels = encode(row["messages"], row.get("tools"), tokenizer)
        except (ValueError, KeyError, TypeError):
            dropped["unrenderable"] += 1
            continue
        longest = max(longest, len(ids))
        if len(ids) > max_seq_len:
            dropped["too_long_for_plan"] += 1
            continue
        # Position 0 is never a target (nothing precedes it); a sample needs one target after it.
        if not _num_targets(labels):
            dropped["no_target"] += 1
            continue
        examples.append(Example(sample_id=str(row["sample_id"]), input_ids=ids, labels=labels))
    stats = DataStats(num_samples=len(rows), num_examples=len(examples),
                      num_dropped=sum(dropped.values()), num_dropped_by_reason=dropped,
                      max_sample_tokens=longest,
                      num_tokens=sum(len(e.input_ids) for e in examples),
                      num_label_tokens=sum(_num_targets(e.labels) for e in examples))
    return examples, stats


def plan_tokenizer(base_model: str) -> Any:
    """The tokenizer the trainer renders samples with: the base model's, with our chat template.

    A local path that does not exist is a ``ValueError`` (a configuration error); a hub id
    that cannot be fetched stays an ``OSError`` (the network may come back).
    """
    from .chat import install_chat_template
    from .model import load_tokenizer

    path = Path(base_model).expanduser()
    if (path.is_absolute() or base_model.startswith((".", "~"))) and not path.exists():
        raise ValueError(f"plan.base_model: no such directory {base_model}")
    return install_chat_template(load_tokenizer(base_model))


def check_plan_data(rows: Sequence[dict[str, Any]], tokenizer: Any, *, max_seq_len: int
                    ) -> DataStats:
    """The pre-launch check: tokenize ``rows`` exactly as the trainer will, and raise a
    ``ValueError`` naming the numbers when the plan would drop more than ``MAX_DROP_FRACTION``
    of them. No kept sample lacks a target: ``tokenize`` drops those (``no_target``), and the
    drops count toward the limit."""
    _, stats = tokenize(rows, tokenizer, max_seq_len=max_seq_len)
    n, dropped = stats.num_samples, stats.num_dropped
    if not n:
        raise ValueError("no training samples")
    if dropped / n > MAX_DROP_FRACTION:
        raise ValueError(
            f"plan max_seq_len {max_seq_len} would drop {dropped} of {n} training samples "
            f"({dropped / n:.1%}, over the {MAX_DROP_FRACTION:.0%} limit): "
            f"{stats.describe_drops()}")
    return stats


def check_job_data(job: Job) -> DataStats:
    """``check_plan_data`` over the training rows ``job`` reads, with its base model's
    tokenizer; the held-out rows must keep at least one sample. Returns the training stats."""
    tokenizer = plan_tokenizer(job.plan.base_model)
    rows = read_rows(data_files=job.data_files, payload_file=job.payload_file)
    stats = check_plan_data(rows, tokenizer, max_seq_len=job.plan.max_seq_len)
    if job.eval_data_files:
        held_out, ev = tokenize(read_rows(data_files=job.eval_data_files), tokenizer,
                                max_seq_len=job.plan.max_seq_len)
        if not held_out:
            raise ValueError(f"plan max_seq_len {job.plan.max_seq_len} would keep none of the "
                             f"{ev.num_samples} held-out samples: {ev.describe_drops()}")
    return stats


def fingerprint(examples: Sequence[Example]) -> str:
    """Identity of the tokenized data: a resume against different data is refused."""
    h = hashlib.sha256()
    for e in examples:
        h.update(e.sample_id.encode())
        h.update(len(e.input_ids).to_bytes(4, "little"))
    return h.hexdigest()


def _num_targets(labels: Sequence[int]) -> int:
    return sum(1 for lab in labels[1:] if lab != IGNORE_INDEX)


def pack(lengths: Sequence[int], order: Sequence[int], max_len: int) -> list[list[int]]:
    """First-fit packing of examples (in ``order``) into rows of at most ``max_len`` tokens."""
    rows: list[list[int]] = []
    room: list[int] = []
    first_open = 0
    for i in order:
        n = lengths[i]
        for r in range(first_open, len(rows)):
            if room[r] >= n:
                rows[r].append(i)
                room[r] -= n
                break
        else:
            rows.append([i])
            room.append(max_len - n)
            first_open = max(first_open, len(rows) - _OPEN_ROWS)
    return rows


def first_target(labels: Sequence[int]) -> int:
    """Index of the first trained token (position 0 is never one); ``len(labels)`` if none."""
    for t in range(1, len(labels)):
        if labels[t] != IGNORE_INDEX:
            return t
    return len(labels)


def shared_prefix_length(examples: Sequence[Example]) -> int:
    """Tokens all ``examples`` begin with, ending before the first trained token of each.

    The token right after the prefix is then never a target, so a rest placed after another
    rest (``collate_shared``) loses no prediction: that token's target is ignored either way.
    """
    if not examples:
        return 0
    return common_prefix([e.input_ids for e in examples],
                         min(first_target(e.labels) - 1 for e in examples))


@dataclass(frozen=True, kw_only=True)
class Batch:
    """One micro-batch as tensors."""

    input_ids: torch.Tensor
    """[B, L] token ids (padding: the pad id)."""
    position_ids: torch.Tensor
    """[B, L] positions, restarting at 0 for each packed sample."""
    labels: torch.Tensor
    """[B, L] targets; ``IGNORE_INDEX`` where no loss is taken."""
    attention_mask: torch.Tensor | None
    """[B, L] 1/0 padding mask for unpacked rows; None for packed rows."""
    sample_index: torch.Tensor
    """[B, L] index of the example each token comes from (-1 for padding)."""
    num_real_tokens: int
    """Non-padding tokens."""
    num_label_tokens: int
    """Tokens the loss is taken on."""
    num_row_tokens: int = 0
    """Non-padding tokens of the rows, the tokens computed: ``num_real_tokens`` less the shared
    prefixes computed once (0: the same as ``num_real_tokens``)."""

    @property
    def num_computed_tokens(self) -> int:
        return self.num_row_tokens or self.num_real_tokens

    def to(self, device: torch.device) -> Batch:
        return Batch(input_ids=self.input_ids.to(device), position_ids=self.position_ids.to(device),
                     labels=self.labels.to(device),
                     attention_mask=None if self.attention_mask is None
                     else self.attention_mask.to(device),
                     sample_index=self.sample_index, num_real_tokens=self.num_real_tokens,
                     num_label_tokens=self.num_label_tokens, num_row_tokens=self.num_row_tokens)


def collate(examples: Sequence[Example], rows: Sequence[Sequence[int]], *, packed: bool,
            pad_id: int) -> Batch:
    """Rows of example indices to a padded micro-batch (padded to its longest row)."""
    length = max(sum(len(examples[i].input_ids) for i in row) for row in rows)
    ids, pos, labs, idx, mask = [], [], [], [], []
    real = 0
    for row in rows:
        assert packed or len(row) == 1, "unpacked rows hold one sample"
        r_ids: list[int] = []
        r_pos: list[int] = []
        r_lab: list[int] = []
        r_idx: list[int] = []
        for i in row:
            e = examples[i]
            r_ids += e.input_ids
            r_pos += range(len(e.input_ids))
            # The first token of a packed sample must never be the target of the previous one.
            r_lab += [IGNORE_INDEX] + e.labels[1:]
            r_idx += [i] * len(e.input_ids)
        real += len(r_ids)
        pad = length - len(r_ids)
        mask.append([1] * len(r_ids) + [0] * pad)
        # Packed padding restarts positions: a segment of its own that no sample attends to.
        r_pos += range(pad) if packed else range(len(r_pos), len(r_pos) + pad)
        ids.append(r_ids + [pad_id] * pad)
        pos.append(r_pos)
        labs.append(r_lab + [IGNORE_INDEX] * pad)
        idx.append(r_idx + [-1] * pad)
    labels = torch.tensor(labs, dtype=torch.long)
    return Batch(input_ids=torch.tensor(ids, dtype=torch.long),
                 position_ids=torch.tensor(pos, dtype=torch.long), labels=labels,
                 attention_mask=None if packed else torch.tensor(mask, dtype=torch.long),
                 sample_index=torch.tensor(idx, dtype=torch.long), num_real_tokens=real,
                 num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()))


def collate_shared(examples: Sequence[Example], indices: Sequence[int], prefix: int) -> Batch:
    """The examples ``indices`` as one row: their first ``prefix`` tokens (the same in all, see
    ``shared_prefix_length``) once, then each example's rest at positions ``prefix...``."""
    first = examples[indices[0]]
    ids = list(first.input_ids[:prefix])
    pos = list(range(prefix))
    labs = [IGNORE_INDEX] * prefix
    idx = [indices[0]] * prefix
    real = 0
    for i in indices:
        e = examples[i]
        n = len(e.input_ids)
        real += n
        ids += e.input_ids[prefix:]
        pos += range(prefix, n)
        # e.labels[prefix] is never a target (the prefix ends before the first one).
        labs += e.labels[prefix:]
        idx += [i] * (n - prefix)
    labels = torch.tensor([labs], dtype=torch.long)
    return Batch(input_ids=torch.tensor([ids], dtype=torch.long),
                 position_ids=torch.tensor([pos], dtype=torch.long), labels=labels,
                 attention_mask=None, sample_index=torch.tensor([idx], dtype=torch.long),
                 num_real_tokens=real, num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
                 num_row_tokens=len(ids))


class MicroBatchStream:
    """The endless, deterministic sequence of micro-batches over epochs.

    Global micro-batch ``k`` belongs to epoch ``k // per_epoch``; an optimizer step consumes
    ``grad_accum_steps * world_size`` consecutive ones, rank ``r`` taking every ``world_size``-th.
    """

    def __init__(self, examples: Sequence[Example], *, max_seq_len: int, packing: bool,
                 micro_batch_size: int, seed: int, pad_id: int, shuffle: bool = True,
                 share_prefix: bool = False) -> None:
        if not examples:
            raise ValueError("data_files: no usable samples (each needs an assistant turn)")
        self.examples = examples
        self.max_seq_len = max_seq_len
        self.packing = packing
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.shuffle = shuffle
        self.share_prefix = share_prefix
        self._cache: dict[int, list[list[list[int]]]] = {}
        self.per_epoch = len(self._layout(0))

    def _layout(self, epoch: int) -> list[list[list[int]]]:
        """Micro-batches of rows of example indices for ``epoch``."""
        if epoch not in self._cache:
            n = len(self.examples)
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                order = torch.randperm(n, generator=g).tolist()
            else:
                order = list(range(n))
            if self.packing:
                rows = pack([len(e.input_ids) for e in self.examples], order, self.max_seq_len)
            else:
                rows = [[i] for i in order]
            mbs = self.micro_batch_size
            self._cache = {epoch: [rows[i:i + mbs] for i in range(0, len(rows), mbs)]}
        return self._cache[epoch]

    def rows(self, index: int) -> list[list[int]]:
        return self._layout(index // self.per_epoch)[index % self.per_epoch]

    def _shared(self, index: int) -> tuple[list[int], int] | None:
        """(the micro-batch's example indices, their shared prefix) when ``share_prefix`` makes
        it one row; None when it trains as its rows."""
        if not self.share_prefix:
            return None
        indices = [i for row in self.rows(index) for i in row]
        prefix = shared_prefix_length([self.examples[i] for i in indices])
        return (indices, prefix) if len(indices) > 1 and prefix >= MIN_SHARED_PREFIX else None

    def batch(self, index: int) -> Batch:
        shared = self._shared(index)
        if shared is not None:
            return collate_shared(self.examples, *shared)
        return collate(self.examples, self.rows(index), packed=self.packing, pad_id=self.pad_id)

    def shared_prefix_summary(self) -> dict[str, Any]:
        """What ``share_prefix`` saves over the first epoch: micro-batches that share a prefix,
        and the tokens computed against the samples' own."""
        real = computed = num_shared = 0
        for k in range(self.per_epoch):
            n = sum(len(self.examples[i].input_ids) for row in self.rows(k) for i in row)
            real += n
            shared = self._shared(k)
            if shared is not None:
                indices, prefix = shared
                num_shared += 1
                n -= prefix * (len(indices) - 1)
            computed += n
        return {"micro_batches": num_shared, "of": self.per_epoch, "tokens": real,
                "tokens_computed": computed}

    def num_label_tokens(self, index: int) -> int:
        return sum(_num_targets(self.examples[i].labels) for row in self.rows(index) for i in row)

    def position(self, index: int) -> dict[str, int]:
        return {"microbatch": index, "epoch": index // self.per_epoch,
                "index_in_epoch": index % self.per_epoch, "per_epoch": self.per_epoch}
