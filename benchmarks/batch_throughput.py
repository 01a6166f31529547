"""Batch ask throughput (questions/s) at batch sizes 1, 8, 32 (graft, real offline pair).

Batch size 1 is sequential `Asker.ask`; larger sizes use `Asker.ask_many`
when this CacheGraft has it (checked at run time; otherwise they report "not
available"). The same questions (about the shared real-pair store, see
ttft.py) are answered under every condition; conditions are interleaved,
their order rotating each repeat. Also reports how many batched answers
equal the sequential ones (batched decoding with padding may differ).

    python benchmarks/batch_throughput.py [--questions 32] [--batch-sizes 1,8,32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import inspect
import sys
import time

import bench_common as bc


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--questions", type=int, default=32)
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--system", default="graft")
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--passages", type=int, default=bc.REAL_PASSAGES)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--use-store", default=None,
                    help="use this existing store of SQuAD paragraphs (e.g. one codec_quality.py made)")
    return ap.parse_args(argv)


def run(asker, questions: list[str], options, batch: int) -> tuple[float, list[str]]:
    """Seconds to answer all questions at this batch size, and the answers."""
    t0 = time.perf_counter()
    if batch == 1:
        results = [asker.ask(q, options) for q in questions]
    elif "batch_size" in inspect.signature(asker.ask_many).parameters:
        results = asker.ask_many(questions, options, batch_size=batch)
    else:  # an ask_many(questions, options) without batch_size: batch by calling per chunk
        results = [r for i in range(0, len(questions), batch)
                   for r in asker.ask_many(questions[i : i + batch], options)]
    return time.perf_counter() - t0, [r["answer"] for r in results]


def main(argv=None) -> int:
    args = parse_args(argv)
    bc.set_threads(args.threads)
    from cachegraft_cli.answering.ask import Asker, AskOptions
    from cachegraft_cli.lm.generation import GenerationOptions

    if args.use_store:
        url, session, (_, questions) = args.use_store, bc.session_for("closed"), bc.store_data(args.use_store)
    else:
        url, session, _, questions = bc.real_store(args.passages, args.seed)
    questions = [q.question for q in questions[: args.questions]]
    asker = Asker(url, session=session)
    asker.warm(args.system)
    options = AskOptions(args.system, args.k, generation=GenerationOptions(args.max_new_tokens))
    have_many = hasattr(Asker, "ask_many")
    sizes = [int(s) for s in args.batch_sizes.split(",")]
    runnable = [b for b in sizes if b == 1 or have_many]
    start_machine = bc.machine()
    secs = {b: [] for b in runnable}
    answers = {}
    for r in range(args.repeats):
        for b in bc.rotated(runnable, r):
            s, answers[b] = run(asker, questions, options, b)
            secs[b].append(s)
            bc.log(f"batch {b}: {len(questions) / s:.3f} q/s")
    qps = {b: len(questions) / bc.median(secs[b]) for b in runnable}
    same = {b: sum(a == s for a, s in zip(answers[b], answers[1])) for b in runnable if 1 in answers}
    rows = [[b, f"{qps[b]:.3f}" if b in qps else "not available",
             f"{qps[b] / qps[1]:.2f}x" if b in qps and 1 in qps else "-",
             f"{same[b]}/{len(questions)}" if b in same else "-"] for b in sizes]
    bc.print_table(f"batch throughput: {args.system}, k={args.k}, {len(questions)} questions, "
                   f"max_new_tokens {args.max_new_tokens}, median of {args.repeats}",
                   ["batch", "questions/s", "vs batch 1", "same answer as seq."], rows)
    if not have_many:
        print("Asker.ask_many is not available in this CacheGraft: batched sizes not measured")
    print(f"machine at start: {start_machine}; loadavg at end {bc.machine()['loadavg']}")
    bc.emit({"bench": "batch_throughput", "system": args.system, "k": args.k, "questions": len(questions),
             "qps": {str(b): qps.get(b, "not available") for b in sizes},
             "same_answers": {str(b): v for b, v in same.items()},
             "machine_start": start_machine, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
