"""Which models a command uses, loaded lazily and once.

`ModelChoice` is what the user asked for (preset plus overrides);
`ModelSession` loads the receiver, the fuser and, only when a fuser needs it,
the sharer, and derives the store identity from them.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import cached_property

from cachegraft_cli.config import PAPER_PRESET, get_preset
from cachegraft_cli.errors import StoreMismatchError
from cachegraft_cli.lm.template import DEFAULT_INSTRUCTION

POSITION_SCHEME = "canonical"  # passages are encoded right after the prefix


@dataclass
class ModelChoice:
    receiver: str
    sharer: str | None
    fuser: str | None
    device: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    instruction: str = DEFAULT_INSTRUCTION
    weights: str = "as-loaded"  # the receiver's, when it answers (never recorded: caches are not made with it)

    def __post_init__(self):
        # A local model or fuser is recorded in the store by absolute path, so `ask` finds it from
        # any directory and the same files named another way are the same models.
        self.receiver = _absolute(self.receiver)
        self.sharer = _absolute(self.sharer)
        self.fuser = _absolute(self.fuser)

    def check(self) -> ModelChoice:
        """Everything about the choice that can be checked without loading a model:
        device, dtype, that local specs exist, built-in fuser names. Raises typed errors."""
        from cachegraft_cli.fuser import check_fuser_spec
        from cachegraft_cli.lm.models import check_device, check_dtype, resolve_source

        check_device(self.device)
        check_dtype(self.dtype)
        for spec in (self.receiver, self.sharer):
            if spec:
                resolve_source(spec)
        check_fuser_spec(self.fuser)
        return self

    @classmethod
    def resolve(cls, preset: str | None = None, receiver=None, sharer=None, fuser=None, **kw) -> "ModelChoice":
        """Preset defaults (the paper's pair when nothing is given) overridden by explicit specs."""
        base = get_preset(preset or PAPER_PRESET) if (preset or not receiver) else None
        return cls(
            receiver=receiver or (base.receiver if base else ""),
            sharer=sharer or (base.sharer if base else None),
            fuser=fuser if fuser is not None else (base.fuser if base else "closed"),
            **{k: v for k, v in kw.items() if v is not None},
        )


@dataclass(frozen=True)
class ModelOverrides:
    """What a user may change about the models that ask a store: the store names the receiver
    (and the sharer it ran, if any); `sharer` names the `sharer-text` model when it ran none."""

    sharer: str | None = None
    device: str | None = None
    dtype: str | None = None
    trust_remote_code: bool = False
    weights: str | None = None  # the receiver's: as-loaded, int8 or int4 (`lm/weights.py`)

    def check(self) -> ModelOverrides:
        """Device, dtype, weights and a local sharer checked without loading anything (typed errors)."""
        from cachegraft_cli.lm.models import check_device, check_dtype, pick_device, resolve_source

        check_device(self.device)
        check_dtype(self.dtype)
        if self.weights not in (None, "as-loaded"):  # weights.py imports torch: only when asked for
            from cachegraft_cli.lm.weights import check_weights

            check_weights(self.weights, pick_device(self.device))
        sharer = _absolute(self.sharer)  # recorded and compared by absolute path, as `ModelChoice`'s
        if sharer:
            resolve_source(sharer)
        return replace(self, sharer=sharer)


def _absolute(spec: str | None) -> str | None:
    """An existing local path made absolute; hub ids, `pulled:`/`builtin:` names and `closed` as given."""
    from pathlib import Path

    if not spec or ":" in spec.split("/", 1)[0] or spec in ("closed", "none"):
        return spec
    path = Path(spec).expanduser()
    return str(path.resolve()) if path.exists() else spec


class ModelSession:
    def __init__(self, choice: ModelChoice):
        self.choice = choice
        # (title, text, token limit) -> the notes this session's sharer wrote (`encoding.notes`): the
        # stores `evaluate` makes of one corpus (a notes store and its mismatched control) share them
        self.notes_written: dict[tuple[str, str, int], str] = {}

    @cached_property
    def receiver(self):
        return self._load(self.choice.receiver, self.choice.weights)

    @cached_property
    def fuser(self):
        """The fuser on the receiver's device (`place_fuser`: float32 on CPUs without fast bf16)."""
        from cachegraft_cli.fuser import load_fuser, place_fuser

        fuser = load_fuser(self.choice.fuser)
        if fuser is not None:
            place_fuser(fuser, self.receiver.device)
        return fuser

    @cached_property
    def sharer(self):
        if not self.choice.sharer:
            from cachegraft_cli.errors import UsageError

            raise UsageError("This needs a sharer model, and none is configured (the store ran no sharer).",
                             "Pass --sharer MODEL (hub id, local dir or .gguf).")
        return self._load(self.choice.sharer)

    @cached_property
    def tokenizer(self):
        """The receiver's tokenizer; loaded on its own (no weights) when the receiver is not loaded yet."""
        if "receiver" in self.__dict__:
            return self.receiver.tokenizer
        from cachegraft_cli.lm.models import load_tokenizer

        return load_tokenizer(self.choice.receiver, trust_remote_code=self.choice.trust_remote_code)

    @cached_property
    def template(self):
        from cachegraft_cli.lm.template import PromptTemplate

        return PromptTemplate.for_tokenizer(self.tokenizer, self.choice.instruction)

    def _load(self, spec: str, weights: str = "as-loaded"):
        from cachegraft_cli.lm.models import load_causal_lm

        c = self.choice
        return load_causal_lm(spec, device=c.device, dtype=c.dtype, trust_remote_code=c.trust_remote_code,
                              weights=weights)

    def fusion(self):
        """The passage fusion (built once): the sharer loads only for an open fuser."""
        if "_fusion" not in self.__dict__:
            from cachegraft_cli.fuser.fusion import PassageFusion

            sharer = self.sharer if self._runs_sharer() else None
            self._fusion = PassageFusion(self.receiver, self.template.prefix_ids(), sharer, self.fuser)
        return self._fusion

    def _runs_sharer(self) -> bool:
        """Only an open fuser fed by the sharer needs it; an adapter is fed zeros."""
        return self.fuser is not None and getattr(self.fuser.spec, "sharer_input", "model") != "zero"

    def _fuser_identity(self, sharer_input: dict | None = None) -> dict | None:
        if self.fuser is None:
            return None
        ident = {"name": self.choice.fuser, "fingerprint": self.fuser.fingerprint()[:32]}
        if not self._runs_sharer():
            ident["sharer_input"] = "zero"
        elif sharer_input:
            ident.update(sharer_input)
        return ident

    def check_mismatched(self) -> None:
        """The mismatched-sharer control needs a fuser fed by the sharer (checked once it is loaded)."""
        if not self._runs_sharer():
            from cachegraft_cli.errors import UsageError

            what = "an adapter (fed zeros)" if self.fuser is not None else "no fuser (closed)"
            raise UsageError(f"--mismatched-sharer needs a fuser fed by the sharer; this encode has {what}.",
                             "Use a sharer-fed fuser, e.g. --preset offline.")

    def identity(self, codec: str, keep: dict | None = None, sharer_input: dict | None = None,
                 notes: dict | None = None) -> dict:
        """What the store's caches depend on; a store made otherwise is refused. `keep` (a pruned
        store's ratio and method) is recorded only when tokens are dropped, `sharer_input` (what a
        sharer-fed fuser read instead of each passage, `encoding.donors`) and `notes` (the sharer's
        notes, `encoding.notes`) only when there are."""
        ident = {
            "receiver": self.receiver.identity,
            "sharer": self.sharer.identity if self._runs_sharer() else None,
            "fuser": self._fuser_identity(sharer_input),
            "template": self.template.identity(),
            "prefix_token_ids": self.template.prefix_ids(),
            "position_scheme": POSITION_SCHEME,
            "dtype": str(self.receiver.dtype).removeprefix("torch."),
            "codec": codec,
            "geometry": self.receiver.geometry.as_dict(),
        }
        if notes:
            ident["notes"] = notes
        return {**ident, "keep": keep} if keep is not None else ident

    def open_or_create_store(self, target, codec: str, also_own_cache: bool, keep: dict | None = None,
                             compressor: str | None = None, sharer_input: dict | None = None,
                             notes: dict | None = None, codec_params: dict | None = None):
        """A store for these models at `target` (the caller's `store.target.Target`, checked):
        created, or the existing one (identity checked). A store that already keeps own caches
        goes on keeping them, asked or not."""
        from cachegraft_cli.lm import kvcache
        from cachegraft_cli.store.oserrors import writing

        store = target.store
        kinds = ("fused", "own") if also_own_cache else ("fused",)
        prefix = kvcache.to_token_major(self.fusion().prefix_kv())
        with writing(target.name, "create the store"):
            return target.create(self.identity(codec, keep, sharer_input, notes), prefix,
                                 store.kinds if store is not None else kinds, compressor, codec_params)

    def names_match(self, store) -> bool:
        """Whether this session names the receiver, fuser and (where it ran one) sharer the store
        records, so that its weights need no loading to be trusted as the store's."""
        have, c = stored_choice(store.identity), self.choice
        return (c.receiver, c.fuser or "closed") == (have.receiver, have.fuser) and (
            have.sharer is None or c.sharer == have.sharer)

    def check_template(self, store) -> None:
        """The prompt template (tokenizer + instruction) must be the store's: checked with the
        tokenizer alone, before any model loads."""
        from cachegraft_cli.store.identity import check

        check(store.loc.url, store.identity, {"template": self.template.identity(),
                                              "prefix_token_ids": self.template.prefix_ids()})


def stored_choice(identity: dict) -> ModelChoice:
    """The models, fuser, instruction and dtype a store was encoded with."""
    return ModelChoice(
        receiver=identity["receiver"]["name"],
        sharer=(identity.get("sharer") or {}).get("name"),
        fuser=(identity.get("fuser") or {}).get("name") or "closed",
        dtype=identity.get("dtype"),
        instruction=identity["template"]["instruction"],
    )


def choice_for_encode(store, preset: str | None = None, receiver=None, sharer=None, fuser=None, **kw) -> ModelChoice:
    """What `encode` uses. A new store: the preset (or the paper's pair) with overrides. An
    existing store: the models recorded in it, so an append needs no model options; explicit
    --receiver/--sharer/--fuser still override (their weights are checked once loaded), and a
    --preset naming other models is refused at once."""
    if store is None:
        return ModelChoice.resolve(preset, receiver, sharer, fuser, **kw)
    base = stored_choice(store.identity)
    if preset:
        check_preset(store, preset)
    given = {k: v for k, v in kw.items() if v is not None}
    return replace(base, receiver=receiver or base.receiver, sharer=sharer or base.sharer,
                   fuser=fuser if fuser is not None else base.fuser, **given)


def check_preset(store, preset: str) -> None:
    """Refuse a preset whose receiver, fuser or (where the store ran one) sharer is not the store's."""
    wanted = get_preset(preset)
    have = stored_choice(store.identity)
    pairs = [("receiver", have.receiver, wanted.receiver), ("fuser", have.fuser, wanted.fuser)]
    if have.sharer is not None:
        pairs.append(("sharer", have.sharer, wanted.sharer))
    _refuse_other_models(store, pairs, lambda role, b: f"--preset {preset} names {role} {b}",
                         lambda role: "Leave out --preset to append with the store's own models, or encode into a "
                                      "new --store.")


def _refuse_other_models(store, pairs: list, named, hint) -> None:
    """StoreMismatchError for the first (role, stored, named) whose two names differ; `named(role,
    name)` says who named the other one, `hint(role)` what to do."""
    differ = next(((role, a, b) for role, a, b in pairs if a != b), None)
    if differ:
        role, a, b = differ
        raise StoreMismatchError(f"Store {store.loc.url} was encoded with {role} {a}, but {named(role, b)}.",
                                 hint(role))


def check_named_models(store, choice: ModelChoice) -> None:
    """Refuse, before any model loads, an append whose --receiver, --fuser or (where the store ran
    one) --sharer names other models than the store records. The store's identity holds each by
    the name it was given (a local path made absolute, as `choice`'s), and the identity check after
    loading refuses any other name anyway: loading first only cost the load, or a hub's retries."""
    have = stored_choice(store.identity)
    fuser = "closed" if choice.fuser in (None, "", "none") else choice.fuser  # `load_fuser`'s spellings of none
    pairs: list[tuple[str, str | None, str | None]] = [("receiver", have.receiver, choice.receiver),
                                                       ("fuser", have.fuser, fuser)]
    if have.sharer is not None:
        pairs.append(("sharer", have.sharer, choice.sharer))
    _refuse_other_models(store, pairs, lambda role, b: f"--{role} names {b}",
                         lambda role: f"Leave out --{role} to append with the store's own models (see `cachegraft "
                                      f"store info {store.loc.url}`), or encode into a new --store.")


def session_for_store(store, overrides: ModelOverrides | None = None) -> ModelSession:
    """A session that loads the receiver (and, on demand, the sharer) a store was made with,
    with the user's `overrides` (sharer, device, dtype, trust_remote_code)."""
    ident = store.identity
    choice = replace(stored_choice(ident), fuser=None, dtype=None)
    if overrides is not None:  # --sharer names the sharer-text model when the store ran none (closed fuser)
        choice = replace(choice, sharer=overrides.sharer or choice.sharer, device=overrides.device,
                         dtype=overrides.dtype or ident["dtype"], trust_remote_code=overrides.trust_remote_code,
                         weights=overrides.weights or "as-loaded")
    else:
        choice = replace(choice, dtype=ident["dtype"])
    session = ModelSession(choice)
    return session


def check_receiver(store, session: ModelSession) -> None:
    """The loaded receiver must be the one the store was encoded with."""
    stored = store.identity["receiver"]
    have = session.receiver.identity
    if stored.get("fingerprint") != have.get("fingerprint"):
        raise StoreMismatchError(
            f"Store was encoded with receiver {stored.get('name')} (fingerprint {stored.get('fingerprint')}), "
            f"but {have.get('name')} (fingerprint {have.get('fingerprint')}) is loaded.",
            "Use the receiver the store was made with (see `cachegraft store info`), or encode a new store.",
        )
