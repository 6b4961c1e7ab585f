"""Model-sharded islands (``island_parallel="fsdp"``): 2 islands x 2 FSDP2 ranks over gloo.

The same data, seeds and options run once with DDP islands and once with FSDP islands; the
outer round of the FSDP run works on each rank's local shards only. The model has an uneven
shard (5 rows over 2 ranks) and an empty one (1 row over 2 ranks: rank 1 holds none).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from lightning_swarm import SwarmStrategy
from lightning_swarm.config import SwarmConfig
from tests.fsdp_utils import (
    ForgetsToShard,
    NoConfigureModel,
    fit_islands,
    fit_module,
    fit_tensor_parallel,
    load,
    token_data,
)
from tests.helpers import regression_data

STEPS, SYNC_EVERY = 9, 3


@pytest.fixture(scope="module")
def ddp_and_fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, list]:
    root = tmp_path_factory.mktemp("fsdp_vs_ddp")
    common: dict[str, Any] = {"island_size": 2, "sync_every": SYNC_EVERY}
    fit_islands(root / "ddp", steps=STEPS, shard_outer=False, **common)
    fit_islands(root / "fsdp", steps=STEPS, island_parallel="fsdp", **common)
    return load(root / "ddp", 4), load(root / "fsdp", 4)


def test_fsdp_islands_match_ddp_islands(ddp_and_fsdp: tuple[list, list]) -> None:
    ddp, fsdp = ddp_and_fsdp
    for rank in range(4):
        assert fsdp[rank]["outer_steps"] == STEPS // SYNC_EVERY
        for name, want in ddp[rank]["full"].items():
            got = fsdp[rank]["full"][name]
            assert got.shape == want.shape, name
            torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=name)


def test_fsdp_shards_are_uneven_and_empty(ddp_and_fsdp: tuple[list, list]) -> None:
    _, fsdp = ddp_and_fsdp
    assert fsdp[0]["local"]["net.0.weight"].shape == (3, 8)
    assert fsdp[1]["local"]["net.0.weight"].shape == (2, 8)
    assert fsdp[0]["local"]["net.2.weight"].shape == (1, 5)
    assert fsdp[1]["local"]["net.2.weight"].shape == (0, 5)
    assert fsdp[1]["local"]["net.2.bias"].numel() == 0


def test_fsdp_anchors_and_outer_state_are_the_local_shards(
    ddp_and_fsdp: tuple[list, list],
) -> None:
    _, fsdp = ddp_and_fsdp
    for rank, info in enumerate(fsdp):
        shard_bytes = sum(t.numel() * t.element_size() for t in info["local"].values())
        assert info["anchor_bytes"] == shard_bytes, rank
        # Nesterov SGD keeps one momentum buffer per anchor: the shard's size again
        assert info["outer_state_bytes"] == shard_bytes, rank
        for name, anchor in info["anchors"].items():
            # sync_at_end: every island ends on the anchors, shard for shard
            assert torch.equal(anchor, info["local"][name]), (rank, name)
    full_bytes = sum(t.numel() * 4 for t in fsdp[0]["full"].values())
    assert fsdp[0]["anchor_bytes"] + fsdp[1]["anchor_bytes"] == full_bytes
    assert fsdp[0]["anchor_bytes"] != fsdp[1]["anchor_bytes"]  # uneven shards


def test_fsdp_bytes_sent_per_round_are_the_shard(ddp_and_fsdp: tuple[list, list]) -> None:
    ddp, fsdp = ddp_and_fsdp
    for rank, info in enumerate(fsdp):
        shard_bytes = sum(t.numel() * t.element_size() for t in info["local"].values())
        # a ring all-reduce between 2 islands sends the payload once
        assert info["rounds"] == [shard_bytes] * (STEPS // SYNC_EVERY), rank
    full_bytes = sum(t.numel() * 4 for t in ddp[0]["full"].values())
    assert ddp[0]["rounds"] == [full_bytes] * (STEPS // SYNC_EVERY)


@pytest.mark.parametrize(
    ("options", "names"),
    [
        ({"island_parallel": "zero"}, "island_parallel='zero'"),
        ({"tensor_parallel_size": 2, "island_size": 2}, "island_parallel='fsdp'"),
        ({"island_parallel": "fsdp", "tensor_parallel_size": 0}, "tensor_parallel_size"),
        (
            {"island_parallel": "fsdp", "island_size": 3, "tensor_parallel_size": 2},
            "tensor_parallel_size=2 does not divide island_size=3",
        ),
    ],
)
def test_refusals_name_the_option(options: dict, names: str) -> None:
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(".", r"\.")) as err:
        SwarmConfig(**options)
    assert "island_parallel" in str(err.value) or "tensor_parallel_size" in str(err.value)
    with pytest.raises(ValueError, match=names.replace("(", r"\(").replace(".", r"\.")):
        SwarmStrategy(**options)


def test_sharded_outer_state_is_off_under_fsdp() -> None:
    assert SwarmConfig(island_size=2).outer_sharded
    assert not SwarmConfig(island_size=2, island_parallel="fsdp").outer_sharded
    assert SwarmConfig(island_size=4, island_parallel="fsdp").data_parallel_size == 4


def test_swarm_fsdp_is_registered() -> None:
    from lightning.pytorch.strategies import StrategyRegistry

    strategy = StrategyRegistry.get("swarm_fsdp")
    assert isinstance(strategy, SwarmStrategy)
    assert strategy.config.island_parallel == "fsdp"


def test_demo_gpt_shards_and_matches_ddp_islands(tmp_path: Path) -> None:
    from lightning_swarm.demo.gpt import GPTLightningModule

    def gpt() -> GPTLightningModule:
        torch.manual_seed(0)
        return GPTLightningModule(block_size=8, n_layer=2, n_head=2, n_embd=16, warmup_steps=1)

    common = {"devices": 4, "island_size": 2, "sync_every": 2}
    fit_module(gpt(), token_data(), tmp_path / "ddp", shard_outer=False, **common)
    fit_module(gpt(), token_data(), tmp_path / "fsdp", island_parallel="fsdp", **common)
    ddp, fsdp = load(tmp_path / "ddp", 4), load(tmp_path / "fsdp", 4)
    for rank in range(4):
        assert fsdp[rank]["outer_steps"] == 2
        for name, want in ddp[rank]["full"].items():
            torch.testing.assert_close(fsdp[rank]["full"][name], want, rtol=0, atol=1e-6)
    # each rank's anchors are half the model (every GPT tensor has an even first dimension)
    full_bytes = sum(t.numel() * 4 for t in fsdp[0]["full"].values())
    assert fsdp[0]["anchor_bytes"] == fsdp[1]["anchor_bytes"] == full_bytes // 2


@pytest.mark.parametrize(
    ("module", "message"),
    [
        (NoConfigureModel, "requires the LightningModule to override configure_model"),
        (ForgetsToShard, "left 2 parameter\\(s\\) unsharded, e.g. \\['layer.weight'"),
    ],
)
def test_module_that_does_not_shard_is_refused(tmp_path: Path, module: type, message: str) -> None:
    with pytest.raises(Exception, match=message):
        fit_module(
            module(), regression_data(), tmp_path, devices=2, island_size=2, island_parallel="fsdp"
        )


@pytest.mark.parametrize(
    ("options", "atol"),
    [
        # each rank blocks its own shard for the int8 scales, so the codes differ from DDP's
        ({"quantize": "int8", "quantize_block_size": 4, "error_feedback": True}, 1e-3),
        ({"transport": "swarm"}, 1e-6),
        # a bound every island stays under: the island-wide norm is formed, nothing rejected
        ({"transport": "swarm", "swarm": {"max_norm": 100.0, "offload": False}}, 1e-6),
        # every island owns 1/n of each shard; the peer groups agree on one verdict per island
        ({"transport": "swarm", "swarm": {"aggregator": "sharded"}}, 1e-6),
        ({"transport": "swarm", "swarm": {"aggregator": "sharded", "max_norm": 100.0}}, 1e-6),
        ({"sync_every": 4, "num_fragments": 2, "sync_delay": 1, "merge_alpha": 0.5}, 1e-6),
    ],
    ids=[
        "int8_error_feedback",
        "swarm_transport",
        "swarm_max_norm",
        "swarm_sharded",
        "swarm_sharded_max_norm",
        "fragments_delay_alpha",
    ],
)
def test_fsdp_outer_features_on_shards(tmp_path: Path, options: dict, atol: float) -> None:
    common = {"island_size": 2, "sync_every": SYNC_EVERY, **options}
    fit_islands(tmp_path / "ddp", steps=STEPS, shard_outer=False, **common)
    fit_islands(tmp_path / "fsdp", steps=STEPS, island_parallel="fsdp", **common)
    ddp, fsdp = load(tmp_path / "ddp", 4), load(tmp_path / "fsdp", 4)
    for rank in range(4):
        assert fsdp[rank]["outer_steps"] == ddp[rank]["outer_steps"] >= 3
        for name, want in ddp[rank]["full"].items():
            torch.testing.assert_close(fsdp[rank]["full"][name], want, rtol=0, atol=atol)
        for name, anchor in fsdp[rank]["anchors"].items():  # every island ends on the anchors
            assert torch.equal(anchor, fsdp[rank]["local"][name]), (rank, name)
    if options.get("error_feedback"):
        # the residuals are per rank and shaped like its shards (the empty one included)
        for rank in range(4):
            residuals = fsdp[rank]["residuals"]
            assert set(residuals) == set(fsdp[rank]["local"])
            for name, residual in residuals.items():
                assert residual.shape == fsdp[rank]["local"][name].shape
            assert any(r.abs().sum() > 0 for r in residuals.values())


def test_tensor_parallel_islands_match_ddp_islands(tmp_path: Path) -> None:
    """2 islands x (1 dp x 2 tp) against 2 single-rank DDP islands: both tensor-parallel ranks
    of an island read the island's batch, so each island sees what a one-rank island sees."""
    common = {"sync_every": SYNC_EVERY}
    fit_tensor_parallel(tmp_path / "ddp", devices=2, island_size=1, **common)
    fit_tensor_parallel(
        tmp_path / "tp",
        devices=4,
        island_size=2,
        island_parallel="fsdp",
        tensor_parallel_size=2,
        **common,
    )
    ddp, tp = load(tmp_path / "ddp", 2), load(tmp_path / "tp", 4)
    for rank in range(4):
        island = rank // 2
        assert tp[rank]["outer_steps"] == STEPS // SYNC_EVERY
        for name, want in ddp[island]["full"].items():
            torch.testing.assert_close(tp[rank]["full"][name], want, rtol=0, atol=1e-6, msg=name)
    assert tp[1]["local"]["net.0.weight"].shape == (3, 8)  # column-wise: output rows
    assert tp[1]["local"]["net.2.weight"].shape == (1, 3)  # row-wise: input columns
    assert tp[1]["local"]["net.2.bias"].shape == (1,)  # replicated on both ranks
    for rank in range(4):
        shard_bytes = sum(t.numel() * t.element_size() for t in tp[rank]["local"].values())
        assert tp[rank]["anchor_bytes"] == shard_bytes
        assert tp[rank]["rounds"] == [shard_bytes] * (STEPS // SYNC_EVERY)


def test_gradient_clipping_uses_the_island_wide_norm(tmp_path: Path) -> None:
    """Lightning's ``gradient_clip_val`` on sharded gradients: the norm is the island's (the
    DTensor reduction runs over the island's mesh), so clipping matches DDP islands."""
    common: dict[str, Any] = {"island_size": 2, "sync_every": SYNC_EVERY}
    common["trainer_kw"] = {"gradient_clip_val": 0.05}
    fit_islands(tmp_path / "ddp", steps=STEPS, shard_outer=False, **common)
    fit_islands(tmp_path / "fsdp", steps=STEPS, island_parallel="fsdp", **common)
    fit_islands(
        tmp_path / "unclipped", steps=STEPS, island_parallel="fsdp", island_size=2, sync_every=3
    )
    ddp, fsdp = load(tmp_path / "ddp", 4), load(tmp_path / "fsdp", 4)
    unclipped = load(tmp_path / "unclipped", 4)
    for rank in range(4):
        for name, want in ddp[rank]["full"].items():
            torch.testing.assert_close(fsdp[rank]["full"][name], want, rtol=0, atol=1e-6)
    # the bound was active: without it the run ends elsewhere
    assert not torch.allclose(fsdp[0]["full"]["net.0.weight"], unclipped[0]["full"]["net.0.weight"])


def test_empty_init_builds_on_meta_and_materialises_shards(tmp_path: Path) -> None:
    """``trainer.init_module(empty_init=True)``, as with ModelParallelStrategy: the module is
    built on the meta device and each rank materialises only its shards after configure_model
    (``reset_parameters``); every island starts from island 0's shards and ends on the anchors."""
    import lightning.pytorch as pl

    from tests.fsdp_utils import DumpShards, ShardedRegressor
    from tests.helpers import QUIET

    pl.seed_everything(7)
    strategy = SwarmStrategy(
        island_size=2, island_parallel="fsdp", sync_every=SYNC_EVERY, start_method="fork"
    )
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=strategy,
        max_steps=STEPS,
        callbacks=[DumpShards(tmp_path)],
        **QUIET,
    )
    with trainer.init_module(empty_init=True):
        module = ShardedRegressor()
    assert module.net[0].weight.is_meta
    trainer.fit(module, regression_data())
    ranks = load(tmp_path, 4)
    for rank in range(4):
        assert ranks[rank]["outer_steps"] == STEPS // SYNC_EVERY
        for name, value in ranks[rank]["full"].items():
            assert torch.isfinite(value).all() and value.abs().sum() > 0, (rank, name)
            assert torch.equal(value, ranks[0]["full"][name]), (rank, name)


def test_an_uneven_tensor_parallel_split_is_refused_at_setup_naming_the_parameter(
    tmp_path: Path,
) -> None:
    import lightning.pytorch as pl

    from tests.fsdp_utils import UnevenTensorParallelModel
    from tests.helpers import QUIET

    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=SwarmStrategy(
            island_size=2, island_parallel="fsdp", tensor_parallel_size=2, start_method="fork"
        ),
        max_steps=2,
        **QUIET,
    )
    with pytest.raises(Exception) as caught:
        trainer.fit(UnevenTensorParallelModel())
    message = str(caught.value)
    assert "parameter 'net.0.weight' of shape (5, 6) is split along dim 0" in message, message
    assert "over tensor_parallel_size=2, which does not divide its 5" in message, message
