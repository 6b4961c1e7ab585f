"""The swarm transport (``transport="swarm"``): a round's payload aggregated by its owners, one
island in turn (``rotating``) or every island 1/n (``sharded``), both through ``swarm_round``.
"""
