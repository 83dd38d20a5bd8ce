"""Samples in, micro-batches out: reading, tokenizing, packing, and a resumable order.

Training data streams (``MixtureStream``): one or more sources (``TrainerJob.mix``, or the job's
data files as one source) are read a block at a time in a seeded order per epoch (``SourceReader``),
sampled by weight, tokenized a window of samples at a time and packed within the window. No
source is tokenized or held whole, and the order is a pure function of (data, plan, seed): the
data position of a checkpoint is where its window began (``MixPosition``: per source an epoch
and an index, and the window's number) plus an offset, and a resumed run draws, reads and packs
the same batches from it. The held-out set is tokenized whole (``MicroBatchStream``): every eval
scores all of it.

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

A vision-language base model (``vision.has_vision``) renders each image of a sample as its
placeholder tokens and feeds the processor's ``pixel_values`` and ``image_grid_thw`` with the
batch (``Batch.pixel_values``, in the order the image tokens appear in the rows); a sample
whose image is not in the blob store is dropped (``missing_image``). Image samples pack like
any other: ``model.CausalLMLoss`` computes each packed segment's 3-D rope positions apart.

A sample is trained whole or not at all: one longer than the plan's ``max_seq_len`` is dropped
(``too_long_for_plan``), never cut, because the cut falls at the end of the conversation, on the
assistant turn the sample exists for. ``check_plan_data`` is the pre-launch check the
``training_run`` asset runs with this same ``tokenize``: it refuses a plan that would drop more
than ``MAX_DROP_FRACTION`` of the samples before any compute is spent.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import json
import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .chat import IGNORE_INDEX, common_prefix, encode, install_chat_template, load_tokenizer
from .config import MIN_SHARED_PREFIX, MixSource, TrainerJob
from .vision import ImageInput, MissingImage, Vision, has_vision, load_vision, stack
from .vision import encode as encode_with_images

if TYPE_CHECKING:
    import torch

# First-fit packing looks at this many open rows: 99%+ fill on realistic length mixes while
# staying linear in the number of samples.
_OPEN_ROWS = 64

DROP_REASONS = ("unrenderable", "missing_image", "too_long_for_plan", "no_target")
"""Why ``tokenize`` drops a sample: its messages cannot be rendered; an image of it is not in
the blob store (vision models only); it is longer than the plan's ``max_seq_len``; it has no
assistant token to train on."""
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
    images: tuple[ImageInput, ...] = ()
    """Its images, in the order of their tokens (a vision model's samples only)."""


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
            rows = [_json_row(line, n) for n, line in enumerate(f, 1) if line.strip()]
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


class _Tally:
    """Counts what tokenizing keeps and drops, for ``DataStats``."""

    def __init__(self, vision: Vision | None = None) -> None:
        self.vision = vision
        self.num_samples = self.num_tokens = self.num_label_tokens = self.longest = 0
        self.kept = 0
        self.dropped = dict.fromkeys(DROP_REASONS, 0)

    def encode(self, row: dict[str, Any], tokenizer: Any, max_seq_len: int) -> Example | None:
        """``row`` as an example with ``trainer.chat.encode``, or None (dropped, counted)."""
        self.num_samples += 1
        images: list[ImageInput] = []
        try:
            if self.vision is not None:
                ids, labels, images = encode_with_images(row["messages"], row.get("tools"),
                                                         tokenizer, self.vision)
            else:
                ids, labels = encode(row["messages"], row.get("tools"), tokenizer)
        except MissingImage:
            self.dropped["missing_image"] += 1
            return None
        except (ValueError, KeyError, TypeError):
            self.dropped["unrenderable"] += 1
            return None
        self.longest = max(self.longest, len(ids))
        if len(ids) > max_seq_len:
            self.dropped["too_long_for_plan"] += 1
            return None
        # Position 0 is never a target (nothing precedes it); a sample needs one target after it.
        targets = _num_targets(labels)
        if not targets:
            self.dropped["no_target"] += 1
            return None
        self.kept += 1
        self.num_tokens += len(ids)
        self.num_label_tokens += targets
        return Example(sample_id=str(row["sample_id"]), input_ids=ids, labels=labels,
                       images=tuple(images))

    def stats(self) -> DataStats:
        return DataStats(num_samples=self.num_samples, num_examples=self.kept,
                         num_dropped=sum(self.dropped.values()),
                         num_dropped_by_reason=dict(self.dropped), max_sample_tokens=self.longest,
                         num_tokens=self.num_tokens, num_label_tokens=self.num_label_tokens)


def tokenize(rows: Iterable[dict[str, Any]], tokenizer: Any, *, max_seq_len: int,
             vision: Vision | None = None) -> tuple[list[Example], DataStats]:
    """Rows to examples with ``trainer.chat.encode`` (``trainer.vision.encode`` with
    ``vision``); a row that cannot train whole is dropped and counted by its reason
    (``DROP_REASONS``)."""
    tally = _Tally(vision)
    examples = [e for row in rows if (e := tally.encode(row, tokenizer, max_seq_len)) is not None]
    return examples, tally.stats()


def plan_tokenizer(base_model: str) -> Any:
    """The tokenizer the trainer renders samples with: the base model's, with our chat template.

    A local path that does not exist is a ``ValueError`` (a configuration error); a hub id
    that cannot be fetched stays an ``OSError`` (the network may come back).
    """
    path = Path(base_model).expanduser()
    if (path.is_absolute() or base_model.startswith((".", "~"))) and not path.exists():
        raise ValueError(f"plan.base_model: no such directory {base_model}")
    return install_chat_template(load_tokenizer(base_model), vision=has_vision(base_model))


MAX_CHECK_ROWS = 10_000
"""Rows of each source after the primary that the pre-launch check tokenizes (~7 s at
~0.7 ms a sample): a general instruction set can be far larger than the traffic, all of which
is checked."""


def check_plan_data(rows: Iterable[dict[str, Any]], tokenizer: Any, *, max_seq_len: int,
                    what: str = "training samples", vision: Vision | None = None) -> DataStats:
    """The pre-launch check: tokenize ``rows`` exactly as the trainer will (holding none), and
    raise a ``ValueError`` naming the numbers when the plan would drop more than
    ``MAX_DROP_FRACTION`` of them. No kept sample lacks a target: ``tokenize`` drops those
    (``no_target``), and the drops count toward the limit."""
    tally = _Tally(vision)
    for row in rows:
        tally.encode(row, tokenizer, max_seq_len)
    stats = tally.stats()
    n, dropped = stats.num_samples, stats.num_dropped
    if not n:
        raise ValueError(f"no {what}")
    if dropped / n > MAX_DROP_FRACTION:
        raise ValueError(
            f"plan max_seq_len {max_seq_len} would drop {dropped} of {n} {what} "
            f"({dropped / n:.1%}, over the {MAX_DROP_FRACTION:.0%} limit): "
            f"{stats.describe_drops()}")
    return stats


def check_job_data(job: TrainerJob) -> DataStats:
    """``check_plan_data`` over the training rows ``job`` reads, with its base model's
    tokenizer: every row of the primary source, the first ``MAX_CHECK_ROWS`` of each other
    source of a mix. The held-out rows must keep at least one sample. Returns the primary
    source's stats."""
    tokenizer = plan_tokenizer(job.plan.base_model)
    vision = load_vision(job.plan.base_model, job.blob_dir)
    sources = job.sources()
    stats = check_plan_data(SourceReader(sources[0], index=0, seed=0).rows(), tokenizer,
                            max_seq_len=job.plan.max_seq_len,
                            what=f"{sources[0].name} samples" if job.mix
                            else "training samples", vision=vision)
    for i, source in enumerate(sources[1:], 1):
        rows = SourceReader(source, index=i, seed=0).rows()
        check_plan_data(itertools.islice(rows, MAX_CHECK_ROWS), tokenizer,
                        max_seq_len=job.plan.max_seq_len, what=f"{source.name} samples",
                        vision=vision)
    if job.eval_data_files:
        held_out, ev = tokenize(read_rows(data_files=job.eval_data_files), tokenizer,
                                max_seq_len=job.plan.max_seq_len, vision=vision)
        if not held_out:
            raise ValueError(f"plan max_seq_len {job.plan.max_seq_len} would keep none of the "
                             f"{ev.num_samples} held-out samples: {ev.describe_drops()}")
    return stats


def sources_fingerprint(sources: Sequence[MixSource]) -> str:
    """Identity of a job's training data: each source's name, weight and the bytes of its
    files (read in 8 MiB blocks, never held). A resume against different data is refused."""
    import fsspec

    h = hashlib.sha256()
    for source in sources:
        h.update(json.dumps([source.name, float(source.weight)]).encode())
        for path in source.data_files or [source.payload_file or ""]:
            with fsspec.open(path, "rb") as f:
                while block := f.read(8 << 20):
                    h.update(block)
            h.update(b"\0")
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
    pixel_values: torch.Tensor | None = None
    """The images' processed patches, in the order of their tokens in the rows (row by row);
    None: no image."""
    image_grid_thw: torch.Tensor | None = None
    """[num_images, 3] each image's patch grid, in the same order."""

    @property
    def num_computed_tokens(self) -> int:
        return self.num_row_tokens or self.num_real_tokens

    def to(self, device: torch.device) -> Batch:
        return Batch(input_ids=self.input_ids.to(device), position_ids=self.position_ids.to(device),
                     labels=self.labels.to(device),
                     attention_mask=None if self.attention_mask is None
                     else self.attention_mask.to(device),
                     sample_index=self.sample_index, num_real_tokens=self.num_real_tokens,
                     num_label_tokens=self.num_label_tokens, num_row_tokens=self.num_row_tokens,
                     pixel_values=None if self.pixel_values is None
                     else self.pixel_values.to(device),
                     image_grid_thw=None if self.image_grid_thw is None
                     else self.image_grid_thw.to(device))


def collate(examples: Sequence[Example], rows: Sequence[Sequence[int]], *, packed: bool,
            pad_id: int) -> Batch:
    """Rows of example indices to a padded micro-batch (padded to its longest row)."""
    import torch

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
    pixels, grids = stack([x for row in rows for i in row for x in examples[i].images])
    return Batch(input_ids=torch.tensor(ids, dtype=torch.long),
                 position_ids=torch.tensor(pos, dtype=torch.long), labels=labels,
                 attention_mask=None if packed else torch.tensor(mask, dtype=torch.long),
                 sample_index=torch.tensor(idx, dtype=torch.long), num_real_tokens=real,
                 num_label_tokens=int((labels[:, 1:] != IGNORE_INDEX).sum()),
                 pixel_values=pixels, image_grid_thw=grids)


def collate_shared(examples: Sequence[Example], indices: Sequence[int], prefix: int) -> Batch:
    """The examples ``indices`` as one row: their first ``prefix`` tokens (the same in all, see
    ``shared_prefix_length``) once, then each example's rest at positions ``prefix...``."""
    import torch

    # Only plain-attention (text) models share prefixes (``load_model``): no images here.
    assert not any(examples[i].images for i in indices), "share_prefix with image samples"
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
    """The endless, deterministic sequence of micro-batches over epochs of examples tokenized
    up front (the held-out set; training streams with ``MixtureStream``).

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
        import torch

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


# ---------------------------------------------------------------------------------------------
# The streaming mixture: the training data path.

WINDOW_SAMPLES = 1024
"""Samples drawn, tokenized and packed together (the lookahead of first-fit packing). At most
the windows of one optimizer step are held tokenized: ~1024 x 300 tokens of a typical
conversation, a few MiB."""
BLOCK_LINES = 1024
"""Lines of a JSONL source read at a time (a Parquet source is read a row group at a time)."""
_COLUMNS = ["sample_id", "messages", "tools"]
_MAX_EMPTY_WINDOWS = 64


def _seed(*parts: int) -> int:
    """A 63-bit generator seed from integers."""
    digest = hashlib.sha256(json.dumps(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def _randperm(n: int, seed: int) -> list[int]:
    import torch

    return torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()


class SourceReader:
    """One source's rows in a seeded order per epoch, read a block at a time.

    A block is a Parquet row group or ``BLOCK_LINES`` lines of a JSONL file. Epoch ``e`` visits
    the blocks in a seeded order and each block's rows in a seeded order, so the row at cursor
    ``(e, i)`` is a pure function of the files, the seed, the source's index, ``e`` and ``i``:
    a position is two integers, and one block of raw rows is held at a time. A source of one
    block is one permutation per epoch seeded ``seed * 1_000_003 + e`` (plus an offset per
    source index), the order ``MicroBatchStream`` gives the same rows.
    """

    def __init__(self, source: MixSource, *, index: int, seed: int) -> None:
        self.name = source.name
        self.index = index
        self.seed = seed
        self.prefix = "payload_file" if source.payload_file else "data_files"
        # (path, row group or byte offset, first line number, rows)
        self.blocks: list[tuple[str, int, int, int]] = []
        if source.payload_file:
            self._index_jsonl(source.payload_file)
        else:
            for path in source.data_files:
                self._index_parquet(path)
        self.num_rows = sum(b[3] for b in self.blocks)
        self._epoch = -1
        self._order: list[int] = []
        self._ends: list[int] = []
        self._loaded: tuple[int, list[dict[str, Any]]] | None = None
        self.peak_rows_held = 0
        """The most raw rows held at once (one block's)."""

    def _index_parquet(self, path: str) -> None:
        import fsspec
        import pyarrow.parquet as pq

        with fsspec.open(path, "rb") as f:
            meta = pq.ParquetFile(f)
            missing = set(_COLUMNS) - set(meta.schema_arrow.names)
            if missing:
                raise ValueError(f"data_files: {path} lacks columns {sorted(missing)}")
            for g in range(meta.num_row_groups):
                n = meta.metadata.row_group(g).num_rows
                if n:
                    self.blocks.append((path, g, 0, n))

    def _index_jsonl(self, path: str) -> None:
        """Validates every line (as ``read_rows`` does) and notes where each block starts."""
        import fsspec

        offset = 0
        count = 0
        start: tuple[int, int] | None = None
        with fsspec.open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                line = raw.decode("utf-8")
                here, offset = offset, offset + len(raw)
                if not line.strip():
                    continue
                _json_row(line, n)
                if start is None:
                    start = (here, n)
                count += 1
                if count == BLOCK_LINES:
                    self.blocks.append((path, start[0], start[1], count))
                    start, count = None, 0
        if start is not None:
            self.blocks.append((path, start[0], start[1], count))

    def _read(self, block: int) -> list[dict[str, Any]]:
        import fsspec

        path, where, first_line, n = self.blocks[block]
        if self.prefix == "data_files":
            import pyarrow.parquet as pq

            with fsspec.open(path, "rb") as f:
                return pq.ParquetFile(f).read_row_group(where, columns=_COLUMNS).to_pylist()
        rows: list[dict[str, Any]] = []
        with fsspec.open(path, "rb") as f:
            f.seek(where)
            for number, raw in enumerate(f, first_line):
                line = raw.decode("utf-8")
                if line.strip():
                    rows.append(_json_row(line, number))
                    if len(rows) == n:
                        break
        return rows

    def rows(self) -> Iterator[dict[str, Any]]:
        """Every row in file order, a block at a time."""
        for b in range(len(self.blocks)):
            yield from self._read(b)

    def _epoch_seed(self, epoch: int) -> int:
        return (self.seed * 1_000_003 + epoch + self.index * 7_777_777_777) % 2**63

    def row(self, epoch: int, i: int) -> dict[str, Any]:
        """Row ``i`` of epoch ``epoch``'s order."""
        if epoch != self._epoch:
            num_blocks = len(self.blocks)
            self._order = _randperm(num_blocks, self._epoch_seed(epoch)) if num_blocks > 1 \
                else [0]
            self._ends = list(itertools.accumulate(self.blocks[b][3] for b in self._order))
            self._epoch, self._loaded = epoch, None
        k = bisect.bisect_right(self._ends, i)
        block = self._order[k]
        if self._loaded is None or self._loaded[0] != block:
            self._loaded = None
            rows = self._read(block)
            seed = self._epoch_seed(epoch) if len(self.blocks) == 1 \
                else _seed(self.seed, self.index, epoch, block)
            self._loaded = (block, [rows[j] for j in _randperm(len(rows), seed)])
            self.peak_rows_held = max(self.peak_rows_held, len(rows))
        return self._loaded[1][i - (self._ends[k - 1] if k else 0)]


def _json_row(line: str, n: int) -> dict[str, Any]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise ValueError(f"payload_file: line {n} is not JSON ({e})") from None
    if not isinstance(obj, dict) or "messages" not in obj:
        raise ValueError(f"payload_file: line {n} has no 'messages'")
    return {"sample_id": str(obj.get("sample_id") or f"line-{n}"),
            "messages": obj["messages"], "tools": obj.get("tools") or []}


@dataclass(frozen=True, kw_only=True)
class MixPosition:
    """Where a window of the mixture begins: all a resume needs to draw the same samples."""

    window: int
    """Windows before it (seeds its draws)."""
    start: int
    """Global index of its first micro-batch."""
    cursors: tuple[tuple[int, int], ...]
    """Per source, (epoch, index in that epoch's order) of the next row."""

    def to_dict(self) -> dict[str, Any]:
        return {"window": self.window, "window_start": self.start,
                "cursors": [list(c) for c in self.cursors]}

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> MixPosition:
        return cls(window=int(raw["window"]), start=int(raw["window_start"]),
                   cursors=tuple((int(e), int(i)) for e, i in raw["cursors"]))


@dataclass(frozen=True, kw_only=True)
class _Window:
    at: MixPosition
    examples: list[Example]
    layout: list[list[list[int]]]
    after: MixPosition

    @property
    def end(self) -> int:
        return self.after.start


class MixtureStream:
    """The endless, deterministic micro-batches of a weighted mixture of sources, streamed.

    Window ``w`` draws up to ``window_samples`` sources with replacement by weight (a generator
    seeded by ``seed`` and ``w``), takes each drawn source's next row (``SourceReader``),
    tokenizes it, packs the window's examples first-fit in draw order (in a seeded order of the
    window when a source has several blocks, which a reader visits one after another) and
    groups the rows into micro-batches. The primary source (the first) finishing an epoch ends
    a window, so a single source trains in whole epochs, each window one epoch while the source
    fits in one: the batches ``MicroBatchStream`` gives the same rows when no sample is dropped.

    So the data position of a micro-batch is its window's ``MixPosition`` plus an offset, and a
    resume from it draws, reads and packs the same batches. Windows are made as indices are
    asked for, in increasing order, and those wholly before ``release(index)`` are dropped: the
    tokenized samples held are the windows of the current optimizer step (``peak_examples_held``).
    Global micro-batch ``k``: an optimizer step consumes ``grad_accum_steps * world_size``
    consecutive ones, rank ``r`` taking every ``world_size``-th, as with ``MicroBatchStream``.
    """

    def __init__(self, sources: Sequence[MixSource], tokenizer: Any, *, max_seq_len: int,
                 packing: bool, micro_batch_size: int, seed: int, pad_id: int,
                 share_prefix: bool = False, window_samples: int = WINDOW_SAMPLES,
                 vision: Vision | None = None) -> None:
        if not sources:
            raise ValueError("mix: no sources")
        self.readers = [SourceReader(s, index=i, seed=seed) for i, s in enumerate(sources)]
        for reader in self.readers:
            if not reader.num_rows:
                where = f"mix source {reader.name}" if len(sources) > 1 else reader.prefix
                raise ValueError(f"{where}: no samples")
        self.names = [s.name for s in sources]
        import torch

        weights = torch.tensor([float(s.weight) for s in sources], dtype=torch.float64)
        self.shares = (weights / weights.sum()).tolist()
        self._weights = weights
        self.tokenizer = tokenizer
        self.max_seq_len = max_seq_len
        self.packing = packing
        self.micro_batch_size = micro_batch_size
        self.seed = seed
        self.pad_id = pad_id
        self.share_prefix = share_prefix
        self.window_samples = window_samples
        self.tally = _Tally(vision)
        self.drawn = [0] * len(sources)
        """Rows drawn from each source by this process."""
        self.peak_examples_held = 0
        """The most tokenized samples held at once."""
        self._windows: list[_Window] = []
        self._next = MixPosition(window=0, start=0, cursors=((0, 0),) * len(sources))
        first = self._generate()
        self.first_window_stats = self.tally.stats()
        """What tokenizing the first window kept and dropped (the whole primary epoch when it
        fits in one window)."""
        self.per_epoch = 0
        """Micro-batches per epoch of the primary source: exact when its epoch ended the first
        window, else scaled from that window by the primary's rows; 0 when the first window
        kept no sample (the data cannot train)."""
        self._summary: dict[str, Any] = {}
        if first.layout:
            self._windows = [first]
            self.peak_examples_held = len(first.examples)
            epoch, primary_rows = first.after.cursors[0]
            self.per_epoch = len(first.layout) if epoch else max(1, math.ceil(
                len(first.layout) * self.readers[0].num_rows / max(1, primary_rows)))
            self._summary = self._prefix_summary(first)

    def _generate(self) -> _Window:
        import torch

        at = self._next
        cursors = list(at.cursors)
        if len(self.readers) > 1:
            g = torch.Generator().manual_seed(_seed(self.seed, -1, at.window))
            draws = torch.multinomial(self._weights, self.window_samples, replacement=True,
                                      generator=g).tolist()
        else:
            draws = [0] * self.window_samples
        examples: list[Example] = []
        for s in draws:
            reader = self.readers[s]
            epoch, i = cursors[s]
            row = reader.row(epoch, i)
            cursors[s] = (epoch + 1, 0) if i + 1 == reader.num_rows else (epoch, i + 1)
            self.drawn[s] += 1
            example = self.tally.encode(row, self.tokenizer, self.max_seq_len)
            if example is not None:
                examples.append(example)
            if s == 0 and cursors[0][0] != epoch:
                break
        if any(len(r.blocks) > 1 for r in self.readers):
            # A source of several files or row groups yields them one block after another:
            # the window's samples are mixed so a run does not train one file, then the next.
            # (One block is already one permutation an epoch.)
            g = torch.Generator().manual_seed(_seed(self.seed, -2, at.window))
            examples = [examples[j] for j in torch.randperm(len(examples), generator=g).tolist()]
        if self.packing:
            rows = pack([len(e.input_ids) for e in examples], range(len(examples)),
                        self.max_seq_len)
        else:
            rows = [[i] for i in range(len(examples))]
        mbs = self.micro_batch_size
        layout = [rows[i:i + mbs] for i in range(0, len(rows), mbs)]
        self._next = MixPosition(window=at.window + 1, start=at.start + len(layout),
                                 cursors=tuple(cursors))
        return _Window(at=at, examples=examples, layout=layout, after=self._next)

    def _window(self, index: int) -> _Window:
        """The window holding micro-batch ``index``, made (and those before it) if need be."""
        if self._windows and index < self._windows[0].at.start:
            raise ValueError(f"micro-batch {index} was released (the stream is at "
                             f"{self._windows[0].at.start})")
        for w in self._windows:
            if w.at.start <= index < w.end:
                return w
        empty = 0
        while True:
            w = self._generate()
            if w.layout:
                self._windows.append(w)
                held = sum(len(x.examples) for x in self._windows)
                self.peak_examples_held = max(self.peak_examples_held, held)
                if index < w.end:
                    return w
                empty = 0
            else:
                empty += 1
                if empty >= _MAX_EMPTY_WINDOWS:
                    raise ValueError(f"{_MAX_EMPTY_WINDOWS} windows of the mixture in a row "
                                     f"kept no sample: {self.tally.stats().describe_drops()}")

    def release(self, index: int) -> None:
        """Drop the windows wholly before micro-batch ``index``."""
        self._windows = [w for w in self._windows if w.end > index]

    def seek(self, position: dict[str, Any]) -> None:
        """Continue from a checkpoint's ``data_position`` (see ``position``)."""
        at = MixPosition.from_dict(position)
        if len(at.cursors) != len(self.readers):
            raise ValueError(f"resume: the position has {len(at.cursors)} sources, the job "
                             f"{len(self.readers)}")
        self._windows = []
        self._next = at
        self._window(int(position["microbatch"]))

    def rows(self, index: int) -> list[list[int]]:
        w = self._window(index)
        return w.layout[index - w.at.start]

    def sample_ids(self, index: int) -> list[str]:
        """The sample ids micro-batch ``index`` trains on, row by row."""
        w = self._window(index)
        return [w.examples[i].sample_id for row in w.layout[index - w.at.start] for i in row]

    def _shared(self, w: _Window, index: int) -> tuple[list[int], int] | None:
        if not self.share_prefix:
            return None
        indices = [i for row in w.layout[index - w.at.start] for i in row]
        prefix = shared_prefix_length([w.examples[i] for i in indices])
        return (indices, prefix) if len(indices) > 1 and prefix >= MIN_SHARED_PREFIX else None

    def batch(self, index: int) -> Batch:
        w = self._window(index)
        shared = self._shared(w, index)
        if shared is not None:
            return collate_shared(w.examples, *shared)
        return collate(w.examples, w.layout[index - w.at.start], packed=self.packing,
                       pad_id=self.pad_id)

    def num_label_tokens(self, index: int) -> int:
        w = self._window(index)
        return sum(_num_targets(w.examples[i].labels)
                   for row in w.layout[index - w.at.start] for i in row)

    def shared_prefix_summary(self) -> dict[str, Any]:
        """What ``share_prefix`` saves over the first window (an epoch of the primary source
        when it fits): micro-batches that share a prefix, and tokens computed against the
        samples' own."""
        return dict(self._summary)

    def _prefix_summary(self, w: _Window) -> dict[str, Any]:
        real = computed = num_shared = 0
        for k in range(len(w.layout)):
            n = sum(len(w.examples[i].input_ids) for row in w.layout[k] for i in row)
            real += n
            shared = self._shared(w, k)
            if shared is not None:
                indices, prefix = shared
                num_shared += 1
                n -= prefix * (len(indices) - 1)
            computed += n
        return {"micro_batches": num_shared, "of": len(w.layout), "tokens": real,
                "tokens_computed": computed}

    def position(self, index: int) -> dict[str, Any]:
        """Micro-batch ``index``'s data position: its window's ``MixPosition`` and the primary
        source's epoch, for a checkpoint (``seek``) and the progress events."""
        w = self._window(index)
        return {"microbatch": index, "epoch": w.at.cursors[0][0],
                "per_epoch": self.per_epoch, **w.at.to_dict()}

    def summary(self) -> dict[str, Any]:
        """The sources, their shares and the rows drawn from each by this process."""
        return {name: {"share": share, "rows": r.num_rows, "drawn": n}
                for name, share, r, n in zip(self.names, self.shares, self.readers, self.drawn,
                                             strict=True)}
