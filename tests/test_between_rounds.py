"""Between rounds nothing crosses islands; a SIGTERM still stops every rank, together.

Lightning's training loop broadcasts a SIGTERM flag over the world at every batch. The strategy
confines that check to each island (``lightning_swarm.between_rounds``) and carries the flag across
islands at rounds only. These tests count every torch.distributed call by phase, and send a
real SIGTERM to one rank of a four-rank run.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint, Timer
from lightning.pytorch.callbacks.timer import Interval
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.trainer.connectors.signal_connector import _SignalConnector
from torch import Tensor

from lightning_swarm import PeerLostError, SwarmStrategy
from lightning_swarm.between_rounds import IslandSigterm, warn_of_world_collectives
from tests.cli_utils import run_rank_processes
from tests.collective_probe import CollectiveProbe
from tests.helpers import QUIET, TinyRegressor, regression_data
from tests.sigterm_rank import STOP_STEP, SYNC_EVERY, WORLD


class ValidatedRegressor(TinyRegressor):
    """Logs its training and validation losses with ``sync_dist=True``."""

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        loss = super().training_step(batch, batch_idx)
        self.log("train_loss", loss, sync_dist=True)  # over the island only, while training
        return loss

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(x), y), sync_dist=True)


@pytest.mark.parametrize(("world", "island_size"), [(2, 1), (4, 2)])
def test_no_collective_crosses_islands_between_rounds(
    tmp_path: Path, world: int, island_size: int
) -> None:
    steps, sync_every = 12, 4
    probe = CollectiveProbe(tmp_path, island_size)
    probe.install()
    try:
        pl.seed_everything(0)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=world,
            strategy=SwarmStrategy(
                sync_every=sync_every, island_size=island_size, start_method="fork"
            ),
            max_steps=steps,
            val_check_interval=6,
            limit_val_batches=2,
            num_sanity_val_steps=0,
            callbacks=[probe],
            **QUIET,
        )
        trainer.fit(ValidatedRegressor(), regression_data(), regression_data(num=32))
    finally:
        probe.uninstall()
    for rank in range(world):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert report["steps"] == steps
        records = report["records"]
        crossing = [r for r in records if r["crosses"]]
        in_training = [r for r in crossing if r["phase"] == "train"]
        assert in_training == [], f"rank {rank}: cross-island calls between rounds: {in_training}"
        # The probe sees cross-island traffic where it is allowed: the rounds (and validation,
        # whose sync_dist reduction uses the world).
        assert any(r["phase"] == "round" for r in crossing), records
        assert any(r["phase"] == "validation" for r in crossing), records
        island_checks = [r for r in records if r["phase"] == "train" and not r["crosses"]]
        if island_size == 1:
            assert island_checks == []  # an island of one rank sends nothing between rounds
        else:  # per batch, the SIGTERM agreement and the logged loss, inside the island
            calls = [r["call"] for r in island_checks]
            assert calls.count("all_reduce") == 2 * steps, calls
            assert set(calls) == {"all_reduce", "barrier"}, calls  # Lightning's sync_dist


def test_a_sigterm_on_one_rank_stops_every_island_after_the_next_round(tmp_path: Path) -> None:
    procs, outputs = run_rank_processes("tests.sigterm_rank", [str(tmp_path)], WORLD, 100)
    next_round = (STOP_STEP // SYNC_EVERY + 1) * SYNC_EVERY
    finals = []
    for rank, (proc, (_, err)) in enumerate(zip(procs, outputs, strict=True)):
        # 143 = 128 + SIGTERM on every rank, with a line that says why, on every rank.
        assert proc.returncode == 143, f"rank {rank} exited {proc.returncode}:\n{err[-3000:]}"
        assert (
            f"[rank: {rank}] the fit stops early, at inner step {next_round} of max_steps=40: "
            "island(s) [1] received SIGTERM"
        ) in err, err[-3000:]
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # Every rank stopped at the batch after the round that followed the signal, on
        # Lightning's own SIGTERM path, with the round's global model in place.
        assert result["exception"] == "SIGTERMException", (rank, result)
        assert result["global_step"] == next_round, (rank, result)
        assert result["outer_steps"] == next_round // SYNC_EVERY, (rank, result)
        finals.append(result["params"])
    assert "SIGTERM received: every island stops after the next outer round" in outputs[3][1]
    for params in finals[1:]:
        assert torch.equal(params, finals[0])


def test_time_based_callbacks_that_cross_islands_every_step_are_named() -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_time="00:00:10:00",
        callbacks=[ModelCheckpoint(train_time_interval=datetime.timedelta(minutes=5))],
        **{**QUIET, "enable_checkpointing": True},
    )
    with pytest.warns(UserWarning) as warned:
        warn_of_world_collectives(trainer)
    messages = [str(w.message) for w in warned]
    assert any(m.startswith("Trainer(max_time=...) (Lightning's Timer)") for m in messages)
    assert any(m.startswith("ModelCheckpoint(train_time_interval=...)") for m in messages)
    assert all("prefer" in m for m in messages)


def test_the_lightning_internals_it_replaces_are_where_it_expects_them() -> None:
    # lightning_swarm.between_rounds replaces these on one trainer; an upgrade that renames or moves
    # one must fail here rather than leave Lightning's world broadcast in every step.
    assert callable(_TrainingEpochLoop._broadcast_sigterm_tensor)
    assert callable(_SignalConnector._sigterm_notifier_fn)
    trainer = pl.Trainer(accelerator="cpu", devices=1, **QUIET)
    assert isinstance(trainer._signal_connector, _SignalConnector)
    assert trainer._signal_connector.received_sigterm is False
    assert isinstance(trainer.fit_loop.epoch_loop, _TrainingEpochLoop)
    assert trainer.received_sigterm is False
    trainer._signal_connector.received_sigterm = True
    assert trainer.received_sigterm is True  # what Lightning's own checks read
    timer = Timer(duration="00:00:01:00")
    assert timer._duration == 60 and timer._interval == Interval.step
    checkpoint = ModelCheckpoint(train_time_interval=datetime.timedelta(seconds=5))
    assert checkpoint._train_time_interval == datetime.timedelta(seconds=5)


class _ClosedWork:
    """A world agreement in flight whose peer died: its wait fails as gloo's does."""

    def wait(self) -> None:
        raise RuntimeError(
            "[gloo/transport/tcp/pair.cc:553] Connection closed by peer [10.0.0.2]:5"
        )


def test_a_peer_island_lost_after_a_round_is_named_at_the_next_batch() -> None:
    trainer = SimpleNamespace(global_rank=0)
    sigterm = IslandSigterm(trainer, None, torch.device("cpu"), island_index=0, num_islands=2)  # type: ignore[arg-type]
    sigterm._pending.append((_ClosedWork(), torch.zeros(1)))  # type: ignore[arg-type]
    with pytest.raises(PeerLostError) as caught:
        sigterm.check()
    message = str(caught.value)
    assert message.startswith("rank 0, after the last round: a rank of another island"), message
    assert "Connection closed by peer [10.0.0.2]:5" in message
    assert "Restart the fit from the last checkpoint (ckpt_path=last)" in message
