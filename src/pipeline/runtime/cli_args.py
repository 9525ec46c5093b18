"""Arguments shared by every service's main(): profile, replica, controller, overrides."""

from __future__ import annotations

import argparse
import os

from pipeline.config import PipelineConfig, load_config, parse_override_args


def service_parser(role: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=f"pipeline service {role}",
        description=f"Run one {role} replica; it joins the run through the controller.",
        epilog="Any other --section.key VALUE pair overrides the profile.",
    )
    parser.add_argument("--profile", default="profiles/local-cpu.toml")
    parser.add_argument("--replica", type=int, default=0)
    parser.add_argument(
        "--pool",
        default=None,
        help="pool of the profile this replica runs on: its host and devices (default: the "
        "role's placement)",
    )
    parser.add_argument("--controller", default=None, help="controller address (default: layout)")
    parser.add_argument("--allow-incomplete", action="store_true", help=argparse.SUPPRESS)
    return parser


def service_args(role: str, argv: list[str] | None) -> tuple[argparse.Namespace, PipelineConfig]:
    parser = service_parser(role)
    args, rest = parser.parse_known_args(argv)
    config = load_config(args.profile, parse_override_args(rest))
    if args.pool is not None:
        config = config.placed_on(role, args.pool)
    from pipeline.transport.security import configure

    configure(config.run.keys_dir or None, config.run.allow_insecure)
    return args, config


def run_service(role: str, service_cls: object, argv: list[str] | None) -> int:
    """The thin main() of a data-plane service."""
    from pipeline.runtime import layout
    from pipeline.runtime.service import serve
    from pipeline.transport.channel import run_async

    args, config = service_args(role, argv)
    pin_devices(config, role, args.replica)
    controller = args.controller or layout.controller_endpoint(config)
    run_async(
        serve(
            service_cls,  # type: ignore[arg-type]
            controller=controller,
            replica=args.replica,
            local_config=config,
            pool=args.pool,
        )
    )
    return 0


def pin_devices(config: PipelineConfig, role: str, replica: int) -> None:
    """Show this replica only its pool devices (before anything initialises CUDA)."""
    devices = config.devices(role, replica)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
