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

from cachegraft_cli.errors import StoreError, UsageError

DEFAULT_CODEC = "int8"  # a new store's where the fuser ships no tc calibration (encoding.calibration.default_codec)


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


def to_bf16_words(x: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """float32 -> upper 16 bits, rounding to nearest even (exact bf16 values are kept bit for bit);
    written into `out` (uint16, x's shape) when given."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, np.uint16) if out is None else out
    halves = x.view("<u2") if np.little_endian else x.astype("<f4").view("<u2")
    if not halves[..., 0::2].any():  # already bf16 (the usual case): take the upper words as they are
        np.copyto(out, halves[..., 1::2])
        return out
    u = x.view(np.uint32)
    words = ((u + (np.uint32(0x7FFF) + ((u >> 16) & np.uint32(1)))) >> 16).astype(np.uint16)
    nan = np.isnan(x)
    if nan.any():  # keep NaN a (quiet) NaN instead of letting the carry turn it into inf
        words[nan] = ((u[nan] >> 16) | np.uint32(0x40)).astype(np.uint16)
    np.copyto(out, words)
    return out


def from_bf16_words(words: np.ndarray) -> np.ndarray:
    return (words.astype(np.uint32) << np.uint32(16)).view(np.float32)


# ---- decoding helpers (numpy: readers load no torch) ---------------------------


def _unpack_nibbles(b: np.ndarray) -> np.ndarray:
    out = np.empty(b.shape[:-1] + (b.shape[-1] * 2,), dtype=np.uint8)
    out[..., 0::2] = b & 0x0F
    out[..., 1::2] = b >> 4
    return out


def unpack_bits(packed: np.ndarray, bits: int) -> np.ndarray:
    """Inverse of `quantise.pack_bits`: code j of a byte sits at bit bits * j."""
    per, mask = 8 // bits, np.uint8((1 << bits) - 1)
    out = np.empty(packed.shape + (per,), np.uint8)
    for j in range(per):
        out[..., j] = (packed >> np.uint8(bits * j)) & mask
    return out.reshape(packed.shape[:-1] + (-1,))


# ---- codecs ------------------------------------------------------------------


def _torch():
    import torch

    return torch


def as_tensor(x):
    """A cache as a torch tensor where it lives: numpy arrays (float32) wrap without a copy."""
    return x.detach() if hasattr(x, "detach") else _torch().from_numpy(np.asarray(x, dtype=np.float32))


class Codec:
    """Encoding runs in torch on the device that holds the block (`encode_tensor`; the writer
    stages blocks where the caches were fused); decoding runs in numpy on the CPU."""

    name = ""
    STORED_DEFAULTS: dict = {}  # see get_codec(stored=True)

    def __init__(self, geometry: dict, params: dict | None = None):
        self.layers, self.heads, self.head_dim = _geometry(geometry)
        self.params = dict(params or {})

    def stage_dtype(self, x):
        """The torch dtype the writer buffers caches like `x` in until a block is encoded: a bf16 or
        float16 tensor's own (float32 holds it exactly; the quantisers widen the block on its
        device), float32 otherwise."""
        torch = _torch()
        dtype = getattr(x, "dtype", None)
        return dtype if dtype in (torch.bfloat16, torch.float16) else torch.float32

    def stage(self, x, out) -> None:
        """Copy one passage's cache (float32 numpy, or a torch tensor on any device) into the
        writer's block buffer `out` (a torch tensor); `encode_tensor` later takes the block."""
        out.copy_(as_tensor(x))

    def components(self) -> list[Component]:
        raise NotImplementedError

    def format_version(self) -> int:
        """The store format a new store of this codec is written at (store/layout.py): the lowest
        that holds it, so that builds reading only older formats keep reading it."""
        return 2

    def encode_tensor(self, x) -> dict:
        """Component rows of a staged block, as torch tensors on the block's device."""
        raise NotImplementedError

    def encode_staged(self, block, positions: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Component rows of a staged block, encoded on its device and brought to the CPU as numpy.
        `positions`: each token's index in its passage (only codecs that model RoPE use them)."""
        return {name: parts_to_numpy(part) for name, part in self.encode_tensor(block).items()}

    def encode(self, x, positions: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """Component rows of a float32 block (numpy or torch), as numpy arrays (staged as the
        writer stages it, so both give the same bytes); by default one passage from its start."""
        t = as_tensor(x)
        staged = _torch().empty(tuple(t.shape), dtype=self.stage_dtype(t), device=t.device)
        self.stage(x, staged)
        return self.encode_staged(staged, np.arange(len(t)) if positions is None else positions)

    @classmethod
    def check_geometry(cls, geometry: dict) -> None:
        """Refuse a geometry this codec cannot hold (with its default parameters)."""
        cls(geometry)

    def bind(self, loc) -> None:
        """The store this codec reads and writes: codecs with store-level tables load them from it."""

    def install(self, loc) -> None:
        """Write what the codec keeps once per store (before the store's root metadata)."""

    def tables(self) -> dict | None:
        """What the codec keeps once per store (`store info`), or None."""
        return None

    def decode(self, parts: dict[str, np.ndarray], start: int, stop: int) -> np.ndarray:
        """Tokens [start, stop) from component rows `Component.rows(start, stop)`."""
        raise NotImplementedError

    def decode_many(self, reads: list[tuple[dict[str, np.ndarray], int, int]]) -> list[np.ndarray]:
        """`decode` of several (parts, start, stop) at once (a codec may share work between them)."""
        return [self.decode(parts, start, stop) for parts, start, stop in reads]

    def nominal_bytes_per_token(self) -> float:
        """Uncompressed stored bytes per token (grouped parts amortised over full groups)."""
        return float(sum(np.dtype(c.dtype).itemsize * np.prod(c.tail) / c.stride for c in self.components()))


_BLAS = None


def one_blas_thread():
    """A context in which numpy's BLAS runs on one thread: the transform codec's matrices are small,
    and a BLAS pool spinning beside torch's (or another process) costs 5x on 2 cores (measured)."""
    global _BLAS
    if _BLAS is None:
        from threadpoolctl import ThreadpoolController

        _BLAS = ThreadpoolController()
    return _BLAS.limit(limits=1, user_api="blas")


def parts_to_numpy(t) -> np.ndarray:
    """A component tensor on any device as a numpy array on the CPU (int16 words as uint16)."""
    a = t.contiguous().cpu().numpy()
    return a.view(np.uint16) if a.dtype == np.int16 else a


class Bf16Codec(Codec):
    """Lossless for bf16-representable float32: raw 16-bit words."""

    name = "bf16"

    def stage_dtype(self, x):
        return _torch().int16  # the writer buffers the words themselves: half the bytes, no second pass

    def components(self) -> list[Component]:
        return [Component("data", "uint16", 1, (self.layers, 2, self.heads, self.head_dim))]

    def stage(self, x, out):
        torch = _torch()
        if not hasattr(x, "detach"):  # numpy float32: round to nearest even, NaN kept a quiet NaN
            words = to_bf16_words(np.asarray(x, dtype=np.float32)).view(np.int16)
            out.copy_(torch.from_numpy(words))
            return
        t = x.detach()
        if t.dtype != torch.bfloat16:  # torch rounds to nearest even, as to_bf16_words does
            t = t.to(torch.bfloat16)
        out.copy_(t.view(torch.int16))

    def encode_tensor(self, x):
        return {"data": x}

    def decode(self, parts, start, stop):
        return from_bf16_words(parts["data"])


class Float32Codec(Codec):
    """Lossless float32 words, for float32 models (exactness tests, fp32 pipelines)."""

    name = "float32"

    def stage_dtype(self, x):
        return _torch().float32

    def components(self) -> list[Component]:
        return [Component("data", "float32", 1, (self.layers, 2, self.heads, self.head_dim))]

    def encode_tensor(self, x):
        return {"data": x}

    def decode(self, parts, start, stop):
        return parts["data"].astype(np.float32, copy=False)


class Int8Codec(Codec):
    """Symmetric int8 over head_dim, one float16 scale per (token, layer, K/V, head)."""

    name = "int8"

    def components(self) -> list[Component]:
        lay, h, d = self.layers, self.heads, self.head_dim
        return [Component("data", "int8", 1, (lay, 2, h, d)), Component("scale", "float16", 1, (lay, 2, h))]

    def encode_tensor(self, x):
        from cachegraft_cli.store import quantise as qz

        x = x.to(_torch().float32)
        scale = qz.scales(x.abs().amax(dim=-1), 127)
        return {"data": qz.quantise_symmetric(x, scale[..., None], 127), "scale": scale}

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

    def encode_tensor(self, x):
        from cachegraft_cli.store import quantise as qz

        torch = _torch()
        x = x.to(torch.float32)
        k, v = x[:, :, 0], x[:, :, 1]
        data = torch.empty(tuple(x.shape[:-1]) + (self.head_dim // 2,), dtype=torch.uint8, device=x.device)
        if not self.asym:
            return self._encode_symmetric(k, v, data)
        kq, kzero, kscale = qz.quantise_keys(k, self.kg, 15)
        vq, vzero, vscale = qz.quantise_values(v, self.vg, 15)
        data[:, :, 0], data[:, :, 1] = qz.pack_bits(kq, 4), qz.pack_bits(vq, 4)
        return {"data": data, "kscale": kscale, "kzero": kzero, "vscale": vscale, "vzero": vzero}

    def _encode_symmetric(self, k, v, data):
        """Stores written before zero points (appends keep their codec): levels -7..7, codes 1..15."""
        from cachegraft_cli.store import quantise as qz

        groups = qz.key_groups(k, self.kg)
        vs = v.reshape(tuple(v.shape[:-1]) + (-1, self.vg))
        kscale, vscale = qz.scales(groups.abs().amax(dim=1), 7), qz.scales(vs.abs().amax(dim=-1), 7)
        kq = qz.quantise_symmetric(groups, kscale[:, None], 7).reshape((-1,) + tuple(k.shape[1:]))
        kq = kq[: k.shape[0]] + 8
        vq = qz.quantise_symmetric(vs, vscale[..., None], 7) + 8
        data[:, :, 0], data[:, :, 1] = qz.pack_bits(kq, 4), qz.pack_bits(vq.reshape(v.shape), 4)
        return {"data": data, "kscale": kscale, "vscale": vscale}

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


class KiviCodec(Codec):
    """Asymmetric low-bit KV after KIVI: keys per channel over groups of `key_group` tokens
    (key outliers live in channels), values per token over groups of `value_group` channels;
    `key_bits` / `value_bits` of 2 or 4, x = zero + q * scale with float16 zero and scale
    chosen so nothing clips. Keys and values are separate components (their own bit widths)."""

    DEFAULTS: dict = {}

    def __init__(self, geometry, params=None):
        super().__init__(geometry, {**self.DEFAULTS, **(params or {})})
        self.kb, self.vb = int(self.params["key_bits"]), int(self.params["value_bits"])
        self.kg = int(self.params["key_group"])
        self.vg = min(int(self.params["value_group"]), self.head_dim)
        self.params.update(value_group=self.vg)
        if self.kb not in (2, 4, 8) or self.vb not in (2, 4, 8) or self.kg < 1:
            raise UsageError(f"{self.name} takes key_bits and value_bits of 2, 4 or 8 and key_group >= 1, got "
                             f"{self.kb}, {self.vb}, {self.kg}.")
        if self.head_dim % 4 or self.head_dim % self.vg:
            raise UsageError(f"{self.name} needs a head_dim divisible by 4 and by value_group={self.vg}, "
                             f"got {self.head_dim}.")

    def components(self) -> list[Component]:
        lay, h, d = self.layers, self.heads, self.head_dim
        return [Component("kdata", "uint8", 1, (lay, h, d * self.kb // 8)),
                Component("vdata", "uint8", 1, (lay, h, d * self.vb // 8)),
                Component("kscale", "float16", self.kg, (lay, h, d)),
                Component("kzero", "float16", self.kg, (lay, h, d)),
                Component("vscale", "float16", 1, (lay, h, d // self.vg)),
                Component("vzero", "float16", 1, (lay, h, d // self.vg))]

    def encode_tensor(self, x):
        from cachegraft_cli.store import quantise as qz

        x = x.to(_torch().float32)
        kq, kzero, kscale = qz.quantise_keys(x[:, :, 0], self.kg, 2**self.kb - 1)
        vq, vzero, vscale = qz.quantise_values(x[:, :, 1], self.vg, 2**self.vb - 1)
        return {"kdata": qz.pack_bits(kq, self.kb), "vdata": qz.pack_bits(vq, self.vb),
                "kscale": kscale, "kzero": kzero, "vscale": vscale, "vzero": vzero}

    def decode(self, parts, start, stop):
        rows = np.arange(start, stop) // self.kg - start // self.kg
        out = np.empty((stop - start, self.layers, 2, self.heads, self.head_dim), np.float32)
        k = unpack_bits(parts["kdata"], self.kb).astype(np.float32)
        out[:, :, 0] = k * parts["kscale"][rows].astype(np.float32) + parts["kzero"][rows].astype(np.float32)
        v = unpack_bits(parts["vdata"], self.vb).astype(np.float32).reshape(k.shape[:-1] + (-1, self.vg))
        v = v * parts["vscale"].astype(np.float32)[..., None] + parts["vzero"].astype(np.float32)[..., None]
        out[:, :, 1] = v.reshape(k.shape)
        return out


class K2V4Codec(KiviCodec):
    """2-bit keys, int4 values."""

    name = "k2v4"
    DEFAULTS = {"key_bits": 2, "value_bits": 4, "key_group": 128, "value_group": 64}


class K8V4Codec(KiviCodec):
    """8-bit keys per channel, int4 values: keys drive the softmax and lose most to coarse codes
    (2-bit keys cost 17 F1 points where 4-bit values cost 2-4; docs/results.md, "Store size")."""

    name = "k8v4"
    DEFAULTS = {"key_bits": 8, "value_bits": 4, "key_group": 128, "value_group": 64}


class Int2Codec(KiviCodec):
    """2-bit keys and values."""

    name = "int2"
    DEFAULTS = {"key_bits": 2, "value_bits": 2, "key_group": 128, "value_group": 32}


class TransformCodec(Codec):
    """Transform coding with a calibration kept once per store (store/transform.py, store/entropy.py):
    keys without RoPE; each layer predicted from the one rebuilt before it; the residual in a PCA
    basis; one step per layer and K/V; static per-class ANS models. Tokens are coded in groups of
    `group` into `code` rows of `group_words` uint32 words (zero-padded: zstd takes the padding);
    `head` holds each group's [words, tokens, shift]. A group whose code would not fit, or with a
    component beyond its class's range, is coded with its steps doubled `shift` times (caches unlike
    the calibration's): every component's error stays within 1.5 of its group's steps (plus the
    calibration's deadzone).
    `pos` keeps each token's index in its passage, the angle its keys were un-rotated by."""

    name = "tc"
    DEFAULTS = {"group": 16}
    NEW = {"entropy": "deflate"}  # a new store's entropy stage (store/entropy.py)
    ENTROPY = ("deflate", "zstd", "ans")
    ZSTD_LEVEL = 15  # zstd stores' writer level when none is recorded (15: the bytes of 19 at half its CPU)
    CALIBRATION_DIR = "codec"

    def __init__(self, geometry, params=None):
        params = dict(params or {})
        cal = params.get("calibration")
        self._cal = None
        if cal is not None and not isinstance(cal, str):  # a fitted Calibration, for a new store
            self._cal = cal
            params = {**self.NEW, **params}
            banded = params["entropy"] != "ans"  # each band's frame header and table: a few words a row
            params.update(calibration=cal.sha256, position_offset=int(cal.info["position_offset"]),
                          group=int(cal.info["group"]),
                          group_words=params.get("group_words") or cal.info["group_words"] + 8 * banded * bands(cal))
        super().__init__(geometry, {**self.DEFAULTS, **params})
        # stored params stay as written (a segment's commit record holds them): no key means ANS
        self.entropy, self.level = self.params.get("entropy", "ans"), self.params.get("level", self.ZSTD_LEVEL)
        if self.entropy not in self.ENTROPY or not isinstance(self.level, int) or not 1 <= self.level <= 22:
            raise UsageError(f"the tc codec's entropy stage is one of {', '.join(self.ENTROPY)} (zstd at a level "
                             f"1-22); got {self.entropy!r}, level {self.level!r}.",
                             hint="Leave them at their defaults.")
        self._loc = None
        self._coder = None
        sha, words = self.params.get("calibration"), self.params.get("group_words")
        if not isinstance(sha, str) or len(sha) != 64 or not isinstance(words, int) or words < 1:
            raise UsageError("the tc codec needs a calibration (a sha256 and the group_words it was sized for).",
                             hint="Fit one with `cachegraft store calibrate`, or use another --codec.")
        self.group, self.words = int(self.params["group"]), int(words)
        self.offset = int(self.params.get("position_offset", 0))
        if self._cal is not None:
            self._check_calibration(self._cal)

    @classmethod
    def check_geometry(cls, geometry: dict) -> None:
        if _geometry(geometry)[2] % 2:
            raise UsageError(f"the tc codec needs an even head_dim (RoPE pairs); got {geometry}.",
                             hint="Use --codec int8.")

    def format_version(self) -> int:
        return 4 if self.entropy == "deflate" else 3  # 3: a calibration file; 4: deflate frames too

    def components(self) -> list[Component]:
        return [Component("code", "uint32", self.group, (self.words,)),
                Component("head", "uint32", self.group, (3,)),
                Component("pos", "uint32", 1, (1,))]

    @property
    def calibration_path(self) -> str:
        return f"{self.CALIBRATION_DIR}/tc-{self.params['calibration']}.safetensors"

    def bind(self, loc) -> None:
        self._loc = loc

    def install(self, loc) -> None:
        if self._cal is not None and not loc.exists(self.calibration_path):
            loc.write_bytes_atomic(self.calibration_path, self._cal.to_bytes())

    def tables(self) -> dict:
        cal = self.calibration()
        keep = ("source", "tokens", "passages", "key_step", "value_step", "bits_per_element", "rope_theta", "predict",
                "transform", "weighting")
        return {"file": self.calibration_path, "bytes": len(cal.to_bytes()), "sha256": self.params["calibration"],
                **{k: cal.info.get(k) for k in keep}, "layer_steps": bool(cal.info.get("layer_steps"))}

    def calibration(self):
        """The store's calibration, checked against its sha256 on first use."""
        if self._cal is None:
            self._cal = self._load()
        return self._cal

    def _load(self):
        import hashlib

        from cachegraft_cli.errors import StoreMetadataError
        from cachegraft_cli.store.transform import Calibration

        where = f"{getattr(self._loc, 'url', '?')}/{self.calibration_path}"
        try:
            data = self._loc.read_bytes(self.calibration_path)
        except Exception as exc:  # noqa: BLE001 - missing or unreadable: the same refusal
            raise StoreMetadataError(f"the transform codec's calibration {where} does not read ({exc}).",
                                     hint="Restore it from a backup; no passage of the store decodes without it.") \
                from None
        if hashlib.sha256(data).hexdigest() != self.params["calibration"]:
            raise StoreMetadataError(f"the transform codec's calibration {where} does not match its sha256 in "
                                     "zarr.json.", hint="Restore the file from a backup; it cannot be re-derived.")
        cal = Calibration.from_bytes(data)
        self._check_calibration(cal)
        return cal

    def _check_calibration(self, cal) -> None:
        from cachegraft_cli.errors import StoreMetadataError

        want = {"layers": self.layers, "kv_heads": self.heads, "head_dim": self.head_dim}
        if cal.info.get("geometry") != want:
            raise StoreMetadataError(f"transform-codec calibration is for geometry {cal.info.get('geometry')}, the "
                                     f"store holds {want}.", hint="Fit a calibration on this model's caches.")

    def coder(self):
        if self._coder is None:
            from cachegraft_cli.store.entropy import BandCoder, GroupCoder

            cal = self.calibration()
            if self.entropy != "ans":
                self._coder = BandCoder(cal.arrays["klass"], cal.arrays["radius"], self.entropy, self.level)
            else:
                self._coder = GroupCoder(cal.arrays["klass"], cal.class_probabilities(), cal.arrays["radius"])
        return self._coder

    def encode_staged(self, block, positions=None):
        from cachegraft_cli.store import transform as tf

        x = block.detach().to(_torch().float32).cpu().numpy() if hasattr(block, "detach") else \
            np.asarray(block, np.float32)
        if not np.isfinite(x).all():
            raise StoreError("a cache holds NaN or infinite values; the transform codec codes finite ones only.",
                             hint="Check the model's dtype (float16 overflows); use --codec bf16 to keep them.")
        t, g = len(x), self.group
        n = -(-t // g)
        pos = np.arange(t) if positions is None else np.asarray(positions, np.int64)
        cal = self.calibration()
        code, head = np.zeros((n, self.words), np.uint32), np.zeros((n, 3), np.uint32)
        head[:, 1] = [min(g, t - i * g) for i in range(n)]
        with one_blas_thread():
            keys, values = (grouped(a, n * g).reshape((n, g) + a.shape[1:])
                            for a in tf.split(x, pos + self.offset, cal.arrays["inv_freq"]))
            todo = np.arange(n)
            while len(todo):
                todo = self._code_groups(cal, keys, values, todo, code, head)
        return {"code": code, "head": head, "pos": pos.astype(np.uint32).reshape(-1, 1)}

    def _code_groups(self, cal, keys, values, todo, code, head) -> np.ndarray:
        """Code groups `todo` at their shifts (`head[:, 2]`); returns those whose code did not fit
        or clamped (their shift raised)."""
        from cachegraft_cli.store import transform as tf

        scale = np.repeat(2.0 ** head[todo, 2:3].astype(np.float64), self.group, axis=1)
        coded = tf.Coded.empty(self.coder().order, (self.layers, 2, self.heads * self.head_dim), len(todo),
                               self.group)
        _, over = tf.analyse(cal, keys[todo], values[todo], scale, out=coded)
        again = []
        for j, i in enumerate(todo.tolist()):
            m = int(head[i, 1])
            words = self.coder().encode_ordered(coded.buffer[j, :-1, :m])
            if len(words) <= self.words and not over[j, :m].any():
                code[i, : len(words)], head[i, 0] = words, len(words)
            elif head[i, 2] >= 24:
                raise StoreError("a cache does not fit the transform codec's rows even with its steps 2^24 times "
                                 "coarser: it is not a cache of this model.",
                                 hint="Check the caches; use --codec int8.")
            else:
                head[i, 2] += 1
                again.append(i)
        return np.array(again, np.int64)

    def decode(self, parts, start, stop):
        return self.decode_many([(parts, start, stop)])[0]

    def decode_many(self, reads):
        """All the reads' groups rebuilt in one batch (each group's products its own: a read gives
        the same caches alone or with others), then each read's tokens rotated back. The groups,
        then the reads, are split between torch's threads (as many as it runs): the split changes
        no bit, and inflate and numpy's products release the GIL."""
        from concurrent.futures import ThreadPoolExecutor

        from cachegraft_cli.store import transform as tf

        cal = self.calibration()
        heads = np.concatenate([p["head"] for p, _, _ in reads]).astype(np.int64)
        code = np.concatenate([p["code"] for p, _, _ in reads])
        self.coder()  # built once here, not by each thread (the calibration's tables fill lazily: any
        # thread that gets there first computes the same values)
        threads = max(1, min(_torch().get_num_threads(), len(heads)))
        with one_blas_thread(), ThreadPoolExecutor(threads) as pool:
            cuts = np.array_split(np.arange(len(heads)), threads)
            parts = list(pool.map(lambda ix: self._synthesise(cal, code[ix], heads[ix]), cuts))
            passages = self._passages(reads, heads, parts, [len(ix) for ix in cuts])
            return list(pool.map(lambda kvp: tf.join(*kvp, cal.arrays["inv_freq"], self.heads), passages))

    def _passages(self, reads, heads: np.ndarray, parts: list, sizes: list[int]) -> list[tuple]:
        """Each read's (keys, values, positions), `(tokens, L, C)` views where they can be, cut from
        the rebuilt groups: `parts`, each thread's layer-major `(L, groups, g, C)` keys and values
        for `sizes` groups in turn. No copy of the whole batch: `join` makes each read's one copy."""
        g, out, at = self.group, [], 0
        ends = np.cumsum(sizes).tolist()
        for stored, start, stop in reads:
            n = len(stored["head"])
            h = heads[at: at + n]
            k, v = (_groups([p[i] for p in parts], ends, at, at + n) for i in (0, 1))
            at += n
            first = start // g * g
            tokens: slice | np.ndarray = slice(start - first, stop - first)  # a view while only the last group is short
            if not (h[:-1, 1] == g).all():  # a short group inside (a segment's last): its valid tokens only
                tokens = np.flatnonzero(np.arange(g)[None, :] < h[:, 1:2])[tokens]
            k, v = (r.reshape((r.shape[0], n * g, r.shape[-1]))[:, tokens] for r in (k, v))
            out.append((np.moveaxis(k, 0, 1), np.moveaxis(v, 0, 1), stored["pos"][:, 0].astype(np.int64) + self.offset))
        return out

    def _synthesise(self, cal, code: np.ndarray, heads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        from cachegraft_cli.store import transform as tf

        g, c, coder = self.group, self.heads * self.head_dim, self.coder()
        # symbols as the coder holds them (class order, component-major: whole rows to fill)
        coded = tf.Coded.empty(coder.order, (self.layers, 2, c), len(heads), g)
        for i, (words, h) in enumerate(zip(code, heads)):
            coder.decode_ordered(words[: h[0]], int(h[1]), out=coded.buffer[i, :-1, : h[1]])
        keys, values = tf.synthesise(cal, coded, np.repeat(2.0 ** heads[:, 2:3], g, axis=1))
        return np.moveaxis(keys, -2, 0), np.moveaxis(values, -2, 0)  # layer-major, as rebuilt: contiguous


def _groups(parts: list[np.ndarray], ends: list[int], lo: int, hi: int) -> np.ndarray:
    """Groups `lo:hi` of the batch, from per-thread layer-major `parts` ending at `ends`: a view
    when one part holds them all."""
    pieces, begin = [], 0
    for part, end in zip(parts, ends):
        if lo < end and hi > begin:
            pieces.append(part[:, max(lo, begin) - begin: min(hi, end) - begin])
        begin = end
    return pieces[0] if len(pieces) == 1 else np.concatenate(pieces, axis=1)


def bands(cal) -> int:
    """How many bands a calibration's components fall into (each frame costs a few words a row)."""
    from cachegraft_cli.store.entropy import BandCoder, bands as cut

    return len(cut(cal.arrays["klass"].reshape(-1).astype(np.int64), cal.arrays["radius"], BandCoder.MIN_BAND))


def grouped(a: np.ndarray, tokens: int) -> np.ndarray:
    """`a` zero-padded along its first axis to `tokens` rows."""
    out = np.zeros((tokens,) + a.shape[1:], a.dtype)
    out[: len(a)] = a
    return out


_BY_NAME = {c.name: c for c in (Bf16Codec, Int8Codec, Int4Codec, K8V4Codec, K2V4Codec, Int2Codec, Float32Codec,
                                TransformCodec)}
CODECS = tuple(_BY_NAME)  # every codec's name, in the order help texts list them


def get_codec(name: str, geometry: dict, params: dict | None = None, stored: bool = False) -> Codec:
    """A codec; `stored`: `params` come from an existing store's metadata, where a missing
    parameter means the behaviour from before it existed (`STORED_DEFAULTS`), not today's default."""
    if name not in _BY_NAME:
        raise UsageError(f"unknown cache codec {name!r}.", hint=f"Use one of: {', '.join(CODECS)}.")
    cls = _BY_NAME[name]
    if stored:
        params = {**cls.STORED_DEFAULTS, **(params or {})}
    return cls(geometry, params)


def check_codec(name: str, geometry: dict) -> None:
    """That `name` is a codec that can hold caches of `geometry` (before its parameters exist)."""
    if name not in _BY_NAME:
        raise UsageError(f"unknown cache codec {name!r}.", hint=f"Use one of: {', '.join(CODECS)}.")
    _BY_NAME[name].check_geometry(geometry)


def codec_bytes_per_token(codec: str, geometry: dict, params: dict | None = None) -> float:
    """Nominal (uncompressed) stored bytes per token of one cache kind."""
    return get_codec(codec, geometry, params).nominal_bytes_per_token()


def raw_bf16_bytes_per_token(geometry: dict) -> int:
    layers, heads, head_dim = _geometry(geometry)
    return 2 * layers * 2 * heads * head_dim
