"""Host memory and wall time of saving and restoring >= 2 GiB of float32 anchors.

Run:  .venv/bin/python benchmarks/resume_memory.py [--gib 2.0] [--dir /tmp]

Save side (this process): the anchors of an ``OuterSync`` are written exactly as
``SwarmStrategy.save_checkpoint`` writes ``anchors.pt`` (``atomic_save``: ``torch.save`` to a
path, fsync, rename). Extra host memory = peak RSS during the write (VmHWM after resetting it
through /proc/self/clear_refs) minus RSS before. For contrast, the same state serialised into an
in-memory buffer first, as Lightning's own ``_atomic_save`` does with its checkpoint dict.

The save also hashes the written file (``file_digest``, XXH3-128, what the record holds), timed
on its own.

Restore side: each mode runs in a fresh interpreter (so none sees another's pages), with the
file warm in the page cache (it was just written). A restore is ``load_swarm_file`` plus
``OuterSync.load_state_dict`` into deferred (memory-less) anchors, i.e. what
``SwarmCheckpointer.restore`` does; the ``+verify`` modes first check the file against its
recorded size and checksum (``check_file``: one chunked read) and scan the anchors for NaN/inf
(``check_finite``), as ``anchors.verify=true`` does. Reported: wall time, anonymous memory added
(smaps_rollup ``Anonymous``), and anonymous memory after one read pass over every anchor
(reading a mapped page keeps it file-backed).
"""

from __future__ import annotations

import argparse
import functools
import gc
import io
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.memory.procfs import ProcReader
from lightning_swarm.outer import OuterSync
from lightning_swarm.resume.atomic import atomic_save
from lightning_swarm.resume.files import load_swarm_file
from lightning_swarm.resume.integrity import check_file, check_finite, file_digest
from lightning_swarm.resume.records import FORMAT_VERSION, FileDigest
from tests.transport_rounds import NamedRound

OUTER = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
TENSOR_MIB = 128
MiB = 2**20
MODES = ("mmap", "mmap+verify", "eager", "eager+verify")


class _NoTransport(NamedRound):
    """A single island's transport: the mean of one contribution is itself."""


def _anonymous() -> int:
    rollup = ProcReader().smaps_rollup()
    assert rollup is not None, "needs a readable /proc/self/smaps_rollup"
    return rollup["Anonymous"]


def _status(field: str) -> int:
    status = ProcReader().status()
    assert status is not None
    return status[field]


def _meta_params(gib: float) -> dict[str, torch.nn.Parameter]:
    count = max(1, round(gib * 1024 / TENSOR_MIB))
    shape = (TENSOR_MIB * MiB // 4 // 1024, 1024)
    return {
        f"layer{i}.weight": torch.nn.Parameter(torch.empty(shape, device="meta"))
        for i in range(count)
    }


def _outer(params: dict[str, torch.nn.Parameter], defer: bool) -> OuterSync:
    return OuterSync(
        params, outer_optimizer=OUTER, transport=_NoTransport(), sync_every=1, defer_anchors=defer
    )


def _peak_extra(write: object) -> tuple[int, float]:
    """(peak RSS above the starting RSS, seconds) while calling ``write``."""
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS
    before = _status("VmRSS")
    start = time.perf_counter()
    write()  # type: ignore[operator]
    wall = time.perf_counter() - start
    return _status("VmHWM") - before, wall


def save_side(path: Path, gib: float) -> dict[str, Any]:
    params = _meta_params(gib)
    outer = _outer(params, defer=True)
    anchors = {name: torch.full(p.shape, 0.25) for name, p in params.items()}  # the trained anchors
    outer.load_state_dict(
        {
            "anchors": anchors,
            "outer_optimizer": outer.outer_optimizer.state_dict(),
            "inner_steps": 0,
            "outer_steps": 0,
        }
    )
    del anchors
    payload = {"format": FORMAT_VERSION, "save_id": "bench", "outer": [outer.state_dict()]}
    extra, wall = _peak_extra(lambda: atomic_save(payload, path))
    start = time.perf_counter()
    digest = file_digest(path)
    digest_wall = time.perf_counter() - start

    def to_buffer() -> None:
        buffer = io.BytesIO()
        torch.save(payload, buffer)
        del buffer

    buffer_extra, buffer_wall = _peak_extra(to_buffer)
    return {
        "anchor_bytes": outer.anchor_bytes,
        "file_bytes": path.stat().st_size,
        "save_extra_bytes": extra,
        "save_wall_s": wall,
        "buffer_extra_bytes": buffer_extra,
        "buffer_wall_s": buffer_wall,
        "digest_wall_s": digest_wall,
        "digest": digest.digest,
    }


def restore_side(path: Path, gib: float, mode: str, digest: str) -> dict[str, float]:
    outer = _outer(_meta_params(gib), defer=True)
    gc.collect()
    before = _anonymous()
    start = time.perf_counter()
    verify = mode.endswith("+verify")
    check_file(path, FileDigest(path.stat().st_size, digest), verify=verify)
    payload, _ = load_swarm_file(path, mmap=mode.startswith("mmap"))
    if verify:
        check_finite(payload["outer"][0]["anchors"], source=path, what="the anchors")
    outer.load_state_dict(payload["outer"][0])
    del payload
    wall = time.perf_counter() - start
    added = _anonymous() - before
    start = time.perf_counter()
    total = sum(float(a.sum()) for a in outer.anchors.values())  # one read pass
    read_wall = time.perf_counter() - start
    assert total > 0
    return {
        "restore_wall_s": wall,
        "restore_anon_bytes": added,
        "after_read_anon_bytes": _anonymous() - before,
        "read_wall_s": read_wall,
    }


def _child(path: Path, gib: float, mode: str, digest: str) -> dict[str, float]:
    cmd = [sys.executable, __file__, "--child", mode, "--path", str(path), "--gib", str(gib)]
    cmd += ["--digest", digest]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=2.0, help="GiB of float32 anchors")
    parser.add_argument("--dir", default=None, help="directory for the anchors file")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--digest", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.child:
        print(json.dumps(restore_side(Path(args.path), args.gib, args.child, args.digest)))
        return
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        path = Path(tmp) / "anchors.pt"
        save = save_side(path, args.gib)
        results = {mode: _child(path, args.gib, mode, str(save["digest"])) for mode in MODES}
    anchor = save["anchor_bytes"]
    print(f"anchors: {anchor / 2**30:.2f} GiB float32, file {save['file_bytes'] / 2**30:.2f} GiB")
    print(
        f"save (atomic_save to a path): {save['save_wall_s']:.2f} s, extra host memory "
        f"{save['save_extra_bytes'] / MiB:.1f} MiB ({100 * save['save_extra_bytes'] / anchor:.2f}% "
        "of anchors)"
    )
    print(
        f"checksum of the written file (xxh3-128, one chunked read): {save['digest_wall_s']:.2f} s"
    )
    print(
        f"for contrast, torch.save into an in-memory buffer: {save['buffer_wall_s']:.2f} s, "
        f"extra {save['buffer_extra_bytes'] / MiB:.1f} MiB "
        f"({100 * save['buffer_extra_bytes'] / anchor:.1f}%)"
    )
    print(
        f"{'restore':<13}{'wall s':>9}{'anon added MiB':>16}{'% anchors':>11}"
        f"{'after read MiB':>16}{'read s':>8}"
    )
    for mode, r in results.items():
        print(
            f"{mode:<13}{r['restore_wall_s']:>9.3f}{r['restore_anon_bytes'] / MiB:>16.1f}"
            f"{100 * r['restore_anon_bytes'] / anchor:>10.2f}%"
            f"{r['after_read_anon_bytes'] / MiB:>16.1f}{r['read_wall_s']:>8.2f}"
        )


if __name__ == "__main__":
    main()
