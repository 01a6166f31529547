"""Where the suite's files are, for tests in any folder under tests/."""

import importlib
import sys
from contextlib import contextmanager
from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SAMPLE_DATA = REPO / "sample_data"
SHARED_QA = REPO.parent / "shared" / "data" / "qa"
PACKAGE = REPO / "cachegraft_cli"
BENCHMARKS = REPO / "benchmarks"


@contextmanager
def benchmark_module(name: str):
    """A script of benchmarks/ imported as a module (they import each other by bare name)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module(name)
    finally:
        sys.path.remove(str(BENCHMARKS))
