"""Configuration of the capture gateway (``factory serve``): upstreams, limits, spool timing."""

from __future__ import annotations

import os
from dataclasses import dataclass

DEFAULT_UPSTREAMS = {
    "openai": "https://api.openai.com",
    "anthropic": "https://api.anthropic.com",
    "gemini": "https://generativelanguage.googleapis.com",
}
PROVIDERS = tuple(DEFAULT_UPSTREAMS)


@dataclass(frozen=True, kw_only=True)
class GatewayConfig:
    """What the gateway listens on, where it forwards, and how it spools captures."""

    host: str = "127.0.0.1"
    """Interface to bind; loopback unless told otherwise."""
    port: int = 8787
    """TCP port (0 picks a free one)."""
    openai_base_url: str = DEFAULT_UPSTREAMS["openai"]
    """OpenAI upstream origin (a trailing ``/v1`` is accepted and folded into the path)."""
    anthropic_base_url: str = DEFAULT_UPSTREAMS["anthropic"]
    """Anthropic upstream origin."""
    gemini_base_url: str = DEFAULT_UPSTREAMS["gemini"]
    """Gemini (Generative Language API) upstream origin."""
    openai_api_key: str | None = None
    """When set, the gateway holds the OpenAI key and injects it, replacing the client's."""
    anthropic_api_key: str | None = None
    """When set, injected as ``x-api-key`` upstream, replacing the client's."""
    gemini_api_key: str | None = None
    """When set, injected as ``x-goog-api-key`` upstream, replacing the client's."""
    max_body_bytes: int = 32 * 1024 * 1024
    """Request bodies larger than this are refused with 413 before being read whole."""
    upstream_timeout_s: float = 600.0
    """Longest wait for the upstream to send the next bytes; past it the client gets a 504."""
    upstream_connect_timeout_s: float = 10.0
    """Longest wait to open a connection to the upstream (then 502)."""
    max_upstream_connections: int = 512
    """Size of the shared upstream connection pool."""
    group_commit_ms: float = 2.0
    """The spool's fsync window: captures written within it share one fsync."""
    segment_max_age_s: float = 0.5
    """A spool segment is sealed (handed to the flusher) after this long..."""
    segment_max_bytes: int = 16 * 1024 * 1024
    """...or this many bytes, whichever comes first."""
    flush_interval_s: float = 0.5
    """How often the flusher looks for sealed segments to commit to the lake."""
    flush_max_records: int = 20_000
    """Most captures committed in one lake batch."""
    flush_retry_max_s: float = 10.0
    """Longest back-off between attempts while the lake is unavailable."""
    snapshot_retention_s: float = 600.0
    """Snapshots of the capture tables older than this are expired (``Lake.expire_snapshots``:
    the last 100, and every snapshot a kept lineage reads, stay): every flush is a commit, and
    each snapshot kept makes every later commit rewrite more metadata."""
    snapshot_expiry_every_s: float = 300.0
    """How often the flusher expires them (0: never)."""
    routes_poll_s: float = 2.0
    """How often the routing table is re-read from the lake (skipped when unchanged)."""
    flush: bool = True
    """Run the background flusher (off: only spool; another process drains)."""
    shadow_queue_size: int = 256
    """Shadow calls waiting for their candidate at most; past it they are dropped (counted)."""
    shadow_concurrency: int = 4
    """Candidate calls in flight at once (background tasks on the event loop)."""
    shadow_timeout_s: float = 60.0
    """Longest wait for a candidate's next bytes; past it the pair is stored as failed."""
    shadow_flush_s: float = 5.0
    """Shadow pairs are sealed and committed to ``shadow_pairs`` at most this often (one
    commit costs about the same for ten pairs as for a thousand)."""

    def __post_init__(self) -> None:
        if self.max_body_bytes <= 0:
            raise ValueError(f"max_body_bytes must be positive, got {self.max_body_bytes}")
        if self.upstream_timeout_s <= 0:
            raise ValueError(f"upstream_timeout_s must be positive, got {self.upstream_timeout_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be 0-65535, got {self.port}")
        for provider in PROVIDERS:
            url = self.base_url(provider)
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"{provider} base URL must start with http:// or https://, "
                                 f"got {url!r}")

    def base_url(self, provider: str) -> str:
        url: str = getattr(self, f"{provider}_base_url")
        return url

    def api_key(self, provider: str) -> str | None:
        key: str | None = getattr(self, f"{provider}_api_key")
        return key

    @classmethod
    def from_env(cls, **overrides: object) -> GatewayConfig:
        """Defaults overridden by ``FACTORY_<PROVIDER>_BASE_URL`` / ``_API_KEY``,
        ``FACTORY_MAX_BODY_BYTES`` and ``FACTORY_FLUSH_INTERVAL_S``, then by
        ``overrides`` (None values are ignored, so CLI flags left unset fall through)."""
        values: dict[str, object] = {}
        for provider in PROVIDERS:
            for suffix in ("base_url", "api_key"):
                env = os.environ.get(f"FACTORY_{provider.upper()}_{suffix.upper()}")
                if env:
                    values[f"{provider}_{suffix}"] = env
        for name, field, kind, what in (
                ("FACTORY_MAX_BODY_BYTES", "max_body_bytes", int, "an integer"),
                ("FACTORY_FLUSH_INTERVAL_S", "flush_interval_s", float, "a number")):
            env = os.environ.get(name)
            if env:
                try:
                    values[field] = kind(env)
                except ValueError:
                    raise ValueError(f"{name} must be {what}, got {env!r}") from None
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)  # type: ignore[arg-type]
