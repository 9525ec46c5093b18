"""The critic role: its service and the value-model worker.

`python -m services.critic` runs it; `SERVICE` is the class a subclass in another module replaces."""

from services.critic.service import SERVICE, CriticService, main

__all__ = ["SERVICE", "CriticService", "main"]
