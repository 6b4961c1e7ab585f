"""Every bad constructor value gives a ValueError naming the option and the fix."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm import SwarmConfig, SwarmStrategy
from lightning_swarm.outer import OuterSync
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport import AllReduceTransport


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"sync_every": 0}, "sync_every must be a positive integer, got 0"),
        ({"sync_every": -3}, "sync_every must be a positive integer"),
        ({"sync_every": 2.5}, "sync_every must be a positive integer"),
        ({"sync_every": True}, "sync_every must be a positive integer"),
        ({"island_size": 0}, "island_size must be a positive integer.*1 makes every rank"),
        ({"transport": "carrier-pigeon"}, "transport='carrier-pigeon' is not known"),
        ({"anchor_device": "floppy"}, "anchor_device='floppy' is not a torch device"),
        ({"anchor_dtype": "int8"}, "anchor_dtype='int8' is not a supported dtype"),
        ({"anchor_dtype": torch.int8}, "anchor_dtype='int8' is not a supported dtype"),
        ({"bucket_mb": 0}, r"bucket_mb=0 is below the floor of 1 MiB.*use bucket_mb=32"),
        ({"bucket_mb": 1e-12}, r"bucket_mb=1e-12 is below the floor of 1 MiB"),
        ({"bucket_mb": float("inf")}, "bucket_mb must be a finite number of MiB, got inf"),
        ({"bucket_mb": "big"}, "bucket_mb must be a finite number of MiB"),
        ({"transport": "swarm", "swarm": {"chunk_mb": 1e-9}}, "swarm.chunk_mb=1e-09 is below"),
        ({"transport": "swarm", "swarm": {"spool_dir": 123}}, "swarm.spool_dir must be a"),
        ({"transport": "swarm", "swarm": {"island_weights": 5}}, "swarm.island_weights must be"),
        ({"sync_at_end": "yes"}, "sync_at_end must be true or false, got 'yes'; true"),
    ],
)
def test_bad_strategy_options(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SwarmStrategy(**kwargs)


def test_outer_optimizer_must_be_callable() -> None:
    with pytest.raises(ValueError, match="outer_optimizer must be a callable.*functools.partial"):
        SwarmStrategy(outer_optimizer=0.7)  # type: ignore[arg-type]


def test_process_group_is_reserved() -> None:
    with pytest.raises(ValueError, match="process_group cannot be passed.*island_size"):
        SwarmStrategy(process_group=object())


def test_outer_optimizer_must_return_optimizer() -> None:
    p = torch.nn.Parameter(torch.zeros(2))
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=4)
    with pytest.raises(TypeError, match="must return a torch.optim.Optimizer"):
        OuterSync(
            {"p": p},
            outer_optimizer=lambda params: "sgd",  # type: ignore[arg-type,return-value]
            transport=transport,
            sync_every=1,
        )


def test_island_size_must_divide_world() -> None:
    with pytest.raises(ValueError, match="island_size=3 does not divide the world size 4"):
        IslandTopology(world_size=4, island_size=3, global_rank=0)


def test_defaults_and_dtype_parsing() -> None:
    cfg = SwarmConfig()
    assert (cfg.sync_every, cfg.island_size, cfg.transport, cfg.anchor_device) == (
        100,
        1,
        "allreduce",
        "cpu",
    )
    assert cfg.anchor_torch_dtype is torch.float32
    assert SwarmStrategy(anchor_dtype=torch.bfloat16).config.anchor_torch_dtype is torch.bfloat16
    assert SwarmConfig(bucket_mb=1).bucket_numel == 2**18


def test_unknown_keyword_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"unknown option\(s\) \['sync_evry'\]"):
        SwarmStrategy(sync_evry=5)


def test_ddp_keywords_pass_through() -> None:
    strategy = SwarmStrategy(sync_every=5, find_unused_parameters=True, start_method="spawn")
    assert strategy._ddp_kwargs == {"find_unused_parameters": True}
    assert strategy._start_method == "spawn"


def test_topology_numbers() -> None:
    t = IslandTopology(world_size=6, island_size=2, global_rank=3)
    assert (t.num_islands, t.island_index, t.local_index) == (3, 1, 1)
    assert t.island_ranks(2) == [4, 5]
    assert t.peer_ranks(1) == [1, 3, 5]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine where torch finds no GPU")
def test_anchor_device_without_that_device_is_refused_by_name() -> None:
    # Before the check this surfaced after launch as torch's AssertionError, naming no option.
    for device in ("cuda", "cuda:1", torch.device("cuda")):
        with pytest.raises(
            ValueError,
            match=r"anchor_device='cuda(:1)?', but this torch build finds no cuda device.*"
            r"use anchor_device='cpu'",
        ):
            SwarmStrategy(anchor_device=device)


def test_sync_at_end_reaches_the_config() -> None:
    assert SwarmConfig().sync_at_end is True
    assert SwarmStrategy(sync_at_end=False).config.sync_at_end is False


def test_every_option_is_declared_once_on_swarm_config() -> None:
    """The strategy's keywords, the Hydra schema and the resume record derive from SwarmConfig."""
    from dataclasses import fields

    from lightning_swarm.cli.app import SwarmStrategyConf
    from lightning_swarm.config import RESUME_OPTIONS
    from lightning_swarm.resume.records import OptionsRecord

    names = [f.name for f in fields(SwarmConfig)]
    extras = {"_target_", "outer_optimizer", "start_method", "process_group_backend"}
    assert [f.name for f in fields(SwarmStrategyConf) if f.name not in extras] == names
    assert set(RESUME_OPTIONS) <= set(names)
    saved = {
        **SwarmConfig(sync_every=7).resume_options(),
        "outer_optimizer": ["SGD"],
        "outer_hyperparameters": [{"lr": 0.7}],
    }
    record = OptionsRecord.from_dict(saved)
    assert record["sync_every"] == 7 and set(record.values) == set(RESUME_OPTIONS)


def test_strategy_takes_a_config_and_any_field_by_name() -> None:
    from lightning_swarm.strategy import SwarmStrategy

    base = SwarmConfig(sync_every=8, num_fragments=2)
    strategy = SwarmStrategy(base, sync_every=4, anchor_dtype=torch.bfloat16)
    assert strategy.config.sync_every == 4 and strategy.config.num_fragments == 2
    assert strategy.config.anchor_dtype == "bfloat16"
    assert base.sync_every == 8  # the caller's config is not mutated
    # An override is validated with the rest: 3 inner steps cannot hold 2 fragments evenly.
    with pytest.raises(ValueError, match="sync_every"):
        SwarmStrategy(base, sync_every=3)
    with pytest.raises(TypeError, match=r"pass options by name, e.g. SwarmStrategy\(sync_every"):
        SwarmStrategy(100)  # type: ignore[arg-type]


def test_must_match_lists_derive_from_field_metadata() -> None:
    """The options a resume compares and the settings islands must share are the fields marked
    on ``SwarmConfig``: the same sets the hand-written lists held before, in declaration order."""
    from dataclasses import fields

    from lightning_swarm.config import ISLAND_SETTINGS, RESUME_OPTIONS, must_match
    from lightning_swarm.membership.round_header import swarm_settings

    resume_before = (
        "sync_every",
        "num_fragments",
        "fragment_layout",
        "sync_delay",
        "merge_alpha",
        "quantize",
        "quantize_block_size",
        "transport",
        "error_feedback",
        "anchor_dtype",
        "island_size",
    )
    islands_before = (
        "sync_every",
        "sync_every_s",
        "num_fragments",
        "fragment_layout",
        "sync_delay",
        "merge_alpha",
        "quantize",
        "quantize_block_size",
        "error_feedback",
        "anchor_dtype",
        "outer_momentum_warmup",
        "outer_momentum_cooldown",
    )
    names = [f.name for f in fields(SwarmConfig)]
    for derived, before in ((RESUME_OPTIONS, resume_before), (ISLAND_SETTINGS, islands_before)):
        assert sorted(derived) == sorted(before)
        assert list(derived) == [name for name in names if name in before]
    assert must_match("resume") == RESUME_OPTIONS and must_match("islands") == ISLAND_SETTINGS
    # The round header sends exactly these, beside the outer optimizer's class and settings.
    settings = swarm_settings(SwarmConfig(), torch.optim.SGD([torch.zeros(1)], lr=0.1))
    assert {k for k in settings if not k.startswith("outer_optimizer")} == set(islands_before)
