"""Three outer rounds per configuration, bitwise against the recorded digests.

The digests (``tests/data/round_digests.json``) were recorded by ``benchmarks/round_digests.py``
before the round engine was rewritten: every change of the engine must keep these bits, or
re-record them in a commit that names the cause.
"""

from __future__ import annotations

import json

from benchmarks.round_digests import CASES, DIGESTS, record


def test_rounds_match_the_recorded_digests() -> None:
    expected = json.loads(DIGESTS.read_text())
    got = record()
    assert set(got) == set(expected)
    for rank, cases in expected.items():
        assert set(cases) == set(CASES)
        for case, digests in cases.items():
            assert got[rank][case] == digests, (rank, case)
