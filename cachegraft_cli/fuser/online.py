"""The online C2C reference: how C2C itself runs a prompt cut into sections.

Each section is read by the receiver with its running cache; the sharer reads
the same sections at the same positions. After a *fused* section, the
receiver's cache slice for that section is overwritten by the fuser output.
Later sections (and generation) attend to the fused slice. This is the reference
the exactness tests hold stored caches to (a stored fused cache read back must
give what running C2C online gives); nothing in the package imports it.
"""

from __future__ import annotations

import torch

from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.align import TokenAligner
from cachegraft_cli.lm.generation import Generation, GenerationOptions, Prompt, generate
from cachegraft_cli.lm.models import LoadedModel

Section = tuple[list[int], bool]  # (receiver token ids, fused?)


@torch.inference_mode()
def online_prefill(receiver: LoadedModel, sharer: LoadedModel | None, fuser, sections: list[Section]):
    """Run all but the last section; return (receiver plain KV, position after them)."""
    if fuser is not None and sharer is None:
        raise ValueError("online C2C with a fuser needs the sharer")
    aligner = None
    if fuser is not None and sharer is not None:
        aligner = TokenAligner(receiver.tokenizer, sharer.tokenizer, _strategy(fuser))
    last_fused = max((i for i, (_, fused) in enumerate(sections[:-1]) if fused), default=-1)
    r_cache = s_cache = None
    for i, (ids, fused) in enumerate(sections[:-1]):
        start = r_cache.get_seq_length() if r_cache is not None else 0
        r_cache = _forward(receiver, ids, r_cache)
        if aligner is None or sharer is None or i > last_fused:
            continue
        s_cache = _forward(sharer, aligner.align(ids), s_cache)
        if fused:
            _overwrite_fused(r_cache, s_cache, fuser, start, start + len(ids))
    kv = kvcache.from_model_cache(r_cache) if r_cache is not None else None
    return kv, (r_cache.get_seq_length() if r_cache is not None else 0)


def online_generate(
    receiver: LoadedModel,
    sharer: LoadedModel | None,
    fuser,
    sections: list[Section],
    config: GenerationOptions | None = None,
) -> Generation:
    """Generate after the sections; the last section (the question) is receiver-only."""
    past, position = online_prefill(receiver, sharer, fuser, sections)
    return generate(receiver, Prompt.plain(past, sections[-1][0], position), config)


@torch.inference_mode()
def online_logits(receiver: LoadedModel, sharer: LoadedModel | None, fuser, sections: list[Section]) -> torch.Tensor:
    """Receiver logits over the last section's tokens, `(tokens, vocab)`."""
    past, position = online_prefill(receiver, sharer, fuser, sections)
    ids = sections[-1][0]
    cache = kvcache.to_model_cache(past, receiver.model.config) if past else None
    positions = torch.arange(position, position + len(ids), device=receiver.device)[None]
    out = receiver.model(input_ids=torch.tensor([ids], device=receiver.device), cache=cache, position_ids=positions)
    return out.logits[0].float()


def _strategy(fuser) -> str:
    return fuser.spec.alignment_strategy if fuser.spec.alignment else "first"


def _forward(lm: LoadedModel, ids: list[int], cache):
    out = lm.model(input_ids=torch.tensor([ids], device=lm.device), cache=cache, use_cache=True, logits_to_keep=1)
    return out.cache


def _overwrite_fused(r_cache, s_cache, fuser, start: int, end: int) -> None:
    receiver_kv = kvcache.slice_tokens(kvcache.from_model_cache(r_cache), start, end)
    sharer_kv = kvcache.slice_tokens(kvcache.from_model_cache(s_cache), start, end)
    fused = fuser.fuse(receiver_kv, sharer_kv)
    kvcache.write_tokens(r_cache, fused, start)
