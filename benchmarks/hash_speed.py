"""Checksum throughput over a file in the page cache: why swarm files are checked with XXH3-128.

Writes ``--gib`` GiB (1) of random bytes to a temporary file, reads it once to warm the page
cache, then reads it ``--reps`` times (3) per method in ``--chunk-mib`` MiB chunks (8) through
one reusable buffer, as ``lightning_swarm.resume.integrity.file_digest`` does, and reports the
best pass per method in GiB/s. Methods: a plain read (the floor every checksum pays), xxh3_128
(the one the checkpoints record), xxh3_64, crc32c (only when the ``crc32c`` package is
installed; the run says when it is skipped), ``zlib.crc32``, sha1, sha256, blake2b.

Run:   PYTHONPATH=. .venv/bin/python benchmarks/hash_speed.py [--gib 1] [--reps 3] [--json out]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import xxhash

# One chunk in, nothing out: each method folds the chunk into a state it owns.
Update = Callable[[memoryview], None]


def _hashlib(name: str) -> Callable[[], Update]:
    return lambda: hashlib.new(name).update


def _xxh(kind: Callable[[], xxhash.xxh3_128 | xxhash.xxh3_64]) -> Callable[[], Update]:
    return lambda: kind().update


def _crc(fn: Callable[[memoryview, int], int]) -> Callable[[], Update]:
    def make() -> Update:
        value = 0

        def update(chunk: memoryview) -> None:
            nonlocal value
            value = fn(chunk, value)

        return update

    return make


def methods() -> dict[str, Callable[[], Update] | None]:
    """Each method's factory of a fresh update function; ``None`` where it is not installed."""
    try:
        import crc32c  # type: ignore[import-not-found,unused-ignore]

        crc32c_update: Callable[[], Update] | None = _crc(crc32c.crc32c)
    except ImportError:
        crc32c_update = None
    return {
        "plain read": lambda: lambda chunk: None,
        "xxh3_128": _xxh(xxhash.xxh3_128),
        "xxh3_64": _xxh(xxhash.xxh3_64),
        "crc32c": crc32c_update,
        "zlib.crc32": _crc(zlib.crc32),
        "sha1": _hashlib("sha1"),
        "sha256": _hashlib("sha256"),
        "blake2b": _hashlib("blake2b"),
    }


def one_pass(path: Path, update: Update, buffer: bytearray) -> float:
    """Seconds to read ``path`` through ``buffer`` and feed every chunk to ``update``."""
    view = memoryview(buffer)
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            update(view[:count])
    return time.perf_counter() - start


def write_file(path: Path, gib: float, chunk: int) -> None:
    remaining = int(gib * 2**30)
    with open(path, "wb") as handle:
        while remaining:
            step = min(chunk, remaining)
            handle.write(os.urandom(step))
            remaining -= step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--chunk-mib", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", default=None, help="write the figures as JSON here")
    args = parser.parse_args()
    chunk = args.chunk_mib * 2**20
    buffer = bytearray(chunk)
    results: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "data.bin"
        write_file(path, args.gib, chunk)
        one_pass(path, lambda chunk: None, buffer)  # the page cache holds the file from here
        size_gib = path.stat().st_size / 2**30
        for name, make in methods().items():
            if make is None:
                print(f"{name:<12} skipped (pip install {name} to include it)", flush=True)
                continue
            best = min(one_pass(path, make(), buffer) for _ in range(args.reps))
            results[name] = size_gib / best
            print(f"{name:<12} {results[name]:6.2f} GiB/s", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
