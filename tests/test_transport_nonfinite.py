"""A diverged island (NaN/inf pseudo-gradient) is reported on every rank, never half-applied."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_swarm.algorithm.codecs import Codec, with_error_feedback
from lightning_swarm.transport import AllReduceTransport
from lightning_swarm.transport.errors import NonFinitePseudoGradientError
from lightning_swarm.transport.reduce_scatter import ReduceScatterTransport
from tests.dist_utils import run_ranks
from tests.transport_rounds import average


def _worker(rank: int, world: int, out: str, kind: str) -> None:
    if kind == "allreduce":
        transport = AllReduceTransport(None, num_islands=world, bucket_numel=64)
    else:
        transport = ReduceScatterTransport(
            None, num_islands=world, island_index=rank, codec=Codec("int4", 32), bucket_numel=64
        )
    # Values differ between islands, so an exchange that ran before the check would show: the
    # mean of "w" over the islands is no island's own "w".
    tensors = {"w": torch.arange(40.0) * (rank + 1), "b": torch.full((3,), rank + 1.0)}
    if rank == 1:
        tensors["b"][1] = float("nan")
    before = {k: v.clone() for k, v in tensors.items()}
    try:
        average(transport, tensors, round_index=0)
        message = "no error"
    except NonFinitePseudoGradientError as err:
        message = str(err)
    # nothing was exchanged: every rank still holds its own tensors
    unchanged = all(torch.allclose(tensors[k], before[k], 0, 0, equal_nan=True) for k in tensors)
    (Path(out) / f"{rank}.txt").write_text(f"{unchanged}\n{message}")


@pytest.mark.parametrize("kind", ["allreduce", "int4"])
def test_every_rank_names_the_diverged_island(tmp_path: Path, kind: str) -> None:
    run_ranks(_worker, 3, str(tmp_path), kind)
    for rank in range(3):
        unchanged, message = (tmp_path / f"{rank}.txt").read_text().split("\n", 1)
        assert unchanged == "True"
        assert "island(s) [1] holds NaN or inf" in message
        assert "anchors unchanged" in message and "gradient clipping" in message


def test_single_island_nonfinite_is_an_error_too() -> None:
    transport = AllReduceTransport(None, num_islands=1, bucket_numel=8)
    with pytest.raises(NonFinitePseudoGradientError, match=r"island\(s\) \[0\]"):
        average(transport, {"a": torch.tensor([1.0, float("inf")])}, round_index=0)


def test_error_feedback_passes_a_diverged_tensor_through_and_keeps_its_residual() -> None:
    codec = Codec("int8", 4)
    residual = torch.full((4,), 0.5)
    x = torch.tensor([1.0, float("nan"), 2.0, 3.0])
    to_send, kept = with_error_feedback(x, residual, codec)
    assert torch.isnan(to_send[1]) and to_send[0] == 1.5
    assert torch.equal(kept, residual) and kept is not residual
