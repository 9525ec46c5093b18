"""Arguments shared by every service's main(): profile, replica, controller, overrides."""

from __future__ import annotations

import argparse
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn

from pipeline.config import PipelineConfig, load_config, parse_override_args
from pipeline.errors import EXIT_CONFIG, ConfigError

if TYPE_CHECKING:
    from pipeline.runtime.service import Service


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
    parser.add_argument(
        "--supervise",
        action="store_true",
        help="run the service as a child and restart it as `pipeline run` would "
        "(supervisor.max_restarts): for launchers that start each replica on its own",
    )
    parser.add_argument("--allow-incomplete", action="store_true", help=argparse.SUPPRESS)
    return parser


def service_args(role: str, argv: list[str] | None) -> tuple[argparse.Namespace, PipelineConfig]:
    parser = service_parser(role)
    args, rest = parser.parse_known_args(argv)
    config = load_config(args.profile, parse_override_args(rest))
    if args.pool is not None:
        config = config.placed_on(role, args.pool)
    from pipeline.runtime import layout
    from pipeline.transport.security import configure, run_secret

    secret = run_secret(layout.run_dir(config))
    configure(config.run.keys_dir or None, config.run.allow_insecure, secret)
    return args, config


def supervised(
    role: str, args: argparse.Namespace, config: PipelineConfig, argv: list[str] | None
) -> int | None:
    """With --supervise: the replica runs as a child, restarted as `pipeline run` would
    (runtime/replica_supervisor.py), and this is its exit code; None without it."""
    if not args.supervise:
        return None
    from pipeline.runtime.replica_supervisor import supervise_replica

    words = sys.argv[1:] if argv is None else argv
    return supervise_replica(config, role, args.replica, [w for w in words if w != "--supervise"])


def config_refused(exc: ConfigError) -> int:
    """What a service whose config is refused returns: it says why, and exits with a code
    the supervisor does not restart (a restart cannot fix a config)."""
    print(f"error: {exc}", file=sys.stderr, flush=True)
    return EXIT_CONFIG


def run_service(role: str, service_cls: type[Service], argv: list[str] | None) -> int:
    """The thin main() of a data-plane service. Under torchrun (a trainer with fsdp_size >
    1) every rank joins one process group; rank 0 serves, the others follow it."""
    try:
        return _run_service(role, service_cls, argv)
    except ConfigError as exc:
        return config_refused(exc)


def _run_service(role: str, service_cls: type[Service], argv: list[str] | None) -> int:
    from pipeline.runtime import layout, ranks
    from pipeline.runtime.service import follow, serve
    from pipeline.transport.channel import run_async

    args, config = service_args(role, argv)
    if (code := supervised(role, args, config, argv)) is not None:
        return code
    pin_devices(config, role, args.replica)
    compile_caches(config, on_gpu=bool(config.devices(role, args.replica)))
    link = ranks.join(config, role, args.replica)
    if link is not None and not link.is_leader:
        released = follow(
            service_cls,
            ranks=link,
            replica=args.replica,
            grace_s=config.supervisor.stop_timeout_s,
        )
        if not released:
            _exit(143)  # rank 0 is gone or stuck: no barrier to meet
        _exit(0, link)
    controller = args.controller or layout.controller_endpoint(config)
    early = None
    if link is None:  # one process: its model parts need nothing the controller sends
        from pipeline.log import bind_process, configure_logging
        from pipeline.runtime.early_build import start_early_build

        configure_logging()
        bind_process(service=role, replica=args.replica)
        early = start_early_build(config, service_cls.early_parts)
    run_async(
        serve(
            service_cls,
            controller=controller,
            replica=args.replica,
            local_config=config,
            pool=args.pool,
            ranks=link,
            early=early,
        )
    )
    if link is not None:
        _exit(0, link)
    return 0


def _exit(code: int, ranks: Any = None) -> NoReturn:
    """Leave a sharded service's process: together (a barrier), then at once. The normal
    interpreter exit can abort in c10d's threads ("terminate called without an active
    exception", SIGABRT) after the work is done, and torchrun would report a failure."""
    if ranks is not None:
        ranks.close()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def compile_caches(config: PipelineConfig, *, on_gpu: bool = False) -> None:
    """Point torch.compile's caches at `run.compile_cache_dir` (before anything compiles),
    unless the environment already says where they go. On a GPU, the few CPU kernels of a
    compiled graph are not vectorised: inductor would otherwise probe every CPU ISA in
    each process by building and loading a test library (a large part of a GPU host's
    start)."""
    if on_gpu:
        os.environ.setdefault("TORCHINDUCTOR_VEC_ISA_OK", "0")
    root = config.run.compile_cache_dir
    if not root:
        return
    base = os.path.expanduser(root)
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(base, "inductor"))
    os.environ.setdefault("TRITON_CACHE_DIR", os.path.join(base, "triton"))


def pin_devices(config: PipelineConfig, role: str, replica: int) -> None:
    """Show this replica only its pool devices (before anything initialises CUDA)."""
    devices = config.devices(role, replica)
    if devices:
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(str(d) for d in devices)
