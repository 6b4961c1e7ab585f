"""One bucket's outer-step work: form ``anchor - local``, step SGD/Adam(W), merge.

A ``BucketJob`` lives for one round: it writes the caller's tensors in place through
``PieceView``s and owns only its bf16 rounding generator. Buckets touch disjoint elements, so
their order does not change a bit.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.profiler import record_function

import lightning_swarm.profiling as labels
from lightning_swarm.algorithm import merge_into_local
from lightning_swarm.algorithm.codecs import Codec, with_error_feedback
from lightning_swarm.algorithm.diloco import pseudo_gradient_into, stochastic_round_to_bf16
from lightning_swarm.algorithm.outer_optimizer import (
    FastKind,
    adam_step_,
    ensure_state,
    groups_by_param,
    sgd_step_,
)
from lightning_swarm.transport.buckets import Piece, placed

# A streamed round's error feedback: its names, the new residuals (scratch), the codec.
Feedback = tuple[list[str], dict[str, Tensor], Codec]

# One bucket's mean across islands, in place: (flat, its pieces) -> bytes sent.
Exchange = Callable[[Tensor, list[Piece]], int]

# The state tensors the functional step reads and writes, in its argument order.
STATE_KEYS: dict[FastKind, tuple[str, ...]] = {
    "sgd": ("momentum_buffer",),
    "adam": ("exp_avg", "exp_avg_sq"),
}

# A piece's slice of a bucket-sized buffer, from its offset in the bucket and the piece.
PieceView = Callable[[int, Piece], Tensor]
StateView = Callable[[int, Piece], list[Tensor]]


class BucketJob:
    """One round's tensors and options, with the per-piece helpers of both device paths."""

    def __init__(
        self,
        params: Sequence[Tensor],
        anchors: Sequence[Tensor],
        optimizer: torch.optim.Optimizer,
        kind: FastKind,
        groups: dict[int, dict[str, Any]],
        fresh: list[bool],
        merge_alpha: float,
        seed: int,
    ) -> None:
        self.params, self.anchors, self.optimizer = params, anchors, optimizer
        self.kind, self.groups, self.fresh = kind, groups, fresh
        self.merge_alpha = merge_alpha
        self.device = params[0].device
        states = [optimizer.state.get(a, {}) for a in anchors]
        self.states_per_tensor = [
            [state[key] for key in STATE_KEYS[kind] if state.get(key) is not None]
            for state in states
        ]
        # bf16 anchors draw their rounding noise per piece, in order, from one generator seeded
        # like the slow path's: on the CPU the same numbers, so the result is bitwise equal.
        self._seed = seed
        self._generator: torch.Generator | None = None

    def form(self, bucket: list[Piece], delta: Tensor, anchor_of: PieceView) -> None:
        with record_function(labels.PSEUDO_GRADIENT):
            for at, p in placed(bucket):
                pseudo_gradient_into(anchor_of(at, p), self.param_slice(p), self.cut(delta, at, p))

    def step_and_merge(
        self, bucket: list[Piece], delta: Tensor, anchor_of: PieceView, state_of: StateView
    ) -> None:
        """Step the bucket's anchor pieces with its averaged ``delta`` (which the step uses
        as scratch), then merge the new anchors into the parameters."""
        with record_function(labels.OUTER_STEP):
            for at, p in placed(bucket):
                self.step(anchor_of(at, p), self.cut(delta, at, p), state_of(at, p), p)
        with record_function(labels.MERGE):
            for at, p in placed(bucket):
                merge_into_local(self.param_slice(p), anchor_of(at, p), self.merge_alpha)

    def param_slice(self, p: Piece) -> Tensor:
        return self.params[p.tensor_index].data.view(-1)[p.start : p.stop]

    def state_at(self, at: int, p: Piece) -> list[Tensor]:
        return [t.view(-1)[p.start : p.stop] for t in self.state(p)]

    def anchor_at(self, at: int, p: Piece) -> Tensor:
        return self.anchors[p.tensor_index].view(-1)[p.start : p.stop]

    @staticmethod
    def cut(flat: Tensor, at: int, p: Piece) -> Tensor:
        return flat[at : at + p.length]

    def state(self, p: Piece) -> list[Tensor]:
        return self.states_per_tensor[p.tensor_index]

    def step(self, anchor: Tensor, grad: Tensor, state: list[Tensor], p: Piece) -> None:
        """The functional outer step on one piece (float32 work copy for low precision)."""
        work = anchor if anchor.dtype == torch.float32 else anchor.to(torch.float32)
        group = self.groups[id(self.anchors[p.tensor_index])]
        if self.kind == "sgd":
            buf = state[0] if state else None
            sgd_step_(work, grad, buf, group, fresh=self.fresh[p.tensor_index])
        else:
            step = float(self.optimizer.state[self.anchors[p.tensor_index]]["step"].item())
            adam_step_(work, grad, state[0], state[1], group, step=step)
        if work is anchor:
            return
        if anchor.dtype == torch.bfloat16:
            if self._generator is None:
                self._generator = torch.Generator(device=anchor.device).manual_seed(self._seed)
            anchor.copy_(stochastic_round_to_bf16(work, self._generator))
        else:
            anchor.copy_(work)


def form_fragment(
    params: Mapping[str, Tensor],
    anchors: Mapping[str, Tensor],
    names: Sequence[str],
    reuse: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """``anchor - local`` in float32 for ``names``, back to back in one buffer on the anchors'
    device (``reuse`` when it fits exactly); the buffer, which the caller owns, and its views."""
    device = anchors[names[0]].device if names else torch.device("cpu")
    numel = sum(params[n].numel() for n in names)
    fits = reuse is not None and reuse.numel() == numel and reuse.device == device
    # Reusing the buffer spares the page faults of a fresh fragment-sized allocation.
    flat = reuse if reuse is not None and fits else torch.empty(numel, device=device)
    deltas, offset = {}, 0
    for name in names:
        param, anchor = params[name], anchors[name]
        if param.shape != anchor.shape:
            raise ValueError(
                f"anchor shape {tuple(anchor.shape)} != local shape {tuple(param.shape)}; "
                "anchors must be built from the same parameters the optimizer trains."
            )
        view = flat[offset : offset + param.numel()].view(param.shape)
        local = param.detach().to(device=anchor.device, dtype=torch.float32)
        torch.sub(anchor.to(torch.float32), local, out=view)
        deltas[name], offset = view, offset + param.numel()
    return flat, deltas


def feed_back_pieces(
    residuals: Mapping[str, Tensor],
    names: Sequence[str],
    scratch: dict[str, Tensor],
    codec: Codec,
    bucket: list[Piece],
    delta: Tensor,
) -> None:
    """Error feedback on one formed bucket, piece by piece (each starts on a codec block, so
    this equals feedback per tensor); new residuals go to ``scratch``, installed on success."""
    for at, p in placed(bucket):
        name = names[p.tensor_index]
        old = residuals.get(name)
        piece = delta[at : at + p.length]
        old_piece = None if old is None else old.view(-1)[p.start : p.stop]
        to_send, residual = with_error_feedback(piece, old_piece, codec)
        piece.copy_(to_send)
        scratch[name].view(-1)[p.start : p.stop].copy_(residual)


def state_beside(anchor: Tensor) -> Tensor:
    return torch.empty(anchor.shape, dtype=torch.float32, device=anchor.device)


def start_job(
    optimizer: torch.optim.Optimizer,
    pairs: tuple[list[Tensor], list[Tensor]],
    kind: FastKind,
    merge_alpha: float,
    allocate: Callable[[Tensor], Tensor],
    seed: int,
) -> BucketJob:
    """A round's job over (parameters, anchors): creates missing outer state with ``allocate``
    and counts Adam's step. ``seed`` must agree on every island (bf16 noise)."""
    params, anchors = pairs
    groups = groups_by_param(optimizer)
    fresh = [ensure_state(optimizer, a, kind, groups[id(a)], allocate) for a in anchors]
    if kind == "adam":
        for anchor in anchors:
            optimizer.state[anchor]["step"] += 1
    return BucketJob(params, anchors, optimizer, kind, groups, fresh, merge_alpha, seed)
