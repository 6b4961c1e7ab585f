"""Islands: contiguous blocks of ``island_size`` global ranks (DDP over their own group).

Ranks at the same position in every island form a *peer group*, over which the transport
averages; every rank of an island holds the same parameters, so the peer groups carry the payload
in parallel. Plain arithmetic: imports neither torch nor lightning.
"""

from __future__ import annotations

from dataclasses import dataclass

from lightning_swarm.errors import SwarmConfigError


@dataclass(frozen=True)
class IslandTopology:
    """Where one rank sits among the islands (``island_size`` divides ``world_size``)."""

    world_size: int
    island_size: int
    global_rank: int

    def __post_init__(self) -> None:
        if self.island_size < 1:
            raise SwarmConfigError(
                f"island_size must be a positive integer, got {self.island_size}; "
                "set it to the number of ranks that sync every step (1 = every rank is an island)."
            )
        if self.world_size % self.island_size != 0:
            raise SwarmConfigError(
                f"island_size={self.island_size} does not divide the world size "
                f"{self.world_size} (devices x num_nodes); {self._divisor_hint()}"
            )
        if not 0 <= self.global_rank < self.world_size:
            raise ValueError(f"global_rank {self.global_rank} outside world of {self.world_size}")

    def _divisor_hint(self) -> str:
        if self.world_size == 1:  # the only divisor of 1 is 1: suggesting "1 or 1" helps nobody
            return (
                "with one rank the only island_size is 1; for islands of "
                f"{self.island_size} ranks launch a multiple of {self.island_size} ranks "
                f"(e.g. trainer.devices={self.island_size})."
            )
        divisors = [d for d in range(1, self.world_size + 1) if self.world_size % d == 0]
        return (
            f"choose one of {divisors} (1 = one island per rank, {self.world_size} = one "
            "island), or launch a multiple of island_size ranks."
        )

    @property
    def num_islands(self) -> int:
        return self.world_size // self.island_size

    @property
    def island_index(self) -> int:
        return self.global_rank // self.island_size

    @property
    def local_index(self) -> int:
        """This rank's position inside its island (0 .. island_size - 1)."""
        return self.global_rank % self.island_size

    def island_ranks(self, island_index: int) -> list[int]:
        start = island_index * self.island_size
        return list(range(start, start + self.island_size))

    def peer_ranks(self, local_index: int) -> list[int]:
        """Global ranks holding position ``local_index`` in every island, ordered by island."""
        return [i * self.island_size + local_index for i in range(self.num_islands)]
