"""`cachegraft serve` under load: questions/s and time to first token (p50, p99) at 1, 4 and
16 concurrent streaming clients, k=5, graft and text (`model` = STORE/text) through the same
server; and, from a shell, `cachegraft ask --server` against a cold `cachegraft ask` per
question (wall-time ratio, interleaved in one run).

    python benchmarks/serve_load.py [--store DIR] [--clients 1,4,16] [--rounds 2] [--shell 3]

The store defaults to sample_data/corpus.jsonl encoded with `--preset offline` into
$CACHEGRAFT_BENCH_DIR/serve-sample (once). Without the pulled offline pair it says so and
exits. TTFT is measured at the client: request sent -> first non-empty content chunk.
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(REPO)}
CLI = [sys.executable, "-m", "cachegraft_cli"]
WORK = Path(os.environ.get("CACHEGRAFT_BENCH_DIR", "/tmp/cachegraft-bench"))


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def models_pulled() -> bool:
    found = subprocess.run([*CLI, "models", "path", "qwen2.5-coder-0.5b-instruct"], env=ENV, capture_output=True)
    return found.returncode == 0


def ensure_store(path: Path) -> None:
    if (path / "manifest.json").exists() and (path / "index").exists():
        return
    log(f"encoding sample_data/corpus.jsonl into {path} (offline pair, once)")
    subprocess.run([*CLI, "encode", str(REPO / "sample_data" / "corpus.jsonl"), "--store", str(path),
                    "--preset", "offline"], env=ENV, check=True)
    subprocess.run([*CLI, "index", "--store", str(path)], env=ENV, check=True)


def questions() -> list[str]:
    lines = (REPO / "sample_data" / "questions.jsonl").read_text().splitlines()
    return [json.loads(line)["question"] for line in lines if line.strip()]


class Server:
    def __init__(self, store: Path, port: int, max_tokens: int):
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen([*CLI, "serve", "--store", f"bench={store}", "--port", str(port), "-k", "5",
                                      "--max-new-tokens", str(max_tokens), "--max-batch", "16", "--max-queue", "256",
                                      "--watch", "0"], env=ENV, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            log(f"  serve: {line.rstrip()}")
            if line.startswith("ready:"):
                break
        else:
            raise SystemExit("the server did not start")
        threading.Thread(target=lambda: [None for _ in self.proc.stderr or []], daemon=True).start()

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(timeout=300)


def stream_once(url: str, model: str, question: str, max_tokens: int) -> tuple[float, float]:
    """(seconds to the first content chunk, seconds to the end) of one streamed chat request."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": question}], "stream": True,
            "max_tokens": max_tokens}
    t0 = time.perf_counter()
    first = None
    with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if first is None and line.startswith("data: {") and '"content": "' in line and '"content": ""' not in line:
                first = time.perf_counter() - t0
    end = time.perf_counter() - t0
    return (first if first is not None else end), end


def load_level(url: str, model: str, clients: int, rounds: int, qs: list[str], max_tokens: int) -> dict:
    """`clients` threads, each asking `rounds` questions one after another (all start at once)."""
    ttfts: list[float] = []
    lock = threading.Lock()

    def client(c: int) -> None:
        for r in range(rounds):
            ttft, _ = stream_once(url, model, qs[(c * rounds + r) % len(qs)], max_tokens)
            with lock:
                ttfts.append(ttft)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    ttfts.sort()
    return {"clients": clients, "questions": len(ttfts), "qps": round(len(ttfts) / wall, 3),
            "ttft_p50": round(statistics.median(ttfts), 3),
            "ttft_p99": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3)}


def shell_ratio(url: str, store: Path, qs: list[str], n: int, max_tokens: int) -> dict:
    """Wall time of `cachegraft ask` cold and through `--server`, per question, interleaved."""
    cold, warm = [], []
    for i, q in enumerate(qs[:n]):
        common = [*CLI, "ask", q, "-k", "5", "--max-new-tokens", str(max_tokens), "--json"]
        runs = [("cold", [*common, "--store", str(store)]), ("server", [*common, "--store", "bench", "--server", url])]
        for name, command in runs if i % 2 == 0 else runs[::-1]:
            t0 = time.perf_counter()
            subprocess.run(command, env=ENV, check=True, capture_output=True)
            (cold if name == "cold" else warm).append(time.perf_counter() - t0)
    mean_cold, mean_warm = statistics.mean(cold), statistics.mean(warm)
    return {"questions": len(cold), "cold_s": round(mean_cold, 3), "server_s": round(mean_warm, 3),
            "ratio": round(mean_cold / mean_warm, 2)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--store", type=Path, default=WORK / "serve-sample")
    ap.add_argument("--clients", default="1,4,16")
    ap.add_argument("--rounds", type=int, default=2, help="questions each client asks per level")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--shell", type=int, default=3, help="questions for the shell ratio (0: skip)")
    ap.add_argument("--systems", default="graft,text")
    ap.add_argument("--port", type=int, default=8765)
    args = ap.parse_args()
    if not models_pulled():
        print("serve_load: not run: the offline pair is not pulled (`cachegraft models pull offline`).")
        print(json.dumps({"benchmark": "serve_load", "run": False}))
        return
    ensure_store(args.store)
    qs = questions()
    load_start = os.getloadavg()
    server = Server(args.store, args.port, args.max_tokens)
    rows = []
    try:
        stream_once(server.url, "bench", qs[0], args.max_tokens)  # first request: lazy set-up out of the figures
        for level in [int(c) for c in args.clients.split(",")]:
            systems = [f"bench/{s}" for s in args.systems.split(",")]
            for model in systems if level % 2 else systems[::-1]:  # the order alternates between levels
                row = {"system": model.split("/")[1], **load_level(server.url, model, level, args.rounds, qs,
                                                                   args.max_tokens)}
                log(f"  {row}")
                rows.append(row)
        shell = shell_ratio(server.url, args.store, qs, args.shell, args.max_tokens) if args.shell else None
    finally:
        code = server.stop()
    print(f"{'system':8} {'clients':>7} {'questions':>9} {'q/s':>7} {'TTFT p50':>9} {'TTFT p99':>9}")
    for r in sorted(rows, key=lambda r: (r["system"], r["clients"])):
        print(f"{r['system']:8} {r['clients']:7} {r['questions']:9} {r['qps']:7.3f} {r['ttft_p50']:9.3f} "
              f"{r['ttft_p99']:9.3f}")
    graft = {r["clients"]: r for r in rows if r["system"] == "graft"}
    scaling = round(graft[4]["ttft_p50"] / graft[1]["ttft_p50"], 2) if 1 in graft and 4 in graft else None
    if scaling is not None:
        print(f"graft TTFT p50 at 4 clients / at 1 client: {scaling}x (goal <= 1.5x)")
    if shell:
        print(f"shell, per question ({shell['questions']}): cold `cachegraft ask` {shell['cold_s']} s, "
              f"`ask --server` {shell['server_s']} s: {shell['ratio']}x (goal >= 10x)")
    print(f"server exit code after SIGTERM: {code}; load average {load_start[0]:.2f} -> {os.getloadavg()[0]:.2f}")
    print(json.dumps({"benchmark": "serve_load", "run": True, "rows": rows, "graft_ttft_4_over_1": scaling,
                      "shell": shell, "exit_code": code, "loadavg": [round(load_start[0], 2),
                                                                     round(os.getloadavg()[0], 2)]}))


if __name__ == "__main__":
    main()
