"""Training items and the loss.

An item is: a passage key, how many of its tokens are in the past (all for
`qa`, the first part for `lm`), and the receiver tokens read after the past:
`ids`, of which the first `n_context` are context (the question) and the rest
are scored. The past is always `prefix (receiver-only) + fused passage(s)`,
the ask-time template; the question is read unfused at explicit positions.

A `qa` item may hold several passages (`layout`: the answer's passage among
others), assembled exactly as `ask` does with the `rotate` scheme: each
passage fused on its own at its canonical positions, then its keys re-rotated
to follow the passages before it. The others are what BM25 retrieves for the
question from the same split (or random passages), in the order `ask` reads
them (`assembly.in_prompt_order`), and an item may carry the passage tokens
that `ask --recompute N` re-reads in context (`recompute`): they are read by
the receiver before the question in the same forward, with the same mask as
at ask time (`assembly.visibility`). Training at k > 1 thus sees what asking
at k > 1 sees.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cachegraft_cli.lm import kvcache


@dataclass(frozen=True)
class Item:
    passage: str
    past_tokens: int
    ids: tuple[int, ...]
    n_context: int  # ids[:n_context] are read but not scored
    layout: tuple[tuple[str, int], ...] = ()  # (passage, tokens) in past order; () = `passage` alone
    recompute: tuple[tuple[int, int], ...] = ()  # (offset in the passages, token id) re-read before the question

    @property
    def scored(self) -> int:
        return len(self.ids) - self.n_context

    @property
    def parts(self) -> tuple[tuple[str, int], ...]:
        return self.layout or ((self.passage, self.past_tokens),)


def with_passages(items: list[Item], keys: list[str], lengths: dict[str, int], mix: Sequence[int], seed: int,
                  ranked: list[list[str]] | None = None, order: str = "best-last") -> list[Item]:
    """Each item's past as `ask -k K` would assemble it, K drawn from `mix` in equal shares (seeded).

    With `ranked` (per item, the split's passages ranked for its question) the
    past is the top K with the answer's passage kept (it replaces the K-th when
    retrieval missed it), in `order`; without, the answer's passage sits among
    K - 1 random others at a random slot."""
    from cachegraft_cli.answering.assembly import in_prompt_order

    rng = random.Random(seed)
    shares = [mix[i % len(mix)] for i in range(len(items))]
    rng.shuffle(shares)
    out = []
    for i, (item, per_item) in enumerate(zip(items, shares)):
        if per_item <= 1:
            out.append(item)
            continue
        if ranked is not None:
            top = [k for k in ranked[i] if k in lengths][:per_item]
            if item.passage not in top:
                top = top[: per_item - 1] + [item.passage]
            order_keys = in_prompt_order(top, order)
        else:
            order_keys = rng.sample([k for k in keys if k != item.passage], min(per_item - 1, len(keys) - 1))
            order_keys.insert(rng.randrange(len(order_keys) + 1), item.passage)
        layout = tuple((k, lengths[k]) for k in order_keys)
        out.append(dataclasses.replace(item, past_tokens=sum(n for _, n in layout), layout=layout))
    return out


def with_recompute(items: list[Item], passage_ids: dict[str, list[int]], n: int) -> list[Item]:
    """The tokens `ask --recompute n` re-reads: the first n of every passage after the first."""
    if n <= 0:
        return items
    out = []
    for item in items:
        tokens, offset = [], 0
        for index, (key, length) in enumerate(item.parts):
            if index > 0:
                tokens += [(offset + j, passage_ids[key][j]) for j in range(min(n, length))]
            offset += length
        out.append(dataclasses.replace(item, recompute=tuple(tokens)))
    return out


def end_token_id(tokenizer, chat: bool) -> int:
    """The token the model ends an answer with: <|im_end|> (or the template's eos) for chat models."""
    vocab = tokenizer.get_vocab()
    for token in ("<|im_end|>", "<|eot_id|>", "<end_of_turn>"):
        if chat and token in vocab:
            return vocab[token]
    return tokenizer.eos_token_id


def answer_ids(tokenizer, answer: str, end_id: int, max_tokens: int) -> list[int]:
    from cachegraft_cli.lm.plaintext import plain_ids

    # dataset text: a control string in an answer must not teach the model to emit the control token
    ids = plain_ids(tokenizer, answer.strip())[: max_tokens - 1]
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
    if receiver.dtype != torch.float32:
        past = kvcache.cast(past, receiver.dtype)
    n_prefix = kvcache.num_tokens(prefix)
    pad = receiver.tokenizer.pad_token_id or 0
    if any(i.recompute for i in items):
        ids, mask, positions = _recompute_inputs(items, n_prefix, max(lengths), pad, receiver.dtype)
    else:
        ids, mask, positions = _plain_inputs(items, lengths, n_prefix, pad)
    cache = kvcache.to_model_cache(past, receiver.model.config)
    base = receiver.model.model if hasattr(receiver.model, "model") else receiver.model
    hidden = base(
        input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True
    ).last_hidden_state
    rows, cols, labels = _scored_positions(items)
    logits = receiver.model.lm_head(hidden[rows, cols]).float()  # LM head only on scored positions
    return F.cross_entropy(logits, labels, reduction="sum"), len(labels)


def _plain_inputs(items: list[Item], lengths: list[int], n_prefix: int, pad: int):
    """Right-padded ids, a 2D mask hiding the padded passage slots, and each item's own positions."""
    width = max(lengths)
    longest = max(len(i.ids) for i in items)
    ids = torch.tensor([list(i.ids) + [pad] * (longest - len(i.ids)) for i in items])
    mask = torch.ones(len(items), n_prefix + width + longest, dtype=torch.long)
    for b, n in enumerate(lengths):
        mask[b, n_prefix + n : n_prefix + width] = 0  # padded passage slots
    positions = torch.stack([torch.arange(longest) + n_prefix + n for n in lengths])
    return ids, mask, positions


def _recompute_inputs(items: list[Item], n_prefix: int, width: int, pad: int, dtype: torch.dtype):
    """Ids `recomputed passage tokens + question + answer` per item, with the 4D mask `ask` uses
    (`assembly.visibility`): the padded passage slots and the replaced stored copies hidden."""
    from cachegraft_cli.answering.assembly import visibility
    from cachegraft_cli.lm.generation import additive_mask

    total = n_prefix + width
    reads = [[t for _, t in i.recompute] + list(i.ids) for i in items]
    longest = max(map(len, reads))
    ids = torch.tensor([r + [pad] * (longest - len(r)) for r in reads])
    visible = torch.zeros(len(items), 1, longest, total + longest, dtype=torch.bool)
    positions = torch.zeros(len(items), longest, dtype=torch.long)
    for b, (item, read) in enumerate(zip(items, reads)):
        slots = [n_prefix + offset for offset, _ in item.recompute]
        end = n_prefix + item.past_tokens
        orders = slots + list(range(total, total + len(item.ids)))
        vis = visibility(total, slots + list(range(end, total)), orders)
        n = len(read)
        visible[b, 0, :n, :total], visible[b, 0, :n, total : total + n] = vis[:, :total], vis[:, total:]
        visible[b, 0, range(n, longest), range(total + n, total + longest)] = True  # pads see themselves
        positions[b] = torch.tensor(slots + list(range(end, end + longest - len(slots))))
    return ids, additive_mask(visible, dtype), positions


def _scored_positions(items: list[Item]):
    rows, cols, labels = [], [], []
    for b, item in enumerate(items):
        shift = len(item.recompute)  # recomputed passage tokens are read before the question
        for j in range(max(item.n_context, 1), len(item.ids)):
            rows.append(b)
            cols.append(shift + j - 1)  # position j-1 predicts ids[j]
            labels.append(item.ids[j])
    return torch.tensor(rows), torch.tensor(cols), torch.tensor(labels)
