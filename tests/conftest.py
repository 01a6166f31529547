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


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on localhost, for the whole session."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from ray_support import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def ray_cluster(s3_server):
    """One local Ray runtime (2 CPUs) shared by every Ray test; its workers get tests/ on their
    path and the S3 server's endpoint and credentials in their environment. Yields its address."""
    import logging

    ray = pytest.importorskip("ray")
    env = {"PYTHONPATH": str(Path(__file__).parent), **s3_server.env}
    ray.init(num_cpus=2, include_dashboard=False, logging_level=logging.WARNING, runtime_env={"env_vars": env})
    yield ray.get_runtime_context().gcs_address
    ray.shutdown()
