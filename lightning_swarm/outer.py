"""The outer loop of one inner optimizer's parameters: anchors, outer optimizer, counters.

``OuterSync`` ties the DiLoCo math (``lightning_swarm.algorithm``) to a ``Transport``. It knows
nothing of Lightning: the strategy calls ``on_inner_step`` after every real inner optimizer step
and gets a ``SyncReport`` back when an outer sync happened.

Ownership and lifetime:
- ``anchors`` are owned here: one tensor per trained parameter, on ``anchor_device`` in
  ``anchor_dtype``, created as a copy of the parameters at construction time. They are never
  aliased to the model's parameters.
- The outer optimizer is built over the anchors and owns its state (e.g. Nesterov momentum),
  which therefore lives on the anchor device too.
- Pseudo-gradients exist only during a sync: they are created, averaged by the transport,
  applied, and dropped. Between syncs this object holds anchors + outer state, nothing more.
- ``params`` are the model's live parameters, owned by the LightningModule; a sync overwrites
  them in place with the new anchors.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_swarm.algorithm import global_norm, merge_into_local, outer_step, pseudo_gradient
from lightning_swarm.transport.base import Transport

OuterOptimizerFactory = Callable[[Iterable[Tensor]], torch.optim.Optimizer]


@dataclass(frozen=True)
class SyncReport:
    """One outer sync as seen by this rank."""

    outer_steps: int
    inner_steps: int
    pseudo_grad_norm: float
    bytes_sent: int
    bytes_received: int
    wall_s: float
    applied: bool


class OuterSync:
    """DiLoCo outer state and sync for one set of parameters.

    Args:
        params: the trained parameters by name, in a fixed order identical on every rank.
        outer_optimizer: factory called once with the anchors.
        transport: averages pseudo-gradients across islands.
        sync_every: inner steps between outer syncs.
        anchor_device: device for anchors and outer optimizer state.
        anchor_dtype: dtype of the stored anchors.
    """

    def __init__(
        self,
        params: Mapping[str, torch.nn.Parameter],
        *,
        outer_optimizer: OuterOptimizerFactory,
        transport: Transport,
        sync_every: int,
        anchor_device: torch.device | str = "cpu",
        anchor_dtype: torch.dtype = torch.float32,
        defer_anchors: bool = False,
    ) -> None:
        self.params = dict(params)
        self.transport = transport
        self.sync_every = sync_every
        self.anchor_device = torch.device(anchor_device)
        self.anchor_dtype = anchor_dtype
        self._outer_optimizer_factory = outer_optimizer
        # A resume replaces the anchors right after setup: copying the weights first would add
        # the full anchor bytes to RAM at the tightest moment of a restart, so ``defer_anchors``
        # builds memory-less placeholders (meta device) that ``load_state_dict`` must replace;
        # a sync on placeholders fails loudly instead of training on half-loaded state.
        placement = "meta" if defer_anchors else anchor_device
        with torch.no_grad():
            self.anchors: dict[str, Tensor] = {
                name: p.detach().to(device=placement, dtype=anchor_dtype, copy=True)
                for name, p in self.params.items()
            }
        self.outer_optimizer = outer_optimizer(list(self.anchors.values()))
        if not isinstance(self.outer_optimizer, torch.optim.Optimizer):
            raise TypeError(
                "outer_optimizer must return a torch.optim.Optimizer, got "
                f"{type(self.outer_optimizer).__name__}; pass e.g. "
                "functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)."
            )
        self.inner_steps = 0
        self.outer_steps = 0

    @property
    def anchor_bytes(self) -> int:
        return sum(a.numel() * a.element_size() for a in self.anchors.values())

    def outer_state_bytes(self) -> int:
        """Bytes held by the outer optimizer's state tensors (e.g. momentum)."""
        total = 0
        for state in self.outer_optimizer.state.values():
            for value in state.values():
                if isinstance(value, Tensor):
                    total += value.numel() * value.element_size()
        return total

    def on_inner_step(self) -> SyncReport | None:
        """Count one inner step; run the outer sync when ``sync_every`` steps have passed."""
        self.inner_steps += 1
        if self.inner_steps % self.sync_every != 0:
            return None
        return self.sync()

    @torch.no_grad()
    def sync(self) -> SyncReport:
        """Average pseudo-gradients across islands, step the anchors, reset the locals."""
        start = time.perf_counter()
        deltas = {name: pseudo_gradient(self.anchors[name], p) for name, p in self.params.items()}
        stats = self.transport.average(deltas, round_index=self.outer_steps)
        norm = 0.0
        if stats.applied:
            norm = global_norm(list(deltas.values()))
            outer_step(self.outer_optimizer, list(self.anchors.values()), list(deltas.values()))
            self.outer_steps += 1
            for name, p in self.params.items():
                merge_into_local(p.data, self.anchors[name])
        # A skipped round keeps both anchors and locals: the island's progress is not thrown
        # away, it simply enters the next round's pseudo-gradient.
        del deltas
        return SyncReport(
            outer_steps=self.outer_steps,
            inner_steps=self.inner_steps,
            pseudo_grad_norm=norm,
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            wall_s=time.perf_counter() - start,
            applied=stats.applied,
        )

    def state_dict(self) -> dict[str, Any]:
        """Anchors, outer optimizer state and counters (tensors stay on the anchor device)."""
        return {
            "anchors": dict(self.anchors),
            "outer_optimizer": self.outer_optimizer.state_dict(),
            "inner_steps": self.inner_steps,
            "outer_steps": self.outer_steps,
        }

    @property
    def anchors_deferred(self) -> bool:
        """True while the anchors are placeholders awaiting ``load_state_dict``."""
        return any(a.device.type == "meta" for a in self.anchors.values())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Install anchors, outer optimizer state and counters saved by ``state_dict``.

        The given anchor tensors are adopted, not copied, when they already have this object's
        anchor device and dtype: memory-mapped anchors stay file-backed until a sync writes
        them. Otherwise they are converted (e.g. a float32 file resumed with bfloat16 anchors).
        The outer optimizer is rebuilt over the new anchors, then given the saved state.

        Raises:
            ValueError: a parameter has no anchor, or an anchor of the wrong shape.
        """
        anchors: Mapping[str, Tensor] = state["anchors"]
        for name, p in self.params.items():
            if name not in anchors or tuple(anchors[name].shape) != tuple(p.shape):
                found = tuple(anchors[name].shape) if name in anchors else "no anchor"
                raise ValueError(
                    f"saved anchors do not fit parameter {name!r} (shape {tuple(p.shape)}, "
                    f"saved {found}); resume with the model the checkpoint was written by."
                )
        self.anchors = {
            name: anchors[name].to(device=self.anchor_device, dtype=self.anchor_dtype)
            for name in self.params
        }
        self.outer_optimizer = self._outer_optimizer_factory(list(self.anchors.values()))
        self.outer_optimizer.load_state_dict(state["outer_optimizer"])
        self.inner_steps = int(state["inner_steps"])
        self.outer_steps = int(state["outer_steps"])
