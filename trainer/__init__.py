"""The provider-agnostic LoRA trainer: takes a job, trains, checkpoints, reports. No orchestration.

Never imports Dagster, pyiceberg or the rest of the factory (import-linter enforces it); importing
this package is free of side effects. Installed it is ``factory.trainer``; its modules import each
other relatively, so a plain copy of trainer/ (with kernels/ beside it for the opt-in kernels) runs
as ``trainer``, as in its image. Run it as ``python -m factory.trainer --job JOB.json`` (``python
-m trainer`` in the image; ``--check`` only validates). Interfaces others build on:

Job file (``trainer.config.TrainerJob.from_json``; unknown keys and bad values raise ValueError
naming the field, e.g. ``plan.learning_rate: must be > 0``, before anything is loaded)::

    {"run_id": "exp-1-run-3",                      # stable across resumes/rollovers
     "plan": {                                     # trainer.config.TrainConfig
       "base_model": "/models/smollm2-135m-instruct", "max_seq_len": 2048, "packing": true,
       "micro_batch_size": 1, "grad_accum_steps": 8, "learning_rate": 2e-4,
       "lr_schedule": "cosine", "warmup_steps": 10, "num_steps": 300,   # or "num_epochs": 2
       "weight_decay": 0.0, "max_grad_norm": 1.0,
       "lora_rank": 16, "lora_alpha": 32, "lora_dropout": 0.05,
       "lora_target_modules": ["all-linear"], "frozen_modules": [],
       "precision": "bf16",                        # fp32 | bf16-autocast | bf16
       "gradient_checkpointing": false, "checkpoint_every_steps": 50,
       "eval_every_steps": null, "log_every_steps": 1, "seed": 0, "deterministic": false,
       "use_kernels": false, "num_devices": 1, "parallelism": "single"},   # or fsdp2
     "data_files": ["/lake/.../part-0.parquet"],   # or "payload_file": "samples.jsonl"
     "eval_data_files": [],                        # held-out loss every eval_every_steps
     "output_dir": "/ckpt/exp-1-run-3",            # or any fsspec URL (s3://...)
     "resume_from": null,                          # a checkpoint dir, or "latest"
     "events_file": null,                          # default output_dir/events.jsonl
     "webhook_url": "http://gateway/v1/trainer/events", "webhook_key_id": "k1",
     "webhook_secret_env": "FACTORY_WEBHOOK_SECRET",   # the secret is never in the file
     "tracker": {"backend": "jsonl"},              # jsonl | mlflow | neptune | none
     "debug": {"nan_at_step": null, "sleep_per_step_s": 0}}

Exit codes (``trainer.train.ExitCode``): 0 finished; 1 failed (a crash: retried); 2 invalid job
and 65 data or configuration error (never retried: running again cannot heal them); 3
non-finite loss or gradient (no checkpoint of the bad step; resume from the last good one); 75
preempted (SIGTERM/SIGINT: the last completed step was checkpointed; resume from it).

Checkpoints (``trainer.checkpoint``): ``output_dir/checkpoints/step-XXXXXXXX/`` with the PEFT
adapter (``adapter_model.safetensors`` + ``adapter_config.json``), tokenizer with our chat
template, ``optimizer.safetensors/.json``, ``rng.safetensors/.json``, ``trainer_state.json``
(step, data position, loss history, schedule) and ``manifest.json`` (sha256 of each file, written
last). The directory loads as is with ``PeftModel.from_pretrained(base, dir)`` or vLLM's LoRA
loader. ``verify_checkpoint(path) -> CheckpointInfo(path, step, manifest_sha256)`` raises
``CheckpointError`` (a ValueError) unless manifest, hashes and finite weights all check out;
``latest_checkpoint(output_dir)`` is the newest one that verifies.

Events (``trainer.webhooks``): JSON objects with ``event_id, run_id, type, segment, seq, time``
and per-type fields; types ``started, progress, checkpoint, finished, failed, nan, preempted``;
appended to the events file and POSTed with headers ``X-Factory-Key-Id``,
``X-Factory-Timestamp``, ``X-Factory-Signature: v1=<hex hmac-sha256(secret, ts + "." + body)>``.
Receivers call ``verify(headers, body, secrets_by_key_id, *, now=None, max_age_s=300,
replay_cache=ReplayCache())`` which returns the event or raises ``WebhookError``.

Rendering (``trainer.chat``): ``render(messages, tools, tokenizer=None, *,
add_generation_prompt=False) -> str`` turns canonical samples into model text in the chat format
of the base tokenizer (``chat_format``: ChatML or Gemma's turns) (the one rendering: curation
counts tokens with ``spans``, the server renders requests with it); ``encode`` adds the
assistant-only label mask; ``parse_assistant(text)`` turns generated text back into a canonical
assistant message; ``chat_template(fmt)`` is the identical Jinja template shipped with every
checkpoint, so serving with ``apply_chat_template`` matches training.
"""
