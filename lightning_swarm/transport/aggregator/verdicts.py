"""The verdicts of a swarm round, read from a table every island holds.

Each owner measured its shard of every contribution; one all-gather of their rows (``[how it
fared, finite per island..., sum of squares per island...]``) gives every rank the same table,
so every rank derives the same verdicts and outcome: a mismatched island (``terms``) or one
non-finite on any owner is rejected; ``max_norm`` bounds the whole contribution's norm; too
few accepted islands (or zero accepted weights) skip the round with the same warning everywhere.
"""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.round_status import (
    AggregatorOutcome,
    RoundReport,
    peer_failure_message,
    skip_message,
)
from lightning_swarm.transport.aggregator.terms import (
    AggregationRule,
    agree_island,
    elsewhere_message,
)
from lightning_swarm.transport.errors import SwarmRoundError

log = logging.getLogger(__name__)

SPOOL_FAILED, JUDGED, FAILED = 0.0, 1.0, 2.0  # column 0 of an owner's row


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
) -> AggregatorOutcome:
    """Fill ``report`` (accepted, rejected, non_finite, outcome) from ``table`` (one row per
    owner: ``[how it fared, finite per island..., sum of squares per island...]``).
    ``failure`` is this island's own error, ``owner`` the round's one owner (``None``: every
    island owns a shard), ``where`` this island's own finding of where a non-finite value sat.
    With ``island_group`` (a model-sharded island) the peer groups' findings are combined over
    the island first (``terms.agree_island``): one verdict per island, ``max_norm`` on the
    island's norm.

    Raises:
        SwarmRoundError: some owner's spool failed or its validation raised; the owner whose
            validation raised re-raises its own exception.
    """
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
        validated, islands = agree_island(found, n, island_group)
        finite, norms = [f for f, _ in islands], [norm for _, norm in islands]
    if raised:
        raise_if_failed(report, failure if island_index in raised else None, raised, owner=owner)
    if not failed and not validated and owner is not None:
        # One owner: the other peer groups of a model-sharded island whose round failed skip
        # it (no shard moves); the failing peer group's ranks raise.
        report.outcome = AggregatorOutcome.SKIPPED
        message = elsewhere_message(report.round_index, "the round failed")
        warnings.warn(message, RuntimeWarning, stacklevel=6)
        return report.outcome
    if failed or not validated:
        report.outcome = AggregatorOutcome.SPOOL_FAILED
        raise _spool_failed(report, failed, failure, owner, island_index)
    for island in range(n):
        problem = mismatched.get(island)
        if problem is None:
            if island_group is None:
                problem = rule.problem(finite[island], norms[island], where=where.get(island, ""))
            else:
                problem = rule.problem(
                    finite[island],
                    norms[island],
                    where=" or no payload in some shard",
                    over=" over the island's shards",
                )
        if problem is None:
            report.accepted.append(island)
            continue
        report.rejected[island] = problem
        if not finite[island] and island not in mismatched:
            report.non_finite.append(island)
        _log_rejection(report, island, island_index, owner, problem)
    if rule.skips(report.accepted):
        report.outcome = AggregatorOutcome.SKIPPED
        warnings.warn(skip_message(report, n, rule.min_contributions), RuntimeWarning, stacklevel=6)
    return report.outcome


def _log_rejection(
    report: RoundReport, island: int, island_index: int, owner: int | None, problem: str
) -> None:
    """The owner of a one-owner round logs every rejection; an island, its own."""
    if owner == island_index:
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
    """After the islands shared whether their validation or aggregation succeeded (``failed``
    lists those that did not; ``island_ok``: every peer group of a model-sharded island
    succeeded): the island whose own raised re-raises it; every other raises
    ``SwarmRoundError`` naming them. Nothing when every island succeeded."""
    if not failed and island_ok:
        return
    report.outcome = AggregatorOutcome.ERROR
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
