"""Training items and the loss.

An item is: a passage key, how many of its tokens are in the past (all for
`qa`, the first part for `lm`), and the receiver tokens read after the past:
`ids`, of which the first `n_context` are context (the question) and the rest
are scored. The past is always `prefix (receiver-only) + fused passage`, the
ask-time template; the question is read unfused at explicit positions.
"""

from __future__ import annotations

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

    @property
    def scored(self) -> int:
        return len(self.ids) - self.n_context


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
        items.append(Item(q.passage, passage_len[q.passage], tuple(qids + answer_ids(tok, q.answer, end, max_answer_tokens)), len(qids)))
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


def fused_past(fuser, bank, prefix: list[tuple[torch.Tensor, torch.Tensor]], items: list[Item], zero_sharer: bool):
    """Batched past KV `prefix + fused passage (right-padded)` in float32, with the
    passage lengths. Gradients flow into the fuser; the models' caches are constants."""
    width = max(i.past_tokens for i in items)
    own = _pad_stack([bank.get(i.passage)[0][:, :, :, : i.past_tokens] for i in items], width)
    own_kv = unstack_batched(own)
    if fuser is None:
        passage = own_kv
    elif zero_sharer:
        passage = fuser.fuse(own_kv, fuser.zero_sharer_kv(len(items), width, torch.float32))
    else:
        sharer = _pad_stack([bank.get(i.passage)[1][:, :, :, : i.past_tokens] for i in items], width)
        passage = fuser.fuse(own_kv, unstack_batched(sharer))
    batch_prefix = kvcache.expand_batch(prefix, len(items))
    return kvcache.concat_tokens([batch_prefix, passage]), [i.past_tokens for i in items]


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
    past, lengths = fused_past(fuser, bank, prefix, items, zero_sharer)
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
    hidden = base(input_ids=ids, attention_mask=mask, position_ids=positions, cache=cache, use_cache=True).last_hidden_state
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
