"""Shared helpers for the store tests (no tests here)."""

from __future__ import annotations

import uuid

import numpy as np

from cachegraft_cli.store import CacheStore, PassageRow
from cachegraft_cli.store.codecs import from_bf16_words, to_bf16_words
from cachegraft_cli.store.target import Target

GEOMETRY = {"layers": 3, "kv_heads": 2, "head_dim": 8}
TOKEN_SHAPE = (3, 2, 2, 8)


def identity(codec: str = "bf16", geometry: dict | None = None, **over) -> dict:
    ident = {
        "receiver": {"name": "tiny/receiver", "revision": "r1"},
        "sharer": {"name": "tiny/sharer", "revision": "s1"},
        "fuser": {"name": "tiny/fuser", "sha256": "ab" * 32},
        "template": {"name": "plain", "version": 1},
        "prefix_token_ids": [1, 2, 3, 4],
        "position_scheme": "canonical",
        "dtype": "bfloat16",
        "codec": codec,
        "geometry": geometry or GEOMETRY,
    }
    ident.update(over)
    return ident


def make(url, rng, codec="bf16", kinds=("fused",), **kw) -> CacheStore:
    """A new store at `url` with the test identity and a random prefix; `kw` as `CacheStore.create`."""
    return CacheStore.create(url, identity(codec), prefix(rng), kinds=kinds, **kw)


def bf16_cache(rng, tokens: int, shape=TOKEN_SHAPE, scale: float = 1.0) -> np.ndarray:
    x = rng.normal(0, scale, size=(tokens,) + tuple(shape)).astype(np.float32)
    return from_bf16_words(to_bf16_words(x))


def prefix(rng, shape=TOKEN_SHAPE) -> np.ndarray:
    return bf16_cache(rng, 4, shape)


def row(i: int, **over) -> PassageRow:
    fields = dict(id=f"p{i}", title=f"Title {i}", text=f"passage text {i}", content_hash=f"hash{i}",
                  metadata={"n": i, "tags": ["a", "b"]}, parent_id=f"doc{i // 3}", chunk_index=i % 3)
    fields.update(over)
    return PassageRow(**fields)


def fill(store, rng, ids, lengths=(5, 40), kinds=("fused",), run_info=None) -> dict:
    """Add passages `ids` in one writer session; returns id -> {kind: array}."""
    data = {}
    with store.writer(run_info or {"test": True}) as w:
        for i in ids:
            n = int(rng.integers(*lengths))
            data[f"p{i}"] = {k: bf16_cache(rng, n) for k in kinds}
            w.add(row(i), data[f"p{i}"])
    return data


def add_passages(url: str, ids, tokens: int = 20, seed: int = 7, run_info: dict | None = None) -> None:
    """Open the store at `url` and add passages `ids`, `tokens` tokens each, in one writer session
    (what a child process does in the kill tests)."""
    store = CacheStore.open(url)
    rng = np.random.default_rng(seed)
    with store.writer(run_info) as w:
        for i in ids:
            w.add(row(i), {"fused": bf16_cache(rng, tokens)})


def memory_url() -> str:
    return f"memory://cg-{uuid.uuid4().hex[:10]}/store"


def files_under(store, rel: str) -> dict[str, bytes]:
    """path -> bytes of every file under `rel` of a store (any filesystem)."""
    fs, root = store.loc.fs, store.loc.path(rel)
    return {p: fs.cat_file(p) for p in fs.find(root)}


def shard_files(store, segment: str, kind: str = "fused", part: str = "data") -> list[str]:
    fs = store.loc.fs
    root = store.loc.path(f"segments/{segment}/{kind}/{part}/c")
    return sorted(fs.find(root))


def flip_bytes(store, path: str, at: int, n: int = 8) -> None:
    fs = store.loc.fs
    data = bytearray(fs.cat_file(path))
    for j in range(at, at + n):
        data[j] ^= 0xFF
    fs.pipe_file(path, bytes(data))


def fingerprint(store) -> list:
    """Every row in manifest order, superseded ones too: (id, content hash, tokens, checksums of every
    kind/part). Compaction must not change any of it."""
    from cachegraft_cli.store import segments

    tables = segments.load_tables(store.loc, [s["name"] for s in store.segments], store.rows_file)
    return [(pid, t.content_hash(i), int(t.tokens[i]), {k: t.checksum(i, k) for k in store.kinds})
            for t in tables for i, pid in enumerate(t.ids)]


def decoded(store) -> dict:
    """id -> decoded fused cache of every current passage."""
    ids = sorted(store.ids())
    return dict(zip(ids, store.read(ids)))


def same_caches(store, caches: dict) -> bool:
    """Whether the store holds exactly the passages of `caches` (id -> array), bit for bit."""
    ids = sorted(caches)
    return sorted(store.ids()) == ids and all(np.array_equal(a, caches[i]) for i, a in zip(ids, store.read(ids)))


def indexed_store(root, words, receiver, commit_every: int) -> dict:
    """A store of one passage per word (each passage has its own word), in segments of
    `commit_every`, encoded with the receiver's own caches (closed fuser, float32) and indexed:
    its path, every passage's cache, the corpus and the receiver."""
    import json

    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.local import encode_corpus
    from cachegraft_cli.encoding.plan import EncodeOptions
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.session import ModelChoice, ModelSession
    from cachegraft_cli.store import CacheStore

    corpus = root / "c.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"p{i}", "title": f"Entry {i}",
                                          "text": f"The {w} entry tells of {w} things."}) + "\n"
                              for i, w in enumerate(words)))
    session = ModelSession(ModelChoice(str(receiver), None, "closed", device="cpu", dtype="float32"))
    store = root / "store"
    encode_corpus(read_corpus(corpus), Target.open(str(store)), session, EncodeOptions(commit_every=commit_every))
    build_store_index(str(store))
    opened = CacheStore.open(str(store))
    return {"store": store, "caches": dict(zip(opened.ids(), opened.read(opened.ids()))), "corpus": corpus,
            "receiver": str(receiver), "segments": len(opened.segments)}


# ---- the transform codec: caches with structure, and calibrations fitted on them

def structured_cache(rng, tokens: int, geometry: dict | None = None, offset: int = 4) -> np.ndarray:
    """A cache `(tokens, L, 2, H, D)` shaped like a model's: every layer's keys and values are
    mixes of a few shared latent features (the mixes fixed per geometry, so calibration and test
    caches share them) plus noise, and the keys are RoPE-rotated to positions offset + 0, 1, ..."""
    from cachegraft_cli.store import transform as tf

    g = geometry or GEOMETRY
    layers, heads, dim = g["layers"], g["kv_heads"], g["head_dim"]
    mix = np.random.default_rng(1234).normal(0, 1, (layers, 2, 4, heads * dim))
    latent = rng.normal(0, 1, (tokens, 4))
    x = np.einsum("tr,lkrc->tlkc", latent, mix) + rng.normal(0, 0.05, (tokens, layers, 2, heads * dim))
    x = x.reshape(tokens, layers, 2, heads, dim).astype(np.float32)
    x[:, :, 0] = tf.rotate(x[:, :, 0], offset + np.arange(tokens), tf.inv_frequencies(10000.0, dim), 1)
    return x


def tc_calibration(geometry: dict | None = None, seed: int = 0, passages: int = 12, **settings):
    """A transform-codec calibration fitted on `passages` structured caches of 50 tokens."""
    from cachegraft_cli.store import transform as tf

    rng = np.random.default_rng(seed)
    caches = [structured_cache(rng, 50, geometry) for _ in range(passages)]
    return tf.fit(caches, tf.FitOptions(rope_theta=10000.0, position_offset=4, **settings), source="tests")
