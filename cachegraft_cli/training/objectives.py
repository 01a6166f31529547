"""Training items and the loss.

An item is: a passage key, how many of its tokens are in the past (all for
`qa`, the first part for `lm`), and the receiver tokens read after the past:
`ids`, of which the first `n_context` are context (the question) and the rest
are scored. The past is always `prefix (receiver-only) + fused passage(s)`,
the ask-time template; the question is read unfused at explicit positions.

A `qa` item may hold several passages (`layout`: the answer's passage among
distractors), assembled exactly as `ask` does with the `rotate` scheme: each
passage fused on its own at its canonical positions, then its keys re-rotated
to follow the passages before it. Training at k > 1 thus sees what asking at
k > 1 sees.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachegraft_cli import kvcache


@dataclass(frozen=True)
class Item:
    passage: str
    past_tokens: int
    ids: tuple[int, ...]
    n_context: int  # ids[:n_context] are read but not scored
    layout: tuple[tuple[str, int], ...] = ()  # (passage, tokens) in past order; () = `passage` alone

    @property
    def scored(self) -> int:
        return len(self.ids) - self.n_context

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        return self.layout or ((self.passage, self.past_tokens),)


def with_distractors(
    items: list[Item], keys: list[str], lengths: dict[str, int], per_item: int, seed: int
) -> list[Item]:
    """Each item's passage among `per_item - 1` other passages of `keys`, at a random slot (seeded)."""
    if per_item <= 1:
        return items
    rng = random.Random(seed)
    out = []
    for item in items:
        others = rng.sample([k for k in keys if k != item.passage], min(per_item - 1, len(keys) - 1))
        order = others[:]
        order.insert(rng.randrange(len(others) + 1), item.passage)
        layout = tuple((k, lengths[k]) for k in order)
        out.append(dataclasses.replace(item, past_tokens=sum(n for _, n in layout), layout=layout))
    return out


def end_token_id(tokenizer, chat: bool) -> int:
    """The token the model ends an answer with: <|im_end|> (or the template's eos) for chat models."""
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if chat and token in vocab:
            return vocab[token]
    return tokenizer.eos_token_id


def answer_ids(tokenizer, answer: str, end_id: int, max_tokens: int) -> list[int]:
    ids = list(tokenizer(answer.strip(), add_special_tokens=False)["input_ids"])[: max_tokens - 1]
    return ids + [end_id]


def qa_items(questions, template, passage_len: dict[str, int], max_answer_tokens: int) -> list[Item]:
    tok = template.tokenizer
    end = end_token_id(tok, template.chat)
    items = []
    for q in questions:
        if q.passage not in passage_len:
            continue
        qids = template.question_ids(q.question)
        items.append(
            Item(
                q.passage,
                passage_len[q.passage],
                tuple(qids + answer_ids(tok, q.answer, end, max_answer_tokens)),
                len(qids),
            )
        )
    return items


def lm_items(passage_ids: dict[str, list[int]], fused_fraction: float, target_tokens: int) -> list[Item]:
    """Fuse the first part of each passage; score the receiver on the continuation."""
    items = []
    for key, ids in passage_ids.items():
        split = max(4, int(len(ids) * fused_fraction))
        target = ids[split : split + target_tokens]
        if len(target) >= 4:
            items.append(Item(key, split, tuple(target), 1))
    return items


def fused_past(fuser, bank, prefix: list[tuple[torch.Tensor, torch.Tensor]], items: list[Item], zero_sharer: bool,
               rotator=None):
    """Batched past KV `prefix + fused passage(s) (right-padded)` in float32, with the
    past lengths. Gradients flow into the fuser; the models' caches are constants.
    Items with several passages need `rotator` (the receiver's `KeyRotator`)."""
    segments = [part for item in items for part in item.parts]
    passages = _fused_segments(fuser, bank, segments, zero_sharer)
    if len(segments) > len(items):
        passages = _assemble(passages, items, rotator)
    batch_prefix = kvcache.expand_batch(prefix, len(items))
    return kvcache.concat_tokens([batch_prefix, passages]), [i.past_tokens for i in items]


def _fused_segments(fuser, bank, segments: list[tuple[str, int]], zero_sharer: bool):
    """One batch row per (passage, tokens) segment, each fused on its own, right-padded."""
    width = max(n for _, n in segments)
    own_kv = unstack_batched(_pad_stack([bank.get(k)[0][:, :, :, :n] for k, n in segments], width))
    if fuser is None:
        return own_kv
    if zero_sharer:
        return fuser.fuse(own_kv, fuser.zero_sharer_kv(len(segments), width, torch.float32))
    sharer = _pad_stack([bank.get(k)[1][:, :, :, :n] for k, n in segments], width)
    return fuser.fuse(own_kv, unstack_batched(sharer))


def _assemble(segment_kv, items: list[Item], rotator):
    """Segments -> one row per item: its passages in order, keys re-rotated by their offsets."""
    width = max(i.past_tokens for i in items)
    rows, s = [], 0
    for item in items:
        pieces, offset = [], 0
        for _, n in item.parts:
            piece = [(k[s, :, :n], v[s, :, :n]) for k, v in segment_kv]
            pieces.append(rotator.rotate(piece, offset))
            offset, s = offset + n, s + 1
        rows.append([(F.pad(k, (0, 0, 0, width - offset)), F.pad(v, (0, 0, 0, width - offset)))
                     for k, v in kvcache.concat_tokens(pieces)])
    return [(torch.stack([r[layer][0] for r in rows]), torch.stack([r[layer][1] for r in rows]))
            for layer in range(len(segment_kv))]


def _pad_stack(arrays: list[torch.Tensor], width: int) -> torch.Tensor:
    """(layers, 2, heads, tokens, dim) per item -> (layers, 2, batch, heads, width, dim) float32, zero pads."""
    layers, two, heads, _, dim = arrays[0].shape
    out = torch.zeros((layers, two, len(arrays), heads, width, dim), dtype=torch.float32)
    for b, a in enumerate(arrays):
        out[:, :, b, :, : a.shape[3]] = a.float()
    return out


def unstack_batched(t: torch.Tensor):
    return [(t[i, 0], t[i, 1]) for i in range(t.shape[0])]


def batch_nll(receiver, fuser, bank, prefix, items: list[Item], zero_sharer: bool = False) -> tuple[torch.Tensor, int]:
    """Summed NLL of the scored tokens of `items` and their count (one receiver pass).
    The receiver is frozen here: gradients go only into the past KV (the fuser)."""
    if next(receiver.model.parameters()).requires_grad:
        receiver.model.requires_grad_(False)
    rotator = kvcache.KeyRotator.for_model(receiver.model) if any(i.layout for i in items) else None
    past, lengths = fused_past(fuser, bank, prefix, items, zero_sharer, rotator)
    n_prefix = kvcache.num_tokens(prefix)
    width = max(lengths)
    longest = max(len(i.ids) for i in items)
    pad = receiver.tokenizer.pad_token_id or 0
    ids = torch.tensor([list(i.ids) + [pad] * (longest - len(i.ids)) for i in items])
    mask = torch.ones(len(items), n_prefix + width + longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, n_prefix + n : n_prefix + width] = 0  # padded passage slots
    positions = torch.stack([torch.arange(longest) + n_prefix + n for n in lengths])
    if receiver.dtype != torch.float32:
        past = kvcache.cast(past, receiver.dtype)
    cache = kvcache.to_model_cache(past, receiver.model.config)
    base = receiver.model.model if hasattr(receiver.model, "model") else receiver.model
    hidden = base(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    ).last_hidden_state
    rows, cols, labels = _scored_positions(items)
    logits = receiver.model.lm_head(hidden[rows, cols]).float()  # LM head only on scored positions
    return F.cross_entropy(logits, labels, reduction="sum"), len(labels)


def _scored_positions(items: list[Item]):
    rows, cols, labels = [], [], []
    for b, item in enumerate(items):
        for j in range(max(item.n_context, 1), len(item.ids)):
            rows.append(b)
            cols.append(j - 1)  # position j-1 predicts ids[j]
            labels.append(item.ids[j])
    return torch.tensor(rows), torch.tensor(cols), torch.tensor(labels)
