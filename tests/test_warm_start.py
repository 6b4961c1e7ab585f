"""The warm start (``warm_start_steps``): DDP over all ranks for its steps, then rounds from
equal anchors; exact resume across a save inside it; the options it refuses, by name."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import DDPStrategy

from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.warm_start import _buckets
from tests.resume_utils import StepDataModel, assert_bitwise_equal, fit, load_ranks

WARM = 4
MAX_STEPS = 8


class _DumpParams(pl.Callback):
    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        params = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        torch.save(params, self.out / f"rank{trainer.global_rank}.pt")


def _ddp_fit(out: Path, *, devices: int, max_steps: int) -> None:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=DDPStrategy(start_method="fork", process_group_backend="gloo"),
        max_steps=max_steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        callbacks=[_DumpParams(out)],
    )
    trainer.fit(StepDataModel())


@pytest.fixture(scope="module")
def warm_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """2 islands of 1 rank, a warm start of 4 steps then rounds every 3, a save every step."""
    root = tmp_path_factory.mktemp("warm")
    fit(
        root / "out",
        devices=2,
        island_size=1,
        max_steps=MAX_STEPS,
        ckpt_dir=root / "ckpts",
        warm_start_steps=WARM,
    )
    return root


def test_warm_start_steps_equal_ddp_over_all_ranks(tmp_path: Path) -> None:
    fit(tmp_path / "warm", devices=2, island_size=1, max_steps=WARM, warm_start_steps=WARM)
    _ddp_fit(tmp_path / "ddp", devices=2, max_steps=WARM)
    warm = load_ranks(tmp_path / "warm", 2)
    ddp = [torch.load(tmp_path / "ddp" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    start = warm[0]["start_params"]
    for rank in range(2):
        for name, value in ddp[rank].items():
            assert not torch.equal(value, start[name]), f"{name} never trained"
            torch.testing.assert_close(warm[rank]["params"][name], value, rtol=1e-5, atol=1e-6)
    # No round ran, and the anchors start from the weights the warm start ended on.
    for rank in range(2):
        assert warm[rank]["outer_steps"] == [0] and warm[rank]["inner_steps"] == [0]
        for name, anchor in warm[rank]["anchors"][0].items():
            assert torch.equal(anchor, warm[rank]["params"][name])


def test_rounds_start_after_the_warm_start(warm_run: Path) -> None:
    ranks = load_ranks(warm_run / "out", 2)
    # Steps 5..8 are local: one round at step 4 + 3, one at the end (step 8).
    assert [r["outer_steps"] for r in ranks] == [[2], [2]]
    assert [r["inner_steps"] for r in ranks] == [[MAX_STEPS - WARM]] * 2
    for name, value in ranks[0]["params"].items():
        assert torch.equal(value, ranks[1]["params"][name])


@pytest.mark.parametrize("step", [2, WARM, WARM + 1])
def test_exact_resume_inside_and_after_the_warm_start(
    warm_run: Path, tmp_path: Path, step: int
) -> None:
    fit(
        tmp_path / "resumed",
        devices=2,
        island_size=1,
        max_steps=MAX_STEPS,
        ckpt_path=warm_run / "ckpts" / f"step={step}.ckpt",
        warm_start_steps=WARM,
    )
    full, resumed = load_ranks(warm_run / "out", 2), load_ranks(tmp_path / "resumed", 2)
    for rank in range(2):
        assert_bitwise_equal(full[rank], resumed[rank], f"resume at step {step}, rank {rank}")


@pytest.mark.parametrize(
    ("other", "named"),
    [
        ({"membership": "torchft", "lighthouse": "localhost:1"}, "membership='torchft'"),
        ({"sync_every_s": 5.0}, "sync_every_s=5.0"),
        ({"island_parallel": "fsdp"}, "island_parallel='fsdp'"),
    ],
)
def test_refused_combinations_name_both_options(other: dict[str, Any], named: str) -> None:
    with pytest.raises(SwarmConfigError) as err:
        SwarmConfig(warm_start_steps=10, **other)
    assert "warm_start_steps=10 cannot be combined with " + named in str(err.value)
    assert "warm_start_steps=0" in str(err.value)


@pytest.mark.parametrize("value", [-1, 2.5, True, "10"])
def test_bad_warm_start_steps_is_refused_with_an_example(value: object) -> None:
    with pytest.raises(SwarmConfigError, match=r"whole number of optimizer steps >= 0, e\.g\."):
        SwarmConfig(warm_start_steps=value)  # type: ignore[arg-type]


def test_buckets_keep_order_and_bound_elements() -> None:
    sizes = [3, 4, 10, 1, 1]
    params = [torch.zeros(n) for n in sizes]
    buckets = _buckets(params, 7)
    assert [[p.numel() for p in b] for b in buckets] == [[3, 4], [10], [1, 1]]
