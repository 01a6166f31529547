"""Retrieval engines behind one interface (`base.Engine`), chosen by name.

| name | takes | what |
|---|---|---|
| `tantivy` | terms | BM25 on tantivy segments (default lexical engine) |
| `usearch` | vectors | HNSW graphs, int8 vectors, memory-mapped (default vector engine) |
| `flat` | vectors | exact brute force over memory-mapped float32 (small corpora, reference) |

Engine modules import their libraries inside functions, so importing this
package is free. The choice is by measurement: docs/results.md, "Retrieval".
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from cachegraft_cli.retrieval.engines.base import TERMS, VECTORS, Engine

_CLASSES = {
    "tantivy": ("cachegraft_cli.retrieval.engines.tantivy", "TantivyEngine", TERMS),
    "usearch": ("cachegraft_cli.retrieval.engines.usearch", "UsearchEngine", VECTORS),
    "flat": ("cachegraft_cli.retrieval.engines.flat", "FlatEngine", VECTORS),
}
DEFAULTS = {TERMS: "tantivy", VECTORS: "usearch"}
NAMES = tuple(_CLASSES)


def takes(name: str) -> str:
    """TERMS or VECTORS; KeyError for an unknown name."""
    return _CLASSES[name][2]


def engine_class(name: str) -> type[Engine]:
    module, attr, _ = _CLASSES[name]
    return getattr(importlib.import_module(module), attr)


def create(name: str, root: Path, **options: Any) -> Engine:
    return engine_class(name).create(root, **options)


def open_engine(name: str, root: Path, params: dict[str, Any]) -> Engine:
    return engine_class(name).open(root, params)


__all__ = ["DEFAULTS", "NAMES", "TERMS", "VECTORS", "Engine", "create", "engine_class", "open_engine", "takes"]
