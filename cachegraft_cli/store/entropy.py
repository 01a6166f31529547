"""The transform codec's entropy stage: a group of tokens' symbols as uint32 words, and back exactly.

Two coders, chosen per store (the tc codec's `entropy` parameter, docs/store-format.md):

- `BandCoder` ("deflate", new stores; "zstd", stores of 2026-12-04 to 2026-12-06): the coded
  components, in class order, cut into bands of similar spread; each band's symbols
  component-major in one frame, so each band gets its own Huffman table. "deflate" frames pack
  small symbols several to a byte and Huffman-code the bytes (raw deflate, RFC 1951; any inflate
  reads them); "zstd" frames hold one symbol per byte (int16 as a low-byte plane then a high-byte
  plane) and need zstd's slow optimal parser to come near (docs/results.md, "Store size").
- `GroupCoder` ("ans", the first tc stores): one ANS stream (constriction) with static per-class
  models from the calibration's histograms: for each class in order, the symbols of its
  components, token-major.
"""

from __future__ import annotations

import functools

import numpy as np


class GroupCoder:
    """Codes symbol groups with one calibration's class models."""

    def __init__(self, klass: np.ndarray, probabilities: list[np.ndarray], radius: np.ndarray):
        import constriction

        flat = klass.reshape(-1)
        self.width = len(flat)
        self.members = [np.flatnonzero(flat == c) for c in range(len(probabilities))]
        self.order = np.concatenate(self.members + [np.zeros(0, np.int64)])  # coded components, class by class
        self.starts = np.cumsum([0] + [len(m) for m in self.members])  # each class's first row in `order`
        self.radius = [int(r) for r in radius]
        self.models = [constriction.stream.model.Categorical(p, perfect=False) for p in probabilities]
        self._ans = constriction.stream.stack.AnsCoder

    def encode(self, symbols: np.ndarray) -> np.ndarray:
        """uint32 words of `symbols` `(tokens, width)` (int, within the class radii)."""
        return self.encode_ordered(symbols.reshape(len(symbols), self.width)[:, self.order].T)

    def encode_ordered(self, ordered: np.ndarray) -> np.ndarray:
        """uint32 words of the coded components' symbols in class order, component-major
        `(len(order), tokens)` (as `decode_ordered` gives them back)."""
        coder, starts = self._ans(), self.starts
        for c in reversed(range(len(self.models))):  # a stack: the last pushed is read first
            if len(self.members[c]):
                rows = ordered[starts[c]: starts[c + 1]].T  # token-major within the class
                coder.encode_reverse(np.ascontiguousarray(rows + self.radius[c], dtype=np.int32).reshape(-1),
                                     self.models[c])
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
    """Codes symbol groups band by band, each band one frame. A group's words: one uint32 per band
    (its frame's length in bytes), then the frames back to back, zero-padded to whole words."""

    MIN_BAND = 128  # coded components per band at least: each frame carries its own table
    FRAMES = ("deflate", "zstd")

    def __init__(self, klass: np.ndarray, radius: np.ndarray, frame: str = "deflate", level: int = 15):
        if frame not in self.FRAMES:
            raise ValueError(f"unknown band frame {frame!r}")
        flat = klass.reshape(-1).astype(np.int64)
        self.width = len(flat)
        self.bands = bands(flat, radius, self.MIN_BAND)
        self.order = np.concatenate(self.bands + [np.zeros(0, np.int64)])  # class order, as GroupCoder's
        self.wide = [bool(radius[np.unique(flat[b])].max(initial=0) > 127) for b in self.bands]
        self.frame, self.level = frame, int(level)

    def encode(self, symbols: np.ndarray) -> np.ndarray:
        """uint32 words of `symbols` `(tokens, width)` (int, within the class radii)."""
        return self.encode_ordered(symbols.reshape(len(symbols), self.width)[:, self.order].T)

    def encode_ordered(self, ordered: np.ndarray) -> np.ndarray:
        """uint32 words of the coded components' symbols band after band (class order),
        component-major `(len(order), tokens)` (as `decode_ordered` gives them back)."""
        pack, ends = self._packer(), np.cumsum([len(b) for b in self.bands])
        frames = [pack(ordered[end - len(b): end], wide) for b, wide, end in zip(self.bands, self.wide, ends)]
        body = b"".join(frames)
        body += bytes(-len(body) % 4)
        return np.concatenate([np.array([len(f) for f in frames], np.uint32), np.frombuffer(body, "<u4")])

    def _packer(self):
        """(symbols `(components, tokens)`, wide) -> one band's frame."""
        if self.frame == "deflate":
            return deflate_frame
        import zstandard

        zstd = zstandard.ZstdCompressor(level=self.level)
        return lambda x, wide: zstd.compress(planes(x, wide))

    def _unpacker(self):
        """(frame, wide, out `(components, tokens)`) -> the band's symbols written into `out`."""
        if self.frame == "deflate":
            return inflate_frame
        import zstandard

        zstd = zstandard.ZstdDecompressor()

        def unpack(frame: bytes, wide: bool, out: np.ndarray) -> None:
            rows, cols = out.shape
            size = rows * cols * (2 if wide else 1)
            out[:] = unplanes(sized(zstd.decompress(frame, max_output_size=size), size), wide, rows, cols)

        return unpack

    def decode(self, words: np.ndarray, tokens: int) -> np.ndarray:
        """Symbols `(tokens, width)` int32 (never-coded components zero)."""
        return scatter(self.order, self.width, self.decode_ordered(words, tokens))

    def decode_ordered(self, words: np.ndarray, tokens: int, out: np.ndarray | None = None) -> np.ndarray:
        """The coded components' symbols band after band (class order), component-major
        `(len(order), tokens)` as the frames hold them, into `out` when given."""
        out = np.empty((len(self.order), tokens), np.int32) if out is None else out
        if tokens == 0:
            return out
        words = np.ascontiguousarray(words, "<u4")
        lengths, body = words[: len(self.bands)].astype(np.int64), words[len(self.bands):].tobytes()
        at, row, unpack = 0, 0, self._unpacker()
        for b, wide, n in zip(self.bands, self.wide, lengths.tolist()):
            unpack(body[at: at + n], wide, out[row: row + len(b)])
            at, row = at + n, row + len(b)
        return out


# Symbols packed several to a byte, by the band's largest magnitude r in the group: 5 for r = 1
# (3^5 = 243 values), 3 for r = 2 (125), 2 up to r = 7 (225), else one. Huffman codes spend at
# least a bit per byte, and most symbols are 0: packing lets one code cover 2-5 of them
# (6% fewer bytes than one symbol per byte; docs/results.md, "Store size").
PACK = {1: 5, 2: 3, 3: 2, 4: 2, 5: 2, 6: 2, 7: 2}


def deflate_frame(x: np.ndarray, wide: bool) -> bytes:
    """One band's symbols `(components, tokens)` as a "deflate" frame: int16 bands their two
    planes deflated; int8 bands one byte r = max |symbol|, then (unless r = 0) the packed
    symbols deflated."""
    if wide:
        return deflate(planes(x, True))
    r = max(int(x.max(initial=0)), -int(x.min(initial=0)))
    if r == 0:
        return b"\0"
    base, per = 2 * r + 1, PACK.get(r, 1)
    digits = (x + r).astype(np.uint8).reshape(-1)  # 0..2r, at most 254
    whole = len(digits) // per * per
    packed = digits[:whole: per].copy()
    for j in range(1, per):  # in uint8: every partial sum is below base**per <= 243
        packed *= np.uint8(base)
        packed += digits[j: whole: per]
    return bytes([r]) + deflate(packed.tobytes() + digits[whole:].tobytes())


def inflate_frame(frame: bytes, wide: bool, out: np.ndarray) -> None:
    """A "deflate" frame's symbols into `out` `(components, tokens)` int32: the inverse of
    `deflate_frame`."""
    rows, cols = out.shape
    count = rows * cols
    if wide:
        out[:] = unplanes(sized(inflate(frame, 2 * count), 2 * count), True, rows, cols)
        return
    if not frame:
        raise ValueError("an empty band frame")
    r = frame[0]
    if r == 0:
        out[:] = 0
        return
    if r > 127:
        raise ValueError(f"a band frame's symbols reach {r}, beyond int8")
    base, per = 2 * r + 1, PACK.get(r, 1)
    whole = count // per
    size = whole + count - whole * per
    raw = sized(inflate(frame[1:], size), size)
    if raw[:whole].max(initial=0) >= base**per or raw[whole:].max(initial=0) >= base:
        raise ValueError("a band frame holds symbols beyond its range")
    flat = out.reshape(-1) if out.flags.c_contiguous else np.empty(count, np.int32)  # a view when it can be
    np.take(unpacking(r), raw[:whole], axis=0, out=flat[: whole * per].reshape(whole, per))
    flat[whole * per:] = raw[whole:].astype(np.int32) - r
    if not out.flags.c_contiguous:
        out[:] = flat.reshape(rows, cols)


@functools.lru_cache(maxsize=None)
def unpacking(r: int) -> np.ndarray:
    """(256, per) int32: each packed byte's symbols for largest magnitude `r` (a table lookup
    unpacks a frame in one pass)."""
    base, per = 2 * r + 1, PACK.get(r, 1)
    byte = np.arange(256)
    return np.stack([byte // base ** (per - 1 - j) % base for j in range(per)], axis=1).astype(np.int32) - r


def sized(data: bytes, size: int) -> np.ndarray:
    """`data` as uint8, which must be `size` bytes long."""
    if len(data) != size:
        raise ValueError(f"a band frame holds {len(data)} bytes, not {size}")
    return np.frombuffer(data, np.uint8)


def deflate(data: bytes) -> bytes:
    """A raw deflate stream (RFC 1951, no zlib header) of `data`, Huffman codes only: the packed
    symbols have no repeats worth an LZ match (runs of zero are packed already)."""
    import zlib

    packer = zlib.compressobj(9, zlib.DEFLATED, -15, 9, zlib.Z_HUFFMAN_ONLY)
    return packer.compress(data) + packer.flush()


def inflate(frame: bytes, size: int) -> bytes:
    """At most `size` bytes out of a raw deflate stream."""
    import zlib

    return zlib.decompressobj(-15).decompress(frame, size)


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
