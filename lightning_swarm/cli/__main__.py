"""``python -m lightning_swarm.cli``: the same app as ``swarm-train``."""

from lightning_swarm.cli.app import main

if __name__ == "__main__":
    main()
