"""The controller role: its service and the per-step log.

`python -m services.controller` runs it; (it has no `SERVICE`: one controller per run)."""

from services.controller.service import Controller, main

__all__ = ["Controller", "main"]
