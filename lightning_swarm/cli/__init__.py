"""``swarm-train``: the Hydra app (``app``), its strategy schema (``schema``), the checks it runs
before any process starts (``preflight``) and the run summary (``summary``)."""

from lightning_swarm.cli.app import main

__all__ = ["main"]
