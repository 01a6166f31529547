"""Which planned chunks are in which finished segment, and what may be listed next.

Workers report each segment they finished with the plan positions (`seqs`) of
its rows. The ledger accepts a report only if none of its positions is taken
already, so a task that ran twice (a retry after the first attempt did finish,
a lost result recomputed) never lists a passage twice: the second segment stays
unlisted and is garbage. Segments are released for listing in plan order, and
only once every position before them is covered, so the manifest order is the
plan's whatever order the workers finish in.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field


@dataclass
class SegmentReport:
    seqs: list[int]
    entry: dict

    @property
    def first(self) -> int:
        return self.seqs[0]


@dataclass
class SegmentLedger:
    planned: int
    duplicates: int = 0
    _covered: bytearray = field(init=False)
    _next: int = field(init=False, default=0)  # the first plan position not covered yet
    _waiting: list[tuple[int, int, SegmentReport]] = field(init=False, default_factory=list)

    def __post_init__(self):
        self._covered = bytearray(self.planned)

    def accept(self, report: SegmentReport) -> bool:
        """Record a finished segment; False (and nothing recorded) if any of its rows is covered already."""
        seqs = sorted(report.seqs)
        if not seqs or seqs[0] < 0 or seqs[-1] >= self.planned or len(set(seqs)) != len(seqs):
            raise ValueError(f"segment {report.entry.get('name')} reports plan positions outside the plan")
        if any(self._covered[s] for s in seqs):
            self.duplicates += 1
            return False
        for s in seqs:
            self._covered[s] = 1
        report.seqs = seqs
        bisect.insort(self._waiting, (seqs[0], seqs[-1], report), key=lambda w: w[0])
        while self._next < self.planned and self._covered[self._next]:
            self._next += 1
        return True

    def ready(self) -> list[SegmentReport]:
        """Accepted segments that may be listed now, in plan order (removed from the ledger)."""
        n = 0
        while n < len(self._waiting) and self._waiting[n][1] < self._next:
            n += 1
        out = [w[2] for w in self._waiting[:n]]
        del self._waiting[:n]
        return out

    @property
    def complete(self) -> bool:
        return self._next >= self.planned

    @property
    def missing(self) -> int:
        return self.planned - sum(self._covered)
