"""The Starlette app: OpenAI-compatible chat completions and models, the native ask /
retrieve / reload endpoints, health. Every failure is a JSON error in OpenAI's shape
({"error": {"message", "type", "param", "code"}}, plus CacheGraft's "hint"), never a traceback.

Starlette is the `serve` extra: it is imported here, at the top, and this module is imported
only inside the functions that start a server (`server.py`), so `cachegraft --help` and
`ask --server` never load it.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
import uuid
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from typing import Any, AsyncIterator

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.answering.systems import SYSTEMS
from cachegraft_cli.errors import (
    CacheGraftError,
    IndexMismatchError,
    IndexMissingError,
    ModelLoadError,
    NoPassagesError,
    RetrievalIndexError,
    StorageError,
    StoreCorruptError,
    StoreError,
    StoreLockedError,
    StoreMismatchError,
    StoreNotFoundError,
    UsageError,
)
from cachegraft_cli.serving.requests import (
    Limits,
    RequestError,
    ask_request,
    chat_request,
    retrieve_request,
)
from cachegraft_cli.serving.worker import Busy, Job, JobKind, Worker


@dataclass
class AppOptions:
    """What the endpoints need besides the worker: the defaults a request starts from
    (the `serve` command's ask options), the limits, the key, the stores' paths."""

    defaults: AskOptions = field(default_factory=AskOptions)
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    on_ready: Any = None  # called once the app has started (the `serve` command prints "ready")
    body_timeout: float = 30.0  # seconds a request's body may take to arrive, from its first read on; then 408


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "server_busy"}

# What a CacheGraftError raised while answering means for the client, most specific class first
# (the first one an error is an instance of decides). Only what a retry can cure is 503; a damaged,
# missing or mismatched store or index stays so until someone repairs it: a permanent 500.
_STATUSES: list[tuple[type[CacheGraftError], int, str]] = [
    (NoPassagesError, 404, "no_passages"),
    (StoreLockedError, 503, "store_locked"),  # a writer holds it (an index being built): retry later
    (StoreCorruptError, 500, "store_damaged"),
    (StoreMismatchError, 500, "store_mismatch"),
    (StoreNotFoundError, 500, "store_missing"),  # a served store gone from disk (not an unknown name: 404)
    (StoreError, 500, "store_error"),
    (IndexMissingError, 500, "index_missing"),
    (IndexMismatchError, 500, "index_mismatch"),
    (RetrievalIndexError, 500, "index_damaged"),
    (StorageError, 500, "storage_error"),
    (ModelLoadError, 500, "model_error"),
    (CacheGraftError, 500, "server_error"),
]


class ClientGone(RequestError):
    """The client hung up before its answer: nobody reads the response (its slot is already free)."""

    def __init__(self, message: str = "The client disconnected.", hint: str = ""):
        super().__init__(message, hint, status=400, code="client_disconnected")

    def __reduce__(self):
        return (type(self), (self.message, self.hint))


def error_body(status: int, message: str, hint: str = "", param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": f"{message} {hint}".strip(), "type": kind, "param": param, "code": code,
                      "hint": hint}}


def error_response(exc: BaseException):
    """The one map from an exception to a response."""
    if isinstance(exc, ClientDisconnect):  # left mid-body: nobody will read this
        exc = ClientGone()
    if not isinstance(exc, CacheGraftError):
        print(f"error: unexpected {type(exc).__name__} while answering: {exc}", file=sys.stderr, flush=True)
        return JSONResponse(error_body(500, f"Internal error ({type(exc).__name__}).",
                                       "This is a bug in cachegraft; the server's stderr has the details."), 500)
    status, param, code = error_status(exc)
    if status >= 500 and not isinstance(exc, Busy):  # the operator has a store or index to look at
        print(f"error: {type(exc).__name__} while answering: {exc}", file=sys.stderr, flush=True)
    headers = {}
    if isinstance(exc, Busy):
        headers["Retry-After"] = str(exc.retry_after)
    elif status == 503:
        headers["Retry-After"] = "5"
    if status in (408, 413):  # the body was not read to its end: the connection cannot carry another request
        headers["Connection"] = "close"
    return JSONResponse(error_body(status, exc.message, exc.hint, param, code), status, headers=headers)


def error_status(exc: CacheGraftError) -> tuple[int, str | None, str]:
    """(HTTP status, param, code) of an error raised while serving a request."""
    if isinstance(exc, RequestError):
        return exc.status, exc.param, exc.code
    if isinstance(exc, UsageError):  # a system the store cannot serve, a prompt past the context window
        return 400, None, "context_length_exceeded" if "context window" in exc.message else "invalid_request"
    return next((status, None, code) for kind, status, code in _STATUSES if isinstance(exc, kind))


async def read_json(request, limit: int, timeout: float = 30.0) -> Any:
    """The body as JSON, refusing one over `limit` bytes before reading more than that, and one
    that has not arrived `timeout` seconds after the first read (408: a stalled client)."""
    length = request.headers.get("content-length")
    if length is not None and not (length.isascii() and length.isdigit()):  # h11 refuses these first
        raise RequestError(f"Bad Content-Length header {length[:40]!r}.", "Send the body's length in bytes.",
                           code="invalid_content_length")
    if length is not None and int(length) > limit:
        raise _too_big(limit)
    try:
        data = await asyncio.wait_for(_body(request, limit), timeout)
    except asyncio.TimeoutError:
        raise RequestError(f"The request body did not arrive within {timeout:g} s.",
                           "Send the whole body promptly (the limit is the server's --body-timeout).", status=408,
                           code="request_timeout") from None
    return parse_json(data)


async def _body(request, limit: int) -> bytes:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _too_big(limit)
    return bytes(data)


def parse_json(data: bytes) -> Any:
    """A body as JSON: UTF-8 only (json.loads would also take UTF-16 and UTF-32), no NaN or
    Infinity (not JSON; a number field would compare false with every bound)."""
    try:
        return json.loads(data.decode("utf-8"), parse_constant=_not_json)
    except RecursionError:  # the C parser's own depth guard: a 400, never a 500
        raise RequestError("The body nests arrays or objects too deeply to parse.", "Send a flat JSON object.",
                           code="invalid_json") from None
    except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, an integer of over 4300 digits
        raise RequestError(f"The body is not valid JSON ({exc}).", "Send a JSON object in UTF-8.",
                           code="invalid_json") from None


def _not_json(constant: str) -> Any:
    raise ValueError(f"{constant} is not a JSON number")


def _too_big(limit: int) -> RequestError:
    return RequestError(f"The request body is over this server's limit of {limit:,} bytes.",
                        "Send a shorter body (the limit is the server's --max-body).", status=413,
                        code="body_too_large")


async def hung_up(receive) -> None:
    """Return once the client disconnects. Called after the body was read whole: the next ASGI
    message is then `http.disconnect`, sent when the connection drops (or the response is done)."""
    while (await receive())["type"] != "http.disconnect":
        pass


class Api:
    """The endpoints over one worker."""

    def __init__(self, worker: Worker, config: AppOptions):
        self.worker, self.config = worker, config
        self.default_store = next(iter(worker.urls))

    # -- helpers -----------------------------------------------------------------------------------

    async def body(self, request) -> Any:
        return await read_json(request, self.config.limits.max_body, self.config.body_timeout)

    def check_key(self, request) -> None:
        key = self.config.api_key
        if not key:
            return
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(token.strip().encode(), key.encode()):
            raise RequestError("Missing or wrong API key." if given else "This server needs an API key.",
                               "Send it as the header 'Authorization: Bearer KEY'.", status=401, code="invalid_api_key")

    def store_name(self, store: str | None) -> str:
        """A store by its name, or by the path or URL it was served from."""
        if store is None:
            return self.default_store
        found = self.find_store(store)
        if found is None:
            raise RequestError(f"No store {store!r} on this server.",
                               f"Stores: {', '.join(self.worker.urls)} (GET /v1/models lists them).", status=404,
                               param="store", code="store_not_found")
        return found

    def find_store(self, given: str) -> str | None:
        """The name of the store `given` names (its name, or the path or URL it is served from)."""
        if given in self.worker.urls:
            return given
        return next((name for name, url in self.worker.urls.items() if _same_place(given, url)), None)

    def model(self, model: str | None) -> tuple[str, str | None]:
        """(store, system or None) that a chat `model` names: STORE, SYSTEM or STORE/SYSTEM, where
        STORE is a store's name or the path it is served from (as `store` takes it)."""
        if not model:
            return self.default_store, None
        if model in self.worker.urls:
            return model, None
        if model in SYSTEMS:
            return self.default_store, model
        store = self.find_store(model)
        if store is not None:
            return store, None
        prefix, _, system = model.rpartition("/")
        store = self.find_store(prefix) if prefix and system in SYSTEMS else None
        if store is not None:
            return store, system
        raise RequestError(f"The model {model!r} does not exist on this server.",
                           "GET /v1/models lists the models: a store, a system, or STORE/SYSTEM (a store by its "
                           "name or the path it is served from).", status=404, param="model",
                           code="model_not_found")

    def model_ids(self) -> list[str]:
        ids = list(self.worker.urls)
        for name, asker in self.worker.askers.items():
            ids += [f"{name}/{s}" for s in _servable(asker)]
        ids += [s for s in _servable(self.worker.askers[self.default_store])]
        return ids

    async def answer(self, job: Job, request=None) -> Any:
        """Queue `job` and wait for it. A client that hangs up meanwhile (or a request cancelled
        by the shutdown bound) frees its slot at once: a queued job is dropped, a decoding one
        stops after its current token; nobody waits for an answer no one will read."""
        self.worker.submit(job)
        result = asyncio.wrap_future(job.future)
        watch: list[asyncio.Future[Any]] = []
        if request is not None:
            watch.append(asyncio.ensure_future(hung_up(request.receive)))
        try:
            await asyncio.wait([result, *watch], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in watch:
                task.cancel()
            if not result.done():  # the client left, or this request was cancelled
                self.worker.cancel(job)
                result.cancel()
        if result.cancelled():
            raise ClientGone()
        return result.result()

    # -- endpoints ---------------------------------------------------------------------------------

    async def health(self, request):
        stores = {name: {"passages": len(a.store), "indexed": len(a.index)} for name, a in self.worker.askers.items()}
        return JSONResponse({"status": "ok", "stores": stores, "queue": self.worker.load()})

    async def models(self, request):
        data = [{"id": m, "object": "model", "created": 0, "owned_by": "cachegraft"} for m in self.model_ids()]
        return JSONResponse({"object": "list", "data": data})

    async def ask(self, request):
        q = ask_request(await self.body(request), self.config.defaults, self.config.limits)
        job = Job(JobKind.ASK, self.store_name(q.store), q.question, q.options)
        return JSONResponse(await self.answer(job, request))

    async def retrieve(self, request):
        q = retrieve_request(await self.body(request), self.config.defaults, self.config.limits)
        job = Job(JobKind.RETRIEVE, self.store_name(q.store), q.question, q.options)
        return JSONResponse(await self.answer(job, request))

    async def reload(self, request):
        return JSONResponse(await self.answer(Job(JobKind.RELOAD, self.default_store), request))

    async def chat(self, request):
        chat = chat_request(await self.body(request), self.config.defaults, self.config.limits)
        store, system = self.model(chat.model)
        options = chat.question.options if system is None else replace(chat.question.options, system=system)
        job = Job(JobKind.ASK, store, chat.question.question, options)
        reply = Reply(chat.model or store, options.generation.max_new_tokens)
        if not chat.stream:
            return JSONResponse(reply.completion(await self.answer(job, request)))
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.on_text = lambda text: _put(loop, events, text)
        job.future.add_done_callback(lambda _: _put(loop, events, None))
        self.worker.submit(job)  # before the response starts: a full queue is still a 429
        return StreamingResponse(self.stream(job, reply, events), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def stream(self, job: Job, reply: Reply, events: asyncio.Queue) -> AsyncIterator[str]:
        trim = Trim()
        try:
            yield sse(reply.chunk({"role": "assistant", "content": ""}))
            while (text := await events.get()) is not None:
                if piece := trim.push(text):
                    yield sse(reply.chunk({"content": piece}))
            exc = job.future.exception()
            if exc is not None:
                yield sse(json.loads(error_response(exc).body))
                return
            result = job.future.result()
            yield sse(reply.chunk({}, reply.finish(result), sources=result["passages"], usage=_usage(result)))
            yield "data: [DONE]\n\n"
        finally:
            if not job.future.done():
                self.worker.cancel(job)  # the client went away mid-stream: its slot is free now


def _put(loop, queue: asyncio.Queue, item) -> None:
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:  # the loop has closed: nobody is listening any more
        pass


class Trim:
    """Streamed pieces whose concatenation is the answer's text as the non-streamed reply
    has it (stripped): leading whitespace dropped, trailing whitespace held until more text."""

    def __init__(self):
        self.started, self.held = False, ""

    def push(self, text: str) -> str:
        text = self.held + text
        if not self.started:
            text = text.lstrip()
            self.started = bool(text)
        body = text.rstrip()
        self.held = text[len(body):]
        return body


@dataclass
class Reply:
    """OpenAI's completion and chunk objects for one request."""

    model: str
    max_tokens: int
    id: str = field(default_factory=lambda: f"chatcmpl-{uuid.uuid4().hex[:24]}")
    created: int = field(default_factory=lambda: int(time.time()))

    def completion(self, result: dict) -> dict:
        message = {"role": "assistant", "content": result["answer"]}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "finish_reason": self.finish(result), "logprobs": None}],
                "usage": _usage(result), "sources": result["passages"], "cachegraft": result}

    def finish(self, result: dict) -> str:
        return "length" if result["tokens"]["generated"] >= self.max_tokens else "stop"

    def chunk(self, delta: dict, finish: str | None = None, **extra) -> dict:
        return {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}], **extra}




def _usage(result: dict) -> dict:
    tokens = result["tokens"]
    return {"prompt_tokens": tokens["prompt"], "completion_tokens": tokens["generated"],
            "total_tokens": tokens["prompt"] + tokens["generated"]}


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def _servable(asker) -> list[str]:
    from cachegraft_cli.answering.systems import check_system

    out = []
    for system in SYSTEMS:
        if system == "sharer-text" and not asker.session.choice.sharer:
            continue
        try:
            check_system(asker.store, system)
        except UsageError:
            continue
        out.append(system)
    return out


def _same_place(given: str, url: str) -> bool:
    if "://" in given or "://" in url:
        return given.rstrip("/") == url.rstrip("/")
    try:
        return os.path.realpath(given) == os.path.realpath(url)
    except (OSError, ValueError):  # a name no path can be (refused earlier; a path loop): not this store
        return False


def build_app(worker: Worker, config: AppOptions):
    """The ASGI app. Every endpoint checks the key first and answers errors as JSON."""
    api = Api(worker, config)

    def guarded(handler):
        async def endpoint(request):
            try:
                api.check_key(request)
                return await handler(request)
            except Exception as exc:  # noqa: BLE001 - the one place a request's failure becomes its response
                return error_response(exc)

        return endpoint

    async def http_error(request, exc):
        message = {404: f"No endpoint {request.url.path}.", 405: f"{request.method} is not allowed here."}
        body = error_body(exc.status_code, message.get(exc.status_code, str(exc.detail)),
                          "Endpoints: GET /health, GET /v1/models, POST /v1/chat/completions, /v1/ask, /v1/retrieve, "
                          "/v1/reload.")
        return JSONResponse(body, exc.status_code)

    @asynccontextmanager
    async def lifespan(app):
        if config.on_ready is not None:
            config.on_ready()
        yield

    routes = [
        Route("/health", guarded(api.health), methods=["GET"]),
        Route("/v1/models", guarded(api.models), methods=["GET"]),
        Route("/v1/chat/completions", guarded(api.chat), methods=["POST"]),
        Route("/v1/ask", guarded(api.ask), methods=["POST"]),
        Route("/v1/retrieve", guarded(api.retrieve), methods=["POST"]),
        Route("/v1/reload", guarded(api.reload), methods=["POST"]),
    ]
    return cut_off_cleanly(Starlette(routes=routes, exception_handlers={HTTPException: http_error},
                                     lifespan=lifespan))


def cut_off_cleanly(app):
    """`app`, ending a request that uvicorn cancels (SIGTERM's drain ran past --shutdown-timeout)
    with an answer instead of a traceback: a 503 `shutting_down` if no response has started, an
    error event ending a stream that has."""

    async def wrapped(scope, receive, send) -> None:
        started: list[dict] = []

        async def tracking(message) -> None:
            if message["type"] == "http.response.start":
                started.append(message)
            await send(message)

        try:
            await app(scope, receive, tracking)
        except asyncio.CancelledError:
            if scope["type"] != "http":
                raise
            await send_cut_off(send, started[0] if started else None)

    return wrapped


async def send_cut_off(send, start: dict | None) -> None:
    body = error_body(503, "The server shut down before this request was answered.",
                      "Retry against a running server.", None, "shutting_down")
    if start is None:
        content = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": 503,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(content)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": content})
        return
    event_stream = (b"content-type", b"text/event-stream; charset=utf-8") in start.get("headers", [])
    await send({"type": "http.response.body", "body": sse(body).encode() if event_stream else b""})
