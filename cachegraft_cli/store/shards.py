"""Encode whole Zarr v3 shards directly (the sharding codec's byte layout).

Going through zarr's write path costs about a millisecond per inner chunk;
the writer only ever writes complete, fresh shards, so it builds them here:
each inner chunk (padded to the full chunk shape with the fill value 0) is
compressed and gets its crc32c appended; then comes the index, one
(offset, nbytes) little-endian uint64 pair per inner chunk in C order, empty
chunks as (2**64-1, 2**64-1), followed by the index's own crc32c. Reads go
through zarr, so every test read checks this layout against zarr's decoder.
"""

from __future__ import annotations

import google_crc32c
import numpy as np

EMPTY = np.uint64(2**64 - 1)


def numcodecs_compressor(spec: dict):
    from numcodecs import Blosc, Zstd

    if spec["name"] == "zstd":
        return Zstd(level=spec.get("level", 3))
    if spec["name"] == "blosc":
        shuffle = {"noshuffle": Blosc.NOSHUFFLE, "shuffle": Blosc.SHUFFLE, "bitshuffle": Blosc.BITSHUFFLE}
        return Blosc(cname=spec["cname"], clevel=spec["clevel"], shuffle=shuffle[spec.get("shuffle", "shuffle")])
    return None


def _crc_bytes(payload) -> bytes:
    return np.uint32(google_crc32c.value(payload)).astype("<u4").tobytes()


def encode_shard(rows: np.ndarray, rows_per_chunk: int, chunks_per_shard: int, compressor) -> bytes:
    """One shard from up to `rows_per_chunk * chunks_per_shard` rows (axis 0) of a component, as bytes."""
    return b"".join(shard_pieces(rows, rows_per_chunk, chunks_per_shard, compressor))


def shard_pieces(rows: np.ndarray, rows_per_chunk: int, chunks_per_shard: int, compressor) -> list[bytes]:
    """The shard's bytes as pieces in file order (`Location.write_bytes` writes them without joining).

    One compressor call and one crc32c per inner chunk, over views of `rows` (no copy but
    the zero padding of a short last chunk, and the bytes of an uncompressed chunk)."""
    if rows.dtype.byteorder == ">" or (rows.dtype.byteorder == "=" and not np.little_endian):
        rows = rows.astype(rows.dtype.newbyteorder("<"))
    rows = np.ascontiguousarray(rows)
    pieces, index = [], np.full((chunks_per_shard, 2), EMPTY, dtype="<u8")
    offset = 0
    for j in range(-(-len(rows) // rows_per_chunk)):
        chunk = rows[j * rows_per_chunk: (j + 1) * rows_per_chunk]
        if len(chunk) < rows_per_chunk:
            chunk = np.concatenate([chunk, np.zeros((rows_per_chunk - len(chunk),) + chunk.shape[1:], chunk.dtype)])
        payload = bytes(compressor.encode(chunk)) if compressor is not None else chunk.tobytes()
        pieces += [payload, _crc_bytes(payload)]
        index[j] = (offset, len(payload) + 4)
        offset += len(payload) + 4
    table = index.tobytes()
    return pieces + [table, _crc_bytes(table)]


def shard_key(array_path: str, shard: int, ndim: int) -> str:
    return f"{array_path}/c/{shard}" + "/0" * (ndim - 1)
