"""The reference role: the frozen initial policy's log-probs.

`python -m services.reference` runs it; `SERVICE` is the class a subclass in another module replaces."""

from services.reference.service import SERVICE, ReferenceService, main

__all__ = ["SERVICE", "ReferenceService", "main"]
