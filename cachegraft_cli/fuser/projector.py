"""The C2C projector for one receiver layer (docs/method.md section 1), parameter
names identical to the published checkpoints."""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn


@dataclass
class ProjectorArgs:
    """The `init_args` of a published `projector_{i}.json`."""

    source_dim: int
    target_dim: int
    source_num_heads: int
    target_num_heads: int
    hidden_dim: int = 1024
    intermediate_dim: int = 1024
    num_layers: int = 3
    dropout: float = 0.1
    initial_temperature: float = 1.0
    final_temperature: float = 0.001
    anneal_steps: int = 1929
    dtype: str = "float32"

    def as_dict(self) -> dict:
        return asdict(self)


class FFNBlock(nn.Module):
    """y = x + Dropout(W2 GELU(W1 RMSNorm(x))), bias-free linears."""

    def __init__(self, hidden: int, intermediate: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.norm = nn.RMSNorm(hidden, eps=1e-6, dtype=dtype)
        self.w1 = nn.Linear(hidden, intermediate, bias=False, dtype=dtype)
        self.w2 = nn.Linear(intermediate, hidden, bias=False, dtype=dtype)
        self.act = nn.GELU()  # exact (erf) GELU
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(self.w2(self.act(self.w1(self.norm(x)))))


class FFNStack(nn.Module):
    def __init__(self, n: int, hidden: int, intermediate: int, dropout: float, dtype: torch.dtype):
        super().__init__()
        self.blocks = nn.ModuleList(FFNBlock(hidden, intermediate, dropout, dtype) for _ in range(n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Branch(nn.Module):
    """Builds the modules of one branch (keys or values); C2CProjector adopts them under its prefix."""

    def __init__(self, a: ProjectorArgs, dtype: torch.dtype):
        super().__init__()
        src, tgt, hid = a.source_dim * a.source_num_heads, a.target_dim * a.target_num_heads, a.hidden_dim
        self.inp = nn.Linear(src + tgt, hid, bias=True, dtype=dtype)
        self.mlp1 = FFNStack(1, hid, a.intermediate_dim, a.dropout, dtype)
        self.scalar_mlp2 = FFNStack(1, hid, hid, a.dropout, dtype)
        self.scalar_head = nn.Linear(hid, a.target_num_heads, bias=True, dtype=dtype)
        self.proj_mlp2 = FFNStack(a.num_layers - 2, hid, a.intermediate_dim, a.dropout, dtype)
        self.proj_out = nn.Linear(hid, tgt, bias=True, dtype=dtype)


def _flatten_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)  # head-major features


_BRANCH_PARTS = ("in", "mlp1", "scalar_mlp2", "scalar_head", "proj_mlp2", "proj_out")


class C2CProjector(nn.Module):
    """Fuses one receiver layer with its mapped sharer layer.

    Attribute names give the published state-dict keys (`key_in.weight`,
    `value_proj_mlp2.blocks.0.w1.weight`, `key_gate_logit`, ...).
    """

    args: ProjectorArgs
    key_gate_logit: nn.Parameter
    value_gate_logit: nn.Parameter
    gate_temperature: torch.Tensor  # a buffer

    def __init__(self, args: ProjectorArgs):
        super().__init__()
        self.args = args
        dtype = getattr(torch, args.dtype)
        for prefix in ("key", "value"):
            branch = Branch(args, dtype)
            for part in _BRANCH_PARTS:
                setattr(self, f"{prefix}_{part}", getattr(branch, "inp" if part == "in" else part))
            setattr(self, f"{prefix}_gate_logit", nn.Parameter(torch.zeros((), dtype=dtype)))
        self.register_buffer("gate_temperature", torch.tensor(args.initial_temperature, dtype=dtype))

    def update_temperature(self, step: int) -> None:
        """Exponential decay from initial to final temperature over anneal_steps."""
        a = self.args
        ratio = min(step / max(a.anneal_steps, 1), 1.0)
        self.gate_temperature.fill_(a.initial_temperature * (a.final_temperature / a.initial_temperature) ** ratio)

    def gates(self) -> dict[str, bool]:
        """Inference gate states: open when the logit is positive."""
        return {"key": bool(self.key_gate_logit > 0), "value": bool(self.value_gate_logit > 0)}

    def forward(self, source_kv, target_kv) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for prefix, source, target in zip(("key", "value"), source_kv, target_kv):
            projected, weight = self._branch(prefix, source, target)
            gate = self._gate(getattr(self, f"{prefix}_gate_logit"), weight.shape)
            out.append(target + gate * torch.sigmoid(weight) * projected)
        return out[0], out[1]

    def _branch(self, prefix: str, source: torch.Tensor, target: torch.Tensor):
        b, ht, n, dt = target.shape
        x = torch.cat([_flatten_heads(source), _flatten_heads(target)], dim=-1)
        h = getattr(self, f"{prefix}_mlp1")(getattr(self, f"{prefix}_in")(x))
        proj = getattr(self, f"{prefix}_proj_out")(getattr(self, f"{prefix}_proj_mlp2")(h))
        weight = getattr(self, f"{prefix}_scalar_head")(getattr(self, f"{prefix}_scalar_mlp2")(h))
        return proj.view(b, n, ht, dt).transpose(1, 2), weight.permute(0, 2, 1).unsqueeze(-1)

    def _gate(self, logit: torch.Tensor, shape) -> torch.Tensor:
        if not self.training:
            return (logit > 0).to(logit.dtype)
        # Gumbel noise per token and head; the annealed temperature hardens the gate.
        u = torch.rand(shape, device=logit.device, dtype=logit.dtype)
        noise = -torch.log(-torch.log(u + 1e-20) + 1e-20)
        return torch.sigmoid((logit + noise) / self.gate_temperature)
