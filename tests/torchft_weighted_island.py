"""One elastic island that runs time-budgeted rounds straight through ``TorchftMembership``'s
bucket contract, run as its own process by tests/test_budget_weights.py.

``--steps`` is its weight in the weighted round. Rounds: 0 the genesis quorum (never applied),
1 with every island's own steps, 2 with equal steps, 3 without work, 4 with the weight of
island ``b`` broken (31 steps since the last round, of 30 in all). Each round's mean, scale,
swarm steps and outcome go to ``<out>/<island>.pt``.
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.transport.base import Bucket, RoundRequest, Work


def contribution(island: str) -> torch.Tensor:
    """Island ``island``'s pseudo-gradient in every round: fixed, so the test knows the mean."""
    gen = torch.Generator().manual_seed(ord(island))
    return torch.randn(37, generator=gen)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--island", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--min-islands", type=int, default=3)
    args = parser.parse_args()
    config = ElasticConfig(
        lighthouse=args.lighthouse,
        island_id=args.island,
        min_islands=args.min_islands,
        quorum_timeout_s=20.0,
        round_timeout_s=10.0,
    )
    membership = TorchftMembership(config, layout=model_layout({"w": torch.zeros(37)}))
    broken = 31 if args.island == "b" else 2  # more than its 30 inner steps
    works: list[Work | None] = [
        Work(1, 1),
        Work(args.steps, 10 + args.steps),
        Work(2, 20),
        None,
        Work(broken, 30),
    ]
    results: list[dict[str, Any]] = []
    try:
        for round_index, work in enumerate(works):
            flat = contribution(args.island)
            opening = membership.open(RoundRequest(round_index, True, {"w": flat.shape}, work=work))
            if opening.adopt is not None:  # a member being healed sends zeros
                flat.zero_()
            elif opening.scale != 1.0:  # as the round engine does
                flat.mul_(opening.scale)
            if not opening.abandon:
                membership.start(Bucket(flat, (flat.numel(),))).wait()
            stats = membership.agree()
            results.append(
                {
                    "mean": flat,
                    "scale": opening.scale,
                    "swarm_steps": opening.swarm_steps,
                    "applied": stats.applied,
                    "participants": membership.totals.islands_in_round,
                }
            )
    finally:
        membership.close()
    torch.save(results, f"{args.out}/{args.island}.pt")


if __name__ == "__main__":
    main()
