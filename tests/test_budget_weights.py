"""Time-budgeted rounds on every transport: the mean weighted by each island's inner steps,
bitwise the plain mean when the steps are equal, a bad weight refused, a stalled island."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import lightning.pytorch as pl
import pytest
import torch
from safetensors.torch import load_file
from torch import Tensor

from lightning_swarm import SwarmStrategy
from lightning_swarm.algorithm.budget import RoundBudget
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.errors import SwarmError
from lightning_swarm.membership.round_header import HeaderRow, island_hash, weighed
from lightning_swarm.outer import OuterSync
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.aggregator.swarm_round import SwarmAggregator
from lightning_swarm.transport.base import Opening, RoundRequest, RoundStats, Transport, Work
from lightning_swarm.transport.errors import BadWorkError
from lightning_swarm.transport.link import LinkTimeouts
from tests.dist_utils import run_ranks
from tests.helpers import QUIET, Recorder, load_ranks, regression_data
from tests.test_budget import PLAIN_OUTER, FakeClock, SleepyRegressor, _locals, _params, _train
from tests.transport_rounds import NamedRound, average

WORLD = 3
STEPS = [3, 1, 2]  # each island's inner steps this round: its weight
ISLAND_WEIGHTS = [1.0, 2.0, 1.0]  # weighted_mean's samples per step

# name -> (transport factory, weights the mean takes besides the steps)
KINDS = ("allreduce", "rotating", "sharded", "sharded_spooled", "weighted", "median", "int8")
CODEC = Codec("int8", 4)


def _transport(kind: str, rank: int) -> Transport:
    common: dict[str, Any] = {"num_islands": WORLD, "island_index": rank, "offload": False}
    if kind == "allreduce":
        return AllReduceTransport(None, num_islands=WORLD, bucket_numel=7)
    if kind == "rotating":
        return SwarmAggregator(None, **common)
    if kind == "sharded":  # mean without max_norm: summed as the chunks arrive (fold)
        return SwarmAggregator(None, owners="sharded", **common, chunk_bytes=64)
    if kind == "sharded_spooled":  # max_norm needs each island's norm: spooled and judged
        return SwarmAggregator(None, owners="sharded", **common, chunk_bytes=64, max_norm=1e9)
    if kind == "weighted":
        return SwarmAggregator(
            None, **common, aggregation="weighted_mean", island_weights=ISLAND_WEIGHTS
        )
    if kind == "int8":  # contributions (the owner's own too) are weighed decoded
        return SwarmAggregator(None, **common, codec=CODEC)
    assert kind == "median"
    return SwarmAggregator(None, **common, aggregation="median")


def _contribution(island: int) -> dict[str, Tensor]:
    gen = torch.Generator().manual_seed(100 + island)
    return {"w": torch.randn(13, 7, generator=gen), "b": torch.randn(5, generator=gen)}


def _weights_worker(rank: int, world: int, out: Path) -> None:
    """Each kind three times: with unequal steps, with equal steps, and with no work at all."""
    results: dict[str, Any] = {}
    for kind in KINDS:
        for case, work in (
            ("unequal", Work(STEPS[rank], 3 * STEPS[rank])),
            ("equal", Work(2, 2 + rank)),
            ("none", None),
        ):
            tensors = _contribution(rank)
            transport = _transport(kind, rank)
            stats = average(transport, tensors, round_index=1, work=work)
            transport.close()
            results[f"{kind}/{case}"] = (tensors, stats.swarm_steps)
    torch.save(results, out / f"{rank}.pt")


def _reference(weights: list[float], codec: Codec | None = None) -> dict[str, Tensor]:
    """The weighted mean in float64 (of the contributions' round trips through ``codec``)."""
    total = sum(weights)
    contributions = [_contribution(i) for i in range(WORLD)]
    if codec is not None:
        contributions = [
            {n: codec.roundtrip(t.reshape(-1)).view_as(t) for n, t in c.items()}
            for c in contributions
        ]
    return {
        name: sum(w * c[name].double() for w, c in zip(weights, contributions, strict=True)) / total
        for name in contributions[0]
    }


def test_the_mean_is_weighted_by_the_steps_on_every_transport(tmp_path: Path) -> None:
    run_ranks(_weights_worker, WORLD, tmp_path, timeout_s=60)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    for kind in KINDS:
        for case in ("unequal", "equal", "none"):
            key = f"{kind}/{case}"
            ours = ranks[0][key][0]
            for other in ranks[1:]:  # the same bits on every island
                assert all(torch.equal(ours[n], other[key][0][n]) for n in ours), key
        unequal, equal, plain = (ranks[0][f"{kind}/{c}"][0] for c in ("unequal", "equal", "none"))
        # Equal steps: bit for bit the round without work.
        assert all(torch.equal(equal[n], plain[n]) for n in plain), kind
        if kind == "median":  # an order statistic: no weights
            assert all(torch.equal(unequal[n], plain[n]) for n in plain)
            continue
        weights = [float(s) for s in STEPS]
        if kind == "weighted":  # samples per step times steps
            weights = [w * s for w, s in zip(ISLAND_WEIGHTS, STEPS, strict=True)]
        expected = _reference(weights, CODEC if kind == "int8" else None)
        for name, got in unequal.items():
            torch.testing.assert_close(got.double(), expected[name], rtol=1e-6, atol=1e-6)
            assert not torch.equal(got, plain[name]), f"{kind}: the weights changed nothing"
        if kind != "allreduce":  # the aggregator reports the swarm's most inner steps
            assert [r[f"{kind}/unequal"][1] for r in ranks] == [9] * WORLD
            assert [r[f"{kind}/equal"][1] for r in ranks] == [4] * WORLD
            assert ranks[0][f"{kind}/none"][1] is None


def _nan_worker(rank: int, world: int, out: Path) -> None:
    results = {}
    for kind in ("rotating", "sharded", "weighted"):
        tensors = _contribution(rank)
        if rank == 1:
            tensors["w"][2, 3] = math.nan
        transport = _transport(kind, rank)
        stats = average(transport, tensors, round_index=1, work=Work(STEPS[rank], 9))
        results[kind] = (tensors, stats.non_finite_islands, stats.rejected_own, stats.applied)
    torch.save(results, out / f"{rank}.pt")


def test_a_non_finite_island_under_a_budget_is_left_out_with_its_weight(tmp_path: Path) -> None:
    run_ranks(_nan_worker, WORLD, tmp_path, timeout_s=60)
    ranks = [torch.load(tmp_path / f"{r}.pt", weights_only=False) for r in range(WORLD)]
    for kind in ("rotating", "sharded", "weighted"):
        weights = [float(STEPS[0]), 0.0, float(STEPS[2])]  # island 1's weight goes with it
        if kind == "weighted":
            weights = [w * s for w, s in zip(ISLAND_WEIGHTS, weights, strict=True)]
        expected = _reference(weights)
        for rank, result in enumerate(ranks):
            tensors, non_finite, rejected_own, applied = result[kind]
            assert non_finite == (1,) and rejected_own == (rank == 1) and applied, kind
            for name, got in tensors.items():
                assert torch.equal(got, ranks[0][kind][0][name])
                torch.testing.assert_close(got.double(), expected[name], rtol=1e-6, atol=1e-6)


BAD_WEIGHTS = [2.5, 11.0, math.nan, -1.0]  # 11 > its 10 inner steps


def _bad_weight_worker(rank: int, world: int, out: Path, kind: str) -> None:
    for bad in BAD_WEIGHTS:
        transport = _transport(kind, rank)
        # What a modified peer could send; ``Work`` says int, the wire carries float64.
        steps = cast(int, bad) if rank == 1 else 2
        try:
            average(transport, _contribution(rank), round_index=0, work=Work(steps, 10))
        except BadWorkError as err:
            (out / f"{rank}-{bad}.txt").write_text(str(err))
        finally:
            transport.close()


@pytest.mark.parametrize("kind", ["allreduce", "rotating", "sharded"])
def test_a_bad_weight_from_a_peer_is_refused_on_every_island_naming_it(
    tmp_path: Path, kind: str
) -> None:
    run_ranks(_bad_weight_worker, WORLD, tmp_path, kind, timeout_s=60)
    for bad in BAD_WEIGHTS:
        for rank in range(WORLD):
            message = (tmp_path / f"{rank}-{bad}.txt").read_text()
            assert message.startswith(f"island 1 sent the weight {bad!r} (inner steps since"), (
                message
            )
            assert "a weight must be a whole number from 0 to its inner steps" in message
            assert "the same sync_every_s on every island" in message


# -- the round engine on a budget over the aggregator ------------------------------------------
def _engine_worker(rank: int, world: int, out: Path, kind: str) -> None:
    """``[3, 1][rank]`` inner steps, then the budget's round, over the swarm transport."""
    steps = [3, 1][rank]
    clock = FakeClock()
    budget = RoundBudget(1.0, clock=clock)
    transport = SwarmAggregator(
        None, num_islands=world, island_index=rank, owners=kind, offload=False
    )
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN_OUTER,
        transport=transport,
        sync_every=10**6,
        budget=budget,
    )
    budget.restart(0)
    for step in range(steps):
        _train(outer.params, rank, step)
        clock.now += 1.0 if step == steps - 1 else 0.0
        assert (outer.on_inner_step() is None) == (step < steps - 1)
    assert budget.swarm_steps == 3 and budget.round_started_step == steps
    torch.save({n: a.clone() for n, a in outer.anchors.items()}, out / f"{rank}.pt")


@pytest.mark.parametrize("kind", ["rotating", "sharded"])
def test_the_round_engine_weighs_the_aggregators_mean_by_the_steps(
    tmp_path: Path, kind: str
) -> None:
    run_ranks(_engine_worker, 2, tmp_path, kind, timeout_s=60)
    got = [torch.load(tmp_path / f"{r}.pt") for r in range(2)]
    locals_ = [_locals(0, 3), _locals(1, 1)]
    for name, anchor in got[0].items():
        assert torch.equal(anchor, got[1][name])
        expected = (3 * locals_[0][name].double() + locals_[1][name].double()) / 4
        torch.testing.assert_close(anchor.double(), expected, rtol=0, atol=1e-6)


def test_a_fit_on_a_budget_over_the_aggregator_ends_on_every_island_at_one_round(
    tmp_path: Path,
) -> None:
    pl.seed_everything(7)
    strategy = SwarmStrategy(sync_every_s=0.2, transport="swarm", start_method="fork")
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=strategy,
        max_steps=24,
        callbacks=[Recorder(str(tmp_path))],
        limit_val_batches=0,
        **QUIET,
    )
    trainer.fit(SleepyRegressor((0.01, 0.05)), regression_data())
    ranks = load_ranks(tmp_path, 2)
    fast, slow = ranks[0]["inner_steps"][0], ranks[1]["inner_steps"][0]
    assert fast >= 24 > slow, (fast, slow)  # the stop came from the aggregator's swarm_steps
    assert ranks[0]["outer_steps"] == ranks[1]["outer_steps"]
    assert torch.equal(ranks[0]["final"], ranks[1]["final"])


# -- an island that stalls for many budgets ----------------------------------------------------
STALL_S = 4.0  # twenty budgets of 0.2 s
TIMEOUT_S = 1.0


def _stall_worker(rank: int, world: int, out: Path) -> None:
    """Island 1 stalls in its second inner step; island 0 reaches the round and waits in it
    until the round's timeout, which ends it with ``RoundTimeoutError`` (anchors unchanged)."""
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN_OUTER,
        transport=AllReduceTransport(
            None,
            num_islands=world,
            bucket_numel=64,
            # Derived from the tiny payload: the floor, TIMEOUT_S.
            timeouts=LinkTimeouts("timeout_s", TIMEOUT_S),
        ),
        sync_every=10**6,
        budget=RoundBudget(0.2),
    )
    before = {n: a.clone() for n, a in outer.anchors.items()}
    start = time.monotonic()
    try:
        for step in range(10**6):
            _train(outer.params, rank, step)
            time.sleep(STALL_S if rank == 1 and step == 1 else 0.05)
            outer.on_inner_step()
            if time.monotonic() - start > 30:  # a bound of the test's own, never reached
                break
    except SwarmError as err:  # the stalled island meets a peer that gave up: its own error
        unchanged = all(torch.equal(outer.anchors[n], before[n]) for n in before)
        elapsed = time.monotonic() - start
        (out / f"{rank}.txt").write_text(f"{elapsed:.3f} {unchanged} {type(err).__name__}\n{err}")


def test_an_island_that_stalls_for_many_budgets_is_not_waited_on_forever(tmp_path: Path) -> None:
    run_ranks(_stall_worker, 2, tmp_path, timeout_s=60)
    head, message = (tmp_path / "0.txt").read_text().split("\n", 1)
    elapsed, unchanged, kind = head.split()
    # The fast island's first budget ends after 0.2 s and its round waits TIMEOUT_S, well
    # before the slow island wakes up.
    assert float(elapsed) < STALL_S and unchanged == "True" and kind == "RoundTimeoutError", head
    assert message.startswith("rank 0, island 0, round 0: a collective of its "), message
    assert f"waited timeout_s={TIMEOUT_S:g} s (derived" in message
    # The stalled island, once awake, finds its peer gone and says so.
    head, message = (tmp_path / "1.txt").read_text().split("\n", 1)
    assert head.split()[2] in ("PeerLostError", "RoundTimeoutError"), head
    assert message.startswith("rank 1, island 1, round 0: "), message


# -- torchft: the quorum's participants, weighed ---------------------------------------------
def _row(nonce: int, work: int, inner: int, healing: int = 0) -> HeaderRow:
    return HeaderRow(
        island=nonce, model=1, healing=healing, joined_ns=0, nonce=nonce, finite=1,
        settings=1, settings_len=1, work=work, inner_steps=inner,
    )  # fmt: skip


def test_the_quorums_participants_are_weighed_and_a_healed_member_brings_no_weight() -> None:
    rows = [_row(1, 3, 9), _row(2, 5, 50, healing=1), _row(3, 1, 4)]
    # Participants 1 and 3: torchft divides their sum by 2, so 2 * 3 / 4 and 2 * 1 / 4.
    assert weighed(rows, rows[0], Opening()) == Opening(scale=1.5, swarm_steps=9)
    assert weighed(rows, rows[2], Opening()) == Opening(scale=0.5, swarm_steps=9)
    assert weighed(rows, rows[1], Opening()).scale == 1.0  # it sends zeros
    equal = [_row(1, 2, 9), _row(2, 2, 4)]
    assert weighed(equal, equal[1], Opening()) == Opening(scale=1.0, swarm_steps=9)
    with pytest.raises(
        BadWorkError,
        match=r"^the island at place 2 of the quorum \(island_id hash 3\) sent the weight 5\.0",
    ):
        weighed([_row(1, 2, 9), _row(2, 7, 7, healing=1), _row(3, 5, 4)], rows[0], Opening())
    # No step since the last round (an island's join): weight 0, a plain mean when all are 0.
    idle = [_row(1, 0, 0), _row(2, 0, 0)]
    assert weighed(idle, idle[0], Opening()) == Opening(scale=1.0, swarm_steps=0)
    some = [_row(1, 0, 3), _row(2, 4, 4)]
    assert weighed(some, some[0], Opening()).scale == 0.0


SCRIPT = "tests/torchft_weighted_island.py"


def test_torchft_rounds_weigh_the_mean_by_the_steps(tmp_path: Path) -> None:
    from tests.elastic_utils import finish_all, lighthouse, reaped, start_island
    from tests.torchft_weighted_island import contribution

    pytest.importorskip("torchft")
    steps = {"a": 3, "b": 1, "c": 2}
    with lighthouse(min_islands=3) as address:
        procs = {
            name: start_island(tmp_path, address, name, "--steps", str(s), script=SCRIPT)
            for name, s in steps.items()
        }
        with reaped(list(procs.values())):
            finish_all(procs, tmp_path, 90)
    got = {name: torch.load(tmp_path / f"{name}.pt", weights_only=False) for name in steps}
    a = got["a"]
    assert [r["applied"] for r in a] == [False, True, True, True, False]
    assert all(r["participants"] == 3 for r in a[1:4])
    expected = sum(s * contribution(n).double() for n, s in steps.items()) / sum(steps.values())
    torch.testing.assert_close(a[1]["mean"].double(), expected, rtol=1e-6, atol=1e-6)
    for name, result in got.items():
        for r in range(1, 4):  # the same bits on every island
            assert torch.equal(result[r]["mean"], a[r]["mean"]), (name, r)
        assert result[1]["swarm_steps"] == 13 and result[2]["swarm_steps"] == 20
        assert result[3]["scale"] == 1.0 and result[3]["swarm_steps"] is None
        assert not result[4]["applied"]  # b's broken weight: abandoned everywhere
    assert torch.equal(a[2]["mean"], a[3]["mean"])  # equal steps: bit for bit unweighted
    assert not torch.equal(a[1]["mean"], a[3]["mean"])
    for name in steps:
        log = (tmp_path / f"{name}.stderr").read_text()
        assert f"island '{name}' abandons this round: the island at place" in log, log[-2000:]
        assert "sent the weight 31.0" in log


@pytest.mark.parametrize("merge_alpha", ["0.0", "0.5"])
def test_lightning_islands_of_different_speeds_on_torchft_end_equal(
    tmp_path: Path, merge_alpha: str
) -> None:
    """Two elastic islands on a budget, one five times slower: the fit ends on both at the
    round where the fast one reached max_steps, with the same model (the global one, also when
    rounds merge with alpha); the first round, where no island has stepped, is not abandoned."""
    from tests.elastic_utils import finish_all, lighthouse, reaped, start_island

    pytest.importorskip("torchft")
    script = "tests/elastic_lightning_island.py"
    opts = ["--budget-s", "0.3", "--max-steps", "30", "--merge-alpha", merge_alpha]
    with lighthouse() as address:
        procs = {
            name: start_island(tmp_path, address, name, *opts, "--step-s", pace, script=script)
            for name, pace in (("a", "0.01"), ("b", "0.05"))
        }
        with reaped(list(procs.values())):
            finish_all(procs, tmp_path, 90)
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a), {k: (a[k] - b[k]).abs().max() for k in a}
    steps = {}
    for name in "ab":
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        rounds = [r for r in rows if "swarm/islands_in_round" in r]
        steps[name] = max(r["step"] for r in rows)
        assert rounds and all(r["swarm/islands_in_round"] == 2 for r in rounds[1:]), name
        assert not any(r["swarm/rounds_abandoned"] for r in rounds), name
        log = (tmp_path / f"{name}.stderr").read_text()
        assert "abandons this round" not in log and "BadWorkError" not in log, log[-2000:]
    assert steps["a"] == 30 > steps["b"], steps


def _jsonl(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_a_dead_island_under_torchft_on_a_budget_is_left_out_with_its_weight(
    tmp_path: Path,
) -> None:
    """Three elastic islands of different speeds on a budget; once all three shared a round, c
    is SIGKILLed inside one. a and b abandon that round, then commit rounds weighed over the
    two of them alone, and end with the same model."""
    from tests.elastic_utils import finish_all, lighthouse, reaped, start_island, wait_for

    pytest.importorskip("torchft")
    script = "tests/elastic_lightning_island.py"
    stall = tmp_path / "stall"
    opts = ["--budget-s", "0.3", "--max-steps", "240"]
    paces = {"a": "0.01", "b": "0.03", "c": "0.02"}

    def rounds(name: str) -> list[dict[str, Any]]:
        path = tmp_path / f"{name}.jsonl"
        rows = _jsonl(path) if path.exists() else []
        return [r for r in rows if "swarm/islands_in_round" in r]

    def weighed_by_three(path: Path) -> bool:  # a round whose mean held c's weight
        return path.exists() and any(
            len(w["rows"]) == 3 and not any(row[1] for row in w["rows"]) for w in _jsonl(path)
        )

    with lighthouse() as address:
        procs = {
            name: start_island(
                tmp_path,
                address,
                name,
                *opts,
                "--step-s",
                pace,
                *(["--stall-file", str(stall)] if name == "c" else []),
                script=script,
            )
            for name, pace in paces.items()
        }
        with reaped(list(procs.values())):
            wait_for(lambda: weighed_by_three(tmp_path / "c.weights.jsonl"), 90, "c's weight")
            stall.write_text("")  # c's next round stalls after its header: kill it there
            wait_for((tmp_path / "c.stalled").exists, 30, "c to stall inside a round")
            stalled_at = (tmp_path / "c.stalled").stat().st_mtime
            procs["c"].kill()
            procs["c"].wait()
            finish_all({n: procs[n] for n in "ab"}, tmp_path, 90)
    a, b = (load_file(str(tmp_path / f"{n}.rank0.safetensors")) for n in "ab")
    assert all(a[k].equal(b[k]) for k in a), {k: (a[k] - b[k]).abs().max() for k in a}
    dead = island_hash("c")
    scales: dict[str, dict[str, float]] = {"a": {}, "b": {}}
    for name in "ab":
        assert not list(tmp_path.glob(f"{name}.error.*")), name
        rows = rounds(name)
        before = [r for r in rows if r["t"] < stalled_at]
        after = [r for r in rows if r["t"] > stalled_at]
        # The round c died in: abandoned, the anchors unchanged.
        assert after[0]["swarm/islands_in_round"] == 3, (name, after[0])
        assert after[0]["swarm/rounds_abandoned"] == before[-1]["swarm/rounds_abandoned"] + 1
        assert after[0]["swarm/outer_steps"] == before[-1]["swarm/outer_steps"]
        # Then rounds of the two survivors, committed: training went on without c.
        later = after[1:]
        assert len(later) >= 2 and all(r["swarm/islands_in_round"] == 2 for r in later), name
        assert later[-1]["swarm/outer_steps"] >= after[0]["swarm/outer_steps"] + 2, name
        assert later[-1]["swarm/rounds_abandoned"] == after[0]["swarm/rounds_abandoned"]
        weighings = _jsonl(tmp_path / f"{name}.weights.jsonl")
        with_c = [dead in [row[0] for row in w["rows"]] for w in weighings]
        # c weighed in rounds up to the one it died in, never again after it.
        assert any(with_c), (name, with_c)
        last_with = len(with_c) - 1 - with_c[::-1].index(True)
        for w in weighings[last_with + 1 :]:
            assert w["t"] > stalled_at and len(w["rows"]) == 2, (name, w)
            # The round, named by every island's inner steps in it: the same rows on a and b.
            key = json.dumps(sorted(w["rows"]))
            scales[name][key] = w["scale"]
    rounds_ab = scales["a"].keys() & scales["b"].keys()
    assert len(rounds_ab) >= 2, scales
    for key in rounds_ab:
        # The participants' steps (a member being healed brings none, and takes scale 1).
        work = {island: steps for island, healing, steps, _ in json.loads(key) if not healing}
        total = sum(work.values())
        for name in "ab":  # n * its steps over the survivors' steps alone: c's are gone
            mine = work.get(island_hash(name))
            expected = 1.0 if mine is None or len(set(work.values())) == 1 else 2 * mine / total
            assert scales[name][key] == pytest.approx(expected, rel=1e-12), (name, key)


class _Verdict(NamedRound):
    """A stand-in round that reports 100 inner steps for the swarm and the given outcome."""

    def __init__(self, applied: bool) -> None:
        self.applied = applied

    def open(self, request: RoundRequest) -> Opening:
        super().open(request)
        return Opening(swarm_steps=100)

    def average_named(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        return RoundStats(applied=self.applied)


@pytest.mark.parametrize("applied", [True, False])
def test_only_an_applied_round_counts_for_the_stopping_rule(applied: bool) -> None:
    # torchft's vote or the aggregator's min_contributions can leave a round unapplied on
    # every island: a fit that stopped there would end on local models.
    clock = FakeClock()
    budget = RoundBudget(1.0, clock=clock)
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN_OUTER,
        transport=cast(Transport, _Verdict(applied)),
        sync_every=10**6,
        budget=budget,
    )
    budget.restart(0)
    clock.now += 1.0
    assert outer.on_inner_step() is not None
    assert budget.swarm_steps == (100 if applied else None)
