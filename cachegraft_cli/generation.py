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
    ids = set()
    for source in (getattr(lm.model, "generation_config", None), lm.model.config, lm.tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update(eos if isinstance(eos, (list, tuple)) else [eos] if eos is not None else [])
    for token in ("<|im_end|>", "<|endoftext|>", "<end_of_turn>", "<|eot_id|>"):
        tid = lm.tokenizer.convert_tokens_to_ids(token) if token in lm.tokenizer.get_vocab() else None
        if tid is not None:
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
