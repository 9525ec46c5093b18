"""Multi-turn environments: the interface, the worker processes, the episode driver."""

from pipeline.envs.types import Environment, EnvironmentNotFound, Episode, StepResult

__all__ = ["Environment", "EnvironmentNotFound", "Episode", "StepResult"]
