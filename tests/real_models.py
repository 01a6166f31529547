"""Where the slow tests find real models: the variable named (a directory), else the model
pulled with `cachegraft models pull` (the directory `cachegraft models path NAME` prints)."""

from __future__ import annotations

import os
from pathlib import Path


def real_model(variable: str, pulled: str) -> str:
    """A model directory, or "" when neither the variable nor a complete pulled copy gives one."""
    given = os.environ.get(variable, "")
    if given:
        return given if Path(given).is_dir() else ""
    from cachegraft_cli.lm import pull

    return str(pull.model_dir(pulled)) if pull.is_pulled(pulled) else ""


def reason(variable: str, pulled: str) -> str:
    return f"no real model: set {variable} to a model directory, or run `cachegraft models pull {pulled}`"
