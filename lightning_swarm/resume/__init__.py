"""Save and restore of a swarm run's state, owned by the strategy; never imports Lightning.

``SwarmCheckpointer`` is what the strategy holds; ``TrainingView`` the small view of training state
it is handed; ``records`` the typed checkpoint records and ``FORMAT_VERSION``.
"""

from lightning_swarm.resume.checkpointer import SwarmCheckpointer
from lightning_swarm.resume.records import FORMAT_VERSION
from lightning_swarm.resume.training_view import Collectives, TrainingView, options_of

__all__ = ["FORMAT_VERSION", "Collectives", "SwarmCheckpointer", "TrainingView", "options_of"]
