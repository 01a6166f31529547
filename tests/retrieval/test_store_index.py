"""A store's retrieval index: incremental updates by segment, and the O(segments) consistency check."""

from __future__ import annotations

import shutil

import numpy as np
import pytest

from cachegraft_cli.errors import IndexMismatchError
from cachegraft_cli.retrieval import stored as indexing
from cachegraft_cli.retrieval.index import load_index
from cachegraft_cli.store import CacheStore, PassageRow

GEOMETRY = {"layers": 1, "kv_heads": 1, "head_dim": 4}
IDENTITY = {"receiver": None, "sharer": None, "fuser": None, "template": {}, "prefix_token_ids": [1],
            "position_scheme": "canonical", "dtype": "float32", "codec": "float32", "geometry": GEOMETRY}
TEXTS = ["amber falcon river", "basalt quarry lantern", "cobalt meadow harbour", "dusty archive ledger",
         "ember lighthouse storm", "frost orchard ladder"]


def add(url, items):
    store = CacheStore.open(url)
    with store.writer() as w:
        for pid, text in items:
            w.add(PassageRow(pid, text=text, content_hash=f"h-{pid}-{text}"),
                  {"fused": np.ones((3, 1, 2, 1, 4), np.float32)})


@pytest.fixture
def url(tmp_path):
    url = str(tmp_path / "s")
    CacheStore.create(url, IDENTITY, np.zeros((1, 1, 2, 1, 4), np.float32))
    add(url, [(f"p{i}", TEXTS[i]) for i in range(3)])
    return url


def test_update_reads_only_new_segments_and_equals_a_fresh_build(url, monkeypatch, tmp_path):
    assert indexing.build_store_index(url)["mode"] == "built"
    add(url, [(f"p{i}", TEXTS[i]) for i in range(3, 6)])
    seen = []
    real = CacheStore.rows
    monkeypatch.setattr(CacheStore, "rows", lambda self, segs=None: seen.append(segs) or real(self, segs))
    report = indexing.build_store_index(url)
    assert (report["mode"], report["added"], report["passages"]) == ("updated", 3, 6)
    assert seen == [[CacheStore.open(url).segments[1]["name"]]]  # the first segment's text was not read
    fresh = str(tmp_path / "fresh")
    shutil.copytree(url, fresh)
    indexing.build_store_index(fresh, rebuild=True)
    updated, rebuilt = load_index(indexing.index_path(url)), load_index(indexing.index_path(fresh))
    for query in ["amber river", "ember storm lighthouse", "frost ladder"]:
        assert updated.search(query, 3) == rebuilt.search(query, 3)
    assert updated.fingerprint == rebuilt.fingerprint


def test_superseded_id_in_a_new_segment_replaces_its_row(url):
    indexing.build_store_index(url)
    add(url, [("p0", "zinc telescope")])
    assert indexing.build_store_index(url)["added"] == 1
    index = indexing.open_index(CacheStore.open(url), url)
    assert [h.id for h in index.search("zinc telescope", 1)] == ["p0"] and len(index) == 3


def test_open_checks_segments_not_passages_when_they_match(url, monkeypatch):
    indexing.build_store_index(url)
    monkeypatch.setattr(indexing, "store_fingerprint", lambda store: pytest.fail("fingerprinted every passage"))
    index = indexing.open_index(CacheStore.open(url), url)
    assert index.engines == {"terms": "tantivy"}
    assert [h.id for h in index.search("cobalt harbour", 1)] == ["p2"]


def test_an_index_of_another_passage_set_is_refused(url, tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(url, other)
    add(other, [("p9", "granite canyon echo")])
    indexing.build_store_index(other)
    shutil.rmtree(indexing.index_path(url), ignore_errors=True)
    shutil.copytree(indexing.index_path(other), indexing.index_path(url))
    with pytest.raises(IndexMismatchError):
        indexing.open_index(CacheStore.open(url), url)


def test_reindexing_an_unchanged_store_keeps_a_working_index(url):
    indexing.build_store_index(url)
    index = indexing.open_index(CacheStore.open(url), url)  # memory-maps the files the next save replaces
    assert indexing.build_store_index(url)["added"] == 0
    assert [h.id for h in index.search("basalt lantern", 1)] == ["p1"]
    again = indexing.open_index(CacheStore.open(url), url)
    assert [h.id for h in again.search("basalt lantern", 1)] == ["p1"]


def test_a_format_1_index_is_refused_by_ask_and_rebuilt_by_index(url):
    import json
    from pathlib import Path

    from cachegraft_cli.errors import RetrievalIndexError

    root = Path(indexing.index_path(url))
    root.mkdir()
    (root / "bm25").mkdir()  # the earlier layout: hand-written BM25 blocks
    (root / "index.json").write_text(json.dumps({"format": "cachegraft-retrieval-index", "version": 1,
                                                 "kind": "bm25", "passages": 3, "bm25_blocks": []}))
    with pytest.raises(RetrievalIndexError, match="format 1") as info:
        indexing.open_index(CacheStore.open(url), url)
    assert info.value.hint == f"Run `cachegraft index --store {url}` to rebuild it."
    assert indexing.build_store_index(url)["mode"] == "built"
    assert not (root / "bm25").exists()  # the old files are gone with the rebuild
    assert [h.id for h in indexing.open_index(CacheStore.open(url), url).search("cobalt harbour", 1)] == ["p2"]


def test_appending_adds_engine_files_and_leaves_old_ones(url):
    import pathlib

    indexing.build_store_index(url)
    root = pathlib.Path(indexing.index_path(url))
    mutable = (".json", "passages.bin", ".lock")
    before = {p.relative_to(root): (p.read_bytes(), p.stat().st_ino)
              for p in root.rglob("*") if p.is_file() and not p.name.endswith(mutable)}
    add(url, [("p3", TEXTS[3])])
    indexing.build_store_index(url)
    root = pathlib.Path(indexing.index_path(url))  # a new version of the index
    after = {p.relative_to(root): (p.read_bytes(), p.stat().st_ino) for p in root.rglob("*") if p.is_file()}
    assert all(after.get(p) == data for p, data in before.items())  # tantivy segments are immutable: same files
    assert len(after) > len(before)


def test_engines_can_be_named_and_are_kept_on_update(url):
    report = indexing.build_store_index(url, engines=["tantivy"])
    assert report["engines"] == {"terms": "tantivy"}
    add(url, [("p3", TEXTS[3])])
    assert indexing.build_store_index(url)["mode"] == "updated"


def test_a_missing_block_file_is_a_typed_error_and_index_rebuilds(url):
    import pathlib

    from cachegraft_cli.errors import RetrievalIndexError

    indexing.build_store_index(url)
    next(pathlib.Path(indexing.index_path(url), "lexical").glob("meta.json")).unlink()
    with pytest.raises(RetrievalIndexError, match="cachegraft index"):
        indexing.open_index(CacheStore.open(url), url)
    assert indexing.build_store_index(url)["mode"] == "built"
    assert [h.id for h in indexing.open_index(CacheStore.open(url), url).search("amber falcon", 1)] == ["p0"]


def test_index_kind_views_what_the_index_has(url):
    from cachegraft_cli.errors import RetrievalIndexError

    indexing.build_store_index(url)
    store = CacheStore.open(url)
    assert [h.id for h in indexing.open_index(store, url, "bm25").search("amber falcon", 1)] == ["p0"]
    with pytest.raises(RetrievalIndexError, match="cannot be searched as 'dense'"):
        indexing.open_index(store, url, "dense")  # what `ask --index-kind dense` gets on a BM25 index


def test_an_index_on_an_object_store_is_replaced_as_a_new_version(tmp_path, monkeypatch):
    """A remote store's index is published atomically too: a new version directory, CURRENT replaced,
    the old version removed; its unchanged engine files are copied server-side, not uploaded again,
    and readers mirror both versions into one local directory."""
    import fsspec
    from fsspec.implementations.memory import MemoryFileSystem
    from store_support import memory_url

    from cachegraft_cli.retrieval.engines import files

    monkeypatch.setenv("CACHEGRAFT_HOME", str(tmp_path / "home"))
    remote = memory_url()
    CacheStore.create(remote, IDENTITY, np.zeros((1, 1, 2, 1, 4), np.float32))
    add(remote, [(f"p{i}", TEXTS[i]) for i in range(3)])
    indexing.build_store_index(remote)
    first = indexing.index_path(remote)
    assert [h.id for h in indexing.open_index(CacheStore.open(remote), remote).search("cobalt harbour", 1)] == ["p2"]
    add(remote, [("p3", TEXTS[3])])
    fs, root = fsspec.core.url_to_fs(f"{remote}/index")
    old = files.remote_files(fs, fsspec.core.url_to_fs(first)[1])
    uploads, copies = [], []
    real_put, real_copy = MemoryFileSystem.put_file, MemoryFileSystem.cp_file
    monkeypatch.setattr(MemoryFileSystem, "put_file",
                        lambda self, a, b, **k: uploads.append(b) or real_put(self, a, b, **k))
    monkeypatch.setattr(MemoryFileSystem, "cp_file",
                        lambda self, a, b, **k: copies.append(b) or real_copy(self, a, b, **k))
    assert indexing.build_store_index(remote)["mode"] == "updated"
    second = indexing.index_path(remote)
    assert second != first and sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == \
        sorted(["CURRENT", second.rsplit("/", 1)[-1]])  # the old version is gone, no lock left behind

    def rel(path: str) -> str:  # a file's path inside its version directory
        return path.split("/v-", 1)[1].split("/", 1)[1]

    assert copies and {rel(c) for c in copies} <= set(old)  # unchanged engine files: copied server-side
    assert all(files.is_mutable(rel(u)) or rel(u) not in old for u in uploads)  # only new ones uploaded
    index = indexing.open_index(CacheStore.open(remote), remote)
    assert [h.id for h in index.search("dusty archive", 1)] == ["p3"] and len(index) == 4
    mirrors = list((tmp_path / "home" / "index-mirror").iterdir())
    assert len(mirrors) == 1  # one mirror for the index, whichever version
