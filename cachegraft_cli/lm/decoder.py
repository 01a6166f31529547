"""One-token decode steps without transformers' module stack.

A decode step of the 0.5B receiver is about 1,000 small tensor operations. Run through
transformers' modules, each layer also builds masks, dispatches through its attention interface
and cache classes, and passes keyword arguments down four levels; on a 2-core CPU that Python
is several milliseconds of a 60 ms step, and more when the cores are busy, because every op
then waits for its threads. `Decoder` runs the same operations on the same weights, in the same
order, straight from the loaded model's tensors: a step gives the logits transformers' forward
gives (the tests hold them equal), with less in between.

With int8 weights (`weights.Int8Linear`) a layer's q, k and v projections are one kernel call,
as are the MLP's gate and up projections: their rows are stored together and each layer keeps
views into them, so no weight is held twice. Each output row of the kernel is its own dot
product, so the fused call gives what the separate ones give.

Only decoder layers of the Qwen2 / Qwen3 shape (pre-norm attention with optional q/k norms, a
gated MLP, full attention everywhere, packed one-token GQA from `gqa.py`) are run here;
`Decoder.for_model` returns None for anything else and callers keep transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cachegraft_cli.lm import gqa
from cachegraft_cli.lm.kvcache import rotate_half
from cachegraft_cli.lm.weights import Int8Linear

MODEL_TYPES = ("qwen2", "qwen3")  # decoder layers this module runs as transformers runs them
ATTRIBUTE = "_cachegraft_decoder"  # where a model keeps its Decoder (None: not supported)


def for_model(model: Any) -> "Decoder | None":
    """The model's `Decoder`, built on first use and again when its layers were replaced since
    (`--weights` converts them), or None when the model is not one this module runs."""
    if not hasattr(model, ATTRIBUTE):
        setattr(model, ATTRIBUTE, Decoder(model) if supported(model) else None)
    decoder: Decoder | None = getattr(model, ATTRIBUTE)
    if decoder is not None and not decoder.runs(model):
        decoder = Decoder(model)
        setattr(model, ATTRIBUTE, decoder)
    return decoder


def keep_transformers(model: Any) -> None:
    """Decode `model` through transformers' forward from now on (benchmarks compare the two)."""
    setattr(model, ATTRIBUTE, None)


def supported(model: Any) -> bool:
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in MODEL_TYPES:
        return False
    if getattr(config, "_attn_implementation", None) != gqa.NAME:
        return False
    types = getattr(config, "layer_types", None) or ["full_attention"]
    return all(t == "full_attention" for t in types) and next(model.parameters()).device.type == "cpu"


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Qwen RMSNorm, operation for operation (float32 inside, weight applied in the
    input's dtype)."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * x32.to(dtype)


class Projections:
    """Several linear layers that read the same input: one int8 kernel call
    (`weights.Int8Linear.stacked`) when every one is an `Int8Linear` and the call is a decode
    step, else each layer's own forward."""

    def __init__(self, linears: list[Any]):
        self.linears = linears
        self.sizes = [m.out_features for m in linears]
        fusable = len(linears) > 1 and all(type(m) is Int8Linear for m in linears) and \
            len({m.kernel_dtype for m in linears}) == 1
        self.stacked = Int8Linear.stacked(linears) if fusable else None

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        if self.stacked is None or x.numel() // x.shape[-1] > self.linears[0].decode_rows:
            return [m(x) for m in self.linears]
        return list(self.stacked.quantised(x).split(self.sizes, dim=-1))


class Layer:
    """What one decoder layer's step needs, taken from its modules once."""

    def __init__(self, layer: Any, config: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.q_norm, self.k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        self.qkv = Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = Projections([mlp.gate_proj, mlp.up_proj])
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.scaling, self.head_dim = attn.scaling, attn.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads


class Decoder:
    """Decode steps of one token per row for a supported model (`for_model`)."""

    def __init__(self, model: Any):
        inner = model.model
        self.embed, self.rotary, self.norm, self.head = inner.embed_tokens, inner.rotary_emb, inner.norm, model.lm_head
        self.layers = [Layer(layer, model.config) for layer in inner.layers]

    def runs(self, model: Any) -> bool:
        """Whether this decoder still holds `model`'s own layers (none was replaced since)."""
        attn, mlp = model.model.layers[-1].self_attn, model.model.layers[-1].mlp
        last = self.layers[-1]
        return (self.head is model.lm_head and last.qkv.linears[0] is attn.q_proj
                and last.gate_up.linears[0] is mlp.gate_proj and last.down_proj is mlp.down_proj)

    def step(self, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
             mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits `(rows, vocab)` of one new token per row: `ids` and `positions` `(rows, 1)`;
        `mask` `(rows, slots)`, nonzero where a row sees a cache slot (the new token's included),
        or None when every row sees every slot. The token's keys and values go into `cache` (a
        transformers cache, as the model's forward takes)."""
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        cos, sin = cos[:, None], sin[:, None]  # (rows, 1, 1, dim): over heads
        # a mask that hides nothing is dropped, as transformers drops it
        seen = None if mask is None or bool(mask.all()) else mask.bool()[:, None, None, :]
        for index, layer in enumerate(self.layers):
            h = h + self._attention(layer, index, rms_norm(h, layer.input_norm), cos, sin, cache, seen)
            gate, up = layer.gate_up(rms_norm(h, layer.post_norm))
            h = h + layer.down_proj(layer.act(gate) * up)
        return self.head(rms_norm(h, self.norm)[:, -1])

    @staticmethod
    def _attention(layer: Layer, index: int, x: torch.Tensor, cos, sin, cache, seen) -> torch.Tensor:
        rows, dim = x.shape[0], layer.head_dim
        q, k, v = layer.qkv(x)
        q, k, v = q.view(rows, 1, -1, dim), k.view(rows, 1, -1, dim), v.view(rows, 1, -1, dim)
        if layer.q_norm is not None:
            q, k = rms_norm(q, layer.q_norm), rms_norm(k, layer.k_norm)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        keys, values = cache.update(k, v, index)
        groups = layer.heads // layer.kv_heads
        packed = q.reshape(rows, layer.kv_heads, groups, dim)  # one-token GQA as gqa.cpu_sdpa packs it
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=seen, scale=layer.scaling)
        return layer.o_proj(out.reshape(rows, 1, layer.heads * dim))
