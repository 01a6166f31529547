"""Weight-only int8 and int4 linear layers for answering on CPU.

A decode step reads every weight of the receiver once for one token, so on a CPU it is bound by
memory bandwidth: the 0.5B receiver's bf16 linears are ~1 GB a token (its 151,936 x 896 output
layer alone 272 MB). Storing weights in int8 (one scale per output row) halves that; int4 in
groups of 32 input weights (a scale and a zero point each) quarters it. torch's own CPU kernels
(`_weight_int8pack_mm`, `_weight_int4pack_mm_for_cpu`) dequantise on the fly.

Those kernels are vectorised for bf16 activations only: fed float32 they run a scalar loop,
3-10x slower than fed bf16 and 2-6x slower than the dense float32 layer they replace (AVX2,
2026-12-07, docs/results.md "The decode step"). So a float32 model's decode steps enter the
kernels in bf16 and leave them in float32 (`kernel_dtype`: the scales are kept in it too, so a
step converts nothing but its activations); a bf16 model's stay bf16.

They are also matrix-vector kernels: on more than a few rows they are 2-4x slower than the
dense bf16 GEMM (a question's ~20 tokens, a text prompt's 700), and prefill is compute-bound, not
memory-bound. So each layer keeps its dense weight too and takes the quantised path only for
forwards of at most `DECODE_ROWS` rows: decode steps (a batch of up to `DECODE_ROWS` answers).
Prompts are read with the exact weights; only the tokens an answer generates go through the
quantised ones. The model takes more memory, not less: the quantised copies come on top
(+50% of the linears' bytes for int8, about +30% for int4).

These change answers a little, so they are opt-in (`--weights`), and their cost is measured
the way a cache codec's is: KL and answer flips against the model as loaded
(`benchmarks/codec_fidelity.py --codecs weights:int8,weights:int4`, docs/results.md).
Only the layers that answering runs are converted, and only on CPU; the model's embedding
table stays as loaded.
"""

from __future__ import annotations

import torch

SCHEMES = ("as-loaded", "int8", "int4")
INT4_GROUP = 32  # input weights per int4 scale and zero point (llama.cpp's block size)
DECODE_ROWS = 8  # forwards of at most this many rows take the quantised kernels


def kernel_dtype(dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype inside the quantised kernels for a model of `dtype` (the module
    docstring says why float32 is multiplied in bf16)."""
    return torch.bfloat16 if dtype == torch.float32 else dtype


def available(scheme: str) -> bool:
    """Whether this torch build has the CPU kernel `scheme` needs."""
    op = {"int8": "_weight_int8pack_mm", "int4": "_weight_int4pack_mm_for_cpu"}.get(scheme)
    return op is None or hasattr(torch, op)


def check_weights(scheme: str | None, device: str) -> None:
    """Refuse an unknown scheme, or a quantised one off the CPU (`device`: where the receiver
    loads) or without its kernel (typed errors), before anything loads."""
    from cachegraft_cli.errors import UsageError

    if scheme is None or scheme == "as-loaded":
        return
    if scheme not in SCHEMES:
        raise UsageError(f"unknown weights {scheme!r}.", "Use as-loaded, int8 or int4.")
    if torch.device(device).type != "cpu":
        raise UsageError(f"--weights {scheme} runs on CPU only, and the receiver would load on {device}.",
                         "Add --device cpu, or leave --weights out on a GPU.")
    if not available(scheme):
        raise UsageError(f"this torch {torch.__version__} has no CPU kernel for {scheme} weights.",
                         "Leave --weights out, or install the pinned torch (pip install -e .).")


class QuantisedLinear(torch.nn.Module):
    """A linear layer that keeps its dense twin (`dense`, for forwards of more than `decode_rows`
    rows) and multiplies decode steps through a quantised kernel (`product`, per subclass)."""

    decode_rows = DECODE_ROWS  # `set_decode_rows` changes it per model
    ROWS: dict[str, int] = {}  # each quantised buffer: the axis its output rows lie on
    SETTINGS: tuple[str, ...] = ()  # what layers must share to be `stacked`
    ROW_BLOCK = 1  # the kernel's packing is row-separable at multiples of this many output rows
    dense: torch.nn.Linear | None  # None in a `stacked` layer
    bias: torch.Tensor | None

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.dense, self.bias = linear, linear.bias
        self.kernel_dtype = kernel_dtype(linear.weight.dtype)

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() // self.in_features > self.decode_rows and self.dense is not None:
            return self.dense(x)
        return self.quantised(x)

    @classmethod
    def stacked(cls, layers: list) -> "QuantisedLinear":
        """One layer computing `layers`' outputs side by side (they read the same input and share
        a class and `SETTINGS`): one kernel call for several. Each output row is its own dot
        product, so it gives what they give. Buffers whose output rows are leading rows (`ROWS`
        axis 0) are then views of its buffers in the layers, so no weight is held twice; the
        others (int4's scales, rows on axis 1) stay the layers' own, since a view across rows
        would not be contiguous and the kernels take contiguous buffers only. It has no dense
        twin: its caller reads more rows than `decode_rows` through the layers themselves."""
        first = layers[0]
        out = cls.__new__(cls)
        torch.nn.Module.__init__(out)
        out.in_features, out.out_features = first.in_features, sum(m.out_features for m in layers)
        out.dense, out.kernel_dtype = None, first.kernel_dtype
        for name in cls.SETTINGS:
            setattr(out, name, getattr(first, name))
        given = [m.bias for m in layers if m.bias is not None]
        out.bias = torch.cat([m.bias if m.bias is not None else given[0].new_zeros(m.out_features)
                              for m in layers]) if given else None
        for name, axis in cls.ROWS.items():
            out.register_buffer(name, torch.cat([getattr(m, name) for m in layers], dim=axis))
        leading, at = [n for n, axis in cls.ROWS.items() if axis == 0], 0
        for m in layers:
            for name in leading:
                setattr(m, name, getattr(out, name)[at: at + m.out_features])
            at += m.out_features
        return out

    @classmethod
    def can_stack(cls, layers: list) -> bool:
        """Whether `stacked` can join `layers` in this order: one kernel and its settings, the same
        inputs, and every layer but the last a whole number of the packing's row blocks."""
        first = layers[0]
        return len(layers) > 1 and all(
            type(m) is cls and m.kernel_dtype == first.kernel_dtype and m.in_features == first.in_features
            and all(getattr(m, n) == getattr(first, n) for n in cls.SETTINGS) for m in layers) and \
            all(m.out_features % cls.ROW_BLOCK == 0 for m in layers[:-1])

    def quantised(self, x: torch.Tensor) -> torch.Tensor:
        """`x` through the quantised kernel, whatever its rows."""
        flat = x.reshape(-1, self.in_features)
        if flat.dtype != self.kernel_dtype:  # float32 is multiplied in bf16 (the module docstring)
            flat = flat.to(self.kernel_dtype)
        # the kernels take contiguous rows only; a batch's last positions (the LM head's input) are a strided view
        y = self.product(flat.contiguous())
        y = (y if y.dtype == x.dtype else y.to(x.dtype)).view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class Int8Linear(QuantisedLinear):
    """Int8 weights and one scale per output row (symmetric)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    ROWS = {"qweight": 0, "scales": 0}

    def __init__(self, linear: torch.nn.Linear):
        super().__init__(linear)
        parts = [_int8_rows(rows) for rows in _row_chunks(linear.weight)]
        self.register_buffer("qweight", torch.cat([q for q, _ in parts]))
        self.register_buffer("scales", torch.cat([s for _, s in parts]).to(self.kernel_dtype))

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int8pack_mm(flat, self.qweight, self.scales)


class Int4Linear(QuantisedLinear):
    """Int4 weights, a scale and a zero point per `INT4_GROUP` inputs (asymmetric, the group's
    range mapped onto 0..15)."""

    packed: torch.Tensor
    scales_zeros: torch.Tensor
    ROWS = {"packed": 0, "scales_zeros": 1}
    SETTINGS = ("group",)
    ROW_BLOCK = 64  # the CPU packing interleaves output rows in blocks of 64 (the last one shorter)

    def __init__(self, linear: torch.nn.Linear, group: int = INT4_GROUP):
        super().__init__(linear)
        self.group = group
        parts = [_int4_rows(rows, group) for rows in _row_chunks(linear.weight)]
        self.register_buffer("packed", torch.cat([p for p, _ in parts]))
        # (groups, rows, 2) as the kernel takes them
        self.register_buffer("scales_zeros", torch.cat([sz for _, sz in parts], dim=1).to(self.kernel_dtype))

    def product(self, flat: torch.Tensor) -> torch.Tensor:
        return torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)


def set_decode_rows(model: torch.nn.Module, rows: int) -> int:
    """Forwards of at most `rows` rows take the quantised kernels in `model` from now on (0: none
    does, a huge number: every one); how many layers were set. For measuring (the fidelity
    benchmark reads a prompt with the exact weights and forces its answer through the quantised
    ones, as decoding would)."""
    layers = [m for m in model.modules() if isinstance(m, QuantisedLinear)]
    for layer in layers:
        layer.decode_rows = rows
    return len(layers)


def _row_chunks(weight: torch.Tensor, rows: int = 8192):
    """The weight's rows `rows` at a time, as float32: the conversion's temporaries stay small (the
    0.5B receiver's output layer is 151,936 rows) and the int4 packing is row-separable."""
    for at in range(0, weight.shape[0], rows):
        yield weight.detach()[at: at + rows].float()


def _int8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    return torch.round(w / scale[:, None]).to(torch.int8), scale


def _int4_rows(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = w.shape
    grouped = w.view(rows, cols // group, group)
    low, high = grouped.amin(dim=-1), grouped.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    q = torch.round((grouped - low[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32)
    zero = low + 8 * scale  # the kernel dequantises (q - 8) * scale + zero: zero is the value of q = 8
    packed = torch._convert_weight_to_int4pack_for_cpu(q.view(rows, cols), 1)
    return packed, torch.stack([scale.t(), zero.t()], dim=-1)


def convertible(linear: torch.nn.Module, scheme: str) -> bool:
    # a subclass too: on CPUs without bf16 the large float32 layers are `onednn.OneDnnLinear`
    if not isinstance(linear, torch.nn.Linear) or linear.weight.device.type != "cpu":
        return False
    # the int4 kernel packs output rows 16 at a time and needs whole groups of inputs
    return scheme != "int4" or (linear.in_features % INT4_GROUP == 0 and linear.out_features % 16 == 0)


def quantize_linears(model: torch.nn.Module, scheme: str) -> int:
    """Replace every plain CPU `nn.Linear` of `model` by its `scheme` counterpart (in place);
    how many were replaced. `as-loaded` changes nothing."""
    if scheme == "as-loaded":
        return 0
    make = {"int8": Int8Linear, "int4": Int4Linear}[scheme]
    parents = [m for m in model.modules() if not isinstance(m, QuantisedLinear)]  # a converted layer's `dense` stays
    swaps = [(parent, name, child) for parent in parents for name, child in parent.named_children()
             if convertible(child, scheme)]
    for parent, name, child in swaps:
        setattr(parent, name, make(child))
    return len(swaps)
