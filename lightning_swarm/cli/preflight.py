"""What the Hydra app settles before any process starts: accelerator, devices, lighthouse,
checkpoint path. Each function turns a composed option into the value Lightning will use, or
raises a ``ValueError`` naming the option and the fix, once, before the launch."""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.accelerators import AcceleratorRegistry, CUDAAccelerator, MPSAccelerator
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import Container, OmegaConf

from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.membership.errors import LighthouseUnreachableError
from lightning_swarm.membership.quorum import lighthouse_problem
from lightning_swarm.resume.integrity import checkpoint_problem
from lightning_swarm.topology import IslandTopology

LAST = "last"


def plain(value: Any) -> Any:
    """``value`` with every OmegaConf container (at any depth) turned into dicts and lists."""
    if isinstance(value, Container):
        return OmegaConf.to_container(value, resolve=True)
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(plain(v) for v in value)
    return value


def check_accelerator(accelerator: str) -> str:
    """The accelerator Lightning will pick for ``accelerator`` ("gpu" -> "cuda" or "mps").
    Raises ``ValueError`` when a GPU is asked for and torch sees none."""
    name = str(accelerator).lower()
    if name == "auto":
        if CUDAAccelerator.is_available():
            return "cuda"
        return "mps" if MPSAccelerator.is_available() else "cpu"
    if name in ("gpu", "cuda", "mps"):
        found = [
            backend  # Lightning's order for "gpu": MPS first, then CUDA
            for backend, cls in (("mps", MPSAccelerator), ("cuda", CUDAAccelerator))
            if name in ("gpu", backend) and cls.is_available()
        ]
        if found:
            return found[0]
        build = "a CPU-only build" if torch.version.cuda is None else f"CUDA {torch.version.cuda}"
        raise SwarmConfigError(
            f"trainer.accelerator={accelerator!r}, but no GPU was found on this machine (torch "
            f"{torch.__version__}, {build}, sees no CUDA or MPS device). Train on the CPU with "
            "trainer=cpu, or run where a GPU and a CUDA build of torch are installed."
        )
    return name


def resolve_devices(accelerator: str, devices: Any) -> int:
    """How many processes per node Lightning starts for ``trainer.devices`` on ``accelerator``,
    parsed as Lightning does."""
    name = check_accelerator(accelerator)
    if name not in AcceleratorRegistry:
        return devices if isinstance(devices, int) and devices > 0 else 1
    accelerator_cls = type(AcceleratorRegistry.get(name))
    if devices == "auto":
        return int(accelerator_cls.auto_device_count())
    try:
        parsed = accelerator_cls.parse_devices(plain(devices))
        return len(accelerator_cls.get_parallel_devices(parsed))
    except Exception as err:  # Lightning raises TypeError or MisconfigurationException
        hint = "a count of processes > 0, e.g. trainer.devices=2"
        if name != "cpu":
            hint += ", a list of GPU indices, -1 (every GPU) or auto"
        raise SwarmConfigError(
            f"trainer.devices={devices!r} is not valid on the {name} accelerator: give {hint}."
        ) from err


def check_islands(accelerator: str, devices: Any, num_nodes: int, island_size: int) -> None:
    """Fail now, with the resolved world size, when ``island_size`` does not divide it."""
    per_node = resolve_devices(accelerator, devices)
    try:
        IslandTopology(world_size=per_node * num_nodes, island_size=island_size, global_rank=0)
    except ValueError as err:
        raise SwarmConfigError(
            f"strategy.{err} Here trainer.devices={devices!r} means {per_node} process(es) per "
            f"node on the {check_accelerator(accelerator)} accelerator, and "
            f"trainer.num_nodes={num_nodes}."
        ) from err


def check_pipeline(
    config: SwarmConfig,
    model_options: Mapping[str, Any],
    data_options: Mapping[str, Any],
    trainer_options: Mapping[str, Any],
) -> None:
    """With pipeline stages, fail now when the model has fewer blocks than stages
    (``model.n_layer``), the batch does not split into ``pipeline_microbatches``, or gradients
    would accumulate over batches (the schedule accumulates over micro-batches)."""
    pp = config.pipeline_parallel_size
    if pp == 1:
        return
    layers = model_options.get("n_layer")
    if isinstance(layers, int) and layers < pp:
        raise SwarmConfigError(
            f"strategy.pipeline_parallel_size={pp} stages for model.n_layer={layers} blocks: "
            f"every stage needs at least one block; set model.n_layer >= {pp} or fewer stages."
        )
    batch, micro = data_options.get("batch_size"), config.microbatches
    if isinstance(batch, int) and batch % micro:
        raise SwarmConfigError(
            f"data.batch_size={batch} does not split into strategy.pipeline_microbatches="
            f"{micro} micro-batches; use a batch size that is a multiple of it, or fewer "
            "micro-batches."
        )
    accumulate = trainer_options.get("accumulate_grad_batches", 1)
    if accumulate != 1:
        raise SwarmConfigError(
            f"strategy.pipeline_parallel_size={pp} with trainer.accumulate_grad_batches="
            f"{accumulate}: the schedule already accumulates over the micro-batches; raise "
            "strategy.pipeline_microbatches and data.batch_size instead."
        )


# A TCP handshake takes one round trip on a live link: a few seconds tell a dead address.
LIGHTHOUSE_CONNECT_S = 3.0


def check_lighthouse(config: SwarmConfig, timeout_s: float = LIGHTHOUSE_CONNECT_S) -> None:
    """Raise ``LighthouseUnreachableError`` now, before any rank starts, when an elastic run's
    lighthouse accepts no connection within ``timeout_s``."""
    if config.membership != "torchft" or not config.lighthouse:
        return
    problem = lighthouse_problem(config.lighthouse, timeout_s)
    if problem is not None:
        raise LighthouseUnreachableError(
            f"strategy.lighthouse={config.lighthouse}: {problem}. Start "
            "the lighthouse first (`swarm-lighthouse --min-islands N --port P`, on a host "
            "every island reaches) and pass its address as strategy.lighthouse=http://host:P; "
            "check the host, the port and any firewall between them. The run stopped before "
            "training."
        )


# Values Lightning's fit(ckpt_path=...) resolves itself (not paths).
_LIGHTNING_NAMES = {"best", "hpc", "registry"}


def check_ckpt_file(ckpt_path: str | None) -> str | None:
    """``ckpt_path`` unchanged when it is a checkpoint file or not a local path; raises
    ``ValueError`` for a local path that is missing or a folder."""
    if ckpt_path is None or ckpt_path in _LIGHTNING_NAMES or "://" in str(ckpt_path):
        return ckpt_path
    path = Path(ckpt_path)
    if path.is_dir():
        raise SwarmConfigError(
            f"ckpt_path={ckpt_path} is a folder; give one checkpoint file in it (e.g. "
            f"{path / 'last.ckpt'}), or ckpt_path=last run_dir={ckpt_path} for the newest one."
        )
    if not path.exists():
        raise SwarmConfigError(
            f"ckpt_path={ckpt_path} does not exist; check the path (relative paths start at "
            f"{Path.cwd()}), or use ckpt_path=last with run_dir=<the run directory>."
        )
    return ckpt_path


def resolve_ckpt_path(
    ckpt_path: str | None, run_dir: str | None, callbacks: list[Any]
) -> str | None:
    """The checkpoint ``trainer.fit`` resumes from: for ``last``, the newest complete
    ``*.ckpt`` under ``run_dir`` if given, else under the ModelCheckpoint folders; any other
    value is checked by ``check_ckpt_file``.

    Raises:
        ValueError: ``last`` with nowhere to look, or no checkpoint where it looked.
    """
    if ckpt_path != LAST:
        return check_ckpt_file(ckpt_path)
    if run_dir is not None:
        places = [Path(run_dir)]
        if not places[0].is_dir():
            raise SwarmConfigError(
                f"ckpt_path=last: run_dir={run_dir!r} is not a folder; give the run directory "
                "of the run to resume (e.g. run_dir=outputs/2026-12-01/10-00-00)."
            )
    else:
        places = [
            Path(c.dirpath) for c in callbacks if isinstance(c, ModelCheckpoint) and c.dirpath
        ]
        if not places:
            raise SwarmConfigError(
                "ckpt_path=last needs a place to look: add run_dir=<the run directory of the "
                "run to resume>, or train with a ModelCheckpoint that has a dirpath "
                "(callbacks=checkpoint)."
            )
    found = [p for place in places if place.is_dir() for p in place.rglob("*.ckpt") if p.is_file()]
    if not found:
        raise SwarmConfigError(
            f"ckpt_path=last found no *.ckpt file under {', '.join(map(str, places))}; check "
            "the folder, or train with callbacks=checkpoint to write checkpoints there."
        )
    return str(newest_complete(found).resolve())


def newest_complete(found: list[Path]) -> Path:
    """The newest checkpoint (by mtime, then name) that passes ``checkpoint_problem``; newer
    ones that fail are skipped with a warning naming them and why. Raises ``ValueError`` when
    none is complete."""
    ordered = sorted(found, key=lambda p: (p.stat().st_mtime_ns, p.name), reverse=True)
    skipped: list[str] = []
    for path in ordered:
        problem = checkpoint_problem(path)
        if problem is None:
            if skipped:
                warnings.warn(
                    f"ckpt_path=last: skipped newer checkpoint(s) that cannot be resumed from: "
                    f"{'; '.join(skipped)}. Resuming from {path}, the newest complete one.",
                    UserWarning,
                    stacklevel=3,
                )
            return path
        skipped.append(f"{path} ({problem})")
    raise SwarmConfigError(
        "ckpt_path=last found no complete checkpoint: " + "; ".join(skipped) + ". Give an "
        "intact checkpoint as ckpt_path=<file>, or start without ckpt_path."
    )
