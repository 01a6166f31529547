"""Cache codecs: token-major float32 caches <-> stored components.

A cache block is float32 `(tokens, layers, 2, kv_heads, head_dim)`. A codec
turns it into named components, each an array whose axis 0 is tokens or groups
of `stride` tokens (`row = token // stride`). Blocks handed to `encode` start
at a token index that is a multiple of every stride, so token groups are
aligned to the segment's token axis (docs/store-format.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cachegraft_cli.errors import UsageError

CODECS = ("bf16", "int8", "int4", "float32")
F16_MAX = float(np.finfo(np.float16).max)


@dataclass(frozen=True)
class Component:
    name: str
    dtype: str
    stride: int  # tokens per row of axis 0
    tail: tuple  # shape after axis 0

    def rows(self, start: int, stop: int) -> tuple[int, int]:
        """Rows holding tokens [start, stop)."""
        return start // self.stride, -(-stop // self.stride)


def _geometry(geometry: dict) -> tuple[int, int, int]:
    return int(geometry["layers"]), int(geometry["kv_heads"]), int(geometry["head_dim"])


# ---- bf16 ----------------------------------------------------------------


def to_bf16_words(x: np.ndarray) -> np.ndarray:
    """float32 -> upper 16 bits, rounding to nearest even (exact bf16 values are kept bit for bit)."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    halves = x.view("<u2") if np.little_endian else x.astype("<f4").view("<u2")
    if not halves[..., 0::2].any():  # already bf16 (the usual case): take the upper words as they are
        return halves[..., 1::2].astype(np.uint16)
    u = x.view(np.uint32)
    words = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a (quiet) NaN instead of letting the carry turn it into inf
        words[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    return words


def from_bf16_words(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---- symmetric quantisation helpers ------------------------------------------


def _scales(maxabs: np.ndarray, qmax: int) -> np.ndarray:
    """float16 scales with scale*qmax >= maxabs (so nothing clips unless beyond float16 range)."""
    want = np.minimum(maxabs.astype(np.float32) / qmax, F16_MAX)
    s = want.astype(np.float16)
    low = s.astype(np.float32) < want
    s[low] = np.nextafter(s[low], np.float16(np.inf))
    return s


def _quantise(x: np.ndarray, scale: np.ndarray, qmax: int) -> np.ndarray:
    s = scale.astype(np.float32)
    q = np.divide(x, s, out=np.zeros_like(x), where=s > 0)
    return np.clip(np.rint(q), -qmax, qmax).astype(np.int8)


def _pack_nibbles(codes: np.ndarray) -> np.ndarray:
    """4-bit codes (0..15) two per byte: channel 2i in the low nibble, 2i+1 in the high."""
    n = codes.astype(np.uint8)
    return n[..., 0::2] | (n[..., 1::2] << 4)


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0x0F
    out[..., 1::2] = b >> 4
    return out


# ---- asymmetric (zero point) quantisation helpers ------------------------------


def _zeros_and_scales(lo: np.ndarray, hi: np.ndarray, levels: int) -> tuple[np.ndarray, np.ndarray]:
    """float16 (zero, scale) with zero <= lo and zero + levels*scale >= hi, so nothing clips
    (unless beyond float16's range): the zero is rounded down, the scale up, and the scale is
    computed from the rounded zero."""
    lo = np.clip(lo.astype(np.float32), -F16_MAX, F16_MAX)
    zero = lo.astype(np.float16)
    high = zero.astype(np.float32) > lo
    zero[high] = np.nextafter(zero[high], np.float16(-np.inf))
    return zero, _scales(np.maximum(hi.astype(np.float32) - zero.astype(np.float32), 0), levels)


def _quantise_asym(x: np.ndarray, zero: np.ndarray, scale: np.ndarray, levels: int) -> np.ndarray:
    s = scale.astype(np.float32)
    q = np.divide(x - zero.astype(np.float32), s, out=np.zeros_like(x), where=s > 0)
    return np.clip(np.rint(q), 0, levels).astype(np.uint8)


# ---- codecs ------------------------------------------------------------------


class Codec:
    name = ""
    STORED_DEFAULTS: dict = {}  # see get_codec(stored=True)

    def __init__(self, geometry: dict, params: dict | None = None):
        self.layers, self.heads, self.head_dim = _geometry(geometry)
        self.params = dict(params or {})

    def components(self) -> list[Component]:
        raise NotImplementedError

    def encode(self, x: np.ndarray) -> dict[str, np.ndarray]:
        raise NotImplementedError

    def decode(self, parts: dict[str, np.ndarray], start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) from component rows `Component.rows(start, stop)`."""
        raise NotImplementedError

    def nominal_bytes_per_token(self) -> float:
        """Uncompressed stored bytes per token (grouped parts amortised over full groups)."""
        return float(sum(np.dtype(c.dtype).itemsize * np.prod(c.tail) / c.stride for c in self.components()))


class Bf16Codec(Codec):
    """Lossless for bf16-representable float32: raw 16-bit words."""

    name = "bf16"

    def components(self) -> list[Component]:
        return [Component("data", "uint16", 1, (self.layers, 2, self.heads, self.head_dim))]

    def encode(self, x):
        return {"data": to_bf16_words(x)}

    def decode(self, parts, start, stop):
        return from_bf16_words(parts["data"])


class Float32Codec(Codec):
    """Lossless float32 words, for float32 models (exactness tests, fp32 pipelines)."""

    name = "float32"

    def components(self) -> list[Component]:
        return [Component("data", "float32", 1, (self.layers, 2, self.heads, self.head_dim))]

    def encode(self, x):
        return {"data": np.ascontiguousarray(x, dtype=np.float32)}

    def decode(self, parts, start, stop):
        return parts["data"].astype(np.float32, copy=False)


class Int8Codec(Codec):
    """Symmetric int8 over head_dim, one float16 scale per (token, layer, K/V, head)."""

    name = "int8"

    def components(self) -> list[Component]:
        lay, h, d = self.layers, self.heads, self.head_dim
        return [Component("data", "int8", 1, (lay, 2, h, d)), Component("scale", "float16", 1, (lay, 2, h))]

    def encode(self, x):
        scale = _scales(np.abs(x).max(axis=-1), 127)
        return {"data": _quantise(x, scale[..., None], 127), "scale": scale}

    def decode(self, parts, start, stop):
        return parts["data"].astype(np.float32) * parts["scale"].astype(np.float32)[..., None]


class Int4Codec(Codec):
    """int4, two codes per byte. Keys: per channel per group of `key_group` tokens
    (KIVI-style: key outliers live in channels). Values: per token per group of
    `value_group` channels.

    `zero_point` (new stores): asymmetric, 16 levels, x = zero + q * scale. Without it
    (stores written before zero points, whose codec_params lack the key): symmetric,
    levels -7..7, x = q * scale. The zero point pays for itself: on real Qwen caches it
    cuts the relative RMS error of keys by ~60% and of values by ~22-27%
    (benchmarks/int4_error_study.py, docs/results.md).
    """

    name = "int4"
    DEFAULTS = {"key_group": 128, "value_group": 64, "zero_point": True}
    STORED_DEFAULTS = {"zero_point": False}

    def __init__(self, geometry, params=None):
        super().__init__(geometry, {**self.DEFAULTS, **(params or {})})
        self.kg = int(self.params["key_group"])
        self.vg = min(int(self.params["value_group"]), self.head_dim)
        self.asym = bool(self.params["zero_point"])
        self.params.update(value_group=self.vg, zero_point=self.asym)
        if self.head_dim % 2 or self.head_dim % self.vg:
            raise UsageError(f"int4 needs an even head_dim divisible by value_group={self.vg}, got {self.head_dim}.")

    def components(self) -> list[Component]:
        lay, h, d = self.layers, self.heads, self.head_dim
        names = ["scale", "zero"] if self.asym else ["scale"]
        return [Component("data", "uint8", 1, (lay, 2, h, d // 2))] + \
            [Component(f"k{n}", "float16", self.kg, (lay, h, d)) for n in names] + \
            [Component(f"v{n}", "float16", 1, (lay, h, d // self.vg)) for n in names]

    def encode(self, x):
        k, v = x[:, :, 0], x[:, :, 1]
        groups = self._key_groups(k)  # (groups, key_group, L, H, D)
        vs = v.reshape(v.shape[:-1] + (-1, self.vg))  # (T, L, H, D / value_group, value_group)
        parts, kq, vq = self._encode_zero_point(k, groups, vs) if self.asym else self._encode_symmetric(k, groups, vs)
        return {"data": _pack_nibbles(np.stack([kq, vq.reshape(v.shape)], axis=2)), **parts}

    def _encode_symmetric(self, k, groups, vs):
        kscale, vscale = _scales(np.abs(groups).max(axis=1), 7), _scales(np.abs(vs).max(axis=-1), 7)
        kq = _quantise(k, self._per_token(kscale, len(k)), 7) + 8  # codes 1..15
        vq = _quantise(vs, vscale[..., None], 7) + 8
        return {"kscale": kscale, "vscale": vscale}, kq, vq

    def _encode_zero_point(self, k, groups, vs):
        kzero, kscale = _zeros_and_scales(groups.min(axis=1), groups.max(axis=1), 15)
        vzero, vscale = _zeros_and_scales(vs.min(axis=-1), vs.max(axis=-1), 15)
        kq = _quantise_asym(k, self._per_token(kzero, len(k)), self._per_token(kscale, len(k)), 15)
        vq = _quantise_asym(vs, vzero[..., None], vscale[..., None], 15)
        return {"kscale": kscale, "kzero": kzero, "vscale": vscale, "vzero": vzero}, kq, vq

    def _key_groups(self, k: np.ndarray) -> np.ndarray:
        """Keys as (groups, key_group, ...); a partial last group is padded with its own last
        token, which changes neither its max |x| nor its min and max."""
        groups = -(-len(k) // self.kg)
        padded = np.concatenate([k, np.repeat(k[-1:], groups * self.kg - len(k), axis=0)])
        return padded.reshape((groups, self.kg) + k.shape[1:])

    def _per_token(self, per_group: np.ndarray, tokens: int) -> np.ndarray:
        return np.repeat(per_group, self.kg, axis=0)[:tokens]

    def decode(self, parts, start, stop):
        q = _unpack_nibbles(parts["data"]).astype(np.float32)
        if not self.asym:
            q -= 8
        rows = np.arange(start, stop) // self.kg - start // self.kg
        q[:, :, 0] *= parts["kscale"][rows].astype(np.float32)
        v = q[:, :, 1].reshape(q.shape[:2] + (self.heads, -1, self.vg)) * parts["vscale"].astype(np.float32)[..., None]
        if self.asym:
            q[:, :, 0] += parts["kzero"][rows].astype(np.float32)
            v += parts["vzero"].astype(np.float32)[..., None]
        q[:, :, 1] = v.reshape(q.shape[:2] + (self.heads, self.head_dim))
        return q


_BY_NAME = {c.name: c for c in (Bf16Codec, Int8Codec, Int4Codec, Float32Codec)}


def get_codec(name: str, geometry: dict, params: dict | None = None, stored: bool = False) -> Codec:
    """A codec; `stored`: `params` come from an existing store's metadata, where a missing
    parameter means the behaviour from before it existed (`STORED_DEFAULTS`), not today's default."""
    if name not in _BY_NAME:
        raise UsageError(f"unknown cache codec {name!r}.", hint=f"Use one of: {', '.join(CODECS)}.")
    cls = _BY_NAME[name]
    if stored:
        params = {**cls.STORED_DEFAULTS, **(params or {})}
    return cls(geometry, params)


def codec_bytes_per_token(codec: str, geometry: dict, params: dict | None = None) -> float:
    """Nominal (uncompressed) stored bytes per token of one cache kind."""
    return get_codec(codec, geometry, params).nominal_bytes_per_token()


def raw_bf16_bytes_per_token(geometry: dict) -> int:
    layers, heads, head_dim = _geometry(geometry)
    return 2 * layers * 2 * heads * head_dim
