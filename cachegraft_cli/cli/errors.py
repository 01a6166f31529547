"""The one place where exceptions become messages and exit codes."""

from __future__ import annotations

import errno
import sys
import traceback
from contextlib import contextmanager

from cachegraft_cli.errors import CacheGraftError

_DEBUG = {"on": False}
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, getattr(errno, "EDQUOT", errno.ENOSPC)}


def set_debug(on: bool) -> None:
    _DEBUG["on"] = on


def debug_enabled() -> bool:
    return _DEBUG["on"]


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def report(exc: BaseException) -> int:
    """Print `exc` for a user and return the exit code it maps to."""
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, CacheGraftError):
        _say(f"error: {exc.message}")
        if exc.hint:
            _say(f"  hint: {exc.hint}")
        return exc.exit_code
    click_code = _click_error(exc)
    if click_code is not None:
        return click_code
    if isinstance(exc, KeyboardInterrupt):
        _say("interrupted")
        return 130
    if isinstance(exc, MemoryError) or _is_torch_oom(exc):
        where = "GPU" if _is_torch_oom(exc) else "RAM"
        _say(f"error: out of memory ({where}): {str(exc).splitlines()[0] if str(exc) else 'allocation failed'}")
        _say("  hint: use a smaller --batch-size, a lighter --dtype (bfloat16), --device cpu, "
             "or a smaller model.")
        return 13
    if isinstance(exc, BrokenPipeError):
        return 0  # downstream closed the pipe (e.g. `| head`): not an error
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:  # disk full, read-only: the machine, not a bug
        from cachegraft_cli.store.oserrors import write_error

        return report(write_error(exc, exc.filename or "?", "write"))
    _say(f"error: unexpected {type(exc).__name__}: {exc}")
    _say("  hint: this is a bug in cachegraft; rerun with --debug for the traceback and report it.")
    return 70


def _click_error(exc: BaseException) -> int | None:
    """Usage errors from option parsing, as one line plus a hint; None for other exceptions.
    Typer ships its own copy of click, so its exceptions are recognised by class name."""
    kinds = {cls.__name__ for cls in type(exc).__mro__}
    if "NoArgsIsHelpError" in kinds:
        print(exc.format_message())  # type: ignore[attr-defined]  # a bare `cachegraft` or group: its help
        return int(exc.exit_code)  # type: ignore[attr-defined]
    if "Abort" in kinds and "ClickException" not in kinds:
        _say("interrupted")
        return 130
    if "ClickException" not in kinds:
        return None
    _say(f"error: {' '.join(exc.format_message().split())}")  # type: ignore[attr-defined]
    ctx = getattr(exc, "ctx", None)
    if "UsageError" in kinds:
        _say(f"  hint: see `{ctx.command_path if ctx is not None else 'cachegraft'} --help`.")
    return int(exc.exit_code)  # type: ignore[attr-defined]


def _is_torch_oom(exc: BaseException) -> bool:
    """torch's OutOfMemoryError (a RuntimeError), recognised without importing torch."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and isinstance(exc, oom)


@contextmanager
def handled():
    """Run a command body, turning any exception into a message and exit code."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the single top-level handler
        raise SystemExit(report(exc)) from None
