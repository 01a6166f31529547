"""A zarr store wrapper that counts what reads fetch (for tests and benchmarks)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from zarr.storage import WrapperStore

_META_NAMES = {"zarr.json", ".zarray", ".zattrs", ".zgroup"}


@dataclass
class ReadStats:
    """Array IO since the last `reset()`. Metadata (`zarr.json`) is counted apart."""

    requests: int = 0
    bytes: int = 0
    meta_requests: int = 0
    meta_bytes: int = 0
    keys: Counter = field(default_factory=Counter)  # requests per array-data key (shard file)

    def record(self, key: str, nbytes: int) -> None:
        if key.rsplit("/", 1)[-1] in _META_NAMES:
            self.meta_requests += 1
            self.meta_bytes += nbytes
            return
        self.requests += 1
        self.bytes += nbytes
        self.keys[key] += 1

    def reset(self) -> None:
        self.requests = self.bytes = self.meta_requests = self.meta_bytes = 0
        self.keys.clear()


class CountingStore(WrapperStore):
    def __init__(self, store, stats: ReadStats | None = None):
        super().__init__(store)
        self.stats = stats if stats is not None else ReadStats()

    def _with_store(self, store):
        return type(self)(store, self.stats)

    async def get(self, key, prototype=None, byte_range=None):
        buf = await self._store.get(key, prototype, byte_range)
        self.stats.record(key, 0 if buf is None else len(buf))
        return buf

    async def get_partial_values(self, prototype, key_ranges):
        key_ranges = list(key_ranges)
        bufs = await self._store.get_partial_values(prototype, key_ranges)
        for (key, _), buf in zip(key_ranges, bufs):
            self.stats.record(key, 0 if buf is None else len(buf))
        return bufs
