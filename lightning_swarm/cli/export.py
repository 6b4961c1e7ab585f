"""``swarm-export CKPT OUT_DIR``: the global model of a swarm checkpoint (or one island's local
weights) as safetensors with the module's own parameter names, offline
(``resume.global_model.export``; ``docs/evaluation.md``)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import torch

from lightning_swarm.errors import SwarmError
from lightning_swarm.resume.global_model import export

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20}
_UNITS |= {"GIB": 2**30}


def parse_size(text: str) -> int:
    """``"5GB"``, ``"500MiB"`` or a number of bytes, as bytes (``argparse`` type)."""
    upper = text.strip().upper()
    digits = upper.rstrip("KMGIB")
    unit = upper[len(digits) :]
    try:
        value = float(digits)
    except ValueError:
        value = -1.0
    if unit not in _UNITS or value <= 0:
        raise argparse.ArgumentTypeError(
            f"--max-shard-size {text!r} is not a size; give e.g. 5GB, 500MiB or 1000000."
        )
    return int(value * _UNITS[unit])


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="swarm-export",
        description="Write the global model (the anchors) of a lightning_swarm checkpoint as "
        "safetensors: model.safetensors, or shards and model.safetensors.index.json.",
    )
    p.add_argument("ckpt", help="the Lightning .ckpt file (its .swarm directory beside it)")
    p.add_argument("out_dir", help="the directory to write into (made if missing)")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="cast every tensor (default: its own)")
    p.add_argument(
        "--local", type=int, metavar="ISLAND", help="that island's local weights instead"
    )
    p.add_argument(
        "--max-shard-size", type=parse_size, default=5 * 10**9, help="per file (default 5GB)"
    )
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        written = export(
            args.ckpt,
            args.out_dir,
            dtype=DTYPES[args.dtype] if args.dtype else None,
            island=args.local,
            max_shard_bytes=args.max_shard_size,
        )
    except SwarmError as err:
        print(f"swarm-export: {err}", file=sys.stderr)
        return 1
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
