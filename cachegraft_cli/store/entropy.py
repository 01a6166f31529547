"""The transform codec's entropy stage: static per-class models over groups of tokens (constriction ANS).

A group's symbols `(tokens, components)` are coded class by class into one ANS stream of uint32
words: for each class in order, the symbols of its components, token-major. The models are the
calibration's class histograms, so nothing about them is stored per passage. Decoding needs the
group's token count and its words; it reproduces the symbols exactly.
"""

from __future__ import annotations

import numpy as np


class GroupCoder:
    """Codes symbol groups with one calibration's class models."""

    def __init__(self, klass: np.ndarray, probabilities: list[np.ndarray], radius: np.ndarray):
        import constriction

        flat = klass.reshape(-1)
        self.width = len(flat)
        self.members = [np.flatnonzero(flat == c) for c in range(len(probabilities))]
        self.order = np.concatenate(self.members + [np.zeros(0, np.int64)])  # coded components, class by class
        self.radius = [int(r) for r in radius]
        self.models = [constriction.stream.model.Categorical(p, perfect=False) for p in probabilities]
        self._ans = constriction.stream.stack.AnsCoder

    def encode(self, symbols: np.ndarray) -> np.ndarray:
        """uint32 words of `symbols` `(tokens, width)` (int, within the class radii)."""
        flat = symbols.reshape(len(symbols), self.width)
        coder = self._ans()
        for c in reversed(range(len(self.models))):  # a stack: the last pushed is read first
            if len(self.members[c]):
                coder.encode_reverse(np.ascontiguousarray(flat[:, self.members[c]] + self.radius[c],
                                                          dtype=np.int32).reshape(-1), self.models[c])
        return np.asarray(coder.get_compressed(), dtype=np.uint32)

    def decode(self, words: np.ndarray, tokens: int) -> np.ndarray:
        """Symbols `(tokens, width)` int32 (never-coded components zero)."""
        out = np.zeros((tokens, self.width), np.int32)
        if tokens == 0:
            return out
        coder = self._ans(np.ascontiguousarray(words, dtype=np.uint32))
        # class by class into one class-ordered buffer, then one scatter (46 scatters cost more than ANS)
        buf, at = np.empty((tokens, len(self.order)), np.int32), 0
        for c, members in enumerate(self.members):
            if len(members):
                got = coder.decode(self.models[c], tokens * len(members)).reshape(tokens, len(members))
                np.subtract(got, self.radius[c], out=buf[:, at: at + len(members)])
                at += len(members)
        out[:, self.order] = buf
        return out

    def cost_bits(self, symbols: np.ndarray, probabilities: list[np.ndarray]) -> np.ndarray:
        """Ideal bits per token `(tokens,)` under the models (for sizing the code rows)."""
        flat = symbols.reshape(len(symbols), self.width)
        bits = np.zeros(len(flat))
        for c, members in enumerate(self.members):
            if len(members):
                bits += -np.log2(probabilities[c][flat[:, members] + self.radius[c]]).sum(1)
        return bits
