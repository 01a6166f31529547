"""CacheGraft: retrieval-augmented generation with fused (Cache-to-Cache) KV caches.

The Python API (`cachegraft_cli.api`, whose `__all__` is the one list of public names)
is re-exported here and imported on first use, so `import cachegraft_cli` and
`cachegraft --help` stay instant:

    import cachegraft_cli as cg
    store = cg.open_store("my-store")
    print(store.ask("Who founded the town?").text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.2.0"

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports the API on first use
    from cachegraft_cli.api import *  # noqa: F403


def _api() -> Any:
    from importlib import import_module  # not `from cachegraft_cli import api`: that would re-enter __getattr__

    return import_module("cachegraft_cli.api")


def __getattr__(name: str) -> Any:  # PEP 562: the API module loads on first attribute access
    if name.startswith("__") and name != "__all__":
        raise AttributeError(name)
    api = _api()
    if name == "__all__":
        return ["__version__", *api.__all__]
    if name in api.__all__:
        return getattr(api, name)
    raise AttributeError(f"module 'cachegraft_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_api().__all__])
