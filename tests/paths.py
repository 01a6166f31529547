"""Where the suite's files are, for tests in any folder under tests/."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
SAMPLE_DATA = REPO / "sample_data"
SHARED_QA = REPO.parent / "shared" / "data" / "qa"
PACKAGE = REPO / "cachegraft_cli"
