"""The only module that touches transformers cache internals.

Everything else sees a *plain KV*: a list with one `(K, V)` pair per layer.
Batched tensors are `(batch, kv_heads, tokens, head_dim)`; a single passage
drops the batch axis: `(kv_heads, tokens, head_dim)`. Keys are post-RoPE, as
the model stores them.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

PlainKV = list[tuple[torch.Tensor, torch.Tensor]]


def from_model_cache(cache) -> PlainKV:
    """Plain batched KV from a transformers `DynamicCache` (or legacy tuple)."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(k, v) for k, v in cache]


def to_model_cache(kv: PlainKV, config=None):
    """A fresh `DynamicCache` holding (not copying) the batched `kv` tensors."""
    from transformers import DynamicCache

    return DynamicCache(ddp_cache_data=[(k, v) for k, v in kv], config=config)


def to_decode_cache(kv: PlainKV | None, config):
    """A cache to decode into: `to_model_cache`'s, with each full-attention layer a growing one
    (`growing_layer_class`). For inference only; `kv` None starts empty."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    cache = DynamicCache(config=config)
    grow = growing_layer_class()
    layers: list[Any] = [grow() if type(layer) is DynamicLayer else layer for layer in cache.layers]
    cache.layers = layers
    for layer, (k, v) in zip(layers, kv or []):
        layer.update(k, v)
    return cache


@functools.cache
def growing_layer_class():
    """A `DynamicLayer` that appends into spare room (built on first use: transformers loads lazily).

    transformers' own concatenates the whole layer with each new token: 48 copies of the cache
    per decode step, 3.5-4 ms of a 45 ms step of the 0.5B receiver at 600 cached tokens
    (2026-12-06, AVX512-BF16). Here `keys` and `values` are views of the first slots of a buffer
    with `ROOM` slots more. Code that replaces them (crop, batch selection) is noticed by the
    data pointer and gets a new buffer; a crop that keeps the pointer is overwritten in place,
    which is what a crop means."""
    from transformers.cache_utils import DynamicLayer

    class GrowingLayer(DynamicLayer):
        ROOM = 128

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, new = (self.keys.shape[-2] if self.keys.numel() else 0), key_states.shape[-2]
            room = getattr(self, "room", None)
            if (room is None or room[0].data_ptr() != self.keys.data_ptr() or n + new > room[0].shape[-2]
                    or room[0].shape[:-2] != key_states.shape[:-2]):
                room = self.room = self.allocate(n, key_states, value_states)
            room[0][..., n: n + new, :] = key_states
            room[1][..., n: n + new, :] = value_states
            self.keys, self.values = room[0][..., : n + new, :], room[1][..., : n + new, :]
            return self.keys, self.values

        def allocate(self, n: int, key_states, value_states):
            slots = n + key_states.shape[-2] + self.ROOM
            keys = key_states.new_empty((*key_states.shape[:-2], slots, key_states.shape[-1]))
            values = value_states.new_empty((*value_states.shape[:-2], slots, value_states.shape[-1]))
            if n:
                keys[..., :n, :], values[..., :n, :] = self.keys, self.values
            return keys, values

    return GrowingLayer


def num_tokens(kv: PlainKV) -> int:
    return kv[0][0].shape[-2]


def batched(kv: PlainKV) -> PlainKV:
    """Add a batch axis of 1 to a single-passage KV."""
    return [(k.unsqueeze(0), v.unsqueeze(0)) for k, v in kv]


def unbatched(kv: PlainKV, index: int = 0) -> PlainKV:
    return [(k[index], v[index]) for k, v in kv]


def expand_batch(kv: PlainKV, batch: int) -> PlainKV:
    """Repeat a batch-1 KV `batch` times (contiguous: the model appends to it)."""
    return [(k.expand(batch, -1, -1, -1).contiguous(), v.expand(batch, -1, -1, -1).contiguous()) for k, v in kv]


def slice_tokens(kv: PlainKV, start: int, end: int) -> PlainKV:
    return [(k[..., start:end, :], v[..., start:end, :]) for k, v in kv]


def concat_tokens(parts: Sequence[PlainKV]) -> PlainKV:
    """Concatenate KVs along the token axis (all batched or all single)."""
    layers = len(parts[0])
    return [
        (torch.cat([p[i][0] for p in parts], dim=-2), torch.cat([p[i][1] for p in parts], dim=-2))
        for i in range(layers)
    ]


def cast(kv: PlainKV, dtype: torch.dtype, device=None) -> PlainKV:
    return [(k.to(device=device, dtype=dtype), v.to(device=device, dtype=dtype)) for k, v in kv]


def token_major(kv: PlainKV) -> torch.Tensor:
    """Single-passage KV -> `(tokens, layers, 2, kv_heads, head_dim)` (the store layout), in its own
    dtype on its own device: the store writer encodes it there (on the GPU that fused it)."""
    return torch.stack([torch.stack([k, v]) for k, v in kv]).permute(3, 0, 1, 2, 4)  # from (L, 2, H, T, D)


def to_token_major(kv: PlainKV) -> np.ndarray:
    """`token_major` as float32 numpy on the CPU."""
    return token_major(kv).to(torch.float32).cpu().numpy()


def from_token_major(array: np.ndarray, dtype: torch.dtype = torch.float32, device=None) -> PlainKV:
    """Inverse of `to_token_major`: single-passage plain KV."""
    t = torch.from_numpy(np.ascontiguousarray(array)).to(device=device, dtype=dtype)
    t = t.permute(1, 2, 3, 0, 4)  # (L, 2, H, T, D)
    return [(t[i, 0].contiguous(), t[i, 1].contiguous()) for i in range(t.shape[0])]


@dataclass
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int

    def as_dict(self) -> dict:
        return {"layers": self.layers, "kv_heads": self.kv_heads, "head_dim": self.head_dim}


def model_geometry(config) -> Geometry:
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    return Geometry(text.num_hidden_layers, kv_heads, head_dim)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    """RoPE's half rotation, as transformers writes it."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class KeyRotator:
    """Re-rotates post-RoPE keys by a position offset with the model's own RoPE.

    RoPE rotations compose: R(p + d) = R(d) R(p), so a key stored at position p
    becomes the key at p + d by one more rotation of angle d * inv_freq. Any
    attention scaling of the rope type (e.g. YaRN) is already inside the stored
    key and is not applied again. Models with several rope kinds (per layer
    type) get one inverse-frequency table per layer.
    """

    def __init__(self, inv_freqs: Sequence[torch.Tensor]):
        self.inv_freqs = [f.detach().to(torch.float64) for f in inv_freqs]

    @classmethod
    def for_model(cls, model) -> "KeyRotator":
        base = getattr(model, "model", model)
        rotary = getattr(base, "rotary_emb", None)
        if rotary is None:
            raise ValueError(f"{type(model).__name__} has no rotary embedding: keys cannot be re-rotated")
        layers = model_geometry(model.config).layers
        if hasattr(rotary, "inv_freq"):
            return cls([rotary.inv_freq] * layers)
        return cls(_per_layer_type_inv_freq(model, rotary, layers))

    def rotate(self, kv: PlainKV, offset: int) -> PlainKV:
        """Keys moved by `offset` positions; values untouched."""
        if offset == 0:
            return kv
        return [(self._rotate_keys(k, offset, i), v) for i, (k, v) in enumerate(kv)]

    def _rotate_keys(self, keys: torch.Tensor, offset: int, layer: int) -> torch.Tensor:
        inv = self.inv_freqs[layer]
        rot_dim = 2 * inv.shape[0]  # partial rotary models rotate only the first dims
        angles = torch.cat([offset * inv, offset * inv])
        cos = angles.cos().to(keys.device)
        sin = angles.sin().to(keys.device)
        head = keys[..., :rot_dim].to(torch.float64)
        rotated = (head * cos + _rotate_half(head) * sin).to(keys.dtype)
        if rot_dim == keys.shape[-1]:
            return rotated
        return torch.cat([rotated, keys[..., rot_dim:]], dim=-1)


def _per_layer_type_inv_freq(model, rotary, layers: int) -> list[torch.Tensor]:
    """Models like Gemma 3 keep one inv_freq buffer per attention layer type."""
    types = getattr(model.config.get_text_config(decoder=True), "layer_types", None)
    if not types:
        raise ValueError(f"cannot find RoPE frequencies of {type(model).__name__}")
    return [getattr(rotary, f"{t}_inv_freq") for t in types[:layers]]


def write_tokens(cache, kv: PlainKV, start: int) -> None:
    """Overwrite a model cache's slots [start, start + n) in place with batched `kv`."""
    n = num_tokens(kv)
    for layer, (k, v) in zip(cache.layers, kv):
        layer.keys[..., start : start + n, :] = k
        layer.values[..., start : start + n, :] = v


class _StopForward(Exception):
    """Raised by a forward hook to end a forward pass after the layer it watches."""


def decoder_layers(model):
    """The model's decoder layers (`model.model.layers` on Hugging Face causal LMs)."""
    layers = getattr(getattr(model, "model", model), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} does not expose its decoder layers")
    return layers


def layer_kv(model, past: PlainKV, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, layer: int):
    """Batched (K, V) of layer `layer` for `ids` read after `past`, running only layers 0..`layer`.

    The forward stops right after that layer (its attention has written the new
    tokens' KV into a scratch cache); `past` itself is not changed."""
    cache = to_model_cache(past, model.config)
    start = num_tokens(past)

    def stop(*_):
        raise _StopForward

    handle = decoder_layers(model)[layer].register_forward_hook(stop)
    try:
        model(input_ids=ids, cache=cache, position_ids=positions, attention_mask=mask, use_cache=True)
    except _StopForward:
        pass
    finally:
        handle.remove()
    entry = cache.layers[layer]
    return entry.keys[..., start:, :], entry.values[..., start:, :]
