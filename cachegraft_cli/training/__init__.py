"""Fuser training: data, precomputed model caches, objectives, the loop.

Both LLMs stay frozen. Their passage caches are computed once (no gradients)
and reused every epoch; a step runs only the fuser plus the receiver over the
short target (question + answer, or a text continuation) with the fused
passage KV as past, so gradients flow through the past KV into the fuser.
"""

from cachegraft_cli.training.config import TrainConfig

__all__ = ["TrainConfig", "train_fuser"]


def train_fuser(config: TrainConfig, progress: bool = True):
    """Train (or resume) a fuser as `config` says; returns the summary dict."""
    from cachegraft_cli.training.loop import run

    return run(config, progress=progress)
