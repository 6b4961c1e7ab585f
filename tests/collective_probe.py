"""Counts every torch.distributed call a rank makes, by fit phase and by whether it crosses islands.

``CollectiveProbe`` wraps the collective and point-to-point functions of ``torch.distributed``
(both the package's names and ``distributed_c10d``'s, which its object collectives call) in the
process it is installed in, before Lightning forks or spawns its ranks. A callback of the same
object tracks the phase of the fit (``train``, ``validation``, ``round``); the rounds are marked
by wrapping the strategy's outer-loop entry points. At the end of the fit each rank writes its
records to ``<out>/rank<r>.json``.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from lightning_swarm.between_rounds import IslandSigterm
from lightning_swarm.outer import OuterLoop

COLLECTIVES = (
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
)

_PHASE = {"name": "setup", "depth": 0}
_RECORDS: list[dict[str, Any]] = []


def _ranks_of(name: str, bound: inspect.BoundArguments) -> set[int]:
    """The global ranks a call talks to (its group's, or the two ends of a point-to-point)."""
    args = bound.arguments
    if name in ("send", "isend"):
        return {dist.get_rank(), int(args["dst"])}
    if name in ("recv", "irecv") and args.get("src") is not None:
        return {dist.get_rank(), int(args["src"])}
    group = args.get("group")
    return set(dist.get_process_group_ranks(group if group is not None else c10d.GroupMember.WORLD))


def _wrap(name: str, original: Callable[..., Any], island_size: int) -> Callable[..., Any]:
    signature = inspect.signature(original)

    @functools.wraps(original)
    def call(*args: Any, **kwargs: Any) -> Any:
        if _PHASE["depth"] == 0:  # an object collective's inner calls are counted once
            bound = signature.bind(*args, **kwargs)
            islands = {r // island_size for r in _ranks_of(name, bound)}
            _RECORDS.append({"phase": _PHASE["name"], "call": name, "crosses": len(islands) > 1})
        _PHASE["depth"] += 1
        try:
            return original(*args, **kwargs)
        finally:
            _PHASE["depth"] -= 1

    return call


@contextlib.contextmanager
def _phase(name: str) -> Iterator[None]:
    before = _PHASE["name"]
    _PHASE["name"] = name
    try:
        yield
    finally:
        _PHASE["name"] = before


def _in_round(method: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(method)
    def call(*args: Any, **kwargs: Any) -> Any:
        with _phase("round"):
            return method(*args, **kwargs)

    return call


class CollectiveProbe(pl.Callback):
    """Install with ``install()`` in the launching process; add as a Trainer callback."""

    def __init__(self, out_dir: Path, island_size: int) -> None:
        self.out_dir = out_dir
        self.island_size = island_size
        self._undo: list[tuple[object, str, object]] = []

    def install(self) -> None:
        for module in (dist, c10d):
            for name in COLLECTIVES:
                original = getattr(module, name)
                self._undo.append((module, name, original))
                setattr(module, name, _wrap(name, original, self.island_size))
        # A round (every optimizer's, and the end-of-fit one) and the SIGTERM agreement it
        # starts are the only places a static swarm may cross islands while training.
        for owner, name in ((OuterLoop, "on_inner_step"), (OuterLoop, "finish")):
            self._undo.append((owner, name, getattr(owner, name)))
            setattr(owner, name, _in_round(getattr(owner, name)))
        self._undo.append((IslandSigterm, "on_round", IslandSigterm.on_round))
        IslandSigterm.on_round = _in_round(IslandSigterm.on_round)  # type: ignore[method-assign]

    def uninstall(self) -> None:
        for owner, name, original in reversed(self._undo):
            setattr(owner, name, original)
        self._undo.clear()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _RECORDS.clear()
        _PHASE["name"] = "train"

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _PHASE["name"] = "validation"

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _PHASE["name"] = "train"

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        _PHASE["name"] = "end"
        path = self.out_dir / f"rank{trainer.global_rank}.json"
        payload = {"steps": trainer.global_step, "records": _RECORDS}
        path.write_text(json.dumps(payload))
