"""Decoding from a prepared cache with explicit RoPE positions.

The cache slots and the RoPE positions need not agree (the `shared` position
scheme puts several passages at the same positions), so positions are passed
explicitly; the causal mask follows cache slots, which is what we want: the
question sees every cached slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from cachegraft_cli import kvcache
from cachegraft_cli.kvcache import PlainKV


@dataclass
class GenerationConfig:
    max_new_tokens: int = 48
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None


@dataclass
class Generation:
    token_ids: list[int]
    text: str
    prompt_tokens: int
    timings: dict = field(default_factory=dict)  # prefill, first_token, total (seconds)


def stop_ids(lm) -> set[int]:
    """End-of-turn ids of a model, worked out once per loaded model (asked every answer)."""
    cached = getattr(lm, "_stop_ids", None)
    if cached is None:
        cached = lm._stop_ids = _find_stop_ids(lm)
    return cached


def _find_stop_ids(lm) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    unk = lm.tokenizer.unk_token_id
    for token in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        tid = lm.tokenizer.convert_tokens_to_ids(token)  # no get_vocab(): it builds a 150k-entry dict
        if tid is not None and tid != unk:
            ids.add(tid)
    return ids


@torch.inference_mode()
def generate(
    lm,
    past: PlainKV | None,
    input_ids: list[int],
    start_position: int,
    config: GenerationConfig | None = None,
    on_text: Callable[[str], None] | None = None,
    started: float | None = None,
) -> Generation:
    """Generate after `past` (batched KV, batch 1), reading `input_ids` at `start_position`.

    `started` is when the caller began the request, so `first_token` covers
    retrieval and cache loading too.
    """
    config = config or GenerationConfig()
    t_call = time.perf_counter()
    t0 = started if started is not None else t_call
    cache = kvcache.to_model_cache(past, lm.model.config) if past else None
    step = _Stepper(lm, cache, start_position)
    logits = step(input_ids)
    t_prefill = time.perf_counter()
    out, stops, streamer = [], stop_ids(lm), _Streamer(lm.tokenizer, on_text)
    rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    t_first = None
    for _ in range(config.max_new_tokens):
        token = _pick(logits, config, rng)
        t_first = t_first or time.perf_counter()
        if token in stops:
            break
        out.append(token)
        streamer.push(out)
        if len(out) == config.max_new_tokens:
            break  # no forward pass for a token that would never be read
        logits = step([token])
    t_end = time.perf_counter()
    text = lm.tokenizer.decode(out, skip_special_tokens=True).strip()
    timings = {"prefill": t_prefill - t_call, "first_token": (t_first or t_end) - t0, "total": t_end - t0}
    return Generation(out, text, len(input_ids), timings)


class _Stepper:
    """Feeds tokens at explicit positions, growing the cache."""

    def __init__(self, lm, cache, start: int):
        self.lm, self.cache, self.position = lm, cache, start

    def __call__(self, ids: list[int]) -> torch.Tensor:
        device = self.lm.device
        positions = torch.arange(self.position, self.position + len(ids), device=device)[None]
        out = self.lm.model(
            input_ids=torch.tensor([ids], device=device),
            cache=self.cache,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.cache
        self.position += len(ids)
        return out.logits[0, -1].float()


def _pick(logits: torch.Tensor, config: GenerationConfig, rng) -> int:
    if config.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < config.top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))


class _Streamer:
    """Emits the newly decoded text after each token (whole characters only)."""

    def __init__(self, tokenizer, on_text):
        self.tokenizer, self.on_text, self.sent = tokenizer, on_text, 0

    def push(self, ids: list[int]) -> None:
        if self.on_text is None:
            return
        text = self.tokenizer.decode(ids, skip_special_tokens=True)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence: wait for the next token
            return
        self.on_text(text[self.sent :])
        self.sent = len(text)


@torch.inference_mode()
def generate_batch(
    lm, pasts: list[PlainKV | None], inputs: list[list[int]], starts: list[int], config: GenerationConfig | None = None
) -> list[Generation]:
    """Greedy/sampled decoding of several prompts at once, each with its own past.

    Rows are left-padded twice: the pasts to the longest past, the inputs to
    the longest input; pads are masked out, so each row computes what it
    would alone (up to float summation order).
    """
    config = config or GenerationConfig()
    t0 = time.perf_counter()
    past, mask = _pad_pasts(lm, pasts)
    ids, positions, qmask = _pad_inputs(inputs, starts, lm.tokenizer.pad_token_id or 0)
    step = _BatchStepper(lm, kvcache.to_model_cache(past, lm.model.config) if past else None, mask)
    logits = step(ids, positions, qmask)
    t_prefill = time.perf_counter()
    rows = _decode_rows(step, logits, positions[:, -1] + 1, lm, config)
    t_end = time.perf_counter()
    timings = {"prefill": t_prefill - t0, "first_token": t_prefill - t0, "total": t_end - t0}
    return [Generation(out, lm.tokenizer.decode(out, skip_special_tokens=True).strip(), len(q), dict(timings))
            for out, q in zip(rows, inputs)]


def _decode_rows(step, logits, next_pos, lm, config: GenerationConfig) -> list[list[int]]:
    stops = stop_ids(lm)
    rows: list[list[int]] = [[] for _ in range(logits.shape[0])]
    done = [False] * len(rows)
    rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    for n in range(config.max_new_tokens):
        tokens = [_pick(row_logits, config, rng) for row_logits in logits]
        for i, t in enumerate(tokens):
            done[i] = done[i] or t in stops
            if not done[i]:
                rows[i].append(t)
        if all(done) or n + 1 == config.max_new_tokens:
            break
        ones = torch.ones(len(rows), 1, dtype=torch.long)
        logits = step(torch.tensor(tokens)[:, None], next_pos[:, None], ones)
        next_pos = next_pos + 1
    return rows


def _pad_pasts(lm, pasts):
    lengths = [kvcache.num_tokens(p) if p else 0 for p in pasts]
    width = max(lengths)
    if width == 0:
        return None, torch.zeros(len(pasts), 0, dtype=torch.long)
    ref = next(p for p in pasts if p)
    layers = []
    for layer in range(len(ref)):
        k0, v0 = ref[layer]
        k = k0.new_zeros((len(pasts), k0.shape[-3], width, k0.shape[-1]))
        v = v0.new_zeros((len(pasts), v0.shape[-3], width, v0.shape[-1]))
        for i, p in enumerate(pasts):
            if p:
                k[i, :, width - lengths[i] :] = p[layer][0][0]
                v[i, :, width - lengths[i] :] = p[layer][1][0]
        layers.append((k, v))
    mask = torch.tensor([[0] * (width - n) + [1] * n for n in lengths])
    return layers, mask


def _pad_inputs(inputs, starts, pad: int):
    width = max(len(q) for q in inputs)
    ids = torch.tensor([[pad] * (width - len(q)) + list(q) for q in inputs])
    positions = torch.tensor([[s] * (width - len(q)) + list(range(s, s + len(q))) for q, s in zip(inputs, starts)])
    mask = torch.tensor([[0] * (width - len(q)) + [1] * len(q) for q in inputs])
    return ids, positions, mask


class _BatchStepper:
    """Feeds a batch of tokens at explicit positions with a growing 2D mask."""

    def __init__(self, lm, cache, mask):
        self.lm, self.cache, self.mask = lm, cache, mask

    def __call__(self, ids, positions, new_mask) -> torch.Tensor:
        device = self.lm.device
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        out = self.lm.model(
            input_ids=ids.to(device),
            attention_mask=self.mask.to(device),
            cache=self.cache,
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.cache
        return out.logits[:, -1].float()
