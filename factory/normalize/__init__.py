"""Normalization: every provider format into canonical samples (``canonical-sample.md``).

``normalize_record(payload, format)`` is pure: it returns the canonical conversations of one
record or raises ``NormalizeError`` naming the field and what was wrong. ``detect_format`` picks
the format of a record when none is forced. The modules run compiled when built
(``factory.native``).
"""

from __future__ import annotations

from factory.native import install_guard

install_guard()  # before any compiled module loads: a stale build must not run

from factory.normalize.canon import NormalizeError, canonical_json, sample_id  # noqa: E402
from factory.normalize.detect import FORMATS, detect_format, normalize_record  # noqa: E402

__all__ = ["FORMATS", "NormalizeError", "canonical_json", "detect_format", "normalize_record",
           "sample_id"]
