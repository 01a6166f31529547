"""The numpy encoders the stores were written with before the codecs moved to torch
(`cachegraft_cli.store.quantise`): the reference the torch encoders must match bit for bit,
so that stores written either way, and appends across the change, hold the same bytes."""

from __future__ import annotations

import numpy as np

F16_MAX = float(np.finfo(np.float16).max)


def scales(maxabs, qmax):
    want = np.minimum(maxabs.astype(np.float32) / qmax, F16_MAX)
    s = want.astype(np.float16)
    low = s.astype(np.float32) < want
    s[low] = np.nextafter(s[low], np.float16(np.inf))
    return s


def quantise(x, scale, qmax):
    s = scale.astype(np.float32)
    q = np.divide(x, s, out=np.zeros_like(x), where=s > 0)
    return np.clip(np.rint(q), -qmax, qmax).astype(np.int8)


def zeros_and_scales(lo, hi, levels):
    lo = np.clip(lo.astype(np.float32), -F16_MAX, F16_MAX)
    zero = lo.astype(np.float16)
    high = zero.astype(np.float32) > lo
    zero[high] = np.nextafter(zero[high], np.float16(-np.inf))
    return zero, scales(np.maximum(hi.astype(np.float32) - zero.astype(np.float32), 0), levels)


def quantise_asym(x, zero, scale, levels):
    s = scale.astype(np.float32)
    q = np.divide(x - zero.astype(np.float32), s, out=np.zeros_like(x), where=s > 0)
    return np.clip(np.rint(q), 0, levels).astype(np.uint8)


def pack_bits(codes, bits):
    per = 8 // bits
    c = codes.astype(np.uint8).reshape(codes.shape[:-1] + (-1, per))
    out = c[..., 0].copy()
    for j in range(1, per):
        out |= c[..., j] << np.uint8(bits * j)
    return out


def _groups(k, kg):
    groups = -(-len(k) // kg)
    padded = np.concatenate([k, np.repeat(k[-1:], groups * kg - len(k), axis=0)])
    return padded.reshape((groups, kg) + k.shape[1:])


def encode_int8(x):
    scale = scales(np.abs(x).max(axis=-1), 127)
    return {"data": quantise(x, scale[..., None], 127), "scale": scale}


def encode_int4(x, kg=128, vg=64, zero_point=True):
    k, v = x[:, :, 0], x[:, :, 1]
    groups = _groups(k, kg)
    vs = v.reshape(v.shape[:-1] + (-1, vg))
    def rep(a):
        return np.repeat(a, kg, axis=0)[: len(k)]
    if zero_point:
        kzero, kscale = zeros_and_scales(groups.min(axis=1), groups.max(axis=1), 15)
        vzero, vscale = zeros_and_scales(vs.min(axis=-1), vs.max(axis=-1), 15)
        kq = quantise_asym(k, rep(kzero), rep(kscale), 15)
        vq = quantise_asym(vs, vzero[..., None], vscale[..., None], 15)
        parts = {"kscale": kscale, "kzero": kzero, "vscale": vscale, "vzero": vzero}
    else:
        kscale, vscale = scales(np.abs(groups).max(axis=1), 7), scales(np.abs(vs).max(axis=-1), 7)
        kq = quantise(k, rep(kscale), 7) + 8
        vq = quantise(vs, vscale[..., None], 7) + 8
        parts = {"kscale": kscale, "vscale": vscale}
    return {"data": pack_bits(np.stack([kq, vq.reshape(v.shape)], axis=2), 4), **parts}


def encode_kivi(x, kb, vb, kg, vg):
    k, v = x[:, :, 0], x[:, :, 1]
    g = _groups(k, kg)
    kzero, kscale = zeros_and_scales(g.min(axis=1), g.max(axis=1), 2**kb - 1)
    kq = quantise_asym(g, kzero[:, None], kscale[:, None], 2**kb - 1).reshape((-1,) + k.shape[1:])
    vs = v.reshape(v.shape[:-1] + (-1, vg))
    vzero, vscale = zeros_and_scales(vs.min(axis=-1), vs.max(axis=-1), 2**vb - 1)
    vq = quantise_asym(vs, vzero[..., None], vscale[..., None], 2**vb - 1).reshape(v.shape)
    return {"kdata": pack_bits(kq[: len(k)], kb), "vdata": pack_bits(vq, vb),
            "kscale": kscale, "kzero": kzero, "vscale": vscale, "vzero": vzero}


def encode(codec, x):
    """The reference parts of `codec` (a `cachegraft_cli.store.codecs.Codec`) for float32 `x`."""
    p = codec.params
    if codec.name == "int8":
        return encode_int8(x)
    if codec.name == "int4":
        return encode_int4(x, p["key_group"], p["value_group"], p["zero_point"])
    if codec.name in ("k2v4", "int2", "k8v4"):
        return encode_kivi(x, p["key_bits"], p["value_bits"], p["key_group"], p["value_group"])
    raise ValueError(codec.name)
