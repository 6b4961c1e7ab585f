"""Failure injection for the elastic test islands, keyed by (island, round, phase).

An island script takes ``--fault PHASE:ROUND:ACTION`` (repeatable) and installs ``fault_hook``
as its membership's ``on_phase``. When the island's rank 0 starts that phase of that round
(``*``: the first round that reaches the phase; ``N+``: the first from round N on), the hook
writes ``<out>/<island>.<action>`` (holding "phase round") and then:

- ``kill``: SIGKILLs its own process (a death at exactly that moment);
- ``freeze``: SIGSTOPs its own process; the test continues it with SIGCONT when it chooses.

Phases: quorum, pg_setup, header, mean, commit, heal_send, heal_recv (``TorchftMembership``).
Each fault fires once, and at most one fault fires per output directory (the first to create
``<out>/fault.fired`` exclusively): a fault armed on several islands (e.g. on whichever heals a
joiner) takes down one of them. Nothing here is timing-based: the test waits for the marker.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

PHASES = ("quorum", "pg_setup", "header", "mean", "commit", "heal_send", "heal_recv")
ACTIONS = {"kill": signal.SIGKILL, "freeze": signal.SIGSTOP}


@dataclass
class Fault:
    phase: str
    first_round: int  # the first round the fault may fire in
    exact: bool  # fire only in first_round itself
    action: str
    fired: bool = False

    @classmethod
    def parse(cls, text: str) -> Fault:
        phase, round_, action = text.split(":")
        if phase not in PHASES or action not in ACTIONS:
            raise ValueError(f"--fault {text!r}: use PHASE:ROUND:ACTION, phases {PHASES}")
        if round_ == "*":
            return cls(phase, 0, False, action)
        return cls(phase, int(round_.rstrip("+")), not round_.endswith("+"), action)

    def matches(self, phase: str, round_: int) -> bool:
        if self.fired or phase != self.phase or round_ < self.first_round:
            return False
        return not self.exact or round_ == self.first_round


def fault_hook(texts: Sequence[str], out: Path, island: str) -> Callable[[str, int], None]:
    faults = [Fault.parse(t) for t in texts]

    def hook(phase: str, round_: int) -> None:
        for fault in faults:
            if not fault.matches(phase, round_):
                continue
            fault.fired = True
            try:
                (out / "fault.fired").open("x").close()
            except FileExistsError:  # another island's fault fired already
                return
            (out / f"{island}.{fault.action}").write_text(f"{phase} {round_}")
            os.kill(os.getpid(), ACTIONS[fault.action])

    return hook
