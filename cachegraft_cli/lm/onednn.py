"""float32 linear layers through oneDNN on CPU.

torch sends a float32 `nn.Linear` on CPU to MKL's sgemm. On a 2-core AMD EPYC with
AVX2 only (2026-11-30, idle), oneDNN's linear was 1.1-1.7x faster for large layers
(the 0.5B receiver's 896x4864 MLP: 1.6x at 1 row, 1.3x at 21, 1.1x at 700) and
slower for small ones (its 896x128 K/V projections: a fixed ~0.1 ms per call), so
only layers of at least `MIN_WEIGHTS` weights are routed. The receiver's forward
over a 21-token question got 1.30x faster, over a 700-token prompt 1.09x
(`benchmarks/linear_kernels.py`, docs/results.md). Results differ from MKL's by
float32 rounding only (max logit difference 8e-5 on a 21-token forward; same
argmax).

`CACHEGRAFT_ONEDNN_LINEAR=0` turns it off. The op has no autograd kernel, so
anything that needs gradients (fuser training) takes torch's own path.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENV = "CACHEGRAFT_ONEDNN_LINEAR"
MIN_WEIGHTS = 1 << 20  # in x out; the 896x896 attention projections stay on MKL


def available() -> bool:
    return (os.environ.get(ENV, "1") != "0" and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class OneDnnLinear(torch.nn.Linear):
    """An `nn.Linear` whose float32 CPU forward without gradients runs through oneDNN."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if (x.device.type != "cpu" or x.dtype != torch.float32 or w.dtype != torch.float32
                or (torch.is_grad_enabled() and (x.requires_grad or w.requires_grad))):
            return F.linear(x, w, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x, w, self.bias, "none", [], "")


def route_linears(module: torch.nn.Module, min_weights: int = MIN_WEIGHTS) -> int:
    """Make every plain float32 CPU `nn.Linear` of at least `min_weights` weights in `module` a
    `OneDnnLinear` (in place, same parameters); how many were changed. Nothing changes when
    oneDNN is unavailable or off."""
    if not available():
        return 0
    chosen = [m for m in module.modules() if type(m) is torch.nn.Linear and m.weight.device.type == "cpu"
              and m.weight.dtype == torch.float32 and m.weight.numel() >= min_weights]
    for m in chosen:
        m.__class__ = OneDnnLinear
    return len(chosen)
