"""The swarm round's vocabulary and its two control messages, laid out in one place.

One vocabulary for how a round ended (``AggregatorOutcome``) and what the aggregator thought of each
island's contribution (``Verdict``); ``RoundReport`` is what a rank knows of its last round.

Two messages travel besides the payloads, both flat int64 tensors whose layout is defined only
here (``FIELDS`` names them in wire order; the byte sizes follow from it):
- ``Descriptor`` (peer -> aggregator, before the payload): the description's length, the
  payload's bytes and the peer's chunk size.
- ``RoundStatus`` (aggregator -> each peer, after validation): the outcome, the result's bytes
  and chunk size, then one verdict per island in island order.
Both come from untrusted peers: ``from_tensor`` maps unknown codes to a ``ValueError``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import Tensor

_WIRE_DTYPE = torch.int64
_FIELD_BYTES = torch.empty((), dtype=_WIRE_DTYPE).element_size()


class AggregatorOutcome(enum.IntEnum):
    """How a round ended, the same word on every rank."""

    APPLIED = 0  # the aggregate is in every accepted island's tensors
    SKIPPED = 1  # too few accepted contributions (or weights summing to 0): anchors unchanged
    SPOOL_FAILED = 2  # the spool could not be written or read
    ERROR = 3  # anything else raised on the aggregator once the payloads were in


class Verdict(enum.IntEnum):
    """The aggregator's verdict on one island's contribution."""

    ACCEPTED = 0
    NON_FINITE = 1
    ABOVE_NORM = 2
    BAD_LAYOUT = 3

    @property
    def text(self) -> str:
        return _VERDICT_TEXT[self]


_VERDICT_TEXT = {
    Verdict.ACCEPTED: "accepted",
    Verdict.NON_FINITE: "non-finite values",
    Verdict.ABOVE_NORM: "norm above max_norm",
    Verdict.BAD_LAYOUT: "payload layout differs from the aggregator's",
}


@dataclass
class RoundReport:
    """What this rank knows about one round (the aggregator also knows why islands were
    rejected; every rank knows which were accepted)."""

    round_index: int
    aggregator: int
    outcome: AggregatorOutcome = AggregatorOutcome.APPLIED
    accepted: list[int] = field(default_factory=list)
    rejected: dict[int, str] = field(default_factory=dict)
    # Islands rejected for NaN or inf: every rank learns it from the status's verdicts.
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


def _decode(values: list[int], kind: type[enum.IntEnum], what: str) -> list[enum.IntEnum]:
    try:
        return [kind(v) for v in values]
    except ValueError as err:
        raise ValueError(f"malformed {what} from a peer: {err}") from err


@dataclass(frozen=True)
class Descriptor:
    """What a peer announces before its payload."""

    FIELDS: ClassVar[tuple[str, ...]] = ("description_len", "data_bytes", "chunk_bytes")
    NBYTES: ClassVar[int] = len(FIELDS) * _FIELD_BYTES

    description_len: int
    data_bytes: int
    chunk_bytes: int

    @classmethod
    def empty(cls) -> Tensor:
        return torch.empty(len(cls.FIELDS), dtype=_WIRE_DTYPE)

    def to_tensor(self) -> Tensor:
        return torch.tensor([getattr(self, f) for f in self.FIELDS], dtype=_WIRE_DTYPE)

    @classmethod
    def from_tensor(cls, t: Tensor) -> Descriptor:
        values = [int(v) for v in t.tolist()]
        if any(v < 0 for v in values):
            raise ValueError(f"malformed payload descriptor from a peer: {values}")
        return cls(*values)


@dataclass(frozen=True)
class RoundStatus:
    """The aggregator's answer to every peer."""

    HEADER: ClassVar[tuple[str, ...]] = ("outcome", "result_bytes", "result_chunk_bytes")

    outcome: AggregatorOutcome
    result_bytes: int
    result_chunk_bytes: int
    verdicts: tuple[Verdict, ...]

    @classmethod
    def nbytes(cls, num_islands: int) -> int:
        return (len(cls.HEADER) + num_islands) * _FIELD_BYTES

    @classmethod
    def empty(cls, num_islands: int) -> Tensor:
        return torch.empty(len(cls.HEADER) + num_islands, dtype=_WIRE_DTYPE)

    @property
    def accepted(self) -> list[int]:
        return [i for i, v in enumerate(self.verdicts) if v == Verdict.ACCEPTED]

    def to_tensor(self) -> Tensor:
        head = [int(self.outcome), self.result_bytes, self.result_chunk_bytes]
        return torch.tensor(head + [int(v) for v in self.verdicts], dtype=_WIRE_DTYPE)

    @classmethod
    def from_tensor(cls, t: Tensor) -> RoundStatus:
        values = [int(v) for v in t.tolist()]
        n = len(cls.HEADER)
        (outcome,) = _decode(values[:1], AggregatorOutcome, "round status")
        verdicts = _decode(values[n:], Verdict, "round status")
        return cls(
            AggregatorOutcome(outcome), values[1], values[2], tuple(Verdict(v) for v in verdicts)
        )
