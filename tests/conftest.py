import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Model directories of the tiny receiver and sharers (built once per session)."""
    from tiny import build_all

    return build_all(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """Loaded tiny models in float32 on CPU, by role."""
    from cachegraft_cli.models import load_causal_lm

    return {role: load_causal_lm(str(path), device="cpu", dtype="float32") for role, path in tiny_dirs.items()}
