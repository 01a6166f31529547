"""Engines that run `encode`: `local` (this process, `cachegraft_cli.encode`) and `ray`
(a pool of actors on a Ray cluster, `ray_engine`). Both plan, window and batch the
same way and write the same store; `ray` is an optional extra, imported only when used."""

ENGINES = ("local", "ray")
