"""How retrieved passages' stored caches become the receiver's past.

Every passage was encoded alone, right after the shared prefix, so at ask time
no passage has attended to the others. Three options make them read together:

- **order**: `retrieval` puts the best passage first (rank order); `best-last`
  reverses it, so the best passage sits next to the question. Text systems use
  the same order, so comparisons stay fair.
- **recompute N** (boundary recompute, after EPIC): the receiver re-reads the
  first N tokens of every passage after the first, attending to the prefix and
  to every passage before it, and their new KV replaces the stored one. N = 0
  is the plain stored-cache path.
- **blend r** (selective recompute, after CacheBlend): besides the boundary,
  the fraction r of the other passage tokens whose KV deviates most from an
  in-context recompute at layer `blend_layer` is recomputed too. Choosing them
  costs a forward of the first layers over every later passage token.

Recomputed tokens are read in the same forward as the question: one pass whose
mask lets each token see exactly what it would see in order (the prefix, the
earlier passages with their recomputed tokens, the tokens before it in its own
passage), and hides the stored copies they replace. Recomputing every passage
token of the receiver's own caches is therefore the `text` system's
computation.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from cachegraft_cli.checks import number, one_of, whole
from cachegraft_cli.errors import UsageError

if TYPE_CHECKING:  # torch is imported where it is used: `cachegraft --help` reads the defaults here
    import torch

    from cachegraft_cli.lm.generation import Prompt
    from cachegraft_cli.lm.kvcache import PlainKV

ORDERS = ("retrieval", "best-last")
SCHEMES = ("rotate", "shared")
DEFAULT_ORDER = "best-last"
DEFAULT_SCHEME = "rotate"
# Off by default: re-reading 16 boundary tokens of each later passage costs the question's forward
# 3-4x its tokens, and at k=5 text/graft time to first token fell from 8.4x to 4.8x, under the 6x
# floor (benchmarks/ttft.py, docs/results.md). It also did not help the default best-last order
# (42 -> 40 EM on squad at k=5); it helped a retrieval-order prompt (17 -> 21 EM).
DEFAULT_RECOMPUTE = 0


@dataclass(frozen=True)
class AssemblyOptions:
    order: str = DEFAULT_ORDER
    scheme: str = DEFAULT_SCHEME
    recompute: int = DEFAULT_RECOMPUTE
    blend: float = 0.0
    blend_layer: int = 1

    def check(self) -> None:
        one_of("passage order", self.order, ORDERS)
        one_of("position scheme", self.scheme, SCHEMES)
        whole("recompute (--recompute)", self.recompute, 0)
        number("blend (--blend)", self.blend, 0.0, 1.0)
        whole("blend_layer (--blend-layer)", self.blend_layer, 0)

    def as_dict(self) -> dict:
        return {
            "order": self.order,
            "scheme": self.scheme,
            "recompute": self.recompute,
            "blend": self.blend,
            "blend_layer": self.blend_layer,
        }


def check_blend_layer(options: AssemblyOptions, layers: int) -> None:
    """A `blend` > 0 compares KV at `blend_layer`, a layer of the receiver (`layers` of them, from
    the store's geometry before any model loads). A layer past the last is refused, not clamped:
    a clamped run would report a setting it did not use."""
    if options.blend > 0 and not options.blend_layer < layers:
        raise UsageError(f"blend_layer (--blend-layer) must be from 0 to {layers - 1}: the receiver has {layers} "
                         f"layers; got {options.blend_layer}.",
                         f"Pass --blend-layer from 0 to {layers - 1}.")


def in_prompt_order(items: Sequence, order: str) -> list:
    """Items in retrieval rank order (best first) -> the order the prompt reads them."""
    return list(reversed(items)) if order == "best-last" else list(items)


@dataclass(frozen=True)
class Layout:
    """Where the prefix and each passage sit in the assembled past (slots and RoPE positions).

    A passage of a pruned store (`encode --keep`) fills fewer slots than it spans
    positions: its stored tokens keep their positions in the passage (`kept`), and the
    next passage, or the question, starts after the whole passage (`spans`), as if the
    dropped tokens were there."""

    prefix_tokens: int
    starts: tuple[int, ...]  # slot of each passage's first token
    lengths: tuple[int, ...]  # slots each passage fills (its stored tokens)
    scheme: str
    spans: tuple[int, ...] = ()  # positions each passage spans (its tokens before pruning); () = lengths
    kept: tuple[tuple[int, ...] | None, ...] = ()  # per passage, its stored tokens' positions; None = 0..n-1

    @classmethod
    def of(cls, prefix_tokens: int, lengths: Sequence[int], scheme: str, kept: Sequence | None = None) -> "Layout":
        """`kept`: per passage None (stored whole) or (positions of its stored tokens, tokens before
        pruning), as `CacheStore.positions` gives them."""
        starts, slot = [], prefix_tokens
        for n in lengths:
            starts.append(slot)
            slot += n
        kept = list(kept) if kept is not None else [None] * len(lengths)
        spans = tuple(n if k is None else int(k[1]) for n, k in zip(lengths, kept))
        positions = tuple(None if k is None else tuple(int(p) for p in k[0]) for k in kept)
        return cls(prefix_tokens, tuple(starts), tuple(lengths), scheme, spans, positions)

    def span(self, index: int) -> int:
        return self.spans[index] if self.spans else self.lengths[index]

    def first_position(self, index: int) -> int:
        """Position of passage `index`'s first token (before pruning)."""
        if self.scheme != "rotate":
            return self.prefix_tokens
        return self.prefix_tokens + sum(self.span(i) for i in range(index))

    def in_passage(self, slot: int) -> tuple[int, int]:
        """(passage, position of the slot's token within its passage) of a passage slot."""
        index = self.passage_of(slot)
        j = slot - self.starts[index]
        kept = self.kept[index] if self.kept else None
        return index, (kept[j] if kept is not None else j)

    @property
    def past_tokens(self) -> int:
        return self.prefix_tokens + sum(self.lengths)

    def offset(self, index: int) -> int:
        """How far passage `index` moves from its canonical positions (0 with `shared`)."""
        return self.first_position(index) - self.prefix_tokens

    def position(self, slot: int) -> int:
        if slot < self.prefix_tokens:
            return slot
        index, within = self.in_passage(slot)
        return self.first_position(index) + within

    def passage_of(self, slot: int) -> int:
        return max(i for i, s in enumerate(self.starts) if s <= slot)

    @property
    def question_start(self) -> int:
        spans = [self.span(i) for i in range(len(self.lengths))]
        if self.scheme == "rotate" or not spans:
            return self.prefix_tokens + sum(spans)
        return self.prefix_tokens + max(spans)

    def passage_slots(self, index: int) -> range:
        return range(self.starts[index], self.starts[index] + self.lengths[index])

    def later_slots(self) -> list[int]:
        """Every slot of every passage after the first."""
        return [s for i in range(1, len(self.lengths)) for s in self.passage_slots(i)]

    def boundary_slots(self, n: int) -> list[int]:
        """The first `n` slots of every passage after the first (the first already read its true context)."""
        return [s for i in range(1, len(self.lengths)) for s in self.passage_slots(i)[:n]]


def visibility(past_tokens: int, hidden: Sequence[int], orders: Sequence[int]) -> torch.Tensor:
    """Which slots each new token sees: `(len(orders), past_tokens + len(orders))` booleans.

    New token i stands at assembled place `orders[i]` (the past slot it
    recomputes, or >= past_tokens for the question); places must increase. It
    sees every past slot up to its place that is not `hidden`, and the new
    tokens up to itself.
    """
    import torch

    order = torch.tensor(list(orders), dtype=torch.long)
    if len(order) > 1 and bool((order[1:] <= order[:-1]).any()):
        raise ValueError("new tokens must be in increasing assembled order")
    shown = torch.ones(past_tokens, dtype=torch.bool)
    shown[list(hidden)] = False
    past = shown[None, :] & (torch.arange(past_tokens)[None, :] <= order[:, None])
    new = torch.ones(len(order), len(order), dtype=torch.bool).tril()
    return torch.cat([past, new], dim=1)


def recompute_prompt(
    past: PlainKV,
    layout: Layout,
    passage_ids: Sequence[Sequence[int]],
    slots: Sequence[int],
    question_ids: Sequence[int],
) -> Prompt:
    """The first forward: the recomputed passage tokens at `slots`, then the question."""
    from cachegraft_cli.lm.generation import Prompt

    slots = sorted(slots)
    if not slots:
        return Prompt.plain(past, list(question_ids), layout.question_start)
    ids = [_token_at(layout, passage_ids, s) for s in slots]
    q0 = layout.question_start
    positions = [layout.position(s) for s in slots] + list(range(q0, q0 + len(question_ids)))
    total = layout.past_tokens
    orders = slots + list(range(total, total + len(question_ids)))
    visible = visibility(total, slots, orders)
    return Prompt(past, ids + list(question_ids), positions, visible, list(slots), len(slots))


def _token_at(layout: Layout, passage_ids, slot: int) -> int:
    index, within = layout.in_passage(slot)
    return passage_ids[index][within]


class Assembler:
    """Builds a question's prompt from the stored caches of its passages (receiver side)."""

    def __init__(self, receiver, prefix: PlainKV):
        from cachegraft_cli.lm import kvcache

        self.receiver = receiver
        self.prefix = prefix  # single (unbatched) prefix KV in the receiver's dtype
        self.rotator = kvcache.KeyRotator.for_model(receiver.model)

    def past(self, arrays, scheme: str, kept: Sequence | None = None) -> tuple[PlainKV, Layout]:
        """Batched past `prefix + passages` (keys re-rotated with `rotate`) and its layout
        (`kept`: the pruned passages' positions, see `Layout.of`)."""
        from cachegraft_cli.lm import kvcache

        r = self.receiver
        layout = Layout.of(kvcache.num_tokens(self.prefix), [len(a) for a in arrays], scheme, kept)
        parts = [self.prefix]
        for i, array in enumerate(arrays):
            kv = kvcache.from_token_major(array, r.dtype, r.device)
            parts.append(self.rotator.rotate(kv, layout.offset(i)))
        return kvcache.batched(kvcache.concat_tokens(parts)), layout

    def prompt(self, arrays, passage_ids, question_ids: list[int], options: AssemblyOptions,
               kept: Sequence | None = None) -> Prompt:
        """`arrays`, `passage_ids` (every token, pruned or not) and `kept` in prompt order."""
        past, layout = self.past(arrays, options.scheme, kept)
        slots = set(layout.boundary_slots(options.recompute))
        if options.blend > 0 and len(arrays) > 1:
            slots |= set(self.blend_slots(past, layout, passage_ids, options, slots))
        return recompute_prompt(past, layout, passage_ids, sorted(slots), question_ids)

    def blend_slots(
        self, past: PlainKV, layout: Layout, passage_ids, options: AssemblyOptions, chosen: set[int]
    ) -> list[int]:
        """CacheBlend's choice: the later-passage tokens whose KV at an early layer moves most
        when recomputed in context (the boundary tokens in `chosen` are taken anyway)."""
        later = layout.later_slots()
        candidates = [s for s in later if s not in chosen]
        count = min(len(candidates), math.ceil(options.blend * len(later)))
        if count == 0:
            return []
        import torch

        from cachegraft_cli.lm import kvcache
        from cachegraft_cli.lm.generation import additive_mask

        r = self.receiver
        total = layout.past_tokens
        check_blend_layer(options, len(past))  # asked before loading too (`Asker.check_options`)
        layer = options.blend_layer
        ids = torch.tensor([[_token_at(layout, passage_ids, s) for s in later]], device=r.device)
        positions = torch.tensor([[layout.position(s) for s in later]], device=r.device)
        mask = additive_mask(visibility(total, later, later), r.dtype).to(r.device)
        with torch.inference_mode():
            new_k, new_v = kvcache.layer_kv(r.model, past, ids, positions, mask, layer)
        old_k, old_v = past[layer][0][..., later, :], past[layer][1][..., later, :]
        deviation = ((new_k.float() - old_k.float()) ** 2).sum(dim=(0, 1, 3))
        deviation += ((new_v.float() - old_v.float()) ** 2).sum(dim=(0, 1, 3))
        index = {s: i for i, s in enumerate(later)}
        scores = torch.stack([deviation[index[s]] for s in candidates])
        return [candidates[i] for i in torch.topk(scores, count).indices.tolist()]
