"""``factory keys create|list|revoke``: the keys clients send to the gateway (X-Factory-Key).

Once a key exists the gateway refuses calls without one, the factory's own clients' too (``factory
chat``, an LLM judge or synthesis teacher behind the gateway, the comparison page's vibe check,
the demo's traffic): they send the key of ``$FACTORY_GATEWAY_KEY``, which ``create`` says.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from factory.gateway.keys import KeyStore, key_rows
from factory.output import print_rows


def register(sub: Any) -> None:
    p = sub.add_parser("keys", help="manage factory keys for the gateway (X-Factory-Key)")
    actions = p.add_subparsers(dest="action", metavar="ACTION", required=True)
    c = actions.add_parser("create", help="create a key; it is printed once and stored hashed")
    c.add_argument("--name", default="", help="a label to recognize the key by")
    c.add_argument("--format", choices=["text", "json"], default="text")
    c.set_defaults(func=_create)
    ls = actions.add_parser("list", help="list keys (ids and names, never the keys)")
    ls.add_argument("--format", choices=["table", "json"], default="table")
    ls.set_defaults(func=_list)
    r = actions.add_parser("revoke", help="revoke a key by id (running gateways notice in ~1 s)")
    r.add_argument("key_id")
    r.set_defaults(func=_revoke)


def _create(args: argparse.Namespace) -> int:
    info, key = KeyStore().create(args.name)
    if args.format == "json":
        print(json.dumps({"key_id": info.key_id, "name": info.name, "key": key}))
    else:
        print(key)
        print(f"key id {info.key_id}: shown once, only its hash is stored; send it as "
              f"X-Factory-Key")
        print("the gateway now refuses calls without a key, the factory's own included "
              "(factory chat, LLM judges and synthesis teachers behind the gateway, the vibe "
              "check, the demo): where they run, export FACTORY_GATEWAY_KEY=<a key>")
    return 0


def _list(args: argparse.Namespace) -> int:
    print_rows(key_rows(KeyStore().infos()), args.format,
               columns=["key_id", "name", "created_at", "revoked_at"])
    return 0


def _revoke(args: argparse.Namespace) -> int:
    info = KeyStore().revoke(args.key_id)
    print(f"revoked {info.key_id} ({info.name or 'no name'}) at {info.revoked_at}")
    return 0
