"""The reward role: scores every sample with its verifier.

`python -m services.reward` runs it; `SERVICE` is the class a subclass in another module replaces."""

from services.reward.service import SERVICE, RewardService, main

__all__ = ["SERVICE", "RewardService", "main"]
