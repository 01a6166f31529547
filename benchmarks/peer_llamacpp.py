"""CacheGraft against the peer a CPU user would pick: text RAG on llama.cpp, side by side.

The peer is llama-cpp-python's OpenAI-compatible server (llama.cpp built from source on this
machine by `pip install 'cachegraft[peer]'`) serving the receiver's own GGUF, the very file the
offline receiver is converted from (`cachegraft models pull offline --keep-gguf` keeps it,
sha256-checked), with the same thread count as `cachegraft serve` and prompt caching as llama.cpp's
server does it: the longest prefix shared with the previous prompt is reused (llama-cpp-python
always does this). Its optional RAM cache of whole states (`--cache true`) stays off: saving the
state after each answer cost about 1.3 s at these prompt lengths (decode measured 5.8 tokens/s
with it, 23.8 without). The peer answers one request at a time (llama-cpp-python's server holds a
lock; queued requests wait, `--interrupt_requests false`), as its users get it.
`cachegraft serve` serves int8 stores (the default codec) of the three QA sets' paragraphs:
`benchmarks/codec_fidelity.py`'s, built here if absent.

For each question and k, the peer gets exactly the prompt our `text` system builds: the passages
our BM25 index retrieves, best last, in the receiver's chat template (sent as text; the peer's
tokenizer is checked to give back the same ids, and the share that does is printed). Both
servers decode greedily, 16 new tokens at most, the peer's repeat penalty off. At 1 client the
systems take turns per question (the order rotating); at 4 clients each system gets the
questions from 4 concurrent clients in turn, so the servers never share the cores.

Reported per system, k and client count: time to first token (p50, p90, at the client: request
sent to first content), decode tokens/s (tokens after the first over the time after the first,
summed over answers) and decode steps/s (the same with the step of each stop token counted),
whole-answer latency (p50), answers/s, EM/F1 against the gold answers, and how often the peer's
answers equal our `text` answers (a check that the prompts match).

    python benchmarks/peer_llamacpp.py [--per-set 40] [--k 1,3,5] [--clients 1,4] [--four-k 3,5]

Skips cleanly (exit 0, says why) without the `peer` extra, the GGUF, the pulled pair or the QA
data. Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import bench_common as bc

SETS = {"squad": "squad_v1.1_dev.json", "new_wiki": "squadshifts_new_wiki.json", "nyt": "squadshifts_nyt.json"}
RECEIVER_NAME = "qwen2.5-coder-0.5b-instruct"
SERVE_LOG = bc.WORK_DIR / "peer-serve.stderr"  # `cachegraft serve`'s stderr of the last run
SYSTEMS = ("peer-text", "graft", "text")
GOALS = {"first_token": 10.0, "whole_answer": 3.0, "decode": 1.0}  # graft vs the peer (issue 35)


def parse_args(argv):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--per-set", type=int, default=40, help="questions from each of the three sets")
    ap.add_argument("--k", default="1,3,5", help="k values at 1 client")
    ap.add_argument("--clients", default="1,4")
    ap.add_argument("--four-k", default="3,5", help="k values at more than 1 client")
    ap.add_argument("--four-every", type=int, default=1, help="at more than 1 client, every n-th question")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--weights", default="as-loaded", help="`cachegraft serve --weights`: as-loaded, int8 or int4")
    ap.add_argument("--threads", type=int, default=2, help="both servers' CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, help="also write every figure and answer here")
    return ap.parse_args(argv)


def missing() -> str | None:
    """Why the benchmark cannot run here, or None."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return "llama-cpp-python is not installed (pip install 'cachegraft[peer]'; it builds llama.cpp, ~5-15 min)"
    from cachegraft_cli.lm import pull

    if not pull.is_pulled(RECEIVER_NAME) or not pull.gguf_path(RECEIVER_NAME).is_file():
        return "the receiver's GGUF is not kept (cachegraft models pull offline --keep-gguf)"
    if not all((bc.QA_DATA / f).is_file() for f in SETS.values()):
        return f"the QA sets are not in {bc.QA_DATA} (set CACHEGRAFT_QA_DATA)"
    return None


# ---------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, proc: subprocess.Popen, seconds: float = 300) -> None:
    import httpx

    end = time.monotonic() + seconds
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited ({proc.returncode}) before it was ready: {url}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"server not ready after {seconds:.0f} s: {url}")


def start_peer(gguf: Path, threads: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--host", "127.0.0.1", "--port", str(port),
           "--n_threads", str(threads), "--n_threads_batch", str(threads), "--n_ctx", "4096", "--n_batch", "512",
           "--cache", "false", "--interrupt_requests", "false", "--verbose", "false"]
    proc = subprocess.Popen(cmd, env=user_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


def user_env() -> dict:
    """The environment a user's shell gives a server: without the OpenMP wait settings this
    benchmark process runs under (`bench_common`). llama.cpp's CPU backend is OpenMP too (libgomp),
    and each server keeps its own defaults: `cachegraft serve` sets its own."""
    return {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}


def start_ours(stores: dict[str, str], threads: int, max_tokens: int,
               weights: str = "as-loaded") -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "cachegraft_cli", "serve", "--port", str(port), "--max-new-tokens", str(max_tokens),
           "--max-batch", "8", "--max-queue", "256", "--watch", "0", "--weights", weights]
    for name, url in stores.items():
        cmd += ["--store", f"{name}={url}"]
    env = {**user_env(), "PYTHONPATH": str(bc.REPO), "OMP_NUM_THREADS": str(threads)}
    SERVE_LOG.parent.mkdir(parents=True, exist_ok=True)
    with SERVE_LOG.open("w") as log:  # a failed request says "the server's stderr has the details": keep them
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    wait_ready(url, proc)
    return proc, url


# ---------------------------------------------------------------- one request


def stream(url: str, path: str, body: dict) -> dict:
    """One streamed request: seconds to the first content, to the end; the text; tokens generated
    (our server's usage; the peer streams one chunk per token)."""
    import httpx

    t0, first, pieces, chunks, usage = time.perf_counter(), None, [], 0, None
    with httpx.stream("POST", f"{url}{path}", json={**body, "stream": True}, timeout=900) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                raise RuntimeError(f"{url}: {event['error']}")
            usage = event.get("usage") or usage
            choice = (event.get("choices") or [{}])[0]
            text = choice.get("text") if "text" in choice else (choice.get("delta") or {}).get("content")
            if text is None:
                continue
            if "text" in choice and choice.get("finish_reason") is None:
                chunks += 1
            if text:
                first = first if first is not None else time.perf_counter() - t0
                pieces.append(text)
    end = time.perf_counter() - t0
    tokens = usage["completion_tokens"] if usage else chunks
    return {"first": first if first is not None else end, "end": end, "text": "".join(pieces).strip(),
            "tokens": tokens}


def ask(system: str, item: dict, k: int, urls: dict, max_tokens: int) -> dict:
    if system == "peer-text":
        body = {"prompt": item["prompts"][k], "max_tokens": max_tokens, "temperature": 0.0, "repeat_penalty": 1.0,
                "top_k": 1}
        return stream(urls["peer"], "/v1/completions", body)
    body = {"model": f"{item['set']}/{system}", "messages": [{"role": "user", "content": item["question"]}],
            "max_tokens": max_tokens, "temperature": 0.0, "k": k}
    return stream(urls["ours"], "/v1/chat/completions", body)


# ---------------------------------------------------------------- inputs


def inputs(args) -> tuple[dict[str, str], list[dict]]:
    """The int8 store of each set (built once) and the questions, each with the peer's prompts
    per k: our `text` plan's ids rendered as text."""
    from codec_fidelity import OFFLINE_FUSER, sample

    from cachegraft_cli.answering.ask import Asker
    from cachegraft_cli.answering.options import AskOptions

    session = None
    stores, items = {}, []
    ks = sorted({int(k) for k in args.k.split(",")} | {int(k) for k in args.four_k.split(",")})
    for name, file in SETS.items():
        passages, questions = sample(str(bc.QA_DATA / file), 200, 60, args.seed)  # codec_fidelity's stores
        tag = OFFLINE_FUSER.split(":", 1)[1]
        base = bc.WORK_DIR / f"fidelity-{tag}-{bc.DTYPE or 'auto'}-{name}-n{len(passages)}"
        stores[name] = f"{base}-int8"
        if not (Path(stores[name]) / "index").exists():
            from codec_quality import transcode

            session = session or bc.session_for(OFFLINE_FUSER)
            bc.ensure_store(f"{base}-float32", passages, session, codec="float32")
            transcode(f"{base}-float32", stores[name], "int8")
        asker = Asker(stores[name], session=session)
        tok = asker.session.tokenizer
        for q in questions[: args.per_set + (name == "squad")]:  # squad's extra one: the warm-up
            prompts, ids = {}, {}
            for k in ks:
                plan = asker.plan(q.question, asker.retrieve(q.question, k), AskOptions("text", k))
                ids[k] = plan.prefix_ids + [i for p in plan.passage_ids for i in p] + plan.question_ids
                prompts[k] = tok.decode(ids[k], skip_special_tokens=False)
            items.append({"set": name, "question": q.question, "answers": list(q.answers), "prompts": prompts,
                          "ids": ids})
    return stores, items


def same_tokens(url: str, items: list[dict]) -> float:
    """The share of prompts the peer's tokenizer turns back into our ids."""
    import httpx

    same = total = 0
    for item in items:
        for k, prompt in item["prompts"].items():
            got = httpx.post(f"{url}/extras/tokenize", json={"input": prompt}, timeout=60).json()["tokens"]
            same += got == item["ids"][k]
            total += 1
    return same / max(total, 1)


# ---------------------------------------------------------------- levels


def one_client(items: list[dict], ks: list[int], urls: dict, max_tokens: int) -> dict:
    """{(system, k, 1): [answers]}: per question, the systems back to back, the order rotating."""
    out: dict = {}
    for k in ks:
        for i in range(len(items)):
            for system in bc.rotated(list(SYSTEMS), i + k):
                out.setdefault((system, k, 1), []).append(
                    attempt(lambda i, s=system, k=k: ask(s, items[i], k, urls, max_tokens), i))
            if (i + 1) % 20 == 0:
                bc.log(f"k={k}: {i + 1}/{len(items)} questions at 1 client")
    return out


def many_clients(items: list[dict], ks: list[int], clients: int, urls: dict, max_tokens: int,
                 every: int) -> tuple[dict, dict]:
    """{(system, k, clients): [answers]} and each level's wall time: every system in turn gets
    every `every`-th question from `clients` threads at once."""
    out, walls = {}, {}
    chosen = list(range(0, len(items), every))
    for n, k in enumerate(ks):
        for system in bc.rotated(list(SYSTEMS), n):
            t0 = time.perf_counter()
            out[(system, k, clients)] = concurrently(lambda i, s=system, k=k: ask(s, items[i], k, urls, max_tokens),
                                                     chosen, clients)
            walls[(system, k, clients)] = time.perf_counter() - t0
            bc.log(f"k={k}, {clients} clients, {system}: {walls[(system, k, clients)]:.0f} s")
    return out, walls


def attempt(one, i: int) -> dict:
    """`one(i)`'s answer, or the failure: a failed request is a figure too, counted and never dropped."""
    try:
        return {**one(i), "item": i}
    except Exception as exc:  # noqa: BLE001
        return {"item": i, "error": str(exc)[:300]}


def concurrently(one, chosen: list[int], clients: int) -> list[dict]:
    """`one(i)` for every question `i` of `chosen`, from `clients` threads taking the next one free."""
    answers: list = []
    lock, queue = threading.Lock(), list(chosen)

    def client() -> None:
        while True:
            with lock:
                if not queue:
                    return
                i = queue.pop(0)
            got = attempt(one, i)
            with lock:
                answers.append(got)

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return answers


# ---------------------------------------------------------------- figures


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def row(answers: list[dict], items: list[dict], wall: float | None, max_tokens: int = 16) -> dict | None:
    """The figures of one cell over its answered requests (`errors`: the failed ones); None when
    every request failed. `decode_steps_s` counts each answer's last step too: an answer shorter
    than `max_tokens` ended on a stop token that neither server streams, a step with no token, so
    short answers lower tokens/s but not the step rate."""
    from cachegraft_cli.evaluation.metrics import exact_match, f1_score

    errors = sum("error" in a for a in answers)
    answers = [a for a in answers if "error" not in a]
    if not answers:
        return None
    firsts, ends = [a["first"] for a in answers], [a["end"] for a in answers]
    after = [(a["tokens"] - 1, a["end"] - a["first"]) for a in answers if a["tokens"] > 1]
    decoded, seconds = sum(t for t, _ in after), max(sum(s for _, s in after), 1e-9)
    stops = sum(a["tokens"] < max_tokens for a in answers if a["tokens"] > 1)
    golds = [items[a["item"]]["answers"] for a in answers]
    return {
        "answers": len(answers), "errors": errors,
        "ttft_p50": statistics.median(firsts), "ttft_p90": pct(firsts, 0.9),
        "whole_p50": statistics.median(ends), "whole_mean": statistics.mean(ends),
        "decode_tok_s": decoded / seconds,
        "decode_steps_s": (decoded + stops) / seconds,
        "tokens_mean": statistics.mean(a["tokens"] for a in answers),
        "answers_per_s": len(answers) / (wall if wall else sum(ends)),
        "em": 100 * statistics.mean(exact_match(a["text"], g) for a, g in zip(answers, golds)),
        "f1": 100 * statistics.mean(f1_score(a["text"], g) for a, g in zip(answers, golds)),
    }


def agreement(runs: dict, k: int, clients: int) -> float | None:
    peer, ours = runs.get(("peer-text", k, clients)), runs.get(("text", k, clients))
    if not peer or not ours:
        return None
    by_item = {a["item"]: a.get("text") for a in ours}
    both = [a for a in peer if "error" not in a and by_item.get(a["item"]) is not None]
    return sum(a["text"] == by_item[a["item"]] for a in both) / len(both) if both else None


def report(rows: dict, agree: dict, same: float, args) -> None:
    headers = ["system", "k", "clients", "n", "failed", "TTFT p50", "TTFT p90", "whole p50", "decode tok/s",
               "steps/s", "answers/s", "EM", "F1"]
    table = [[s, k, c, r["answers"], r["errors"], f"{r['ttft_p50']:.3f}", f"{r['ttft_p90']:.3f}",
              f"{r['whole_p50']:.3f}", f"{r['decode_tok_s']:.1f}", f"{r['decode_steps_s']:.1f}",
              f"{r['answers_per_s']:.3f}", f"{r['em']:.1f}", f"{r['f1']:.1f}"]
             for (s, k, c), r in sorted(rows.items(), key=lambda kv: (kv[0][2], kv[0][1], kv[0][0]))]
    bc.print_table(f"Text RAG on llama.cpp vs CacheGraft serve (--weights {args.weights}), "
                   f"{args.max_tokens} new tokens, greedy", headers, table)
    print(f"peer tokenizer gives back our text prompt's ids: {100 * same:.1f}% of prompts")
    for (k, c), share in sorted(agree.items()):
        if share is not None:
            print(f"k={k}, {c} client(s): peer-text answer == our text answer in {100 * share:.1f}%")
    for (s, k, c), r in sorted(rows.items()):
        if s != "graft" or ("peer-text", k, c) not in rows:
            continue
        p = rows[("peer-text", k, c)]
        ft, wa = p["ttft_p50"] / r["ttft_p50"], p["whole_p50"] / r["whole_p50"]
        dec = r["decode_tok_s"] / max(p["decode_tok_s"], 1e-9)
        steps = r["decode_steps_s"] / max(p["decode_steps_s"], 1e-9)
        print(f"k={k}, {c} client(s): peer/graft first token {ft:.1f}x {bc.verdict(ft, GOALS['first_token'], False)}"
              f"; whole answer {wa:.1f}x {bc.verdict(wa, GOALS['whole_answer'], False)}; graft/peer decode "
              f"{dec:.2f}x {bc.verdict(dec, GOALS['decode'], False)} (per step {steps:.2f}x)")


def main(argv=None) -> int:
    args = parse_args(argv)
    why = missing()
    if why:
        print(f"peer_llamacpp: not run: {why}.")
        print(json.dumps({"bench": "peer_llamacpp", "run": False, "why": why}))
        return 0
    from cachegraft_cli.lm import pull

    start_machine = bc.machine()
    stores, items = inputs(args)
    warm, items = items[args.per_set], items[: args.per_set] + items[args.per_set + 1:]
    ks = [int(k) for k in args.k.split(",")]
    peer, peer_url = start_peer(pull.gguf_path(RECEIVER_NAME), args.threads)
    ours, ours_url = start_ours(stores, args.threads, args.max_tokens, args.weights)
    urls = {"peer": peer_url, "ours": ours_url}
    try:
        same = same_tokens(peer_url, items)
        for system in SYSTEMS:  # first requests, on a question not measured: lazy set-up out of the figures
            ask(system, warm, ks[0], urls, args.max_tokens)
        runs, walls = {}, {}
        for clients in [int(c) for c in args.clients.split(",")]:
            if clients == 1:
                runs.update(one_client(items, ks, urls, args.max_tokens))
            else:
                got, wall = many_clients(items, [int(k) for k in args.four_k.split(",")], clients, urls,
                                         args.max_tokens, args.four_every)
                runs.update(got)
                walls.update(wall)
    finally:
        for proc in (peer, ours):
            proc.terminate()
            proc.wait(timeout=120)
    cells = {key: row(answers, items, walls.get(key), args.max_tokens) for key, answers in runs.items()}
    rows = {key: r for key, r in cells.items() if r is not None}
    failed = sum("error" in a for xs in runs.values() for a in xs)
    if failed:
        first = next(a["error"] for xs in runs.values() for a in xs if "error" in a)
        print(f"{failed} requests failed (first: {first}); our server's stderr: {SERVE_LOG}", file=sys.stderr)
    agree = {(k, c): agreement(runs, k, c) for (_, k, c) in runs}
    figures = {"bench": "peer_llamacpp", "run": True, "questions": len(items), "machine_start": start_machine,
               "machine_end": bc.machine(), "prompt_ids_same": same,
               "rows": [{"system": s, "k": k, "clients": c, **r} for (s, k, c), r in rows.items()],
               "agreement": [{"k": k, "clients": c, "share": a} for (k, c), a in agree.items()]}
    if args.json:
        answers = [{"system": s, "k": k, "clients": c, **a} for (s, k, c), xs in runs.items() for a in xs]
        Path(args.json).write_text(json.dumps({**figures, "answers": answers}, indent=1))
    report(rows, agree, same, args)
    print(json.dumps(figures))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
