"""`encode`'s one entry point: the models the user chose, then the runner (local or Ray)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

from cachegraft_cli.corpus import Passage
from cachegraft_cli.encoding.local import encode_corpus
from cachegraft_cli.encoding.plan import EncodeOptions, EncodeSummary
from cachegraft_cli.session import ModelSession


def encode_into(
    store_url: str,
    passages: Iterable[Passage],
    options: EncodeOptions | None = None,
    *,
    preset: str | None = None,
    receiver: str | None = None,
    sharer: str | None = None,
    fuser: str | None = None,
    device: str | None = None,
    dtype: str | None = None,
    trust_remote_code: bool = False,
    instruction: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    ray=None,
    planned: Callable[[int], None] | None = None,
) -> EncodeSummary:
    """Encode passages into a store with the models the user chose: a new store takes the
    preset (or the paper's pair) with overrides, an existing one its own models
    (`session.choice_for_encode`). `ray` (`encoding.ray.driver.RayOptions`) runs the
    fusion on Ray actors instead of in this process; the store is the same. `passages` is
    read more than once (see `encode_corpus`); `planned(n)` hears how many chunks will be
    encoded, once the plan under the lock knows it."""
    from dataclasses import replace

    from cachegraft_cli.session import check_named_models, choice_for_encode
    from cachegraft_cli.store.target import Target

    options = options or EncodeOptions()
    target = Target.open(store_url)  # a file, a foreign directory, a lost manifest: first, and only once
    check_not_foreign(target)  # the runner checks the target against the options, once
    choice = choice_for_encode(target.store, preset, receiver, sharer, fuser, device=device, dtype=dtype,
                               trust_remote_code=trust_remote_code or None, instruction=instruction)
    if target.store is not None:
        check_named_models(target.store, choice)  # by name, before any model (or the hub) is looked up
    choice.check()
    if ray is not None and (options.mismatched_sharer or target.mismatched or options.sharer_notes or target.notes):
        from cachegraft_cli.errors import UsageError

        raise UsageError("The mismatched-sharer control and sharer notes are encoded by the local runner only.",
                         "Leave out --runner ray.")
    if ray is None:
        return encode_corpus(passages, target, ModelSession(choice), options, progress, planned=planned)
    from cachegraft_cli.encoding.calibration import store_codec
    from cachegraft_cli.encoding.ray.driver import encode_on_ray

    codec, note = store_codec(options.codec, target.codec, choice.fuser)
    summary = encode_on_ray(passages, target, choice, replace(options, codec=codec), ray, progress=progress,
                            planned=planned)
    summary.codec, summary.note = codec, note
    return summary


def check_not_foreign(target) -> None:
    """A target with no store yet must hold nothing, or what a killed creation left (made again).
    A zarr.json without cachegraft's metadata beside segments (attributes lost, or another tool's
    zarr group) is refused now: `Target.open` takes it for "no store yet", and the refusal would
    otherwise come when the store is created, after the default models were looked up on the hub."""
    from cachegraft_cli.errors import StoreError, StoreNotFoundError
    from cachegraft_cli.store.layout import ROOT_META
    from cachegraft_cli.store.store import half_created, read_meta

    if target.store is not None or not target.loc.exists(ROOT_META) or half_created(target.loc):
        return
    try:
        read_meta(target.loc)  # another writer may have created the store since: `Target.locked` opens it
    except StoreNotFoundError:
        raise StoreError(
            f"{target.name} is not a cache store: its {ROOT_META} holds no cachegraft metadata (lost, or another "
            "tool's zarr group), so nothing can be appended to it.",
            "Encode into a new or empty --store; if this was a cache store, restore its zarr.json from a backup.",
        ) from None
