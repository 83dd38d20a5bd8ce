"""The content-addressed blob store: each image once, and no re-hashing of what it stored."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from factory.blobs import BlobStore


def test_put_stores_bytes_under_their_sha256_once(factory_home: Path) -> None:
    store = BlobStore()
    data = b"\x89PNG fake image bytes"
    digest = hashlib.sha256(data).hexdigest()
    assert store.put(data) == digest
    assert store.put(data, digest) == digest
    assert store.get(digest) == data
    assert [p.name for p in store.root.rglob("*") if p.is_file()] == [digest]


def test_a_store_remembers_what_it_stored_and_a_new_one_checks_the_disk(
        factory_home: Path) -> None:
    store = BlobStore()
    data = b"logo bytes"
    digest = store.put(data)
    store.path(digest).unlink()  # behind the store's back: it trusts what it wrote
    assert store.put(data, digest) == digest
    assert not store.path(digest).exists()
    fresh = BlobStore()  # another process's store looks at the disk and writes it again
    assert fresh.put(data, digest) == digest
    assert fresh.get(digest) == data


def test_an_existing_blob_is_not_written_again(factory_home: Path) -> None:
    data = b"seen before"
    digest = BlobStore().put(data)
    mtime = BlobStore().path(digest).stat().st_mtime_ns
    store = BlobStore()
    store.put(data, digest)
    store.put(data, digest)
    assert store.path(digest).stat().st_mtime_ns == mtime


def test_a_wrong_digest_for_new_bytes_is_refused(factory_home: Path) -> None:
    with pytest.raises(AssertionError, match="do not match"):
        BlobStore().put(b"abc", hashlib.sha256(b"xyz").hexdigest())


def test_memory_is_bounded(factory_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(BlobStore, "_REMEMBER", 3)
    store = BlobStore()
    for i in range(10):
        store.put(b"blob %d" % i)
        assert len(store._stored) <= 3
    assert sum(1 for p in store.root.rglob("*") if p.is_file()) == 10
