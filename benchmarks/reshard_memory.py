"""Host memory of a resume onto another layout: the anchors and outer optimizer state one rank
cuts out of a checkpoint of FSDP islands (data_parallel=2), for FSDP islands of dp=4 (and dp=3)
and for DDP islands, at >= 100M parameters.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/reshard_memory.py [--params 100e6] [--work DIR]

The checkpoint is ``benchmarks/export_memory.py``'s ``fsdp`` one (a stack of square Linear
layers, 2 islands x 2 FSDP2 ranks, 2 inner steps with ``sync_every=1``, the default outer
optimizer, so each anchor has a momentum buffer); ``--work`` keeps and reuses it.

Each target rank is a fresh interpreter (this file with ``--child``) that runs what
``resume.reshard.reshard`` runs for the global state: read the save's anchor files mapped
(``load_outer``), then ``cut_outer_state`` for this rank's layout (FSDP2's row chunks of every
parameter, or whole tensors for DDP). Reported: the anchor (+ outer state) bytes this rank
holds; the anonymous memory (smaps_rollup ``Anonymous``) the cut added, right after it and
after a pass that reads every element; the bytes copied into the file-backed scratch (slices
that are not a contiguous part of one saved tensor); wall time. Each cut is then checked bit
for bit against the same slice of ``load_global_state_dict``'s anchors (after the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import subprocess
import sys
import tempfile
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch

from lightning_swarm.algorithm.model_layout import ParamLayout
from lightning_swarm.memory.procfs import ProcReader
from lightning_swarm.resume.files import swarm_root
from lightning_swarm.resume.global_model import assemble, model_pieces
from lightning_swarm.resume.records import SwarmRecord
from lightning_swarm.resume.reshard import cut_outer_state, load_outer
from lightning_swarm.resume.restore import Source, read_file

MiB = 2**20
TARGETS = ["fsdp4:0", "fsdp4:1", "fsdp4:2", "fsdp4:3", "fsdp3:1", "ddp"]


def _anonymous() -> int:
    rollup = ProcReader().smaps_rollup()
    assert rollup is not None, "needs /proc/self/smaps_rollup"
    return rollup["Anonymous"]


def target_layout(shape: tuple[int, ...], dtype: str, target: str) -> ParamLayout:
    """This target rank's slice: FSDP2's dim-0 chunk of ``ceil(rows / dp)`` rows, or whole."""
    if target == "ddp":
        return ParamLayout(shape, dtype, (0,) * len(shape), shape)
    mesh, position = target.removeprefix("fsdp").split(":")
    dp, k = int(mesh), int(position)
    chunk = math.ceil(shape[0] / dp)
    start = min(k * chunk, shape[0])
    rows = max(0, min(chunk, shape[0] - start))
    return ParamLayout(shape, dtype, (start, *(0,) * (len(shape) - 1)), (rows, *shape[1:]))


def child(ckpt: str, target: str) -> None:
    path = Path(ckpt)
    loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    record = SwarmRecord.from_dict(loaded["swarm"], str(path))
    source = Source(path, record)
    read = partial(read_file, source, verify=False, use_mmap=True, legacy=[])
    gc.collect()
    baseline = _anonymous()
    start = time.perf_counter()
    outers = load_outer(read, record, source.directory, verify=False)
    targets = []
    for outer in outers:
        layout = {
            name: target_layout(p.shape, str(p.dtype).removeprefix("torch."), target)
            for name, p in outer.anchors.items()
        }
        targets.append((list(layout), layout))
    cut, copied, file_backed = cut_outer_state(outers, targets, source.directory)
    wall = time.perf_counter() - start
    after = _anonymous()
    held = sum(t.numel() * t.element_size() for t in cut.values())
    anchors = sum(t.numel() * t.element_size() for k, t in cut.items() if k[0] == "anchor")
    # Read every element without a temporary of the tensor's size (a cast or ``abs`` would add
    # its own anonymous memory to the figure).
    total = sum(float(torch.aminmax(t.reshape(-1)).max) for t in cut.values() if t.numel())
    touched = _anonymous()
    # Bit for bit against the global anchors (after the figures: this allocates).
    pieces = model_pieces(path)
    for key, tensor in cut.items():
        if key[0] != "anchor":
            continue
        part = targets[key[1]][1][key[2]]
        offset, shape = part.slice
        whole = assemble(key[2], pieces[key[2]], tensor.dtype)
        expected = whole[tuple(slice(o, o + s) for o, s in zip(offset, shape, strict=True))]
        assert torch.equal(tensor, expected), f"{target}: {key[2]} differs"
    print(
        json.dumps(
            {
                "target": target,
                "anchor_bytes": anchors,
                "held_bytes": held,
                "anon_added": after - baseline,
                "anon_added_after_read": touched - baseline,
                "copied_bytes": copied,
                "file_backed": file_backed,
                "wall_s": wall,
                "checksum": total,
            }
        )
    )


def measure(ckpt: Path, target: str) -> dict[str, Any]:
    command = [sys.executable, __file__, "--child", str(ckpt), target]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def _row(m: dict[str, Any]) -> str:
    share = 100 * m["anon_added_after_read"] / m["anchor_bytes"]
    cells = [
        m["target"].replace("fsdp", "FSDP dp=").replace(":", ", position ").replace("ddp", "DDP"),
        f"{m['anchor_bytes'] / MiB:,.0f}",
        f"{m['held_bytes'] / MiB:,.0f}",
        f"{m['anon_added'] / MiB:,.1f}",
        f"{m['anon_added_after_read'] / MiB:,.1f} ({share:.2f}%)",
        f"{m['copied_bytes'] / MiB:,.0f}",
        f"{m['wall_s']:.2f}",
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| target rank | its anchors (MiB) | anchors + outer state (MiB) | anon added (MiB) "
    "| anon added after reading all (share of anchors) | copied to file-backed scratch (MiB) "
    "| wall (s) |\n|---|---|---|---|---|---|---|"
)


def run(args: argparse.Namespace, work: Path) -> None:
    from benchmarks.export_memory import make_checkpoint

    width = 64 * math.ceil(math.sqrt(args.params / args.layers) / 64)
    print(f"model: {args.layers} x Linear({width}, {width})", flush=True)
    ckpt = make_checkpoint(work, "fsdp", width, args.layers)
    rows = []
    for target in TARGETS:
        figures = measure(ckpt, target)
        print(json.dumps(figures), flush=True)
        rows.append(_row(figures))
    leftovers = [p.name for p in swarm_root(ckpt).iterdir() if p.name.startswith(".reshard-")]
    assert not leftovers, f"scratch files left behind: {leftovers}"
    print("\n" + HEADER + "\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters in the model")
    parser.add_argument("--layers", type=int, default=24, help="square Linear layers")
    parser.add_argument("--work", type=Path, help="for the checkpoint (default: a temp dir)")
    parser.add_argument("--child", nargs=2, metavar=("CKPT", "TARGET"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        run(args, args.work)
        return
    with tempfile.TemporaryDirectory() as tmp:
        run(args, Path(tmp))


if __name__ == "__main__":
    main()
