"""Pipeline-stage islands: 2 islands x 2 stages train as 2 islands of the whole model do.

``StagedModel`` (``tests/pipeline_utils.py``) runs with and without stages unchanged; every
case compares the islands' full parameters (each island's stages joined) with the pp=1 run of
the same options, in fp32.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.pipeline import keep_stage, stage_blocks
from tests.pipeline_utils import NUM_BLOCKS, StagedModel, fit_staged, island_params
from tests.resume_utils import swarm_dir

STEPS = 9
STAGES = {"island_size": 2, "pipeline_parallel_size": 2, "pipeline_microbatches": 2}
TOL = {"rtol": 0, "atol": 1e-5}


def _compare(
    tmp_path: Path, options: dict[str, Any], trainer_kw: dict | None = None, atol: float = 1e-5
) -> list:
    fit_staged(tmp_path / "pp1", devices=2, max_steps=STEPS, trainer_kw=trainer_kw, **options)
    fit_staged(
        tmp_path / "pp2", devices=4, max_steps=STEPS, trainer_kw=trainer_kw, **STAGES, **options
    )
    whole, staged = island_params(tmp_path / "pp1", 2), island_params(tmp_path / "pp2", 4)
    for island, params in whole.items():
        assert sorted(params) == sorted(staged[island])
        for name, value in params.items():
            torch.testing.assert_close(staged[island][name], value, rtol=0, atol=atol, msg=name)
    return [torch.load(tmp_path / "pp2" / f"rank{r}.pt", weights_only=False) for r in range(4)]


@pytest.mark.parametrize("schedule", ["1f1b", pytest.param("gpipe", marks=pytest.mark.slow)])
def test_two_stages_end_where_the_whole_model_ends(tmp_path: Path, schedule: str) -> None:
    ranks = _compare(tmp_path, {"pipeline_schedule": schedule})
    assert [r["stage"] for r in ranks] == [0, 1, 0, 1]  # positions are (stage, dp, tp)
    # The logged loss is the last stage's, on every rank of the island.
    assert ranks[0]["losses"] == ranks[1]["losses"] and ranks[2]["losses"] == ranks[3]["losses"]
    pp1 = torch.load(tmp_path / "pp1" / "rank0.pt", weights_only=False)
    torch.testing.assert_close(torch.tensor(ranks[0]["losses"]), torch.tensor(pp1["losses"]))
    # Each rank holds, and sends, its stage's share only.
    for rank in ranks:
        assert 0 < rank["anchor_bytes"] < pp1["anchor_bytes"]
        assert 0 < rank["bytes_sent"] < pp1["bytes_sent"]
    assert ranks[0]["anchor_bytes"] + ranks[1]["anchor_bytes"] == pp1["anchor_bytes"]


@pytest.mark.parametrize(
    "options",
    [
        pytest.param({"sync_every": 6, "num_fragments": 3, "sync_delay": 1}, id="fragments_delay"),
        pytest.param({"transport": "swarm"}, id="swarm", marks=pytest.mark.slow),
        pytest.param(
            {"quantize": "int8", "error_feedback": True}, id="int8_feedback", marks=pytest.mark.slow
        ),
    ],
)
def test_options_work_with_stages(tmp_path: Path, options: dict[str, Any]) -> None:
    # int8 blocks start at each rank's first element: a stage's differ from the whole model's.
    _compare(tmp_path, options, atol=1e-3 if "quantize" in options else 1e-5)


@pytest.mark.parametrize("inside", ["ddp", pytest.param("fsdp", marks=pytest.mark.slow)])
def test_data_parallel_inside_each_stage(tmp_path: Path, inside: str) -> None:
    """2 islands x (2 stages x 2 data-parallel ranks): DDP (plain gradients averaged by the
    strategy) or FSDP2 inside each stage."""
    fit_staged(tmp_path / "pp1", devices=2, max_steps=STEPS)
    options = {**STAGES, "island_size": 4, "island_parallel": inside}
    fit_staged(tmp_path / "pp2", devices=8, max_steps=STEPS, **options)
    whole, staged = island_params(tmp_path / "pp1", 2), island_params(tmp_path / "pp2", 8)
    for island, params in whole.items():
        for name, value in params.items():
            torch.testing.assert_close(staged[island][name], value, **TOL, msg=name)


def test_gradient_clipping_takes_the_norm_over_every_stage(tmp_path: Path) -> None:
    # A bound below the gradients' norm: each stage alone would clip by its own norm.
    _compare(tmp_path, {}, trainer_kw={"gradient_clip_val": 0.05})


def test_resume_mid_round_is_bitwise_and_moves_to_one_stage(tmp_path: Path) -> None:
    fit_staged(tmp_path / "full", devices=4, max_steps=STEPS, ckpt_dir=tmp_path / "ck", **STAGES)
    ckpt = tmp_path / "ck" / "step=4.ckpt"  # between the rounds of steps 3 and 6
    names = sorted(p.name for p in swarm_dir(ckpt).iterdir())
    assert "anchors-rank-00001.pt" in names and "island-00001-rank-00001.pt" in names
    fit_staged(tmp_path / "resumed", devices=4, max_steps=STEPS, ckpt_path=ckpt, **STAGES)
    full, resumed = island_params(tmp_path / "full", 4), island_params(tmp_path / "resumed", 4)
    for island, params in full.items():
        for name, value in params.items():
            assert torch.equal(resumed[island][name], value), f"island {island}: {name}"
    # The same checkpoint resumed as islands of the whole model: resharded by the layout.
    fit_staged(tmp_path / "moved", devices=2, max_steps=STEPS, ckpt_path=ckpt)
    moved = island_params(tmp_path / "moved", 2)
    for island, params in full.items():
        for name, value in params.items():
            torch.testing.assert_close(moved[island][name], value, **TOL)


def test_the_global_model_is_joined_from_the_stages(tmp_path: Path) -> None:
    from lightning_swarm import load_global_state_dict

    fit_staged(tmp_path / "full", devices=4, max_steps=6, ckpt_dir=tmp_path / "ck", **STAGES)
    state = load_global_state_dict(tmp_path / "ck" / "step=6.ckpt")
    anchors: dict[str, torch.Tensor] = {}
    for rank in range(2):  # island 0's two stages
        anchors |= torch.load(tmp_path / "full" / f"rank{rank}.pt", weights_only=False)["anchors"]
    assert sorted(state) == sorted(anchors) == sorted(StagedModel().state_dict())
    for name, value in anchors.items():
        assert torch.equal(state[name], value), name


# -- bad input --------------------------------------------------------------------------------
def test_refusals_at_construction_name_the_fix() -> None:
    with pytest.raises(SwarmConfigError, match="does not divide island_size=2"):
        SwarmStrategy(island_size=2, pipeline_parallel_size=3)
    with pytest.raises(SwarmConfigError, match="at least as many micro-batches as stages"):
        SwarmStrategy(island_size=4, pipeline_parallel_size=4, pipeline_microbatches=2)
    with pytest.raises(SwarmConfigError, match="pipeline_schedule='interleaved' is not known"):
        SwarmStrategy(island_size=2, pipeline_parallel_size=2, pipeline_schedule="interleaved")
    with pytest.raises(SwarmConfigError, match="sync_every_s"):
        SwarmStrategy(island_size=2, pipeline_parallel_size=2, sync_every_s=1.0)
    with pytest.raises(SwarmConfigError, match="warm_start_steps=5 cannot be combined with pipe"):
        SwarmStrategy(island_size=2, pipeline_parallel_size=2, warm_start_steps=5)


def test_more_stages_than_blocks_is_refused() -> None:
    assert stage_blocks(5, 2) == [range(0, 3), range(3, 5)]
    with pytest.raises(SwarmConfigError, match="every stage needs at least one block"):
        stage_blocks(NUM_BLOCKS, NUM_BLOCKS + 1)
    with pytest.raises(SwarmConfigError, match="not a ModuleList, Sequential or ModuleDict"):
        keep_stage(StagedModel(), None, blocks="head")


class IgnoresTheMesh(StagedModel):
    def configure_model(self) -> None:
        pass


def test_a_module_that_ignores_the_stages_is_refused(tmp_path: Path) -> None:
    import lightning.pytorch as pl

    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=SwarmStrategy(start_method="fork", **STAGES),
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with pytest.raises(Exception, match="configure_model ignored the mesh's pipeline_parallel"):
        trainer.fit(IgnoresTheMesh())


def test_gradient_accumulation_is_refused_with_stages(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="accumulate_grad_batches=2"):
        fit_staged(
            tmp_path, devices=4, max_steps=2, trainer_kw={"accumulate_grad_batches": 2}, **STAGES
        )


def test_the_census_names_each_rank_stage() -> None:
    from lightning_swarm.callbacks.census import _summary_line

    line = _summary_line(3, {"swarm/pipeline_stage": 1.0, "summary/num_samples": 2.0})
    assert line.startswith("census rank 3 (stage 1): peak RSS")


# -- the main job's CLI ----------------------------------------------------------------------
def _compose(tmp_path: Path, overrides: list[str]) -> Any:
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import open_dict

    from lightning_swarm.cli.app import CONF_DIR

    with hydra.initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        paths = [f"hydra.runtime.output_dir={tmp_path}"]
        cfg = hydra.compose("train", overrides=[*paths, *overrides], return_hydra_config=True)
        HydraConfig.instance().set_config(cfg)
        with open_dict(cfg):
            del cfg["hydra"]
        return cfg


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["model.n_layer=1"], r"pipeline_parallel_size=2 stages for model.n_layer=1 blocks"),
        (["data.batch_size=5"], r"data.batch_size=5 does not split into .*=2 micro-batches"),
        (["+trainer.accumulate_grad_batches=2"], r"accumulate_grad_batches=2"),
        (["strategy.pipeline_parallel_size=3"], r"does not divide island_size=2"),
    ],
)
def test_the_cli_refuses_a_bad_pipeline_before_launch(
    tmp_path: Path, overrides: list[str], message: str
) -> None:
    from lightning_swarm.cli.app import build

    base = ["trainer.devices=4", "strategy.island_size=2", "strategy.pipeline_parallel_size=2"]
    cfg = _compose(tmp_path, [*base, *overrides])
    with pytest.raises(Exception, match=message):
        build(cfg)


def _final(run_dir: Path) -> tuple[float, int]:
    """The run's last logged val_loss (full precision, from its CSV log) and bytes per rank."""
    import csv

    (metrics,) = run_dir.glob("logs/version_*/metrics.csv")
    rows = [r for r in csv.DictReader(metrics.open()) if r.get("val_loss")]
    summary = (run_dir / "stdout.txt").read_text()
    sent = next(line for line in summary.splitlines() if "bytes sent across islands" in line)
    return float(rows[-1]["val_loss"]), int(sent.split()[-1].replace(",", ""))


@pytest.mark.slow
def test_demo_gpt_with_two_stages_matches_one_from_the_cli(tmp_path: Path) -> None:
    """The main job with strategy.pipeline_parallel_size=2 (2 islands x 2 stages) ends at the
    validation loss of its run without stages after 100 steps, each rank sending its stage's
    share (about 3 minutes here: -m slow)."""
    from tests.cli_utils import swarm_train

    common = [
        "trainer.max_steps=100",
        "trainer.val_check_interval=100",
        "trainer.limit_val_batches=4",
        "trainer.enable_progress_bar=false",
        "model.n_layer=2",
        "data.max_bytes=300000",
        "logger=csv",
    ]
    runs = {
        "pp1": [*common, "trainer.devices=2"],
        "pp2": [
            *common,
            "trainer.devices=4",
            "strategy.island_size=2",
            "strategy.pipeline_parallel_size=2",
        ],
    }
    for name, overrides in runs.items():
        done = swarm_train(tmp_path / name, *overrides)
        assert done.returncode == 0, done.stderr[-3000:]
        (tmp_path / name / "stdout.txt").write_text(done.stdout)
    (whole, whole_sent), (staged, staged_sent) = _final(tmp_path / "pp1"), _final(tmp_path / "pp2")
    assert abs(whole - staged) < 1e-5, (whole, staged)
    assert staged_sent < 0.75 * whole_sent
