"""Save and restore of a swarm run's state, owned by the strategy; never imports Lightning."""

from lightning_swarm.resume.checkpointer import SwarmCheckpointer
from lightning_swarm.resume.records import FORMAT_VERSION
from lightning_swarm.resume.training_view import Collectives, TrainingView, options_of

__all__ = ["FORMAT_VERSION", "Collectives", "SwarmCheckpointer", "TrainingView", "options_of"]
