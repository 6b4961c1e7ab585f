"""The mean of a round's pseudo-gradients over the quorum, bucket by bucket.

``bucketed_mean`` packs the tensors into one reused float32 CPU bucket of at most
``bucket_numel`` elements (the one packer, ``transport.buckets.mean_in_buckets``), averages each
bucket with torchft's ``Manager.allreduce`` and writes the result back into the tensors' own
storage. ``Manager.allreduce`` averages over the participating islands, zeroes the share of an
island being healed, and records a failure (a dead peer) for the commit gate instead of raising,
so a failed bucket leaves garbage that the abandoned round never applies. Tensors may live on
any device (copies cross it); the bucket is the only extra memory.

Bytes: gloo all-reduces a bucket with a ring over the quorum's group, so a rank sends (and
receives) ``2 (n - 1) / n`` of it (``transport.allreduce.ring_allreduce_bytes``); a bucket
whose all-reduce failed moved nothing worth counting and counts 0.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from lightning_swarm.transport.allreduce import ring_allreduce_bytes
from lightning_swarm.transport.buckets import mean_in_buckets


def bucketed_mean(
    manager: Any, tensors: list[Tensor], bucket_numel: int, group_size: int = 1
) -> int:
    """Overwrite ``tensors`` in place with their mean over the quorum (see the module);
    returns the bytes this island sent (= received) in a ring over ``group_size`` islands."""

    def mean_(bucket: Tensor) -> int:
        manager.allreduce(bucket).wait()
        if manager.errored():
            return 0
        return ring_allreduce_bytes(bucket.numel() * bucket.element_size(), group_size)

    return mean_in_buckets(tensors, bucket_numel, mean_)
