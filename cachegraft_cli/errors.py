"""Typed errors. Each carries what went wrong and what to do next.

The CLI maps every `CacheGraftError` to a one-line message and its `exit_code`
in one place (`cli/errors.py`); anything else is a bug and shows a traceback
only with `--debug`.
"""

from __future__ import annotations


class CacheGraftError(Exception):
    """Base class. `message` says what is wrong, `hint` what to do next."""

    exit_code = 1

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message} {self.hint}".strip() if self.hint else self.message

    def __reduce__(self):
        """Pickle with the hint (errors raised in another process, e.g. a Ray worker, keep it)."""
        return (type(self), (self.message, self.hint))


class UsageError(CacheGraftError):
    """Bad option values or combinations."""

    exit_code = 2


class ModelLoadError(CacheGraftError):
    exit_code = 3


class HubUnreachableError(ModelLoadError):
    """The Hugging Face hub could not be reached for a model, fuser or dataset."""


class CheckpointError(CacheGraftError):
    """A fuser checkpoint is malformed, unsafe or does not fit the models."""

    exit_code = 4


class AlignmentError(CacheGraftError):
    exit_code = 4


class StoreError(CacheGraftError):
    exit_code = 5


class StoreNotFoundError(StoreError):
    pass


class StoreMismatchError(StoreError):
    """The store was made with other models, fuser, template or codec."""


class StoreLockedError(StoreError):
    """Another writer holds the store."""

    exit_code = 6


class StoreCorruptError(StoreError):
    exit_code = 7


class StoreMetadataError(StoreCorruptError):
    """The store's metadata contradicts itself (root zarr.json, row tables, commit records, array
    metadata): intact bytes would decode as something else. Reported, never turned into dropped rows."""


class CorpusError(CacheGraftError):
    """Bad corpus input: names file and line."""

    exit_code = 8


class RetrievalIndexError(CacheGraftError):
    exit_code = 9


class IndexMissingError(RetrievalIndexError):
    pass


class IndexMismatchError(RetrievalIndexError):
    pass


class NoPassagesError(CacheGraftError):
    """Nothing to answer from: empty store or no passage retrieved."""

    exit_code = 10


class DatasetError(CacheGraftError):
    exit_code = 11


class TrainingError(CacheGraftError):
    exit_code = 12


class StorageError(CacheGraftError):
    """Writing failed for a reason outside cachegraft: disk full, read-only filesystem, permissions."""

    exit_code = 14


class DiskFullError(StorageError):
    """No space left (ENOSPC, or over quota) while writing."""


class RunnerError(CacheGraftError):
    """The distributed runner failed: the cluster is unreachable, or tasks kept failing after their retries."""

    exit_code = 15


class ServerError(CacheGraftError):
    """`ask --server`: the server could not be reached, refused the key, or was too busy."""

    exit_code = 16
