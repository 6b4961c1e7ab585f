"""Issue 22, item 6: parameters frozen at setup are left out of the outer loop.

A parameter with ``requires_grad=False`` cannot change while frozen, so by default
(``frozen_params="exclude"``) it gets no anchor and is never exchanged: anchors and bytes
shrink by exactly its size. Unfreezing it later is refused at that step, naming the fix
(``frozen_params="sync"``, which keeps the old behaviour; test_strategy.py covers it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.config import SwarmConfig
from lightning_swarm.transport import ring_allreduce_bytes
from tests.helpers import QUIET, ThawingRegressor, TinyRegressor, regression_data

FROZEN = "net.0.weight"  # 8 x 16 float32: 512 bytes


class FrozenFirstLayer(TinyRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.net[0].weight.requires_grad_(False)


class Figures(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy) and strategy.outer_loop is not None
        loop = strategy.outer_loop
        info = {
            "anchor_bytes": loop.anchor_bytes(),
            "bytes_sent": strategy.totals.bytes_sent,
            "outer_steps": strategy.totals.outer_steps,
            "anchored": sorted(n for o in loop.outer_syncs for n in o.anchors),
            "frozen": sorted(loop.frozen),
            "frozen_value": module.net[0].weight.detach().clone(),
        }
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def _fit(out: Path, **strategy_kw: Any) -> list[dict[str, Any]]:
    out.mkdir(parents=True)
    pl.seed_everything(3)
    module = FrozenFirstLayer()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(sync_every=2, start_method="fork", **strategy_kw),
        max_steps=6,
        callbacks=[Figures(out)],
        **QUIET,
    )
    trainer.fit(module, regression_data())
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


def test_frozen_parameters_get_no_anchor_and_cost_no_bytes(tmp_path: Path) -> None:
    kept = _fit(tmp_path / "sync", frozen_params="sync")[0]
    left_out = _fit(tmp_path / "exclude")[0]
    frozen_bytes = 8 * 16 * 4
    assert FROZEN in kept["anchored"] and FROZEN not in left_out["anchored"]
    assert left_out["frozen"] == [FROZEN]
    assert left_out["anchor_bytes"] == kept["anchor_bytes"] - frozen_bytes
    rounds = left_out["outer_steps"]
    assert rounds == kept["outer_steps"] == 3
    trained = kept["anchor_bytes"] - frozen_bytes
    assert left_out["bytes_sent"] == rounds * ring_allreduce_bytes(trained, 2)
    assert kept["bytes_sent"] == rounds * ring_allreduce_bytes(kept["anchor_bytes"], 2)
    # Left out, it still holds rank 0's value on every island (it never moved).
    assert torch.equal(left_out["frozen_value"], kept["frozen_value"])


def test_unfreezing_a_left_out_parameter_is_refused_with_the_fix(tmp_path: Path) -> None:
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=SwarmStrategy(sync_every=4, start_method="fork"),
        max_steps=4,
        **QUIET,
    )
    with pytest.raises(Exception, match=r"\['net.0.weight'\] were frozen .* frozen_params='sync'"):
        trainer.fit(ThawingRegressor(), regression_data())


def test_frozen_params_value_is_checked() -> None:
    with pytest.raises(ValueError, match="frozen_params='keep' is not known; use 'exclude'"):
        SwarmConfig(frozen_params="keep")
