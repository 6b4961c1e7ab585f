"""Streaming DiLoCo through SwarmStrategy over real gloo groups (fork launcher, CPU).

Fragments, a delayed exchange in the background worker, int4 pseudo-gradients with error
feedback: every rank must hold the same anchors at every step, and a checkpoint taken while a
fragment is in flight must resume bitwise to the uninterrupted run.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm.fragments import FragmentSchedule
from lightning_swarm.resume.files import ANCHORS_FILE, swarm_root
from tests.helpers import QUIET, Recorder, TinyRegressor, load_ranks, regression_data
from tests.resume_utils import assert_bitwise_equal, fit
from tests.resume_utils import load_ranks as load_resume_ranks

STREAMING: dict[str, Any] = {
    "sync_every": 4,
    "num_fragments": 2,
    "sync_delay": 1,
    "quantize": "int4",
    "quantize_block_size": 16,
    "error_feedback": True,
    "sync_at_end": False,  # these tests pin the schedule; the end-of-fit round has its own
}
# TinyRegressor: net.0 (16 x 8 + 16) and net.2 (1 x 16 + 1); strided: one layer per fragment
FRAGMENT_SIZES = [8 * 16 + 16, 16 + 1]


@pytest.mark.parametrize(
    ("world", "island_size", "shard_outer"), [(2, 1, True), (4, 2, False), (4, 2, True)]
)
def test_anchors_agree_across_islands(
    tmp_path: Path, world: int, island_size: int, shard_outer: bool
) -> None:
    pl.seed_everything(7)
    strategy = SwarmStrategy(
        island_size=island_size, shard_outer=shard_outer, start_method="fork", **STREAMING
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=strategy,
        max_steps=12,
        callbacks=[Recorder(str(tmp_path))],
        logger=CSVLogger(str(tmp_path), name="m", version=0),
        log_every_n_steps=50,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(TinyRegressor(), regression_data())
    ranks = load_ranks(tmp_path, world)
    schedule = FragmentSchedule(sync_every=4, num_fragments=2, sync_delay=1)
    # applies at 3, 5, 7, 9, 11; fragment 0 sent at 12 is still in flight when fit ends
    assert all(r["outer_steps"] == [5] and r["inner_steps"] == [12] for r in ranks)
    offsets = [0, FRAGMENT_SIZES[0], sum(FRAGMENT_SIZES)]
    for i in range(12):
        step = i + 1
        anchors = [r["steps"][i]["anchors"][0] for r in ranks]
        params = [r["steps"][i]["params"] for r in ranks]
        # ranks at the same position of every island hold the same anchors (or share)
        for r in range(world):
            assert torch.equal(anchors[r], anchors[r % island_size]), f"anchors differ at {step}"
            assert torch.equal(params[r], params[(r // island_size) * island_size])
        applied = schedule.applies_at(step)
        if applied is not None and not (shard_outer and island_size > 1):
            lo, hi = offsets[applied], offsets[applied + 1]
            for p in params:  # merge_alpha=0: the fragment's locals are the new global
                assert torch.equal(p[lo:hi], anchors[0][lo:hi]), f"step {step}"
        if applied is not None:  # by name, whatever share each rank holds
            fragment = (
                ["net.0.weight", "net.0.bias"] if applied == 0 else ["net.2.weight", "net.2.bias"]
            )
            for r in range(world):
                record = ranks[r]["steps"][i]
                for name in fragment:
                    if name in record["named_anchors"]:
                        assert torch.equal(
                            record["named_params"][name], record["named_anchors"][name]
                        ), (step, r, name)
        if step > 1:
            assert not torch.equal(params[0], params[island_size]), f"islands equal at {step}"
    assert not torch.equal(ranks[0]["steps"][0]["anchors"][0], ranks[0]["steps"][-1]["anchors"][0])
    if world == 2:
        with open(tmp_path / "m" / "version_0" / "metrics.csv") as f:
            rows = [r for r in csv.DictReader(f) if r.get("swarm/outer_steps")]
        assert [int(r["step"]) for r in rows] == [3, 5, 7, 9, 11]
        assert [r["swarm/fragment1_rounds"] for r in rows if r["swarm/fragment1_rounds"]] == [
            "1.0",
            "2.0",
            "3.0",
        ]
        # int4 all-gather with 2 islands: half a byte per element plus a scale per block
        per_fragment = [n // 2 + n % 2 + 4 * -(-n // 16) for n in FRAGMENT_SIZES]
        expected = [per_fragment[1], per_fragment[0]] * 3
        sent = [float(r["swarm/bytes_sent"]) for r in rows]
        assert sent == [float(sum(expected[: k + 1])) for k in range(5)]
        assert all(float(r["swarm/transport_time_s"]) > 0 for r in rows)


def test_layout_not_covering_the_model_fails_at_setup() -> None:
    strategy = SwarmStrategy(
        sync_every=4, num_fragments=2, fragment_layout=[["net.0"], ["net.0"]], start_method="fork"
    )
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=strategy, max_steps=1, **QUIET)
    with pytest.raises(Exception, match=r"'net.0.weight' is in fragment_layout\[0\] and"):
        trainer.fit(TinyRegressor(), regression_data())


def test_resume_with_a_fragment_in_flight_is_exact(tmp_path: Path) -> None:
    """Steps 2, 4 and 6 end with a fragment in flight (sent there, applied one step later)."""
    kw: dict[str, Any] = {"sync_every": 4, "num_fragments": 2, "sync_delay": 1, "quantize": "int4"}
    kw |= {"quantize_block_size": 8, "error_feedback": True}
    full = tmp_path / "full"
    fit(full / "out", devices=2, island_size=1, max_steps=8, ckpt_dir=full / "ckpts", **kw)
    ckpt = full / "ckpts" / "step=4.ckpt"
    record = torch.load(ckpt, weights_only=True)["swarm"]
    assert record["fingerprint"]["fragments"]["layout"] == [
        [["net.0.weight", "net.0.bias"], ["net.2.weight", "net.2.bias"]]
    ]
    directory = swarm_root(ckpt) / record["save_id"]
    pending = torch.load(directory / ANCHORS_FILE, weights_only=True)["outer"][0]["pending"]
    assert pending["fragment"] == 0 and pending["send_step"] == 4
    islands = [torch.load(directory / f"island-0000{i}.pt", weights_only=True) for i in (0, 1)]
    residuals = [i["outer_island"][0]["residuals"]["net.0.weight"] for i in islands]
    assert not torch.equal(residuals[0], residuals[1])  # per-island state, both saved
    for step in (4, 6):
        out = tmp_path / f"resumed{step}"
        fit(
            out,
            devices=2,
            island_size=1,
            max_steps=8,
            ckpt_path=full / "ckpts" / f"step={step}.ckpt",
            **kw,
        )
        expected, resumed = load_resume_ranks(full / "out", 2), load_resume_ranks(out, 2)
        for rank in range(2):
            assert_bitwise_equal(expected[rank], resumed[rank], f"resume at {step}, rank {rank}")


def test_resume_with_other_fragments_is_refused(tmp_path: Path) -> None:
    kw: dict[str, Any] = {"sync_every": 4, "num_fragments": 2, "sync_delay": 1}
    fit(tmp_path / "out", devices=2, island_size=1, max_steps=2, ckpt_dir=tmp_path / "c", **kw)
    with pytest.raises(Exception, match="fragment layout: checkpoint has"):
        fit(
            tmp_path / "again",
            devices=2,
            island_size=1,
            max_steps=4,
            ckpt_path=tmp_path / "c" / "step=2.ckpt",
            sync_every=4,
            num_fragments=2,
            sync_delay=0,
        )


def test_swarm_transport_with_fragments_and_delay(tmp_path: Path) -> None:
    pl.seed_everything(7)
    strategy = SwarmStrategy(
        sync_every=4,
        num_fragments=2,
        sync_delay=1,
        transport="swarm",
        swarm={"spool_dir": str(tmp_path / "spool")},
        start_method="fork",
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=8,
        callbacks=[Recorder(str(tmp_path))],
        **QUIET,
    )
    trainer.fit(TinyRegressor(), regression_data())
    ranks = load_ranks(tmp_path, 2)
    # applied at 3, 5, 7; at the end fragment 0 (sent at 8) is applied early and fragment 1,
    # stepped since 7, syncs inline: both islands end with the anchors
    assert ranks[0]["outer_steps"] == [5]
    last = [r["steps"][-1] for r in ranks]
    assert torch.equal(last[0]["params"], last[1]["params"])
    assert torch.equal(last[0]["params"], last[0]["anchors"][0])
    assert all(
        torch.equal(a["anchors"][0], b["anchors"][0])
        for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)
    )
