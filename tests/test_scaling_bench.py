"""Smoke run of benchmarks/scaling.py and its model at a tiny size: every method runs side by
side, and the byte formulas the model projects with equal what the transports moved (no
timings are checked; the figures live in docs/scaling.md)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from benchmarks.scaling import METHODS, measure
from benchmarks.scaling_model import PARAMS, fit, markdown


# ~20 s: five spawned processes import torch; the transports' byte counts are checked in the
# default run by test_reduce_scatter_transport.py and test_sharded_aggregator.py.
@pytest.mark.slow
def test_every_wire_runs_and_the_model_counts_its_bytes() -> None:
    args: dict[str, Any] = {"mb": 0.25, "reps": 1, "warmup": 0, "methods": list(METHODS)}
    report: dict[str, Any] = {
        "machine": "2 CPU cores",
        "payload_bytes": 2**18,
        "block_size": 128,
        "args": args,
        "islands": {str(n): measure(n, args) for n in (2, 3)},
    }
    params, table = fit(report)
    assert params.shape == (len(PARAMS),) and bool((params >= 0).all())
    assert {(r["method"], r["islands"]) for r in table} == {(m, n) for m in METHODS for n in (2, 3)}
    for r in table:
        # shares cut on blocks, the swarm's status messages and votes: a few KiB at most
        assert np.isclose(r["busiest_bytes"], r["formula_bytes"], rtol=0.02, atol=4096), r
    text = markdown(report, params, table)
    assert "Projected round time" in text and "| 256 |" in text
