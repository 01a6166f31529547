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


def _click_exceptions():
    """typer's own copy of click (typer >= 0.22 vendors it), else click."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions  # type: ignore[no-redef]
    return exceptions


def _abort() -> type:
    import typer

    return typer.Abort


def report(exc: BaseException) -> int:
    """Print `exc` for a user and return the exit code it maps to."""
    if debug_enabled():
        traceback.print_exception(exc, file=sys.stderr)
    if isinstance(exc, CacheGraftError):
        _say(f"error: {exc.message}")
        if exc.hint:
            _say(f"  hint: {exc.hint}")
        return exc.exit_code
    clicks = _click_exceptions()
    no_args = getattr(clicks, "NoArgsIsHelpError", None)
    if no_args is not None and isinstance(exc, no_args):
        exc.show()  # the command's help
        return exc.exit_code
    if isinstance(exc, clicks.UsageError):  # a bad or missing option or argument
        command = exc.ctx.command_path if exc.ctx is not None else "cachegraft"
        _say(f"error: {exc.format_message()}")
        _say(f"  hint: Run `{command} --help` to see the options.")
        return exc.exit_code
    if isinstance(exc, clicks.ClickException):
        _say(f"error: {exc.format_message()}")
        return exc.exit_code
    if isinstance(exc, (KeyboardInterrupt, _abort())):
        _say("interrupted")
        return 130
    if isinstance(exc, MemoryError):
        _say("error: out of memory. Use a smaller --batch-size or a smaller model.")
        return 13
    if isinstance(exc, BrokenPipeError):
        return 0  # downstream closed the pipe (e.g. `| head`): not an error
    if isinstance(exc, OSError) and exc.errno in _STORAGE_ERRNOS:  # disk full, read-only: the machine, not a bug
        from cachegraft_cli.storage import write_error

        return report(write_error(exc, exc.filename or "?", "write"))
    _say(f"error: unexpected {type(exc).__name__}: {exc}")
    _say("  hint: this is a bug in cachegraft; rerun with --debug for the traceback and report it.")
    return 70


@contextmanager
def handled():
    """Run a command body, turning any exception into a message and exit code."""
    try:
        yield
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - the single top-level handler
        raise SystemExit(report(exc)) from None
