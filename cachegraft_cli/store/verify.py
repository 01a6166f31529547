"""`CacheStore.verify()`: every chunk decodes and every passage matches its checksums."""

from __future__ import annotations

import numpy as np

from cachegraft_cli.store import checksums
from cachegraft_cli.store.layout import COMMIT, segment_file


def verify(store, progress=None) -> dict:
    """Report problems naming segment and passage; never raises for damage (the CLI does)."""
    problems: list[dict] = []
    total = sum(e["tokens"] for e in store.segments) * len(store.kinds)
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    for table, entry in zip(store.tables, store.segments):
        problems += _check_table(store, table, entry)
        for kind in store.kinds:
            problems += _check_kind(store, table, kind, advance)
    return {"ok": not problems, "url": store.loc.url, "segments": len(store.segments),
            "rows": sum(len(t) for t in store.tables), "tokens": total // max(len(store.kinds), 1),
            "problems": problems}


def _problem(table, row, kind, part, text) -> dict:
    passage = table.ids[row] if row is not None else None
    return {"segment": table.segment, "passage": passage, "kind": kind, "part": part, "problem": text}


def _check_table(store, table, entry) -> list[dict]:
    out = []
    if not store.loc.exists(segment_file(table.segment, COMMIT)):
        out.append(_problem(table, None, None, None, "commit.json is missing"))
    if "token_extent" in entry:  # compacted: sources start on token-group boundaries, gaps between them
        ends = table.offsets + table.tokens
        outside = len(table) and (table.offsets[0] < 0 or ends[-1] > entry["token_extent"])
        if np.any(table.offsets[1:] < ends[:-1]) or outside or int(table.tokens.sum()) != entry["tokens"]:
            out.append(_problem(table, None, None, None,
                                f"{store.rows_file} offsets overlap or leave the segment's tokens"))
    else:
        offsets = np.concatenate([[0], np.cumsum(table.tokens)])
        if not np.array_equal(offsets[:-1], table.offsets) or offsets[-1] != entry["tokens"]:
            out.append(_problem(table, None, None, None, f"{store.rows_file} offsets do not tile the segment's tokens"))
    if len(table) != entry["rows"]:
        out.append(_problem(table, None, None, None,
                            f"{store.rows_file} has {len(table)} rows, manifest says {entry['rows']}"))
    return out


def _check_kind(store, table, kind, advance) -> list[dict]:
    comps = store.codec.components()
    tokens = int((table.offsets + table.tokens).max()) if len(table) else 0  # gaps included (compacted int4)
    try:
        arrays = {c.name: store.array(table.segment, kind, c.name) for c in comps}
    except Exception as exc:  # noqa: BLE001 - any failure to open is damage to report
        return [_problem(table, None, kind, None, f"arrays do not open: {exc}")]
    spans = [table.span(i) for i in range(len(table))]
    crcs = [checksums.empty([kind], comps) for _ in spans]
    damaged: dict[int, dict] = {}
    for start in range(0, tokens, store.shard_tokens):
        stop = min(start + store.shard_tokens, tokens)
        parts = {c.name: _read_block(arrays[c.name], c, start, stop, table, spans, kind, damaged) for c in comps}
        checksums.feed(spans, crcs, kind, comps, parts, start, stop)
        advance(stop - start)
    out = list(damaged.values())
    for i, crc in enumerate(crcs):
        if i not in damaged and crc[kind] != table.checksum(i, kind):
            bad = [name for name in crc[kind] if crc[kind][name] != table.checksum(i, kind).get(name)]
            out.append(_problem(table, i, kind, ",".join(bad), "checksum mismatch"))
    return out


def _read_block(arr, comp, start, stop, table, spans, kind, damaged) -> np.ndarray:
    lo, hi = comp.rows(start, stop)
    if arr.shape[0] < hi:
        _mark(
            table, spans, kind, comp, (arr.shape[0] * comp.stride, stop), f"array ends at row {arr.shape[0]}", damaged
        )
    try:
        return np.asarray(arr[lo:hi])
    except Exception:  # noqa: BLE001 - localise below, chunk by chunk
        return _salvage(arr, comp, lo, hi, table, spans, kind, damaged)


def _salvage(arr, comp, lo, hi, table, spans, kind, damaged) -> np.ndarray:
    out = np.zeros((hi - lo,) + comp.tail, dtype=comp.dtype)
    step = arr.chunks[0]
    for r in range(lo - lo % step, hi, step):
        a, b = max(r, lo), min(r + step, hi)
        try:
            out[a - lo: b - lo] = arr[a:b]
        except Exception as exc:  # noqa: BLE001
            tokens = (a * comp.stride, b * comp.stride)
            _mark(table, spans, kind, comp, tokens, f"chunk at tokens [{tokens[0]}, {tokens[1]}) does not decode: "
                                                    f"{exc}", damaged)
    return out


def _mark(table, spans, kind, comp, tokens, text, damaged) -> None:
    for i, (a, b) in enumerate(spans):
        if a < tokens[1] and b > tokens[0] and i not in damaged:
            damaged[i] = _problem(table, i, kind, comp.name, text)
