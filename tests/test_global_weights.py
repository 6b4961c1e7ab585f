"""``load_global_state_dict``: the global model (the anchors) out of any swarm checkpoint.

Between outer rounds the Lightning file holds island 0's drifting local weights; the helper's
result must stay the model of the last round, and right after a round equal the weights.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import lightning_swarm
from lightning_swarm import load_global_state_dict
from lightning_swarm.resume.files import anchor_shard_names
from tests.resume_utils import SYNC_EVERY, StepDataModel, fit


@pytest.fixture(scope="module", params=[1, 2], ids=["2-islands-of-1", "1-island-of-2-sharded"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Checkpoints after every step of a 6-step run (rounds after steps 3 and 6)."""
    root = tmp_path_factory.mktemp("global")
    fit(root / "out", devices=2, island_size=request.param, max_steps=6, ckpt_dir=root / "ckpts")
    return root / "ckpts"


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    return torch.load(ckpt, weights_only=True)["state_dict"]


def test_global_model_is_the_last_rounds_between_rounds(run: Path) -> None:
    at_round = run / f"step={SYNC_EVERY}.ckpt"
    global_at_round = load_global_state_dict(at_round)
    # Right after a round every island holds the new global model.
    assert global_at_round.keys() == _weights(at_round).keys()
    for name, value in _weights(at_round).items():
        assert torch.equal(global_at_round[name], value), name
    for step in (SYNC_EVERY + 1, SYNC_EVERY + 2):
        local = _weights(run / f"step={step}.ckpt")
        assert not torch.equal(local["net.0.weight"], global_at_round["net.0.weight"])
        got = load_global_state_dict(run / f"step={step}.ckpt")
        for name, value in global_at_round.items():
            assert torch.equal(got[name], value), (step, name)
    module = StepDataModel()
    module.load_state_dict(got)  # loads into the module that was trained, as it is


def test_sharded_anchors_are_joined(run: Path) -> None:
    record = torch.load(run / "step=4.ckpt", weights_only=True)["swarm"]
    shards = anchor_shard_names(record["files"])
    assert len(shards) in (0, 2)  # unsharded islands of 1, or one file per rank of island 0


def test_a_plain_checkpoint_is_refused_with_the_fix(tmp_path: Path) -> None:
    plain = tmp_path / "plain.ckpt"
    torch.save({"state_dict": {"w": torch.zeros(1)}}, plain)
    with pytest.raises(lightning_swarm.SwarmCheckpointError, match="its state_dict already is"):
        load_global_state_dict(plain)
