"""Digests of 3 outer rounds of ``OuterSync`` per configuration, on 2 gloo CPU ranks.

Records sha256 digests of anchors, parameters and outer optimizer state after the rounds, so a
change of the round engine can be checked bitwise against the recorded trajectory
(``tests/test_round_digests.py`` compares; ``tests/data/round_digests.json`` holds them).

    python -m benchmarks.round_digests            # print the digests
    python -m benchmarks.round_digests --write    # re-record tests/data/round_digests.json
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.outer import OuterSync, StreamingOptions
from lightning_swarm.outer.worker import SyncWorker
from lightning_swarm.transport import build_transport
from lightning_swarm.transport.config import SwarmTransportConfig

DIGESTS = Path(__file__).resolve().parents[1] / "tests" / "data" / "round_digests.json"
SHAPES = [(4, 3), (11,), (2, 2, 5), (1,), (130,)]
WORLD = 2
ROUNDS = 3

SGD = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd": SGD,
    "adamw": functools.partial(torch.optim.AdamW, lr=1e-2, weight_decay=0.1),
    "rmsprop": functools.partial(torch.optim.RMSprop, lr=1e-2),
}

# name -> (transport, codec, error feedback, sync_delay, optimizer, anchor dtype, fragments)
CASES: dict[str, dict[str, Any]] = {
    "allreduce_sgd": {},
    "reduce_scatter_int8_ef": {"transport": "allreduce", "codec": "int8", "ef": True},
    "delayed": {"delay": 1, "fragments": True, "alpha": 0.25, "sync_every": 4},
    "swarm": {"transport": "swarm"},
    "adamw": {"optimizer": "adamw"},
    "bf16_anchors": {"dtype": torch.bfloat16},
    "rmsprop": {"optimizer": "rmsprop"},
    "delayed_int8_ef": {"codec": "int8", "ef": True, "delay": 1, "sync_every": 2},
}


def _params() -> dict[str, torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(0)
    return {
        f"p{i}": torch.nn.Parameter(torch.randn(s, generator=gen)) for i, s in enumerate(SHAPES)
    }


def _train(params: dict[str, torch.nn.Parameter], rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    with torch.no_grad():
        for p in params.values():
            p.add_(torch.randn(p.shape, generator=gen), alpha=0.1)


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(str(t.dtype).encode())
        h.update(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_case(rank: int, case: dict[str, Any], spool: str) -> dict[str, str]:
    """Three rounds of one configuration on this rank; its digests."""
    params = _params()
    codec = codec_for(case.get("codec", "none"), 8)
    transport = build_transport(
        case.get("transport", "allreduce"),
        group=None,
        num_islands=WORLD,
        island_index=rank,
        device=torch.device("cpu"),
        codec=codec,
        bucket_numel=16,
        swarm=SwarmTransportConfig(spool_dir=spool),
    )
    delay = case.get("delay", 0)
    worker = SyncWorker() if delay else None
    fragments = [["p0", "p2", "p4"], ["p1", "p3"]] if case.get("fragments") else None
    outer = OuterSync(
        params,
        outer_optimizer=OPTIMIZERS[case.get("optimizer", "sgd")],
        transport=transport,
        sync_every=case.get("sync_every", 2),
        anchor_dtype=case.get("dtype", torch.float32),
        streaming=StreamingOptions(
            fragments=fragments,
            sync_delay=delay,
            merge_alpha=case.get("alpha", 0.0),
            codec=codec,
            error_feedback=case.get("ef", False),
            worker=worker,
        ),
    )
    try:
        step = 0
        while outer.outer_steps < ROUNDS:
            _train(params, rank, step)
            outer.on_inner_step()
            step += 1
        outer.drain()
        state = outer.outer_optimizer.state_dict()["state"]
        return {
            "anchors": _digest(list(outer.anchors.values())),
            "params": _digest(list(params.values())),
            "outer_state": _digest(
                [v for s in state.values() for v in s.values() if isinstance(v, torch.Tensor)]
            ),
            "residuals": _digest(list(outer.residuals.values())),
        }
    finally:
        if worker is not None:
            worker.close()
        transport.close()


def _worker(rank: int, world: int, out: str) -> None:
    with tempfile.TemporaryDirectory() as spool:
        digests = {name: run_case(rank, case, spool) for name, case in CASES.items()}
    (Path(out) / f"{rank}.json").write_text(json.dumps(digests, sort_keys=True))


def record() -> dict[str, dict[str, dict[str, str]]]:
    """Every case on ``WORLD`` forked gloo ranks: ``{rank: {case: {what: sha256}}}``."""
    from tests.dist_utils import run_ranks

    with tempfile.TemporaryDirectory() as out:
        run_ranks(_worker, WORLD, out)
        return {
            str(rank): json.loads((Path(out) / f"{rank}.json").read_text()) for rank in range(WORLD)
        }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--write", action="store_true", help="re-record the digests file")
    args = parser.parse_args()
    torch.set_num_threads(1)
    digests = record()
    text = json.dumps(digests, indent=1, sort_keys=True) + "\n"
    if args.write:
        DIGESTS.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
