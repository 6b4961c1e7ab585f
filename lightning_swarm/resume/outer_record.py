"""``OuterRecord``: an ``OuterSync``'s global state, the one form checkpoints and heals share.
``to_dict`` gives the plain dict both store or send; tensors are never copied."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from torch import Tensor


@dataclass(frozen=True)
class OuterCounters:
    """Inner steps, applied rounds and the end-of-fit marks (None where a save lacks them)."""

    inner_steps: int
    outer_steps: int
    fragment_rounds: list[int] | None = None
    synced_at: list[int | None] | None = None
    ended_at: int | None = None
    merged_at: list[int | None] | None = None


_CAST = {"int": int, "float": float, "bool": bool, "dict[str, Tensor]": dict}


@dataclass(frozen=True)
class PendingRound:
    """A round in flight as saved: its deltas hold the averaged result, ready to apply.
    ``share_norm`` is None unsharded; sharded, whether ``norm`` covers this share only."""

    fragment: int
    send_step: int
    deltas: dict[str, Tensor]
    applied: bool
    norm: float
    bytes_sent: int
    bytes_received: int
    transport_s: float
    share_norm: bool | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.share_norm is None:
            del out["share_norm"]
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PendingRound:
        # Each required field read as its declared type (the annotations are strings here).
        required = {f.name: _CAST[str(f.type)](data[f.name]) for f in fields(cls)[:-1]}
        share_norm = data.get("share_norm")
        return cls(**required, share_norm=None if share_norm is None else bool(share_norm))


@dataclass(frozen=True)
class OuterRecord:
    """Anchors, outer optimizer state, counters, a round in flight and, sharded, the share.
    ``param_names`` (sharded) orders the positional outer optimizer state; ``share`` (a heal
    from a sharded rank) is that rank's (position, island size). A heal has no ``pending``."""

    anchors: dict[str, Tensor]
    outer_optimizer: dict[str, Any]
    counters: OuterCounters
    pending: PendingRound | None = None
    param_names: list[str] | None = None
    share: tuple[int, int] | None = None
    # The saving rank's layout of its anchors (``algorithm.model_layout``, plain lists): which
    # slice of each parameter they are; None in saves written before slices were recorded.
    layout: dict[str, list[Any]] | None = None

    @property
    def names(self) -> list[str]:
        return list(self.param_names) if self.param_names else list(self.anchors)

    def to_dict(self) -> dict[str, Any]:
        c = self.counters
        out: dict[str, Any] = {
            "anchors": self.anchors,
            "outer_optimizer": self.outer_optimizer,
            "inner_steps": c.inner_steps,
            "outer_steps": c.outer_steps,
            "fragment_rounds": c.fragment_rounds,
            "pending": None if self.pending is None else self.pending.to_dict(),
            "synced_at": c.synced_at,
            "ended_at": c.ended_at,
            "merged_at": c.merged_at,
        }
        if self.param_names is not None:
            out["param_names"] = self.param_names
        if self.share is not None:
            out["share"] = list(self.share)
        if self.layout is not None:
            out["layout"] = self.layout
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> OuterRecord:
        """Read a dict of ``to_dict``'s layout; ``KeyError`` when a required key is missing."""
        rounds, synced = data.get("fragment_rounds"), data.get("synced_at")
        ended, merged = data.get("ended_at"), data.get("merged_at")
        counters = OuterCounters(
            inner_steps=int(data["inner_steps"]),
            outer_steps=int(data["outer_steps"]),
            fragment_rounds=None if rounds is None else [int(v) for v in rounds],
            synced_at=None if synced is None else [None if v is None else int(v) for v in synced],
            ended_at=None if ended is None else int(ended),
            merged_at=None if merged is None else [None if v is None else int(v) for v in merged],
        )
        pending, names, share = data.get("pending"), data.get("param_names"), data.get("share")
        return cls(
            anchors=dict(data["anchors"]),
            outer_optimizer=data["outer_optimizer"],
            counters=counters,
            pending=None if pending is None else PendingRound.from_dict(pending),
            param_names=None if names is None else [str(n) for n in names],
            share=None if share is None else (int(share[0]), int(share[1])),
            layout=data.get("layout"),
        )

    @classmethod
    def of(cls, state: Mapping[str, Any] | OuterRecord) -> OuterRecord:
        """``state`` as a record (read by ``from_dict`` when it is a dict)."""
        return state if isinstance(state, OuterRecord) else cls.from_dict(state)
