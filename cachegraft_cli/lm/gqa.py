"""Attention with grouped KV heads, fast on CPU.

When a decode step reads its cache without a mask, transformers' SDPA attention calls
`scaled_dot_product_attention(..., enable_gqa=True)`, and on CPU that kernel is slow for one
query: with the 0.5B receiver's shape (14 query heads over 2 KV heads, head dim 64, 600 cached
tokens, bf16) it took 0.54 ms per layer against 0.07 ms for the same attention with the query
heads packed under their KV heads (2026-12-06, 2-core AMD EPYC with AVX512-BF16). That was 13
ms of a 48 ms decode step. A forward of a few tokens with a mask (a decode step checking copied
drafts, `drafting.py`) gains the same way.

`install(model)` points the model at `cpu_sdpa`: on CPU, one-token queries, and several queries
with a mask, are packed `(batch, kv_heads, groups x queries, dim)` (each packed row keeps its
query's mask row) and attend with plain SDPA; everything else (several queries made causal by a
flag, not a mask) is transformers' own SDPA path, unchanged. Packing is a reshape: each query
row attends to the same keys with the same scale, so the result differs from the GQA kernel's
by float rounding only.
"""

from __future__ import annotations

from typing import Any

import torch.nn.functional as F

NAME = "cachegraft_cpu_sdpa"


def cpu_sdpa(module, query, key, value, attention_mask, dropout: float = 0.0, scaling=None, **kwargs):
    """An attention function for transformers' `AttentionInterface` (shapes as its SDPA's:
    query `(batch, heads, q, dim)`, key and value `(batch, kv_heads, kv, dim)`)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    queries = query.shape[2]
    if (query.device.type != "cpu" or groups == 1 or dropout or kwargs.get("output_attentions")
            or (queries > 1 and attention_mask is None)):  # several queries without a mask: causal by flag
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    batch, heads, _, dim = query.shape
    kv = heads // groups
    packed = query.reshape(batch, kv, groups * queries, dim)  # each KV head's query heads, query after query
    mask = attention_mask
    if mask is not None and (queries > 1 or mask.shape[1] != 1):  # each packed row keeps its query's mask row
        rows = mask.expand(mask.shape[0], heads, queries, mask.shape[-1])
        mask = rows.reshape(mask.shape[0], kv, groups * queries, mask.shape[-1])
    out = F.scaled_dot_product_attention(packed, key, value, attn_mask=mask, scale=scaling)
    return out.reshape(out.shape[0], heads, queries, value.shape[-1]).transpose(1, 2).contiguous(), None


def install(model: Any) -> bool:
    """Route `model`'s attention through `cpu_sdpa` when it uses transformers' SDPA attention
    (in place); whether it did. Other implementations (eager, flash) are left alone."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, cpu_sdpa)
    AttentionMaskInterface.register(NAME, sdpa_mask)  # the masks SDPA takes
    model.set_attn_implementation(NAME)
    return True
