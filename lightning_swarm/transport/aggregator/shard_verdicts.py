"""The verdicts of a sharded swarm round, read from a table every island holds.

Each owner judged one shard of every island's contribution; one all-gather of their rows gives
every rank the same table, so every rank derives the same verdicts and the same outcome with no
further message. Column 0 of the table says whether each owner's spool held; then one column
per island (its shard was finite on that owner) and one per island (the shard's sum of squares):

- non-finite on any owner rejects the island everywhere;
- ``max_norm`` compares the norm of the *whole* contribution (the square root of the shards'
  summed squares) with the bound;
- fewer accepted islands than ``min_contributions``, or accepted ``weighted_mean`` weights that
  sum to 0, skip the round on every rank with the same warning.

Torch only; the collectives are the caller's.
"""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist
from torch import Tensor

from lightning_swarm.transport.aggregator.island_verdicts import agree, elsewhere_message
from lightning_swarm.transport.aggregator.owners import AggregationRule
from lightning_swarm.transport.aggregator.round_status import (
    AggregatorOutcome,
    RoundReport,
    skip_message,
)
from lightning_swarm.transport.errors import SwarmRoundError

log = logging.getLogger("lightning_swarm.transport.aggregator.sharded")


def read_verdicts(
    table: Tensor,
    rule: AggregationRule,
    report: RoundReport,
    island_index: int,
    failure: Exception | None,
    island_group: dist.ProcessGroup | None = None,
) -> AggregatorOutcome:
    """Fill ``report`` (accepted, rejected, non_finite, outcome) from ``table`` (one row per
    owner: ``[spool held, finite per island..., sum of squares per island...]``); ``failure``
    is this island's own spool error, named in the message. With ``island_group`` (a
    model-sharded island) the peer groups' findings are combined over the island first
    (``island_verdicts.agree``): one verdict per island, ``max_norm`` on the island's norm.

    Raises:
        SwarmRoundError: some owner's spool failed (the outcome is ``SPOOL_FAILED``).
    """
    n = table.shape[0]
    failed = [j for j in range(n) if table[j, 0] == 0.0]
    finite = [not bool((table[:, 1 + i] == 0.0).any()) for i in range(n)]
    norms = [float(table[:, 1 + n + i].sum().sqrt()) for i in range(n)]
    validated = True
    if island_group is not None:
        found = (
            None if failed else {i: (finite[i], float(table[:, 1 + n + i].sum())) for i in range(n)}
        )
        validated, islands = agree(found, n, island_group)
        finite, norms = [f for f, _ in islands], [norm for _, norm in islands]
    if failed or not validated:
        report.outcome = AggregatorOutcome.SPOOL_FAILED
        if not failed:
            raise SwarmRoundError(elsewhere_message(report.round_index, "the spool failed"))
        raise SwarmRoundError(
            f"swarm round {report.round_index}: the spool failed on island(s) {failed} "
            f"({failure if failure is not None else 'see their logs'}). Anchors are unchanged."
        )
    for island in range(n):
        problem = rule.problem(finite[island], norms[island])
        if problem is None:
            report.accepted.append(island)
            continue
        report.rejected[island] = problem
        if not finite[island]:
            report.non_finite.append(island)
        if island == island_index:
            log.warning(
                "swarm round %d: this island's contribution was rejected (%s)",
                report.round_index,
                problem,
            )
    if rule.skips(report.accepted):
        report.outcome = AggregatorOutcome.SKIPPED
        warnings.warn(skip_message(report, n, rule.min_contributions), RuntimeWarning, stacklevel=6)
    return report.outcome


def raise_if_failed(
    report: RoundReport, error: Exception | None, failed: list[int], island_ok: bool = True
) -> None:
    """After the islands shared whether their aggregation succeeded (``failed`` lists those
    that did not; ``island_ok``: every peer group of a model-sharded island succeeded): the
    island whose own raised re-raises it; every other raises ``SwarmRoundError`` naming them.
    Nothing when every island succeeded."""
    if not failed and island_ok:
        return
    report.outcome = AggregatorOutcome.ERROR
    if not failed:
        raise SwarmRoundError(elsewhere_message(report.round_index, "aggregation failed"))
    if error is not None:
        raise error
    raise SwarmRoundError(
        f"swarm round {report.round_index}: aggregation failed on island(s) {failed} "
        "(their logs say why). Anchors are unchanged."
    )
