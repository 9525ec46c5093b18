"""A trainer service's model parts built and warmed up while it waits for the controller.

The controller answers a service's hello only once it has prepared the run; on a GPU host
that took 18 s of a cold start (its imports alone), and the learner's warm-up (90 s) came
after it. With a local model directory (`model.path`) nothing the parts need comes from
the controller, so the service builds them from its own copy of the config on a thread
during the handshake, and its setup takes them if the run's config agrees.
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Callable
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.log import get_logger

# what the parts are built from: a run whose config differs here builds them again
_SECTIONS = ("model", "algorithm", "learner", "critic", "reference", "task", "rollout")


def _key(config: PipelineConfig) -> tuple[Any, ...]:
    return (*(getattr(config, name) for name in _SECTIONS), config.run.torch_threads)


class EarlyBuild:
    """`build(config)` running on its own thread from now on."""

    def __init__(self, config: PipelineConfig, build: Callable[[PipelineConfig], Any]) -> None:
        self.config = config
        self._build = build
        self._result: Any = None
        self._failed = False
        context = contextvars.copy_context()  # the process's log binding
        self._thread = threading.Thread(
            target=context.run, args=(self._run,), name="early-build", daemon=True
        )
        self._thread.start()

    def _run(self) -> None:
        try:
            self._result = self._build(self.config)
        except Exception as exc:  # the service's own build meets it again, in context
            self._failed = True
            get_logger("early_build").warning("early_build_failed", error=str(exc))

    def take(self, config: PipelineConfig) -> Any:
        """The parts once built, if the run's `config` builds the same ones; else None
        (then the caller builds them)."""
        self._thread.join()
        result, self._result = self._result, None
        if self._failed or result is None:
            return None
        if _key(config) != _key(self.config):
            get_logger("early_build").warning("early_build_discarded", reason="config differs")
            return None
        return result


def start_early_build(
    config: PipelineConfig, build: Callable[[PipelineConfig], Any] | None
) -> EarlyBuild | None:
    """Start `build` now when it needs nothing from the controller: a local model
    directory (a tiny model is made by the controller)."""
    if build is None or not config.model.path:
        return None
    return EarlyBuild(config, build)
