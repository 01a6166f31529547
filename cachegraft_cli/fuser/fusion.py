"""Fuse passages: receiver and sharer read the shared prefix and the passage at
the same positions; the fuser rewrites every receiver layer of the passage
section. Several passages go through one forward pass.

Batches are right-padded: in a causal model real tokens never attend to the
pads after them, so no attention mask is needed and every passage keeps its
canonical positions (right after the prefix). The pads' KV is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachegraft_cli.errors import CheckpointError
from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.align import TokenAligner
from cachegraft_cli.lm.attention import QueryCapture, received_attention
from cachegraft_cli.lm.kvcache import PlainKV
from cachegraft_cli.lm.models import LoadedModel

SCORED_LAYERS = (-4, -3, -2, -1)  # the receiver layers whose attention ranks tokens for `encode --keep`


@dataclass
class PassageKV:
    fused: PlainKV  # single-passage tensors (kv_heads, tokens, head_dim)
    own: PlainKV  # the receiver's own cache of the same tokens
    attention: torch.Tensor | None = None  # (tokens,) attention each token receives (`fuse(..., attention=True)`)


class PassageFusion:
    """Computes prefix and passage caches for one (receiver, sharer, fuser) triple.

    With `fuser=None` (closed) the sharer is never run and the fused cache is
    the receiver's own cache. A fuser with `sharer_input="zero"` (an adapter)
    never runs the sharer either: it is fed zeros of the sharer geometry.
    """

    def __init__(self, receiver: LoadedModel, prefix_ids: list[int], sharer: LoadedModel | None = None, fuser=None):
        self.receiver = receiver
        self.zero_sharer = fuser is not None and getattr(fuser.spec, "sharer_input", "model") == "zero"
        self.sharer = sharer if fuser is not None and not self.zero_sharer else None
        self.fuser = fuser
        self.prefix_ids = list(prefix_ids)
        self.aligner = None
        if self.sharer is not None:
            check_fuser_fits(fuser, receiver, self.sharer)
            strategy = fuser.spec.alignment_strategy if fuser.spec.alignment else "first"
            self.aligner = TokenAligner(receiver.tokenizer, self.sharer.tokenizer, strategy)
        self._receiver_prefix = _prefill(receiver.model, self.prefix_ids)
        self._sharer_prefix = _prefill(self.sharer.model, self._sharer_ids(self.prefix_ids)) if self.sharer else None

    def prefix_kv(self) -> PlainKV:
        """The receiver's own prefix cache (single, unfused)."""
        return kvcache.unbatched(self._receiver_prefix)

    @torch.inference_mode()
    def fuse(self, passages: list[list[int]], attention: bool = False,
             donors: list[list[int]] | None = None) -> list[PassageKV]:
        """Fused and own caches for each passage's token ids, one forward per model; with
        `attention`, also the attention each token receives from its passage's later tokens
        at the receiver's last layers (`lm.attention`), from the same receiver forward.
        `donors` (one per passage, each as long as it): the token ids the sharer reads instead
        of the passage's own (the mismatched-sharer control, `encoding.donors`)."""
        lengths = [len(p) for p in passages]
        if donors is not None and (self.sharer is None or [len(d) for d in donors] != lengths):
            raise ValueError("donors need a sharer-fed fuser and one donor as long as each passage")
        scores = None
        if attention:
            with QueryCapture(self.receiver.model, list(SCORED_LAYERS)) as capture:
                own = self.passage_pass("receiver", passages)
            scores = received_attention(capture, self._receiver_prefix, own, lengths)
        else:
            own = self.passage_pass("receiver", passages)
        fused = own
        if self.sharer is not None:
            fused = self.fuser.fuse(own, self.passage_pass("sharer", passages if donors is None else donors))
        elif self.zero_sharer:
            zeros = self.fuser.zero_sharer_kv(len(passages), max(lengths), own[0][0].dtype, own[0][0].device)
            fused = self.fuser.fuse(own, zeros)
        return [
            PassageKV(take(fused, i, lengths[i]), take(own, i, lengths[i]),
                      scores[i, : lengths[i]].clone() if scores is not None else None)
            for i in range(len(passages))
        ]

    @torch.inference_mode()
    def model_kv(self, passages: list[list[int]]) -> list[tuple[PlainKV, PlainKV | None]]:
        """Unfused (receiver, sharer) passage KV, exactly what `fuse` feeds the fuser
        (same prefix, positions and batching); sharer None when it is not run.
        Training precomputes these once and reuses them every epoch."""
        lengths = [len(p) for p in passages]
        own = self.passage_pass("receiver", passages)
        sharer = self.passage_pass("sharer", passages) if self.sharer is not None else None
        return [
            (take(own, i, n), take(sharer, i, n) if sharer is not None else None) for i, n in enumerate(lengths)
        ]

    def passage_pass(self, role: str, passages: list[list[int]]) -> PlainKV:
        """One model's batched passage KV after its prefix, unfused: the pass `fuse` makes for
        `role` ("receiver" or "sharer"; receiver token ids in, aligned for the sharer)."""
        if role == "receiver":
            return extend(self.receiver, self._receiver_prefix, passages)
        if self.sharer is None or self._sharer_prefix is None:
            raise ValueError("this fusion runs no sharer (closed fuser or adapter)")
        return extend(self.sharer, self._sharer_prefix, [self._sharer_ids(p) for p in passages])

    def _sharer_ids(self, ids: list[int]) -> list[int]:
        if self.aligner is None:
            raise ValueError("this fusion runs no sharer (closed fuser or adapter)")
        return self.aligner.align(ids)


def take(kv: PlainKV, index: int, length: int) -> PlainKV:
    """Passage `index` of a batched passage KV, cut to its own `length` (a copy)."""
    return [(k[index, :, :length].clone(), v[index, :, :length].clone()) for k, v in kv]


@torch.inference_mode()
def _prefill(model, ids: list[int]) -> PlainKV:
    device = next(model.parameters()).device
    out = model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    return kvcache.from_model_cache(out.cache)


def extend(lm: LoadedModel, prefix: PlainKV, passages: list[list[int]]) -> PlainKV:
    """Passage-section KV (batch, heads, max_len, dim) computed after the prefix."""
    width = max(len(p) for p in passages)
    pad = lm.tokenizer.pad_token_id if lm.tokenizer.pad_token_id is not None else 0
    ids = torch.tensor([p + [pad] * (width - len(p)) for p in passages], device=lm.device)
    cache = kvcache.to_model_cache(kvcache.expand_batch(prefix, len(passages)), lm.model.config)
    out = lm.model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)
    start = kvcache.num_tokens(prefix)
    return kvcache.slice_tokens(kvcache.from_model_cache(out.cache), start, start + width)


def check_fuser_fits(fuser, receiver: LoadedModel, sharer: LoadedModel) -> None:
    """A fuser trained for other geometries would crash mid-encode: refuse up front."""
    rgeo, sgeo = receiver.geometry, sharer.geometry
    for t, pairs in fuser.spec.layer_map.items():
        if t >= rgeo.layers or any(s >= sgeo.layers for s, _ in pairs):
            raise CheckpointError(
                f"Fuser layer map uses receiver layer {t} / sharer layers {[s for s, _ in pairs]}, but the models have "
                f"{rgeo.layers} and {sgeo.layers} layers.",
                f"This fuser was made for {fuser.spec.receiver} <- {fuser.spec.sharer}; use matching models.",
            )
    a = fuser.projectors[0].args
    want = (a.target_num_heads, a.target_dim, a.source_num_heads, a.source_dim)
    have = (rgeo.kv_heads, rgeo.head_dim, sgeo.kv_heads, sgeo.head_dim)
    if want != have:
        raise CheckpointError(
            f"Fuser expects receiver/sharer KV heads x dim {want[0]}x{want[1]} / {want[2]}x{want[3]}, "
            f"the models have {have[0]}x{have[1]} / {have[2]}x{have[3]}.",
            f"This fuser was made for {fuser.spec.receiver} <- {fuser.spec.sharer}; use matching models.",
        )
