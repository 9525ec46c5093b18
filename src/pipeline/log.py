"""The one structlog logger factory: binds service, replica and rank; JSON lines in deployments."""

from __future__ import annotations

import logging
import os
import sys
from typing import Any

import structlog

_configured = False


class _CurrentStderr:
    """Whatever sys.stderr is when a line is written: under a live progress bar (rich
    redirects stderr) log lines then print above the bar instead of through it."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(*, json_lines: bool | None = None, level: str | None = None) -> None:
    """Configure structlog once per process.

    JSON lines when stderr is not a terminal (deployments, supervised services) or when
    PIPELINE_LOG_JSON=1; readable console output otherwise.
    """
    global _configured
    if json_lines is None:
        env = os.environ.get("PIPELINE_LOG_JSON")
        json_lines = env == "1" if env is not None else not sys.stderr.isatty()
    level_name = (level or os.environ.get("PIPELINE_LOG_LEVEL", "info")).upper()
    renderer: Any = (
        structlog.processors.JSONRenderer()
        if json_lines
        else structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.StackInfoRenderer(),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            logging.getLevelNamesMapping().get(level_name, logging.INFO)
        ),
        # one write per line: the ranks of a torchrun'd trainer share one unbuffered log
        # file, where print's separate write of the newline lets their lines interleave
        logger_factory=structlog.WriteLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    _configured = True


def get_logger(name: str, **bindings: Any) -> structlog.typing.FilteringBoundLogger:
    """Logger for a component; `bind_process` adds service/replica/rank to every line."""
    if not _configured:
        configure_logging()
    return structlog.get_logger(name).bind(component=name, **bindings)


def bind_process(*, service: str, replica: int = 0, rank: int = 0, run_id: str = "") -> None:
    """Bind the identity of this OS process to every log line it writes."""
    structlog.contextvars.bind_contextvars(
        service=service, replica=replica, rank=rank, run_id=run_id, pid=os.getpid()
    )
