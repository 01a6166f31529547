"""`cachegraft evaluate`: QA datasets, metrics, judges, statistics, report and plots, the run.

Everything here imports only the standard library at module level; torch,
transformers, datasets, scipy, numpy and matplotlib load inside functions.
"""

from cachegraft_cli.evaluation.datasets import QAExample, load_benchmark, parse_dataset_spec, squad_passage_id
from cachegraft_cli.evaluation.protocol import Answerer, RunConfig, run_evaluation, write_outputs

__all__ = [
    "Answerer", "QAExample", "RunConfig", "load_benchmark", "parse_dataset_spec", "run_evaluation",
    "squad_passage_id", "write_outputs",
]
