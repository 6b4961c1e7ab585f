"""Static membership: the islands are the blocks of one torch.distributed world.

Every island of the launch takes part in every round; the transport averages over the peer
groups that ``transport.groups`` builds from the world. Nothing is decided per round, so this
module only names the memberships and validates the choice. A process that dies ends the fit of
every island, as in any torch.distributed job; ``membership="torchft"`` is the elastic one.
"""

from __future__ import annotations

from lightning_swarm.errors import SwarmConfigError

MEMBERSHIPS = ("static", "torchft")


def check_membership(name: object) -> str:
    """``name`` if it is a known membership; ``ValueError`` naming the choices otherwise."""
    if name not in MEMBERSHIPS:
        raise SwarmConfigError(
            f"membership must be one of {list(MEMBERSHIPS)}, got {name!r}; 'static' is one "
            "torch.distributed world, 'torchft' lets islands fail, restart and join through a "
            "lighthouse (pip install 'lightning-swarm[elastic]')."
        )
    return str(name)
