"""Errors of a round that could not average the islands' pseudo-gradients: each a ``SwarmError``
that keeps the builtin base callers already catch."""

from __future__ import annotations

from lightning_swarm.errors import SwarmError


class NonFinitePseudoGradientError(SwarmError, ValueError):
    """Some island's pseudo-gradient holds NaN or inf; the round was not run anywhere."""


class LayoutMismatchError(SwarmError, ValueError):
    """Ranks that a round pairs up hold other slices of its parameters (their model layouts
    differ); the round was not run anywhere."""


class BadWorkError(SwarmError, ValueError):
    """An island's weight in a time-budgeted round (its inner steps since the last round) is
    not a whole number from 0 to its inner steps; the round was not run anywhere."""


class SwarmRoundError(SwarmError, RuntimeError):
    """A swarm round failed on the aggregator (spool trouble or an error while validating or
    aggregating); anchors must stay unchanged."""


class SpoolError(SwarmError, RuntimeError):
    """A spool file could not be written or read; the round cannot use it."""
