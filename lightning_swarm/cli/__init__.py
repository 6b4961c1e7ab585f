"""``swarm-train``: the Hydra app (``app``) and the checks it runs before any process starts
(``preflight``)."""

from lightning_swarm.cli.app import main

__all__ = ["main"]
