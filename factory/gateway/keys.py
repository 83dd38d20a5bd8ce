"""Factory keys: what clients send in ``X-Factory-Key`` to use the gateway.

A key is shown once, at creation; only its SHA-256 is stored, in ``$FACTORY_HOME/gateway/
keys.json`` (mode 0600). Keys are 256 random bits, so a plain hash is safe against guessing and
cheap enough to check on every request. The gateway re-reads the file when it changes, so
``factory keys create|revoke`` take effect without a restart.

The factory's own clients of the gateway send the key of its settings (``$FACTORY_GATEWAY_KEY``,
``client_headers``), so they keep working once keys exist.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from factory.errors import FactoryError
from factory.settings import Settings, get_settings

KEY_PREFIX = "fk-"
KEY_HEADER = "X-Factory-Key"


def hash_key(key: str | bytes) -> str:
    raw = key.encode() if isinstance(key, str) else key
    return hashlib.sha256(raw).hexdigest()


def client_headers(settings: Settings | None = None) -> dict[str, str]:
    """The headers a client of the factory's gateway sends: its factory key from the settings
    (``$FACTORY_GATEWAY_KEY``), none without one. Sent to the gateway only, never to another
    endpoint: a factory key is for the factory's gateway alone."""
    key = (settings or get_settings()).gateway_key
    return {KEY_HEADER: key} if key else {}


def gateway_api_url(settings: Settings | None = None) -> str:
    """The gateway's OpenAI base URL (``settings.gateway_url`` + ``/v1``)."""
    return (settings or get_settings()).gateway_url.rstrip("/") + "/v1"


def headers_for(base_url: str, settings: Settings | None = None) -> dict[str, str]:
    """``client_headers`` when ``base_url`` is the factory's gateway (``gateway_api_url``),
    nothing for any other endpoint: the one rule every internal client (judge, synthesis
    teacher) applies before it sends the factory key."""
    settings = settings or get_settings()
    return client_headers(settings) if base_url.rstrip("/") == gateway_api_url(settings) else {}


def keys_path(settings: Settings | None = None) -> Path:
    return (settings or get_settings()).home / "gateway" / "keys.json"


@dataclass(frozen=True, kw_only=True)
class KeyInfo:
    """One stored key (never the key itself)."""

    key_id: str
    """Short public id: the first 12 hex digits of the hash."""
    name: str
    """Label given at creation."""
    sha256: str
    """Hex SHA-256 of the key."""
    created_at: str
    """ISO time of creation (UTC)."""
    revoked_at: str | None = None
    """ISO time of revocation, None while the key is valid."""


class KeyStore:
    """The key file, with a cached set of valid hashes refreshed when the file changes."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path or keys_path()
        self._lock = threading.Lock()
        self._valid: frozenset[str] = frozenset()
        self._stamp: tuple[int, int] | None = None
        self._checked_at = 0.0

    # -- management (CLI) ----------------------------------------------------------------------
    def infos(self) -> list[KeyInfo]:
        if not self.path.exists():
            return []
        try:
            rows = orjson.loads(self.path.read_bytes())
        except orjson.JSONDecodeError as exc:
            raise FactoryError(f"key file {self.path} is not valid JSON: {exc}") from None
        return [KeyInfo(**row) for row in rows]

    def create(self, name: str = "") -> tuple[KeyInfo, str]:
        """A new key: returns its info and the key, which is never shown again."""
        key = KEY_PREFIX + secrets.token_urlsafe(32)
        digest = hash_key(key)
        info = KeyInfo(key_id=digest[:12], name=name, sha256=digest,
                       created_at=datetime.now(UTC).isoformat(timespec="seconds"))
        self._write([*self.infos(), info])
        return info, key

    def revoke(self, key_id: str) -> KeyInfo:
        infos = self.infos()
        match = [i for i in infos if i.key_id == key_id]
        if not match:
            known = ", ".join(i.key_id for i in infos) or "none"
            raise FactoryError(f"no key with id {key_id!r} (known: {known})")
        now = datetime.now(UTC).isoformat(timespec="seconds")
        updated = [KeyInfo(**{**i.__dict__, "revoked_at": i.revoked_at or now})
                   if i.key_id == key_id else i for i in infos]
        self._write(updated)
        return next(i for i in updated if i.key_id == key_id)

    def _write(self, infos: list[KeyInfo]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        data = orjson.dumps([i.__dict__ for i in infos], option=orjson.OPT_INDENT_2)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.path)

    # -- checking (gateway hot path) -------------------------------------------------------------
    def valid_hashes(self, *, max_age_s: float = 1.0) -> frozenset[str]:
        """Hashes of unrevoked keys; the file is stat'ed at most once per ``max_age_s``."""
        now = time.monotonic()
        if now - self._checked_at < max_age_s:
            return self._valid
        with self._lock:
            self._checked_at = now
            try:
                st = self.path.stat()
                stamp: tuple[int, int] | None = (st.st_mtime_ns, st.st_size)
            except FileNotFoundError:
                stamp = None
            if stamp != self._stamp:
                self._stamp = stamp
                self._valid = frozenset(
                    i.sha256 for i in (self.infos() if stamp else []) if i.revoked_at is None)
        return self._valid

    def check(self, presented: bytes | None) -> bool | None:
        """None when no key exists (open to loopback only), else whether ``presented`` is valid."""
        valid = self.valid_hashes()
        if not valid:
            return None
        return presented is not None and hash_key(presented) in valid


def key_rows(infos: list[KeyInfo]) -> list[dict[str, Any]]:
    return [{"key_id": i.key_id, "name": i.name, "created_at": i.created_at,
             "revoked_at": i.revoked_at or ""} for i in infos]
