"""The comparison page behind ``factory compare``: a candidate deployment against the frontier
model on the live traffic shadow mode paired them on (``shadow_pairs``, ``shadow_scores``).

Per experiment it shows agreement and mean judge score over time (inline SVG), latency p50/p95
and an estimated cost per 1,000 requests for both sides, the worst-scored pairs side by side,
a vibe check (one prompt sent to both models at once; the frontier through the gateway with the
factory key of the settings, ``$FACTORY_GATEWAY_KEY``) and a promote action that moves
``factory/<experiment>`` to the candidate after a confirmation.

This module is the web server: its routes read the lake and call the renderers of
:mod:`factory.app.compare_pages` (Jinja2 templates). The figures are
:mod:`factory.app.comparison`'s, the chart :mod:`factory.app.charts`', the cost model and its
editable price table (``$FACTORY_HOME/compare-prices.json``) :mod:`factory.app.costs`' and the
vibe check :mod:`factory.app.vibe`'s.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import HTMLResponse, RedirectResponse, Response
from starlette.routing import Route

from factory.app import compare_pages as pages
from factory.app.charts import buckets
from factory.app.comparison import compare, experiments, known, pair_versions, percentile
from factory.app.costs import Prices, load_prices, parse_prices, prices_path, save_prices
from factory.app.vibe import ask_both, vibe_targets
from factory.deploy import DeployConfig, Deployer, Deployment, DeploymentError
from factory.deploy.kubernetes import host_from_env
from factory.evals.shadow import summarize
from factory.lake import Lake

__all__ = ["Compare", "Prices", "buckets", "percentile"]


class Compare:
    """The Starlette app and what its pages read: the lake, the gateway's URL (default: the
    lake's settings', ``$FACTORY_GATEWAY_URL``), the deployer's config (``drain_s`` of a
    promotion)."""

    def __init__(self, lake: Lake | None = None, *, gateway_url: str | None = None,
                 deploy_config: DeployConfig | None = None) -> None:
        self.lake = lake or Lake()
        self.gateway_url = gateway_url or self.lake.settings.gateway_url
        self.deploy_config = deploy_config
        self.app = Starlette(routes=[
            Route("/", self.index),
            Route("/e/{experiment}", self.experiment),
            Route("/e/{experiment}/vibe", self.vibe, methods=["GET", "POST"]),
            Route("/e/{experiment}/promote", self.promote, methods=["GET", "POST"]),
            Route("/prices", self.prices, methods=["GET", "POST"]),
        ])

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await self.app(scope, receive, send)

    def _known(self, experiment: str) -> bool:
        return known(self.lake, experiment)

    def index(self, request: Request) -> Response:
        return HTMLResponse(pages.index_page(experiments(self.lake)))

    def experiment(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not self._known(e):
            return HTMLResponse(pages.not_found_page(e), 404)
        asked = request.query_params.get("version")
        versions = pair_versions(self.lake, e)
        if asked == "all":
            version = None
        elif asked:
            if asked not in dict(versions):
                return HTMLResponse(pages.not_found_page(e, asked), 404)
            version = asked
        else:
            version = versions[0][0] if versions else None
        try:
            prices, notice = load_prices(prices_path(self.lake)), ""
        except ValueError as exc:
            prices, notice = Prices(), f"{exc}. Costs use the default prices."
        comparison = compare(self.lake, e, version, prices)
        deployer = Deployer(self.lake)
        return HTMLResponse(pages.experiment_page(comparison, deployer.candidate(e),
                                                  deployer.live(e), notice=notice))

    async def vibe(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not await run_in_threadpool(self._known, e):
            return HTMLResponse(pages.not_found_page(e), 404)
        if request.method == "GET":
            return HTMLResponse(pages.vibe_page(e))
        prompt = (await _form(request)).get("prompt", "").strip()
        if not prompt:
            return HTMLResponse(pages.vibe_page(e, error="Write a prompt first."), 400)
        frontier, candidate = await run_in_threadpool(vibe_targets, self.lake, e,
                                                      self.gateway_url)
        f_reply, c_reply = await ask_both(frontier, candidate, prompt)
        return HTMLResponse(pages.vibe_page(e, prompt=prompt, asked=((frontier, f_reply),
                                                                     (candidate, c_reply))))

    async def promote(self, request: Request) -> Response:
        e = request.path_params["experiment"]
        if not await run_in_threadpool(self._known, e):
            return HTMLResponse(pages.not_found_page(e), 404)
        if request.method == "GET":
            return await run_in_threadpool(self._confirm, e, request.query_params.get("version"))
        if not _same_origin(request):
            return HTMLResponse(pages.refused_page(), 403)
        version = (await _form(request)).get("version") or None
        try:
            dep = await run_in_threadpool(self._promote, e, version)
        except (DeploymentError, ValueError) as exc:
            return HTMLResponse(pages.promoted_page(e, None, str(exc)), 409)
        return HTMLResponse(pages.promoted_page(e, dep))

    def _promote(self, experiment: str, version: str | None) -> Deployment:
        return Deployer(self.lake, self.deploy_config, host=host_from_env()).promote(
            experiment, version)

    def _confirm(self, e: str, version: str | None) -> Response:
        candidate = Deployer(self.lake).candidate(e)
        version = version or (candidate.version if candidate else None)
        if version is None:
            return HTMLResponse(pages.confirm_page(e, None, None), 409)
        return HTMLResponse(pages.confirm_page(e, version, summarize(self.lake, e, version)))

    async def prices(self, request: Request) -> Response:
        path = prices_path(self.lake)
        error = ""
        if request.method == "POST":
            try:
                prices = parse_prices(await _form(request))
            except ValueError as exc:
                error = str(exc)
            else:
                await run_in_threadpool(save_prices, path, prices)
                return RedirectResponse("/prices?saved=1", status_code=303)
        try:
            current = load_prices(path)
        except ValueError as exc:
            current, error = Prices(), error or str(exc)
        saved = request.query_params.get("saved") == "1" and not error
        return HTMLResponse(pages.prices_page(current, saved=saved, error=error),
                            400 if error and request.method == "POST" else 200)


async def _form(request: Request) -> dict[str, str]:
    """An url-encoded form body (the last value of a repeated field)."""
    body = (await request.body()).decode("utf-8", errors="replace")
    return {k: v[-1] for k, v in parse_qs(body, keep_blank_values=True).items()}


def _same_origin(request: Request) -> bool:
    """A browser's POST names its page's origin; one from another site must not promote."""
    origin = request.headers.get("origin")
    if not origin or origin == "null":
        return origin is None
    return urlsplit(origin).netloc == request.headers.get("host")
