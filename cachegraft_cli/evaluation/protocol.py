"""The evaluation run: answer, judge, summarise, report. Resumable.

Answers and verdicts are appended to JSONL files one record at a time; a run
re-started with the same configuration skips every record already there. The
summary, report and plots are rebuilt from those files alone.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from cachegraft_cli.answering.systems import K_FREE_SYSTEMS  # closed: answered once (k=0), shared by every k
from cachegraft_cli.encoding.plan import PASSAGE_TOKENS
from cachegraft_cli.errors import UsageError
from cachegraft_cli.evaluation.datasets import (
    CORPUS_MODES,
    Benchmark,
    DatasetSpec,
    QAExample,
    load_benchmark,
    parse_dataset_spec,
    rechunk,
)
from cachegraft_cli.evaluation.judges import Judge, JudgeItem, PairItem, judge_name, load_judge
from cachegraft_cli.evaluation.kinds import PassageWords, answer_source
from cachegraft_cli.evaluation.metrics import exact_match, f1_score, recall_at_k
from cachegraft_cli.evaluation.plots import write_plots
from cachegraft_cli.evaluation.records import ANSWER_KEY, PAIR_KEY, VERDICT_KEY, RecordFile, read_records
from cachegraft_cli.evaluation.report import render_report
from cachegraft_cli.evaluation.summary import COMPARISON_PAIRS, summarize
from cachegraft_cli.evaluation.variants import base_system, check_variant


class Answerer(Protocol):
    def prepare(self, benchmark_name: str, passages: list[dict], max_passage_tokens: int = PASSAGE_TOKENS) -> None:
        """Encode the corpus ({id, title, text} dicts) into a store and index it; longer
        passages are split as `encode --max-passage-tokens` splits them."""

    def passage_template(self):
        """The receiver's prompt template, whose passage tokens `?passage_tokens=N` counts
        (`datasets.rechunk`); asked for only by a benchmark that re-chunks."""

    def answer(self, benchmark_name: str, questions: list[QAExample], system: str, k: int) -> list[dict]:
        """One dict per question: {"answer": str, "passages": [{"id", "score"}],
        "timings": {"first_token": s, "total": s, ...}, optional "stats": {name: number}}.
        k is 0 for systems answered without passages (closed)."""

    def close_models(self) -> None:
        """Free the answering models before the judges load."""


@dataclass
class RunConfig:
    benchmarks: Sequence[str | DatasetSpec]
    systems: Sequence[str]
    out: str | Path
    ks: Sequence[int] = (1, 3, 5)
    judges: Sequence[str] = ()
    limit: int | None = None
    seed: int = 0
    corpus: str = "articles"
    articles: int | None = None
    pairwise: bool = False
    bootstrap_samples: int = 2000
    answer_batch_size: int = 8
    judge_batch_size: int = 16
    answerer_config: dict = field(default_factory=dict)  # models, fuser, ...: checked on resume
    judge_limit: int | None = None  # judge only N seeded-random questions of each benchmark

    def specs(self) -> list[DatasetSpec]:
        return [parse_dataset_spec(b) if isinstance(b, str) else b for b in self.benchmarks]

    def to_dict(self) -> dict:
        """What defines the run's results (everything but the output directory)."""
        return {
            "benchmarks": [s.to_dict() for s in self.specs()], "systems": list(self.systems),
            "ks": list(self.ks), "judges": _judge_entries(self.judges), "limit": self.limit,
            "seed": self.seed, "corpus": self.corpus, "articles": self.articles, "pairwise": self.pairwise,
            "bootstrap_samples": self.bootstrap_samples, "answer_batch_size": self.answer_batch_size,
            "judge_batch_size": self.judge_batch_size, "answerer": self.answerer_config,
            **({"judge_limit": self.judge_limit} if self.judge_limit is not None else {}),
        }


def _judge_entries(specs: Sequence[str]) -> list[dict]:
    entries: list[dict] = []
    seen: dict[str, int] = {}
    for spec in specs:
        name = judge_name(spec)
        seen[name] = seen.get(name, 0) + 1
        entries.append({"spec": spec, "name": name if seen[name] == 1 else f"{name}-{seen[name]}"})
    return entries


def validate(config: RunConfig) -> None:
    problems = []
    for label in config.systems:
        try:
            check_variant(label)
        except UsageError as exc:
            problems.append(f"system {label!r}: {exc.message.rstrip('.')}")
    if not config.systems or len(set(config.systems)) != len(config.systems):
        problems.append("systems must be a non-empty list without repeats")
    if not config.ks or any(k < 1 for k in config.ks) or len(set(config.ks)) != len(config.ks):
        problems.append("ks must be distinct integers >= 1")
    if config.corpus not in CORPUS_MODES:
        problems.append(f"corpus must be one of {', '.join(CORPUS_MODES)}")
    if config.limit is not None and config.limit < 1:
        problems.append("limit must be >= 1")
    if config.judge_limit is not None and config.judge_limit < 1:
        problems.append("judge_limit must be >= 1")
    names = [s.name for s in config.specs()]
    if not names or len(set(names)) != len(names):
        problems.append("benchmarks must be a non-empty list with distinct names")
    if problems:
        raise UsageError("Bad evaluation settings: " + "; ".join(problems) + ".")


# Settings that only decide who judges: a resumed run may change them (add or drop a
# judge) without touching its answers. Verdicts are kept per judge, and the summary
# counts only the judges the config names. judge_limit is not among them: it decides
# which answers are judged, so changing it would mix two judged subsets.
JUDGING_KEYS = ("judges", "pairwise", "judge_batch_size")


def prepare_run_dir(config: RunConfig) -> Path:
    """Create the run directory, or check that it was made with the same config
    (judges may change; see JUDGING_KEYS)."""
    run_dir = Path(config.out)
    run_dir.mkdir(parents=True, exist_ok=True)
    path, wanted = run_dir / "config.json", config.to_dict()
    if path.exists():
        saved = json.loads(path.read_text(encoding="utf-8"))
        fixed = _diff(saved, wanted, ignore=JUDGING_KEYS)
        if fixed:
            raise UsageError(f"{run_dir} holds a run with other settings ({fixed}).",
                             "Resume with the same arguments (judges may change), or choose a new output directory.")
        if saved == wanted:
            return run_dir
    path.write_text(json.dumps(wanted, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return run_dir


def _diff(saved: dict, wanted: dict, ignore: Sequence[str] = ()) -> str:
    keys = sorted(k for k in set(saved) | set(wanted) if k not in ignore and saved.get(k) != wanted.get(k))
    return "; ".join(f"{k}: was {saved.get(k)!r}, now {wanted.get(k)!r}" for k in keys)


def _progress(total: int, desc: str, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled or total == 0, leave=False)


def _batches(items: list, size: int):
    for start in range(0, len(items), size):
        yield items[start:start + size]


# ---------------------------------------------------------------- answering


def answer_jobs(config: RunConfig) -> list[tuple[str, int]]:
    return [(s, k) for s in config.systems for k in ([0] if base_system(s) in K_FREE_SYSTEMS else config.ks)]


def answer_record(bench: str, q: QAExample, system: str, k: int, result: dict,
                  words: PassageWords | None = None) -> dict:
    """The record of one answer; `words` (the benchmark's passages) locates the answer's words
    among the retrieved passages (`kinds.answer_source`)."""
    answer = str(result.get("answer", ""))
    retrieved = [str(p["id"]) for p in result.get("passages", [])]
    source = answer_source(answer, retrieved, q.gold_ids, words) if words is not None else None
    return {
        "benchmark": bench, "id": q.id, "system": system, "k": k, "question": q.question,
        "golds": list(q.answers), "gold_ids": list(q.gold_ids), "answer": answer,
        "retrieved": retrieved, "scores": [p.get("score") for p in result.get("passages", [])],
        "recall": recall_at_k(retrieved, q.gold_ids, k) if k > 0 else None,
        "em": exact_match(answer, q.answers), "f1": f1_score(answer, q.answers),
        "timings": dict(result.get("timings", {})), "stats": dict(result.get("stats", {})),
        **({"source": source} if words is not None else {}),
    }


def locate_answers(bench: Benchmark, words: PassageWords, answers: RecordFile) -> int:
    """Give the benchmark's records written before answers were located their `source` (a
    resumed run's report then breaks every answer down); how many were updated."""
    gold_ids = {q.id: q.gold_ids for q in bench.questions}
    stale = [r for r in answers.records() if r["benchmark"] == bench.name and "source" not in r]
    for r in stale:
        answers.append({**r, "source": answer_source(r["answer"], r["retrieved"], gold_ids.get(r["id"], []), words)})
    return len(stale)


def answer_benchmark(bench: Benchmark, answerer: Answerer, config: RunConfig, answers: RecordFile,
                     progress: bool) -> None:
    words = PassageWords({p.id: p.text for p in bench.passages})
    locate_answers(bench, words, answers)
    pending = {job: [q for q in bench.questions if (bench.name, q.id, *job) not in answers]
               for job in answer_jobs(config)}
    total = sum(map(len, pending.values()))
    if total == 0:
        return
    split = {} if bench.max_passage_tokens is None else {"max_passage_tokens": bench.max_passage_tokens}
    answerer.prepare(bench.name, bench.passage_dicts(), **split)  # an answerer written before re-chunking still works
    with _progress(total, f"answer {bench.name}", progress) as bar:
        for (system, k), questions in pending.items():
            for batch in _batches(questions, config.answer_batch_size):
                results = answerer.answer(bench.name, batch, system, k)
                _check_results(results, batch, system)
                for q, result in zip(batch, results):
                    answers.append(answer_record(bench.name, q, system, k, result, words))
                bar.update(len(batch))


def _check_results(results: list, batch: list, system: str) -> None:
    if len(results) != len(batch):
        raise RuntimeError(f"answerer returned {len(results)} answers for {len(batch)} questions ({system})")


# ---------------------------------------------------------------- judging


JudgeLoader = Callable[[str], Judge]


def _pending_verdicts(answers: list[dict], verdicts: RecordFile, judge: str) -> list[dict]:
    return [a for a in answers if (a["benchmark"], a["id"], a["system"], a["k"], judge) not in verdicts]


def judge_answers(judge: Judge, name: str, pending: list[dict], verdicts: RecordFile, config: RunConfig,
                  progress: bool) -> None:
    with _progress(len(pending), f"judge {name}", progress) as bar:
        for batch in _batches(pending, config.judge_batch_size):
            items = [JudgeItem(a["question"], a["golds"], a["answer"]) for a in batch]
            for a, v in zip(batch, judge.judge(items)):
                verdicts.append({"benchmark": a["benchmark"], "id": a["id"], "system": a["system"], "k": a["k"],
                                 "judge": name, "verdict": int(v.verdict), "probability": float(v.probability)})
            bar.update(len(batch))


def _pending_pairs(answers: list[dict], pairs: RecordFile, name: str, config: RunConfig) -> list[tuple]:
    by_key = {(a["benchmark"], a["id"], a["system"], a["k"]): a for a in answers}
    out = []
    for (bench, qid, system, k), rec in by_key.items():
        for a, b in COMPARISON_PAIRS:
            other = by_key.get((bench, qid, b, k))
            if system == a and other and (bench, qid, a, b, k, name) not in pairs:
                out.append((rec, other))
    return out


def judge_pairs(judge, name: str, pending: list[tuple], pairs: RecordFile, config: RunConfig,
                progress: bool) -> None:
    with _progress(len(pending), f"pairwise {name}", progress) as bar:
        for batch in _batches(pending, config.judge_batch_size):
            items = [PairItem(f"{ra['benchmark']}/{ra['id']}/{ra['system']}/{rb['system']}/{ra['k']}",
                              ra["question"], ra["golds"], ra["answer"], rb["answer"]) for ra, rb in batch]
            for (ra, rb), v in zip(batch, judge.judge_pairs(items, seed=config.seed)):
                pairs.append({"benchmark": ra["benchmark"], "id": ra["id"], "a": ra["system"], "b": rb["system"],
                              "k": ra["k"], "judge": name, "verdict": v.verdict, "prob_a": float(v.prob_a)})
            bar.update(len(batch))


def judged_answers(answers: list[dict], benchmarks: list[Benchmark], judge_limit: int | None,
                   seed: int) -> list[dict]:
    """The answers judges see: all, or those to `judge_limit` seeded-random questions of each
    benchmark (the same questions for every system and k, so comparisons stay paired)."""
    if judge_limit is None:
        return answers
    keep: set = set()
    for b in benchmarks:
        chosen = random.Random(f"judge-{seed}-{b.name}").sample(b.questions, min(judge_limit, len(b.questions)))
        keep.update((b.name, q.id) for q in chosen)
    return [a for a in answers if (a["benchmark"], a["id"]) in keep]


def run_judges(config: RunConfig, answers: list[dict], verdicts: RecordFile, pairs: RecordFile,
               loader: JudgeLoader, progress: bool) -> None:
    """Load each judge only when it has work, one at a time, and free it after."""
    for entry in config.to_dict()["judges"]:
        pending = _pending_verdicts(answers, verdicts, entry["name"])
        pending_pairs = _pending_pairs(answers, pairs, entry["name"], config) if config.pairwise else []
        if not pending and not pending_pairs:
            continue
        judge = loader(entry["spec"])
        try:
            judge_answers(judge, entry["name"], pending, verdicts, config, progress)
            if pending_pairs:
                judge_pairs(judge, entry["name"], pending_pairs, pairs, config, progress)
        finally:
            judge.close()


# ---------------------------------------------------------------- outputs


def write_outputs(run_dir: Path) -> dict:
    """summary.json, report.md and plots, from config.json and the JSONL files only."""
    run_dir = Path(run_dir)
    config = json.loads((run_dir / "config.json").read_text(encoding="utf-8"))
    judges = {j["name"] for j in config["judges"]}  # verdicts of judges dropped on resume stay on disk, unused
    verdicts = [v for v in read_records(run_dir / "verdicts.jsonl", VERDICT_KEY) if v["judge"] in judges]
    pairs = [v for v in read_records(run_dir / "pairwise.jsonl", PAIR_KEY) if v["judge"] in judges]
    summary = summarize(config, read_records(run_dir / "answers.jsonl", ANSWER_KEY), verdicts, pairs)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    plots = write_plots(summary, run_dir)
    (run_dir / "report.md").write_text(render_report(summary, plots), encoding="utf-8")
    return summary


def _chunked(bench: Benchmark, spec: DatasetSpec, answerer: Answerer) -> Benchmark:
    """`bench` re-chunked as `?passage_tokens=N` asks (with the receiver's tokenizer, no weights)."""
    if spec.passage_tokens is None:
        return bench
    return rechunk(bench, answerer.passage_template(), spec.passage_tokens)


def run_evaluation(config: RunConfig, answerer: Answerer, judge_loader: JudgeLoader | None = None,
                   progress: bool = True) -> dict:
    """Run (or resume) an evaluation into config.out; returns the summary."""
    validate(config)
    benchmarks = [_chunked(load_benchmark(spec, config.limit, config.seed, config.corpus, config.articles), spec,
                           answerer)
                  for spec in config.specs()]  # every input is read and checked before the run directory is made
    run_dir = prepare_run_dir(config)
    files = [RecordFile(run_dir / name, key) for name, key in
             (("answers.jsonl", ANSWER_KEY), ("verdicts.jsonl", VERDICT_KEY), ("pairwise.jsonl", PAIR_KEY))]
    answers, verdicts, pairs = files
    try:
        for bench in benchmarks:
            answer_benchmark(bench, answerer, config, answers, progress)
        answerer.close_models()
        loader = judge_loader or (lambda spec: load_judge(spec, batch_size=config.judge_batch_size))
        judged = judged_answers(answers.records(), benchmarks, config.judge_limit, config.seed)
        run_judges(config, judged, verdicts, pairs, loader, progress)
    finally:
        for f in files:
            f.close()
    return write_outputs(run_dir)
