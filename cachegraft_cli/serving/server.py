"""`cachegraft serve`: check everything, bind the port, load the models once, serve under
uvicorn until SIGTERM or Ctrl-C, then finish what is in flight (within a bound) and return.

uvicorn bounds only the idle time between two requests (keep-alive): a client that never
finishes its headers, or stops mid-body, would hold its connection, and SIGTERM's drain,
forever. `h11_protocol` adds read deadlines to uvicorn's h11 protocol; `Timeouts` sets them.
"""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import time
from dataclasses import dataclass, field, replace
from http import HTTPStatus
from typing import Callable

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import UsageError
from cachegraft_cli.serving.requests import Limits, check_limits
from cachegraft_cli.serving.worker import WorkerOptions

LOOPBACK = ("127.0.0.1", "localhost", "::1")
MAX_HEAD_BYTES = 16 * 1024  # a request line plus headers (h11's default, stated): over it, a 400 and close
BODY_GRACE = 1.0  # the connection's own body deadline trails the app's (which answers 408) by this


@dataclass(frozen=True)
class Timeouts:
    """Seconds a client may take, and how long SIGTERM waits for the requests in flight."""

    headers: float = 10.0  # a request's line and headers, from the connection (or the previous response) on
    body: float = 30.0  # its body, from the end of its headers on
    shutdown: int = 30  # after SIGTERM, requests still running are cut off (uvicorn counts whole seconds)


@dataclass
class ServeOptions:
    stores: dict[str, str]  # name -> path or URL, in the order given (the first is the default)
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    defaults: AskOptions = field(default_factory=AskOptions)
    limits: Limits = field(default_factory=Limits)
    worker: WorkerOptions = field(default_factory=WorkerOptions)
    timeouts: Timeouts = field(default_factory=Timeouts)
    sharer: str | None = None
    device: str | None = None
    dtype: str | None = None
    index_kind: str | None = None
    trust_remote_code: bool = False
    weights: str | None = None


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


def check(config: ServeOptions):
    """Everything that fails without a model: the stores, options, limits, the model overrides.
    Returns the model overrides."""
    from cachegraft_cli.session import ModelOverrides
    from cachegraft_cli.store import CacheStore

    for url in config.stores.values():
        CacheStore.check_exists(url)
    config.defaults.check()
    check_limits(config.defaults, config.limits)
    e, t = config.worker, config.timeouts
    if e.max_queue < 1 or e.max_batch < 1 or e.watch_seconds < 0:
        raise UsageError("--max-queue and --max-batch must be at least 1, --watch at least 0.", "")
    if not (t.headers > 0 and t.body > 0 and t.shutdown >= 0):
        raise UsageError("--header-timeout and --body-timeout must be above 0, --shutdown-timeout at least 0.", "")
    check_api_key(config.api_key)
    return ModelOverrides(config.sharer, device=config.device, dtype=config.dtype,
                          trust_remote_code=config.trust_remote_code, weights=config.weights).check()


def check_api_key(key: str | None) -> str | None:
    """The key as requests are checked against it: without surrounding whitespace (a header value
    loses its own, so a padded key could never match). An empty key is refused rather than taken
    as none: `--api-key ""` must not quietly serve without one."""
    if key is None:
        return None
    stripped = key.strip()
    if not stripped:
        raise UsageError("--api-key is empty.", "Pass a key, or leave --api-key and CACHEGRAFT_API_KEY unset to "
                                                "serve without one.")
    if not (stripped.isascii() and stripped.isprintable()):
        raise UsageError("--api-key must be printable ASCII (an HTTP header carries it).", "Pick another key.")
    return stripped


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


def serve(config: ServeOptions, log: Callable[[str], None], ready: Callable[[dict], None]) -> bool:
    """Serve until SIGTERM/SIGINT; then stop accepting, finish the requests in flight (cutting
    off any still running `config.timeouts.shutdown` seconds later), return. True if none was
    cut off."""
    require_stack()
    overrides = check(config)
    config = replace(config, api_key=check_api_key(config.api_key))
    sock = bind(config.host, config.port)
    try:
        worker = _open_worker(config, overrides, log)
        return _run(config, worker, sock, lambda: ready(describe(config, worker, sock)))
    finally:
        sock.close()


def _open_worker(config: ServeOptions, overrides, log):
    from cachegraft_cli.serving.worker import Worker

    worker = Worker(config.stores, overrides, config.index_kind, config.worker, log)
    worker.open(config.defaults.system)
    return worker


def _run(config: ServeOptions, worker, sock: socket.socket, on_ready: Callable[[], None]) -> bool:
    from cachegraft_cli.serving.http import AppOptions, build_app

    app = build_app(worker, AppOptions(config.defaults, config.limits, config.api_key, on_ready,
                                      config.timeouts.body))
    server = uvicorn_server(app, config.timeouts)
    worker.start()
    # uvicorn re-raises the signal it caught once it has drained; these handlers take it, so a
    # drained server returns (exit 0) instead of dying of the signal.
    previous = {s: signal.signal(s, _drained) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        # what uvicorn cut off has cancelled its jobs; the bound is for a decode step that hangs
        worker.close(timeout=config.timeouts.shutdown + 10)
        for s, handler in previous.items():
            signal.signal(s, handler)
    return not server.cut_off()


def _drained(signum, frame) -> None:
    """Nothing left to do: uvicorn has already stopped accepting and finished (or cut off) the requests in flight."""


def uvicorn_server(app, timeouts: Timeouts):
    """A uvicorn server of `app` with the read deadlines and the bounded drain of `timeouts`.
    Its `cut_off()` says whether a SIGTERM's drain ran out of time."""
    import uvicorn

    class Server(uvicorn.Server):
        stopping_since: float | None = None

        def handle_exit(self, sig, frame):
            if self.stopping_since is None:
                self.stopping_since = time.monotonic()
            super().handle_exit(sig, frame)

        def cut_off(self) -> bool:
            """Whether the drain took its whole bound (uvicorn then cancelled what was still running)."""
            since = self.stopping_since
            return since is not None and time.monotonic() - since >= timeouts.shutdown

    config = uvicorn.Config(app, http=h11_protocol(timeouts), log_level="warning", lifespan="on", access_log=False,
                            timeout_graceful_shutdown=timeouts.shutdown, h11_max_incomplete_event_size=MAX_HEAD_BYTES)
    return Server(config)


def h11_protocol(timeouts: Timeouts) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with deadlines on reading a request: its line and headers must
    arrive within `timeouts.headers` of the connection's start (or of the previous response),
    else a 408 and close (a connection that sent nothing is closed quietly, as keep-alive does);
    its body within `timeouts.body` of its headers, else the app answers 408 (`read_json`), and
    a body the app never reads is dropped a moment later. A request h11 refuses (a bad request
    line, header or Content-Length; headers over MAX_HEAD_BYTES) gets a JSON 400 in OpenAI's
    shape instead of uvicorn's plain text. Defined here, not at import: uvicorn is an extra."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from cachegraft_cli.serving.http import error_body

    class DeadlineH11Protocol(H11Protocol):
        deadline: asyncio.TimerHandle | None = None
        waiting_for: tuple | None = None  # (request cycle, h11 state) the deadline was armed for

        def connection_made(self, transport):
            super().connection_made(transport)
            self.watch()

        def data_received(self, data):
            super().data_received(data)
            self.watch()

        def on_response_complete(self):
            super().on_response_complete()
            self.watch()

        def connection_lost(self, exc):
            self.disarm()
            super().connection_lost(exc)

        def watch(self) -> None:
            """Arm a deadline when the connection starts waiting for a request's head (IDLE) or
            body (SEND_BODY); drop it once what it waited for has come."""
            state = self.conn.their_state
            waiting = (self.cycle, state) if state in (h11.IDLE, h11.SEND_BODY) else None
            if waiting == self.waiting_for:
                return
            self.disarm()
            self.waiting_for = waiting
            if waiting is not None:
                seconds = timeouts.headers if state is h11.IDLE else timeouts.body + BODY_GRACE
                self.deadline = self.loop.call_later(seconds, self.expire)

        def disarm(self) -> None:
            if self.deadline is not None:
                self.deadline.cancel()
                self.deadline = None

        def expire(self) -> None:
            self.deadline = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE and self.conn.trailing_data[0]:
                self.send_error(408, f"The request's headers did not arrive within {timeouts.headers:g} s.",
                                "Send the whole request promptly (the limit is the server's --header-timeout).",
                                "request_timeout")
            else:  # an idle connection, or a body nobody reads: nothing to answer
                self.transport.close()

        def send_400_response(self, msg):
            self.send_error(400, "The request is not valid HTTP/1.1 (its request line, a header or its "
                                 f"Content-Length), or its headers are over {MAX_HEAD_BYTES:,} bytes.",
                            "Check the Content-Length (one, a whole number, the body's length in bytes).",
                            "invalid_http")

        def send_error(self, status: int, message: str, hint: str, code: str) -> None:
            """A JSON error in OpenAI's shape, then close (the request was not read whole)."""
            cycle = self.cycle
            if cycle is not None and not cycle.response_complete:
                # the app is still at this request: it now sees the client gone, and its own
                # response (which h11 would refuse after this one) is dropped
                cycle.disconnected = True
                cycle.message_event.set()
            content = json.dumps(error_body(status, message, hint, None, code)).encode()
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                       (b"connection", b"close")]
            try:
                head = h11.Response(status_code=status, headers=headers, reason=HTTPStatus(status).phrase.encode())
                for event in (head, h11.Data(data=content), h11.EndOfMessage()):
                    self.transport.write(self.conn.send(event) or b"")
            except h11.LocalProtocolError:  # a response is already under way: closing is all that is left
                pass
            self.transport.close()

    return DeadlineH11Protocol


def describe(config: ServeOptions, worker, sock: socket.socket) -> dict:
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    stores = {}
    for name, asker in worker.askers.items():
        choice = asker.session.choice
        stores[name] = {"path": config.stores[name], "passages": len(asker.store), "indexed": len(asker.index),
                        "receiver": choice.receiver, "sharer": choice.sharer,
                        "fuser": (asker.store.identity.get("fuser") or {}).get("name")}
    return {"url": f"http://{shown}:{port}", "stores": stores, "system": config.defaults.system,
            "auth": bool(config.api_key), "exposed": config.host not in LOOPBACK}
