"""The sharded outer loop (``shard_outer``): 2 islands x 2 ranks over gloo, against unsharded.

The outer loop is driven directly over real process groups: each island's "inner step" adds a
deterministic, island-dependent change to every parameter (identical on the island's ranks, as
DDP would leave them), then the loop counts the step. The same run is done unsharded and
sharded on every rank; parameters and every owned anchor must agree bitwise.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from lightning_swarm.algorithm.outer_optimizer import merge_by_name, select_by_name
from lightning_swarm.config import SwarmConfig
from lightning_swarm.outer import OuterLoop
from lightning_swarm.outer.loop import transport_for
from lightning_swarm.outer.shard import IslandShard, partition_by_bytes
from lightning_swarm.topology import IslandTopology
from lightning_swarm.transport.groups import build_groups
from tests.dist_utils import run_ranks

SHAPES = {"a": (6, 5), "b": (30,), "c": (3, 10), "d": (5, 6)}  # equal sizes: shares balance


def _model() -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(0)
    return {n: torch.nn.Parameter(torch.randn(s, generator=g)) for n, s in SHAPES.items()}


class _Rank:
    """One rank of 2 islands x 2 ranks: its groups, the model and an ``OuterLoop`` over them."""

    def __init__(self, rank: int, config: SwarmConfig) -> None:
        self.topology = IslandTopology(world_size=4, island_size=2, global_rank=rank)
        self.groups = build_groups(self.topology, dedicated_peers=config.sync_delay > 0)
        self.params = _model()
        self.optimizer = torch.optim.SGD(list(self.params.values()), lr=0.1)
        self.loop = OuterLoop(
            [self.optimizer],
            {id(p): n for n, p in self.params.items()},
            config=config,
            transport=transport_for(
                config,
                self.groups.peers,
                num_islands=2,
                island_index=self.topology.island_index,
                device=torch.device("cpu"),
            ),
            num_islands=2,
            outer_optimizer=functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
            island_group=self.groups.island,
            island_position=self.topology.local_index,
        )

    def close(self) -> None:
        self.loop.close()
        self.groups.destroy()


def _run(rank: int, options: dict[str, Any], shard_outer: bool, steps: int) -> dict[str, Any]:
    me = _Rank(rank, SwarmConfig(island_size=2, shard_outer=shard_outer, **options))
    topology, params, optimizer, loop = me.topology, me.params, me.optimizer, me.loop
    try:
        for step in range(steps):
            g = torch.Generator().manual_seed(100 * step + topology.island_index)
            with torch.no_grad():
                for p in params.values():
                    p.add_(0.1 * torch.randn(p.shape, generator=g))
            loop.on_inner_step(optimizer)
        loop.finish()
    finally:
        me.close()
    outer = loop.outer_syncs[0]
    return {
        "params": {n: p.detach().clone() for n, p in params.items()},
        "anchors": {n: a.clone() for n, a in outer.anchors.items()},
        "momentum": {
            n: outer.outer_optimizer.state[a]["momentum_buffer"].clone()
            for n, a in outer.anchors.items()
        },
        "bytes_sent": loop.totals.bytes_sent,
        "bytes_received": loop.totals.bytes_received,
        "anchor_bytes": loop.anchor_bytes(),
        "outer_steps": outer.outer_steps,
        "residuals": {n: r.clone() for n, r in outer.residuals.items()},
    }


def _compare(rank: int, world: int, options: dict[str, Any], out: Path) -> None:
    full = _run(rank, options, shard_outer=False, steps=9)
    dist.barrier()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        sharded = _run(rank, options, shard_outer=True, steps=9)
    labels = sorted({e.name for e in prof.events() if e.name.startswith("lightning_swarm::")})
    torch.save({"full": full, "sharded": sharded, "labels": labels}, out / f"rank{rank}.pt")


CASES = {
    "streamed": {"sync_every": 3},
    "two_phase_fragments_delay_alpha": {
        "sync_every": 4,
        "num_fragments": 2,
        "fragment_layout": [["a", "b"], ["c", "d"]],
        "sync_delay": 1,
        "merge_alpha": 0.5,
    },
    "quantized_int8": {"sync_every": 3, "quantize": "int8", "quantize_block_size": 8},
    "quantized_int4_error_feedback": {
        "sync_every": 3,
        "quantize": "int4",
        "quantize_block_size": 8,
        "error_feedback": True,
    },
    "swarm_transport": {"sync_every": 3, "transport": "swarm"},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_equals_unsharded_with_a_share_of_bytes_and_anchors(
    case: str, tmp_path: Path
) -> None:
    run_ranks(_compare, 4, CASES[case], tmp_path, timeout_s=60)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(4)]
    for rank, info in enumerate(ranks):
        full, sharded = info["full"], info["sharded"]
        assert full["outer_steps"] == sharded["outer_steps"] > 0
        for name, p in full["params"].items():
            assert torch.equal(p, sharded["params"][name]), (case, rank, name)
        assert set(full["anchors"]) == set(SHAPES)
        assert 0 < len(sharded["anchors"]) < len(SHAPES)
        for name, anchor in sharded["anchors"].items():
            assert torch.equal(anchor, full["anchors"][name]), (case, rank, name)
            assert torch.equal(sharded["momentum"][name], full["momentum"][name]), (case, name)
        assert set(sharded["residuals"]) <= set(sharded["anchors"])  # a share's own residuals
        for name, residual in sharded["residuals"].items():
            assert torch.equal(residual, full["residuals"][name]), (case, name)
        assert bool(full["residuals"]) == ("error_feedback" in CASES[case])
        # Every rank of an island ends holding the same (global) parameters.
        buddy = ranks[rank ^ 1]["sharded"]["params"]
        assert all(torch.equal(p, buddy[n]) for n, p in sharded["params"].items())
        # Cross-island bytes and anchor memory per rank: half of the unsharded figures. The
        # swarm transport also counts its per-round status messages, the same for any payload.
        assert sharded["anchor_bytes"] * 2 == full["anchor_bytes"], case
        if case == "swarm_transport":
            assert 0 < sharded["bytes_sent"] < full["bytes_sent"], case
            continue
        assert sharded["bytes_sent"] * 2 == full["bytes_sent"] > 0, case
        assert sharded["bytes_received"] * 2 == full["bytes_received"], case
        assert "lightning_swarm::outer::island_gather" in info["labels"], info["labels"]
    # The two ranks of an island own complementary shares; peers own the same share.
    assert set(ranks[0]["sharded"]["anchors"]).isdisjoint(ranks[1]["sharded"]["anchors"])
    assert set(ranks[0]["sharded"]["anchors"]) == set(ranks[2]["sharded"]["anchors"])


def test_partition_balances_bytes_per_fragment_deterministically() -> None:
    sizes = {"w1": 400, "b1": 4, "w2": 400, "b2": 4, "w3": 100, "b3": 100}
    fragments = [["w1", "b1", "w2", "b2"], ["w3", "b3"]]
    owner = partition_by_bytes(fragments, sizes, 2)
    assert owner == partition_by_bytes(fragments, sizes, 2)
    for names in fragments:  # every fragment's round is split as well
        loads = [sum(sizes[n] for n in names if owner[n] == s) for s in range(2)]
        assert loads[0] == loads[1]
    assert {owner["w1"], owner["w2"]} == {0, 1}
    # Fragments of one tensor each still give every rank a share.
    assert sorted(partition_by_bytes([["x"], ["y"]], {"x": 8, "y": 8}, 2).values()) == [0, 1]


def test_optimizer_state_merges_and_reshards_by_name() -> None:
    anchors = [torch.nn.Parameter(torch.full((2,), float(i))) for i in range(3)]
    sgd = torch.optim.SGD(anchors, lr=0.5, momentum=0.9)
    for i, a in enumerate(anchors):
        a.grad = torch.ones(2) * (1 + i)
    sgd.step()
    state = sgd.state_dict()
    # Two shards: names [x, z] and [y], as two ranks would have saved them.
    first = select_by_name(state, ["x", "y", "z"], ["x", "z"])
    second = select_by_name(state, ["x", "y", "z"], ["y"])
    names, merged = merge_by_name([(["x", "z"], first), (["y"], second)])
    assert names == ["x", "z", "y"]
    again = select_by_name(merged, names, ["x", "y", "z"])
    for i in range(3):
        expected = state["state"][i]["momentum_buffer"]
        assert torch.equal(again["state"][i]["momentum_buffer"], expected)
    assert again["param_groups"][0]["params"] == [0, 1, 2]
    assert again["param_groups"][0]["momentum"] == 0.9
    two_groups = {"state": {}, "param_groups": [{"params": [0]}, {"params": [1]}]}
    with pytest.raises(ValueError, match="only an outer optimizer over one group"):
        select_by_name(two_groups, ["x", "y"], ["y"])


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"transport": "swarm", "swarm": {"max_norm": 1.0}},
            "cannot apply swarm.max_norm.*set shard_outer=False",
        ),
        ({"shard_outer": "yes"}, "shard_outer must be true or false, got 'yes'"),
    ],
)
def test_combinations_a_share_cannot_serve_are_refused(
    options: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        SwarmConfig(island_size=2, **options)


def test_unsharded_or_single_rank_islands_accept_those_options() -> None:
    SwarmConfig(island_size=2, shard_outer=False, transport="swarm", swarm={"max_norm": 1.0})
    SwarmConfig(island_size=1, transport="swarm", swarm={"max_norm": 1.0})
    assert SwarmConfig(island_size=2).outer_sharded and not SwarmConfig(island_size=1).outer_sharded


def _too_few_tensors(rank: int, world: int) -> None:
    config = SwarmConfig(island_size=2)
    topology = IslandTopology(world_size=2, island_size=2, global_rank=rank)
    groups = build_groups(topology)
    param = torch.nn.Parameter(torch.zeros(4))
    optimizer = torch.optim.SGD([param], lr=0.1)
    try:
        with pytest.raises(ValueError, match="optimizer 0 trains only 1 tensor.*shard_outer=False"):
            OuterLoop(
                [optimizer],
                {id(param): "w"},
                config=config,
                transport=transport_for(
                    config, None, num_islands=1, island_index=0, device=torch.device("cpu")
                ),
                num_islands=1,
                island_group=groups.island,
                island_position=topology.local_index,
            )
    finally:
        groups.destroy()


def test_an_optimizer_with_fewer_tensors_than_ranks_is_refused() -> None:
    run_ranks(_too_few_tensors, 2, timeout_s=30)


def _one_share_not_finite(rank: int, world: int, out: Path) -> None:
    me = _Rank(rank, SwarmConfig(island_size=2, sync_every=1))
    topology, params, optimizer, loop = me.topology, me.params, me.optimizer, me.loop
    outer = loop.outer_syncs[0]
    # Island 1 diverged in one tensor that position 1 owns: only that peer group sees it.
    bad = next(n for n in SHAPES if outer.shard is not None and outer.shard.owner[n] == 1)
    if topology.island_index == 1:
        with torch.no_grad():
            params[bad].view(-1)[0] = float("nan")
    try:
        loop.on_inner_step(optimizer)
        raised = "nothing"
    except Exception as err:
        raised = f"{type(err).__name__}: {err}"
    finally:
        me.close()
    (out / f"rank{rank}.txt").write_text(raised)


def test_a_failed_share_raises_on_every_rank_of_the_island(tmp_path: Path) -> None:
    run_ranks(_one_share_not_finite, 4, tmp_path, timeout_s=30)
    raised = [(tmp_path / f"rank{r}.txt").read_text() for r in range(4)]
    for rank in (0, 2):  # position 0: its share was finite; its island partner failed
        assert raised[rank].startswith("ShareFailedError: another rank of this island failed")
    for rank in (1, 3):
        assert raised[rank].startswith("NonFinitePseudoGradientError"), raised[rank]


def _gather_in_small_buckets(rank: int, world: int, out: Path) -> None:
    # Buckets of 4: "big" spans three, "b16" starts a run of another dtype, "t" is not
    # contiguous, and "s" and "c" share a bucket with the tail of "big".
    shapes = {"big": (11,), "s": (1,), "b16": (3,), "t": (2, 3), "c": (2,)}
    owner = {"big": 0, "s": 0, "b16": 0, "t": 1, "c": 1}
    dtypes = {"b16": torch.bfloat16}
    params = {
        n: (torch.arange(float(math.prod(s))) + 100 * rank + 10 * i)
        .to(dtypes.get(n, torch.float32))
        .reshape(s)
        for i, (n, s) in enumerate(shapes.items())
    }
    params["t"] = params["t"].reshape(3, 2).t()  # same shape, not contiguous
    expected = {
        n: (torch.arange(float(math.prod(s))) + 100 * owner[n] + 10 * i)
        .to(dtypes.get(n, torch.float32))
        .reshape(s)
        for i, (n, s) in enumerate(shapes.items())
    }
    expected["t"] = expected["t"].reshape(3, 2).t()
    shard = IslandShard(dist.group.WORLD, rank, world, owner, bucket_numel=4)
    shard.gather(list(shapes), params)
    same = all(torch.equal(params[n], expected[n]) for n in shapes)
    (out / f"rank{rank}.txt").write_text(str(same and not params["t"].is_contiguous()))


def test_the_island_gather_splits_large_tensors_and_keeps_dtypes_apart(tmp_path: Path) -> None:
    run_ranks(_gather_in_small_buckets, 2, tmp_path, timeout_s=30)
    assert [(tmp_path / f"rank{r}.txt").read_text() for r in range(2)] == ["True", "True"]
