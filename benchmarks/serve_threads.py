"""Decoding on a second thread: what a second OpenMP pool costs, and what `lm/openmp.release_pool` buys.

`cachegraft serve` loads its models on the main thread and decodes on a worker thread. Under
libgomp each thread that has run a parallel region keeps its own pool of helper threads; with
two pools on a 2-core machine libgomp stops spinning between parallel regions, and a decode step
(about 1,000 short regions) slows down. This times one model's decode, interleaved, on:

- `main`: the thread that loaded the model (what `cachegraft ask` does);
- `thread, two pools`: a fresh thread while the main thread's pool exists (the server before
  `release_pool`);
- `thread, one pool`: a fresh thread after the main thread released its pool (the server now).

Real receiver, the shared closed-fuser store of SQuAD paragraphs, k = 3, an instruction that
asks for a long answer (--tokens new tokens, greedy); ms per token after the first. Run it once
per OpenMP setting to compare them (e.g. OMP_WAIT_POLICY=ACTIVE python benchmarks/serve_threads.py).

    python benchmarks/serve_threads.py [--weights int4] [--tokens 64] [--rounds 3] [--threads 2]
"""

from __future__ import annotations

import argparse
import sys
import threading

import bench_common as bc

QUESTION = "Write a long, detailed summary of these passages, sentence by sentence."
PLACES = ("main", "thread, two pools", "thread, one pool")


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--weights", default="int4", help="as-loaded, int8 or int4 (`ask --weights`)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    return ap.parse_args(argv)


def decode_ms(asker, options) -> float:
    """ms per token after the first, for one answer decoded on the calling thread."""
    from cachegraft_cli.lm.generation import generate

    prepared = asker.prepare(QUESTION, options)
    gen = generate(prepared.lm, prepared.prompt, options.generation)
    t = gen.timings
    return (t["total"] - t["first_token"]) / max(len(gen.token_ids) - 1, 1) * 1000


def on_thread(asker, options) -> float:
    out: list[float] = []
    worker = threading.Thread(target=lambda: out.append(decode_ms(asker, options)))
    worker.start()
    worker.join()
    return out[0]


def one_round(asker, options) -> dict[str, float]:
    from cachegraft_cli.lm import openmp

    got = {"main": decode_ms(asker, options)}  # the main thread's pool exists from here on
    got["thread, two pools"] = on_thread(asker, options)
    openmp.release_pool()
    got["thread, one pool"] = on_thread(asker, options)
    return got


def main(argv=None) -> int:
    from dataclasses import replace

    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions
    from cachegraft_cli.lm import openmp
    from cachegraft_cli.session import ModelOverrides

    args = parse_args(argv)
    bc.set_threads(args.threads)
    url, session, _, _ = bc.real_store(bc.REAL_PASSAGES)
    asker = Asker(url, ModelOverrides(None, weights=args.weights).check())
    asker.warm("graft")
    options = AskOptions(k=3)
    options = replace(options, generation=replace(options.generation, max_new_tokens=args.tokens))
    start = bc.machine()
    rounds = [one_round(asker, options) for _ in range(args.rounds)]
    figures = {place: bc.median([r[place] for r in rounds]) for place in PLACES}
    bc.print_table(f"Decode on another thread, --weights {args.weights}, {args.tokens} tokens, ms per token "
                   f"(median of {args.rounds}); OpenMP runtime {openmp.runtime() or 'not libgomp'}",
                   ["where", "ms/token", "tokens/s", "vs main"],
                   [[p, f"{figures[p]:.1f}", f"{1000 / figures[p]:.1f}", f"{figures[p] / figures['main']:.2f}x"]
                    for p in PLACES])
    bc.emit({"bench": "serve_threads", "weights": args.weights, "figures": figures, "rounds": rounds,
             "machine_start": start, "machine_end": bc.machine()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
