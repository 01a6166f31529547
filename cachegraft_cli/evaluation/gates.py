"""What a fuser does to the receiver's KV, layer by layer (`cachegraft fuser info --gates`).

For each receiver layer, over a sample of passages:
- the gates of the projectors that write it (a closed gate adds exactly nothing);
- the *residual*: |fused - own| / |own|, how far the fused KV moves from the receiver's own;
- the *sharer dependence*: |fused - fused with a donor| / |fused - own|, how much of that move
  changes when the sharer reads another passage (the donors of `encode --mismatched-sharer`).
  Near 0, the layer's residual is the same whatever the sharer read: the fuser has learned a
  fixed correction (an adapter), not to pass the sharer's content on. An adapter fuser (fed
  zeros) has no sharer dependence by construction; it is reported as None.
Norms are Frobenius norms over every token of every passage (pads excluded), keys and values
apart.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cachegraft_cli.errors import UsageError


@dataclass
class _Sums:
    own: float = 0.0
    residual: float = 0.0
    swapped: float = 0.0

    def add(self, own: torch.Tensor, fused: torch.Tensor, donor_fused: torch.Tensor | None) -> None:
        own, fused = own.float(), fused.float()
        self.own += float(own.pow(2).sum())
        self.residual += float((fused - own).pow(2).sum())
        if donor_fused is not None:
            self.swapped += float((fused - donor_fused.float()).pow(2).sum())

    def report(self, sharer_fed: bool) -> dict:
        residual = (self.residual / self.own) ** 0.5 if self.own else 0.0
        dependence = (self.swapped / self.residual) ** 0.5 if sharer_fed and self.residual else None
        shown = None if dependence is None else round(dependence, 6)
        return {"residual": round(residual, 6), "sharer_dependence": shown}


def gate_report(session, passages: list, limit: int = 32, batch_size: int = 8, max_tokens: int = 512) -> dict:
    """Per receiver layer: gates, residual and sharer dependence of `session`'s fuser over the
    first `limit` of `passages` (cut to `max_tokens` tokens each)."""
    from cachegraft_cli.encoding.donors import donor_tokens, pick_donors

    fuser = session.fuser
    if fuser is None:
        raise UsageError("A closed fuser adds nothing: there is no residual to report.", "Give a fuser checkpoint.")
    template, sample = session.template, list(passages)[:limit]
    ids = [template.passage_ids(p.title, p.text)[:max_tokens] for p in sample]
    sharer_fed = not fuser.zero_sharer
    donors = None
    if sharer_fed:
        picked = pick_donors([p.id for p in sample], [p.title for p in sample], [len(i) for i in ids])
        donors = [donor_tokens(ids[d], len(ids[i])) for i, d in enumerate(picked)]
    layers = session.receiver.geometry.layers
    sums = [(_Sums(), _Sums()) for _ in range(layers)]
    fusion = session.fusion()
    for start in range(0, len(ids), batch_size):
        batch = ids[start : start + batch_size]
        fused = fusion.fuse(batch)
        swapped = fusion.fuse(batch, donors=donors[start : start + batch_size]) if donors else [None] * len(batch)
        for kv, other in zip(fused, swapped):
            for t in range(layers):
                for part in (0, 1):  # keys, values
                    sums[t][part].add(kv.own[t][part], kv.fused[t][part], other.fused[t][part] if other else None)
    return {"fuser": session.choice.fuser, "passages": len(sample), "tokens": sum(len(i) for i in ids),
            "layers": [_layer_row(t, fuser, sums[t], sharer_fed) for t in range(layers)]}


def _layer_row(t: int, fuser, sums: tuple[_Sums, _Sums], sharer_fed: bool) -> dict:
    projectors = [p for _, p in fuser.spec.layer_map.get(t, [])]
    gates = [fuser.projectors[p].gates() for p in projectors]
    return {"layer": t, "projectors": projectors,
            "key_gate": any(g["key"] for g in gates), "value_gate": any(g["value"] for g in gates),
            "key": sums[0].report(sharer_fed), "value": sums[1].report(sharer_fed)}


def inspect_gates(spec: str, corpus: str, *, limit: int = 32, preset: str | None = None, receiver: str | None = None,
                  sharer: str | None = None, device: str | None = None, dtype: str | None = None) -> dict:
    """`gate_report` of the fuser `spec` over the passages of `corpus` (a corpus file as `encode`
    reads it). The models: `receiver` and `sharer` where given, else those of the preset that
    ships `spec` (or `preset`). The corpus, the models' names and `limit` are checked before any
    model loads."""
    from cachegraft_cli.checks import whole
    from cachegraft_cli.config import PRESETS, get_preset
    from cachegraft_cli.corpus import read_corpus
    from cachegraft_cli.encoding.plan import check_corpus
    from cachegraft_cli.session import ModelChoice, ModelSession

    whole("limit (--limit)", limit, 2, 1 << 20)
    shipped = get_preset(preset) if preset else next(
        (p for p in PRESETS.values() if spec in (p.fuser, p.adapter_fuser)), None)
    receiver = receiver or (shipped.receiver if shipped else None)
    sharer = sharer or (shipped.sharer if shipped else None)
    if not receiver:
        raise UsageError(f"No preset ships {spec}, so its models are not known.",
                         "Name them with --receiver and --sharer (or --preset).")
    reader = read_corpus(corpus)
    if check_corpus(reader) < 2:
        raise UsageError(f"{corpus} holds one passage; the report compares passages with each other.",
                         "Give a corpus of at least two passages.")
    choice = ModelChoice(receiver, sharer, spec, device=device, dtype=dtype).check()
    return gate_report(ModelSession(choice), list(_first(reader, limit)), limit)


def _first(passages, n: int):
    for i, passage in enumerate(passages):
        if i == n:
            return
        yield passage
