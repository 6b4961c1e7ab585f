"""``timeout_s``: a rank that stops makes every other rank exit within it, saying why.

Issue 22, item 5. Each rank is its own process (the environment says which rank), so each
rank's exit status and message are its own; the stopped rank is killed by the test afterwards.
"""

from __future__ import annotations

import datetime
import re

import pytest

from lightning_swarm import SwarmStrategy
from tests.cli_utils import run_rank_processes
from tests.stopped_rank import WORLD


def test_a_stopped_rank_ends_every_other_rank_with_a_timeout_message() -> None:
    # Without timeout_s reaching the groups these waits would last torch's 30 minutes:
    # the bound here is the test's own, far above timeout_s (not a timing assertion).
    procs, outputs = run_rank_processes(
        "tests.stopped_rank", ["3", "3"], WORLD, 90, wait_for=WORLD - 1
    )
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=False)):
        assert proc.returncode != 0, f"rank {rank} exited 0:\n{err[-3000:]}"
        # Outside the outer round, or inside it (``RoundTimeoutError``, a subclass, names the
        # island, the round and its payload too).
        plain = f"CollectiveTimeoutError: rank {rank}: a collective waited timeout_s=3 s"
        in_round = re.compile(
            rf"RoundTimeoutError: rank {rank}, island \d, round \d+: .* waited timeout_s=3 s"
        )
        assert plain in err or in_round.search(err), err[-3000:]


def test_timeout_s_must_be_positive() -> None:
    with pytest.raises(ValueError, match=r"timeout_s=0 must be a finite number of seconds"):
        SwarmStrategy(timeout_s=0)


def test_timeout_s_reaches_the_process_group_options() -> None:
    strategy = SwarmStrategy(timeout_s=12.5)
    assert strategy._timeout == datetime.timedelta(seconds=12.5)
    assert strategy.config.timeout_s == 12.5


def test_ddp_timeout_keyword_still_works_and_conflicts_are_refused() -> None:
    strategy = SwarmStrategy(timeout=datetime.timedelta(seconds=7))
    assert strategy.config.timeout_s == 7
    with pytest.raises(ValueError, match="disagree; give timeout_s only"):
        SwarmStrategy(timeout_s=5, timeout=datetime.timedelta(seconds=7))
