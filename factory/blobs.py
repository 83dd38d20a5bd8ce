"""The content-addressed blob store under ``settings.blobs``: images stored once, by sha256.

Images reach the factory base64-encoded inside provider payloads. ``decode_image`` turns such a
payload into bytes and checks they really are an image of the stated type (by magic bytes, not by
trusting the label); ``BlobStore.put`` writes them once at ``blobs/<aa>/<sha256>``.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import re
import tempfile
from pathlib import Path

from factory.settings import Settings, get_settings


class ImageError(ValueError):
    """Bytes that are not a valid image of the stated type; the message names where."""

# Media types a provider may state for an image, and the names they share with a sniffed type.
_ALIASES = {"image/jpg": "image/jpeg", "image/pjpeg": "image/jpeg", "image/x-png": "image/png"}
_B64_CHARS = re.compile(rb"^[A-Za-z0-9+/]*={0,2}$")
_B64URL_CHARS = re.compile(rb"^[A-Za-z0-9_-]*={0,2}$")


def sniff_image(data: bytes) -> str | None:
    """The image media type that ``data``'s magic bytes announce, or None if not an image."""
    if data.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if data.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if data[:6] in (b"GIF87a", b"GIF89a"):
        return "image/gif"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:12] in (b"ftypheic", b"ftypheix", b"ftypmif1", b"ftypheif"):
        return "image/heic"
    return None


def canonical_media_type(media_type: str) -> str:
    base = media_type.split(";", 1)[0].strip().lower()
    return _ALIASES.get(base, base)


def decode_base64(data: str, where: str) -> bytes:
    """Strict base64 (standard or URL-safe alphabet, whitespace ignored); ImageError if not."""
    raw = "".join(data.split()).encode("ascii", "replace")
    if not raw:
        raise ImageError(f"{where}: empty base64 data")
    try:
        if _B64_CHARS.match(raw):
            return base64.b64decode(raw + b"=" * (-len(raw) % 4), validate=True)
        if _B64URL_CHARS.match(raw):
            return base64.urlsafe_b64decode(raw + b"=" * (-len(raw) % 4))
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{where}: invalid base64 ({exc})") from None
    raise ImageError(f"{where}: invalid base64 (characters outside the alphabet)")


def decode_image(data: str, media_type: str | None, where: str) -> tuple[str, bytes]:
    """Decode base64 image data and check it is an image of ``media_type`` (if stated).

    Returns ``(media_type, bytes)``; raises ``ImageError`` naming ``where`` otherwise.
    """
    if not isinstance(data, str):
        raise ImageError(f"{where}: expected base64 text, got {type(data).__name__}")
    raw = decode_base64(data, where)
    sniffed = sniff_image(raw)
    if sniffed is None:
        raise ImageError(f"{where}: the decoded bytes are not a PNG, JPEG, GIF, WebP or "
                             f"HEIC image")
    if media_type:
        stated = canonical_media_type(media_type)
        if not stated.startswith("image/"):
            raise ImageError(f"{where}: media type {media_type!r} is not an image type")
        if stated != sniffed:
            raise ImageError(f"{where}: stated media type {media_type!r} but the bytes are "
                                 f"{sniffed}")
    return sniffed, raw


class BlobStore:
    """Files named by the sha256 of their bytes; writing the same bytes twice stores them once.

    Blobs are never deleted, so a store remembers the digests it has written or seen on disk:
    putting an image it already stored (the same screenshot or logo in many records) costs a
    set lookup, not a hash and a ``stat``. At most ``_REMEMBER`` digests are kept (the
    gateway's store lives as long as the server).
    """

    _REMEMBER = 100_000

    def __init__(self, settings: Settings | None = None) -> None:
        self.root = (settings or get_settings()).blobs
        self._stored: set[str] = set()

    def path(self, sha256: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", sha256):
            raise ValueError(f"not a sha256 hex digest: {sha256!r}")
        return self.root / sha256[:2] / sha256

    def put(self, data: bytes, sha256: str | None = None) -> str:
        """Store ``data`` (atomically, once); returns its sha256.

        ``sha256``, when given, is the caller's digest of ``data``: a digest this store has
        stored already is not checked against the bytes again.
        """
        if sha256 is not None and sha256 in self._stored:
            return sha256
        digest = hashlib.sha256(data).hexdigest()
        assert sha256 is None or sha256 == digest, "blob bytes do not match their name"
        dest = self.path(digest)
        if dest.exists():
            self._remember(digest)
            return digest
        dest.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=".tmp-")
        try:
            with os.fdopen(fd, "wb") as fh:
                fh.write(data)
            os.replace(tmp, dest)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        self._remember(digest)
        return digest

    def _remember(self, digest: str) -> None:
        if len(self._stored) >= self._REMEMBER:
            self._stored.clear()
        self._stored.add(digest)

    def get(self, sha256: str) -> bytes:
        return self.path(sha256).read_bytes()

    def exists(self, sha256: str) -> bool:
        return self.path(sha256).exists()
