"""Drafts copied from the prompt, for greedy answers (prompt-lookup decoding).

Answers from retrieved passages are largely copied from them: a name, a date, a phrase. Once the
last tokens of an answer also occur in the passages, the tokens that follow them there are a
good guess of what comes next. One forward over the last token and such a draft gives the
greedy choice after each of them; the answer keeps the drafts up to the first one greedy
decoding would not have picked, plus that choice, and the cache forgets the rest. On a CPU a
forward of a few tokens costs little more than one (a step reads every weight whatever the
rows), so each accepted draft token is a step saved; a rejected one costs that small extra.

The answer is greedy decoding's: every kept token is the argmax after the tokens before it. The
numbers differ only as a several-token forward's rounding differs from a one-token step's
(`docs/results.md`, "Copied drafts", measures how often that changes an answer).
"""

from __future__ import annotations

from typing import Callable, Sequence

LONGEST_MATCH = 3  # n-grams matched, longest first
MAX_DRAFT_TOKENS = 7  # a step of the last token and 7 drafts is 8 rows: the most the quantised kernels take
# Drafts per step by default: torch's int8 / int4 CPU kernels take rows 4 at a time, so a step of up
# to 4 tokens costs 1.2-1.7x a one-token step and a fifth token about 2-3x (docs/results.md, "Copied
# drafts"); answers from passages are about 5 tokens.
DRAFT_TOKENS = 3


class CopyDrafter:
    """Drafts from one source: the token ids a prompt holds (passages and question), built on
    first use (`source` a callable) so that nothing of it delays the first token."""

    def __init__(self, source: Sequence[int] | Callable[[], Sequence[int]], longest: int = DRAFT_TOKENS):
        self._source = source
        self.longest = longest
        self._ids: list[int] | None = None
        self._after: list[dict[tuple, int]] = []

    def _index(self) -> None:
        """For each n-gram of 1..LONGEST_MATCH tokens, where its last occurrence ends."""
        source = self._source
        self._ids = ids = list(source() if callable(source) else source)
        self._after = [{} for _ in range(LONGEST_MATCH + 1)]
        for n in range(1, LONGEST_MATCH + 1):
            table = self._after[n]
            for end in range(n, len(ids)):  # an n-gram at the very end has nothing after it
                table[tuple(ids[end - n: end])] = end

    def draft(self, answer: Sequence[int], room: int) -> list[int]:
        """Up to `min(room, longest)` tokens that followed the answer's last tokens in the source
        (the longest match of up to LONGEST_MATCH tokens, its last occurrence), or none."""
        room = min(room, self.longest)
        if room <= 0 or not answer:
            return []
        if self._ids is None:
            self._index()
        assert self._ids is not None
        for n in range(min(LONGEST_MATCH, len(answer)), 0, -1):
            end = self._after[n].get(tuple(answer[-n:]))
            if end is not None:
                return self._ids[end: end + room]
        return []
