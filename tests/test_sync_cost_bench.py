"""Smoke runs of benchmarks/sync_cost.py: both modes run end to end at tiny sizes (no timings
are checked; the figures live in docs/performance.md)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from benchmarks.sync_cost import FLOOR, main


def test_cpu_mode_runs_every_method_side_by_side(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    torchft = importlib.util.find_spec("torchft") is not None
    args = ["--mb", "0.25", "--reps", "2", "--warmup", "0", "--start-method", "fork"]
    args += ["--json", str(out)]
    main(args if torchft else [*args, "--no-torchft"])
    result = json.loads(out.read_text())
    methods = {row["method"] for row in result["rows"]}
    expected = {"ours: held", "ours: streamed", FLOOR}
    assert methods == (expected | {"torchft 0.2.0 DiLoCo"} if torchft else expected)
    assert all(len(v) == 2 and min(v) > 0 for v in result["times_s"].values())
    assert result["payload_bytes"] > 0.2 * 2**20


def test_gpu_mode_runs_through_its_cpu_stand_in(tmp_path: Path) -> None:
    pytest.importorskip("lightning")
    out = tmp_path / "g.json"
    main(["--gpu", "--stand-in", "--reps", "1", "--json", str(out)])
    result = json.loads(out.read_text())
    assert result["mode"] == "gpu-stand-in"
    assert "ours: streamed, CPU anchors" in result["times_s"]
    assert set(result["sync_share_at_100"]) >= {"ours: held, CPU anchors"}
