"""``python -m factory.inference MODEL [options]``: the factory's CPU server (flags like vLLM's).

The port is bound first, before torch is imported and the model loaded (seconds to minutes), and
with ``--port-fd`` reported at once: a launcher asking for port 0 learns the port without probing
one that another process could bind in the meantime, and a port already taken fails the start
in a fraction of a second.
"""

from __future__ import annotations

import argparse
import os
import socket
import sys

from factory.inference.resolver import RESOLVER_DIR_ENV
from factory.trainer.cores import CoreShare


def _bind(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a free port the kernel picks), not listening yet:
    the port is this server's from now on, and a client connecting while the model loads is
    refused at once rather than left in a backlog nobody accepts from (uvicorn listens)."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        # A restarted deployment binds its port again while its old connections sit in
        # TIME_WAIT, as uvicorn's own bind allows.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m factory.inference",
                                     description="OpenAI-compatible CPU inference server.")
    parser.add_argument("model", help="base model directory (Hugging Face format)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free one)")
    parser.add_argument("--port-fd", type=int, default=None, metavar="FD",
                        help="write the bound port and a newline to this inherited file "
                             "descriptor (a pipe from the launcher), then close it")
    parser.add_argument("--served-model-name", default=None)
    parser.add_argument("--lora-modules", nargs="*", default=[], metavar="NAME=PATH")
    parser.add_argument("--lora-resolver-dir", default=os.environ.get(RESOLVER_DIR_ENV) or None,
                        metavar="DIR",
                        help="a request naming an adapter the server has not loaded loads "
                             "DIR/<name>, as vLLM's filesystem LoRA resolver does (default "
                             f"${RESOLVER_DIR_ENV})")
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--max-num-seqs", type=int, default=8, help="largest batch")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--chat-template", default="trainer",
                        help="'trainer' (default), 'tokenizer', or a Jinja file for the base")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                        default=True, help="reuse the KV of prompt prefixes already computed "
                                           "(vLLM's flag; on by default, as in vLLM)")
    parser.add_argument("--prefix-cache-mib", type=int, default=128,
                        help="memory the prefix cache may hold")
    parser.add_argument("--prompt-lookup-tokens", type=int, default=None, metavar="N",
                        help="draft tokens a greedy request served alone checks a forward pass "
                             "(prompt lookup; 0: one token a pass; default 3)")
    parser.add_argument("--recent-lookup-tokens", type=int, default=None, metavar="N",
                        help="draft tokens a greedy request served alone takes from the "
                             "model's recent completions first (0: the prompt's only; "
                             "default 8)")
    parser.add_argument("--merge-adapters", action=argparse.BooleanOptionalAction, default=True,
                        help="add the served adapter's weights into the base's while its "
                             "requests follow each other (float32; on by default)")
    parser.add_argument("--bf16-linears", default="off", choices=["auto", "on", "off"],
                        help="generate with the linear layers' weights packed in bf16 (float32 "
                             "only; auto: where the CPU computes bf16 natively; off by default: "
                             "bench/serving.py measured p50 0.78-0.87x, throughput at 4 "
                             "clients 0.90-1.19x in two runs, +0.35-0.44 GiB)")
    args = parser.parse_args(argv)

    try:
        sock = _bind(args.host, args.port)
    except OSError as e:
        print(f"cannot bind {args.host}:{args.port}: {e}", file=sys.stderr)
        return 1
    if args.port_fd is not None:
        with os.fdopen(args.port_fd, "w") as report:
            report.write(f"{sock.getsockname()[1]}\n")

    # torch and the server (~2 s) load after the port is reported: the caller waits on the port
    import torch

    from factory.inference.engine import (
        PROMPT_LOOKUP_TOKENS,
        RECENT_LOOKUP_TOKENS,
        Engine,
        EngineError,
        bf16_linears_available,
    )
    from factory.inference.server import create_app, serve

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
    try:
        engine = Engine(args.model, served_model_name=args.served_model_name, dtype=args.dtype,
                        max_model_len=args.max_model_len, base_chat_template=template,
                        prefix_cache_entries=8 if args.enable_prefix_caching else 0,
                        prefix_cache_bytes=args.prefix_cache_mib * 2**20,
                        prompt_lookup_tokens=(PROMPT_LOOKUP_TOKENS
                                              if args.prompt_lookup_tokens is None
                                              else args.prompt_lookup_tokens),
                        recent_lookup_tokens=(RECENT_LOOKUP_TOKENS
                                              if args.recent_lookup_tokens is None
                                              else args.recent_lookup_tokens),
                        merge_adapters=args.merge_adapters,
                        bf16_linears=args.bf16_linears == "on" or (
                            args.bf16_linears == "auto" and args.dtype == "float32"
                            and bf16_linears_available()[0]))
    except ValueError as e:  # an option the engine refuses (--bf16-linears on where not native)
        print(f"cannot serve {args.model}: {e}", file=sys.stderr)
        return 2
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
    app = create_app(engine, max_batch_size=args.max_num_seqs, cores=cores,
                     resolver_dir=args.lora_resolver_dir)
    serve(app, sock)
    return 0


if __name__ == "__main__":
    sys.exit(main())
