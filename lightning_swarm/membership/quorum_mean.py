"""The mean of a round's pseudo-gradients over the quorum, bucket by bucket.

``bucketed_mean`` packs the tensors into one reused float32 CPU bucket (``mean_in_buckets``), the
only extra memory, and averages each with torchft's ``Manager.allreduce``. That averages over the
participants, zeroes a healing island's share and records a failure for the commit gate instead
of raising: a failed bucket leaves garbage that the abandoned round never applies, and counts 0
bytes (others a ring's ``2 (n - 1) / n``). Tensors may live on any device.
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
