"""Encode: corpus -> fused caches in a store.

`plan` (the shared vocabulary), `local` (this process), `ray/` (actors on a Ray
cluster, an optional extra imported only when used) and `run` (the entry point that
picks a runner). Both runners plan, window and batch the same way and write the same
store."""

RUNNERS = ("local", "ray")
