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
from cachegraft_cli.template import DEFAULT_INSTRUCTION

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

    @classmethod
    def resolve(cls, preset: str | None = None, receiver=None, sharer=None, fuser=None, **kw) -> "ModelChoice":
        """Preset defaults (the paper's pair when nothing is given) overridden by explicit specs."""
        base = get_preset(preset or PAPER_PRESET) if (preset or not receiver) else None
        return cls(
            receiver=receiver or base.receiver,
            sharer=sharer or (base.sharer if base else None),
            fuser=fuser if fuser is not None else (base.fuser if base else "closed"),
            **{k: v for k, v in kw.items() if v is not None},
        )


class ModelSession:
    def __init__(self, choice: ModelChoice):
        self.choice = choice

    @cached_property
    def receiver(self):
        return self._load(self.choice.receiver)

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
    def template(self):
        from cachegraft_cli.template import PromptTemplate

        return PromptTemplate.for_tokenizer(self.receiver.tokenizer, self.choice.instruction)

    def _load(self, spec: str):
        from cachegraft_cli.models import load_causal_lm

        c = self.choice
        return load_causal_lm(spec, device=c.device, dtype=c.dtype, trust_remote_code=c.trust_remote_code)

    def engine(self):
        """The fusion engine (built once): the sharer loads only for an open fuser."""
        if "_engine" not in self.__dict__:
            from cachegraft_cli.fusion import FusionEngine

            sharer = self.sharer if self._runs_sharer() else None
            self._engine = FusionEngine(self.receiver, self.template.prefix_ids(), sharer, self.fuser)
        return self._engine

    def _runs_sharer(self) -> bool:
        """Only an open fuser fed by the sharer needs it; an adapter is fed zeros."""
        return self.fuser is not None and getattr(self.fuser.spec, "sharer_input", "model") != "zero"

    def _fuser_identity(self) -> dict | None:
        if self.fuser is None:
            return None
        ident = {"name": self.choice.fuser, "fingerprint": self.fuser.fingerprint()[:32]}
        if not self._runs_sharer():
            ident["sharer_input"] = "zero"
        return ident

    def identity(self, codec: str) -> dict:
        """What the store's caches depend on; a store made otherwise is refused."""
        return {
            "receiver": self.receiver.identity,
            "sharer": self.sharer.identity if self._runs_sharer() else None,
            "fuser": self._fuser_identity(),
            "template": self.template.identity(),
            "prefix_token_ids": self.template.prefix_ids(),
            "position_scheme": POSITION_SCHEME,
            "dtype": str(self.receiver.dtype).removeprefix("torch."),
            "codec": codec,
            "geometry": self.receiver.geometry.as_dict(),
        }

    def open_or_create_store(self, url: str, codec: str, also_own_cache: bool):
        """A store for these models: created, or reopened (identity checked). A store
        that already keeps own caches goes on keeping them, asked or not."""
        from cachegraft_cli import kvcache
        from cachegraft_cli.errors import StoreNotFoundError
        from cachegraft_cli.store import CacheStore

        kinds = ("fused", "own") if also_own_cache else ("fused",)
        try:
            existing = CacheStore.open(url).kinds
        except StoreNotFoundError:
            existing = ()
        check_own_cache(url, existing, also_own_cache)
        prefix = kvcache.to_token_major(self.engine().prefix_kv())
        return CacheStore.create(url, self.identity(codec), prefix, existing or kinds)


def check_own_cache(url: str, existing: tuple, also_own_cache: bool) -> None:
    """Own caches can only be kept from a store's start (`existing`: its kinds, empty when it is new)."""
    if existing and also_own_cache and "own" not in existing:
        raise StoreMismatchError(
            f"Store {url} was made without own caches, so --also-own-cache cannot add them now.",
            "Encode into a new --store with --also-own-cache to compare with the `cache` system.",
        )


def session_for_store(store, overrides: ModelChoice | None = None) -> ModelSession:
    """A session that loads the receiver (and, on demand, the sharer) a store was made with."""
    ident = store.identity
    choice = ModelChoice(
        receiver=ident["receiver"]["name"],
        sharer=(ident.get("sharer") or {}).get("name"),
        fuser=None,
        instruction=ident["template"]["instruction"],
    )
    if overrides is not None:  # --sharer names the sharer-text model when the store ran none (closed fuser)
        choice = replace(choice, sharer=overrides.sharer or choice.sharer, device=overrides.device,
                         dtype=overrides.dtype or ident["dtype"], trust_remote_code=overrides.trust_remote_code)
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
