"""``python -m factory.inference MODEL [options]``: the factory's CPU server (flags like vLLM's)."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m factory.inference",
                                     description="OpenAI-compatible CPU inference server.")
    parser.add_argument("model", help="base model directory (Hugging Face format)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="largest batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chat-template", default="trainer",
                        help="'trainer' (default), 'tokenizer', or a Jinja file for the base")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    args = parser.parse_args(argv)

    import torch
    import uvicorn

    from factory.inference.engine import Engine, EngineError
    from factory.inference.server import create_app
    from factory.trainer.cores import CoreShare

    if args.threads:
        torch.set_num_threads(args.threads)
    # The cores are split with the factory's other torch processes on this machine (a trainer
    # beside an eval server), adjusted before every batch and left when the app shuts down:
    # factory/trainer/cores.py.
    cores = CoreShare.for_this_process(pinned=args.threads)
    template = args.chat_template
    if template not in ("trainer", "tokenizer"):
        with open(template) as f:
            template = f.read()
    engine = Engine(args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                    max_model_len=args.max_model_len, base_chat_template=template)
    for spec in args.lora_modules:
        name, sep, path = spec.partition("=")
        if not sep:
            print(f"--lora-modules: expected NAME=PATH, got {spec!r}", file=sys.stderr)
            return 2
        try:
            engine.load_adapter(name, path)
        except EngineError as e:
            print(f"--lora-modules: {e}", file=sys.stderr)
            return 2
    app = create_app(engine, max_batch_size=args.max_num_seqs, cores=cores)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(main())
