"""Services that tests run in place of the project's own (`services.ROLE.module`): the
plumbing without models, or a learner a test can park at a point of its step."""

from __future__ import annotations

from collections.abc import Callable


def service_main(role: str, service_cls: type) -> Callable[[list[str] | None], int]:
    """The main() of a stand-in service: the project's service runner with this class."""

    def main(argv: list[str] | None = None) -> int:
        from pipeline.runtime.cli_args import run_service

        return run_service(role, service_cls, argv)

    return main
