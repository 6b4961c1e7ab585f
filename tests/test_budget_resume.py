"""Checkpoints and exact resume of fits on a time budget (``sync_every_s``).

Islands step at their own pace under a budget, so each keeps its own ``global_step`` and data
position. The fits here read an injected clock that only inner steps advance: island 0's steps
take 5 s and island 1's 3 s of a 15 s budget, so island 0 joins every round after 3 steps and
island 1 after 5 (one more each before the first round: a budget starts after the first step).
The rounds fall at island steps (4, 6), (7, 11), (10, 16), (13, 21): with ``max_steps=20`` the
fit ends at round 4, and ``ModelCheckpoint(every_n_train_steps=10)`` saves after rounds 2 and 4,
where the most steps any island had taken reached 11 and 21.
"""

from __future__ import annotations

import functools
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor

import lightning_swarm.strategy as strategy_module
from lightning_swarm import SwarmResume, SwarmStrategy
from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.between_rounds import BudgetFit, check_round_saves
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmCheckpointError, SwarmConfigError
from lightning_swarm.outer import OuterLoop
from lightning_swarm.resume import SwarmCheckpointer
from lightning_swarm.resume.errors import RecordError
from lightning_swarm.resume.records import IslandLoops, OptionsRecord, SwarmRecord
from tests.helpers import QUIET
from tests.resume_utils import DumpFinal, StepDataModel, assert_bitwise_equal, load_ranks

BUDGET_S = 15.0
STEP_S = (5.0, 3.0)  # seconds per inner step, by island: 3 and 5 steps per round
MAX_STEPS = 20
EVERY = 10  # ModelCheckpoint(every_n_train_steps=EVERY)
SAVE_S = 1000.0  # seconds a save takes (``SlowIO``)


class FakeClock:
    """The budget's clock; only ``ClockedModel``'s inner steps move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


# -- the budget's clock around a save -------------------------------------------------------
def test_a_save_right_after_a_round_stores_the_budget_as_just_left() -> None:
    clock = FakeClock()
    budget = RoundBudget(2.0, clock=clock)
    budget.spent()
    clock.now += 2.0
    assert budget.spent()
    budget.restart(4)  # the island left a round after its step 4
    clock.now += 0.125  # Lightning's work between the round and the save
    budget.pause(4)
    clock.now += 30.0  # the save itself
    assert budget.state_dict() == {"elapsed_s": 0.0, "round_started_step": 4, "swarm_steps": None}
    budget.unpause()
    clock.now += 1.5
    assert budget.elapsed_s() == 1.5 and not budget.spent()


def test_a_save_mid_budget_keeps_what_was_spent_and_charges_not_the_save() -> None:
    clock = FakeClock()
    budget = RoundBudget(2.0, clock=clock)
    budget.spent()
    clock.now += 0.75
    budget.pause(2)  # two steps after it left the round at step 0: mid-budget
    clock.now += 30.0
    assert budget.state_dict()["elapsed_s"] == 0.75
    budget.unpause()
    clock.now += 0.25
    assert budget.elapsed_s() == 1.0


def test_a_budget_not_started_stays_so_through_a_save() -> None:
    clock = FakeClock()
    budget = RoundBudget(2.0, clock=clock)
    budget.pause(0)
    clock.now += 10.0
    budget.unpause()
    assert budget.elapsed_s() == 0.0
    clock.now += 10.0
    assert budget.elapsed_s() == 0.0  # still starts with the first step


def test_a_loaded_budget_runs_from_continue_now_until_its_first_step() -> None:
    clock = FakeClock()
    budget = RoundBudget(2.0, clock=clock)
    budget.load_state_dict({"elapsed_s": 0.5, "round_started_step": 7, "swarm_steps": 11})
    clock.now += 40.0  # the rest of the resume's setup
    budget.continue_now()
    clock.now += 1.0
    assert not budget.spent() and budget.elapsed_s() == 1.5
    budget.continue_now()  # a step was counted: no effect any more
    assert budget.elapsed_s() == 1.5


# -- ModelCheckpoint under a budget -----------------------------------------------------------
def _trainer(*checkpoints: ModelCheckpoint, default: bool = False) -> pl.Trainer:
    """A trainer with ``checkpoints``, or Lightning's default checkpoint (``default``)."""
    options = {**QUIET, "enable_checkpointing": bool(checkpoints) or default}
    return pl.Trainer(max_steps=10, callbacks=list(checkpoints), **options)


@pytest.mark.parametrize(
    ("trainer", "said"),
    [
        (lambda: _trainer(default=True), r"ModelCheckpoint\(every_n_epochs=1\)"),
        (
            lambda: _trainer(ModelCheckpoint(train_time_interval=timedelta(minutes=5))),
            r"ModelCheckpoint\(train_time_interval=0:05:00\)",
        ),
        (
            lambda: _trainer(ModelCheckpoint(every_n_epochs=2)),
            r"ModelCheckpoint\(every_n_epochs=2\)",
        ),
    ],
)
def test_a_checkpoint_on_epochs_or_a_clock_is_refused_naming_every_n_train_steps(
    trainer: Any, said: str
) -> None:
    with pytest.raises(SwarmConfigError) as info:
        check_round_saves(trainer(), 2.0)
    assert f"sync_every_s=2.0 cannot run {said.replace(chr(92), '')}" in str(info.value)
    assert "Pass ModelCheckpoint(every_n_train_steps=N) instead" in str(info.value)


def test_a_linked_last_checkpoint_is_refused() -> None:
    trainer = _trainer(ModelCheckpoint(every_n_train_steps=5, save_last="link"))
    with pytest.raises(SwarmConfigError, match=r"save_last='link'\): .*pass save_last=True"):
        check_round_saves(trainer, 2.0)


def test_round_saves_take_over_the_step_trigger_and_give_it_back() -> None:
    every5, every3 = ModelCheckpoint(every_n_train_steps=5), ModelCheckpoint(every_n_train_steps=3)
    last_only = ModelCheckpoint(every_n_train_steps=0, every_n_epochs=0, save_last=True)
    trainer = _trainer(every5, every3, last_only)
    saves = BudgetFit(trainer, 2.0)
    assert saves._checkpoints == [every5, every3]
    saves.install()
    assert every5._every_n_train_steps == 0 and every3._every_n_train_steps == 0
    callbacks = trainer.callbacks  # type: ignore[attr-defined]
    assert callbacks.index(saves) == callbacks.index(every5) - 1  # runs right before them
    due = []
    saves.start(2)  # a resumed fit: the swarm had taken 2 steps at its last round
    for swarm_steps in [4, 6, 9, 10, 16]:
        saves.after_round(swarm_steps)
        due.append(list(saves._due))
    assert due == [[every3], [every5, every3], [every3], [every5], [every5, every3]]
    saves.restore()
    saves.restore()  # idempotent
    assert every5._every_n_train_steps == 5 and every3._every_n_train_steps == 3
    assert saves not in callbacks


def test_the_lightning_private_names_round_saves_reads_still_exist() -> None:
    checkpoint = ModelCheckpoint(every_n_train_steps=4)
    for field in ("_every_n_train_steps", "_every_n_epochs", "_train_time_interval"):
        assert hasattr(checkpoint, field), field
    for method in (
        "_should_skip_saving_checkpoint",
        "_monitor_candidates",
        "_save_topk_checkpoint",
        "_save_last_checkpoint",
    ):
        assert callable(getattr(checkpoint, method)), method


# -- the record: every island's loop state ----------------------------------------------------
def _record(island_steps: list[int] | None) -> dict[str, Any]:
    loops = (
        None
        if island_steps is None
        else [
            # A stateful dataloader's state may have keys that are not text.
            IslandLoops(s, {"fit_loop": {"state_dict": {"combined_loader": [{0: s, "k": s}]}}})
            for s in island_steps
        ]
    )
    return SwarmRecord(
        save_id="abc",
        fingerprint={},
        anchor_dtype=None,
        outer_steps=[2],
        inner_steps=[7],
        files={},
        options=OptionsRecord(values=SwarmConfig().resume_options()),
        global_step=None if island_steps is None else island_steps[0],
        island_loops=loops,
    ).to_dict()


def test_each_island_takes_its_own_loop_state_from_the_record() -> None:
    record = _record([7, 11])
    assert SwarmRecord.from_dict(record, "r").island_loops == [
        IslandLoops.from_dict(x) for x in record["island_loops"]
    ]
    for island, step in enumerate([7, 11]):
        checkpoint = {"swarm": record, "global_step": 7, "loops": {"fit_loop": "island 0's"}}
        SwarmCheckpointer().capture("/c.ckpt", checkpoint, rank=0, island=island, own_pace=True)
        assert checkpoint["global_step"] == step
        assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0][0] == step


def test_a_record_of_islands_in_step_has_no_loops_and_changes_nothing() -> None:
    record = _record(None)
    assert "island_loops" not in record  # a fixed-sync_every record is as it was
    checkpoint = {"swarm": record, "loops": {"fit_loop": "shared"}}
    SwarmCheckpointer().capture("/c.ckpt", checkpoint, rank=0, island=1, own_pace=True)
    assert checkpoint["loops"] == {"fit_loop": "shared"}


def test_the_loop_states_are_sealed_by_the_record_checksum() -> None:
    record = _record([7, 11])
    record["island_loops"][1]["global_step"] = 12
    with pytest.raises(RecordError, match="was changed after it was written"):
        SwarmCheckpointer().capture("/c.ckpt", {"swarm": record}, rank=0, island=1, own_pace=True)


def test_islands_saved_apart_cannot_resume_in_step() -> None:
    checkpoint = {"swarm": _record([7, 11]), "global_step": 7}
    with pytest.raises(SwarmCheckpointError) as info:
        SwarmCheckpointer().capture("/c.ckpt", checkpoint, rank=0, island=0, own_pace=False)
    assert str(info.value) == (
        "/c.ckpt was saved with rounds on a time budget (sync_every_s), where each island keeps "
        "its own step count (global_step by island: [7, 11]), but this run syncs every "
        "sync_every steps, which needs every island at the same step. Resume with sync_every_s "
        "set (any budget), or from a checkpoint where the islands stood at one step."
    )
    # Islands that happen to stand at one step may switch to fixed rounds.
    checkpoint = {"swarm": _record([9, 9]), "global_step": 9}
    SwarmCheckpointer().capture("/c.ckpt", checkpoint, rank=0, island=1, own_pace=False)


@pytest.mark.parametrize(
    ("own_record", "step"),
    [
        (_record([5, 9]), 9),  # its own checkpoint kept one loop state per island: its own
        (_record(None), 11),  # saved with islands in step: the newest checkpoint's serves
        ("not a record", 11),  # unreadable here: the restore refuses it on every rank
    ],
)
def test_an_island_rejoining_from_its_own_checkpoint_keeps_its_own_loop_state(
    tmp_path: Path, own_record: Any, step: int
) -> None:
    own = tmp_path / "own.ckpt"
    torch.save({"swarm": own_record, "global_step": 5, "loops": {"island 0's": 5}}, own)
    checkpointer = SwarmCheckpointer()
    checkpointer.island_ckpt_paths = {1: own}
    checkpoint = {"swarm": _record([7, 11]), "global_step": 7}
    checkpointer.capture("/c.ckpt", checkpoint, rank=0, island=1, own_pace=True)
    assert checkpoint["global_step"] == step
    assert checkpoint["loops"]["fit_loop"]["state_dict"]["combined_loader"][0]["k"] == step


def test_an_island_the_record_has_no_loops_for_is_refused() -> None:
    checkpoint = {"swarm": _record([7, 11]), "global_step": 7}
    with pytest.raises(SwarmCheckpointError, match=r"loop state of 2 island\(s\), but this run's"):
        SwarmCheckpointer().capture("/c.ckpt", checkpoint, rank=0, island=2, own_pace=True)


# -- two islands over gloo: a fit saved after round 2 and resumed, against the whole fit --------
class Positions:
    """An endless stateful iterable (what Lightning restores through ``loops``): its state is
    how many batches it handed out; ``loaded`` is the position a resume gave it."""

    def __init__(self) -> None:
        self.position = 0
        self.loaded: int | None = None

    def __iter__(self) -> Any:
        while True:
            self.position += 1
            yield torch.zeros(1)

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = self.loaded = state["position"]


class ClockedModel(StepDataModel):
    """``StepDataModel`` (its batch drawn from the island's own step) whose inner steps take
    ``STEP_S[island]`` seconds on ``clock``."""

    def __init__(self, clock: FakeClock, island_size: int) -> None:
        super().__init__()
        self.clock = clock
        self.island_size = island_size
        self.data = Positions()

    def training_step(self, batch: Any, batch_idx: int) -> Tensor:
        self.clock.now += STEP_S[self.global_rank // self.island_size]
        return super().training_step(batch, batch_idx)

    def train_dataloader(self) -> Any:
        return self.data


class SlowIO(TorchCheckpointIO):
    """Writing the Lightning file (global rank 0) takes ``SAVE_S`` seconds on ``clock``: a
    budget that charged the save would give island 0 a shorter round after each save."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, **kw: Any) -> None:
        super().save_checkpoint(checkpoint, path, **kw)
        self.clock.now += SAVE_S


class DumpStart(pl.Callback):
    """Writes each rank's step count and loader position at the start of the fit."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        assert isinstance(pl_module, ClockedModel)
        self.out.mkdir(parents=True, exist_ok=True)
        start = {"global_step": trainer.global_step, "loaded": pl_module.data.loaded}
        torch.save(start, self.out / f"start{trainer.global_rank}.pt")


def _clocked_fit(
    out: Path,
    ckpt_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    island_size: int,
    ckpt_path: Path | None = None,
    *,
    every: int = EVERY,
    callbacks: tuple[pl.Callback, ...] = (),
) -> None:
    """Two islands of ``island_size`` ranks."""
    clock = FakeClock()
    # The forked ranks inherit the patched name and the model's clock (one object per rank).
    monkeypatch.setattr(strategy_module, "OuterLoop", functools.partial(OuterLoop, clock=clock))
    pl.seed_everything(0)
    checkpoint = ModelCheckpoint(
        dirpath=ckpt_dir, filename="{step}", every_n_train_steps=every, save_top_k=-1
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 * island_size,
        strategy=SwarmStrategy(sync_every_s=BUDGET_S, island_size=island_size, start_method="fork"),
        max_steps=MAX_STEPS,
        callbacks=[DumpFinal(out), DumpStart(out), *callbacks, checkpoint],
        plugins=[SlowIO(clock)],
        num_sanity_val_steps=0,
        **{**QUIET, "enable_checkpointing": True},
    )
    trainer.fit(ClockedModel(clock, island_size), ckpt_path=ckpt_path)


def _island_loops(ckpt: Path) -> list[dict[str, Any]]:
    return torch.load(ckpt, weights_only=True)["swarm"]["island_loops"]


@pytest.mark.parametrize("island_size", [1, 2])
def test_a_fit_on_a_budget_resumes_bitwise_with_islands_at_their_own_steps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, island_size: int
) -> None:
    world = 2 * island_size
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    _clocked_fit(whole / "out", whole / "ckpts", monkeypatch, island_size)
    # Saved after rounds 2 and 4 only, named by island 0's step count (global rank 0's).
    assert sorted(p.name for p in (whole / "ckpts").glob("*.ckpt")) == [
        "step=13.ckpt",
        "step=7.ckpt",
    ]
    saved = _island_loops(whole / "ckpts" / "step=7.ckpt")
    assert [loops["global_step"] for loops in saved] == [7, 11]
    positions = [s["loops"]["fit_loop"]["state_dict"]["combined_loader"][0] for s in saved]
    assert positions[0] != positions[1]

    # A fresh fit (new processes) from the save after round 2, to the end.
    ckpt = whole / "ckpts" / "step=7.ckpt"
    _clocked_fit(resumed / "out", resumed / "ckpts", monkeypatch, island_size, ckpt)
    a, b = load_ranks(whole / "out", world), load_ranks(resumed / "out", world)
    for rank in range(world):
        island = rank // island_size
        start = torch.load(resumed / "out" / f"start{rank}.pt")
        assert start == {"global_step": [7, 11][island], "loaded": positions[island]["position"]}
        assert f"at inner step(s) [{[7, 11][island]}]" in b[rank]["summary"]
        assert_bitwise_equal(a[rank], b[rank], f"rank {rank}")
        # The stopping rule held after the resume; every island ends on the round's model.
        assert b[rank]["global_step"] == [13, 20][island]
        for name, value in b[rank]["params"].items():
            assert torch.equal(value, b[0]["params"][name]), name
    # The resumed fit saved after round 4 too, with the same loop states as the whole fit.
    final = [_island_loops(run / "ckpts" / "step=13.ckpt") for run in (whole, resumed)]
    assert [s["global_step"] for s in final[1]] == [13, 20]
    assert [s["loops"]["fit_loop"]["epoch_loop.batch_progress"] for s in final[0]] == [
        s["loops"]["fit_loop"]["epoch_loop.batch_progress"] for s in final[1]
    ]

    # From the save after the last round: the stop count was reached, no step is taken.
    ended = tmp_path / "ended"
    _clocked_fit(
        ended / "out", ended / "ckpts", monkeypatch, island_size, ckpt.parent / "step=13.ckpt"
    )
    c = load_ranks(ended / "out", world)
    for rank in range(world):
        assert_bitwise_equal(a[rank], c[rank], f"rank {rank}, resumed at the end")
        assert c[rank]["global_step"] == [13, 20][rank // island_size]
    assert not list((ended / "ckpts").glob("*.ckpt"))


def test_an_island_rejoining_from_an_older_save_keeps_its_own_pace(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Island 1 from the save after round 2, island 0 from the one after round 3: each resumes
    at its own step, they agree on the swarm's count at the start (no island stops or saves
    alone), and they end on one model."""
    whole, rejoined = tmp_path / "whole", tmp_path / "rejoined"
    _clocked_fit(whole / "out", whole / "ckpts", monkeypatch, 1, every=5)  # after every round
    assert sorted(p.name for p in (whole / "ckpts").glob("*.ckpt")) == [
        "step=10.ckpt",
        "step=13.ckpt",
        "step=4.ckpt",
        "step=7.ckpt",
    ]
    older = SwarmResume(island_ckpt_paths={1: whole / "ckpts" / "step=7.ckpt"})
    newest = whole / "ckpts" / "step=10.ckpt"
    _clocked_fit(
        rejoined / "out", rejoined / "ckpts", monkeypatch, 1, newest, every=5, callbacks=(older,)
    )
    starts = [torch.load(rejoined / "out" / f"start{r}.pt")["global_step"] for r in range(2)]
    assert starts == [10, 11]  # island 1 at its own step in the older save
    ends = load_ranks(rejoined / "out", 2)
    assert "caught up optimizer(s) [0]" in ends[1]["summary"]
    for name, value in ends[0]["params"].items():
        assert torch.equal(value, ends[1]["params"][name]), name
