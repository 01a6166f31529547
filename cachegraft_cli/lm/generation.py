"""Decoding from a prepared cache with explicit RoPE positions.

The cache slots and the RoPE positions need not agree (the `shared` position
scheme puts several passages at the same positions), so positions are passed
explicitly; the causal mask follows cache slots, which is what we want: the
question sees every cached slot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from cachegraft_cli.lm import decoder, kvcache
from cachegraft_cli.lm.drafting import CopyDrafter
from cachegraft_cli.lm.kvcache import PlainKV
from cachegraft_cli.lm.sampling import GenerationOptions


@dataclass
class Prompt:
    """What the receiver reads in its first forward after a past.

    `ids` are read at `positions`. With `visible` None every id sees the whole
    past and the ids before it (plain causal). Otherwise `visible` is a boolean
    `(len(ids), past slots + len(ids))` matrix saying which slots each id sees,
    and `hidden` lists past slots that the answer must not see: stored passage
    tokens that `ids` recompute in context (see `assembly.py`).
    """

    past: PlainKV | None
    ids: list[int]
    positions: list[int]
    visible: torch.Tensor | None = None
    hidden: list[int] = field(default_factory=list)
    recomputed: int = 0  # how many of `ids` (the first ones) are recomputed passage tokens
    # the token ids greedy answers copy drafts from (`drafting.py`); None: `ids`. A callable is
    # called once the first token is out (a stored-cache prompt re-tokenizes its passages then)
    source: Sequence[int] | Callable[[], Sequence[int]] | None = None

    @classmethod
    def plain(cls, past: PlainKV | None, ids: list[int], start: int) -> "Prompt":
        return cls(past, list(ids), list(range(start, start + len(ids))))

    @property
    def past_tokens(self) -> int:
        return kvcache.num_tokens(self.past) if self.past else 0

    @property
    def question_tokens(self) -> int:
        return len(self.ids) - self.recomputed

    @property
    def end_position(self) -> int:
        """The position after the last id: where generated tokens go."""
        return self.positions[-1] + 1 if self.positions else 0


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


# Two logits closer than this many units in the last place (of the model's dtype, at the top logit),
# or than CLOSE_CALL_FLOOR, are a close call a several-token forward leaves to a one-token step
# (`Row.take_checked`). Measured on the offline receiver (2026-12-07, AVX512-BF16): a forward of 8
# tokens moved single logits from the one-token step's by at most 0.25 in bf16 (2 units at the top
# logit) and 2.5e-5 in float32 (where the floor, 40 times that, decides).
CLOSE_CALL_ULPS = 4
CLOSE_CALL_FLOOR = 1e-3


@dataclass(eq=False)
class Row:
    """One answer being decoded (by `generate`, or in `batching.RunningBatch`). `started` is when
    its request began (for `first_token`); `cancelled()` true ends it after the current token;
    `tag` is the caller's."""

    prompt: Prompt
    config: GenerationOptions
    on_text: Callable[[str], None] | None = None
    cancelled: Callable[[], bool] | None = None
    started: float | None = None
    tag: Any = None
    out: list[int] = field(default_factory=list)
    done: bool = False
    timings: dict = field(default_factory=dict)

    def begin(self, lm, t_call: float, t_prefill: float) -> None:
        self.t0 = self.started if self.started is not None else t_call
        self.timings["prefill"] = t_prefill - t_call
        self.stops, self.streamer = stop_ids(lm), _Streamer(lm.tokenizer, self.on_text)
        seed = self.config.seed
        self.rng = torch.Generator().manual_seed(seed) if seed is not None else None
        self.t_first: float | None = None
        self.done = self.config.max_new_tokens <= 0
        greedy = self.config.temperature <= 0 and self.config.draft_tokens > 0
        source = self.prompt.source if self.prompt.source is not None else self.prompt.ids
        self.drafter = CopyDrafter(source, self.config.draft_tokens) if greedy else None
        self.near = CLOSE_CALL_ULPS * torch.finfo(lm.dtype).eps  # a close call's margin, per logit
        self.alone_next = False

    def drafts(self) -> list[int]:
        """Tokens to check with the next step after the last one (`drafting.py`): none when
        sampling, drafting is off, the answer's last tokens are nowhere in the source, or the
        step before left a close call to a one-token step."""
        if self.drafter is None or self.alone_next:
            self.alone_next = False
            return []
        return self.drafter.draft(self.out, self.config.max_new_tokens - len(self.out))

    def take_checked(self, logits: torch.Tensor, drafts: list[int]) -> int:
        """Take the choices of a step that fed the last token and then `drafts`: `logits`
        `(1 + len(drafts), vocab)`, each the next token's after the tokens fed before it. A
        choice counts while the drafts before it were the choices; returns how many fed tokens
        the cache must forget (the drafts after the first that greedy decoding did not pick).

        A several-token forward rounds otherwise than a one-token step (by up to 2 units in the
        last place of the model's dtype at the top logit, measured in bf16: docs/results.md,
        "Copied drafts"), so where the two best logits are closer than CLOSE_CALL_ULPS such
        units the choice is left to a one-token step: that token is forgotten too and fed again
        alone."""
        for i, row_logits in enumerate(logits):
            if drafts and self._close_call(row_logits):
                self.alone_next = True
                return len(drafts) + 1 - i
            self.take(row_logits)
            if self.done or i == len(drafts) or self.out[-1] != drafts[i]:
                return len(drafts) - i
        return 0

    def _close_call(self, logits: torch.Tensor) -> bool:
        top = torch.topk(logits, 2).values
        return bool(top[0] - top[1] < max(self.near * abs(float(top[0])), CLOSE_CALL_FLOOR))

    def take(self, logits: torch.Tensor) -> None:
        """Pick the next token from `logits`: a stop token ends the row; any other is kept and
        streamed, and the token limit or `cancelled()` then ends it."""
        token = pick_token(logits, self.config, self.rng)
        self.t_first = self.t_first or time.perf_counter()
        if token in self.stops:
            self.done = True
            return
        self.out.append(token)
        self.streamer.push(self.out)
        stopped = self.cancelled is not None and self.cancelled()
        self.done = len(self.out) >= self.config.max_new_tokens or stopped

    def generation(self, tokenizer) -> Generation:
        t_end = time.perf_counter()
        text = tokenizer.decode(self.out, skip_special_tokens=True).strip()
        timings = {**self.timings, "first_token": (self.t_first or t_end) - self.t0, "total": t_end - self.t0}
        return Generation(list(self.out), text, self.prompt.question_tokens, timings)


@torch.inference_mode()
def generate(
    lm,
    prompt: Prompt,
    config: GenerationOptions | None = None,
    on_text: Callable[[str], None] | None = None,
    started: float | None = None,
    cancelled: Callable[[], bool] | None = None,
) -> Generation:
    """Generate after `prompt.past` (batched KV, batch 1), reading `prompt.ids` first.

    `started` is when the caller began the request, so `first_token` covers
    retrieval and cache loading too. `cancelled()` true stops decoding after the
    current token (a server's client went away).
    """
    config = config or GenerationOptions()
    t_call = time.perf_counter()
    step = Stepper(lm, prompt)
    logits = step.first()
    row = Row(prompt, config, on_text, cancelled, started)
    row.begin(lm, t_call, time.perf_counter())
    row.take(logits)
    while not row.done:  # no forward pass for a token that would never be read
        step.advance(row)
    return row.generation(lm.tokenizer)


@torch.inference_mode()
def prompt_logits(lm, prompt: Prompt) -> torch.Tensor:
    """Float32 logits at every question token of `prompt` (its first forward), `(tokens, vocab)`."""
    cache = kvcache.to_model_cache(prompt.past, lm.model.config) if prompt.past else None
    kwargs = {}
    if prompt.visible is not None:
        kwargs["attention_mask"] = additive_mask(prompt.visible, lm.dtype).to(lm.device)
    out = lm.model(input_ids=torch.tensor([prompt.ids], device=lm.device), cache=cache,
                   position_ids=torch.tensor([prompt.positions], device=lm.device), **kwargs)
    return out.logits[0, prompt.recomputed :].float()


def additive_mask(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Boolean visibility `(..., queries, keys)` -> the additive 4D mask transformers takes as is."""
    mask = torch.zeros(visible.shape, dtype=dtype)
    mask.masked_fill_(~visible, torch.finfo(dtype).min)
    return mask if mask.dim() == 4 else mask.view(-1, 1, *mask.shape[-2:])


class Stepper:
    """Feeds tokens at explicit positions, growing the cache.

    A prompt with a visibility matrix gets it as a 4D mask in the first
    forward; afterwards a 2D mask keeps its hidden slots out of sight.
    """

    def __init__(self, lm, prompt: Prompt):
        self.lm, self.prompt = lm, prompt
        self.cache = kvcache.to_decode_cache(prompt.past, lm.model.config)
        self.position = prompt.end_position
        self.mask: torch.Tensor | None = None

    def first(self) -> torch.Tensor:
        p, device = self.prompt, self.lm.device
        kwargs: dict[str, torch.Tensor] = {}
        if p.visible is not None:
            kwargs["attention_mask"] = additive_mask(p.visible, self.lm.dtype).to(device)
            seen = torch.ones(p.past_tokens + len(p.ids), dtype=torch.long)
            seen[p.hidden] = 0
            self.mask = seen[None]
        return self._forward(p.ids, torch.tensor([p.positions], device=device), **kwargs)

    def __call__(self, ids: list[int]) -> torch.Tensor:
        """Float32 logits `(vocab,)` of the token after `ids`, fed at the next positions."""
        positions = torch.arange(self.position, self.position + len(ids))[None]
        self.position += len(ids)
        if self.mask is not None:
            self.mask = torch.cat([self.mask, torch.ones(1, len(ids), dtype=torch.long)], dim=1)
        self.cache, logits = row_step(self.lm, self.cache, ids, positions, self.mask)
        return logits[-1]

    def advance(self, row: "Row") -> None:
        """One decode step of `row` (`decode_row`)."""
        self.cache, self.mask, kept = decode_row(self.lm, row, self.cache, self.mask, self.position)
        self.position += kept

    def _forward(self, ids: list[int], positions: torch.Tensor, **kwargs) -> torch.Tensor:
        out = self.lm.model(
            input_ids=torch.tensor([ids], device=self.lm.device),
            cache=self.cache,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        self.cache = out.cache
        return out.logits[0, -1].float()


def row_step(lm, cache, ids: list[int], positions: torch.Tensor,
             mask: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    """One row's step after `cache`: `ids` (its last token, then any drafts) at `positions`
    `(1, len(ids))`, `mask` `(1, slots)` of what it sees (None: everything, the new ids
    included). Returns the cache and float32 logits `(len(ids), vocab)`, the next token's after
    each id. One id is `decode_step`; several are one forward of the model."""
    if len(ids) == 1:
        cache, logits = decode_step(lm, cache, torch.tensor([ids]), positions, mask)
        return cache, logits
    device = lm.device
    lean = decoder.for_model(lm.model)
    if lean is not None and cache is not None:
        return cache, lean.run(cache, torch.tensor([ids], device=device), positions.to(device), mask)[0].float()
    kwargs = {} if mask is None else {"attention_mask": mask.to(device)}
    out = lm.model(input_ids=torch.tensor([ids], device=device), cache=cache, position_ids=positions.to(device),
                   use_cache=True, logits_to_keep=len(ids), **kwargs)
    return out.cache, out.logits[0].float()


def decode_row(lm, row: Row, cache, mask: torch.Tensor | None, position: int):
    """One decode step of a lone row: its last token and any drafts copied from its prompt
    (`Row.drafts`) fed from `position` in one forward, its choices taken (`Row.take_checked`),
    the fed tokens greedy decoding did not keep cropped from the cache (in place: a growing
    layer keeps its buffer) and the mask. Returns (cache, mask `(1, slots)` or None, tokens
    kept). `generate` and `batching.RunningBatch` both step a lone row with it."""
    fed = [row.out[-1], *row.drafts()]
    if mask is not None:
        mask = torch.cat([mask, torch.ones(1, len(fed), dtype=torch.long)], dim=1)
    positions = torch.arange(position, position + len(fed))[None]
    cache, logits = row_step(lm, cache, fed, positions, mask)
    unused = row.take_checked(logits, fed[1:])
    if unused:
        cache.crop(-unused)  # transformers' crop takes the count to remove, negated
        mask = None if mask is None else mask[:, :-unused]
    return cache, mask, len(fed) - unused


def decode_step(lm, cache, ids: torch.Tensor, positions: torch.Tensor,
                mask: torch.Tensor | None) -> tuple[Any, torch.Tensor]:
    """One new token per row after `cache`: `ids` and `positions` `(rows, 1)`, `mask` the 2D
    mask `(rows, slots)` of what each row sees (None: everything). Returns the cache and float32
    logits `(rows, vocab)`. Runs `lm/decoder.py`'s lean step where the model is one it runs, else
    the model's forward."""
    device = lm.device
    lean = decoder.for_model(lm.model)
    if lean is not None and cache is not None:
        return cache, lean.step(cache, ids.to(device), positions.to(device), mask).float()
    kwargs = {} if mask is None else {"attention_mask": mask.to(device)}
    out = lm.model(input_ids=ids.to(device), cache=cache, position_ids=positions.to(device), use_cache=True,
                   logits_to_keep=1, **kwargs)
    return out.cache, out.logits[:, -1].float()


def pick_token(logits: torch.Tensor, config: GenerationOptions, rng) -> int:
    if config.temperature <= 0:
        return int(torch.argmax(logits))
    probs = torch.softmax(logits / config.temperature, dim=-1)
    if config.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < config.top_p
        # The most likely token is always in the nucleus: a top_p that rounds to 0 in the logits'
        # dtype (1e-300 in float32) would keep none, and sampling from all zeros fails. For any
        # top_p the dtype can hold, 0 < top_p already keeps it, so other draws are unchanged.
        keep[0] = True
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=rng))


@dataclass
class RowStreams:
    """Per row of a batched decode: who hears its text (`on_text[i]`, or None), and
    `stopped(i)`, true once row i is no longer wanted (it then decodes no further)."""

    on_text: list[Callable[[str], None] | None]
    stopped: Callable[[int], bool] = lambda i: False


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
def generate_batch(lm, prompts: list[Prompt], config: GenerationOptions | None = None,
                   streams: RowStreams | None = None) -> list[Generation]:
    """Greedy/sampled decoding of several prompts at once, each with its own past.

    Rows are left-padded twice: the pasts to the longest past, the inputs to
    the longest input; pads (and each prompt's hidden slots) are masked out, so
    each row computes what it would alone (up to float summation order).
    `streams` hears each row's text as it is decoded and can stop a row.
    """
    config = config or GenerationOptions()
    t0 = time.perf_counter()
    step, logits, next_pos = prefill_batch(lm, prompts)
    t_prefill = time.perf_counter()
    rows = _decode_rows(step, logits, next_pos, lm, config, streams)
    t_end = time.perf_counter()
    timings = {"prefill": t_prefill - t0, "first_token": t_prefill - t0, "total": t_end - t0}
    decode = lm.tokenizer.decode
    return [Generation(out, decode(out, skip_special_tokens=True).strip(), p.question_tokens, dict(timings))
            for out, p in zip(rows, prompts)]


def prefill_batch(lm, prompts: list[Prompt]):
    """The first forward of several prompts together: (stepper, last logits `(batch, vocab)`,
    next positions `(batch,)`). Rows are left-padded (see `generate_batch`)."""
    past, past_mask = _pad_pasts([p.past for p in prompts])
    ids, positions, qmask = _pad_inputs(prompts, lm.tokenizer.pad_token_id or 0)
    for row, p in enumerate(prompts):  # hidden slots move right by the row's left padding
        past_mask[row, [past_mask.shape[1] - p.past_tokens + h for h in p.hidden]] = 0
    step = _BatchStepper(lm, kvcache.to_decode_cache(past, lm.model.config), past_mask)
    if any(p.visible is not None for p in prompts):
        logits = step.first(ids, positions, qmask, _batch_visibility(prompts, past_mask, qmask))
    else:
        logits = step(ids, positions, qmask)
    return step, logits, positions[:, -1] + 1


def _decode_rows(step, logits, next_pos, lm, config: GenerationOptions,
                 streams: RowStreams | None = None) -> list[list[int]]:
    stops = stop_ids(lm)
    rows: list[list[int]] = [[] for _ in range(logits.shape[0])]
    done = [False] * len(rows)
    rng = torch.Generator().manual_seed(config.seed) if config.seed is not None else None
    streamers = [_Streamer(lm.tokenizer, on_text) for on_text in streams.on_text] if streams else []
    for n in range(config.max_new_tokens):
        tokens = [pick_token(row_logits, config, rng) for row_logits in logits]
        for i, t in enumerate(tokens):
            done[i] = done[i] or t in stops or (streams is not None and streams.stopped(i))
            if not done[i]:
                rows[i].append(t)
                if streamers:
                    streamers[i].push(rows[i])
        if all(done) or n + 1 == config.max_new_tokens:
            break
        ones = torch.ones(len(rows), 1, dtype=torch.long)
        logits = step(torch.tensor(tokens)[:, None], next_pos[:, None], ones)
        next_pos = next_pos + 1
    return rows


def _pad_pasts(pasts: list[PlainKV | None]):
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


def _pad_inputs(prompts: list[Prompt], pad: int):
    width = max(len(p.ids) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p.ids)) + list(p.ids) for p in prompts])
    positions = torch.tensor([[p.positions[0]] * (width - len(p.ids)) + list(p.positions) for p in prompts])
    mask = torch.tensor([[0] * (width - len(p.ids)) + [1] * len(p.ids) for p in prompts])
    return ids, positions, mask


def _batch_visibility(prompts: list[Prompt], past_mask: torch.Tensor, qmask: torch.Tensor) -> torch.Tensor:
    """(batch, 1, inputs, past + inputs): each row's own visibility moved to its padded place.
    Rows without one see what a plain causal prompt sees; pad queries see only themselves."""
    batch, width = qmask.shape
    past_width = past_mask.shape[1]
    out = torch.zeros(batch, 1, width, past_width + width, dtype=torch.bool)
    for row, p in enumerate(prompts):
        n, q0, p0 = len(p.ids), width - len(p.ids), past_width - p.past_tokens
        if p.visible is not None:
            out[row, 0, q0:, p0:past_width] = p.visible[:, : p.past_tokens]
            out[row, 0, q0:, past_width + q0 :] = p.visible[:, p.past_tokens :]
        else:
            out[row, 0, q0:, :past_width] = past_mask[row].bool()
            out[row, 0, q0:, past_width + q0 :] = torch.ones(n, n, dtype=torch.bool).tril()
        for q in range(q0):
            out[row, 0, q, past_width + q] = True
    return out


class _BatchStepper:
    """Feeds a batch of tokens at explicit positions with a growing 2D mask."""

    def __init__(self, lm, cache, mask):
        self.lm, self.cache, self.mask = lm, cache, mask

    def first(self, ids, positions, new_mask, visible) -> torch.Tensor:
        """The first forward with a 4D mask; later steps use the 2D mask of what stays visible."""
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        return self._forward(ids, positions, additive_mask(visible, self.lm.dtype))

    def __call__(self, ids, positions, new_mask) -> torch.Tensor:
        self.mask = torch.cat([self.mask, new_mask], dim=1)
        if ids.shape[1] == 1:
            self.cache, logits = decode_step(self.lm, self.cache, ids, positions, self.mask)
            return logits
        return self._forward(ids, positions, self.mask)

    def _forward(self, ids, positions, mask) -> torch.Tensor:
        device = self.lm.device
        out = self.lm.model(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            cache=self.cache,
            position_ids=positions.to(device),
            use_cache=True,
            logits_to_keep=1,
        )
        self.cache = out.cache
        return out.logits[:, -1].float()
