"""Lightning glue of elastic islands (``SwarmStrategy(membership="torchft")``): each launch is
one island. ``global_step`` counts the island's own inner steps, the swarm's clock its committed
rounds; every island ends on the anchors after the same round, ``ceil(max_steps / sync_every) *
num_fragments`` (Lightning's ``max_steps`` is lifted: abandoned rounds cost inner steps).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import lightning.pytorch as pl
import torch.distributed as dist
from torch.nn import Module

from lightning_swarm.algorithm.codecs import codec_for
from lightning_swarm.algorithm.model_layout import model_layout
from lightning_swarm.config import SwarmConfig
from lightning_swarm.errors import SwarmConfigError
from lightning_swarm.membership.config import ElasticConfig
from lightning_swarm.membership.round_header import swarm_settings
from lightning_swarm.membership.torchft_quorum import TorchftMembership
from lightning_swarm.outer.sync import OuterSync


class ElasticIsland:
    """One island's membership, its first round and its stopping rule."""

    def __init__(self, options: ElasticConfig, config: SwarmConfig) -> None:
        self.options = options
        self.config = config
        self.membership: TorchftMembership | None = None
        self.outer_shares = 1  # ranks that share the outer state (1: rank 0 exchanges all)
        self._outer: OuterSync | None = None
        self._target_rounds: int | None = None

    @staticmethod
    def island_size(requested: int, world_size: int) -> int:
        if requested not in (1, world_size):
            raise SwarmConfigError(
                f"island_size={requested} with membership='torchft': each launch is one island "
                f"of all its {world_size} ranks; leave island_size at 1 (or set {world_size})."
            )
        return world_size

    def build_membership(
        self, module: Module, island_group: dist.ProcessGroup | None, bucket_numel: int
    ) -> TorchftMembership:
        params = {n: p for n, p in module.named_parameters() if p.is_floating_point()}
        world = dist.get_world_size(island_group) if dist.is_initialized() else 1
        # Each rank owns a share of the outer state and exchanges it itself: its share of a
        # DDP island's (shard_outer), or its own shards of a model-sharded island's.
        sharded = self.config.model_sharded or self.config.shard_outer
        per_rank = world > 1 and sharded
        self.outer_shares = world if per_rank else 1
        self.membership = TorchftMembership(
            self.options,
            layout=model_layout(params),
            island_group=island_group,
            bucket_numel=bucket_numel,
            codec=codec_for(self.config.quantize, self.config.quantize_block_size),
            background=self.config.sync_delay > 0,
            per_rank=per_rank,
        )
        return self.membership

    @property
    def _outer_sync(self) -> OuterSync:
        assert self._outer is not None, "the outer loop is attached right after it is built"
        return self._outer

    def attach(self, outer_syncs: Sequence[OuterSync]) -> None:
        """Islands whose rounds would mean different things are refused in the round header."""
        if len(outer_syncs) != 1:
            raise SwarmConfigError(
                f"membership='torchft' supports one optimizer, this module has "
                f"{len(outer_syncs)}; use membership='static' for several."
            )
        membership = self.membership
        assert membership is not None, "the membership is built before the outer loop"
        self._outer = outer_syncs[0]
        settings = swarm_settings(self.config, outer_syncs[0].outer_optimizer)
        membership.agree_on({**settings, "outer_shares": self.outer_shares})

    def join(self, trainer: pl.Trainer) -> dict[str, float]:
        """The island's first round (a heal if the swarm is ahead); lifts ``max_steps``."""
        if trainer.max_steps > 0:
            per_sync = self.config.num_fragments  # each fragment syncs once per sync_every
            self._target_rounds = math.ceil(trainer.max_steps / self.config.sync_every) * per_sync
            trainer.fit_loop.epoch_loop.max_steps = -1
        report = self._outer_sync.join()
        return self.after_round(trainer, {"swarm/outer_steps": float(report.outer_steps)})

    def after_round(self, trainer: pl.Trainer, metrics: Mapping[str, float]) -> dict[str, float]:
        """``metrics`` with the membership's; stops the fit after the swarm's last round."""
        assert self.membership is not None
        totals, rounds = self.membership.totals, self._outer_sync.outer_steps
        out = {
            **metrics,
            "swarm/outer_steps": float(rounds),  # the swarm's clock after any heal or adoption
            "swarm/islands_in_round": float(totals.islands_in_round),
            "swarm/rounds_abandoned": float(totals.rounds_abandoned),
            "swarm/heal_bytes": float(totals.heal_bytes),
            "swarm/heal_time_s": totals.heal_time_s,
        }
        if self._target_rounds is not None and rounds >= self._target_rounds:
            trainer.should_stop = True  # the strategy's end-of-fit lands it on the anchors
        return out
