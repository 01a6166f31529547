"""Names of everything in a store, and the zarr arrays' chunking and codecs.

    <store>/zarr.json                      root group; attributes["cachegraft"] = store meta
    <store>/manifest.json                  committed segments, replaced atomically
    <store>/writer.lock                    single-writer lock
    <store>/prefix/                        float32 array: the shared-prefix cache
    <store>/segments/<name>/<kind>/<part>  sharded arrays of one segment
    <store>/segments/<name>/rows.bin       passage index (numpy columns; rows.json in format 1)
    <store>/segments/<name>/content.json   title, text, metadata (columns)
    <store>/segments/<name>/commit.json    written last: the segment is complete
"""

from __future__ import annotations

import datetime as _dt
import os
import socket
import uuid

# 2: binary row tables (rows.bin); format 1 stores (rows.json) are still read and appended to.
# 3: a store-level codec file (the transform codec's calibration under codec/); other stores stay 2
# 4: the transform codec's packed deflate frames (entropy "deflate"); its zstd and ANS stores stay 3.
#    Each store is written at the lowest version that holds it, so older builds read what they can.
FORMAT_VERSION = 4
ROOT_META = "zarr.json"
MANIFEST = "manifest.json"
LOCK = "writer.lock"
PREFIX = "prefix"
SEGMENTS = "segments"
ROWS = "rows.json"
ROWS_BIN = "rows.bin"
CONTENT = "content.json"
COMMIT = "commit.json"

DEFAULT_CHUNK_TOKENS = 16
SHARD_TARGET_BYTES = 64 * 2**20  # raw bf16 bytes per shard, before compression
MAX_SHARD_TOKENS = 16384
DEFAULT_COMPRESSOR = {"name": "blosc", "cname": "zstd", "clevel": 1, "shuffle": "shuffle"}
# `encode --compressor`: zstd is the entropy stage (10-20% off quantised codes, 19% off bf16 words);
# none writes the encoded bytes as they are, for a writer that must keep up with a GPU
COMPRESSORS: dict[str, dict] = {"zstd": DEFAULT_COMPRESSOR, "none": {"name": "none"}}


def compressor_name(spec: dict) -> str:
    """The `--compressor` name of a store's compressor spec ("custom" for one set through the API)."""
    return next((name for name, known in COMPRESSORS.items() if known == spec), "custom")

IDENTITY_KEYS = (
    "receiver",
    "sharer",
    "fuser",
    "template",
    "prefix_token_ids",
    "position_scheme",
    "dtype",
    "codec",
    "geometry",
)


def segment_dir(name: str) -> str:
    return f"{SEGMENTS}/{name}"


def segment_file(name: str, file: str) -> str:
    return f"{SEGMENTS}/{name}/{file}"


def array_path(segment: str, kind: str, part: str) -> str:
    return f"{SEGMENTS}/{segment}/{kind}/{part}"


def new_segment_name() -> str:
    """Sortable by creation time and unique across machines."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%S")
    return f"{stamp}-{socket.gethostname()[:16]}-{os.getpid()}-{uuid.uuid4().hex[:6]}".replace("/", "_")


def now_iso(precise: bool = False) -> str:
    """UTC now; `precise` to the microsecond (commit records: their order is rebuilt from it)."""
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="microseconds" if precise else "seconds")


def default_shard_tokens(raw_bytes_per_token: int, chunk_tokens: int) -> int:
    """Largest power of two under the byte target, a multiple of the chunk."""
    tokens = 64
    while tokens * 2 * raw_bytes_per_token <= SHARD_TARGET_BYTES and tokens * 2 <= MAX_SHARD_TOKENS:
        tokens *= 2
    return max(tokens, chunk_tokens * 4)


def zarr_compressors(spec: dict, dtype: str) -> list:
    """Inner-chunk codecs after `bytes`; crc32c last, so a damaged chunk fails to decode."""
    import numpy as np
    from zarr.codecs import BloscCodec, Crc32cCodec, ZstdCodec

    if spec["name"] == "zstd":
        return [ZstdCodec(level=spec.get("level", 3)), Crc32cCodec()]
    if spec["name"] == "blosc":
        size = np.dtype(dtype).itemsize
        return [
            BloscCodec(
                cname=spec["cname"], clevel=spec["clevel"], shuffle=spec.get("shuffle", "shuffle"), typesize=size
            ),
            Crc32cCodec(),
        ]
    if spec["name"] == "none":
        return [Crc32cCodec()]
    raise ValueError(f"unknown compressor {spec!r}")


def is_temp(name: str) -> bool:
    """A file left by a write that did not finish: ours (`*.tmp-*`) or zarr's (`*.partial`)."""
    return ".tmp-" in name or name.endswith(".partial")


def rows_file(format_version: int) -> str:
    """The row-table file of a store's segments: format 1 wrote JSON, later formats numpy."""
    return ROWS if format_version < 2 else ROWS_BIN


LISTED_BY = "driver"  # `run_info.listed_by` of a worker's segment: complete, but committed only once listed


def token_extent(entry: dict) -> int:
    """Length of a segment's token axis: its tokens, plus alignment gaps in a merged segment."""
    return int(entry.get("token_extent", entry["tokens"]))
