"""Pipeline stages inside islands: the user's split (``keep_stage``) and the schedule runner."""

from lightning_swarm.pipeline.stages import keep_stage, stage_blocks

__all__ = ["keep_stage", "stage_blocks"]
