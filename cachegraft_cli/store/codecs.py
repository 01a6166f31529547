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


def _pack_nibbles(q: np.ndarray) -> np.ndarray:
    n = (q + 8).astype(np.uint8)  # [-7, 7] -> [1, 15]
    return n[..., 0::2] | (n[..., 1::2] << 4)


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.int8)
    out[..., 0::2] = (b & 0x0F).astype(np.int8) - 8
    out[..., 1::2] = (b >> 4).astype(np.int8) - 8
    return out


# ---- codecs ------------------------------------------------------------------


class Codec:
    name = ""

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
    """Symmetric int4 (levels -7..7), two per byte.

    Keys: one scale per channel per group of `key_group` tokens (KIVI-style
    per-channel). Values: one scale per token per group of `value_group`
    channels.
    """

    name = "int4"
    DEFAULTS = {"key_group": 32, "value_group": 64}

    def __init__(self, geometry, params=None):
        super().__init__(geometry, {**self.DEFAULTS, **(params or {})})
        self.kg = int(self.params["key_group"])
        self.vg = min(int(self.params["value_group"]), self.head_dim)
        self.params["value_group"] = self.vg
        if self.head_dim % 2 or self.head_dim % self.vg:
            raise UsageError(f"int4 needs an even head_dim divisible by value_group={self.vg}, got {self.head_dim}.")

    def components(self) -> list[Component]:
        lay, h, d = self.layers, self.heads, self.head_dim
        return [
            Component("data", "uint8", 1, (lay, 2, h, d // 2)),
            Component("kscale", "float16", self.kg, (lay, h, d)),
            Component("vscale", "float16", 1, (lay, h, d // self.vg)),
        ]

    def encode(self, x):
        k, v = x[:, :, 0], x[:, :, 1]
        kscale = self._key_scales(k)
        kq = _quantise(k, np.repeat(kscale, self.kg, axis=0)[: len(k)], 7)
        vs = v.reshape(v.shape[:-1] + (-1, self.vg))
        vscale = _scales(np.abs(vs).max(axis=-1), 7)
        vq = _quantise(vs, vscale[..., None], 7).reshape(v.shape)
        return {"data": _pack_nibbles(np.stack([kq, vq], axis=2)), "kscale": kscale, "vscale": vscale}

    def _key_scales(self, k: np.ndarray) -> np.ndarray:
        groups = -(-len(k) // self.kg)
        padded = np.zeros((groups * self.kg,) + k.shape[1:], dtype=np.float32)
        padded[: len(k)] = np.abs(k)
        return _scales(padded.reshape((groups, self.kg) + k.shape[1:]).max(axis=1), 7)

    def decode(self, parts, start, stop):
        q = _unpack_nibbles(parts["data"]).astype(np.float32)
        rows = np.arange(start, stop) // self.kg - start // self.kg
        q[:, :, 0] *= parts["kscale"][rows].astype(np.float32)
        v = q[:, :, 1].reshape(q.shape[:2] + (self.heads, -1, self.vg)) * parts["vscale"].astype(np.float32)[..., None]
        q[:, :, 1] = v.reshape(q.shape[:2] + (self.heads, self.head_dim))
        return q


_BY_NAME = {c.name: c for c in (Bf16Codec, Int8Codec, Int4Codec, Float32Codec)}


def get_codec(name: str, geometry: dict, params: dict | None = None) -> Codec:
    if name not in _BY_NAME:
        raise UsageError(f"unknown cache codec {name!r}.", hint=f"Use one of: {', '.join(CODECS)}.")
    return _BY_NAME[name](geometry, params)


def codec_bytes_per_token(codec: str, geometry: dict, params: dict | None = None) -> float:
    """Nominal (uncompressed) stored bytes per token of one cache kind."""
    return get_codec(codec, geometry, params).nominal_bytes_per_token()


def raw_bf16_bytes_per_token(geometry: dict) -> int:
    layers, heads, head_dim = _geometry(geometry)
    return 2 * layers * 2 * heads * head_dim
