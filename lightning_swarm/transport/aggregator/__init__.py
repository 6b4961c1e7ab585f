"""The swarm transport (``transport="swarm"``): a round's payload aggregated by its owners.

``owners`` (what both owner layouts share: options, rule, spool), ``rotating``
(``AggregatorTransport``: one owner per round, the round as every island walks it), ``sharded``
(``ShardedAggregatorTransport``: every island owns 1/n), ``rounds`` (the
aggregating island's side: receive, validate, aggregate, answer), ``round_status`` (the round's
control messages and their words), ``links`` (chunked point-to-point streams), ``spool`` and
``spool_files`` (the run-scoped disk spool and its leased files), ``contributions`` (where a
peer's payload lands and how it is aggregated) and ``coded`` (quantized payloads on this path).
"""
