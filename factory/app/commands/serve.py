"""``factory serve``: the capture gateway (provider proxy routes, OTLP receiver, metrics)."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from factory.gateway.config import GatewayConfig
from factory.gateway.server import serve


def register(sub: Any) -> None:
    p = sub.add_parser(
        "serve", help="run the capture gateway: OpenAI/Anthropic/Gemini proxy + OTLP receiver",
        description="Point an SDK's base URL here: calls are passed through to the upstream and "
                    "every call is captured into the lake. Binds 127.0.0.1 unless --host says "
                    "otherwise; while no factory key exists only local clients are served.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8787, help="port (default 8787; 0 = any free)")
    for provider in ("openai", "anthropic", "gemini"):
        p.add_argument(f"--{provider}-base-url", default=None, metavar="URL",
                       help=f"{provider} upstream (env FACTORY_{provider.upper()}_BASE_URL)")
    p.add_argument("--max-body-bytes", type=int, default=None,
                   help="refuse larger request bodies with 413 (default 32 MiB; env "
                        "FACTORY_MAX_BODY_BYTES)")
    p.add_argument("--upstream-timeout", type=float, default=None, metavar="SECONDS",
                   help="504 when the upstream sends nothing for this long (default 600)")
    p.add_argument("--flush-interval", type=float, default=None, metavar="SECONDS",
                   help="how often captures are committed to the lake while traffic is light "
                        "(default 0.5; env FACTORY_FLUSH_INTERVAL_S): each commit costs the "
                        "same CPU however few captures it holds")
    p.add_argument("--no-flush", action="store_true",
                   help="only spool captures; another gateway process drains the spool")
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    config = GatewayConfig.from_env(
        host=args.host, port=args.port, openai_base_url=args.openai_base_url,
        anthropic_base_url=args.anthropic_base_url, gemini_base_url=args.gemini_base_url,
        max_body_bytes=args.max_body_bytes, upstream_timeout_s=args.upstream_timeout,
        flush_interval_s=args.flush_interval, flush=False if args.no_flush else None)

    def ready(port: int) -> None:
        held = [p for p in ("openai", "anthropic", "gemini") if config.api_key(p)]
        print(f"factory gateway on http://{config.host}:{port}  "
              f"(openai -> {config.openai_base_url}, anthropic -> {config.anthropic_base_url}, "
              f"gemini -> {config.gemini_base_url}"
              + (f"; holds upstream keys for {', '.join(held)}" if held else "") + ")",
              flush=True)

    serve(config, on_ready=ready)
    return 0
