"""The swarm transport (``transport="swarm"``): ``swarm_round.SwarmAggregator``, a round's
payload aggregated by its owners, one island in turn or every island 1/n."""
