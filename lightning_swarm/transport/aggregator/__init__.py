"""The swarm transport (``transport="swarm"``): a round's payload aggregated by its owners.

``swarm_round`` (one round: agree, scatter, judge, aggregate, gather), ``rotating``
(``AggregatorTransport``: one owner per round, in turn) and ``sharded``
(``ShardedAggregatorTransport``: every island owns 1/n); ``owners`` (options, rule, spool),
``terms``, ``shards``, ``shard_streams``, ``shard_fold``, ``shard_verdicts`` and
``island_verdicts`` (the round's steps), ``round_status`` (its words), ``spool`` and
``spool_files`` (the run-scoped disk spool and its leased files), ``contributions`` (where a
peer's payload lands and how it is read back) and ``coded`` (quantized payloads).
"""
