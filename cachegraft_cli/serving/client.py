"""The client side of `cachegraft ask --server URL`: the same questions and options, sent
to a running `cachegraft serve` (`POST /v1/ask`), answers as `ask --json` has them."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from cachegraft_cli.answering.options import AskOptions
from cachegraft_cli.errors import (
    CacheGraftError,
    NoPassagesError,
    ServerError,
    StoreNotFoundError,
    UsageError,
)
from cachegraft_cli.serving.requests import option_fields


class Client:
    """A connection to a server (`url` like http://127.0.0.1:8000); `api_key` if it needs one."""

    def __init__(self, url: str, api_key: str | None = None, timeout: float = 600.0):
        try:
            import httpx
        except ImportError:
            raise UsageError("`ask --server` needs httpx (the serve extra).",
                             "Install it: pip install 'cachegraft[serve]'") from None

        if not url.startswith(("http://", "https://")):
            raise UsageError(f"--server {url!r} is not an http(s) URL.", "Use e.g. --server http://127.0.0.1:8000")
        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    def ask(self, store: str, question: str, options: AskOptions) -> dict:
        """One answer, exactly what `ask --json` prints."""
        return self._post("/v1/ask", {"store": store, "question": question, **option_fields(options)})

    def ask_many(self, store: str, questions: list[str], options: AskOptions, concurrency: int = 8) -> list[dict]:
        """Answers in order, `concurrency` requests in flight (the server decodes them together);
        a question the server found no passage for gets {"question", "error"} in its place."""
        def one(question: str) -> dict:
            try:
                return self.ask(store, question, options)
            except NoPassagesError as exc:
                return {"question": question, "error": exc.message}

        with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
            return list(pool.map(one, questions))

    def _post(self, path: str, body: dict) -> Any:
        import httpx

        try:
            response = self.http.post(path, json=body)
        except httpx.TransportError as exc:
            raise ServerError(f"Cannot reach the server at {self.url} ({type(exc).__name__}: {exc}).",
                              "Start one with `cachegraft serve --store DIR`, or check --server / "
                              "CACHEGRAFT_SERVER.") from None
        if response.status_code == 200:
            return response.json()
        raise _error(response, self.url)

    def close(self) -> None:
        self.http.close()


def _error(response, url: str) -> CacheGraftError:
    """The server's JSON error as the typed error `cachegraft ask` would have raised itself."""
    try:
        error = response.json()["error"]
        message, hint, code = str(error["message"]), str(error.get("hint") or ""), error.get("code")
    except (ValueError, KeyError, TypeError):
        return ServerError(f"The server at {url} answered HTTP {response.status_code} without a JSON error.",
                           "Check that --server points at `cachegraft serve`.")
    message = message.removesuffix(hint).strip() if hint else message
    status = response.status_code
    if status == 401:
        return ServerError(message, "Pass the server's key with --api-key or CACHEGRAFT_API_KEY.")
    if status in (429, 503):
        return ServerError(message, hint or "Retry in a moment.")
    if code == "no_passages":
        return NoPassagesError(message, hint)
    if code == "store_not_found":
        return StoreNotFoundError(message, hint)
    if 400 <= status < 500:
        return UsageError(message, hint)
    return ServerError(f"The server failed: {message}", hint)
