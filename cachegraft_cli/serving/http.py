"""The Starlette app: OpenAI-compatible chat completions and models, the native ask /
retrieve / reload endpoints, health. Every failure is a JSON error in OpenAI's shape
({"error": {"message", "type", "param", "code"}}, plus CacheGraft's "hint"), never a traceback.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.answering.systems import SYSTEMS
from cachegraft_cli.errors import CacheGraftError, NoPassagesError, StoreError, UsageError
from cachegraft_cli.serving.engine import Busy, Engine, Job
from cachegraft_cli.serving.requests import (
    Limits,
    RequestError,
    ask_request,
    chat_request,
    retrieve_request,
)


@dataclass
class AppConfig:
    """What the endpoints need besides the engine: the defaults a request starts from
    (the `serve` command's ask options), the limits, the key, the stores' paths."""

    defaults: AskOptions = field(default_factory=AskOptions)
    limits: Limits = field(default_factory=Limits)
    api_key: str | None = None
    on_ready: Any = None  # called once the app has started (the `serve` command prints "ready")


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error", 503: "server_busy"}


def error_body(status: int, message: str, hint: str = "", param: str | None = None, code: str | None = None) -> dict:
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": f"{message} {hint}".strip(), "type": kind, "param": param, "code": code,
                      "hint": hint}}


def error_response(exc: BaseException):
    """The one map from an exception to a response."""
    from starlette.responses import JSONResponse

    headers = {}
    if isinstance(exc, Busy):
        headers["Retry-After"] = str(exc.retry_after)
    if isinstance(exc, RequestError):
        status, param, code = exc.status, exc.param, exc.code
    elif isinstance(exc, NoPassagesError):
        status, param, code = 404, None, "no_passages"
    elif isinstance(exc, UsageError):  # a system the store cannot serve, a prompt past the context window
        status, param = 400, None
        code = "context_length_exceeded" if "context window" in exc.message else "invalid_request"
    elif isinstance(exc, CacheGraftError):
        status, param, code = (503 if isinstance(exc, StoreError) else 500), None, type(exc).__name__
    else:
        print(f"error: unexpected {type(exc).__name__} while answering: {exc}", file=sys.stderr, flush=True)
        return JSONResponse(error_body(500, f"Internal error ({type(exc).__name__}).",
                                       "This is a bug in cachegraft; the server's stderr has the details."), 500)
    body = error_body(status, exc.message, exc.hint, param, code)
    return JSONResponse(body, status, headers=headers)


async def read_json(request, limit: int) -> Any:
    """The body as JSON, refusing one over `limit` bytes before reading more than that."""
    length = request.headers.get("content-length")
    if length is not None and (not length.isdigit() or int(length) > limit):
        raise _too_big(limit) if length.isdigit() else RequestError("Bad Content-Length header.")
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > limit:
            raise _too_big(limit)
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError) as exc:
        raise RequestError(f"The body is not valid JSON ({exc}).", "Send a JSON object.", code="invalid_json") from None


def _too_big(limit: int) -> RequestError:
    return RequestError(f"The request body is over this server's limit of {limit:,} bytes.",
                        "Send a shorter body (the limit is the server's --max-body).", status=413,
                        code="body_too_large")


class Api:
    """The endpoints over one engine."""

    def __init__(self, engine: Engine, config: AppConfig):
        self.engine, self.config = engine, config
        self.default_store = next(iter(engine.urls))

    # -- helpers -----------------------------------------------------------------------------------

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
        if store in self.engine.urls:
            return store
        for name, url in self.engine.urls.items():
            if _same_place(store, url):
                return name
        raise RequestError(f"No store {store!r} on this server.",
                           f"Stores: {', '.join(self.engine.urls)} (GET /v1/models lists them).", status=404,
                           param="store", code="store_not_found")

    def model(self, model: str | None) -> tuple[str, str | None]:
        """(store, system or None) that a chat `model` names: STORE, SYSTEM or STORE/SYSTEM."""
        if not model:
            return self.default_store, None
        if model in self.engine.urls:
            return model, None
        if model in SYSTEMS:
            return self.default_store, model
        store, _, system = model.rpartition("/")
        if store in self.engine.urls and system in SYSTEMS:
            return store, system
        raise RequestError(f"The model {model!r} does not exist on this server.",
                           "GET /v1/models lists the models: a store, a system, or STORE/SYSTEM.", status=404,
                           param="model", code="model_not_found")

    def model_ids(self) -> list[str]:
        ids = list(self.engine.urls)
        for name, asker in self.engine.askers.items():
            ids += [f"{name}/{s}" for s in _servable(asker)]
        ids += [s for s in _servable(self.engine.askers[self.default_store])]
        return ids

    async def answer(self, job: Job) -> Any:
        """Queue `job` and wait for it; a request cancelled meanwhile frees its slot."""
        self.engine.submit(job)
        try:
            return await asyncio.wrap_future(job.future)
        except asyncio.CancelledError:
            self.engine.cancel(job)
            raise

    # -- endpoints ---------------------------------------------------------------------------------

    async def health(self, request):
        from starlette.responses import JSONResponse

        stores = {name: {"passages": len(a.store), "indexed": len(a.index)} for name, a in self.engine.askers.items()}
        return JSONResponse({"status": "ok", "stores": stores, "queue": self.engine.load()})

    async def models(self, request):
        from starlette.responses import JSONResponse

        data = [{"id": m, "object": "model", "created": 0, "owned_by": "cachegraft"} for m in self.model_ids()]
        return JSONResponse({"object": "list", "data": data})

    async def ask(self, request):
        from starlette.responses import JSONResponse

        q = ask_request(await read_json(request, self.config.limits.max_body), self.config.defaults,
                        self.config.limits)
        job = Job("ask", self.store_name(q.store), q.question, q.options)
        return JSONResponse(await self.answer(job))

    async def retrieve(self, request):
        from starlette.responses import JSONResponse

        q = retrieve_request(await read_json(request, self.config.limits.max_body), self.config.defaults,
                             self.config.limits)
        return JSONResponse(await self.answer(Job("retrieve", self.store_name(q.store), q.question, q.options)))

    async def reload(self, request):
        from starlette.responses import JSONResponse

        return JSONResponse(await self.answer(Job("reload", self.default_store)))

    async def chat(self, request):
        from dataclasses import replace

        from starlette.responses import JSONResponse, StreamingResponse

        body = await read_json(request, self.config.limits.max_body)
        chat = chat_request(body, self.config.defaults, self.config.limits)
        store, system = self.model(chat.model)
        options = chat.question.options if system is None else replace(chat.question.options, system=system)
        job = Job("ask", store, chat.question.question, options)
        reply = Reply(chat.model or store, options.generation.max_new_tokens)
        if not chat.stream:
            return JSONResponse(reply.completion(await self.answer(job)))
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        job.on_text = lambda text: _put(loop, events, text)
        job.future.add_done_callback(lambda _: _put(loop, events, None))
        self.engine.submit(job)  # before the response starts: a full queue is still a 429
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
                self.engine.cancel(job)  # the client went away mid-stream: its slot is free now


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
    return os.path.realpath(given) == os.path.realpath(url)


def build_app(engine: Engine, config: AppConfig):
    """The ASGI app. Every endpoint checks the key first and answers errors as JSON."""
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    api = Api(engine, config)

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
    return Starlette(routes=routes, exception_handlers={HTTPException: http_error}, lifespan=lifespan)
