"""``swarm-plan``: the per-rank memory and round time of a layout, from the library's formulas."""

from __future__ import annotations

import pytest

from lightning_swarm.cli.plan import main, plan


def test_a_120b_model_in_8_stages() -> None:
    p = plan(120e9, stages=8, islands=4, link_gbit=(10.0,))
    assert p["elements_per_rank"] == 15e9
    assert p["anchor_gib"] == pytest.approx(15e9 * 4 / 2**30)
    assert p["outer_state_gib"] == pytest.approx(15e9 * 4 / 2**30)  # one momentum buffer
    wire = 2 * 3 / 4 * 15e9 * 4  # a ring all-reduce of fp32 pseudo-gradients, 4 islands
    assert p["wire_gib_per_round"] == pytest.approx(wire / 2**30)
    assert p["round_s@10gbit"] == pytest.approx(wire * 8 / 10e9)
    half = plan(120e9, stages=8, islands=4, anchor_dtype="bfloat16", quantize="int8")
    assert half["anchor_gib"] == pytest.approx(p["anchor_gib"] / 2)
    assert half["wire_gib_per_round"] == pytest.approx(p["wire_gib_per_round"] * (1 + 4 / 128) / 4)


def test_the_command_prints_a_row_per_dtype_and_refuses_zero(capsys: pytest.CaptureFixture) -> None:
    main(["--params", "120e9", "--stages", "8", "--link-gbit", "1", "100"])
    out = capsys.readouterr().out
    assert "| float32 | 1.5e+10 | 55.9 | 55.9 |" in out and "| bfloat16 | 1.5e+10 | 27.9 |" in out
    with pytest.raises(SystemExit):
        main(["--params", "120e9", "--stages", "0"])
    assert "--stages must be above 0" in capsys.readouterr().err
