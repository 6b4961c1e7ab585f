"""One elastic island without Lightning, run as its own process by test_membership_torchft.py.

It trains a tiny model with a deterministic per-island update, runs an outer round every
``--every`` inner steps through ``TorchftMembership`` and appends one JSON line per round to
``<out>/<island>.jsonl`` (outer steps, whether applied, islands in the round, a digest of the
anchors). At the end it writes its anchors and parameters to ``<out>/<island>.safetensors``.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.algorithm.fragments import build_fragments
from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.config import SwarmConfig
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.round_header import swarm_settings
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.outer import OuterSync, StreamingOptions
from lightning_swarm.outer.worker import SyncWorker
from tests.elastic_faults import fault_hook


def digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(tensors[name].contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lighthouse", required=True)
    parser.add_argument("--island", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--every", type=int, default=3)
    parser.add_argument("--step-s", type=float, default=0.02)
    parser.add_argument("--width", type=int, default=4)
    parser.add_argument("--outer-lr", type=float, default=0.7)
    parser.add_argument("--fault", action="append", default=[], help="see tests/elastic_faults.py")
    parser.add_argument("--min-islands", type=int, default=2)
    parser.add_argument("--quorum-timeout", type=float, default=20.0)
    parser.add_argument("--round-timeout", type=float, default=10.0, help="0: derived (None)")
    parser.add_argument("--fragments", type=int, default=1, help="num_fragments")
    parser.add_argument("--delay", type=int, default=0, help="sync_delay")
    parser.add_argument("--alpha", type=float, default=0.0, help="merge_alpha")
    parser.add_argument("--quantize", default="none", help="int8 / int4 (with error feedback)")
    parser.add_argument(
        "--stop-file", default=None, help="when it exists, it holds the round to stop after"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, args.width), torch.nn.Linear(args.width, 2))
    config = SwarmConfig(
        sync_every=args.every,
        num_fragments=args.fragments,
        sync_delay=args.delay,
        merge_alpha=args.alpha,
        quantize=args.quantize,
    )
    codec = codec_for(args.quantize)
    worker = SyncWorker() if args.delay > 0 else None
    params = dict(model.named_parameters())
    membership = None
    out = Path(args.out)
    log = (out / f"{args.island}.jsonl").open("a")
    try:
        membership = TorchftMembership(
            ElasticConfig(
                lighthouse=args.lighthouse,
                island_id=args.island,
                min_islands=args.min_islands,
                quorum_timeout_s=args.quorum_timeout,
                round_timeout_s=args.round_timeout or None,
                connect_timeout_s=3.0,
            ),
            layout=model_layout(params),
            codec=codec,
        )
        outer = OuterSync(
            params,
            outer_optimizer=functools.partial(
                torch.optim.SGD, lr=args.outer_lr, momentum=0.9, nesterov=True
            ),
            transport=membership,
            sync_every=args.every,
            streaming=StreamingOptions(
                fragments=build_fragments(list(params), args.fragments),
                sync_delay=args.delay,
                merge_alpha=args.alpha,
                codec=codec,
                error_feedback=codec is not None,
                worker=worker,
            ),
        )
        membership.on_phase = fault_hook(args.fault, out, args.island)
        membership.agree_on(swarm_settings(config, outer.outer_optimizer))

        def record(report: object, joined: bool) -> None:
            line = {
                "t": time.time(),
                "joined": joined,
                "outer_steps": outer.outer_steps,
                "inner_steps": outer.inner_steps,
                "applied": report.applied,  # type: ignore[attr-defined]
                "islands": membership.totals.islands_in_round,  # type: ignore[union-attr]
                "heals": membership.totals.heals,  # type: ignore[union-attr]
                "heal_bytes": membership.totals.heal_bytes,  # type: ignore[union-attr]
                "anchors": digest(outer.anchors),
                "residuals": digest(outer.residuals),
                "bytes_sent": report.bytes_sent,  # type: ignore[attr-defined]
                "round_timeout_s": membership.round_timeout_s,  # type: ignore[union-attr]
                "rate_bps": membership._link.rate_bps,  # type: ignore[union-attr]
                "params": digest({k: v.detach() for k, v in params.items()}),
            }
            log.write(json.dumps(line) + "\n")
            log.flush()

        record(outer.join(), joined=True)
        island_seed = int(hashlib.sha256(args.island.encode()).hexdigest()[:8], 16)
        last_round = args.rounds
        # The swarm's clock is its committed rounds: inner-step counts drift apart between
        # islands whenever one abandons a round that another did not take part in.
        while outer.outer_steps < last_round:
            gen = torch.Generator().manual_seed(island_seed * 100_003 + outer.inner_steps)
            with torch.no_grad():
                for p in params.values():
                    p.add_(torch.randn(p.shape, generator=gen) * 0.01 - 0.05 * p)
            time.sleep(args.step_s)
            report = outer.on_inner_step()
            if report is not None:
                record(report, joined=False)
                if args.stop_file and Path(args.stop_file).exists():
                    last_round = min(args.rounds, int(Path(args.stop_file).read_text()))
        # The swarm's last round merged one fragment (with merge_alpha, a mix): every island
        # lands on the anchors, as the Lightning glue does.
        outer.land_on_anchors()
        save_file(
            {
                **{f"anchor.{k}": v for k, v in outer.anchors.items()},
                **{f"param.{k}": v.detach().contiguous() for k, v in params.items()},
            },
            str(out / f"{args.island}.safetensors"),
        )
    except Exception as err:
        (out / f"{args.island}.error").write_text(f"{type(err).__name__}: {err}")
        raise
    finally:
        if membership is not None:
            membership.close()
        if worker is not None:
            worker.close()
    sys.exit(0)


if __name__ == "__main__":
    main()
