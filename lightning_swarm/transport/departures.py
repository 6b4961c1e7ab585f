"""Which rank died first, when a static run loses one: the ranks that stop on a lost peer say so.

A rank that dies takes others down with it: its island peers fail in their next island
collective, and their own peers then lose them in turn, so the connection torch names may be a
rank that only stopped as a consequence. Every rank that stops on a lost connection writes its
rank into the run's rendezvous store (torch's TCPStore at ``MASTER_ADDR:MASTER_PORT``, hosted by
global rank 0) and reads who else did; the rank that died never writes. Best effort: when the
store is gone (global rank 0 is the one that died) nothing is said.
"""

from __future__ import annotations

import datetime
import os
import time

import torch.distributed as dist

_KEY = "lightning_swarm/stopped_on_peer_loss/{}"


def stopped_on_peer_loss(window_s: float = 2.0) -> tuple[list[int], list[int]] | None:
    """Record that this rank stops on a lost peer; after waiting up to ``window_s`` for the
    others, return (ranks that stopped on a lost peer, ranks that did not report one), or
    ``None`` without a reachable store. A rank still training elsewhere reports only at its
    next collective, so the rank that died is among the second list, not always alone there.
    """
    host, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not (dist.is_available() and dist.is_initialized() and host and port):
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        store = dist.TCPStore(
            host,
            int(port),
            world,
            is_master=False,
            timeout=datetime.timedelta(seconds=window_s),
            wait_for_workers=False,
        )
        store.set(_KEY.format(rank), "1")
        deadline = time.monotonic() + window_s
        while True:
            stopped = [r for r in range(world) if store.check([_KEY.format(r)])]
            # All but one reported: the last is the rank that died. Else wait out the window.
            if len(stopped) >= world - 1 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    except Exception:  # the store's host is gone, or the store refused: say nothing
        return None
    return stopped, [r for r in range(world) if r not in stopped]


def departures_text() -> str:
    """One sentence for a peer-lost message, or '' (``stopped_on_peer_loss``)."""
    found = stopped_on_peer_loss()
    if found is None:
        return ""
    stopped, silent = found
    if len(silent) == 1:
        return (
            f" Global rank {silent[0]} died first: every other rank ({stopped}) stopped on "
            "losing a peer."
        )
    return (
        f" Ranks {stopped} stopped on losing a peer, so none of them died first; the rank that "
        f"did is among {silent} (a rank still training reports only at its next collective)."
    )
