"""The codecs' quantisers, in torch, on the device that holds the cache.

Encoding where the caches were fused (the GPU, in a real encode) leaves the CPU
only the packed bytes to checksum, compress and write; on a CPU-only machine it
runs as vectorised torch kernels instead of numpy's many passes. The arithmetic
is the stored formats' own, bit for bit (docs/store-format.md; a test holds it
against the numpy reference): float16 scales rounded up and zeros rounded down so
that nothing clips, float32 division, rounding half to even.
"""

from __future__ import annotations

import torch

F16_MAX = 65504.0


def _f16_step(h: torch.Tensor, up: bool) -> torch.Tensor:
    """The float16 next to each of `h` towards +inf (`up`) or -inf, through the bit patterns
    (torch has no float16 `nextafter`); both zeros step to the smallest subnormal."""
    bits = h.view(torch.int16).to(torch.int32) & 0xFFFF
    negative, zero = bits >= 0x8000, (bits & 0x7FFF) == 0
    away = negative != up  # moving away from zero: the magnitude grows
    stepped = torch.where(away, bits + 1, bits - 1)
    stepped = torch.where(zero, torch.full_like(bits, 0x0001 if up else 0x8001), stepped)
    return torch.where(stepped >= 0x8000, stepped - 0x10000, stepped).to(torch.int16).view(torch.float16)


def scales(maxabs: torch.Tensor, qmax: int) -> torch.Tensor:
    """float16 scales with scale * qmax >= maxabs (nothing clips unless beyond float16's range)."""
    want = torch.clamp(maxabs.to(torch.float32) / qmax, max=F16_MAX)
    s = want.to(torch.float16)
    return torch.where(s.to(torch.float32) < want, _f16_step(s, up=True), s)


def zeros_and_scales(lo: torch.Tensor, hi: torch.Tensor, levels: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 (zero, scale) with zero <= lo and zero + levels * scale >= hi: the zero is rounded
    down, the scale up, and the scale is computed from the rounded zero."""
    lo = torch.clamp(lo.to(torch.float32), -F16_MAX, F16_MAX)
    zero = lo.to(torch.float16)
    zero = torch.where(zero.to(torch.float32) > lo, _f16_step(zero, up=False), zero)
    span = torch.clamp(hi.to(torch.float32) - zero.to(torch.float32), min=0)
    return zero, scales(span, levels)


def _divisor(scale: torch.Tensor) -> torch.Tensor:
    """float32 scales with +inf for 0: a finite x over it is 0, the code a zero-scale group gets
    (one pass cheaper than masking the quotient)."""
    s = scale.to(torch.float32)
    return torch.where(s > 0, s, torch.full((), torch.inf, device=s.device))


def quantise_symmetric(x: torch.Tensor, scale: torch.Tensor, qmax: int) -> torch.Tensor:
    """int8 codes in [-qmax, qmax] of x / scale (0 where the scale is 0)."""
    return torch.div(x, _divisor(scale)).round_().clamp_(-qmax, qmax).to(torch.int8)


def quantise_asymmetric(x: torch.Tensor, zero: torch.Tensor, scale: torch.Tensor, levels: int) -> torch.Tensor:
    """uint8 codes in [0, levels] of (x - zero) / scale (0 where the scale is 0)."""
    return torch.sub(x, zero.to(torch.float32)).div_(_divisor(scale)).round_().clamp_(0, levels).to(torch.uint8)


def quantise_keys(k: torch.Tensor, group: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of keys `(tokens, ...)` per channel over groups of `group` tokens:
    (codes per token, zero per group, scale per group)."""
    groups = key_groups(k, group)
    zero, scale = zeros_and_scales(groups.amin(dim=1), groups.amax(dim=1), levels)  # 4x faster than aminmax here
    codes = quantise_asymmetric(groups, zero[:, None], scale[:, None], levels)
    return codes.reshape((-1,) + tuple(k.shape[1:]))[: k.shape[0]], zero, scale


def quantise_values(v: torch.Tensor, group: int, levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric codes of values `(tokens, ..., channels)` per token over groups of `group`
    channels: (codes, zero per group, scale per group)."""
    vs = v.reshape(tuple(v.shape[:-1]) + (-1, group))
    zero, scale = zeros_and_scales(vs.amin(dim=-1), vs.amax(dim=-1), levels)
    return quantise_asymmetric(vs, zero[..., None], scale[..., None], levels).reshape(v.shape), zero, scale


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """`bits`-bit codes (uint8) packed along the last axis, 8 // bits per byte, code j of a byte
    at bit bits * j (for 4 bits: channel 2i in the low nibble, 2i+1 in the high)."""
    per = 8 // bits
    c = codes.to(torch.uint8).reshape(codes.shape[:-1] + (-1, per))
    out = c[..., 0].clone()
    for j in range(1, per):
        out |= c[..., j] << (bits * j)
    return out


def key_groups(k: torch.Tensor, group: int) -> torch.Tensor:
    """Keys `(tokens, ...)` as `(groups, group, ...)`; a partial last group is padded with its own
    last token, which changes neither its max |x| nor its min and max."""
    groups = -(-k.shape[0] // group)
    pad = groups * group - k.shape[0]
    if pad:
        k = torch.cat([k, k[-1:].expand((pad,) + tuple(k.shape[1:]))])
    return k.reshape((groups, group) + tuple(k.shape[1:]))
