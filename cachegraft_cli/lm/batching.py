"""Continuous batching: a running batch of answers that new questions join between decode steps.

The server keeps one `RunningBatch` per loaded model. A question that arrives while others
decode waits for one decode step, not for their whole answers: it is prefilled on its own (or
with the questions that arrived with it), its first token is picked and streamed at once, and
its cache then joins the batch, left-padded to the batch's width (pads masked out, positions
explicit per row). A row that ends (a stop token, its token limit, its client gone) leaves the
batch at once, and the columns only pads still hold are cut.

A row alone that never shared a batch is decoded with exactly the forward calls `generate`
makes, so a lone question's answer is `cachegraft ask`'s bit for bit. Rows decoded together
agree with it up to float summation order, as `generate_batch`'s rows do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from cachegraft_cli.lm import kvcache
from cachegraft_cli.lm.generation import Prompt, Row, Stepper, decode_row, decode_step, prefill_batch


@dataclass
class _Block:
    """Rows decoded by one forward: their model cache, 2D mask (None: every slot visible to
    every row, no padding) and next RoPE position per row."""

    cache: Any
    mask: torch.Tensor | None
    positions: torch.Tensor


class RunningBatch:
    """The rows one model decodes together; `admit` adds rows, `step` decodes one token of each."""

    def __init__(self, lm):
        self.lm = lm
        self.rows: list[Row] = []
        self.block: _Block | None = None

    def __len__(self) -> int:
        return len(self.rows)

    @torch.inference_mode()
    def admit(self, rows: list[Row]) -> list[Row]:
        """Prefill `rows` together, pick their first tokens, and merge the ones still going into
        the batch. Returns the rows already finished (one-token answers)."""
        t_call = time.perf_counter()
        block, logits = self._prefill([r.prompt for r in rows])
        t_prefill = time.perf_counter()
        for row, row_logits in zip(rows, logits):
            row.begin(self.lm, t_call, t_prefill)
            if not row.done:
                row.take(row_logits)
        going = [i for i, r in enumerate(rows) if not r.done]
        if going:
            block = block if len(going) == len(rows) else _select(block, going, self.lm.model.config)
            self.block = block if self.block is None else _merge(self.block, block, self.lm.model.config)
            self.rows += [rows[i] for i in going]
        return [r for r in rows if r.done]

    @torch.inference_mode()
    def step(self) -> list[Row]:
        """One decode step of every row; returns the rows that ended with it (they leave)."""
        if not self.rows or self.block is None:
            return []
        if len(self.rows) == 1:
            return self._step_alone(self.rows[0])
        b = self.block
        if b.mask is not None:
            b.mask = torch.cat([b.mask, torch.ones(len(self.rows), 1, dtype=torch.long)], dim=1)
        ids = torch.tensor([[r.out[-1]] for r in self.rows])
        b.cache, logits = decode_step(self.lm, b.cache, ids, b.positions[:, None], b.mask)
        b.positions = b.positions + 1
        for row, row_logits in zip(self.rows, logits):
            row.take(row_logits)
        return self._drop_done()

    def _step_alone(self, row: Row) -> list[Row]:
        """A lone row's step, as `generate` takes it: its last token and any drafts copied from
        its prompt (`lm/drafting.py`) in one forward, the drafts greedy decoding would not have
        picked forgotten."""
        b = self.block
        assert b is not None
        b.cache, b.mask, kept = decode_row(self.lm, row, b.cache, b.mask, int(b.positions[0]))
        b.positions = b.positions + kept
        return self._drop_done()

    def _drop_done(self) -> list[Row]:
        done = [r for r in self.rows if r.done]
        if done:
            going = [i for i, r in enumerate(self.rows) if not r.done]
            self.rows = [self.rows[i] for i in going]
            self.block = _select(self.block, going, self.lm.model.config) if going else None
        return done

    def _prefill(self, prompts: list[Prompt]) -> tuple[_Block, torch.Tensor]:
        if len(prompts) == 1:  # `generate`'s own first forward: a lone answer stays the CLI's
            stepper = Stepper(self.lm, prompts[0])
            logits = stepper.first()[None]
            return _Block(stepper.cache, stepper.mask, torch.tensor([stepper.position])), logits
        stepper, logits, next_pos = prefill_batch(self.lm, prompts)
        return _Block(stepper.cache, stepper.mask, next_pos), logits


def _select(block, rows: list[int], config) -> _Block:
    """The block of `rows` only, without the leading columns that none of them sees."""
    index = torch.tensor(rows)
    kv = [(k[index.to(k.device)], v[index.to(v.device)]) for k, v in kvcache.from_model_cache(block.cache)]
    mask = block.mask[index] if block.mask is not None else None
    if mask is not None:
        first = int(mask.any(dim=0).nonzero()[0]) if mask.any() else 0
        kv, mask = kvcache.slice_tokens(kv, first, mask.shape[1]), mask[:, first:]
        kv = [(k.contiguous(), v.contiguous()) for k, v in kv]
    return _Block(kvcache.to_decode_cache(kv, config), mask, block.positions[index])


def _merge(a: _Block, b: _Block, config) -> _Block:
    """Both blocks as one batch: each left-padded to the wider one, pads masked out."""
    kv_a, kv_b = kvcache.from_model_cache(a.cache), kvcache.from_model_cache(b.cache)
    len_a, len_b = kvcache.num_tokens(kv_a), kvcache.num_tokens(kv_b)
    width = max(len_a, len_b)
    kv = [(torch.cat([_pad_left(ka, width), _pad_left(kb, width)]), torch.cat([_pad_left(va, width),
                                                                              _pad_left(vb, width)]))
          for (ka, va), (kb, vb) in zip(kv_a, kv_b)]
    if a.mask is None and b.mask is None and len_a == len_b:
        mask = None
    else:
        mask = torch.cat([_pad_left(_mask_of(a, len_a), width), _pad_left(_mask_of(b, len_b), width)])
    return _Block(kvcache.to_decode_cache(kv, config), mask, torch.cat([a.positions, b.positions]))


def _mask_of(block: _Block, length: int) -> torch.Tensor:
    return block.mask if block.mask is not None else torch.ones(len(block.positions), length, dtype=torch.long)


def _pad_left(x: torch.Tensor, width: int) -> torch.Tensor:
    """Zeros before the token axis (-2 for KV, -1 for masks) up to `width`."""
    axis = -2 if x.dim() == 4 else -1
    missing = width - x.shape[axis]
    if missing == 0:
        return x
    pad = (0, 0, missing, 0) if axis == -2 else (missing, 0)
    return torch.nn.functional.pad(x, pad)
