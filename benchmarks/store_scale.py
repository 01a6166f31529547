"""Does the store slow down as it grows? Synthetic stores, 100k vs 1k passages.

The suite generates its own stores (reused by later runs with the same
settings). Disk is the limit: 100k passages of ~150 tokens at the receiver's
geometry (24 layers x 2 kv heads x 64 = 12,288 raw bytes/token) would be
~180 GB, so the synthetic caches use a smaller per-token geometry (default
1 layer x 1 kv head x 64 head_dim = 256 raw bytes/token) with realistic
passage lengths (uniform 100..200 tokens) and the receiver store's chunk and
shard token counts (16 / 4096), so chunk counts, shard-index overhead, rows,
segments and the index scale like the real thing. Values follow the
distribution docs/store-format.md measured codecs on (bf16-exact). Passages
are written 2,000 per segment, as `encode` commits them. Each passage has
random-word text, so a BM25 index of 100k passages is real too.

Measured, interleaved store by store in every repeat (medians):
- open: CacheStore.open
- read: store.read of k random passages; bytes read via store.stats (the read ratio)
- assemble: read + the Asker's assembly (to torch bf16, RoPE re-rotation by
  offset, concat, batch) for the same passages
- retrieve: BM25 search for a query of words from a random passage + get_rows
- ask-like: retrieve + get_rows + read + assemble of the retrieved passages
  (everything an ask does except the receiver's forward passes, which do not
  depend on the store's size)
- ask-like, page cache evicted: the same after evicting both stores' files
  from the page cache (posix_fadvise DONTNEED) before every read, so the
  chunks come from disk, as in a store much larger than memory (the ask-like ratio is the
  figure with the page cache as it is).
Append: open + one writer session appending M passages (commit included) to the
big store vs to a new empty store; and the BM25 index update that follows.

    python benchmarks/store_scale.py [--big 100000] [--small 1000] [--append 1000]
        [--geometry 1,1,64] [--tokens 100,200] [--repeats 20] [--append-repeats 3]
"""

from __future__ import annotations

import argparse
import random
import shutil
import sys
import time

import bench_common as bc
import numpy as np

TARGETS = {"read_ratio": 1.5, "ask_like_big/small": 1.1, "append_big/empty": 1.1}
SEGMENT_ROWS = 2000
SHARD_TOKENS = 4096


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--big", type=int, default=100_000)
    ap.add_argument("--small", type=int, default=1000)
    ap.add_argument("--append", type=int, default=1000)
    ap.add_argument("--geometry", default="1,1,64", help="layers,kv_heads,head_dim")
    ap.add_argument("--tokens", default="100,200", help="passage length range")
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--append-repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


# ---------------------------------------------------------------- synthetic data


class Synth:
    """Passage caches sliced from one random pool (cheap to make, still incompressible per chunk)."""

    def __init__(self, geometry: dict, lengths: tuple[int, int], seed: int):
        self.geometry, self.lengths = geometry, lengths
        self.rng = np.random.default_rng(seed)
        self.pool = self._pool(1 << 15)
        self.words = np.array([f"w{i}" for i in range(20_000)])

    def _pool(self, tokens: int) -> np.ndarray:
        """bf16-exact float32 (tokens, L, 2, H, D): keys N(0,1) x log-normal per-channel scale + offset,
        values N(0, .5)."""
        g = self.geometry
        shape = (tokens, g["layers"], g["kv_heads"], g["head_dim"])
        scale = np.exp(self.rng.normal(0, 1, shape[1:])).astype(np.float32)
        offset = self.rng.normal(0, 1, shape[1:]).astype(np.float32)
        keys = self.rng.standard_normal(shape, dtype=np.float32) * scale + offset
        values = self.rng.standard_normal(shape, dtype=np.float32) * 0.5
        x = np.stack([keys, values], axis=2)
        return (x.view(np.uint32) & 0xFFFF0000).view(np.float32)  # truncate to bf16

    def passage(self, i: int, prefix: str):
        from cachegraft_cli.store import PassageRow, content_hash_of

        n = int(self.rng.integers(self.lengths[0], self.lengths[1] + 1))
        start = int(self.rng.integers(0, len(self.pool) - n))
        text = self.texts(1)[0]
        row = PassageRow(id=f"{prefix}{i}", title=f"t{i}", text=text,
                         content_hash=content_hash_of(f"{prefix}{i} {text}"))
        return row, self.pool[start : start + n]


    def texts(self, n: int) -> list[str]:
        return [" ".join(w) for w in self.rng.choice(self.words, (n, 30))]


def identity(geometry: dict) -> dict:
    return {"receiver": {"name": "synthetic", "fingerprint": "synthetic"}, "sharer": None, "fuser": None,
            "template": {"instruction": "synthetic"}, "prefix_token_ids": [1, 2, 3, 4], "position_scheme": "canonical",
            "dtype": "bfloat16", "codec": "bf16", "geometry": geometry}


def create(url: str, geometry: dict, synth: Synth):
    from cachegraft_cli.store import CacheStore

    return CacheStore.create(url, identity(geometry), synth.pool[:4], shard_tokens=SHARD_TOKENS)


def append(store, synth: Synth, n: int, prefix: str) -> None:
    """One writer session of n passages (one segment)."""
    with store.writer({"tool": "benchmarks/store_scale.py", "passages": n}) as w:
        for i in range(n):
            w.add(*_row_and_caches(synth, i, prefix))


def _row_and_caches(synth: Synth, i: int, prefix: str):
    row, cache = synth.passage(i, prefix)
    return row, {"fused": cache}


def build(url: str, n: int, geometry: dict, synth: Synth) -> float:
    """Make a store of n passages in 2,000-passage segments (reused when complete); seconds taken.

    The first segment goes through the real writer; the others are copies of its cache
    files with their own ids and texts (see clone_segment): writing 15M tokens through
    the writer takes ~30 min on a loaded 2-core machine (blosc on 4 KB chunks), copying
    the files takes a minute, and reads, opens and appends see the same store either way."""
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store import FORMAT_VERSION, CacheStore

    t0 = time.perf_counter()
    try:
        old = CacheStore.open(url)
        # Exactly n: the append test appends to the big store, and a grown store (more segments, files
        # the page cache no longer holds) measured slower run after run; rebuilding is ~30 s.
        if len(old) == n and old.meta.get("format_version") == FORMAT_VERSION:
            return 0.0
    except Exception:  # noqa: BLE001 - missing or partial: rebuild
        pass
    shutil.rmtree(url, ignore_errors=True)
    store = create(url, geometry, synth)
    append(store, synth, min(SEGMENT_ROWS, n), "p0-")
    first = store.segments[0]["name"]
    for s in range(SEGMENT_ROWS, n, SEGMENT_ROWS):
        clone_segment(url, first, f"p{s // SEGMENT_ROWS}-", synth)
        if (s // SEGMENT_ROWS) % 10 == 9:
            bc.log(f"{url}: {s + SEGMENT_ROWS} passages")
    build_store_index(url, "bm25")
    return time.perf_counter() - t0


def clone_segment(url: str, src: str, prefix: str, synth: Synth) -> None:
    """A new committed segment whose arrays are a file copy of `src` (same rows, offsets and
    checksums) with new ids, texts and content hashes; appended to the manifest like a commit."""
    import dataclasses
    import json
    import os

    import numpy as np

    from cachegraft_cli.store import CacheStore, content_hash_of, segments
    from cachegraft_cli.store.layout import COMMIT, CONTENT, new_segment_name, segment_file

    store = CacheStore.open(url)
    loc, name = store.loc, new_segment_name()
    root = os.path.join(url, "segments")
    shutil.copytree(os.path.join(root, src), os.path.join(root, name))
    table = segments.load_tables(loc, [src], store.rows_file)[0]
    content = json.loads(loc.read_bytes(segment_file(src, CONTENT)))["columns"]
    ids = [f"{prefix}{i}" for i in range(len(table))]
    content["text"] = synth.texts(len(table))
    hashes = np.array([content_hash_of(f"{i} {t}") for i, t in zip(ids, content["text"])], dtype="S64")
    segments.write_table(loc, dataclasses.replace(table, segment=name, ids=ids, hashes=hashes), store.rows_file)
    loc.write_json_atomic(segment_file(name, CONTENT), {"columns": content}, compact=True)
    entry = {**json.loads(loc.read_bytes(segment_file(src, COMMIT))), "name": name}
    loc.write_json_atomic(segment_file(name, COMMIT), entry)
    segments.append_to_manifest(loc, entry)


# ---------------------------------------------------------------- measurements


class Probe:
    """One open store with its index and the assembly the Asker does (no model)."""

    def __init__(self, url: str):
        import torch

        from cachegraft_cli.retrieval.stored import open_index
        from cachegraft_cli.store import CacheStore

        t0 = time.perf_counter()
        self.store = CacheStore.open(url)
        self.open_s = time.perf_counter() - t0
        self.url = url
        self.index = open_index(self.store, url)
        self.ids = self.store.ids()
        g = self.store.geometry
        d = g["head_dim"]
        inv = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))  # Qwen2.5 rope_theta
        from cachegraft_cli.lm import kvcache

        self.rotator = kvcache.KeyRotator([inv] * g["layers"])
        self.prefix = kvcache.from_token_major(self.store.prefix(), torch.bfloat16)
        self.store.get_rows(self.ids[:1])  # content of one segment: warm the JSON path, not all of it

    def assemble(self, ids: list[str]):
        """Asker._assemble's work: decode, to bf16 tensors, rotate each block by its offset, concat, batch."""
        import torch

        from cachegraft_cli.lm import kvcache

        arrays = self.store.read(ids)
        base = kvcache.num_tokens(self.prefix)
        parts, position = [self.prefix], base
        for a in arrays:
            kv = kvcache.from_token_major(a, torch.bfloat16)
            parts.append(self.rotator.rotate(kv, position - base))
            position += len(a)
        return kvcache.batched(kvcache.concat_tokens(parts))

    def query(self, rng: random.Random) -> str:
        return " ".join(rng.sample(self.store.get_rows([rng.choice(self.ids)])[0].text.split(), 6))


def time_one(probe: Probe, rng: random.Random, k: int) -> dict:
    ids = rng.sample(probe.ids, k)
    st = probe.store.stats
    before = st.bytes
    t0 = time.perf_counter()
    probe.store.read(ids)
    t1 = time.perf_counter()
    read_ratio = (st.bytes - before) / bc.stored_bytes(probe.store, ids)
    probe.assemble(rng.sample(probe.ids, k))
    t2 = time.perf_counter()
    q = probe.query(rng)
    t3 = time.perf_counter()
    hits = probe.index.search(q, k)
    probe.store.get_rows([h.id for h in hits])
    t4 = time.perf_counter()
    probe.assemble([h.id for h in hits])
    t5 = time.perf_counter()
    return {"read": t1 - t0, "assemble": t2 - t1, "retrieve": t4 - t3, "ask_like": t5 - t3, "read_ratio": read_ratio}


def measure_reads(urls: dict, k: int, repeats: int, seed: int) -> dict:
    probes = {name: Probe(u) for name, u in urls.items()}
    for p in probes.values():  # warm-up (first zarr array opens, JSON of first segments)
        time_one(p, random.Random(seed), k)
    runs = {name: [] for name in probes}
    rng = random.Random(seed + 1)
    for r in range(repeats):
        for name in bc.rotated(list(probes), r):
            runs[name].append(time_one(probes[name], rng, k))
    disk = evicted_ask_like(probes, urls, rng, k, repeats)
    opens = {name: [] for name in probes}
    cold = {name: [] for name in probes}
    for r in range(3):
        for name in bc.rotated(list(probes), r):
            t0 = time.perf_counter()
            p = Probe(urls[name])  # what a one-shot `cachegraft ask` pays before answering
            cold[name].append(time.perf_counter() - t0 + time_one(p, random.Random(r), k)["ask_like"])
            opens[name].append(p.open_s)
    return {name: {key: bc.median(x[key] for x in rs) for key in rs[0]} | {"open": bc.median(opens[name]),
            "cold_ask_like": bc.median(cold[name]), "ask_like_disk": bc.median(disk[name]),
            "read_ratio_max": max(x["read_ratio"] for x in rs)}
            for name, rs in runs.items()}


def evicted_ask_like(probes: dict, urls: dict, rng: random.Random, k: int, repeats: int) -> dict:
    """Ask-like seconds per store, both stores' files evicted from the page cache before each."""
    out = {name: [] for name in probes}
    for r in range(repeats):
        for name in bc.rotated(list(probes), r):
            evict_page_cache(urls.values())
            out[name].append(time_one(probes[name], rng, k)["ask_like"])
    return out


def evict_page_cache(urls) -> None:
    """Drop the stores' file pages from the page cache (Linux; dirty pages are synced first,
    since only clean pages can be dropped). Costs ~0.1 s for the 4k files of a 100k store."""
    import os

    os.sync()
    for url in urls:
        for d, _, files in os.walk(url):
            for f in files:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def measure_appends(big_url: str, empty_root: str, geometry: dict, synth: Synth, n: int, repeats: int) -> dict:
    """Seconds per append session (open + write + commit) and per index update, big vs empty, interleaved."""
    from cachegraft_cli.retrieval.stored import build_store_index
    from cachegraft_cli.store import CacheStore

    out = {"big": [], "empty": [], "index_big": [], "index_empty": [], "open_big": [], "open_empty": []}
    for r in range(repeats):
        empty_url = f"{empty_root}-{r}"
        shutil.rmtree(empty_url, ignore_errors=True)
        create(empty_url, geometry, synth)
        for name in bc.rotated(["big", "empty"], r):
            url = big_url if name == "big" else empty_url
            t0 = time.perf_counter()
            store = CacheStore.open(url)
            out[f"open_{name}"].append(time.perf_counter() - t0)
            append(store, synth, n, f"a{r}-{time.time_ns()}-")
            t1 = time.perf_counter()
            build_store_index(url, "bm25")
            out[name].append(t1 - t0)
            out[f"index_{name}"].append(time.perf_counter() - t1)
        shutil.rmtree(empty_url, ignore_errors=True)
    return {key: bc.median(v) for key, v in out.items()} | {"runs": out}


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    layers, heads, dim = (int(x) for x in args.geometry.split(","))
    geometry = {"layers": layers, "kv_heads": heads, "head_dim": dim}
    lengths = tuple(int(x) for x in args.tokens.split(","))
    synth = Synth(geometry, lengths, args.seed)
    tag = f"g{layers}x{heads}x{dim}-t{lengths[0]}-{lengths[1]}-s{args.seed}"
    urls = {"big": str(bc.WORK_DIR / f"scale-{tag}-n{args.big}"),
            "small": str(bc.WORK_DIR / f"scale-{tag}-n{args.small}")}
    built = {name: build(u, args.big if name == "big" else args.small, geometry, synth) for name, u in urls.items()}
    disk = {name: _du(u) for name, u in urls.items()}
    bc.log(f"stores ready (build seconds {built}, bytes {disk})")
    start_machine = bc.machine()
    reads = measure_reads(urls, args.k, args.repeats, args.seed)
    appends = measure_appends(urls["big"], str(bc.WORK_DIR / f"scale-{tag}-empty"), geometry, synth, args.append,
                              args.append_repeats)
    report(args, geometry, reads, appends, disk, built, start_machine)
    return 0


def _du(path: str) -> int:
    import os

    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def report(args, geometry, reads, appends, disk, built, start_machine) -> None:
    keys = ["open", "read", "assemble", "retrieve", "ask_like", "ask_like_disk", "cold_ask_like"]
    rows = [[k, reads["small"][k] * 1e3, reads["big"][k] * 1e3, reads["big"][k] / reads["small"][k]] for k in keys]
    wb, we = appends["big"] - appends["open_big"], appends["empty"] - appends["open_empty"]
    rows += [["append_open+write", appends["empty"] * 1e3, appends["big"] * 1e3, appends["big"] / appends["empty"]],
             ["append_write_only", we * 1e3, wb * 1e3, wb / we],
             ["index_update", appends["index_empty"] * 1e3, appends["index_big"] * 1e3,
              appends["index_big"] / appends["index_empty"]]]
    bc.print_table(f"Store scale: {args.small} vs {args.big} passages, geometry {geometry}, "
                   f"tokens {args.tokens}, k={args.k}, {args.repeats} read repeats, "
                   f"{args.append_repeats} appends of {args.append} "
                   f"(append/index columns: empty store vs big store)", ["what", "small_ms", "big_ms", "big/small"],
                   rows)
    ratios = {"read_ratio": reads["big"]["read_ratio"],
              "ask_like_big/small": reads["big"]["ask_like"] / reads["small"]["ask_like"],
              "read_big/small": reads["big"]["read"] / reads["small"]["read"],
              "append_big/empty": appends["big"] / appends["empty"], "append_write_only_big/empty": wb / we,
              "cold_ask_like_big/small": reads["big"]["cold_ask_like"] / reads["small"]["cold_ask_like"],
              "disk_ask_like_big/small": reads["big"]["ask_like_disk"] / reads["small"]["ask_like_disk"],
              "index_update_big/empty": appends["index_big"] / appends["index_empty"]}
    print(f"Bytes read / stored bytes of k passages (big store): median {reads['big']['read_ratio']:.3f}, "
          f"max {reads['big']['read_ratio_max']:.3f} -> {bc.verdict(ratios['read_ratio'], 1.5)}")
    print(f"Ask-like latency big/small -> {bc.verdict(ratios['ask_like_big/small'], 1.1)} "
          f"(read only: {ratios['read_big/small']:.2f})")
    print(f"Ask-like, page cache evicted before each read, big/small: {ratios['disk_ask_like_big/small']:.2f} "
          f"({reads['small']['ask_like_disk'] * 1e3:.0f} vs {reads['big']['ask_like_disk'] * 1e3:.0f} ms)")
    print(f"One-shot (open store + index + ask-like) big/small: {ratios['cold_ask_like_big/small']:.1f}x")
    print(f"Append (open + write + commit) big/empty -> {bc.verdict(ratios['append_big/empty'], 1.1)}; "
          f"write+commit only {ratios['append_write_only_big/empty']:.2f}x "
          f"(index update after it: {ratios['index_update_big/empty']:.2f}x)")
    print(f"disk bytes {disk}; build seconds {built}; machine at start {start_machine}; "
          f"loadavg at end {bc.machine()['loadavg']}")
    bc.emit({"bench": "store_scale", "geometry": geometry, "tokens": args.tokens, "big": args.big,
             "small": args.small,
             "append": args.append, "reads": reads, "appends": {k: v for k, v in appends.items() if k != "runs"},
             "ratios": ratios, "targets": TARGETS, "disk_bytes": disk, "build_s": built,
             "machine_start": start_machine, "machine_end": bc.machine()})


if __name__ == "__main__":
    sys.exit(main())
