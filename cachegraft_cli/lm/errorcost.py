"""What an error in a cached key or value costs the receiver: the quadratic forms that the
transform codec weights its quantisation error by (`store.transform.fit(..., roots=...)`).

- **Values.** An error `e` in a value row reaches the layer's output through `o_proj`, once for
  every query head that reads that KV head (scaled by its attention weight, the same for every
  direction of `e`): cost ~ sum_h |W_o,h e|^2, the form sum_h W_o,h^T W_o,h. From the weights.
- **Keys, before RoPE.** An error `e` moves a query's logit by q . R e, R the rotation between the
  query's and the key's positions. Averaged over those rotations each rotary pair's two channels
  mix and the pairs decouple, so cost ~ sum_i w_i e_i^2 with w_i the mean of E[q^2] over channel
  i's pair, summed over the query heads of the KV head. From the receiver's queries on passages:
  their energy is far from even (a few channels carry most of it, the ones RoPE barely turns).

Both are returned as square roots `(layers, 2, kv_heads, head_dim, head_dim)` float64: with `M`
the form, a symmetric root `S` with `S S = M`, so that the cost of `e` is |e S|^2. Each is
scaled to mean eigenvalue 1 (the codec's step is in units of the weighted spread, so only the
shape of a form matters).
"""

from __future__ import annotations

import numpy as np
import torch

from cachegraft_cli.lm.attention import QueryCapture
from cachegraft_cli.lm.kvcache import decoder_layers


def error_roots(model, token_lists: list[list[int]], max_tokens: int = 20_000) -> np.ndarray:
    """The keys' and values' error forms' roots for a causal LM, the keys' from its queries on
    `token_lists` (each a passage's token ids, read one at a time, up to `max_tokens` in all)."""
    blocks = decoder_layers(model)
    attn = blocks[0].self_attn
    heads = model.config.num_attention_heads
    kv_heads = getattr(model.config, "num_key_value_heads", None) or heads
    energy = _query_energy(model, token_lists, max_tokens)  # (L, heads, D)
    roots = np.zeros((len(blocks), 2, kv_heads, attn.head_dim, attn.head_dim))
    group = heads // kv_heads
    for layer, block in enumerate(blocks):
        per_kv = energy[layer].reshape(kv_heads, group, -1).sum(1)
        half = per_kv.shape[-1] // 2
        paired = np.concatenate([(per_kv[:, :half] + per_kv[:, half:]) / 2] * 2, axis=-1)
        w_o = block.self_attn.o_proj.weight.detach().double().numpy()  # (hidden, heads * D)
        for g in range(kv_heads):
            roots[layer, 0, g] = np.diag(np.sqrt(_unit(paired[g])))
            cols = [w_o[:, h * attn.head_dim:(h + 1) * attn.head_dim] for h in range(g * group, (g + 1) * group)]
            roots[layer, 1, g] = _sqrt_form(sum(c.T @ c for c in cols))
    return roots


def _query_energy(model, token_lists: list[list[int]], max_tokens: int) -> np.ndarray:
    """Mean squared query per layer, head and channel `(L, heads, D)`, before RoPE."""
    blocks = decoder_layers(model)
    base = getattr(model, "model", model)  # the decoder without the LM head: no logits are needed
    total, count = None, 0
    with torch.inference_mode(), QueryCapture(model, list(range(len(blocks)))) as capture:
        for ids in token_lists:
            if count >= max_tokens:
                break
            base(input_ids=torch.tensor([ids], device=model.device), use_cache=False)
            sums = torch.stack([capture.raw_queries(i)[0].float().pow(2).sum(1) for i in capture.layers])
            total = sums if total is None else total + sums
            count += len(ids)
    if total is None:
        raise ValueError("no tokens to measure the queries on")
    return (total / count).cpu().double().numpy()


def _unit(weights: np.ndarray) -> np.ndarray:
    weights = np.maximum(weights, weights.max() * 1e-6)  # a channel no query reads still costs a little
    return weights / weights.mean()


def _sqrt_form(form: np.ndarray) -> np.ndarray:
    energy, vectors = np.linalg.eigh(form)
    energy = _unit(np.maximum(energy, 0))
    return (vectors * np.sqrt(energy)) @ vectors.T
