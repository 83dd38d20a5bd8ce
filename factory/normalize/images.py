"""Image parts: base64 payloads decoded and checked, remote URLs kept as references."""

from __future__ import annotations

import hashlib
import re
from typing import Any

from factory.blobs import ImageError, canonical_media_type, decode_image
from factory.normalize.canon import NormalizeError

_DATA_URL = re.compile(r"^data:([^;,]*)((?:;[^;,]*)*),", re.IGNORECASE)


def inline_image(data: Any, media_type: str | None, where: str,
                 blobs: dict[str, bytes]) -> dict[str, Any]:
    """A canonical image part from base64 ``data``; the bytes are kept in ``blobs`` by sha256."""
    try:
        sniffed, raw = decode_image(data, media_type, where)
    except ImageError as exc:
        raise NormalizeError(str(exc)) from None
    digest = hashlib.sha256(raw).hexdigest()
    blobs[digest] = raw
    return {"type": "image", "media_type": sniffed, "sha256": digest}


def url_image(url: Any, media_type: Any, where: str, blobs: dict[str, bytes]) -> dict[str, Any]:
    """A canonical image part from a URL: a ``data:`` URL is decoded, any other is referenced."""
    if not isinstance(url, str) or not url:
        raise NormalizeError(f"{where}: expected a URL string")
    match = _DATA_URL.match(url)
    if match:
        stated = match.group(1) or None
        if ";base64" not in match.group(2).lower():
            raise NormalizeError(f"{where}: data URL is not base64-encoded")
        return inline_image(url[match.end():], stated, where, blobs)
    if url.lower().startswith("data:"):
        raise NormalizeError(f"{where}: malformed data URL")
    part: dict[str, Any] = {"type": "image", "url": url}
    if media_type:
        if not isinstance(media_type, str):
            raise NormalizeError(f"{where}: media type must be a string")
        stated = canonical_media_type(media_type)
        if not stated.startswith("image/"):
            raise NormalizeError(f"{where}: media type {media_type!r} is not an image type")
        part["media_type"] = stated
    return part
