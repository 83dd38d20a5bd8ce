"""The one place that declares every lake table's schema.

Tables live in namespace ``factory`` and are created on first use. A field added here reaches an
existing table through Iceberg schema evolution (``union_by_name``); nothing is ever dropped.
Each capability adds its tables to ``TABLES`` below, next to the others.
"""

from __future__ import annotations

import pyarrow as pa

from factory.errors import UnknownTableError

NAMESPACE = "factory"

_TS = pa.timestamp("us", tz="UTC")
_TAGS = pa.map_(pa.string(), pa.string())

# The columns of a canonical sample, shared by ``samples`` and the per-experiment datasets.
_SAMPLE_FIELDS: list[tuple[str, pa.DataType]] = [
    ("sample_id", pa.string()),
    ("raw_trace_id", pa.string()),
    ("source", pa.string()),
    ("provider", pa.string()),
    ("model", pa.string()),
    ("messages", pa.string()),        # canonical JSON
    ("tools", pa.string()),           # canonical JSON
    ("num_turns", pa.int32()),
    ("has_images", pa.bool_()),
    ("has_tool_calls", pa.bool_()),
    ("created_at", _TS),
    ("project", pa.string()),
    ("tags", _TAGS),
]

TABLES: dict[str, pa.Schema] = {
    # Every input record, once (id = content hash), before anything else happens to it.
    "raw_traces": pa.schema([
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),          # upload | proxy | otel
        ("format", pa.string()),          # detected (or forced) input format
        ("received_at", _TS),
        ("project", pa.string()),
        ("tags", _TAGS),
        ("payload", pa.string()),         # the record as received (JSON text)
    ]),
    # Canonical samples (shared/docs/canonical-sample.md): one row per conversation of a record.
    "samples": pa.schema(_SAMPLE_FIELDS),
    # Records that could not be normalized, with the field and what was wrong.
    "rejected_traces": pa.schema([
        ("raw_trace_id", pa.string()),
        ("source", pa.string()),
        ("format", pa.string()),
        ("received_at", _TS),
        ("reason", pa.string()),
        ("payload", pa.string()),
    ]),
    # Gateway routing table (append-only; the latest row per model wins, active=false removes).
    "routes": pa.schema([
        ("model", pa.string()),
        ("provider", pa.string()),        # openai | anthropic | gemini: the API it speaks
        ("base_url", pa.string()),
        ("deployment", pa.string()),      # upstream model name, when it differs
        ("version", pa.string()),
        ("active", pa.bool_()),
        ("registered_at", _TS),
        ("structured_outputs", pa.string()),  # JSON added to requests without one, or null
    ]),
    # Base models built into plain Hugging Face directories.
    "base_models": pa.schema([
        ("name", pa.string()),
        ("path", pa.string()),
        ("source", pa.string()),
        ("sha256", pa.string()),          # hash of the weights file
        ("num_parameters", pa.int64()),
        ("built_at", _TS),
    ]),
    # Curation (factory/curation): per-experiment datasets; each overwrite is one version.
    **{name: pa.schema([
        ("experiment", pa.string()),
        *_SAMPLE_FIELDS,
        ("split", pa.string()),           # train | eval
        # the unit held out whole: its phrasing cluster (eval_split phrasing) or its split group
        # (recall only), named by its smallest sample_id; the evals' intervals treat a cluster's
        # samples as correlated (factory.evals.selection.summarize)
        ("split_group", pa.string()),
        ("num_tokens", pa.int32()),       # base tokenizer + chat template
        ("num_prompt_tokens", pa.int32()),
        ("num_completion_tokens", pa.int32()),
        ("language", pa.string()),
        ("origin", pa.string()),          # traffic | synthetic (synthetic_samples has its origin)
    ]) for name in ("dataset_train", "dataset_eval")},
    # Every row curation removed, with the step and the reason.
    "dataset_drops": pa.schema([
        ("experiment", pa.string()),
        ("sample_id", pa.string()),
        ("raw_trace_id", pa.string()),
        ("split", pa.string()),
        ("step", pa.string()),            # empty | max_tokens | exact_dup | near_dup | ...
        ("reason", pa.string()),
        ("detail", pa.string()),
        ("origin", pa.string()),          # traffic | synthetic
    ]),
    # Synthesis (factory/curation/synthesis): samples a teacher wrote for an experiment's thin
    # slices, one row per attempt that gave a sample, with its origin. Append-only; an
    # attempt_id is written once (to this table or to synthesis_drops), so a resumed synthesis
    # skips what exists.
    "synthetic_samples": pa.schema([
        ("experiment", pa.string()),
        ("attempt_id", pa.string()),      # hash of experiment, slice and attempt index
        *_SAMPLE_FIELDS,                  # source 'synthetic', model = the teacher model
        ("slice", pa.string()),           # <dimension>:<value> it was written for
        ("attempt", pa.int32()),          # index within the slice
        ("teacher", pa.string()),         # the teacher model name
        ("teacher_base_url", pa.string()),
        ("prompt", pa.string()),          # JSON: the messages that asked for the request
        ("seed_sample_ids", pa.list_(pa.string())),  # train samples shown to the teacher
        ("samples_snapshot_id", pa.int64()),  # the samples snapshot the seeds came from
        ("confidence", pa.float64()),     # probability the teacher gave its answer (null:
                                          # min_confidence unset, or no logprobs returned)
    ]),
    # Attempts that gave no sample, with the reason (malformed, refusal, timeout, ...).
    "synthesis_drops": pa.schema([
        ("experiment", pa.string()),
        ("attempt_id", pa.string()),
        ("slice", pa.string()),
        ("attempt", pa.int32()),
        ("teacher", pa.string()),
        ("seed_sample_ids", pa.list_(pa.string())),
        ("step", pa.string()),            # request (writing the user turn) | answer
        ("reason", pa.string()),          # malformed | refusal | timeout | teacher_error |
                                          # truncated | off_slice | low_confidence |
                                          # no_logprobs | duplicate
        ("detail", pa.string()),
        ("created_at", _TS),
    ]),
    # Control plane (factory/control). Runs and segments are append-only: latest row per id wins.
    "training_runs": pa.schema([
        ("run_id", pa.string()),
        ("experiment", pa.string()),
        ("kind", pa.string()),            # train | eval
        ("priority", pa.int32()),         # lower runs first
        ("status", pa.string()),          # queued | running | finished | failed | stopped |
                                          # cancelled
        ("job", pa.string()),             # the trainer Job as JSON (current learning rate)
        ("num_recoveries", pa.int32()),
        ("learning_rate", pa.float64()),  # after any NaN backoff
        ("reason", pa.string()),
        ("submitted_at", _TS),
        ("updated_at", _TS),
        ("not_before", _TS),              # recovery backoff: no relaunch before this
    ]),
    "training_segments": pa.schema([
        ("segment_id", pa.string()),
        ("run_id", pa.string()),
        ("seq", pa.int32()),              # 0, 1, ... within the run
        ("provider", pa.string()),
        ("handle", pa.string()),          # provider handle as JSON (sandbox id, pod, pid)
        ("status", pa.string()),          # launched | running | ended
        ("launched_at", _TS),
        ("deadline", _TS),                # hard wall-clock limit of the sandbox, if any
        ("resume_from", pa.string()),
        ("resume_step", pa.int64()),
        ("first_step", pa.int64()),
        ("last_step", pa.int64()),
        ("end_reason", pa.string()),      # finished | rollover | preempted | killed | failed |
                                          # nan | heartbeat | stopped | superseded
        ("ended_at", _TS),
        ("learning_rate", pa.float64()),
        ("updated_at", _TS),
    ]),
    "training_events": pa.schema([
        ("event_id", pa.string()),
        ("run_id", pa.string()),
        ("segment_id", pa.string()),      # the control plane's segment (from URL or file)
        ("trainer_segment", pa.string()),
        ("type", pa.string()),
        ("seq", pa.int64()),
        ("step", pa.int64()),
        ("event_time", _TS),
        ("received_at", _TS),
        ("source", pa.string()),          # webhook | events_file
        ("key_id", pa.string()),
        ("payload", pa.string()),         # the event as JSON
    ]),
    "checkpoints": pa.schema([
        ("run_id", pa.string()),
        ("experiment", pa.string()),
        ("step", pa.int64()),
        ("path", pa.string()),            # inference-ready adapter directory
        ("manifest_sha256", pa.string()),
        ("files_sha256", pa.string()),    # sha256 of the manifest's file list: one for a re-save of the same files
        ("verified", pa.bool_()),
        ("received_at", _TS),
        ("event_id", pa.string()),
        ("superseded_by", pa.string()),   # event_id of the checkpoint now in its directory
    ]),
    "scheduler_assignments": pa.schema([
        ("job_id", pa.string()),
        ("kind", pa.string()),
        ("priority", pa.int32()),
        ("provider", pa.string()),        # null while it waits
        ("status", pa.string()),          # assigned | waiting
        ("backfilled", pa.bool_()),
        ("submitted_at", _TS),
        ("decided_at", _TS),
        ("wait_s", pa.float64()),
        ("reason", pa.string()),
    ]),
    # One row per experiment (per version: its snapshots), read by the planner.
    # Planner (factory/planner): one row per planning of a run; latest row per run_key wins.
    "training_plans": pa.schema([
        ("run_key", pa.string()),          # <experiment> or <experiment>/k=v/k=v
        ("experiment", pa.string()),
        ("recipe", pa.string()),
        ("point", pa.string()),            # JSON sweep point
        ("experiment_sha", pa.string()),   # sha256 of the experiment file
        ("dataset_version", pa.string()),  # of the dataset_profile row planned from
        ("created_at", _TS),
        ("gpu", pa.string()),
        ("num_devices", pa.int32()),
        ("max_seq_len", pa.int32()),
        ("micro_batch_size", pa.int32()),
        ("grad_accum_steps", pa.int32()),
        ("learning_rate", pa.float64()),
        ("lora_rank", pa.int32()),
        ("peak_memory_gib", pa.float64()),
        ("estimated_hours", pa.float64()),
        ("train_config", pa.string()),     # JSON: trainer TrainConfig keyword arguments
        ("plan", pa.string()),             # JSON: Plan.to_dict() (values, reasons, memory)
    ]),
    "dataset_profile": pa.schema([
        ("experiment", pa.string()),
        ("dataset_version", pa.string()),  # content hash of the train/eval sample ids
        ("created_at", _TS),
        ("engine", pa.string()),           # embedded | spark
        ("tokenizer", pa.string()),
        ("samples_snapshot_id", pa.int64()),
        ("config", pa.string()),           # JSON of the curation settings
        ("num_selected", pa.int64()),
        ("num_train", pa.int64()),
        ("num_eval", pa.int64()),
        ("num_dropped", pa.int64()),
        ("prompt_tokens_p50", pa.int32()),
        ("prompt_tokens_p95", pa.int32()),
        ("prompt_tokens_p99", pa.int32()),
        ("prompt_tokens_max", pa.int32()),
        ("completion_tokens_p50", pa.int32()),
        ("completion_tokens_p95", pa.int32()),
        ("completion_tokens_p99", pa.int32()),
        ("completion_tokens_max", pa.int32()),
        ("total_tokens_p50", pa.int32()),
        ("total_tokens_p95", pa.int32()),
        ("total_tokens_p99", pa.int32()),
        ("total_tokens_max", pa.int32()),
        ("num_train_tokens", pa.int64()),
        ("shared_prefix_tokens", pa.int32()),  # what share_prefix computes once (planner)
        ("turns_mean", pa.float64()),
        ("turns_p50", pa.int32()),
        ("turns_max", pa.int32()),
        ("share_with_images", pa.float64()),
        ("share_with_tool_calls", pa.float64()),
        ("languages", pa.string()),        # JSON {code: share of train samples}
        ("size_bytes", pa.int64()),
        ("drops_by_reason", pa.string()),  # JSON {reason: rows}
        ("num_synthetic", pa.int64()),     # train samples of origin synthetic
        ("share_synthetic", pa.float64()),  # of the train samples
        ("slices", pa.string()),           # JSON [{dimension, value, num_traffic,
                                           # num_synthetic, thin}] (factory.curation.slices)
        ("eval_split", pa.string()),       # phrasing | recall only (factory.curation.phrasing)
        ("eval_split_reason", pa.string()),  # how the eval set was held out, with numbers
        ("num_phrasing_clusters", pa.int64()),
    ]),
    # Evals (factory/evals): one row per rubric version of an experiment.
    "rubrics": pa.schema([
        ("experiment", pa.string()),
        ("version", pa.string()),          # hash of the criteria
        ("source", pa.string()),           # auto | auto+llm | inline
        ("num_examples", pa.int32()),
        ("rubric", pa.string()),           # JSON {"criteria": [...]}
        ("created_at", _TS),
    ]),
    # One row per (run, step, sample): base model = step 0, reference answers = step null.
    "eval_scores": pa.schema([
        ("run_id", pa.string()),
        ("experiment", pa.string()),
        ("step", pa.int64()),
        ("kind", pa.string()),             # base | checkpoint | reference
        ("checkpoint_path", pa.string()),
        ("rubric_version", pa.string()),
        ("sample_id", pa.string()),
        ("response", pa.string()),
        ("score", pa.float64()),           # 0..1; null when the judge failed
        ("status", pa.string()),           # ok | failed
        ("judge", pa.string()),
        ("criteria", pa.string()),         # JSON {name: {score, assessment}}
        ("assessment", pa.string()),
        ("error", pa.string()),
        ("finish_reason", pa.string()),
        ("num_completion_tokens", pa.int32()),
        ("evaluated_at", _TS),
    ]),
    # Each best_checkpoint materialization (latest row per experiment wins).
    "best_checkpoints": pa.schema([
        ("experiment", pa.string()),
        ("run_id", pa.string()),
        ("step", pa.int64()),
        ("path", pa.string()),
        ("rubric_version", pa.string()),
        ("mean_score", pa.float64()),
        ("ci_low", pa.float64()),          # the 95% interval of mean_score
        ("ci_high", pa.float64()),
        ("num_samples", pa.int64()),
        ("base_score", pa.float64()),
        ("reference_score", pa.float64()),
        ("selected_at", _TS),
        ("ci_method", pa.string()),        # wilson (0/1 scores) | wilson_graded | *_clustered
        ("num_clusters", pa.int64()),      # phrasing clusters behind num_samples; null: each
                                           # sample independent (selection.Interval)
    ]),
    # Deployments (factory/deploy): append-only, the latest row per (name, version) wins.
    "deployments": pa.schema([
        ("name", pa.string()),             # the experiment; clients call factory/<name>
        ("version", pa.string()),          # v1, v2, ... (a rollback reuses its version's tag)
        ("checkpoint", pa.string()),       # adapter directory served
        ("run_id", pa.string()),           # the training run of the checkpoint, when known
        ("step", pa.int64()),
        ("base_model", pa.string()),
        ("adapter", pa.string()),          # the name the server knows the adapter by
        ("route_model", pa.string()),      # the stable model name in the gateway
        ("endpoint", pa.string()),         # the server's OpenAI base URL
        ("backend", pa.string()),          # transformers | vllm
        ("status", pa.string()),           # starting | live | candidate | draining | stopped |
                                           # failed
        ("pid", pa.int64()),               # the server's process (and process group) id
        ("port", pa.int32()),
        ("log_path", pa.string()),
        ("reason", pa.string()),
        ("started_at", _TS),
        ("stopped_at", _TS),
        ("updated_at", _TS),
        ("structured_outputs", pa.string()),  # JSON: the decoding constraint its route adds
        ("engine", pa.string()),           # the shared engine it is an adapter of (every
                                           # version of one base on this machine), or null
    ]),
    # Shadow evaluation (factory/shadow): which client-facing model a candidate deployment
    # shadows. Append-only, the latest row per route wins; active=false ends shadowing.
    "shadows": pa.schema([
        ("route", pa.string()),            # the model name clients send (e.g. gpt-4o-mini)
        ("experiment", pa.string()),
        ("version", pa.string()),          # the candidate's deployment version
        ("base_url", pa.string()),         # the candidate server's OpenAI base URL
        ("deployment", pa.string()),       # the model name the candidate server knows
        ("share", pa.float64()),           # share of the route's calls shadowed, 0..1
        ("active", pa.bool_()),
        ("registered_at", _TS),
    ]),
    # One row per shadowed call: the frontier's answer (what the client got) and the
    # candidate's, to the same request. The frontier call is also a capture (raw_trace_id);
    # the candidate's answer never is.
    "shadow_pairs": pa.schema([
        ("pair_id", pa.string()),
        ("raw_trace_id", pa.string()),     # the frontier call's capture in raw_traces
        ("experiment", pa.string()),
        ("version", pa.string()),          # the candidate deployment version
        ("route", pa.string()),
        ("candidate_model", pa.string()),
        ("project", pa.string()),
        ("request", pa.string()),          # the client's request body (JSON)
        ("frontier_message", pa.string()),  # canonical assistant message (JSON); null: none
        ("candidate_message", pa.string()),
        ("frontier_status", pa.int32()),
        ("candidate_status", pa.int32()),  # HTTP status; 0 when no answer came
        ("candidate_error", pa.string()),  # why the candidate gave no usable answer
        ("frontier_latency_ms", pa.float64()),
        ("candidate_latency_ms", pa.float64()),
        ("frontier_prompt_tokens", pa.int64()),
        ("frontier_completion_tokens", pa.int64()),
        ("candidate_prompt_tokens", pa.int64()),
        ("candidate_completion_tokens", pa.int64()),
        ("created_at", _TS),
    ]),
    # The judge's score of each pair's candidate answer against the frontier's (the reference).
    "shadow_scores": pa.schema([
        ("pair_id", pa.string()),
        ("experiment", pa.string()),
        ("version", pa.string()),
        ("rubric_version", pa.string()),
        ("judge", pa.string()),
        ("score", pa.float64()),           # 0..1; 0 for a candidate that gave no answer
        ("passed", pa.bool_()),            # score reached the rubric's pass threshold
        ("assessment", pa.string()),
        ("scored_at", _TS),
        ("phrasing_key", pa.string()),     # the request's phrasing cluster key (the user
                                           # turns' skeleton digest); null: its own cluster
    ]),
    # Overfitting signals for the control plane (the score fell after its peak).
    "early_stops": pa.schema([
        ("run_id", pa.string()),
        ("experiment", pa.string()),
        ("peak_step", pa.int64()),
        ("peak_score", pa.float64()),
        ("last_step", pa.int64()),
        ("last_score", pa.float64()),
        ("reason", pa.string()),
        ("created_at", _TS),
    ]),
}


# Iceberg table properties beyond the defaults, set when a table is created (and added to an
# existing table that lacks them; a value already set is kept).
# The tables ingest writes hold every record's payload and messages, and writing them is on
# ingest's hot path. Measured on a 16.8 MB block of bench/ingest.py input (raw_traces and
# samples files, CPU-s / MB): zstd level 1, pyiceberg's default, 0.078 / 6.3; lz4 0.050 / 10.6;
# snappy 0.049 / 9.8; uncompressed 0.016 / 29.8. Snappy: the cheaper codec that still keeps the
# files smaller than their input, and the one every Parquet reader supports.
# Every gateway flush commits to these, so each commit's metadata file is written whole: old
# ones are deleted, the last 50 kept (readers load the current one).
_INGEST_WRITE = {"write.parquet.compression-codec": "snappy",
                 "write.metadata.delete-after-commit.enabled": "true",
                 "write.metadata.previous-versions-max": "50"}
TABLE_PROPERTIES: dict[str, dict[str, str]] = {
    "raw_traces": _INGEST_WRITE,
    "samples": _INGEST_WRITE,
    "rejected_traces": _INGEST_WRITE,
    "shadow_pairs": {k: v for k, v in _INGEST_WRITE.items() if k.startswith("write.metadata")},
}

# Columns whose values are whole documents, nearly all distinct: data files written by the
# factory's own writer (factory.datafiles) do not try dictionary encoding on them, which
# Parquet would give up on after the first page anyway (-13% write CPU on the block above).
DOCUMENT_COLUMNS = frozenset({"payload", "messages", "tools"})


def schema_of(name: str) -> pa.Schema:
    """The declared schema of table ``name``; ``UnknownTableError`` if none is declared."""
    try:
        return TABLES[name]
    except KeyError:
        known = ", ".join(sorted(TABLES))
        raise UnknownTableError(f"unknown table {name!r}; the lake has: {known}") from None
