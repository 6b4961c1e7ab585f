"""Agree on a failure across ranks, then raise it on every rank.

One gather brings every rank's outcome (ok or its error, numbers to sum, an object to share) to
every rank; every rank then raises the lowest failing rank's error or returns the same
``Agreement``. A rank that failed must still call ``agree``.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lightning_swarm.errors import SwarmError


@dataclass(frozen=True)
class Outcome:
    """One rank's outcome, as it travels. ``error`` is ``(module, qualname, message)``."""

    ok: bool
    error: tuple[str, str, str] | None = None
    values: tuple[float, ...] = ()
    share: Any = None


Gather = Callable[[Outcome], Sequence[Outcome]]
"""Every rank's ``Outcome`` on every rank, in the group's order (collective)."""


@dataclass(frozen=True)
class Agreement:
    """What every rank agreed on, the same on each: whether ``all_ok``, the group positions of
    the ``bad`` ranks, the element-wise ``sums`` of every rank's values, and every rank's
    ``shares`` and ``values`` in the group's order."""

    all_ok: bool
    bad: tuple[int, ...]
    sums: tuple[float, ...]
    shares: tuple[Any, ...]
    values: tuple[tuple[float, ...], ...] = ()


def agree(
    ok: bool = True,
    *,
    gather: Gather,
    error: Exception | None = None,
    values: Sequence[float] = (),
    share: Any = None,
    before_raise: Callable[[], None] | None = None,
) -> Agreement:
    """Agree on every rank's outcome (``ok``, or the ``error`` it failed with) through the
    collective ``gather``; raise the lowest failing rank's error on every rank.

    Args:
        values: numbers to sum across ranks (the same count on every rank).
        share: an object every rank receives (object gathers only).
        before_raise: runs on every rank when an error is to be raised, after every rank's
            outcome is in (e.g. to remove a failed save's files before a launcher that sees
            one rank fail ends the others).

    Raises:
        Exception: the lowest failing rank's error, with its class and message where
            ``rebuild`` can make it, else a ``SwarmError`` naming class, rank and message (the
            failing rank chains its own error to it).
    """
    wire = None if error is None else _describe(error)
    outcomes = gather(Outcome(ok and error is None, wire, tuple(float(v) for v in values), share))
    bad = tuple(i for i, o in enumerate(outcomes) if not o.ok)
    failed = next(((i, o.error) for i, o in enumerate(outcomes) if o.error is not None), None)
    if failed is not None:
        position, described = failed
        rebuilt = rebuild(described, position)
        if before_raise is not None:
            before_raise()
        if error is not None and _describe(error) == described and type(rebuilt) is type(error):
            raise error  # this rank's own: its traceback shows where it failed
        raise rebuilt from error
    width = len(outcomes[0].values) if outcomes else 0
    sums = tuple(sum(o.values[k] for o in outcomes) for k in range(width))
    shares = tuple(o.share for o in outcomes)
    return Agreement(not bad, bad, sums, shares, tuple(o.values for o in outcomes))


def rebuild(described: tuple[str, str, str], position: int) -> Exception:
    """The error ``described`` names, as ``cls(message)`` for a builtin or an imported
    ``SwarmError`` subclass that gives back that class and message; a ``SwarmError`` otherwise."""
    module, qualname, message = described
    cls = _known_classes().get((module, qualname))
    if cls is not None:
        try:
            error = cls(message)
        except Exception:  # a constructor that needs more than a message
            error = None
        if error is not None and type(error) is cls and str(error) == message:
            return error
    return SwarmError(
        f"{qualname} on rank {position}: {message} (raised on every rank as SwarmError, since "
        f"{module}.{qualname} cannot be rebuilt from its message)"
    )


def _describe(error: BaseException) -> tuple[str, str, str]:
    return (type(error).__module__, type(error).__qualname__, str(error))


def _known_classes() -> dict[tuple[str, str], type[Exception]]:
    known: dict[tuple[str, str], type[Exception]] = {}
    for name in dir(builtins):
        value = getattr(builtins, name)
        if isinstance(value, type) and issubclass(value, Exception):
            known[(value.__module__, value.__qualname__)] = value
    todo: list[type[Exception]] = [SwarmError]
    while todo:
        cls = todo.pop()
        known[(cls.__module__, cls.__qualname__)] = cls
        todo.extend(cls.__subclasses__())
    return known


def objects_over(group: dist.ProcessGroup | None = None) -> Gather:
    """``dist.all_gather_object`` over ``group`` (``None``: the default group; alone without
    torch.distributed). Carries everything."""

    def gather(outcome: Outcome) -> list[Outcome]:
        if not (dist.is_available() and dist.is_initialized()):
            return [outcome]
        out: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, outcome, group=group)
        return out

    return gather


def flags_over(group: dist.ProcessGroup | None, size: int, device: torch.device) -> Gather:
    """An all-gather over ``size`` ranks of one float64 row per rank on ``device`` (NCCL
    included): ``ok`` and the ``values`` (exact for whole numbers below 2**53), not errors or
    shares. One rank: no collective."""

    def gather(outcome: Outcome) -> list[Outcome]:
        if size <= 1:
            return [_flag_only(outcome)]
        row = _row(outcome, device)
        rows = [torch.empty_like(row) for _ in range(size)]
        dist.all_gather(rows, row, group=group)
        return [_outcome(r) for r in torch.stack(rows).cpu().tolist()]

    return gather


def flags_direct(group: dist.ProcessGroup | None, size: int, device: torch.device) -> Gather:
    """``flags_over`` in one step (``all_to_all_single`` instead of a ring of ``size - 1``
    steps): one message time over long-latency links whatever the ranks. A bare flag travels
    as one byte."""

    def gather(outcome: Outcome) -> list[Outcome]:
        if size <= 1:
            return [_flag_only(outcome)]
        if not outcome.values:
            _flag_only(outcome)
            mine = torch.full((size,), int(outcome.ok), dtype=torch.uint8, device=device)
            flags = torch.empty_like(mine)
            dist.all_to_all_single(flags, mine, group=group)
            return [Outcome(f == 1) for f in flags.tolist()]
        row = _row(outcome, device)
        rows = torch.empty(size * row.numel(), dtype=row.dtype, device=device)
        dist.all_to_all_single(rows, row.repeat(size), group=group)
        return [_outcome(r) for r in rows.view(size, -1).cpu().tolist()]

    return gather


def _flag_only(outcome: Outcome) -> Outcome:
    # A tensor carries no message: an error here would be lost on the other ranks.
    assert outcome.error is None and outcome.share is None, (
        "a flag gather carries ok and values only; use objects_over for errors or shares"
    )
    return outcome


def _row(outcome: Outcome, device: torch.device) -> torch.Tensor:
    _flag_only(outcome)
    return torch.tensor([float(outcome.ok), *outcome.values], dtype=torch.float64, device=device)


def _outcome(row: list[float]) -> Outcome:
    return Outcome(row[0] == 1.0, values=tuple(row[1:]))
