"""The trainable fuser: exactly `Fuser.create` (docs/method.md section 1), plus two
training-time devices that leave the saved architecture untouched:

- the projection output (`proj_out` weight and bias) starts at zero, so step 0
  computes exactly the receiver's own cache whatever the gates do;
- the in-projection sees inputs scaled by fixed per-layer constants
  (1/RMS of receiver and sharer K/V measured on the precomputed caches). The
  scale lives in a parametrization of `key_in.weight` / `value_in.weight`
  (`W_effective = W * s` column-wise); `fold` bakes it into plain weights, so
  the saved checkpoint computes the same function with the published layout.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn.utils import parametrize

from cachegraft_cli.fuser.fuser import Fuser
from cachegraft_cli.fuser.projector import ProjectorArgs


class ColumnScale(nn.Module):
    """weight -> weight * scale (per input column); `scale` is a fixed buffer."""

    scale: torch.Tensor  # a buffer

    def __init__(self, scale: torch.Tensor):
        super().__init__()
        self.register_buffer("scale", scale)

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.scale


def create(receiver, sharer_name: str, sharer_geometry, config, anneal_steps: int, alignment: bool = False) -> Fuser:
    """A fresh fuser (float32) for the pair; `alignment` when the tokenizers differ."""
    fuser = Fuser.create(
        receiver.spec, sharer_name, receiver.geometry, sharer_geometry,
        alignment=alignment, sharer_input=config.sharer_input,
        hidden_dim=config.hidden_dim, intermediate_dim=config.intermediate_dim, num_layers=config.num_layers,
        dropout=config.dropout, anneal_steps=max(1, anneal_steps), dtype="float32",
    )
    zero_init_outputs(fuser)
    return fuser


def zero_init_outputs(fuser: Fuser) -> None:
    with torch.no_grad():
        for p in fuser.projectors:
            for name in ("key_proj_out", "value_proj_out"):
                getattr(p, name).weight.zero_()
                getattr(p, name).bias.zero_()


def add_input_scales(fuser: Fuser, scales: dict) -> None:
    """Parametrize every in-projection with its layer's fixed column scales."""
    for t, pairs in fuser.spec.layer_map.items():
        for _, index in pairs:
            projector = fuser.projectors[index]
            a = projector.args
            n_s, n_r = a.source_dim * a.source_num_heads, a.target_dim * a.target_num_heads
            for name in ("key", "value"):
                s = scales[t][name]
                col = torch.cat([torch.full((n_s,), s["sharer"]), torch.full((n_r,), s["receiver"])])
                parametrize.register_parametrization(getattr(projector, f"{name}_in"), "weight", ColumnScale(col))


def fold(fuser: Fuser) -> Fuser:
    """A plain copy (published architecture, no parametrizations) computing the same function."""
    with torch.random.fork_rng():  # building modules draws random inits: keep the training RNG stream intact
        plain = Fuser(fuser.spec, [ProjectorArgs(**p.args.as_dict()) for p in fuser.projectors])
    state = {}
    for name in plain.state_dict():
        owner, _, attr = name.rpartition(".")
        state[name] = getattr(fuser.get_submodule(owner), attr).detach().clone()  # parametrized: W * s
    plain.load_state_dict(state)
    return plain.eval()


def gate_parameters(fuser: Fuser) -> list[nn.Parameter]:
    return [p for n, p in fuser.named_parameters() if n.endswith("gate_logit")]


def other_parameters(fuser: Fuser) -> list[nn.Parameter]:
    return [p for n, p in fuser.named_parameters() if not n.endswith("gate_logit")]


def set_temperature(fuser: Fuser, step: int) -> None:
    for p in fuser.projectors:
        p.update_temperature(step)


def parameter_count(fuser: Fuser) -> int:
    return sum(p.numel() for p in fold(fuser).parameters())
