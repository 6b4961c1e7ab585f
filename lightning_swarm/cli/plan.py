"""``swarm-plan``: per-rank memory and outer-round time of a layout, on paper.

    swarm-plan --params 120e9 --stages 8 [--data-parallel 1] [--tensor-parallel 1]
               [--islands 4] [--anchor-dtype float32 bfloat16] [--quantize none]
               [--link-gbit 1 10 100]

The formulas are the library's: each rank holds ``params / (stages x dp x tp)`` elements of
the model (its stage's shard); its anchors take that many elements in ``anchor_dtype``, its
outer state (SGD with Nesterov momentum, the default) one float32 buffer per element; a round's
all-reduce sends ``2 (n - 1) / n`` times the encoded pseudo-gradient through each rank's link
for ``n`` islands (``docs/scaling.md``), so a round takes that many bytes over the link rate.
Latency, the inner steps that hide a delayed round (``sync_delay``) and stage imbalance (the
first and last stages hold embeddings and head) are left out.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

GiB = 2**30
ENCODED = {"none": 4.0, "bf16": 2.0}  # bytes per element on the wire; int8/int4 add scales
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}


def encoded_bytes(quantize: str, block_size: int) -> float:
    if quantize == "int8":
        return 1 + 4 / block_size
    if quantize == "int4":
        return 0.5 + 4 / block_size
    return ENCODED[quantize]


def plan(
    params: float,
    *,
    stages: int,
    data_parallel: int = 1,
    tensor_parallel: int = 1,
    islands: int = 2,
    anchor_dtype: str = "float32",
    quantize: str = "none",
    block_size: int = 128,
    link_gbit: Sequence[float] = (1.0, 10.0, 100.0),
) -> dict[str, float]:
    """Per-rank elements, anchor and outer-state GiB, wire GiB per round and the round's
    seconds at each link rate (keys ``round_s@<rate>gbit``)."""
    elements = params / (stages * data_parallel * tensor_parallel)
    wire = 2 * (islands - 1) / islands * elements * encoded_bytes(quantize, block_size)
    out = {
        "elements_per_rank": elements,
        "anchor_gib": elements * DTYPE_BYTES[anchor_dtype] / GiB,
        "outer_state_gib": elements * 4 / GiB,
        "wire_gib_per_round": wire / GiB,
    }
    for rate in link_gbit:
        out[f"round_s@{rate:g}gbit"] = wire * 8 / (rate * 1e9)
    return out


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="swarm-plan", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, required=True, help="model parameters")
    parser.add_argument("--stages", type=int, default=1, help="pipeline_parallel_size")
    parser.add_argument("--data-parallel", type=int, default=1)
    parser.add_argument("--tensor-parallel", type=int, default=1)
    parser.add_argument("--islands", type=int, default=2)
    parser.add_argument(
        "--anchor-dtype", nargs="+", default=["float32", "bfloat16"], choices=sorted(DTYPE_BYTES)
    )
    parser.add_argument("--quantize", default="none", choices=["none", "bf16", "int8", "int4"])
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--link-gbit", type=float, nargs="+", default=[1.0, 10.0, 100.0])
    args = parser.parse_args(argv)
    for name, value in (
        ("--params", args.params),
        ("--stages", args.stages),
        ("--data-parallel", args.data_parallel),
        ("--tensor-parallel", args.tensor_parallel),
        ("--islands", args.islands),
        ("--block-size", args.block_size),
    ):
        if value <= 0:
            parser.error(f"{name} must be above 0, got {value}")
    rates = args.link_gbit
    print(
        f"{args.params:.3g} parameters, {args.islands} islands of {args.stages} stage(s) x "
        f"dp {args.data_parallel} x tp {args.tensor_parallel}, quantize={args.quantize}"
    )
    header = [
        "anchor dtype",
        "elements / rank",
        "anchors GiB",
        "outer state GiB",
        "wire GiB / round",
        *(f"round s @ {r:g} Gbit/s" for r in rates),
    ]
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for dtype in args.anchor_dtype:
        p = plan(
            args.params,
            stages=args.stages,
            data_parallel=args.data_parallel,
            tensor_parallel=args.tensor_parallel,
            islands=args.islands,
            anchor_dtype=dtype,
            quantize=args.quantize,
            block_size=args.block_size,
            link_gbit=rates,
        )
        cells = [
            dtype,
            f"{p['elements_per_rank']:.3g}",
            f"{p['anchor_gib']:.1f}",
            f"{p['outer_state_gib']:.1f}",
            f"{p['wire_gib_per_round']:.1f}",
            *(f"{p[f'round_s@{r:g}gbit']:,.1f}" for r in rates),
        ]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
