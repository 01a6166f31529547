"""Decode steps without transformers' module stack.

A decode step of the 0.5B receiver is about 1,000 small tensor operations. Run through
transformers' modules, each layer also builds masks, dispatches through its attention interface
and cache classes, and passes keyword arguments down four levels; on a 2-core CPU that Python
is several milliseconds of a 60 ms step, and more when the cores are busy, because every op
then waits for its threads. `Decoder` runs the same operations on the same weights, in the same
order, straight from the loaded model's tensors: a step gives the logits transformers' forward
gives (the tests hold them equal), with less in between.

With int8 or int4 weights (`weights.QuantisedLinear`) a layer's q, k and v projections are one
kernel call, as are the MLP's gate and up projections: their rows are stored together and each
layer keeps views into them, so no weight is held twice (int4's small scale tables excepted).
Each output row of the kernel is its own dot product, so the fused call gives what the separate
ones give. Queries and keys are normed (Qwen3) and rotated as one tensor: each op runs once per
layer instead of twice, on the same numbers. A step may also read a few tokens per row
(`Decoder.run`: a greedy answer's last token and the drafts it checks, `drafting.py`).

Only decoder layers of the Qwen2 / Qwen3 shape (pre-norm attention with optional q/k norms, a
gated MLP, full attention everywhere, GQA packed as `gqa.py` packs it) are run here;
`Decoder.for_model` returns None for anything else and callers keep transformers' forward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cachegraft_cli.lm import gqa
from cachegraft_cli.lm.weights import QuantisedLinear

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
    if not all(t == "full_attention" for t in types) or next(model.parameters()).device.type != "cpu":
        return False
    attn = model.model.layers[0].self_attn  # q and k are normed as one: with one epsilon
    q_norm: Any = getattr(attn, "q_norm", None)
    return q_norm is None or q_norm.variance_epsilon == attn.k_norm.variance_epsilon


def rms_norm(x: torch.Tensor, norm: Any) -> torch.Tensor:
    """transformers' Qwen RMSNorm, operation for operation (float32 inside, weight applied in the
    input's dtype)."""
    return norm.weight * normalised(x, norm.variance_epsilon)


def normalised(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm before its weight, in `x`'s dtype."""
    x32 = x.to(torch.float32)
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


class Projections:
    """Several linear layers that read the same input, their outputs side by side: one quantised
    kernel call (`weights.QuantisedLinear.stacked`) when they are quantised alike and the call is
    a decode step, else each layer's own forward."""

    def __init__(self, linears: list[Any]):
        self.linears = linears
        kind = type(linears[0])
        fusable = issubclass(kind, QuantisedLinear) and kind.can_stack(linears)
        self.stacked = kind.stacked(linears) if fusable else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """`(..., sum of out_features)`: each layer's output in turn."""
        if self.stacked is None or x.numel() // x.shape[-1] > self.linears[0].decode_rows:
            return torch.cat([m(x) for m in self.linears], dim=-1)
        return self.stacked.quantised(x)


class Layer:
    """What one decoder layer's step needs, taken from its modules once."""

    def __init__(self, layer: Any, config: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.qkv = Projections([attn.q_proj, attn.k_proj, attn.v_proj])
        self.gate_up = Projections([mlp.gate_proj, mlp.up_proj])
        self.o_proj, self.down_proj, self.act = attn.o_proj, mlp.down_proj, mlp.act_fn
        self.scaling, self.head_dim = attn.scaling, attn.head_dim
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        # Qwen3's q and k norms as one: each head's weights in a (heads + kv_heads, dim) table
        q_norm: Any = getattr(attn, "q_norm", None)
        self.qk_norm = None if q_norm is None else torch.cat([
            q_norm.weight.detach().expand(self.heads, -1), attn.k_norm.weight.detach().expand(self.kv_heads, -1)])
        self.qk_eps: float = 0.0 if q_norm is None else q_norm.variance_epsilon


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
        return self.run(cache, ids, positions, mask)[:, -1]

    def run(self, cache: Any, ids: torch.Tensor, positions: torch.Tensor,
            mask: torch.Tensor | None = None) -> torch.Tensor:
        """`step` for several new tokens per row (`ids`, `positions` `(rows, n)`), each seeing
        the ones before it: logits `(rows, n, vocab)`, the next token's after each (a step that
        checks copied drafts, `drafting.py`)."""
        h = self.embed(ids)
        cos, sin = self.rotary(h, positions)
        # (rows, n, 1, dim): the same angle for every head. RoPE's rotate_half negates the second
        # half of a head and swaps the halves; the sign goes into sin instead (exactly: negation
        # commutes with a product), so a rotation is one flip and three products.
        half = sin.shape[-1] // 2
        cos, sin = cos[:, :, None], torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)[:, :, None]
        seen = self._seen(cache, ids.shape[1], mask)
        for index, layer in enumerate(self.layers):
            h = h + self._attention(layer, index, rms_norm(h, layer.input_norm), cos, sin, cache, seen)
            gate, up = layer.gate_up(rms_norm(h, layer.post_norm)).chunk(2, dim=-1)  # both intermediate_size wide
            h = h + layer.down_proj(layer.act(gate) * up)
        return self.head(rms_norm(h, self.norm))

    def _seen(self, cache: Any, new: int, mask: torch.Tensor | None) -> torch.Tensor | None:
        """The boolean attention mask of what each new token sees, in the packed GQA layout
        (`_attention`): `(rows, 1, 1, slots)` for one new token, or None when it sees every slot
        (transformers drops such a mask too); `(rows, kv_heads, groups x new, slots)` for
        several, each packed row its token's mask row. The same for every layer."""
        seen = None if mask is None or bool(mask.all()) else mask.bool()[:, None, None, :]
        if new == 1:
            return seen
        slots = cache.get_seq_length() + new  # the new tokens' slots included
        causal = torch.ones(new, slots, dtype=torch.bool).tril(slots - new)  # token j sees slots up to its own
        rows = causal[None, None] if seen is None else seen & causal
        heads, kv = self.layers[0].heads, self.layers[0].kv_heads
        return rows.expand(-1, heads, new, slots).reshape(rows.shape[0], kv, heads // kv * new, slots)

    @staticmethod
    def _attention(layer: Layer, index: int, x: torch.Tensor, cos, sin, cache, seen) -> torch.Tensor:
        rows, new, dim, heads, kv = x.shape[0], x.shape[1], layer.head_dim, layer.heads, layer.kv_heads
        qkv = layer.qkv(x).view(rows, new, heads + 2 * kv, dim)
        qk, v = qkv[:, :, :heads + kv], qkv[:, :, heads + kv:]  # q and k are normed and rotated as one
        if layer.qk_norm is not None:
            qk = layer.qk_norm * normalised(qk, layer.qk_eps)
        qk = qk * cos + qk.unflatten(-1, (2, dim // 2)).flip(-2).flatten(-2) * sin
        keys, values = cache.update(qk[:, :, heads:].transpose(1, 2), v.transpose(1, 2), index)
        # GQA packed as gqa.cpu_sdpa packs it: each KV head's query heads, token after token
        packed = qk[:, :, :heads].transpose(1, 2).reshape(rows, kv, heads // kv * new, dim)
        out = F.scaled_dot_product_attention(packed, keys, values, attn_mask=seen, scale=layer.scaling)
        return layer.o_proj(out.view(rows, heads, new, dim).transpose(1, 2).reshape(rows, new, heads * dim))
