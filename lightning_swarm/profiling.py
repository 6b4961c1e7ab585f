"""Profiler labels of a round's phases (``torch.profiler.record_function``), one namespace per
layer, defined once; no label is opened inside itself. Logger metrics keep their ``swarm/`` names.
"""

from __future__ import annotations

_OUTER = "lightning_swarm::outer::"
_TRANSPORT = "lightning_swarm::transport::"
_AGGREGATOR = "lightning_swarm::aggregator::"

# Outer loop (lightning_swarm.outer): one round's phases, per fragment (per bucket in a
# bucketed round, inside BUCKETED_ROUND).
PSEUDO_GRADIENT = _OUTER + "pseudo_gradient"
EXCHANGE = _OUTER + "exchange"
OUTER_STEP = _OUTER + "outer_step"
MERGE = _OUTER + "merge"
WAIT = _OUTER + "wait"  # a delayed round: training blocked on a round still in flight
ISLAND_GATHER = _OUTER + "island_gather"  # shard_outer: the island gathers the new parameters
BUCKETED_ROUND = _OUTER + "bucketed_round"
# The warm start (lightning_swarm.warm_start): one step's gradients averaged across islands.
WARM_START = _OUTER + "warm_start"

# Transports (lightning_swarm.transport): the collective under EXCHANGE.
ALLREDUCE = _TRANSPORT + "allreduce"
REDUCE_SCATTER = _TRANSPORT + "reduce_scatter"
# Inside REDUCE_SCATTER, per bucket: each island's shares out, its own share averaged, the
# encoded means of every share back.
SCATTER_SHARES = _TRANSPORT + "scatter_shares"
REDUCE_SHARE = _TRANSPORT + "reduce_share"
GATHER_MEANS = _TRANSPORT + "gather_means"

# The aggregator transports (lightning_swarm.transport.aggregator): their rounds and steps.
AGGREGATOR_ROUND = _AGGREGATOR + "round"
SHARDED_ROUND = _AGGREGATOR + "sharded_round"  # every island aggregates its own part
SEND = _AGGREGATOR + "send"
RECEIVE = _AGGREGATOR + "receive"
AGGREGATE = _AGGREGATOR + "aggregate"
