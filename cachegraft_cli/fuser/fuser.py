"""A complete fuser: one projector per receiver layer, the layer map, and
the alignment settings, for one (receiver, sharer) pair."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import overload

import torch
from torch import nn

from cachegraft_cli.fuser.layermap import LayerMap, last_aligned
from cachegraft_cli.fuser.projector import C2CProjector, ProjectorArgs
from cachegraft_cli.lm.kvcache import Geometry, PlainKV


@dataclass
class FuserSpec:
    receiver: str
    sharer: str
    layer_map: LayerMap
    alignment: bool = False
    alignment_strategy: str = "first"
    extra: dict = field(default_factory=dict)  # recipe fields kept for round trips
    # "model": the sharer's KV feeds the fuser; "zero": zeros of the sharer geometry
    # (a receiver-only adapter, the control that isolates the sharer's contribution).
    sharer_input: str = "model"


class ProjectorList(nn.ModuleList):
    """`nn.ModuleList` of `C2CProjector`s, typed as such (a plain one yields `nn.Module`s)."""

    @overload
    def __getitem__(self, idx: slice) -> ProjectorList: ...

    @overload
    def __getitem__(self, idx: int) -> C2CProjector: ...

    def __getitem__(self, idx: int | slice) -> C2CProjector | ProjectorList:
        return super().__getitem__(idx)  # type: ignore[return-value]  # holds C2CProjectors only

    def __iter__(self) -> Iterator[C2CProjector]:
        return super().__iter__()  # type: ignore[return-value]


class Fuser(nn.Module):
    def __init__(self, spec: FuserSpec, projector_args: list[ProjectorArgs]):
        super().__init__()
        self.spec = spec
        self.projectors = ProjectorList(C2CProjector(a) for a in projector_args)

    @classmethod
    def create(
        cls, receiver: str, sharer: str, rgeo: Geometry, sgeo: Geometry, *, alignment: bool = False,
        sharer_input: str = "model", **proj_kwargs
    ) -> "Fuser":
        """A fresh fuser with the default last-aligned map (closed gates), in eval mode."""
        layer_map = last_aligned(rgeo.layers, sgeo.layers)
        args = ProjectorArgs(sgeo.head_dim, rgeo.head_dim, sgeo.kv_heads, rgeo.kv_heads, **proj_kwargs)
        spec = FuserSpec(receiver, sharer, layer_map, alignment=alignment, sharer_input=sharer_input)
        return cls(spec, [ProjectorArgs(**args.as_dict()) for _ in range(rgeo.layers)]).eval()

    @property
    def dtype(self) -> torch.dtype:
        return self.projectors[0].key_gate_logit.dtype

    def fuse(self, receiver_kv: PlainKV, sharer_kv: PlainKV) -> PlainKV:
        """Fused receiver KV for the same tokens (batched tensors)."""
        out = []
        for t, (k, v) in enumerate(receiver_kv):
            for s, p in self.spec.layer_map.get(t, []):
                projector = self.projectors[p]
                if projector.training or any(projector.gates().values()):  # a closed projector adds exactly 0
                    k, v = self._fuse_layer(projector, (k, v), sharer_kv[s])
            out.append((k, v))
        return out

    @property
    def zero_sharer(self) -> bool:
        return self.spec.sharer_input == "zero"

    def zero_sharer_kv(self, batch: int, tokens: int, dtype=None, device=None) -> PlainKV:
        """Zeros in the sharer geometry the projectors expect (for `sharer_input="zero"`)."""
        a = self.projectors[0].args
        layers = 1 + max(s for pairs in self.spec.layer_map.values() for s, _ in pairs)
        zero = torch.zeros(batch, a.source_num_heads, tokens, a.source_dim, dtype=dtype or self.dtype, device=device)
        return [(zero, zero)] * layers

    def _fuse_layer(self, projector: C2CProjector, target, source):
        dtype = target[0].dtype
        cast = lambda pair: tuple(x.to(self.dtype) for x in pair)  # noqa: E731
        k, v = projector(cast(source), cast(target))
        return k.to(dtype), v.to(dtype)

    def set_gates(self, logit: float) -> None:
        """Set every gate logit (positive opens, as a trained gate would)."""
        with torch.no_grad():
            for p in self.projectors:
                p.key_gate_logit.fill_(logit)
                p.value_gate_logit.fill_(logit)

    def gate_states(self) -> list[dict]:
        return [
            {
                "projector": i,
                **p.gates(),
                "key_logit": float(p.key_gate_logit.detach()),
                "value_logit": float(p.value_gate_logit.detach()),
            }
            for i, p in enumerate(self.projectors)
        ]

    def fingerprint(self) -> str:
        """Content hash of the weights and the layer map: pins a fuser in store metadata."""
        h = hashlib.sha256(repr(sorted(self.spec.layer_map.items())).encode())
        for name, tensor in sorted(self.state_dict().items()):
            h.update(name.encode())
            h.update(tensor.detach().to(torch.float32).cpu().numpy().tobytes())
        return h.hexdigest()
