"""The rollout role: its service and the runner that drives the engines and applies weight updates.

`python -m services.rollout` runs it; `SERVICE` is the class a subclass in another module replaces."""

from services.rollout.service import SERVICE, RolloutService, main

__all__ = ["SERVICE", "RolloutService", "main"]
