"""The client side of `cachegraft ask --server URL`: the same questions and options, sent
to a running `cachegraft serve` (`POST /v1/ask`), answers as `ask --json` has them."""

from __future__ import annotations

import json
from typing import Any

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import (
    CacheGraftError,
    NoPassagesError,
    ServerError,
    StoreCorruptError,
    StoreNotFoundError,
    UsageError,
)
from cachegraft_cli.serving.requests import option_fields


class Client:
    """A connection to a server (`url` like http://127.0.0.1:8000); `api_key` if it needs one."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {url!r} is not an http(s) URL.", "Use e.g. --server http://127.0.0.1:8000")
        self.url, self.timeout = url.rstrip("/"), timeout
        self.headers = {"Content-Type": "application/json"}
        if api_key:
            self.headers["Authorization"] = f"Bearer {api_key}"

    def ask(self, store: str, question: str, options: AskOptions) -> dict:
        """One answer, exactly what `ask --json` prints."""
        return self._post("/v1/ask", {"store": store, "question": question, **option_fields(options)})

    def ask_many(self, store: str, questions: list[str], options: AskOptions, concurrency: int = 8) -> list[dict]:
        """Answers in order, `concurrency` requests in flight (the server decodes them together);
        a question the server found no passage for gets {"question", "error"} in its place."""
        from concurrent.futures import ThreadPoolExecutor

        def one(question: str) -> dict:
            try:
                return self.ask(store, question, options)
            except NoPassagesError as exc:
                return {"question": question, "error": exc.message}

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, questions))

    def _post(self, path: str, body: dict) -> Any:
        # urllib, not httpx: a shell's `ask --server` pays Python's start-up and this module's
        # imports on every question, and httpx's import alone took ~80 ms of a ~1 s answer.
        import urllib.error
        import urllib.request

        request = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=self.headers,
                                         method="POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            raise _error(exc.code, exc.read(), self.url) from None
        except (urllib.error.URLError, OSError) as exc:
            reason = getattr(exc, "reason", exc)
            raise ServerError(f"Cannot reach the server at {self.url} ({type(reason).__name__}: {reason}).",
                              "Start one with `cachegraft serve --store DIR`, or check --server / "
                              "CACHEGRAFT_SERVER.") from None

    def close(self) -> None:
        """Nothing is held between requests (one connection each)."""


def _error(status: int, body: bytes, url: str) -> CacheGraftError:
    """The server's JSON error as the typed error `cachegraft ask` would have raised itself."""
    try:
        error = json.loads(body)["error"]
        message, hint, code = str(error["message"]), str(error.get("hint") or ""), error.get("code")
    except (ValueError, KeyError, TypeError):
        return ServerError(f"The server at {url} answered HTTP {status} without a JSON error.",
                           "Check that --server points at `cachegraft serve`.")
    message = message.removesuffix(hint).strip() if hint else message
    if status == 401:
        return ServerError(message, "Pass the server's key with --api-key or CACHEGRAFT_API_KEY.")
    if status in (429, 503):
        return ServerError(message, hint or "Retry in a moment.")
    if code == "no_passages":
        return NoPassagesError(message, hint)
    if code == "store_not_found":
        return StoreNotFoundError(message, hint)
    if code == "store_damaged":  # the exit code a local `ask` on the damaged store gives
        return StoreCorruptError(message, hint)
    if 400 <= status < 500:
        return UsageError(message, hint)
    return ServerError(f"The server failed: {message}", hint)
