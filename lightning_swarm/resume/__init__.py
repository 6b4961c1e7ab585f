"""Save and restore of a swarm run's state, owned by the strategy; never imports Lightning.

``SwarmCheckpointer`` is what the strategy holds; ``ResumeHost`` the small view of training state
it is handed; ``records`` the typed checkpoint records and ``FORMAT_VERSION``.
"""

from lightning_swarm.resume.checkpointer import SwarmCheckpointer
from lightning_swarm.resume.host import Collectives, ResumeHost, options_of
from lightning_swarm.resume.records import FORMAT_VERSION

__all__ = ["FORMAT_VERSION", "Collectives", "ResumeHost", "SwarmCheckpointer", "options_of"]
