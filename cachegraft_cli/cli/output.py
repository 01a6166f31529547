"""Output helpers: results to stdout (text or JSON), everything else to stderr."""

from __future__ import annotations

import json
import sys
from contextlib import contextmanager
from typing import Any, Iterator


def emit_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, ensure_ascii=False, default=str) + "\n")
    sys.stdout.flush()


def stdout_console():
    from rich.console import Console

    return Console()


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def status_factory(json_out: bool):
    """How slow steps (model loads) show on stderr: a transient spinner on a TTY, one plain
    line per step otherwise, nothing under --json when stderr is not a TTY."""
    if sys.stderr.isatty():
        return _spinner
    return None if json_out else _line


def showing_status(json_out: bool):
    """Context manager: within it, library `progress.loading(...)` steps show as `status_factory` says."""
    from cachegraft_cli.progress import reporting

    return reporting(status_factory(json_out))


@contextmanager
def _spinner(message: str) -> Iterator[None]:
    from rich.console import Console

    with Console(stderr=True).status(f"{message}...", spinner="dots"):
        yield


@contextmanager
def _line(message: str) -> Iterator[None]:
    log(f"{message}...")
    yield
