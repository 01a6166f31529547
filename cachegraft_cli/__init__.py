"""CacheGraft: retrieval-augmented generation with fused (Cache-to-Cache) KV caches.

The Python API (`cachegraft_cli.api`) is re-exported here and imported on first use,
so `import cachegraft_cli` and `cachegraft --help` stay instant:

    import cachegraft_cli as cg
    store = cg.open_store("my-store")
    print(store.ask("Who founded the town?").text)
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_API = ("Answer", "EncodeSummary", "Passage", "Source", "Store", "answer", "answer_many", "ask_options",
        "encode_passages", "index_store", "open_store")
__all__ = ["__version__", *_API]

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ imports the API on first use
    from cachegraft_cli.api import (
        Answer as Answer,
        EncodeSummary as EncodeSummary,
        Passage as Passage,
        Source as Source,
        Store as Store,
        answer as answer,
        answer_many as answer_many,
        ask_options as ask_options,
        encode_passages as encode_passages,
        index_store as index_store,
        open_store as open_store,
    )


def __getattr__(name: str) -> Any:  # PEP 562: the API module loads on first attribute access
    if name in _API:
        from cachegraft_cli import api

        return getattr(api, name)
    raise AttributeError(f"module 'cachegraft_cli' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_API])
