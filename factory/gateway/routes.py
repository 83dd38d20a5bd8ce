"""The routing table: a model name maps to an upstream (the deployment issue registers the
factory's own endpoints, e.g. ``factory/<experiment>``, so their traffic is captured too).

Routes live in the lake table ``routes``, append-only: the latest row per model wins and a row
with ``active = false`` removes the route, so the history of what served a name is kept.
The gateway re-reads the table in the background when its snapshot changes; a request for a
model with no route goes to the provider's configured upstream.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from factory.gateway.config import PROVIDERS
from factory.lake import Lake

if TYPE_CHECKING:
    from factory.lake import Lake, Lineage

log = logging.getLogger("factory.gateway")


@dataclass(frozen=True, kw_only=True)
class Route:
    """Where calls for one model name go."""

    model: str
    """The model name clients send (e.g. ``factory/support-bot``)."""
    provider: str
    """The API the upstream speaks: ``openai``, ``anthropic`` or ``gemini``."""
    base_url: str
    """Upstream origin (an OpenAI-compatible server's ``/v1`` suffix is accepted)."""
    deployment: str | None = None
    """Model name the upstream knows it by (the request's ``model`` is rewritten); None keeps it."""
    version: str | None = None
    """Free version tag recorded on every capture through this route (``route_version`` tag)."""
    structured_outputs: dict[str, Any] | None = None
    """The decoding constraint (``{"choice": [...]}`` or ``{"json": schema}``) added to an
    OpenAI request through this route that sends none: a deployment serves its closed-answer
    task constrained as its run was evaluated (``eval.constrain``). None: nothing added."""

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("a route needs a model name")
        if self.provider not in PROVIDERS:
            raise ValueError(f"route provider must be one of {', '.join(PROVIDERS)}, "
                             f"got {self.provider!r}")
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"route base_url must start with http:// or https://, "
                             f"got {self.base_url!r}")


def register_route(route: Route, *, lake: Lake | None = None,
                   lineage: Lineage | None = None) -> None:
    """Add or replace the route for ``route.model`` (running gateways pick it up within
    ``routes_poll_s``)."""
    (lake or Lake()).append("routes", [_row(route, active=True)], lineage=lineage)


def unregister_route(model: str, *, lake: Lake | None = None,
                     lineage: Lineage | None = None) -> None:
    """Remove the route for ``model``; its calls go back to the provider's default upstream."""
    lake = lake or Lake()
    current = load_routes(lake)
    if model not in current:
        raise ValueError(f"no route for model {model!r}")
    lake.append("routes", [_row(current[model], active=False)], lineage=lineage)


def load_routes(lake: Lake) -> dict[str, Route]:
    """The current routes: the latest row per model, without removed ones."""
    if not lake.exists("routes"):
        return {}
    rows = lake.read("routes").to_pylist()
    rows.sort(key=lambda r: r["registered_at"])
    routes: dict[str, Route] = {}
    for row in rows:
        if row["active"]:
            constraint = row.get("structured_outputs")
            routes[row["model"]] = Route(model=row["model"], provider=row["provider"],
                                         base_url=row["base_url"], deployment=row["deployment"],
                                         version=row["version"],
                                         structured_outputs=json.loads(constraint)
                                         if constraint else None)
        else:
            routes.pop(row["model"], None)
    return routes


def _row(route: Route, *, active: bool) -> dict[str, object]:
    return {"model": route.model, "provider": route.provider, "base_url": route.base_url,
            "deployment": route.deployment, "version": route.version, "active": active,
            "registered_at": datetime.now(UTC),
            "structured_outputs": json.dumps(route.structured_outputs, sort_keys=True)
            if route.structured_outputs else None}


class RoutingTable:
    """The gateway's in-memory view: static routes (config) over the lake's ``routes`` table."""

    def __init__(self, static: dict[str, Route] | None = None) -> None:
        self._static = dict(static or {})
        self._routes: dict[str, Route] = dict(self._static)
        self._snapshot: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def get(self, model: str) -> Route | None:
        return self._routes.get(model)

    def all(self) -> dict[str, Route]:
        return dict(self._routes)

    def refresh(self, lake: Lake) -> bool:
        """Re-read the lake table if its snapshot changed; True when the table was re-read."""
        snap = lake.snapshot_id("routes") if lake.exists("routes") else None
        if snap == self._snapshot:
            return False
        merged = {**load_routes(lake), **self._static}
        self._routes = merged  # one reference swap: readers never see a half-built dict
        self._snapshot = snap
        return True

    def start(self, lake_factory: object, interval_s: float, *,
              also: tuple[Callable[[Lake], object], ...] = ()) -> None:
        """Poll the lake every ``interval_s`` in a thread; ``also``: other tables' refreshers
        (the shadow rules) read on the same poll."""
        def loop() -> None:
            lake = None
            while not self._stop.is_set():
                try:
                    lake = lake or lake_factory()  # type: ignore[operator]
                    if lake is None:
                        return  # no lake (tests of the proxy alone): static routes only
                    self.refresh(lake)
                    for refresh in also:
                        refresh(lake)
                except Exception as exc:  # a locked or missing catalog: keep the last table
                    log.warning("routing table not refreshed: %s", _one_line(exc))
                self._stop.wait(interval_s)

        self._thread = threading.Thread(target=loop, name="gateway-routes", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"
