import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# OpenMP threads that spin while they wait make tiny models 5-10x slower on a shared 2-core machine;
# read once when torch loads, so it is set before any test imports torch (and for forked children).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@pytest.fixture(scope="session")
def tiny_dirs(tmp_path_factory):
    """Model directories of the tiny receiver and sharers (built once per session)."""
    from tiny import build_all

    return build_all(tmp_path_factory.mktemp("tiny_models"))


@pytest.fixture(scope="session")
def tiny_models(tiny_dirs):
    """Loaded tiny models in float32 on CPU, by role."""
    from cachegraft_cli.lm.models import load_causal_lm

    return {role: load_causal_lm(str(path), device="cpu", dtype="float32") for role, path in tiny_dirs.items()}


@pytest.fixture
def rng():
    """A seeded numpy generator (the store tests draw caches and lengths from it)."""
    import numpy as np

    return np.random.default_rng(1234)


@pytest.fixture
def loads(monkeypatch):
    """The model specs `load_causal_lm` is called with during the test, in order (the loads still happen)."""
    import cachegraft_cli.lm.models as models

    seen: list[str] = []
    real = models.load_causal_lm
    monkeypatch.setattr(models, "load_causal_lm", lambda spec, **kw: seen.append(spec) or real(spec, **kw))
    return seen


# Counts the reliability tests add up (faults.record): printed as a table at the end of the run.
TALLY: dict = {}

_TALLY_ROWS = [
    ("kill trials run (SIGKILL delivered)", "kills"),
    ("faults injected (kills, ENOSPC, EROFS, damage)", "faults"),
    ("passages lost", "lost"),
    ("passages duplicated", "duplicated"),
    ("bad inputs tried", "bad_inputs"),
    ("tracebacks", "tracebacks"),
    ("slowest bad-input failure (s, before any model load)", "max_bad_input_seconds"),
]


def pytest_terminal_summary(terminalreporter):
    if not TALLY:
        return
    terminalreporter.write_sep("-", "reliability")
    for label, key in _TALLY_ROWS:
        value = TALLY.get(key, 0)
        terminalreporter.write_line(f"{label:55} {value:.3f}" if isinstance(value, float) else f"{label:55} {value}")
    extra = {k: v for k, v in TALLY.items() if k not in {key for _, key in _TALLY_ROWS}}
    for key, value in sorted(extra.items()):
        terminalreporter.write_line(f"  {key:53} {value}")


@pytest.fixture(scope="session")
def s3_server():
    """A real S3-compatible server (moto's server mode) on localhost, for the whole session."""
    pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    from ray_support import LocalS3

    server = LocalS3()
    yield server
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A fresh bucket on the test's S3 server, named; this process finds the server the usual ways
    (AWS_* variables, fsspec's config), as Ray workers do (`ray_cluster` gives them the same variables)."""
    import uuid

    import fsspec
    import fsspec.config

    for key, value in s3_server.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setitem(fsspec.config.conf, "s3", {"endpoint_url": s3_server.endpoint})
    name = f"cg-{uuid.uuid4().hex[:8]}"
    fsspec.filesystem("s3", skip_instance_cache=True).mkdir(name)
    return name


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


@pytest.fixture
def no_model_loads(monkeypatch):
    """Any model, fuser or embedder load fails the test: every check must come first.
    (A tokenizer alone may load: it reads no weights.)"""
    from cachegraft_cli import fuser
    from cachegraft_cli.lm import models
    from cachegraft_cli.retrieval import index as retrieval

    def refuse(*a, **k):
        raise AssertionError("a model was loaded before the input was checked")

    for module, name in ((models, "load_causal_lm"), (fuser, "load_fuser"), (retrieval, "load_embedder")):
        monkeypatch.setattr(module, name, refuse)


# Greedy tokens of two float32 computations that agree only up to rounding (other shapes, batch
# compositions or kernels; on another CPU kind, other SIMD kernels) are equal when every pick is
# decided by more than the paths' logit difference: within 1e-4 in the tiny models
# (tests/fuser/test_fusion.py), so a margin of 1e-3 leaves room on every CPU.
MIN_GREEDY_MARGIN = 1e-3


@pytest.fixture
def greedy_margins(monkeypatch):
    """The top-1 minus top-2 logit of every token picked while the test runs. A test comparing
    the answers of two such computations asserts min(margins) >= MIN_GREEDY_MARGIN: then equal
    answers are what the code guarantees, not one CPU's rounding, and a near-tie in a fixture
    fails on every CPU alike (margins move by rounding only)."""
    import torch

    from cachegraft_cli.lm import generation

    seen: list[float] = []
    real = generation.pick_token

    def pick(logits, config, rng):
        top = torch.topk(logits.float(), 2).values
        seen.append(float(top[0] - top[1]))
        return real(logits, config, rng)

    monkeypatch.setattr(generation, "pick_token", pick)
    return seen
