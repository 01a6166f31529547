"""Per-passage crc32 over the encoded component rows a passage spans.

A passage at tokens [a, b) owns, in each component of stride s, the rows
[a // s, ceil(b / s)); its checksum for that component is zlib's crc32 of those
rows' little-endian C-order bytes. Rows arrive block by block (the writer's
flushes, the verifier's shard reads), so the crc runs incrementally.
"""

from __future__ import annotations

import bisect
import zlib

import numpy as np

from cachegraft_cli.store.codecs import Component


def empty(kinds: list[str], components: list[Component]) -> dict:
    return {kind: {c.name: 0 for c in components} for kind in kinds}


def _le_bytes(rows: np.ndarray) -> memoryview:
    if rows.dtype.byteorder == ">" or (rows.dtype.byteorder == "=" and np.little_endian is False):
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    return np.ascontiguousarray(rows).data.cast("B")


def feed(spans: list[tuple[int, int]], crcs: list[dict], kind: str, components: list[Component],
         parts: dict[str, np.ndarray], start: int, stop: int) -> None:
    """Fold block tokens [start, stop) of `kind` into the crcs of overlapping spans (sorted by start)."""
    first = max(bisect.bisect_right(spans, (start, float("inf"))) - 1, 0)
    for i in range(first, len(spans)):
        a, b = spans[i]
        if a >= stop:
            break
        if b <= start:
            continue
        for comp in components:
            block_lo, block_hi = comp.rows(start, stop)
            lo, hi = comp.rows(a, b)
            lo, hi = max(lo, block_lo), min(hi, block_hi)
            if hi > lo:
                rows = parts[comp.name][lo - block_lo: hi - block_lo]
                crcs[i][kind][comp.name] = zlib.crc32(_le_bytes(rows), crcs[i][kind][comp.name])


def of_parts(parts: dict[str, np.ndarray], components: list[Component]) -> dict[str, int]:
    """Checksums of one passage's complete component rows (as `read` gets them)."""
    return {c.name: zlib.crc32(_le_bytes(parts[c.name])) for c in components}
