"""Host memory and wall time of ``swarm-export`` on a real checkpoint of a >= 100M-parameter model.

Run:  PYTHONPATH=. .venv/bin/python benchmarks/export_memory.py [--params 100e6] [--layers 24]
      [--work DIR]

``--work DIR`` keeps the checkpoints there (and reuses them on the next run with the same
model); without it they go to a temporary directory, removed at the end.

Checkpoints: a stack of ``--layers`` square ``Linear`` layers (width rounded up to a multiple of
64 so that ``layers * width**2 >= --params``; float32), trained 2 inner steps with
``sync_every=1`` on CPU (gloo, ``start_method="fork"``, plain SGD as inner optimizer), saved by
a ``ModelCheckpoint`` at step 2, in two layouts:

- ``fsdp``: 2 islands x 2 ranks, ``configure_model`` shards every layer with ``fully_shard``
  over the island's ``data_parallel`` mesh: per-rank files hold row slices;
- ``ddp``: 2 islands x 1 rank: whole tensors.

Export: each run is a fresh interpreter (this file with ``--child``) that imports
``lightning_swarm.resume.global_model``, reports its memory (the baseline), waits for the parent,
calls ``export`` (what ``swarm-export CKPT OUT [--dtype]`` calls) and reports its VmHWM. The
parent samples the child's ``/proc/<pid>/status`` every ``--sample-ms`` during the export:
peak VmRSS, and peak RssAnon (anonymous memory: what the export allocates; the pages of the
memory-mapped inputs it reads are file-backed, reclaimable, and show as RssFile). The inputs
are warm in the page cache (just written). VmHWM is reset (``/proc/self/clear_refs``) at the
baseline, so it is the peak RSS of the export itself.

Reported per export (a JSON line each, then a Markdown table): the global model's bytes and its
largest tensor's, in the exported dtype; the child's anonymous memory after imports (baseline)
and its peak minus that baseline (what the export adds); peak RSS (sampled, and VmHWM); peak
file-backed memory minus the baseline's; wall time of ``export``; the files written. The three
exports: FSDP islands in float32 and with ``dtype=bfloat16``, DDP islands in float32.

Correctness: every exported tensor equals ``load_global_state_dict(ckpt)`` (cast for the
``bfloat16`` run), so the figures are those of a correct export.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors import safe_open
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

from lightning_swarm import SwarmStrategy, load_global_state_dict
from lightning_swarm.memory.procfs import ProcReader, parse_status
from lightning_swarm.resume.global_model import export, model_pieces

MiB = 2**20
RUNS = (("fsdp", None), ("fsdp", "bfloat16"), ("ddp", None))
ISLAND_SIZE = {"fsdp": 2, "ddp": 1}
NUM_ISLANDS = 2
SAVE_STEP = 2


def _status(path: str) -> dict[str, int] | None:
    """The fields of ``/proc/<path>`` (``self/status``, ``<pid>/status``); None once it is gone."""
    text = ProcReader().read(path)
    return None if text is None else parse_status(text)


# ---- the child: one export in a fresh interpreter ----------------------------------------


def child(ckpt: str, out: str, dtype_name: str | None) -> None:
    """Report the baseline (after imports), wait for "go", export, report the peak."""
    dtype = getattr(torch, dtype_name) if dtype_name else None
    gc.collect()
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # resets VmHWM to the current RSS
    print(json.dumps({"baseline": _status("self/status")}), flush=True)  # parent: start sampling
    sys.stdin.readline()
    start = time.perf_counter()
    written = export(ckpt, out, dtype=dtype)
    wall_s = time.perf_counter() - start
    report = {"wall_s": wall_s, "files": [str(p) for p in written], "end": _status("self/status")}
    print(json.dumps(report), flush=True)


class Sampler(threading.Thread):
    """Peaks of a process's VmRSS, RssAnon and RssFile, read every ``interval_s``."""

    def __init__(self, pid: int, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.path, self.interval_s = f"{pid}/status", interval_s
        self.peaks: dict[str, int] = {}
        self.num_samples = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            status = _status(self.path)
            if status is None:  # the process is gone
                return
            for key in ("VmRSS", "RssAnon", "RssFile"):
                self.peaks[key] = max(self.peaks.get(key, 0), status.get(key, 0))
            self.num_samples += 1
            time.sleep(self.interval_s)


def measure_export(ckpt: Path, out: Path, dtype: str | None, sample_ms: float) -> dict[str, Any]:
    """Run one export in a child and return its memory figures (bytes) and wall time."""
    command = [sys.executable, __file__, "--child", str(ckpt), str(out)]
    command += ["--dtype", dtype] if dtype else []
    with subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) as p:
        assert p.stdin is not None and p.stdout is not None
        baseline = json.loads(p.stdout.readline())["baseline"]
        sampler = Sampler(p.pid, sample_ms / 1000)
        sampler.start()
        p.stdin.write("go\n")
        p.stdin.flush()
        line = p.stdout.readline()
        sampler.stop.set()
        sampler.join()
        if p.wait() != 0 or not line:
            raise RuntimeError(f"the export of {ckpt} failed (exit {p.returncode})")
    report = json.loads(line)
    end = report["end"]
    # The last reading is the child's own, so the peaks include the end state too.
    peaks = {k: max(sampler.peaks.get(k, 0), end[k]) for k in ("VmRSS", "RssAnon", "RssFile")}
    return {
        "baseline_anon": baseline["RssAnon"],
        "baseline_rss": baseline["VmRSS"],
        "peak_anon": peaks["RssAnon"],
        "peak_rss": peaks["VmRSS"],
        "baseline_file": baseline["RssFile"],
        "peak_file": peaks["RssFile"],
        "vmhwm": end["VmHWM"],
        "wall_s": report["wall_s"],
        "files": report["files"],
        "num_samples": sampler.num_samples,
    }


# ---- the checkpoints ------------------------------------------------------------------------


class Stack(pl.LightningModule):
    """``num_layers`` Linear(width, width); FSDP2-sharded per layer under FSDP islands."""

    def __init__(self, width: int, num_layers: int) -> None:
        super().__init__()
        self.width = width
        self.net = torch.nn.Sequential(*(torch.nn.Linear(width, width) for _ in range(num_layers)))

    def configure_model(self) -> None:
        if self.device_mesh is None:  # DDP islands: nothing to shard
            return
        dp = self.device_mesh["data_parallel"]
        for layer in self.net:
            fully_shard(layer, mesh=dp)
        fully_shard(self.net, mesh=dp)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(100 * self.global_step + self.global_rank)
        x = torch.randn(4, self.width, generator=g)
        return self.net(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)  # no state: low host memory

    def train_dataloader(self) -> DataLoader:
        return DataLoader(TensorDataset(torch.zeros(64, 1)), batch_size=1)


def make_checkpoint(work: Path, layout: str, width: int, num_layers: int) -> Path:
    """Fit ``layout``'s islands for ``SAVE_STEP`` steps and return the checkpoint (reused when a
    previous run left it under ``work``)."""
    root = work / f"{layout}-{num_layers}x{width}"
    ckpt = root / f"step={SAVE_STEP}.ckpt"
    if ckpt.is_file():
        print(f"reusing {ckpt}", flush=True)
        return ckpt
    pl.seed_everything(0, verbose=False)
    strategy = SwarmStrategy(
        sync_every=1,
        island_size=ISLAND_SIZE[layout],
        island_parallel=layout,
        start_method="fork",
    )
    save = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=SAVE_STEP)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=NUM_ISLANDS * ISLAND_SIZE[layout],
        strategy=strategy,
        max_steps=SAVE_STEP,
        callbacks=[save],
        num_sanity_val_steps=0,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    start = time.perf_counter()
    trainer.fit(Stack(width, num_layers))
    print(f"fit {layout}: {time.perf_counter() - start:.1f} s", flush=True)
    assert ckpt.is_file(), f"the fit left no {ckpt}"
    return ckpt


# ---- the parent -----------------------------------------------------------------------------


def model_sizes(ckpt: Path, dtype: str | None) -> tuple[int, int]:
    """(all bytes, the largest tensor's bytes) of the global model as exported (in ``dtype``
    where given), from the checkpoint's index alone."""
    cast = getattr(torch, dtype) if dtype else None
    pieces = model_pieces(ckpt).values()
    sizes = [p.nbytes // p.dtype.itemsize * (cast or p.dtype).itemsize for p in pieces]
    return sum(sizes), max(sizes)


def check_export(ckpt: Path, files: list[str], dtype: str | None) -> int:
    """Assert the exported tensors equal ``load_global_state_dict(ckpt)``; return their count."""
    expected = load_global_state_dict(ckpt)
    cast = getattr(torch, dtype) if dtype else None
    seen = 0
    for file in (f for f in files if f.endswith(".safetensors")):
        with safe_open(file, framework="pt") as handle:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a dict)
                want = expected.pop(name)
                want = want.to(cast) if cast is not None else want
                got = handle.get_tensor(name)
                assert got.dtype == want.dtype and torch.equal(got, want), f"{file}: {name}"
                seen += 1
    assert not expected, f"the export lacks {sorted(expected)[:3]}"
    return seen


def _row(layout: str, dtype: str | None, sizes: tuple[int, int], m: dict[str, Any]) -> str:
    added = (m["peak_anon"] - m["baseline_anon"]) / MiB
    cells = [
        f"{NUM_ISLANDS} x {ISLAND_SIZE[layout]} {layout}",
        dtype or "float32",
        f"{sizes[0] / MiB:,.0f}",
        f"{sizes[1] / MiB:,.0f}",
        f"{m['baseline_anon'] / MiB:,.0f}",
        f"{added:,.1f}",
        f"{m['peak_rss'] / MiB:,.0f} ({m['vmhwm'] / MiB:,.0f})",
        f"{(m['peak_file'] - m['baseline_file']) / MiB:,.0f}",
        f"{m['wall_s']:.2f}",
        str(len(m["files"])),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| islands x ranks | dtype | model (MiB) | largest param (MiB) | baseline anon (MiB) "
    "| export anon (MiB) | peak RSS (VmHWM) (MiB) | file-backed added (MiB) | wall (s) | files |\n"
    "|---|---|---|---|---|---|---|---|---|---|"
)


def run(args: argparse.Namespace, work: Path) -> None:
    width = 64 * math.ceil(math.sqrt(args.params / args.layers) / 64)
    num_params = args.layers * (width + 1) * width
    print(f"model: {args.layers} x Linear({width}, {width}), {num_params:,} parameters", flush=True)
    ckpts = {
        layout: make_checkpoint(work, layout, width, args.layers) for layout in ("fsdp", "ddp")
    }
    gc.collect()
    rows = []
    for layout, dtype in RUNS:
        out = work / f"export-{layout}-{dtype or 'float32'}"
        shutil.rmtree(out, ignore_errors=True)
        figures = measure_export(ckpts[layout], out, dtype, args.sample_ms)
        sizes = model_sizes(ckpts[layout], dtype)
        num_tensors = check_export(ckpts[layout], figures["files"], dtype)
        print(json.dumps({"layout": layout, "dtype": dtype, "tensors": num_tensors, **figures}))
        rows.append(_row(layout, dtype, sizes, figures))
        shutil.rmtree(out)
    print("\n" + HEADER + "\n" + "\n".join(rows))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=100e6, help="parameters in the model")
    parser.add_argument("--layers", type=int, default=24, help="square Linear layers")
    parser.add_argument("--work", type=Path, help="for the checkpoints (default: a temp dir)")
    parser.add_argument("--sample-ms", type=float, default=5.0, help="the parent's sampling")
    parser.add_argument("--child", nargs=2, metavar=("CKPT", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--dtype", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.dtype)
        return
    if args.work is not None:
        args.work.mkdir(parents=True, exist_ok=True)
        run(args, args.work)
        return
    with tempfile.TemporaryDirectory(prefix="export_memory_") as work:
        run(args, Path(work))


if __name__ == "__main__":
    main()
