"""The verdicts of a swarm round, read by every rank from one table of the owners' rows
(``[how it fared, finite per island..., sum of squares per island...]``), so every rank derives
the same ``RoundReport`` and messages.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import dataclass, field
from typing import Literal

import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.terms import (
    AggregationRule,
    agree_island,
    elsewhere_message,
)
from lightning_swarm.transport.errors import SwarmRoundError

log = logging.getLogger(__name__)

SPOOL_FAILED, JUDGED, FAILED = 0.0, 1.0, 2.0  # column 0 of an owner's row


Outcome = Literal["applied", "skipped", "spool_failed", "error"]


@dataclass
class RoundReport:
    """How one round ended on this rank, the same ``outcome``, ``accepted`` and ``non_finite``
    on every rank: ``"applied"`` (the aggregate is in every island's tensors), ``"skipped"``
    (too few accepted contributions, or weights summing to 0), ``"spool_failed"`` (the spool
    could not be written or read) or ``"error"`` (anything else raised on an owner); anchors
    are unchanged unless applied. ``rejected``: island -> why."""

    round_index: int
    aggregator: int
    outcome: Outcome = "applied"
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    non_finite: list[int] = field(default_factory=list)


def peer_failure_message(report: RoundReport) -> str:
    head = f"swarm round {report.round_index} failed on the aggregator (island {report.aggregator})"
    if report.outcome == "error":
        return (
            f"{head}: it raised an error while validating or aggregating; read island "
            f"{report.aggregator}'s log for the cause. Anchors are unchanged."
        )
    return (
        f"{head}: it could not spool the contributions (disk full, unwritable spool_dir, or a "
        "truncated/corrupt spool file; its own error says which). Anchors are unchanged."
    )


def read_verdicts(
    table: Tensor,
    rule: AggregationRule,
    report: RoundReport,
    island_index: int,
    failure: BaseException | None,
    *,
    owner: int | None,
    mismatched: dict[int, str],
    where: dict[int, str],
    island_group: dist.ProcessGroup | None = None,
) -> None:
    """Fill ``report`` from ``table`` (``failure``: this island's own error; ``owner``: ``None``
    when every island owns a part; ``where``: this island's finding of where a non-finite value
    sat); with ``island_group`` the peer groups' findings are combined first, one verdict per
    island. Raises ``SwarmRoundError`` when some owner's spool failed or its validation raised
    (that owner re-raises its own exception)."""
    n = table.shape[0]
    failed = [j for j in range(n) if table[j, 0] == SPOOL_FAILED]
    raised = [j for j in range(n) if table[j, 0] == FAILED]
    finite = [not bool((table[:, 1 + i] == 0.0).any()) for i in range(n)]
    norms = [float(table[:, 1 + n + i].sum().sqrt()) for i in range(n)]
    validated = True
    if island_group is not None:
        found = None
        if not failed and not raised:
            found = {i: (finite[i], float(table[:, 1 + n + i].sum())) for i in range(n)}
        validated, finite, norms = agree_island(found, n, island_group)
    if raised:
        raise_if_failed(report, failure if island_index in raised else None, raised, owner=owner)
    if not failed and not validated and owner is not None:
        # One owner: the other peer groups of a model-sharded island whose round failed skip
        # it (no model shard moves); the failing peer group's ranks raise.
        report.outcome = "skipped"
        message = elsewhere_message(report.round_index, "the round failed")
        warnings.warn(message, RuntimeWarning, stacklevel=6)
        return
    if failed or not validated:
        report.outcome = "spool_failed"
        raise _spool_failed(report, failed, failure, owner, island_index)
    over = "" if island_group is None else " over the island's shards"
    for island in range(n):
        here = where.get(island, "") if island_group is None else " or no payload in some shard"
        problem = mismatched.get(island) or rule.problem(
            finite[island], norms[island], where=here, over=over
        )
        if problem is None:
            report.accepted.append(island)
            continue
        report.rejected[island] = problem
        if not finite[island] and island not in mismatched:
            report.non_finite.append(island)
        if owner == island_index:  # the owner logs every rejection; an island, its own
            log.warning(
                "swarm round %d: contribution of island %d rejected: %s; aggregating without it",
                report.round_index,
                island,
                problem,
            )
        elif island == island_index:
            log.warning(
                "swarm round %d: the aggregator rejected this island's contribution (%s)",
                report.round_index,
                problem,
            )
    accepted = report.accepted
    if not rule.skips(accepted):
        return
    report.outcome = "skipped"
    if len(accepted) < rule.min_contributions:
        cause = (
            f"{len(accepted)} of {n} contributions were accepted, fewer than "
            f"min_contributions={rule.min_contributions}"
        )
    else:
        cause = (
            f"the accepted islands {accepted} have island_weights summing to 0, so "
            "weighted_mean has nothing to average"
        )
    message = (
        f"swarm round {report.round_index} skipped: {cause}; anchors are unchanged (see the "
        "aggregator's log for the rejected islands)"
    )
    warnings.warn(message, RuntimeWarning, stacklevel=6)


def _spool_failed(
    report: RoundReport,
    failed: list[int],
    failure: BaseException | None,
    owner: int | None,
    island_index: int,
) -> SwarmRoundError:
    if not failed:
        return SwarmRoundError(elsewhere_message(report.round_index, "the spool failed"))
    if owner is not None and island_index == owner:
        message = (
            f"swarm round {report.round_index} failed on this aggregator (island {owner}): "
            f"{failure}. Anchors are unchanged."
        )
    elif owner is not None:
        message = peer_failure_message(report)
    else:
        message = (
            f"swarm round {report.round_index}: the spool failed on island(s) {failed} "
            f"({failure if failure is not None else 'see their logs'}). Anchors are unchanged."
        )
    error = SwarmRoundError(message)
    error.__cause__ = failure
    return error


def raise_if_failed(
    report: RoundReport,
    error: BaseException | None,
    failed: list[int],
    island_ok: bool = True,
    *,
    owner: int | None,
) -> None:
    """Once the islands shared whether their validation or aggregation succeeded (``failed``:
    those that did not; ``island_ok``: every peer group of a model-sharded island did): the
    island whose own raised re-raises it, every other raises ``SwarmRoundError``."""
    if not failed and island_ok:
        return
    report.outcome = "error"
    if not failed:
        raise SwarmRoundError(elsewhere_message(report.round_index, "aggregation failed"))
    if error is not None:
        raise error
    if owner is not None:
        raise SwarmRoundError(peer_failure_message(report))
    raise SwarmRoundError(
        f"swarm round {report.round_index}: aggregation failed on island(s) {failed} "
        "(their logs say why). Anchors are unchanged."
    )
