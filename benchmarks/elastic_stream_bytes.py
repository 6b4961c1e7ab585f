"""Bytes per island and round of Streaming DiLoCo under torchft, float32 against int8.

Runs a lighthouse and ``n`` islands of ``tests/elastic_island.py`` (``Linear(8, W)`` and
``Linear(W, 2)``: 2 fragments, ``sync_delay`` 1) for each island count and codec, and prints
what each island's rank 0 moved across islands per committed round of each fragment
(``swarm/bytes_sent``), with the fragment's float32 size beside it. A quantized reduce-scatter
moves about ``2 (n - 1) / n`` of the encoded fragment, a ring all-reduce the same share of the
float32 one: both stay under twice the payload however many islands there are.

Run: PYTHONPATH=. .venv/bin/python benchmarks/elastic_stream_bytes.py [--width 4096]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from tests.elastic_utils import finish, lighthouse, rounds, start_island


def run(num_islands: int, quantize: str, width: int, out: Path) -> dict[int, set[int]]:
    """Fragment size in float32 bytes -> the bytes an island moved in its committed rounds."""
    opts = ["--fragments", "2", "--delay", "1", "--every", "4", "--quantize", quantize]
    opts += ["--width", str(width), "--rounds", "8", "--min-islands", str(num_islands)]
    with lighthouse(min_islands=num_islands) as address:
        names = "abcdefgh"[:num_islands]
        procs = {name: start_island(out, address, name, *opts) for name in names}
        for name, proc in procs.items():
            assert finish(proc, 300, out, name) == 0, (out / f"{name}.stderr").read_text()[-2000:]
    fragment_bytes = [(8 * width + width) * 4, (2 * width + 2) * 4]
    seen: dict[int, set[int]] = {size: set() for size in fragment_bytes}
    for row in rounds(out, "a"):
        if row["applied"] and not row["joined"] and row["islands"] == num_islands:
            # Fragment 1 sends first (offset sync_every / 2): rounds alternate 1, 0, 1, ...
            size = fragment_bytes[0] if row["outer_steps"] % 2 == 0 else fragment_bytes[1]
            seen[size].add(int(row["bytes_sent"]))
    return seen


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--islands", type=int, nargs="+", default=[2, 3])
    args = parser.parse_args()
    for quantize in ("none", "int8"):
        for n in args.islands:
            out = Path(tempfile.mkdtemp())
            seen = run(n, quantize, args.width, out)
            row = {"quantize": quantize, "islands": n}
            row.update({f"fp32 {size} B": sorted(moved) for size, moved in seen.items()})
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
