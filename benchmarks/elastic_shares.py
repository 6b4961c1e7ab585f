"""Cross-island bytes per rank of elastic islands of two ranks, with and without shard_outer.

Runs a lighthouse and two Lightning islands of two ranks each
(``tests/elastic_lightning_island.py``, a model of two ``Linear(8, 8)`` layers: 576 B of
float32, split into two shares of 288 B) once with ``shard_outer=True`` (every rank exchanges
its share) and once with ``shard_outer=False`` (rank 0 exchanges for the island), and
prints each rank's ``swarm/bytes_sent`` per round.

    PYTHONPATH=. .venv/bin/python benchmarks/elastic_shares.py
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from tests.elastic_utils import finish, lighthouse, rounds, start_island

SCRIPT = "tests/elastic_lightning_island.py"


def run(shard_outer: bool, max_steps: int) -> list[str]:
    out = Path(tempfile.mkdtemp(prefix="elastic_shares_"))
    opts = ["--devices", "2", "--width", "0", "--every", "4", "--max-steps", str(max_steps)]
    opts += ["--step-s", "0.02"] + ([] if shard_outer else ["--no-shard-outer"])
    with lighthouse() as address:
        procs = {n: start_island(out, address, n, *opts, script=SCRIPT) for n in "ab"}
        for name, proc in procs.items():
            if finish(proc, 300, out, name) != 0:
                raise SystemExit(f"island {name} failed; see {out / (name + '.stderr')}")
    lines = []
    for name in "ab":
        for rank in (0, 1):
            rows = [r for r in rounds(out, name) if r.get("rank") == rank]
            rows = [r for r in rows if "swarm/bytes_sent" in r]  # the join round logs none
            sent = rows[-1]["swarm/bytes_sent"]
            lines.append(
                f"shard_outer={shard_outer} island {name} rank {rank}: {len(rows)} rounds, "
                f"bytes_sent {sent:.0f} B, {sent / len(rows):.0f} B per round"
            )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-steps", type=int, default=24)
    args = parser.parse_args()
    for shard_outer in (True, False):
        print("\n".join(run(shard_outer, args.max_steps)))


if __name__ == "__main__":
    main()
