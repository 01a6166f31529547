"""The mismatched-sharer control (`encode --mismatched-sharer`): each passage keeps the
receiver's own KV, but the sharer reads another passage of the corpus, its *donor*, and the
fuser fuses the two. Graft minus this control is what pairing the sharer's cache with the
passage it was computed from adds (the pairing gain); a zeroed sharer input (the adapter)
is out of distribution for a sharer-fed fuser, a real sharer cache of other text is not.

How a donor is chosen (deterministic, recorded per row as `metadata["sharer_donor"]`):
- the passages of one encode run are ordered by token count, ties by the sha256 of their
  ids (so the order does not depend on the corpus order);
- a passage's donor is the nearest passage in that order with *another title* (a passage
  of another article), looking at the next longer one first, then alternately further out;
  where every other passage shares its title, the nearest one at all;
- the donor's tokens are cut to the passage's token count, or, for a donor that is shorter
  (the longest passages), repeated from its start until they reach it. The fuser then pairs
  receiver token i with the sharer's KV of donor token i, at the same positions.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

from cachegraft_cli.errors import UsageError

SCAN = 1000  # how far the search for a donor with another title looks before taking the nearest passage
RULE = "nearest-length-other-title"


def donor_identity(mismatched: bool) -> dict | None:
    """The store identity's `fuser` entries of a mismatched-sharer store (None otherwise)."""
    return {"sharer_input": "mismatched", "donor_rule": RULE} if mismatched else None


def donor_order(ids: Sequence[str], lengths: Sequence[int]) -> list[int]:
    """Passage indices by token count, ties by the sha256 of the id."""
    return sorted(range(len(ids)), key=lambda i: (lengths[i], hashlib.sha256(ids[i].encode()).hexdigest()))


def check_count(n: int) -> None:
    """A run of fewer than two new passages has no donor to give (0: nothing to encode)."""
    if n == 1:
        raise UsageError("The mismatched-sharer control needs at least two passages in one encode run "
                         "(it has 1): each passage's sharer input comes from another one.",
                         "Encode the whole corpus in one run, or append at least two passages at a time.")


def pick_donors(ids: Sequence[str], titles: Sequence[str], lengths: Sequence[int]) -> list[int]:
    """For each passage, the index of its donor (never itself)."""
    check_count(len(ids))
    order = donor_order(ids, lengths)
    donors = [0] * len(ids)
    for place, i in enumerate(order):
        donors[i] = order[_donor_place(order, place, titles)]
    return donors


def _donor_place(order: list[int], place: int, titles: Sequence[str]) -> int:
    nearest = place + 1 if place + 1 < len(order) else place - 1
    for step in range(1, min(SCAN, len(order))):
        for other in (place + step, place - step):
            if 0 <= other < len(order) and titles[order[other]] != titles[order[place]]:
                return other
    return nearest


def donor_tokens(donor: Sequence[int], length: int) -> list[int]:
    """The donor's token ids fitted to `length`: cut, or repeated from the start."""
    if not donor:
        raise ValueError("a donor passage has no tokens")
    repeats = -(-length // len(donor))
    return (list(donor) * repeats)[:length]
