"""The learner role: its service, the model worker on its trainer thread, step reports and the weight link to the engines.

`python -m services.learner` runs it; `SERVICE` is the class a subclass in another module replaces."""

from services.learner.service import SERVICE, LearnerService, main

__all__ = ["SERVICE", "LearnerService", "main"]
