"""How much attention each passage token receives from the passage's later tokens, at a
few late layers of the receiver, measured in the forward encode already runs.

The queries are not kept by the model, so a pre-hook on each chosen layer's
attention module records its input (hidden states and RoPE tables) and the
queries are recomputed from it: `q_proj`, the per-head query norm where the
model has one (Qwen3), RoPE. The keys are the layer's cache. The hook changes
nothing in the forward itself: the caches are the same bits with or without it.

Scores are what token-pruning methods in the H2O / SnapKV family rank tokens by:
the mean, over heads and over the later passage tokens that can see a token,
of the softmax weight they put on it (the prefix is in the softmax, so
attention parked on the prefix counts against every passage token alike).
"""

from __future__ import annotations

import math

import torch

from cachegraft_cli.lm.kvcache import PlainKV, decoder_layers


class QueryCapture:
    """Within the `with` block, records the attention input of `layers` (indices, negatives
    from the end) on every forward of `model`."""

    def __init__(self, model, layers: list[int]):
        blocks = decoder_layers(model)
        self.layers = sorted({i % len(blocks) for i in layers})
        self.modules = {i: blocks[i].self_attn for i in self.layers}
        self.inputs: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self._handles: list = []

    def __enter__(self) -> QueryCapture:
        for i, module in self.modules.items():
            self._handles.append(module.register_forward_pre_hook(self._recorder(i), with_kwargs=True))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _recorder(self, layer: int):
        def record(_module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            cos, sin = kwargs["position_embeddings"] if "position_embeddings" in kwargs else args[1]
            self.inputs[layer] = (hidden, cos, sin)

        return record

    def raw_queries(self, layer: int) -> torch.Tensor:
        """The layer's queries before RoPE `(batch, heads, tokens, head_dim)` of the last forward."""
        hidden = self.inputs[layer][0]
        attn = self.modules[layer]
        batch, tokens, _ = hidden.shape
        q = attn.q_proj(hidden).view(batch, tokens, -1, attn.head_dim)
        norm = getattr(attn, "q_norm", None)
        if norm is not None:
            q = norm(q)
        return q.transpose(1, 2)

    def queries(self, layer: int) -> torch.Tensor:
        """The layer's RoPE'd queries `(batch, heads, tokens, head_dim)` of the last forward."""
        q = self.raw_queries(layer)
        cos, sin = self.inputs[layer][1:]
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
        half = q.shape[-1] // 2
        rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
        return q * cos + rotated * sin


def received_attention(capture: QueryCapture, prefix: PlainKV, passage: PlainKV, lengths: list[int]) -> torch.Tensor:
    """`(batch, max_len)` float32 scores of each passage token (0 past a passage's length):
    the attention it receives from its passage's later tokens, averaged over heads, over those
    tokens and over the captured layers. `prefix` is batch 1, `passage` the batched pass."""
    width = passage[0][0].shape[2]
    total = torch.zeros(len(lengths), width)
    for layer in capture.layers:
        keys = torch.cat([prefix[layer][0].expand(len(lengths), -1, -1, -1), passage[layer][0]], dim=2)
        total += _layer_scores(capture.queries(layer), keys, lengths)
    return total / len(capture.layers)


def _layer_scores(q: torch.Tensor, keys: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    batch, heads, width, dim = q.shape
    kv_heads, start = keys.shape[1], keys.shape[2] - width
    keys = keys.repeat_interleave(heads // kv_heads, dim=1).float()
    logits = q.float() @ keys.transpose(-1, -2) / math.sqrt(dim)  # (batch, heads, width, prefix + width)
    rows = torch.arange(width)[:, None]
    cols = torch.arange(start + width)[None, :] - start
    logits.masked_fill_((cols > rows)[None, None], float("-inf"))
    weights = logits.softmax(dim=-1)[..., start:].mean(dim=1)  # passage columns, mean over heads
    later = (cols[:, start:] < rows)  # a token's own row is left out: every token attends to itself
    real = torch.zeros(batch, width, dtype=torch.bool)
    for i, n in enumerate(lengths):
        real[i, :n] = True
    seen = later[None] & real[:, :, None] & real[:, None, :]  # (batch, row, col)
    counts = seen.sum(dim=1).clamp(min=1)
    return (weights * seen).sum(dim=1) / counts
