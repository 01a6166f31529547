"""The transform codec's entropy stage: a group of tokens' symbols as uint32 words, and back exactly.

Two coders, chosen per store (the tc codec's `entropy` parameter, docs/store-format.md):

- `BandCoder` ("zstd", new stores): the coded components, in class order, cut into bands of
  similar spread; each band's symbols component-major (int8, or int16 as a low-byte plane then a
  high-byte plane) in one zstd frame (the `zstandard` library). zstd fits a Huffman table to each
  frame, so each band gets its own model; decoding costs about 10 us per token against ANS's 100+
  (it is most of a cache's load time) for 3% more bytes (docs/results.md, "Store size").
- `GroupCoder` ("ans", the first tc stores): one ANS stream (constriction) with static per-class
  models from the calibration's histograms: for each class in order, the symbols of its
  components, token-major.
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
        return scatter(self.order, self.width, self.decode_ordered(words, tokens))

    def decode_ordered(self, words: np.ndarray, tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        """The coded components' symbols in class order, component-major `(len(order), tokens)`,
        into `out` when given."""
        out = np.empty((len(self.order), tokens), np.int32) if out is None else out
        if tokens == 0:
            return out
        coder = self._ans(np.ascontiguousarray(words, dtype=np.uint32))
        at = 0
        for c, members in enumerate(self.members):
            if len(members):
                got = coder.decode(self.models[c], tokens * len(members)).reshape(tokens, len(members))
                out[at: at + len(members)] = got.T - self.radius[c]
                at += len(members)
        return out

    def cost_bits(self, symbols: np.ndarray, probabilities: list[np.ndarray]) -> np.ndarray:
        """Ideal bits per token `(tokens,)` under the models (for sizing the code rows)."""
        flat = symbols.reshape(len(symbols), self.width)
        bits = np.zeros(len(flat))
        for c, members in enumerate(self.members):
            if len(members):
                bits += -np.log2(probabilities[c][flat[:, members] + self.radius[c]]).sum(1)
        return bits


class BandCoder:
    """Codes symbol groups band by band with zstd. A group's words: one uint32 per band (its
    frame's length in bytes), then the frames back to back, zero-padded to whole words."""

    MIN_BAND = 128  # coded components per band at least: each frame carries its own table

    def __init__(self, klass: np.ndarray, radius: np.ndarray, level: int):
        flat = klass.reshape(-1).astype(np.int64)
        self.width = len(flat)
        self.bands = bands(flat, radius, self.MIN_BAND)
        self.order = np.concatenate(self.bands + [np.zeros(0, np.int64)])  # class order, as GroupCoder's
        self.wide = [bool(radius[np.unique(flat[b])].max(initial=0) > 127) for b in self.bands]
        self.level = int(level)

    def encode(self, symbols: np.ndarray) -> np.ndarray:
        """uint32 words of `symbols` `(tokens, width)` (int, within the class radii)."""
        import zstandard

        flat, zstd = symbols.reshape(len(symbols), self.width), zstandard.ZstdCompressor(level=self.level)
        frames = [zstd.compress(planes(flat[:, b].T, wide)) for b, wide in zip(self.bands, self.wide)]
        body = b"".join(frames)
        body += bytes(-len(body) % 4)
        return np.concatenate([np.array([len(f) for f in frames], np.uint32), np.frombuffer(body, "<u4")])

    def decode(self, words: np.ndarray, tokens: int) -> np.ndarray:
        """Symbols `(tokens, width)` int32 (never-coded components zero)."""
        return scatter(self.order, self.width, self.decode_ordered(words, tokens))

    def decode_ordered(self, words: np.ndarray, tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        """The coded components' symbols band after band (class order), component-major
        `(len(order), tokens)` as the frames hold them, into `out` when given."""
        import zstandard

        out = np.empty((len(self.order), tokens), np.int32) if out is None else out
        if tokens == 0:
            return out
        words = np.ascontiguousarray(words, "<u4")
        lengths, body = words[: len(self.bands)].astype(np.int64), words[len(self.bands):].tobytes()
        at, row, zstd = 0, 0, zstandard.ZstdDecompressor()
        for b, wide, n in zip(self.bands, self.wide, lengths.tolist()):
            size = len(b) * tokens * (2 if wide else 1)
            raw = np.frombuffer(zstd.decompress(body[at: at + n], max_output_size=size), np.uint8)
            out[row: row + len(b)] = unplanes(raw, wide, len(b), tokens)
            at, row = at + n, row + len(b)
        return out


def scatter(order: np.ndarray, width: int, ordered: np.ndarray) -> np.ndarray:
    """Class-ordered component-major symbols as `(tokens, width)` int32, never-coded ones zero."""
    out = np.zeros((ordered.shape[1], width), np.int32)
    out[:, order] = ordered.T
    return out


def bands(klass: np.ndarray, radius: np.ndarray, least: int) -> list[np.ndarray]:
    """The coded components (klass >= 0) cut into bands of whole classes, in class order: a band
    closes once it holds `least` components, and where the symbols change width (a class radius
    over 127 needs int16); a short last band joins the one before when their widths agree."""
    out: list[list[np.ndarray]] = []
    size, wide = 0, list[bool]()
    for c in range(int(klass.max(initial=-1)) + 1):
        members = np.flatnonzero(klass == c)
        if not len(members):
            continue
        w = bool(radius[c] > 127)
        if not out or size >= least or w != wide[-1]:
            out.append([])
            wide.append(w)
            size = 0
        out[-1].append(members)
        size += len(members)
    if len(out) > 1 and size < least and wide[-1] == wide[-2]:
        last = out.pop()
        out[-1] += last
    return [np.concatenate(b) for b in out]


def planes(x: np.ndarray, wide: bool) -> bytes:
    """Symbols as bytes: int8, or int16 as all low bytes then all high bytes (a plane each
    entropy-codes better than interleaved pairs)."""
    if not wide:
        return np.ascontiguousarray(x, np.int8).tobytes()
    pairs = np.ascontiguousarray(x, "<i2").view(np.uint8).reshape(-1, 2)
    return np.ascontiguousarray(pairs.T).tobytes()


def unplanes(raw: np.ndarray, wide: bool, rows: int, cols: int) -> np.ndarray:
    if not wide:
        return raw.view(np.int8).reshape(rows, cols)
    return np.ascontiguousarray(raw.reshape(2, -1).T).view("<i2").reshape(rows, cols)
