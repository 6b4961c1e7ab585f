"""``transport.agree``: every rank returns the same agreement or raises the same error, over
real gloo groups."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from lightning_swarm.errors import DiskFullError, SwarmCheckpointError, SwarmError
from lightning_swarm.membership.errors import QuorumTimeoutError
from lightning_swarm.transport.agree import (
    agree,
    flags_direct,
    flags_over,
    objects_over,
    rebuild,
)
from tests.dist_utils import run_ranks


class NeedsTwoArguments(RuntimeError):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(f"{message} (code {code})")


def _record(out: Path, rank: int, result: dict[str, object]) -> None:
    (out / f"{rank}.json").write_text(json.dumps(result))


def _results(out: Path, world: int) -> list[dict[str, object]]:
    return [json.loads((out / f"{r}.json").read_text()) for r in range(world)]


def _outcome(fn, rank: int, out: Path) -> None:  # type: ignore[no-untyped-def]
    try:
        result = fn(rank)
    except Exception as err:
        cause = err.__cause__
        _record(
            out,
            rank,
            {
                "class": type(err).__name__,
                "message": str(err),
                "cause": None if cause is None else type(cause).__name__,
            },
        )
        return
    _record(out, rank, {"result": result})


def _all_ok(rank: int, world: int, out: Path) -> None:
    def step(rank: int) -> object:
        agreed = agree(gather=objects_over(), values=(rank, 2 * rank + 0.5), share=f"r{rank}")
        flag = agree(True, gather=flags_over(None, world, torch.device("cpu")))
        direct = agree(True, gather=flags_direct(None, world, torch.device("cpu")))
        ends = [flag.all_ok, direct.all_ok]
        return [agreed.all_ok, list(agreed.bad), list(agreed.sums), list(agreed.shares), *ends]

    _outcome(step, rank, out)


def test_every_rank_agrees_when_all_are_ok_and_sums_their_values(tmp_path: Path) -> None:
    run_ranks(_all_ok, 3, tmp_path, timeout_s=60)
    expected = [True, [], [3.0, 7.5], ["r0", "r1", "r2"], True, True]
    assert [r["result"] for r in _results(tmp_path, 3)] == [expected] * 3


def _one_fails(rank: int, world: int, out: Path) -> None:
    def step(rank: int) -> object:
        error = QuorumTimeoutError(f"rank {rank} waited too long") if rank == 1 else None
        return agree(rank != 1, gather=objects_over(), error=error).all_ok

    _outcome(step, rank, out)


def test_an_error_on_one_rank_is_raised_with_its_message_on_every_rank(tmp_path: Path) -> None:
    run_ranks(_one_fails, 3, tmp_path, timeout_s=60)
    seen = _results(tmp_path, 3)
    assert [(r["class"], r["message"]) for r in seen] == [
        ("QuorumTimeoutError", "rank 1 waited too long")
    ] * 3
    # The failing rank raises its own error (its traceback), the others a rebuilt one.
    assert [r["cause"] for r in seen] == [None, None, None]


def _two_fail(rank: int, world: int, out: Path) -> None:
    def step(rank: int) -> object:
        errors: dict[int, Exception] = {
            1: DiskFullError("no space left on device on rank 1"),
            2: PermissionError("rank 2 may not write"),
        }
        return agree(gather=objects_over(), error=errors.get(rank)).all_ok

    _outcome(step, rank, out)


def test_the_lowest_failing_rank_wins(tmp_path: Path) -> None:
    run_ranks(_two_fail, 3, tmp_path, timeout_s=60)
    seen = _results(tmp_path, 3)
    assert [(r["class"], r["message"]) for r in seen] == [
        ("DiskFullError", "no space left on device on rank 1")
    ] * 3
    # Rank 2 raises rank 1's error, chained to its own.
    assert [r["cause"] for r in seen] == [None, None, "PermissionError"]


def _unrebuildable(rank: int, world: int, out: Path) -> None:
    def step(rank: int) -> object:
        error = NeedsTwoArguments("the codec broke", 7) if rank == 0 else None
        return agree(gather=objects_over(), error=error).all_ok

    _outcome(step, rank, out)


def test_an_error_that_cannot_be_rebuilt_becomes_a_swarm_error_naming_it(tmp_path: Path) -> None:
    run_ranks(_unrebuildable, 2, tmp_path, timeout_s=60)
    seen = _results(tmp_path, 2)
    message = (
        "NeedsTwoArguments on rank 0: the codec broke (code 7) (raised on every rank as "
        "SwarmError, since tests.test_agree.NeedsTwoArguments cannot be rebuilt from its message)"
    )
    assert [(r["class"], r["message"]) for r in seen] == [("SwarmError", message)] * 2
    assert [r["cause"] for r in seen] == ["NeedsTwoArguments", None]


def _flags(rank: int, world: int, out: Path) -> None:
    def step(rank: int) -> object:
        cpu = torch.device("cpu")
        over = agree(rank != 2, gather=flags_over(None, world, cpu))
        direct = agree(rank == 0, gather=flags_direct(None, world, cpu))
        return [over.all_ok, list(over.bad), direct.all_ok, list(direct.bad)]

    _outcome(step, rank, out)


def test_flag_gathers_name_the_ranks_that_are_not_ok(tmp_path: Path) -> None:
    run_ranks(_flags, 3, tmp_path, timeout_s=60)
    assert [r["result"] for r in _results(tmp_path, 3)] == [[False, [2], False, [1, 2]]] * 3


def _cleanup_first(rank: int, world: int, out: Path) -> None:
    marker = out / f"cleaned-{rank}"

    def step(rank: int) -> object:
        error = SwarmCheckpointError("rank 0 could not read its file") if rank == 0 else None
        return agree(gather=objects_over(), error=error, before_raise=marker.touch).all_ok

    _outcome(step, rank, out)
    assert marker.exists()
    dist.barrier()


def test_before_raise_runs_on_every_rank_before_the_error(tmp_path: Path) -> None:
    run_ranks(_cleanup_first, 2, tmp_path, timeout_s=60)
    assert [r["class"] for r in _results(tmp_path, 2)] == ["SwarmCheckpointError"] * 2


def test_one_process_alone_raises_its_own_error_and_sums_its_own_values() -> None:
    assert not dist.is_initialized()
    error = ValueError("bad value")
    with pytest.raises(ValueError, match="bad value") as info:
        agree(gather=objects_over(), error=error)
    assert info.value is error
    agreed = agree(False, gather=objects_over(), values=(1.5,))
    assert (agreed.all_ok, agreed.bad, agreed.sums) == (False, (0,), (1.5,))


def test_rebuild_keeps_swarm_and_builtin_classes_with_their_messages() -> None:
    disk = rebuild(("lightning_swarm.errors", "DiskFullError", "disk full on x"), 3)
    assert type(disk) is DiskFullError and str(disk) == "disk full on x"
    key = rebuild(("builtins", "KeyError", "'k'"), 1)  # str(KeyError) quotes: not its message
    assert type(key) is SwarmError
    assert str(key).startswith("KeyError on rank 1: 'k' (raised on every rank as SwarmError")
    unknown = rebuild(("somewhere", "Gone", "text"), 2)
    assert type(unknown) is SwarmError and "somewhere.Gone cannot be rebuilt" in str(unknown)


def test_a_flag_gather_refuses_what_it_cannot_carry() -> None:
    with pytest.raises(AssertionError, match="use objects_over"):
        agree(gather=flags_over(None, 1, torch.device("cpu")), error=ValueError("x"))
