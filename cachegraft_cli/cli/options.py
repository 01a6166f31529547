"""Option aliases defined once and shared by every command."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

StoreOpt = Annotated[str, typer.Option("--store", "-s", help="Store directory or fsspec URL (e.g. s3://bucket/store).")]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")]
PresetOpt = Annotated[
    Optional[str],
    typer.Option("--preset", "-p", help="Model pair preset (see `cachegraft models list`)."),
]
ReceiverOpt = Annotated[Optional[str], typer.Option("--receiver", help="Receiver model: hub id, local dir or .gguf "
                                                                       "file.")]
SharerOpt = Annotated[Optional[str], typer.Option("--sharer", help="Sharer model: hub id, local dir or .gguf file.")]
FuserOpt = Annotated[
    Optional[str],
    typer.Option("--fuser", help="Fuser: local dir, hub repo id, or REPO:SUBFOLDER; 'closed' for none."),
]
DeviceOpt = Annotated[Optional[str], typer.Option("--device", help="cpu, cuda, cuda:1, mps (default: best available).")]
DtypeOpt = Annotated[Optional[str], typer.Option("--dtype", help="bfloat16, float16 or float32 (default: by device).")]
WeightsOpt = Annotated[Optional[str], typer.Option(
    "--weights", help="The receiver's weights when answering: as-loaded (default), int8 or int4 (CPU only; "
                      "a faster decode that changes answers a little, see docs/results.md).")]
TrustOpt = Annotated[bool, typer.Option("--trust-remote-code", help="Allow model repos to run their own code.")]
BatchOpt = Annotated[
    int, typer.Option("--batch-size", "-b", help="Passages or questions per forward pass (1 to 4096).")
]
TopKOpt = Annotated[int, typer.Option("-k", "--top-k", help="Passages to retrieve (at least 1).")]
InstructionOpt = Annotated[
    Optional[str],
    typer.Option("--instruction", help="System instruction of the prompt template (pinned in the store)."),
]
OrderOpt = Annotated[
    str,
    typer.Option("--order", help="Passage order in the prompt: best-last (best passage next to the question) "
                                 "or retrieval."),
]
RecomputeOpt = Annotated[
    int,
    typer.Option("--recompute", help="Stored caches: re-read the first N tokens of each later passage in "
                                            "context (0: off)."),
]
_BLEND_HELP = ("Stored caches: also recompute this share of the other passage tokens, those whose KV deviates "
               "most (CacheBlend; costs a forward; 0 to 1).")
_BLEND_LAYER_HELP = "Layer whose KV deviation picks the --blend tokens."
BlendOpt = Annotated[float, typer.Option("--blend", help=_BLEND_HELP)]
BlendLayerOpt = Annotated[int, typer.Option("--blend-layer", help=_BLEND_LAYER_HELP)]
# The same options off the help of `ask` and `serve`: research controls that cost answer quality
# (docs/experiments.md); they work as ever, and `evaluate` shows them.
HiddenBlendOpt = Annotated[float, typer.Option("--blend", hidden=True, help=_BLEND_HELP)]
HiddenBlendLayerOpt = Annotated[int, typer.Option("--blend-layer", hidden=True, help=_BLEND_LAYER_HELP)]
SchemeOpt = Annotated[str, typer.Option("--scheme", help="Position scheme for stored caches: rotate or shared.")]
