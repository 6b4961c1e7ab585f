"""The combination suite's factors, its pairwise plan, and one short fit of two islands per row.

Every factor is an option (or a property of the user's module or run) that changes the outer
round. ``pairwise_plan`` picks rows so that every pair of levels of two factors that
``SwarmConfig`` accepts is in some row (greedy, deterministic). ``refused_pairs`` tries every
pair of option levels on ``SwarmConfig`` alone and returns the message of each it refuses: the
table in docs/options.md is generated from it (``tests/test_options_doc.py``).

``run_row`` trains a row with the fork launcher: two islands (of one rank, or of two with
``island_size``), the budget's clock (``sync_every_s``) advanced only by inner steps, island 0's
steps taking 0.25 s and island 1's 0.5 s of a 1 s budget, so that a row runs the same way every
time. With the ``checkpoint`` factor, the row saves mid-run and a second fit resumes from it.
"""

from __future__ import annotations

import functools
import itertools
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import Tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader, TensorDataset

import lightning_swarm.strategy as strategy_module
from lightning_swarm import SwarmStrategy
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.outer import OuterLoop
from tests.helpers import QUIET

# factor -> level -> SwarmStrategy keywords (the module and run factors are read by name).
Level = dict[str, Any]
FACTORS: dict[str, dict[str, Level]] = {
    "sync_every_s": {"unset": {}, "1.0": {"sync_every_s": 1.0}},
    "merge_alpha": {"0": {}, "0.5": {"merge_alpha": 0.5}},
    "num_fragments": {"1": {}, "2": {"num_fragments": 2}},
    "sync_delay": {"0": {}, "1": {"sync_delay": 1}},
    "quantize": {
        "none": {},
        "int8": {"quantize": "int8"},
        "int8+error_feedback": {"quantize": "int8", "error_feedback": True},
    },
    "transport": {
        "allreduce": {},
        "swarm/rotating": {"transport": "swarm", "swarm": {"aggregator": "rotating"}},
        "swarm/sharded": {"transport": "swarm", "swarm": {"aggregator": "sharded"}},
    },
    "island_size": {"1": {}, "2+shard_outer": {"island_size": 2, "shard_outer": True}},
    "island_parallel": {"ddp": {}, "fsdp": {"island_parallel": "fsdp"}},
    "anchor_dtype": {"float32": {}, "bfloat16": {"anchor_dtype": "bfloat16"}},
    "frozen_params": {
        "none": {},
        "exclude": {"frozen_params": "exclude"},
        "sync": {"frozen_params": "sync"},
    },
    "warm_start_steps": {"0": {}, "8": {"warm_start_steps": 8}},
    "optimization": {"automatic": {}, "manual": {}, "manual, two optimizers": {}},
    "checkpoint": {"none": {}, "save and resume": {}},
}
# Factors that are not SwarmConfig options: the module's or the run's.
RUN_FACTORS = ("optimization", "checkpoint")
Row = dict[str, str]
Pair = tuple[tuple[str, str], tuple[str, str]]


def options_of(row: Row) -> Level:
    """The SwarmStrategy keywords of ``row`` (factors it leaves out keep their defaults)."""
    out: Level = {}
    for factor, level in row.items():
        out.update(FACTORS[factor][level])
    return out


# Pairs with a module or run factor that no option can see at construction: the strategy
# refuses them at setup, before the first step, with a message naming both (the words here).
SETUP_REFUSALS: dict[Pair, tuple[str, str]] = {
    (("sync_every_s", "1.0"), ("optimization", "manual, two optimizers")): (
        "sync_every_s",
        "2 optimizers",
    ),
}


def refusal(row: Row) -> str | None:
    """Why ``row`` is refused (``SwarmConfig``'s message, or a setup refusal's words), else
    None."""
    for pair, words in SETUP_REFUSALS.items():
        if all(row.get(factor) == level for factor, level in pair):
            return f"refused at setup: {' and '.join(words)}"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            SwarmConfig(**options_of(row))
        except SwarmConfigError as err:
            return str(err)
    return None


def _pairs() -> Iterator[Pair]:
    for (fa, la), (fb, lb) in itertools.combinations(FACTORS.items(), 2):
        for a, b in itertools.product(la, lb):
            yield (fa, a), (fb, b)


def refused_pairs() -> list[tuple[Pair, str]]:
    """Every pair of option levels that ``SwarmConfig`` refuses on its own, with the message."""
    out = []
    for pair in _pairs():
        message = refusal(dict(pair))
        if message is not None and pair not in SETUP_REFUSALS:
            out.append((pair, message))
    return out


def pairwise_plan() -> list[Row]:
    """Rows (a level for every factor) covering every accepted pair at least once."""
    uncovered = {pair for pair in _pairs() if refusal(dict(pair)) is None}
    rows: list[Row] = []
    while uncovered:
        # Seed the row with the first uncovered pair, then fill each factor greedily.
        (fa, a), (fb, b) = min(uncovered)
        row: Row = {fa: a, fb: b}
        for factor, levels in FACTORS.items():
            if factor in row:
                continue
            best, gain = None, -1
            for level in levels:
                trial = {**row, factor: level}
                if refusal(trial) is not None:
                    continue
                new = sum(
                    1
                    for f, lv in row.items()
                    if ((f, lv), (factor, level)) in uncovered
                    or ((factor, level), (f, lv)) in uncovered
                )
                if new > gain:
                    best, gain = level, new
            assert best is not None, f"no level of {factor} fits {row}"
            row[factor] = best
        ordered = {f: row[f] for f in FACTORS}
        uncovered -= {
            pair for pair in itertools.combinations(ordered.items(), 2) if pair in uncovered
        }
        rows.append(ordered)
    return rows


def row_id(row: Row) -> str:
    """The levels that differ from each factor's first, for test ids."""
    changed = [f"{f}={v}" for f, v in row.items() if v != next(iter(FACTORS[f]))]
    return ",".join(changed) or "defaults"


# -- one row as a fit --------------------------------------------------------------------------
BUDGET_S = 1.0
STEP_S = (0.25, 0.5)  # seconds per inner step on the budget's clock, by island
SYNC_EVERY = 4
MAX_STEPS = 12
SAVE_EVERY = 6


class FakeClock:
    """The budget's clock; only ``ComboModel``'s inner steps move it."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ComboModel(pl.LightningModule):
    """Step-seeded data (no loader position to restore), Adam, and the row's module factors:
    manual optimization, a second optimizer, a frozen parameter, FSDP2 in ``configure_model``."""

    def __init__(self, row: Row, clock: FakeClock, island_size: int) -> None:
        super().__init__()
        self.row, self.clock, self.island_size = row, clock, island_size
        self.a1, self.a2 = torch.nn.Linear(6, 8), torch.nn.Linear(8, 8)
        self.b1, self.b2 = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        self.frozen = torch.nn.Linear(2, 2)
        self.frozen.requires_grad_(row["frozen_params"] == "none")
        self.automatic_optimization = row["optimization"] == "automatic"

    def configure_model(self) -> None:
        if self.device_mesh is None:
            return
        dp = self.device_mesh["data_parallel"]
        for layer in (self.a1, self.a2, self.b1, self.b2, self.frozen):
            fully_shard(layer, mesh=dp)

    def _loss(self) -> Tensor:
        self.clock.now += STEP_S[self.global_rank // self.island_size]
        g = torch.Generator().manual_seed(1000 * self.trainer.global_step + self.global_rank)
        x = torch.randn(16, 6, generator=g)
        y = torch.stack([x[:, :3].sum(1), x[:, 3:].prod(1)], dim=1)
        hidden = torch.tanh(self.a2(torch.tanh(self.a1(x))))
        return torch.nn.functional.mse_loss(self.frozen(self.b2(torch.tanh(self.b1(hidden)))), y)

    def training_step(self, batch: Any, batch_idx: int) -> Tensor | None:
        loss = self._loss()
        if self.automatic_optimization:
            return loss
        optimizers = self.optimizers()
        optimizers = optimizers if isinstance(optimizers, list) else [optimizers]
        for opt in optimizers:
            opt.zero_grad()
        self.manual_backward(loss)
        for opt in optimizers:
            opt.step()
        return None

    def configure_optimizers(self) -> Any:
        trained = [p for p in self.parameters() if p.requires_grad]
        if self.row["optimization"] != "manual, two optimizers":
            return torch.optim.Adam(trained, lr=0.02)
        # Two layers each, so that each optimizer's parameters split into two fragments.
        first = [*self.a1.parameters(), *self.a2.parameters()]
        rest = [p for p in trained if all(p is not q for q in first)]
        return [torch.optim.Adam(first, lr=0.02), torch.optim.Adam(rest, lr=0.01)]

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(4096, 1)), batch_size=1)


def _local(value: Tensor) -> Tensor:
    return (value.to_local() if isinstance(value, DTensor) else value).detach().clone()


class DumpEnd(pl.Callback):
    """Every rank writes its local parameters, anchors, counters and inner optimizer state."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        info = {
            "params": {k: _local(v) for k, v in pl_module.state_dict().items()},
            "anchors": [{k: v.clone() for k, v in o.anchors.items()} for o in strategy.outer_syncs],
            "inner_steps": [o.inner_steps for o in strategy.outer_syncs],
            "outer_steps": [o.outer_steps for o in strategy.outer_syncs],
            "optimizers": [
                {i: {k: _local(torch.as_tensor(v)) for k, v in s.items()} for i, s in o.items()}
                for o in (opt.state_dict()["state"] for opt in trainer.optimizers)
            ],
            "island": strategy.topology.island_index,
            "position": strategy.topology.local_index,
        }
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def fit_row(
    row: Row, out: Path, ckpt_dir: Path, monkeypatch: pytest.MonkeyPatch, ckpt: Path | None
) -> None:
    """One fit of ``row`` (fork launcher); each rank dumps its end state under ``out``."""
    clock = FakeClock()
    # The forked ranks inherit the patched name and the model's clock (one object per rank).
    monkeypatch.setattr(strategy_module, "OuterLoop", functools.partial(OuterLoop, clock=clock))
    pl.seed_everything(0)
    options = options_of(row)
    island_size = int(options.get("island_size", 1))
    callbacks: list[pl.Callback] = [DumpEnd(out)]
    if row["checkpoint"] != "none":
        callbacks.append(
            ModelCheckpoint(
                dirpath=ckpt_dir, filename="{step}", every_n_train_steps=SAVE_EVERY, save_top_k=-1
            )
        )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2 * island_size,
        strategy=SwarmStrategy(sync_every=SYNC_EVERY, start_method="fork", **options),
        max_steps=MAX_STEPS,
        callbacks=callbacks,
        num_sanity_val_steps=0,
        **{**QUIET, "enable_checkpointing": row["checkpoint"] != "none"},
    )
    trainer.fit(ComboModel(row, clock, island_size), ckpt_path=ckpt)


def load_dumps(out: Path) -> list[dict[str, Any]]:
    return [torch.load(p, weights_only=True) for p in sorted(out.glob("rank*.pt"))]
