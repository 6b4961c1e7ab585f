"""The combination suite (``-m combos``): every accepted pair of options runs to its end.

For each row of ``combos.pairwise_plan()`` a short fit of two islands must end with every
island holding the same parameters (rank for rank at the same position in its island) and,
where the row saves mid-run, a resumed fit must end bitwise equal to the uninterrupted one.
Pairs ``SwarmConfig`` refuses are refused at construction, naming both options (checked here
for every refused pair); docs/options.md lists them.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests import combos

PLAN = combos.pairwise_plan()


def test_the_plan_covers_every_accepted_pair_and_no_refused_one() -> None:
    covered = {pair for row in PLAN for pair in combos.itertools.combinations(row.items(), 2)}
    for pair in combos._pairs():
        refused = combos.refusal(dict(pair)) is not None
        assert (pair in covered) != refused, pair


@pytest.mark.parametrize(("pair", "message"), combos.refused_pairs(), ids=str)
def test_a_refused_pair_is_refused_at_construction_naming_both_options(
    pair: combos.Pair, message: str
) -> None:
    (fa, _), (fb, _) = pair
    for factor in (fa, fb):
        named = [key for key in combos.FACTORS[factor][pair[0][1] if factor == fa else pair[1][1]]]
        assert any(key in message for key in named), (pair, message)


@pytest.mark.parametrize("pair", list(combos.SETUP_REFUSALS), ids=str)
def test_a_pair_the_module_decides_is_refused_at_setup_naming_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pair: combos.Pair
) -> None:
    row = {factor: next(iter(levels)) for factor, levels in combos.FACTORS.items()}
    row.update(dict(pair))
    with pytest.raises(Exception) as caught:
        combos.fit_row(row, tmp_path / "out", tmp_path / "ckpts", monkeypatch, None)
    message = str(caught.value)
    assert all(word in message for word in combos.SETUP_REFUSALS[pair]), message
    assert not (tmp_path / "out").exists(), "refused after the fit began"


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    return [k for k in a if not torch.equal(a[k], b[k])]


@pytest.mark.combos
@pytest.mark.timeout(300)
@pytest.mark.parametrize("row", PLAN, ids=combos.row_id)
def test_a_row_runs_to_its_end_with_islands_equal_and_resumes_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row: combos.Row
) -> None:
    whole, ckpts = tmp_path / "whole", tmp_path / "ckpts"
    combos.fit_row(row, whole, ckpts, monkeypatch, None)
    ranks = combos.load_dumps(whole)
    first = {r["position"]: r for r in ranks if r["island"] == 0}
    for r in ranks:
        differ = _same(r["params"], first[r["position"]]["params"])
        assert not differ, f"island {r['island']} ends with other {differ}"
    if row["checkpoint"] == "none":
        return
    saved = sorted(ckpts.glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    assert saved, "the row saved no checkpoint"
    resumed = tmp_path / "resumed"
    combos.fit_row(row, resumed, tmp_path / "ckpts2", monkeypatch, saved[0])
    for a, b in zip(ranks, combos.load_dumps(resumed), strict=True):
        where = f"rank at island {a['island']}, position {a['position']}"
        assert not _same(a["params"], b["params"]), where
        for oa, ob in zip(a["anchors"], b["anchors"], strict=True):
            assert not _same(oa, ob), f"{where}: anchors"
        assert (a["inner_steps"], a["outer_steps"]) == (b["inner_steps"], b["outer_steps"]), where
        for sa, sb in zip(a["optimizers"], b["optimizers"], strict=True):
            for i in sa:
                assert not _same(sa[i], sb[i]), f"{where}: inner optimizer state {i}"
