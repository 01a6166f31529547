"""`CacheStore.verify()`: every chunk decodes and every passage matches its checksums.

Each problem names its segment and, where it is one passage's, the passage
and its row; `code` says what kind of problem it is (for `store repair`):
`segment_missing` (its row table does not read), `commit_missing`, `entry` (the manifest
entry disagrees with a commit record that fits the row table), `rows_mismatch`, `offsets`,
`content`, `arrays`, `shard_missing`, `array_short`, `chunk`, `checksum`, `duplicate`, and `metadata`
(an array's zarr.json contradicts the store's identity: the bytes may be intact, so no row is judged).
"""

from __future__ import annotations

import json

import numpy as np

from cachegraft_cli.errors import StoreMetadataError
from cachegraft_cli.store import checksums, evidence, segments
from cachegraft_cli.store.layout import COMMIT, CONTENT, array_path, segment_file


def verify(store, progress=None) -> dict:
    """Report problems naming segment and passage; never raises for damage (the CLI does)."""
    problems: list[dict] = []
    total = sum(e["tokens"] for e in store.segments if e["name"] not in store.missing) * len(store.kinds)
    tables = _tables_problem(store)
    if tables:  # without its codec tables (the tc calibration) no passage decodes: none is judged
        return {"ok": False, "url": store.loc.url, "segments": len(store.segments),
                "rows": sum(len(t) for t in store.tables), "tokens": total // max(len(store.kinds), 1),
                "problems": [tables]}
    done = [0]

    def advance(n: int) -> None:
        done[0] += n
        if progress:
            progress(done[0], total)

    for table, entry in zip(store.tables, store.segments):
        if table.segment in store.missing:
            problems.append(_problem(table, None, None, None, f"{store.missing[table.segment]}: its "
                                     f"{entry['rows']} passages cannot be read or named from it", "segment_missing"))
            continue
        problems += _check_table(store, table, entry)
        for kind in store.kinds:
            problems += _check_kind(store, table, kind, advance)
    problems += _duplicates(store.tables)
    return {"ok": not problems, "url": store.loc.url, "segments": len(store.segments),
            "rows": sum(len(t) for t in store.tables), "tokens": total // max(len(store.kinds), 1),
            "problems": problems}


def _tables_problem(store) -> dict | None:
    """The codec's store-level tables, read and checked (sha256, geometry), or the problem."""
    try:
        store.codec.tables()
    except StoreMetadataError as exc:
        return {"segment": None, "passage": None, "row": None, "kind": None, "part": None, "problem": exc.message,
                "code": "metadata"}
    return None


def _problem(table, row, kind, part, text, code) -> dict:
    passage = table.ids[row] if row is not None else None
    return {"segment": table.segment, "passage": passage, "row": row, "kind": kind, "part": part,
            "problem": text, "code": code}


def _check_table(store, table, entry) -> list[dict]:
    out = []
    if not store.loc.exists(segment_file(table.segment, COMMIT)):
        out.append(_problem(table, None, None, None, "commit.json is missing", "commit_missing"))
    else:
        record = _commit_record(store, table.segment) or {}
        keys = [k for k in _SIZES if record and entry.get(k) != record.get(k)]
        if keys and _fits(table, record):  # the manifest entry is wrong, not the segment
            said = ", ".join(f"{k}={entry.get(k)!r}" for k in keys)
            found = ", ".join(f"{k}={record.get(k)!r}" for k in keys)
            return [_problem(table, None, None, None, f"the manifest entry says {said}; its commit.json and "
                             f"{store.rows_file} agree on {found}", "entry")] + _check_content(store, table)
    out += _check_layout(store, table, entry)
    out += _check_content(store, table)
    return out


_SIZES = ("rows", "tokens", "token_extent")


def _commit_record(store, name: str) -> dict | None:
    try:
        record = store.loc.read_json(segment_file(name, COMMIT))
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and record.get("name") == name else None


def _fits(table, entry: dict) -> bool:
    """Whether an entry (manifest or commit record) describes this row table."""
    return not _check_layout(None, table, entry)


def _check_layout(store, table, entry) -> list[dict]:
    rows_file = store.rows_file if store is not None else "rows.bin"
    out = []
    if not all(isinstance(entry.get(k, 0), int) for k in _SIZES) or not isinstance(entry.get("rows"), int) \
            or not isinstance(entry.get("tokens"), int):
        return [_problem(table, None, None, None, "its entry has no valid rows and tokens", "offsets")]
    if "token_extent" in entry:  # compacted or repaired: rows in token order, gaps between them allowed
        ends = table.offsets + table.tokens
        ordered = bool(np.all(table.tokens > 0)) and not np.any(table.offsets[1:] < ends[:-1])
        inside = not len(table) or (int(table.offsets[0]) >= 0 and int(ends[-1]) <= entry["token_extent"])
        if not (ordered and inside) or int(table.tokens.sum()) != entry["tokens"]:
            out.append(_problem(table, None, None, None,
                                f"{rows_file} offsets overlap or leave the segment's tokens", "offsets"))
    else:
        offsets = np.concatenate([[0], np.cumsum(table.tokens)])
        if not np.array_equal(offsets[:-1], table.offsets) or offsets[-1] != entry["tokens"]:
            out.append(_problem(table, None, None, None, f"{rows_file} offsets do not tile the segment's tokens",
                                "offsets"))
    if len(table) != entry["rows"]:
        out.append(_problem(table, None, None, None,
                            f"{rows_file} has {len(table)} rows, manifest says {entry['rows']}", "rows_mismatch"))
    return out


def _check_content(store, table) -> list[dict]:
    try:
        blob = store.loc.read_many([segment_file(table.segment, CONTENT)])[0]
        columns = json.loads(blob)["columns"]
        if any(len(columns[c]) != len(table) for c in ("title", "text", "metadata")):
            raise ValueError("column lengths differ from the row count")
    except Exception as exc:  # noqa: BLE001 - any failure to read the text is damage to report
        return [_problem(table, None, None, None, f"content.json is unreadable ({type(exc).__name__}: {exc})",
                         "content")]
    return []


def check_written(store, table, entry: dict) -> list[dict]:
    """Problems of a segment written but not listed yet (a compaction's merge, before the swap):
    its arrays' metadata against the store's, and every passage against its checksums."""
    comps = store.codec.components()
    out = []
    for kind in store.kinds:
        for comp in comps:
            try:
                arr = segments.open_array(store.zarr_store(), array_path(table.segment, kind, comp.name))
                problem = evidence.array_problem(store.expect, arr, comp, entry, table)
            except Exception as exc:  # noqa: BLE001 - any failure to open is what the check reports
                problem = f"does not open ({_short(exc)})"
            if problem:
                out.append(_problem(table, None, kind, comp.name, f"{kind}/{comp.name}/zarr.json {problem}",
                                    "metadata"))
    if out:
        return out
    return [p for kind in store.kinds for p in _check_kind(store, table, kind, lambda n: None)]


def _check_kind(store, table, kind, advance) -> list[dict]:
    comps = store.codec.components()
    tokens = int((table.offsets + table.tokens).max()) if len(table) else 0  # gaps included (compacted int4, repaired)
    try:
        arrays = {c.name: store.array(table.segment, kind, c.name) for c in comps}
    except StoreMetadataError as exc:  # the bytes may be intact: a contradiction, never row damage
        return [_problem(table, None, kind, None, exc.message, "metadata")]
    except Exception as exc:  # noqa: BLE001 - any failure to open is damage to report
        return [_problem(table, None, kind, None, f"arrays do not open: {exc}", "arrays")]
    spans = [table.span(i) for i in range(len(table))]
    crcs = [checksums.empty([kind], comps) for _ in spans]
    damaged: dict[int, dict] = {}
    for comp in comps:
        _mark_missing_shards(store, table, kind, comp, tokens, spans, damaged)
    for start in range(0, tokens, store.shard_tokens):
        stop = min(start + store.shard_tokens, tokens)
        parts = {c.name: _read_block(arrays[c.name], c, start, stop, table, spans, kind, damaged) for c in comps}
        checksums.feed(spans, crcs, kind, comps, parts, start, stop)
        advance(stop - start)
    out = list(damaged.values())
    for i, crc in enumerate(crcs):
        if i not in damaged and crc[kind] != table.checksum(i, kind):
            bad = [name for name in crc[kind] if crc[kind][name] != table.checksum(i, kind).get(name)]
            out.append(_problem(table, i, kind, ",".join(bad), "checksum mismatch", "checksum"))
    return out


def _mark_missing_shards(store, table, kind, comp, tokens, spans, damaged) -> None:
    """A deleted shard reads back as fill values: name it instead of reporting a checksum mismatch."""
    per_shard = segments.chunk_rows(store, comp)[1]
    rows = comp.rows(0, tokens)[1]
    root = store.loc.path(array_path(table.segment, kind, comp.name)) + "/c/"
    try:
        present = {p[len(root):].split("/", 1)[0] for p in store.loc.fs.find(root)}
    except (OSError, ValueError):
        present = set()
    for shard in range(-(-rows // per_shard)):
        if str(shard) not in present:
            lo, hi = shard * per_shard * comp.stride, min((shard + 1) * per_shard * comp.stride, tokens)
            _mark(table, spans, kind, comp, (lo, hi), f"shard file c/{shard} is missing (tokens [{lo}, {hi}))",
                  damaged, "shard_missing")


def _read_block(arr, comp, start, stop, table, spans, kind, damaged) -> np.ndarray:
    lo, hi = comp.rows(start, stop)
    if arr.shape[0] < hi:
        _mark(table, spans, kind, comp, (arr.shape[0] * comp.stride, stop), f"array ends at row {arr.shape[0]}",
              damaged, "array_short")
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
            _mark(table, spans, kind, comp, tokens, f"chunk at tokens [{tokens[0]}, {tokens[1]}) does not decode "
                  f"({_short(exc)})", damaged, "chunk")
    return out


def _short(exc: BaseException) -> str:
    """zarr's message for a bad chunk, without the raw checksum bytes."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    return "its crc32c does not match" if "checksum" in text.lower() else text[:100].rstrip(".")


def _mark(table, spans, kind, comp, tokens, text, damaged, code) -> None:
    for i, (a, b) in enumerate(spans):
        if a < tokens[1] and b > tokens[0] and i not in damaged:
            damaged[i] = _problem(table, i, kind, comp.name, text, code)


def _duplicates(tables) -> list[dict]:
    """Rows that a later row of the same id and the same content hash shadows: the same passage
    stored twice (encode never writes that; two writers racing did). A later row with other
    content is a replacement written on purpose (`StoreWriter.add` of an id again), not damage.
    The later row is what readers see; the shadowed ones are the problems."""
    latest = {pid: (t, i) for t, table in enumerate(tables) for i, pid in enumerate(table.ids)}
    if len(latest) == sum(len(t) for t in tables):
        return []
    out = []
    for t, table in enumerate(tables):
        for i, pid in enumerate(table.ids):
            lt, li = latest[pid]
            if (lt, li) != (t, i) and tables[lt].content_hash(li) == table.content_hash(i):
                out.append(_problem(table, i, None, None,
                                    f"duplicate id: a later row in segment {tables[lt].segment} shadows it",
                                    "duplicate"))
    return out
