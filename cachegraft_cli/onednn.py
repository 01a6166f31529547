"""float32 linear layers through oneDNN on CPU.

torch sends a float32 `nn.Linear` on CPU to MKL's sgemm, which is slow for the
few-row matmuls that dominate answering from caches: the question's prefill is
~20 rows. On the 2-core AMD EPYC (AVX2) these figures come from, oneDNN's
linear was as fast at 1 row (decoding) and 700 rows (a text prefill), and
~2x faster at 21-128 rows (a question, a passage), for the 0.5B receiver's
layer shapes. Results differ from MKL's by float32 rounding only (max logit
difference 8e-5 on a 21-token forward; same argmax).

`CACHEGRAFT_ONEDNN_LINEAR=0` turns it off. The op has no autograd kernel, so
anything that needs gradients (fuser training) takes torch's own path.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

ENV = "CACHEGRAFT_ONEDNN_LINEAR"


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


def route_linears(module: torch.nn.Module) -> int:
    """Make every plain float32 CPU `nn.Linear` in `module` a `OneDnnLinear` (in place, same
    parameters); how many were changed. Nothing changes when oneDNN is unavailable or off."""
    if not available():
        return 0
    changed = 0
    for m in module.modules():
        if type(m) is torch.nn.Linear and m.weight.device.type == "cpu" and m.weight.dtype == torch.float32:
            m.__class__ = OneDnnLinear
            changed += 1
    return changed
