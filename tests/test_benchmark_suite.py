"""run_all.py reads every benchmark's JSON line (recorded from real runs) into its table."""

import json
from pathlib import Path

import pytest
from paths import benchmark_module

OUTPUTS = json.loads((Path(__file__).parent / "data" / "bench_outputs.json").read_text())


@pytest.fixture(scope="module")
def run_all():
    with benchmark_module("run_all") as module:
        yield module


@pytest.mark.parametrize("key", sorted(OUTPUTS))
def test_every_benchmark_output_gives_figures(run_all, key):
    rows = run_all.figures(key, OUTPUTS[key])
    assert rows, key
    assert all(verdict in ("MET", "MISSED", "reported") for *_, verdict in rows)
    assert all(isinstance(value, (int, float)) for _, value, _, _ in rows)


def test_suite_keys_match_recorded_outputs(run_all):
    assert {key for key, _, _ in run_all.SUITE} == set(OUTPUTS)


def test_a_renamed_field_fails_one_row_not_the_suite(run_all):
    rows = run_all.safe_figures("fuse_speed", {"results": {"1": {"ratios": {}}}})
    assert len(rows) == 1 and rows[0][3] == "FAILED" and "KeyError" in rows[0][0]
