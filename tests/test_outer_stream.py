"""The streamed round (device=cpu) against the reference round of ``algorithm.diloco``, bitwise,
over gloo: pseudo-gradient, the transport's ``average``, ``outer_step``, ``merge_into_local``."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

from lightning_swarm.algorithm import merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.algorithm.fragments import FragmentSchedule
from lightning_swarm.outer import OuterSync, StreamingOptions
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.base import Bucket, Transport
from lightning_swarm.transport.buckets import Piece, numel_of, plan_buckets
from lightning_swarm.transport.errors import NonFinitePseudoGradientError
from tests.dist_utils import run_ranks
from tests.transport_rounds import average

SHAPES = [(4, 3), (11,), (2, 2, 5), (1,)]
FACTORIES: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "nesterov": functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True),
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
}


def _params(seed: int) -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return {
        f"p{i}": torch.nn.Parameter(torch.randn(s, generator=gen)) for i, s in enumerate(SHAPES)
    }


def _train(params: dict[str, torch.nn.Parameter], rank: int, step: int) -> None:
    """Stand-in inner steps: a rank- and step-dependent move of every parameter."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.1)


class Reference:
    """The round of ``algorithm.diloco`` over whole tensors: the independent implementation."""

    def __init__(
        self,
        params: dict[str, torch.nn.Parameter],
        factory: Callable[[Any], torch.optim.Optimizer],
        transport: AllReduceTransport,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.params, self.transport = params, transport
        self.anchors = {n: p.detach().to(dtype=dtype, copy=True) for n, p in params.items()}
        self.optimizer = factory(list(self.anchors.values()))
        self.outer_steps = 0
        self.bytes_sent = 0

    @torch.no_grad()
    def round(self, names: list[str], alpha: float) -> float:
        deltas = {n: pseudo_gradient(self.anchors[n], self.params[n]) for n in names}
        stats = average(self.transport, deltas, round_index=self.outer_steps)
        self.bytes_sent = stats.bytes_sent
        norm = float(torch.cat([d.reshape(-1) for d in deltas.values()]).norm())
        anchors = [self.anchors[n] for n in names]
        outer_step(self.optimizer, anchors, list(deltas.values()), seed=self.outer_steps)
        for n in names:
            merge_into_local(self.params[n].data, self.anchors[n], alpha)
        self.outer_steps += 1
        return norm


def _compare_worker(
    rank: int, world: int, out: str, opt: str, dtype: torch.dtype, alpha: float, in_flight: int
) -> None:
    factory, bucket = FACTORIES[opt], 7  # 7 elements: tensors split over buckets, partial last
    ref_params, fast_params = _params(0), _params(0)
    transport = AllReduceTransport(None, num_islands=world, bucket_numel=bucket)
    ref = Reference(ref_params, factory, transport, dtype)
    fast = OuterSync(
        fast_params,
        outer_optimizer=factory,
        transport=transport,
        sync_every=1,
        anchor_dtype=dtype,
        streaming=StreamingOptions(merge_alpha=alpha),
    )
    assert fast.streams
    fast.engine.in_flight = in_flight
    norms = []
    for step in range(4):
        _train(ref_params, rank, step)
        _train(fast_params, rank, step)
        norm = ref.round(list(ref_params), alpha)
        report = fast.on_inner_step()
        assert report is not None
        assert report.bytes_sent == ref.bytes_sent > 0
        norms.append((norm, report.pseudo_grad_norm))
    torch.save(
        {
            "slow": [ref_params, ref.anchors, ref.optimizer.state_dict()],
            "fast": [fast_params, fast.anchors, fast.outer_optimizer.state_dict()],
            "norms": norms,
        },
        Path(out) / f"{rank}.pt",
    )


@pytest.mark.parametrize(
    ("opt", "dtype", "alpha", "in_flight"),
    [
        ("nesterov", torch.float32, 0.0, 1),
        ("adamw", torch.float32, 0.0, 1),
        ("nesterov", torch.bfloat16, 0.0, 1),
        ("nesterov", torch.float32, 0.25, 1),
        ("adamw", torch.bfloat16, 0.5, 3),
    ],
)
def test_stream_round_is_bitwise_the_reference_round(
    tmp_path: Path, opt: str, dtype: torch.dtype, alpha: float, in_flight: int
) -> None:
    world = 3  # three summands: the all-reduce order matters, so the buckets must line up
    run_ranks(_compare_worker, world, str(tmp_path), opt, dtype, alpha, in_flight)
    for rank in range(world):
        saved = torch.load(tmp_path / f"{rank}.pt")
        slow_params, slow_anchors, slow_state = saved["slow"]
        fast_params, fast_anchors, fast_state = saved["fast"]
        for name in slow_params:
            assert torch.equal(slow_params[name], fast_params[name]), (rank, name)
            assert torch.equal(slow_anchors[name], fast_anchors[name]), (rank, name)
            assert not torch.equal(slow_anchors[name], _params(0)[name].to(dtype))
        for index, values in slow_state["state"].items():
            for key, value in values.items():
                assert torch.equal(value, fast_state["state"][index][key]), (index, key)
        for old, new in saved["norms"]:  # float64 then, float32 now: same value to 1e-5
            assert new == pytest.approx(old, rel=1e-5)


def _nonfinite_worker(rank: int, world: int, out: str) -> None:
    params = _params(0)
    outer = OuterSync(
        params,
        outer_optimizer=FACTORIES["nesterov"],
        transport=AllReduceTransport(None, num_islands=world, bucket_numel=7),
        sync_every=1,
    )
    if rank == 1:
        with torch.no_grad():
            params["p2"][0, 1, 3] = float("nan")
    before = {n: a.clone() for n, a in outer.anchors.items()}
    with pytest.raises(NonFinitePseudoGradientError, match=r"island\(s\) \[1\]"):
        outer.on_inner_step()
    assert all(torch.equal(outer.anchors[n], before[n]) for n in before)
    assert not outer.outer_optimizer.state  # no state was created for a round that did not happen
    (Path(out) / f"{rank}.ok").touch()


def test_non_finite_island_is_refused_on_every_rank_before_anything_moves(tmp_path: Path) -> None:
    run_ranks(_nonfinite_worker, 2, str(tmp_path))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0.ok", "1.ok"]


def test_buffers_are_allocated_once_and_reused() -> None:
    params = _params(0)
    outer = OuterSync(
        params,
        outer_optimizer=FACTORIES["nesterov"],
        transport=AllReduceTransport(None, num_islands=1, bucket_numel=7),
        sync_every=1,
    )
    held: list[Tensor] = []
    for step in range(3):
        _train(params, 0, step)
        outer.on_inner_step()
        assert outer.engine._delta is not None
        held.append(outer.engine._delta)
    assert held[0] is held[1] is held[2]
    assert outer.engine.buffer_bytes() == 2 * 7 * 4  # two buckets, whatever the model size


def _outer_sync_worker(rank: int, world: int, out: str, opt: str) -> None:
    """OuterSync against the reference round: two fragments, several rounds, the end of fit."""
    factories = {**FACTORIES, "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-2)}
    fragments = [["p0", "p2"], ["p1", "p3"]]
    params, ref_params = _params(0), _params(0)
    transport = AllReduceTransport(None, num_islands=world, bucket_numel=7)
    outer = OuterSync(
        params,
        outer_optimizer=factories[opt],
        transport=transport,
        sync_every=2,
        streaming=StreamingOptions(fragments=fragments),
    )
    # Streamed where a per-bucket step exists; other optimizers hold the fragment.
    assert outer.streams == (opt != "rmsprop")
    ref = Reference(ref_params, factories[opt], transport)
    schedule = FragmentSchedule(sync_every=2, num_fragments=2)
    synced = [0, 0]
    for step in range(6):
        _train(params, rank, step)
        _train(ref_params, rank, step)
        outer.on_inner_step()
        sending = schedule.sends_at(step + 1)
        if sending is not None:
            ref.round(fragments[sending], 0.0)
            synced[sending] = step + 1
    assert len(outer.finish()) == 1  # the end-of-fit round of the fragment synced at step 5
    for fragment, at in enumerate(synced):
        if at != 6:
            ref.round(fragments[fragment], 0.0)
    results = {
        False: [ref_params, ref.anchors, ref.optimizer.state_dict()],
        True: [params, outer.anchors, outer.state_dict()["outer_optimizer"]],
    }
    torch.save(results, Path(out) / f"{rank}.pt")


@pytest.mark.parametrize("opt", ["nesterov", "adamw", "rmsprop"])
def test_outer_sync_rounds_equal_the_reference_rounds(tmp_path: Path, opt: str) -> None:
    run_ranks(_outer_sync_worker, 2, str(tmp_path), opt)
    for rank in range(2):
        saved = torch.load(tmp_path / f"{rank}.pt")
        (old_params, old_anchors, old_state), (new_params, new_anchors, new_state) = (
            saved[False],
            saved[True],
        )
        for name in old_params:
            assert torch.equal(old_params[name], new_params[name]), name
            assert torch.equal(old_anchors[name], new_anchors[name]), name
            assert not torch.equal(old_anchors[name], _params(0)[name])
        old_ids = [i for group in old_state["param_groups"] for i in group["params"]]
        new_ids = [i for group in new_state["param_groups"] for i in group["params"]]
        assert len(old_ids) == len(new_ids)
        for old_id, new_id in zip(old_ids, new_ids, strict=True):
            for key, value in old_state["state"][old_id].items():
                assert torch.equal(value, new_state["state"][new_id][key]), (old_id, key)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("opt", ["nesterov", "adamw"])
def test_cuda_streamed_round_with_cpu_anchors_matches_the_cpu_round(opt: str) -> None:
    """Parameters on the GPU, anchors on the CPU: pinned anchors and state, side-stream copies.

    The reference is the same round on CPU copies of the same parameters. GPU and CPU
    kernels may round a fused multiply-add differently, so this compares to 1e-6, not bits.
    """
    results = {}
    for device in ("cpu", "cuda"):
        params = {n: torch.nn.Parameter(p.detach().to(device)) for n, p in _params(0).items()}
        outer = OuterSync(
            params,
            outer_optimizer=FACTORIES[opt],
            transport=AllReduceTransport(None, num_islands=1, bucket_numel=7),
            sync_every=1,
        )
        for step in range(4):
            with torch.no_grad():
                for p in params.values():
                    p.add_(0.01 * (step + 1))
            outer.on_inner_step()
        if device == "cuda":
            assert all(a.is_pinned() for a in outer.anchors.values())
            assert outer.streams
            assert outer.engine.buffer_bytes() > 0
        results[device] = (
            {n: p.detach().cpu() for n, p in params.items()},
            {n: a.clone() for n, a in outer.anchors.items()},
        )
    for name in results["cpu"][0]:
        for i in range(2):
            torch.testing.assert_close(
                results["cuda"][i][name], results["cpu"][i][name], rtol=1e-6, atol=1e-7
            )


def test_the_default_configuration_takes_the_streamed_round() -> None:
    """The strategy's defaults (all-reduce, outer SGD Nesterov, no delay) must stream: a
    transport that stops offering the bucket mean would silently fall back to the slow path."""
    from lightning_swarm.config import SwarmConfig
    from lightning_swarm.outer.loop import transport_for
    from lightning_swarm.outer.sync import default_outer_optimizer

    config = SwarmConfig()
    transport = transport_for(
        config, None, num_islands=1, island_index=0, device=torch.device("cpu")
    )
    assert isinstance(transport, Transport) and transport.pipelined
    outer = OuterSync(
        _params(0),
        outer_optimizer=default_outer_optimizer,
        transport=transport,
        sync_every=config.sync_every,
    )
    assert outer.streams and outer.engine.kind() == "sgd"


def _float32(anchor: Tensor) -> Tensor:
    return torch.zeros(anchor.shape, dtype=torch.float32)


class _NoStream:
    """A stand-in CUDA stream/event: on the CPU every copy is already complete."""

    def __init__(self, *args: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("opt", ["nesterov", "adamw"])
def test_the_staged_path_run_on_the_cpu_matches_the_local_path_bitwise(
    monkeypatch: pytest.MonkeyPatch, opt: str, dtype: torch.dtype
) -> None:
    """CudaStaging's bucket schedule (slots, copy in, compute, copy out) with no-op streams, so
    that its bookkeeping is checked without a GPU: bitwise the CPU path's anchors, state, norm."""
    import contextlib

    from lightning_swarm.algorithm.outer_optimizer import ensure_state, groups_by_param
    from lightning_swarm.outer.bucket_step import BucketJob

    monkeypatch.setattr(torch.cuda, "Event", _NoStream)
    monkeypatch.setattr(torch.cuda, "Stream", _NoStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: _NoStream())
    kind = "sgd" if opt == "nesterov" else "adam"
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=7)
    results = []
    for staged in (False, True):
        params = _params(0)
        anchors = [p.detach().to(dtype=dtype, copy=True) for p in params.values()]
        optimizer = FACTORIES[opt](anchors)
        engine = OuterSync(
            params, outer_optimizer=FACTORIES[opt], transport=transport, sync_every=1
        ).engine
        staging = engine.staging

        def exchange(flat: Tensor, bucket: list[Piece]) -> int:
            return transport.start(Bucket(flat, tuple(p.length for p in bucket))).wait()

        for step in range(3):
            _train(params, 0, step)
            groups = groups_by_param(optimizer)
            fresh = [ensure_state(optimizer, a, kind, groups[id(a)], _float32) for a in anchors]
            if kind == "adam":
                for anchor in anchors:
                    optimizer.state[anchor]["step"] += 1
            job = BucketJob(
                list(params.values()), anchors, optimizer, kind, groups, fresh, 0.25, step
            )
            # Both paths on the staged (budgeted) buckets, so that the norm's sums line up too.
            staged_numel = staging.bucket_numel_for(job, 7)
            assert 1 <= staged_numel < 7  # a slot costs more than the transport bucket
            plan = plan_buckets([p.numel() for p in params.values()], staged_numel)
            if staged:
                delta = engine._buffer(numel_of(plan[0]), job.device)
                result = staging.run(job, plan, exchange, delta)
            else:
                result = engine._pipelined(job, plan)
        if staged:  # slots + pseudo-gradient buffer within three float32 transport buckets
            assert 0 < engine.buffer_bytes() <= 3 * 7 * 4
        state = [t for a in anchors for t in optimizer.state[a].values() if t.dim() > 0]
        results.append(([*params.values(), *anchors, *state], result.norm))
    (local, local_norm), (staged_out, staged_norm) = results
    assert local_norm == staged_norm
    assert len(local) == len(staged_out)
    for a, b in zip(local, staged_out, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(
    ("anchor", "param", "num_state", "maximize", "per_element"),
    [
        (torch.float32, torch.float32, 0, False, 12),  # SGD without momentum: a whole bucket
        (torch.float32, torch.float32, 1, False, 20),  # SGD with momentum
        (torch.float32, torch.float32, 2, False, 28),  # Adam / AdamW
        (torch.float32, torch.bfloat16, 1, False, 22),  # merge casts the anchor to bf16
        (torch.bfloat16, torch.float32, 1, False, 26),  # work copy + noise + rounded result
        (torch.float32, torch.float32, 1, True, 24),  # maximize: a negated gradient
    ],
)
def test_the_staged_working_set_stays_within_three_transport_buckets(
    anchor: torch.dtype, param: torch.dtype, num_state: int, maximize: bool, per_element: int
) -> None:
    from lightning_swarm.outer.staging import device_bytes_per_element, staged_bucket_numel

    assert device_bytes_per_element(anchor, param, num_state, maximize) == per_element
    bucket = 32 * 2**20 // 4  # the default 32 MiB of float32
    staged = staged_bucket_numel(bucket, per_element)
    assert staged <= bucket and staged * per_element <= 3 * bucket * 4
    assert (staged + 1) * per_element > 3 * bucket * 4 or staged == bucket  # the largest that fits
    with pytest.raises(ValueError, match="bucket_numel and bytes_per_element must be >= 1"):
        staged_bucket_numel(0, per_element)


def test_a_failed_streamed_round_keeps_the_old_error_feedback_residuals(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """int8 with error feedback streams; a transport failure after some buckets moved leaves
    the residuals of the last round that happened (the new ones were scratch)."""
    from lightning_swarm.algorithm.codecs import codec_for
    from lightning_swarm.transport import ReduceScatterTransport

    codec = codec_for("int8", 4)
    assert codec is not None
    transport = ReduceScatterTransport(
        None, num_islands=1, island_index=0, codec=codec, bucket_numel=8
    )
    params = _params(0)
    outer = OuterSync(
        params,
        outer_optimizer=FACTORIES["nesterov"],
        transport=transport,
        sync_every=1,
        streaming=StreamingOptions(codec=codec, error_feedback=True),
    )
    assert outer.streams
    _train(params, 0, 0)
    outer.on_inner_step()
    kept = {n: r.clone() for n, r in outer.residuals.items()}
    assert set(kept) == set(params) and any(r.abs().sum() > 0 for r in kept.values())
    started = []
    real_start = transport.start

    def failing_start(bucket: Bucket) -> Any:
        started.append(bucket)
        if len(started) == 3:
            raise RuntimeError("link lost")
        return real_start(bucket)

    monkeypatch.setattr(transport, "start", failing_start)
    _train(params, 0, 1)
    with pytest.raises(RuntimeError, match="link lost"):
        outer.on_inner_step()
    assert all(torch.equal(outer.residuals[n], kept[n]) for n in kept)
