"""GPU mode of ``benchmarks/sync_cost.py``: the 1.21B demo GPT on one GPU, one island.

The demo GPT at 24 layers, width 2048, 16 heads, 1024 tokens, byte vocabulary (1.21B parameters,
4.85 GB in float32) lives on the GPU. One island, so no bytes cross a network: the round is
pure local work, which is what this mode measures. Rows (median of ``reps`` after a warm-up):

- ``inner step``: bf16 autocast, batch 8 x 1024, fused AdamW (foreach on a stand-in);
- ``ours: held, CPU anchors``: ``OuterSync`` over ``sync_cost.Held`` (the held form),
  the default anchor device;
- ``ours: streamed, CPU anchors``: ``OuterSync`` as the strategy builds it now (pinned anchors
  and state, buckets through the GPU on side streams), with its extra GPU memory;
- ``ours: streamed, GPU anchors``: ``anchor_device="cuda"`` (anchors and state on the GPU);
- ``torchft-style``: pseudo-gradient on the GPU against pinned CPU copies, outer state on the GPU
  (what torchft's DiLoCo does: backup -> GPU, subtract, restore, ``optimizer.step()``, save);
- ``floor: pinned copies``: every parameter GPU -> pinned CPU and back, the least a round with
  CPU anchors can move; ``copy GPU -> pageable CPU`` beside it.

The sync share at sync_every=100 is ``round / (100 * inner step + round)``.

``--stand-in`` runs the same code on a small GPT on the CPU (2 layers, width 64) where no GPU is
present, so the path is exercised; its figures say nothing about a GPU.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.sync_cost import Held
from lightning_swarm.demo.gpt import GPT
from lightning_swarm.outer import OuterSync
from lightning_swarm.transport import AllReduceTransport

OUTER_SGD = functools.partial(torch.optim.SGD, lr=0.7, momentum=0.9, nesterov=True)
BUCKET_MB = 32.0


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, reps: int) -> list[float]:
    fn()  # warm-up: allocations, pinning, lazy state
    _sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - start)
    return times


def _move(model: torch.nn.Module) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1e-4)


def _ours(model: torch.nn.Module, anchor_device: torch.device, *, held: bool) -> Callable[[], None]:
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=int(BUCKET_MB * 2**18))
    outer = OuterSync(
        dict(model.named_parameters()),
        outer_optimizer=OUTER_SGD,
        transport=Held(transport) if held else transport,
        sync_every=1,
        anchor_device=anchor_device,
    )

    def round_() -> None:
        _move(model)
        outer.on_inner_step()

    return round_


def _torchft_style(model: torch.nn.Module, pin: bool) -> Callable[[], None]:
    params = list(model.parameters())
    backups = [p.detach().to("cpu", copy=True) for p in params]
    if pin:
        backups = [b.pin_memory() for b in backups]
    outer = OUTER_SGD(params)

    def round_() -> None:
        _move(model)
        with torch.no_grad():
            grads = [
                b.to(p.device, non_blocking=True) - p for b, p in zip(backups, params, strict=True)
            ]
            for p, b, g in zip(params, backups, grads, strict=True):
                p.copy_(b, non_blocking=True)
                p.grad = g
        outer.step()
        outer.zero_grad(set_to_none=True)
        with torch.no_grad():
            for b, p in zip(backups, params, strict=True):
                b.copy_(p, non_blocking=True)

    return round_


def _copies(model: torch.nn.Module, pin: bool) -> dict[str, Callable[[], None]]:
    params = [p.detach() for p in model.parameters()]
    host = [torch.empty(p.shape, pin_memory=pin) for p in params]
    pageable = [torch.empty(p.shape) for p in params]

    def d2h_h2d() -> None:
        for h, p in zip(host, params, strict=True):
            h.copy_(p, non_blocking=pin)
        for h, p in zip(host, params, strict=True):
            p.copy_(h, non_blocking=pin)

    def d2h_pageable() -> None:
        for h, p in zip(pageable, params, strict=True):
            h.copy_(p)

    return {"floor: pinned copies GPU->CPU->GPU": d2h_h2d, "copy GPU->pageable CPU": d2h_pageable}


def _inner_step(model: GPT, device: torch.device, batch: int, block: int) -> Callable[[], None]:
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=fused, foreach=not fused)
    tokens = torch.randint(0, 256, (batch, block + 1), device=device)

    def step() -> None:
        with torch.autocast(device.type, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), tokens[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step


def run_gpu(*, stand_in: bool, reps: int) -> dict[str, Any]:
    """Time the GPU rows (see the module docstring); returns times per row and the settings."""
    if not stand_in and not torch.cuda.is_available():
        raise SystemExit("--gpu needs a CUDA GPU; add --stand-in to run the path on the CPU")
    device = torch.device("cpu" if stand_in else "cuda")
    shape = (
        dict(n_layer=2, n_head=2, n_embd=64)
        if stand_in
        else dict(n_layer=24, n_head=16, n_embd=2048)
    )
    batch, block = (2, 64) if stand_in else (8, 1024)
    torch.manual_seed(0)
    model = GPT(256, block, **shape).to(device)
    numel = sum(p.numel() for p in model.parameters())
    pin = device.type == "cuda"
    gpu = torch.device("cuda") if pin else device
    rows: dict[str, Callable[[], None]] = {
        "inner step": _inner_step(model, device, batch, block),
        "ours: held, CPU anchors": _ours(model, torch.device("cpu"), held=True),
        "ours: streamed, CPU anchors": _ours(model, torch.device("cpu"), held=False),
        "ours: streamed, GPU anchors": _ours(model, gpu, held=False),
        "torchft-style (pinned CPU backup, GPU outer state)": _torchft_style(model, pin),
        **_copies(model, pin),
    }
    times: dict[str, list[float]] = {}
    extra_gpu: dict[str, int] = {}
    for name, fn in rows.items():
        fn()  # first call: lazy state, pinning
        if pin:
            _sync(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        times[name] = _timed(fn, device, reps)
        if pin:
            extra_gpu[name] = torch.cuda.max_memory_allocated(device) - base
    inner = statistics.median(times["inner step"])
    share = {
        name: statistics.median(t) / (100 * inner + statistics.median(t))
        for name, t in times.items()
        if name.startswith(("ours", "torchft"))
    }
    return {
        "mode": "gpu-stand-in" if stand_in else "gpu",
        "device": torch.cuda.get_device_name(device) if pin else "cpu (stand-in)",
        "num_params": numel,
        "times_s": times,
        "extra_gpu_bytes": extra_gpu,
        "bucket_mb": BUCKET_MB,
        "sync_share_at_100": share,
        "floor": "floor: pinned copies GPU->CPU->GPU",
    }
