from __future__ import annotations

import os
from typing import Annotated, Optional

import typer

from cachegraft_cli.answering.assembly import DEFAULT_ORDER, DEFAULT_RECOMPUTE
from cachegraft_cli.cli.options import (
    DeviceOpt,
    DtypeOpt,
    HiddenBlendLayerOpt,
    HiddenBlendOpt,
    OrderOpt,
    RecomputeOpt,
    SchemeOpt,
    SharerOpt,
    TopKOpt,
    TrustOpt,
    WeightsOpt,
)
from cachegraft_cli.cli.output import log


def serve(
    store: Annotated[list[str], typer.Option("--store", "-s", help="Store to serve: DIR or NAME=DIR (repeatable; "
                                                                   "the first is the default).")],
    host: Annotated[str, typer.Option(help="Address to listen on (127.0.0.1: this machine only).")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="Port to listen on (0: any free one).")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(
        envvar="CACHEGRAFT_API_KEY", help="Require 'Authorization: Bearer KEY' on every request.")] = None,
    k: TopKOpt = 3,
    system: Annotated[str, typer.Option(help="Default system: graft, adapter, mismatched, cache, text, closed or "
                                             "sharer-text.")] = "graft",
    scheme: SchemeOpt = "rotate",
    order: OrderOpt = DEFAULT_ORDER,
    recompute: RecomputeOpt = DEFAULT_RECOMPUTE,
    blend: HiddenBlendOpt = 0.0,
    blend_layer: HiddenBlendLayerOpt = 1,
    max_new_tokens: Annotated[int, typer.Option(min=1, help="Default answer length limit in tokens.")] = 48,
    temperature: Annotated[float, typer.Option(min=0.0, help="Default temperature (0 = greedy).")] = 0.0,
    index_kind: Annotated[Optional[str], typer.Option(help="Search hybrid indexes as bm25 or dense.")] = None,
    max_queue: Annotated[int, typer.Option(min=1, help="Questions waiting or being answered; one more gets "
                                                       "429.")] = 64,
    max_batch: Annotated[int, typer.Option(min=1, max=256, help="Questions decoding at once (more wait in "
                                                                "the queue).")] = 8,
    batch_wait: Annotated[float, typer.Option(min=0.0, max=10000.0, help="Milliseconds an idle worker waits for more "
                                                                         "questions to prefill with one.")] = 5.0,
    max_k: Annotated[int, typer.Option(min=1, help="Largest k a request may ask for.")] = 20,
    max_tokens: Annotated[int, typer.Option(min=1, help="Largest max_tokens a request may ask for.")] = 512,
    max_body: Annotated[int, typer.Option(min=1024, help="Largest request body in bytes.")] = 1 << 20,
    watch: Annotated[float, typer.Option(min=0.0, help="Seconds between checks for appends and new indexes "
                                                       "(0: only POST /v1/reload).")] = 2.0,
    header_timeout: Annotated[float, typer.Option(min=0.001, help="Seconds a request's line and headers may take "
                                                                  "to arrive; then 408 and close.")] = 10.0,
    body_timeout: Annotated[float, typer.Option(min=0.001, help="Seconds a request's body may take to arrive "
                                                                "after its headers; then 408 and close.")] = 30.0,
    shutdown_timeout: Annotated[int, typer.Option(min=0, help="Seconds SIGTERM waits for the requests in flight; "
                                                              "then those still running are cut off.")] = 30,
    sharer: SharerOpt = None,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    weights: WeightsOpt = None,
    trust_remote_code: TrustOpt = False,
) -> None:
    """Serve stores over HTTP: OpenAI-compatible chat completions, /v1/ask, /v1/retrieve (models load once)."""
    # Before torch loads: OpenMP threads that spin between parallel regions take the cores from the
    # event loop that streams tokens and parses requests (at 4 clients: +22% q/s, p99 TTFT 0.92 -> 0.68 s).
    # But a decode step is ~1,000 short parallel regions, and waking sleeping threads for each cost
    # 40% of an int4 step (40 -> 27 ms): a short spin first (~0.1 ms) keeps both (docs/results.md).
    # (The worker thread also takes over the loader's OpenMP pool: `lm/openmp.py`.)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    os.environ.setdefault("GOMP_SPINCOUNT", "10000")
    from cachegraft_cli.answering.options import AskOptions, check_index_kind
    from cachegraft_cli.cli.output import showing_status
    from cachegraft_cli.lm.sampling import GenerationOptions
    from cachegraft_cli.serving.requests import Limits
    from cachegraft_cli.serving.server import ServeOptions, Timeouts, check_api_key, parse_stores, serve as run_server
    from cachegraft_cli.serving.worker import WorkerOptions

    check_index_kind(index_kind)
    defaults = AskOptions(system=system, k=k, scheme=scheme, order=order, recompute=recompute, blend=blend,
                          blend_layer=blend_layer,
                          generation=GenerationOptions(max_new_tokens=max_new_tokens, temperature=temperature))
    config = ServeOptions(parse_stores(store), host, port, check_api_key(api_key), defaults,
                         Limits(max_k=max_k, max_new_tokens=max_tokens, max_body=max_body),
                         WorkerOptions(max_queue=max_queue, max_batch=max_batch, gather_seconds=batch_wait / 1000,
                                        watch_seconds=watch),
                         Timeouts(headers=header_timeout, body=body_timeout, shutdown=shutdown_timeout),
                         sharer, device, dtype, index_kind, trust_remote_code, weights)
    with showing_status(False):
        drained = run_server(config, log, _announce)
    log("stopped: every request in flight was answered." if drained else
        f"stopped: requests still running {shutdown_timeout} s after the signal were cut off (--shutdown-timeout).")


def _announce(info: dict) -> None:
    for name, s in info["stores"].items():
        fuser = s["fuser"] or "closed fuser"
        log(f"store {name}: {s['path']} ({s['passages']:,} passages, {s['indexed']:,} indexed; receiver "
            f"{s['receiver']}, {fuser})")
    log(f"default system {info['system']}; " + ("API key required" if info["auth"] else "no API key"))
    if info["exposed"] and not info["auth"]:
        log("warning: listening beyond this machine without --api-key: anyone who can reach it can ask.")
    log(f"ready: {info['url']}  (OpenAI base URL {info['url']}/v1; SIGTERM or Ctrl-C stops it)")
