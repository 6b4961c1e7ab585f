"""Streaming DiLoCo in ``OuterSync``, single process: schedule, delay, merge, error feedback.

The transports here are stand-ins: ``FakePeer`` averages the island's tensors with a fixed
"other island" contribution, so the mean is not the identity and the math can be computed by
hand; it records which thread ran each exchange.
"""

from __future__ import annotations

import copy
import functools
import sys
import threading
import traceback
from collections.abc import Callable, Mapping

import pytest
import torch
from torch import Tensor

import lightning_swarm.profiling as labels
from lightning_swarm import RoundTimeoutError, SwarmError
from lightning_swarm.algorithm import merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.algorithm.codecs import Codec
from lightning_swarm.outer import OuterSync, StreamingOptions, SyncWorker
from lightning_swarm.outer.errors import SyncWorkerError
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.base import RoundStats
from lightning_swarm.transport.reduce_scatter import ReduceScatterTransport
from tests.transport_rounds import NamedRound

NESTEROV = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
PLAIN = functools.partial(torch.optim.SGD, lr=1.0)


class FakePeer(NamedRound):
    """Two islands where the other one always contributes ``0.5 * x``: mean = ``0.75 * x``."""

    def __init__(
        self,
        applied: bool = True,
        fail_at: int | None = None,
        failure: Callable[[], Exception] = lambda: ConnectionError("peer vanished"),
    ) -> None:
        self.calls: list[tuple[list[str], str]] = []
        self.applied = applied
        self.fail_at = fail_at
        self.failure = failure

    def average_named(self, tensors: Mapping[str, Tensor], *, round_index: int) -> RoundStats:
        self.calls.append((list(tensors), threading.current_thread().name))
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise self.failure()
        for t in tensors.values():
            t.mul_(0.75)
        return RoundStats(bytes_sent=4, bytes_received=4, applied=self.applied)

    def close(self) -> None:
        pass


def _params(seed: int = 0) -> dict[str, torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    shapes = {"a.weight": (5, 3), "a.bias": (5,), "b.weight": (2, 5), "b.bias": (2,)}
    return {n: torch.nn.Parameter(torch.randn(*s, generator=g)) for n, s in shapes.items()}


def _inner_step(params: Mapping[str, torch.nn.Parameter], step: int) -> None:
    """A deterministic stand-in for an inner optimizer step (different per parameter)."""
    with torch.no_grad():
        for i, p in enumerate(params.values()):
            p.add_(
                torch.sin(torch.arange(p.numel(), dtype=torch.float32) + step + 3 * i).view_as(p)
            )


FRAGMENTS = [["a.weight", "a.bias"], ["b.weight", "b.bias"]]


def _streaming_outer(
    params: dict[str, torch.nn.Parameter],
    transport: object,
    worker: SyncWorker | None,
    **kw: object,
) -> OuterSync:
    return OuterSync(
        params,
        outer_optimizer=PLAIN,
        transport=transport,  # type: ignore[arg-type]
        sync_every=4,
        streaming=StreamingOptions(fragments=FRAGMENTS, worker=worker, **kw),  # type: ignore[arg-type]
    )


def test_one_fragment_no_delay_is_plain_diloco_bitwise() -> None:
    """The reference is DiLoCo's sync as written before fragments existed."""
    params, ref_params = _params(), _params()
    outer = OuterSync(params, outer_optimizer=NESTEROV, transport=FakePeer(), sync_every=3)
    anchors = {n: p.detach().clone() for n, p in ref_params.items()}
    ref_opt = NESTEROV(list(anchors.values()))
    ref_transport = FakePeer()
    for step in range(1, 13):
        _inner_step(params, step)
        _inner_step(ref_params, step)
        report = outer.on_inner_step()
        if step % 3 == 0:
            deltas = {n: pseudo_gradient(anchors[n], p) for n, p in ref_params.items()}
            ref_transport.average_named(deltas, round_index=step // 3 - 1)
            outer_step(ref_opt, list(anchors.values()), list(deltas.values()))
            for n, p in ref_params.items():
                merge_into_local(p.data, anchors[n])
            assert report is not None and report.fragment == 0
        else:
            assert report is None
        for n in params:
            assert torch.equal(params[n], ref_params[n]), (step, n)
            assert torch.equal(outer.anchors[n], anchors[n]), (step, n)
    assert outer.outer_steps == 4 and outer.fragment_rounds == [4]


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_fragments_with_delay_follow_the_schedule(alpha: float) -> None:
    """H=4, F=2, tau=1: fragment 1 sends at 2, 6 and applies at 3, 7; fragment 0 at 4 -> 5."""
    params = _params()
    transport = FakePeer()
    worker = SyncWorker()
    try:
        outer = _streaming_outer(params, transport, worker, sync_delay=1, merge_alpha=alpha)
        events: dict[int, int] = {}
        for step in range(1, 9):
            anchors_before = {n: a.clone() for n, a in outer.anchors.items()}
            if outer.schedule.sends_at(step) is not None:
                sent_from = {n: a.clone() for n, a in outer.anchors.items()}
            _inner_step(params, step)
            at_send = {n: p.detach().clone() for n, p in params.items()}
            if outer.schedule.sends_at(step) is not None:
                sent_locals = at_send
            report = outer.on_inner_step()
            if report is None:
                assert all(torch.equal(outer.anchors[n], anchors_before[n]) for n in params)
                continue
            events[step] = report.fragment
            mine, other = FRAGMENTS[report.fragment], FRAGMENTS[1 - report.fragment]
            for n in mine:  # outer SGD lr=1: anchor - 0.75 * (anchor - local at send)
                expected = sent_from[n] - 0.75 * (sent_from[n] - sent_locals[n])
                torch.testing.assert_close(outer.anchors[n], expected, rtol=0, atol=1e-6)
                local = alpha * at_send[n] + (1 - alpha) * expected
                torch.testing.assert_close(params[n].detach(), local, rtol=0, atol=1e-6)
            for n in other:  # the other fragment: neither anchors nor locals touched
                assert torch.equal(outer.anchors[n], anchors_before[n])
                assert torch.equal(params[n].detach(), at_send[n])
    finally:
        worker.close()
    assert events == {3: 1, 5: 0, 7: 1}
    assert outer.fragment_rounds == [1, 2] and outer.outer_steps == 3
    assert outer.in_flight == 0  # sent at 8, applies at 9
    # delayed exchanges ran in the worker thread, in the order sent
    assert [names for names, _ in transport.calls] == [FRAGMENTS[1], FRAGMENTS[0]] * 2
    assert all(thread.startswith("swarm-sync") for _, thread in transport.calls)


def test_no_delay_exchanges_inline() -> None:
    transport = FakePeer()
    outer = _streaming_outer(_params(), transport, None)
    for step in range(1, 5):
        _inner_step(outer.params, step)
        report = outer.on_inner_step()
        assert (report is not None) == (step in (2, 4))
    assert [t for _, t in transport.calls] == [threading.current_thread().name] * 2


def test_worker_failure_surfaces_at_the_apply_step() -> None:
    """A failure of a delayed round that is not a ``SwarmError`` arrives as ``SyncWorkerError``:
    a ``SwarmError`` (a user's ``except SwarmError`` catches every failed round, and teardown
    warns of it instead of masking the error that ended the fit) naming the round, with the
    worker's own error, traceback and all, as its ``__cause__`` (issue 39, item 5)."""
    worker = SyncWorker()
    try:
        outer = _streaming_outer(_params(), FakePeer(fail_at=2), worker, sync_delay=1)
        for _ in range(4):  # fragment 1 sends at 2, applies at 3; fragment 0 sends at 4
            outer.on_inner_step()
        with pytest.raises(
            SyncWorkerError,
            match=r"outer sync of fragment 0 \(sent after inner step 4\) failed in the "
            r"background sync worker: ConnectionError: peer vanished",
        ) as caught:
            outer.on_inner_step()
    finally:
        worker.close()
    err = caught.value
    assert isinstance(err, SwarmError) and isinstance(err, RuntimeError)
    cause = err.__cause__
    assert isinstance(cause, ConnectionError) and str(cause) == "peer vanished"
    frames = [frame.name for frame in traceback.extract_tb(cause.__traceback__)]
    assert "average_named" in frames, frames  # where it failed, on the worker


def _round_timeout() -> RoundTimeoutError:
    """What ``LinkWatch.explained`` raises for a gloo timeout: torch's error as the cause."""
    try:
        raise RuntimeError("Timed out waiting 1000ms for recv")
    except RuntimeError as gloo:
        try:
            raise RoundTimeoutError("round 1: the payload waited timeout_s=1 s") from gloo
        except RoundTimeoutError as err:
            return err


def test_a_library_error_of_a_delayed_round_reaches_the_training_thread_as_itself() -> None:
    """A ``RoundTimeoutError`` raised on the worker is caught by ``except RoundTimeoutError``
    at the apply step, with its cause and the worker's frames; others keep the wrapper."""
    worker = SyncWorker()
    try:
        outer = _streaming_outer(
            _params(), FakePeer(fail_at=2, failure=_round_timeout), worker, sync_delay=1
        )
        for _ in range(4):
            outer.on_inner_step()
        with pytest.raises(RoundTimeoutError, match="waited timeout_s=1 s") as caught:
            outer.on_inner_step()
    finally:
        worker.close()
    err = caught.value
    assert not isinstance(err, SyncWorkerError)
    assert isinstance(err.__cause__, RuntimeError) and "Timed out" in str(err.__cause__)
    frames = [frame.name for frame in traceback.extract_tb(err.__traceback__)]
    assert "average_named" in frames, frames  # raised on the worker, traceback kept
    if sys.version_info >= (3, 11):
        assert err.__notes__ == [
            "(raised by the outer sync of fragment 0 (sent after inner step 4) in the "
            "background sync worker)"
        ]


def test_a_library_error_at_teardown_warns_instead_of_masking_the_fits() -> None:
    """The round in flight at teardown failed with a ``SwarmError``: ``OuterLoop.close`` warns
    (the error that ended the fit stays the one raised), and asking the worker again raises
    the same error with its note once."""
    from lightning_swarm import SwarmConfig
    from lightning_swarm.outer import OuterLoop

    params = _params()
    optimizer = torch.optim.SGD(list(params.values()), lr=0.1)
    loop = OuterLoop(
        [optimizer],
        {id(p): n for n, p in params.items()},
        config=SwarmConfig(sync_every=4, num_fragments=2, sync_delay=1),
        transport=FakePeer(fail_at=1, failure=_round_timeout),
        num_islands=2,
        outer_optimizer=PLAIN,
    )
    for _ in range(2):  # fragment 0 sends after inner step 2, fails on the worker
        loop.on_inner_step(optimizer)
    outer = loop.outer_syncs[0]
    rnd = outer.held
    assert rnd is not None and rnd.future is not None
    for _ in range(2):
        with pytest.raises(RoundTimeoutError) as caught:
            SyncWorker.wait(rnd.future, "the round")
    assert len(getattr(caught.value, "__notes__", [None])) == 1
    with pytest.warns(RuntimeWarning, match="waited timeout_s=1 s.*dropped at teardown"):
        loop.close()


def test_delay_needs_a_worker() -> None:
    with pytest.raises(ValueError, match="sync_delay > 0 needs a SyncWorker"):
        _streaming_outer(_params(), FakePeer(), None, sync_delay=1)


@pytest.mark.parametrize(
    ("fragments", "message"),
    [
        ([["a.weight", "a.bias"]], r"leave 2 trained parameter\(s\) out, e.g. \['b.weight'"),
        ([["a.weight", "a.bias", "b.bias"], ["b.weight", "a.bias"]], "'a.bias' is repeated"),
        ([["a.weight", "a.bias", "b.bias", "b.weight", "c"]], "'c' is not a trained parameter"),
        ([["a.weight", "a.bias", "b.bias", "b.weight"], []], "fragment 1 is empty"),
    ],
)
def test_fragments_must_cover_parameters_once(fragments: list[list[str]], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        OuterSync(
            _params(),
            outer_optimizer=PLAIN,
            transport=FakePeer(),
            sync_every=4,
            streaming=StreamingOptions(fragments=fragments),
        )


def test_error_feedback_carries_the_quantization_error() -> None:
    codec = Codec("int4", block_size=4)
    transport = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=64
    )
    params = _params()
    outer = OuterSync(
        params,
        outer_optimizer=PLAIN,
        transport=transport,
        sync_every=2,
        streaming=StreamingOptions(codec=codec, error_feedback=True),
    )
    residual: dict[str, Tensor] = {n: torch.zeros_like(p) for n, p in params.items()}
    for step in range(1, 7):
        anchors = {n: a.clone() for n, a in outer.anchors.items()}
        _inner_step(params, step)
        locals_ = {n: p.detach().clone() for n, p in params.items()}
        outer.on_inner_step()
        if step % 2:
            continue
        for n in params:
            to_send = (anchors[n] - locals_[n]) + residual[n]
            sent = codec.roundtrip(to_send.reshape(-1)).view_as(to_send)
            residual[n] = to_send - sent
            assert torch.equal(outer.residuals[n], residual[n])
            assert torch.equal(outer.anchors[n], anchors[n] - sent)
        assert any(bool(r.abs().sum() > 0) for r in residual.values())


def test_skipped_round_restores_residuals() -> None:
    codec = Codec("int8", block_size=4)
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN,
        transport=FakePeer(applied=False),
        sync_every=1,
        streaming=StreamingOptions(codec=codec, error_feedback=True),
    )
    _inner_step(outer.params, 1)
    report = outer.on_inner_step()
    assert report is not None and not report.applied
    assert outer.residuals == {}


def test_failed_round_restores_residuals() -> None:
    codec = Codec("int8", block_size=4)
    outer = OuterSync(
        _params(),
        outer_optimizer=PLAIN,
        transport=FakePeer(fail_at=2),
        sync_every=1,
        streaming=StreamingOptions(codec=codec, error_feedback=True),
    )
    _inner_step(outer.params, 1)
    assert outer.on_inner_step() is not None  # round 1 applied: residuals exist
    before = {n: r.clone() for n, r in outer.residuals.items()}
    assert any(bool(r.abs().sum() > 0) for r in before.values())
    _inner_step(outer.params, 2)
    with pytest.raises(ConnectionError, match="peer vanished"):
        outer.on_inner_step()
    assert outer.residuals.keys() == before.keys()
    assert all(torch.equal(outer.residuals[n], before[n]) for n in before)


def _run_with_save(save_at: int | None, steps: int = 9) -> tuple[OuterSync, list[SyncWorker]]:
    """Fragments + delay + int4 feedback; optionally a save/restore into a twin at ``save_at``."""
    codec = Codec("int4", block_size=4)
    workers = [SyncWorker()]

    def build(params: dict[str, torch.nn.Parameter], worker: SyncWorker) -> OuterSync:
        return OuterSync(
            params,
            outer_optimizer=NESTEROV,
            transport=ReduceScatterTransport(
                None, num_islands=1, island_index=0, codec=codec, bucket_numel=64
            ),
            sync_every=4,
            streaming=StreamingOptions(
                fragments=FRAGMENTS, sync_delay=1, codec=codec, error_feedback=True, worker=worker
            ),
        )

    outer = build(_params(), workers[0])
    for step in range(1, steps + 1):
        _inner_step(outer.params, step)
        outer.on_inner_step()
        if step == save_at:
            state, island = outer.state_dict(), outer.island_state_dict()
            assert state["pending"] is not None, "the save should carry a round in flight"
            workers.append(SyncWorker())
            twin_params = {
                n: torch.nn.Parameter(p.detach().clone()) for n, p in outer.params.items()
            }
            outer = build(twin_params, workers[-1])
            outer.load_state_dict(state)
            outer.load_island_state_dict(island)
    return outer, workers


@pytest.mark.parametrize("save_at", [2, 4, 6])
def test_state_round_trip_with_a_round_in_flight(save_at: int) -> None:
    full, w1 = _run_with_save(None)
    resumed, w2 = _run_with_save(save_at)
    for w in w1 + w2:
        w.close()
    assert resumed.outer_steps == full.outer_steps == 4
    for n in full.params:
        assert torch.equal(full.params[n], resumed.params[n]), n
        assert torch.equal(full.anchors[n], resumed.anchors[n]), n
        assert torch.equal(full.residuals[n], resumed.residuals[n]), n


def test_restore_rejects_a_round_the_schedule_does_not_expect() -> None:
    resumed, workers = _run_with_save(None, steps=4)
    state = resumed.state_dict()  # fragment 0 in flight after step 4
    for w in workers:
        w.close()
    plain = OuterSync(_params(), outer_optimizer=NESTEROV, transport=FakePeer(), sync_every=4)
    with pytest.raises(ValueError, match="fragment 0 in flight at inner step 4 but this run's"):
        plain.load_state_dict(state)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_fragments": 0}, "num_fragments must be a positive integer, got 0"),
        ({"num_fragments": 3}, "sync_every=100 is not divisible by num_fragments=3"),
        ({"num_fragments": 4, "sync_delay": 25}, r"0 <= sync_delay < sync_every / num_frag"),
        ({"sync_delay": -1}, "sync_delay=-1 must be an integer with 0 <= sync_delay"),
        ({"merge_alpha": 1.5}, r"merge_alpha=1.5 must lie in \[0, 1\]"),
        ({"quantize": "int2"}, "quantize='int2' is not a codec; choose one of"),
        ({"quantize_block_size": 0}, "quantize_block_size must be a positive integer, got 0"),
        ({"error_feedback": "yes"}, "error_feedback must be true or false"),
        ({"fragment_layout": "zigzag"}, "fragment_layout='zigzag' is not known"),
        ({"fragment_layout": 3}, "fragment_layout must be 'strided', 'sequential' or a list"),
        ({"num_fragments": 2, "fragment_layout": [["a"]]}, r"lists 1 fragment\(s\) but num_f"),
    ],
)
def test_bad_streaming_options(kwargs: dict, message: str) -> None:
    from lightning_swarm import SwarmStrategy

    with pytest.raises(ValueError, match=message):
        SwarmStrategy(**kwargs)


def test_error_feedback_without_codec_warns() -> None:
    from lightning_swarm import SwarmStrategy

    with pytest.warns(UserWarning, match="error_feedback has no effect with quantize='none'"):
        SwarmStrategy(error_feedback=True)


# -- the end-of-fit round ---------------------------------------------------------------------
def _finished_run(alpha: float) -> tuple[OuterSync, SyncWorker, FakePeer]:
    """H=4, F=2, tau=1 for 8 steps: fragment 0 is in flight (sent at 8, due at 9)."""
    worker, transport = SyncWorker(), FakePeer()
    outer = _streaming_outer(_params(), transport, worker, sync_delay=1, merge_alpha=alpha)
    for step in range(1, 9):
        _inner_step(outer.params, step)
        outer.on_inner_step()
    assert outer.in_flight == 0
    return outer, worker, transport


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_finish_applies_the_round_in_flight_and_syncs_every_fragment(alpha: float) -> None:
    outer, worker, transport = _finished_run(alpha)
    try:
        anchors_before = {n: a.clone() for n, a in outer.anchors.items()}
        reports = outer.finish()
    finally:
        worker.close()
    # Fragment 0's early apply steps its anchors (alpha 0.5: its locals, merged at this step,
    # then land on them with no exchange), so only fragment 1 (stepped since its apply at 7)
    # needs a round.
    expected = [0, 1]
    assert [r.fragment for r in reports] == expected
    assert all(r.applied for r in reports) and outer.in_flight is None
    for n in outer.params:  # every island would now hold the anchors, bit for bit
        assert torch.equal(outer.params[n].detach(), outer.anchors[n]), n
        assert not torch.equal(outer.anchors[n], anchors_before[n]), n
    # the extra rounds ran inline, after the worker's one
    assert [names for names, _ in transport.calls[-len(expected) + 1 :]] == [
        FRAGMENTS[f] for f in expected[1:]
    ]
    assert outer.finish() == []  # nothing has changed since: no second round


def test_finish_with_nothing_to_sync_runs_no_round() -> None:
    transport = FakePeer()
    outer = OuterSync(_params(), outer_optimizer=PLAIN, transport=transport, sync_every=2)
    assert outer.finish() == []  # no inner step yet: the locals are the anchors
    for step in range(1, 5):
        _inner_step(outer.params, step)
        outer.on_inner_step()
    calls = len(transport.calls)
    assert outer.finish() == [] and len(transport.calls) == calls  # just synced at step 4
    _inner_step(outer.params, 5)
    outer.on_inner_step()
    assert [r.outer_steps for r in outer.finish()] == [3]


def test_training_on_after_finish_does_not_apply_a_round_twice() -> None:
    outer, worker, _ = _finished_run(0.0)
    try:
        outer.finish()
        state = copy.deepcopy(outer.state_dict())  # a file's copy, not the live anchors
        twin = _streaming_outer(
            {n: torch.nn.Parameter(p.detach().clone()) for n, p in outer.params.items()},
            FakePeer(),
            worker,
            sync_delay=1,
        )
        twin.load_state_dict(state)  # no round in flight after step 8: the schedule agrees
        for step in range(9, 13):  # step 9 would apply fragment 0's round: finish did
            for o in (outer, twin):
                _inner_step(o.params, step)
                report = o.on_inner_step()
                assert (report is not None) == (step == 11), step
    finally:
        worker.close()
    for n in outer.params:
        assert torch.equal(outer.params[n], twin.params[n]), n
        assert torch.equal(outer.anchors[n], twin.anchors[n]), n


@pytest.mark.parametrize("streamed", [False, True])
def test_round_phases_are_labelled_for_the_profiler(streamed: bool) -> None:
    """Both round forms label the same phases. The streamed round (a one-island all-reduce with
    7-element buckets, so several buckets per round) labels them inside its own label."""
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=7) if streamed else FakePeer()
    outer = OuterSync(_params(), outer_optimizer=PLAIN, transport=transport, sync_every=2)
    assert outer.streams == streamed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for step in range(1, 3):
            _inner_step(outer.params, step)
            outer.on_inner_step()
    events = list(prof.events())
    names = {event.name for event in events}
    phases = {
        "lightning_swarm::outer::pseudo_gradient",
        "lightning_swarm::outer::exchange",
        "lightning_swarm::outer::outer_step",
        "lightning_swarm::outer::merge",
    }
    assert phases <= names, phases - names
    assert (labels.BUCKETED_ROUND in names) == streamed
    if streamed:
        rounds = [e.time_range for e in events if e.name == labels.BUCKETED_ROUND]
        for event in events:
            if event.name in phases:
                span = event.time_range
                assert any(r.start <= span.start and span.end <= r.end for r in rounds), event
