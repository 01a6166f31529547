"""`cachegraft serve`: check everything, bind the port, load the models once, serve under
uvicorn until SIGTERM or Ctrl-C, then finish what is in flight and return."""

from __future__ import annotations

import signal
import socket
from dataclasses import dataclass, field
from typing import Callable

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import UsageError
from cachegraft_cli.serving.engine import EngineSettings
from cachegraft_cli.serving.requests import Limits, check_limits

LOOPBACK = ("127.0.0.1", "localhost", "::1")


@dataclass
class ServeConfig:
    stores: dict[str, str]  # name -> path or URL, in the order given (the first is the default)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    defaults: AskOptions = field(default_factory=AskOptions)
    limits: Limits = field(default_factory=Limits)
    engine: EngineSettings = field(default_factory=EngineSettings)
    sharer: str | None = None
    device: str | None = None
    dtype: str | None = None
    index_kind: str | None = None
    trust_remote_code: bool = False


def parse_stores(specs: list[str]) -> dict[str, str]:
    """`--store DIR` or `--store NAME=DIR`, repeatable; a bare DIR is named by its last path part."""
    import re

    stores: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or "/" in name or ":" in name:
            name, path = re.split(r"[/:]", spec.rstrip("/"))[-1], spec
        if not name or not path:
            raise UsageError(f"--store {spec!r} names no store.", "Use --store DIR or --store NAME=DIR.")
        if name in stores:
            raise UsageError(f"Two stores are named {name!r}.", "Name them apart with --store NAME=DIR.")
        stores[name] = path
    if not stores:
        raise UsageError("No store to serve.", "Give --store DIR (repeatable, or NAME=DIR).")
    return stores


def check(config: ServeConfig):
    """Everything that fails without a model: the stores, options, limits, the model overrides.
    Returns the model overrides."""
    from cachegraft_cli.session import ModelChoice
    from cachegraft_cli.store import CacheStore

    for url in config.stores.values():
        CacheStore.check_exists(url)
    config.defaults.check()
    check_limits(config.defaults, config.limits)
    e = config.engine
    if e.max_queue < 1 or e.max_batch < 1 or e.watch_seconds < 0:
        raise UsageError("--max-queue and --max-batch must be at least 1, --watch at least 0.", "")
    return ModelChoice("", config.sharer, None, device=config.device, dtype=config.dtype,
                       trust_remote_code=config.trust_remote_code).check()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before any model loads (a port in use fails in a second)."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        sock = socket.socket(info[0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(info[4])
    except OSError as exc:
        raise UsageError(f"Cannot listen on {host}:{port}: {exc.strerror or exc}.",
                         "Pick another --port, or stop what is using it.") from None
    sock.listen(128)
    return sock


def require_stack() -> None:
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise UsageError("`cachegraft serve` needs the serve extra (starlette, uvicorn).",
                         "Install it: pip install 'cachegraft[serve]'") from None


def serve(config: ServeConfig, log: Callable[[str], None], ready: Callable[[dict], None]) -> None:
    """Serve until SIGTERM/SIGINT; then stop accepting, finish every request in flight, return."""
    require_stack()
    overrides = check(config)
    sock = bind(config.host, config.port)
    try:
        engine = _open_engine(config, overrides, log)
        _run(config, engine, sock, lambda: ready(describe(config, engine, sock)))
    finally:
        sock.close()


def _open_engine(config: ServeConfig, overrides, log):
    from cachegraft_cli.serving.engine import Engine

    engine = Engine(config.stores, overrides, config.index_kind, config.engine, log)
    engine.open(config.defaults.system)
    return engine


def _run(config: ServeConfig, engine, sock: socket.socket, on_ready: Callable[[], None]) -> None:
    import uvicorn

    from cachegraft_cli.serving.http import AppConfig, build_app

    app = build_app(engine, AppConfig(config.defaults, config.limits, config.api_key, on_ready))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=None,
                                           access_log=False))
    engine.start()
    # uvicorn re-raises the signal it caught once it has drained; these handlers take it, so a
    # drained server returns (exit 0) instead of dying of the signal.
    previous = {s: signal.signal(s, _drained) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        engine.close()
        for s, handler in previous.items():
            signal.signal(s, handler)


def _drained(signum, frame) -> None:
    """Nothing left to do: uvicorn has already stopped accepting and finished in-flight requests."""


def describe(config: ServeConfig, engine, sock: socket.socket) -> dict:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    stores = {}
    for name, asker in engine.askers.items():
        choice = asker.session.choice
        stores[name] = {"path": config.stores[name], "passages": len(asker.store), "indexed": len(asker.index),
                        "receiver": choice.receiver, "sharer": choice.sharer,
                        "fuser": (asker.store.identity.get("fuser") or {}).get("name")}
    return {"url": f"http://{shown}:{port}", "stores": stores, "system": config.defaults.system,
            "auth": bool(config.api_key), "exposed": config.host not in LOOPBACK}
