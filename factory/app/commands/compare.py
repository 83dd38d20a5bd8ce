"""``factory compare``: the web page comparing each experiment's candidate deployment with the
frontier model on shadowed live traffic, with the vibe check and the promote action."""

from __future__ import annotations

import argparse
from typing import Any

from factory.settings import get_settings


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare", help="serve the shadow comparison page: candidate vs frontier model, promote",
        description="Agreement and judge score over time, latency and estimated cost, the "
                    "worst-scored pairs, a vibe check and a promote action, per experiment "
                    "with shadow pairs. Binds 127.0.0.1 unless --host says otherwise: anyone "
                    "who reaches the page can promote.")
    p.add_argument("--host", default="127.0.0.1", help="interface to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8799, help="port (default 8799)")
    p.add_argument("--gateway", default=None, metavar="URL",
                   help="gateway the vibe check asks the frontier model through (default "
                        "$FACTORY_GATEWAY_URL or http://127.0.0.1:8787)")
    p.set_defaults(func=_compare)


def _compare(args: argparse.Namespace) -> int:
    import uvicorn

    # the page loads Jinja2, Starlette, httpx, factory.evals (0.6 s): other commands start without
    from factory.app.compare import Compare

    settings = get_settings().ensure()
    app = Compare(gateway_url=args.gateway)
    print(f"comparison page on http://{args.host}:{args.port} (state in {settings.home}; "
          f"vibe check through {app.gateway_url})", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning",
                access_log=False)
    return 0
