"""The model out of a checkpoint, offline (issue 36, item 3): ``load_global_state_dict`` and
``swarm-export`` for DDP and FSDP islands, against the state each rank held when it saved.

The FSDP run (2 islands x 2 ranks, ``Linear(6, 5)`` split 3 + 2 rows and ``Linear(5, 1)`` split
1 + 0) saves at step 5, two steps after its last round, so anchors and local weights differ.
Each rank also dumps, at that save, its anchors and local module shards; the reference global
tensor is island 0's anchor shards concatenated along rows (FSDP2 shards dim 0), built without
the layout the export reads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from safetensors.torch import load_file

from lightning_swarm import SwarmCheckpointError, SwarmStrategy, load_global_state_dict
from lightning_swarm.cli.export import main as export_main
from lightning_swarm.resume.global_model import export
from tests.fsdp_utils import ShardedStepModel, _local
from tests.helpers import QUIET

SAVE_STEP = 5


class DumpAtSave(pl.Callback):
    """Every rank writes its anchors and local module shards at the step it saves."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: Any, *_: Any) -> None:
        if trainer.global_step != SAVE_STEP:
            return
        strategy = trainer.strategy
        assert isinstance(strategy, SwarmStrategy)
        info = {
            "anchors": {k: v.clone() for k, v in strategy.outer_syncs[0].anchors.items()},
            "module": {k: _local(v).detach().clone() for k, v in pl_module.state_dict().items()},
        }
        self.out.mkdir(parents=True, exist_ok=True)
        torch.save(info, self.out / f"rank{trainer.global_rank}.pt")


def _fit(root: Path, island_parallel: str) -> Path:
    pl.seed_everything(0)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=4,
        strategy=SwarmStrategy(
            sync_every=3, island_size=2, island_parallel=island_parallel, start_method="fork"
        ),
        max_steps=6,
        callbacks=[
            DumpAtSave(root / "dump"),
            ModelCheckpoint(
                dirpath=root / "ckpts", filename="{step}", every_n_train_steps=SAVE_STEP
            ),
        ],
        num_sanity_val_steps=0,
        **{**QUIET, "enable_checkpointing": True},
    )
    model = ShardedStepModel()
    if island_parallel == "ddp":
        model.configure_model = lambda: None  # type: ignore[method-assign]
    trainer.fit(model)
    return root / "ckpts" / f"step={SAVE_STEP}.ckpt"


@pytest.fixture(scope="module")
def fsdp(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("fsdp")
    ckpt = _fit(root, "fsdp")
    return ckpt, [torch.load(root / "dump" / f"rank{r}.pt") for r in range(4)]


def _cat(ranks: list[dict[str, Any]], key: str, which: tuple[int, int]) -> dict[str, Any]:
    return {n: torch.cat([ranks[r][key][n] for r in which]) for n in ranks[which[0]][key]}


def test_fsdp_global_model_is_island_0s_anchor_shards_joined(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    ckpt, ranks = fsdp
    expected = _cat(ranks, "anchors", (0, 1))
    assert expected["net.0.weight"].shape == (5, 6) and expected["net.2.bias"].shape == (1,)
    got = load_global_state_dict(ckpt)
    assert list(got) == ["net.0.weight", "net.0.bias", "net.2.weight", "net.2.bias"]
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    # The local weights moved on since the round: the export is not island 0's own weights.
    local = _cat(ranks, "module", (0, 1))
    assert not torch.equal(local["net.0.weight"], expected["net.0.weight"])
    assert export_main([str(ckpt), str(tmp_path / "out")]) == 0
    exported = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert exported.keys() == expected.keys()
    assert all(torch.equal(exported[n], expected[n]) for n in expected)


def test_fsdp_local_weights_of_one_island_and_another_dtype(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    ckpt, ranks = fsdp
    export(ckpt, tmp_path, island=1, dtype=torch.bfloat16)
    got = load_file(str(tmp_path / "model.safetensors"))
    expected = _cat(ranks, "module", (2, 3))
    assert all(got[n].dtype == torch.bfloat16 for n in got)
    assert all(torch.equal(got[n], expected[n].to(torch.bfloat16)) for n in expected)
    assert not torch.equal(expected["net.0.weight"], _cat(ranks, "module", (0, 1))["net.0.weight"])


def _copy(ckpt: Path, into: Path) -> Path:
    """A copy of ``ckpt`` and its .swarm directory under ``into``, to damage."""
    copy = into / ckpt.name
    copy.write_bytes(ckpt.read_bytes())
    shutil.copytree(Path(f"{ckpt}.swarm"), Path(f"{copy}.swarm"))
    return copy


def test_fsdp_a_missing_rank_file_is_named_not_a_partial_model(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    copy = _copy(fsdp[0], tmp_path)
    (shard,) = Path(f"{copy}.swarm").glob("*/anchors-rank-00001.pt")
    shard.unlink()
    with pytest.raises(SwarmCheckpointError, match=r"anchors-rank-00001\.pt is missing"):
        export(copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_fsdp_a_truncated_rank_file_is_named(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    copy = _copy(fsdp[0], tmp_path)
    (shard,) = Path(f"{copy}.swarm").glob("*/anchors-rank-00000.pt")
    shard.write_bytes(shard.read_bytes()[:-100])
    assert export_main([str(copy), str(tmp_path / "out")]) == 1
    with pytest.raises(SwarmCheckpointError, match=r"anchors-rank-00000\.pt is truncated"):
        export(copy, tmp_path / "out")


def test_ddp_export_in_shards_equals_the_global_state_dict(tmp_path: Path) -> None:
    ckpt = _fit(tmp_path, "ddp")
    expected = load_global_state_dict(ckpt)
    anchors = torch.load(tmp_path / "dump" / "rank0.pt")["anchors"]
    assert all(torch.equal(expected[n], anchors[n]) for n in anchors)
    written = export(ckpt, tmp_path / "out", max_shard_bytes=100)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert len(written) == len(set(index["weight_map"].values())) + 1 > 2
    got: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        got.update(load_file(str(tmp_path / "out" / name)))
    assert got.keys() == expected.keys() == index["weight_map"].keys()
    assert all(torch.equal(got[n], expected[n]) for n in expected)
    sizes = sum(t.numel() * t.element_size() for t in got.values())
    assert index["metadata"]["total_size"] == sizes
    # Island 1's local weights: its own ranks' module state, not the anchors.
    export(ckpt, tmp_path / "local", island=1)
    local = load_file(str(tmp_path / "local" / "model.safetensors"))
    island1 = torch.load(tmp_path / "dump" / "rank2.pt")["module"]
    assert all(torch.equal(local[n], island1[n]) for n in island1)


def test_a_checkpoint_without_swarm_state_or_an_unwritable_place_is_named(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    plain = tmp_path / "x.ckpt"
    torch.save({"state_dict": {}}, plain)
    with pytest.raises(SwarmCheckpointError, match="holds no swarm state"):
        export(plain, tmp_path / "out")
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the export's parent directory should be
    with pytest.raises(SwarmCheckpointError, match=f"export directory {blocker / 'out'}"):
        export(fsdp[0], blocker / "out")
    assert export_main([str(fsdp[0]), str(blocker / "out")]) == 1
    with pytest.raises(SwarmCheckpointError, match="does not exist; give the .ckpt file's path"):
        export(tmp_path / "missing.ckpt", tmp_path / "out")


def test_an_island_the_checkpoint_lacks_is_named_with_the_ones_it_has(
    fsdp: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    with pytest.raises(SwarmCheckpointError, match=r"no module state for island 5: .* \[0, 1\]"):
        export(fsdp[0], tmp_path / "out", island=5)
