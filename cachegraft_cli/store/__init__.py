"""Fused-cache store on Zarr v3: segments, manifest, codecs, lock, lazy reads, verify.

The on-disk format is described in docs/store-format.md.
"""

from cachegraft_cli.store.codecs import CODECS, codec_bytes_per_token, raw_bf16_bytes_per_token
from cachegraft_cli.store.counting import ReadStats
from cachegraft_cli.store.layout import FORMAT_VERSION, IDENTITY_KEYS
from cachegraft_cli.store.rows import PassageRow, content_hash_of
from cachegraft_cli.store.store import CacheStore

__all__ = [
    "CODECS",
    "FORMAT_VERSION",
    "IDENTITY_KEYS",
    "CacheStore",
    "PassageRow",
    "ReadStats",
    "codec_bytes_per_token",
    "content_hash_of",
    "raw_bf16_bytes_per_token",
]
