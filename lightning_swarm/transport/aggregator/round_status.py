"""The words of a swarm round: how it ended (``AggregatorOutcome``), what a rank knows of it
(``RoundReport``), and the messages every rank derives from them."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class AggregatorOutcome(enum.IntEnum):
    """How a round ended, the same word on every rank."""

    APPLIED = 0  # the aggregate is in every island's tensors
    SKIPPED = 1  # too few accepted contributions (or weights summing to 0): anchors unchanged
    SPOOL_FAILED = 2  # the spool could not be written or read
    ERROR = 3  # anything else raised on an owner once the payloads were in


@dataclass
class RoundReport:
    """What this rank knows about one round (every rank knows which islands were accepted and
    which were non-finite; a one-owner round's owner also knows where)."""

    round_index: int
    aggregator: int
    outcome: AggregatorOutcome = AggregatorOutcome.APPLIED
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    # Islands rejected for NaN or inf: every rank reads it from the verdict table.
    non_finite: list[int] = field(default_factory=list)


def bad_layout_message(report: RoundReport) -> str:
    """Why a peer whose layout the aggregator rejected raises."""
    return (
        f"swarm round {report.round_index}: this island's pseudo-gradient layout (names, "
        f"shapes, dtypes) differs from the aggregator's (island {report.aggregator}); its log "
        "names the first difference. Every island must train the same parameters with the same "
        "quantize and quantize_block_size."
    )


def peer_failure_message(report: RoundReport) -> str:
    """What a peer raises when the aggregator reports ``ERROR`` or ``SPOOL_FAILED``."""
    head = f"swarm round {report.round_index} failed on the aggregator (island {report.aggregator})"
    if report.outcome == AggregatorOutcome.ERROR:
        return (
            f"{head}: it raised an error while validating or aggregating; read island "
            f"{report.aggregator}'s log for the cause. Anchors are unchanged."
        )
    return (
        f"{head}: it could not spool the contributions (disk full, unwritable spool_dir, or a "
        "truncated/corrupt spool file; its own error says which). Anchors are unchanged."
    )


def skip_message(report: RoundReport, num_islands: int, min_contributions: int) -> str:
    """The warning of a ``SKIPPED`` round; every rank derives it from the same verdicts."""
    accepted = report.accepted
    if len(accepted) < min_contributions:
        cause = (
            f"{len(accepted)} of {num_islands} contributions were accepted, fewer than "
            f"min_contributions={min_contributions}"
        )
    else:
        cause = (
            f"the accepted islands {accepted} have island_weights summing to 0, so "
            "weighted_mean has nothing to average"
        )
    return (
        f"swarm round {report.round_index} skipped: {cause}; anchors are unchanged (see the "
        "aggregator's log for the rejected islands)"
    )
