"""`pipeline`: run, service, inspect, replay, report, keys, deploy. Heavy imports are lazy."""

from __future__ import annotations

import argparse
import sys

from pipeline.wire.roles import ROLES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pipeline",
        description="Asynchronous KL-PPO for language models: services over ZeroMQ.",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run every service of a profile locally (supervised)")
    run.add_argument("--profile", default="profiles/local-cpu.toml")
    run.add_argument("--name", default=None, help="run name (default: profile name + time)")
    run.add_argument("--no-progress", action="store_true")
    run.add_argument(
        "--resume", action="store_true", help="continue the run of this --name where it stopped"
    )

    cfg = sub.add_parser("config", help="the resolved config of a profile, or every key")
    cfg_sub = cfg.add_subparsers(dest="config_command", required=True)
    show = cfg_sub.add_parser("show", help="print the resolved config (profile + overrides)")
    show.add_argument("--profile", default="profiles/local-cpu.toml")
    cfg_sub.add_parser("keys", help="every key with its default and what it does")

    data = sub.add_parser("data", help="datasets in the RL schema")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    convert = data_sub.add_parser("convert", help="convert a public dataset's rows")
    convert.add_argument("format", choices=("gsm8k",))
    convert.add_argument("input", help="its rows: .parquet, .jsonl or .json")
    convert.add_argument("output", help="the RL-schema file to write (.parquet or .jsonl)")
    convert.add_argument("--split", default="train", help="recorded in extra_info")

    svc = sub.add_parser("service", help="start one service; it joins through the controller")
    svc.add_argument("role", choices=ROLES)

    ins = sub.add_parser("inspect", help="filter, print and export a recorded queue")
    ins.add_argument("run", help="run directory, or a queue .log file")
    ins.add_argument("--queue", default=None, help="queue name (default: every recorded queue)")
    ins.add_argument("--uid", default=None, help="only records whose uid starts with this")
    ins.add_argument("--step", type=int, default=None, help="only uids trained at this step")
    ins.add_argument("--version", type=int, default=None, help="only this released version")
    ins.add_argument("--limit", type=int, default=20)
    ins.add_argument("--jsonl", default=None, help="export matching records to JSONL")
    ins.add_argument("--parquet", default=None, help="export matching records to parquet")

    rep = sub.add_parser("replay", help="feed a recorded queue into one service, in-process")
    rep.add_argument("run", help="run directory that holds queues/<queue>.log")
    rep.add_argument("--service", required=True, choices=ROLES[1:])
    rep.add_argument("--out", default=None, help="where replay outputs go (default RUN/replay)")
    rep.add_argument(
        "--allow-truncated",
        action="store_true",
        help="replay the records before a truncated tail (else the replay refuses the file)",
    )

    rpt = sub.add_parser("report", help="plots and a Perfetto trace of a run")
    rpt.add_argument("run")

    keys = sub.add_parser("keys", help="make CURVE keys for non-loopback transport")
    keys.add_argument("dir", help="where the key files go (then set run.keys_dir = DIR)")

    dep = sub.add_parser("deploy", help="deployment files of a profile (Slurm, Kubernetes)")
    dep_sub = dep.add_subparsers(dest="deploy_command", required=True)
    dep_render = dep_sub.add_parser("render", help="write a Slurm job or Kubernetes manifests")
    dep_render.add_argument("--profile", required=True)
    dep_render.add_argument("--target", required=True, choices=("slurm", "k8s"))
    dep_render.add_argument("--out", default=None, help="folder (default: deploy/<profile>/)")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) >= 2 and argv[0] == "service" and argv[1] in ROLES:
        import importlib

        from pipeline.errors import ConfigError
        from pipeline.runtime.cli_args import service_args

        try:
            _, config = service_args(argv[1], argv[2:])
            module = importlib.import_module(config.service_module(argv[1]))
            return int(module.main(argv[2:]))
        except ConfigError as exc:
            print(f"pipeline service {argv[1]}: error: {exc}", file=sys.stderr)
            return 2
    parser = _parser()
    args, rest = parser.parse_known_args(argv)
    if args.command in ("run", "config"):
        from pipeline.errors import ConfigError

        try:
            if args.command == "run":
                from pipeline.commands.run import run_command

                return run_command(args, rest)
            from pipeline.commands.config_cmd import config_command

            return config_command(args, rest)
        except ConfigError as exc:
            print(f"pipeline {args.command}: error: {exc}", file=sys.stderr)
            return 2
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "data":
        from pipeline.commands.data_cmd import data_command

        return data_command(args)
    if args.command == "inspect":
        from pipeline.commands.inspect import inspect_command

        return inspect_command(args)
    if args.command == "replay":
        from pipeline.commands.replay import replay_command

        return replay_command(args)
    if args.command == "keys":
        from pipeline.transport.security import make_keys

        out = make_keys(args.dir)
        print(f"CURVE keys in {out}: copy the directory to every host, set run.keys_dir")
        return 0
    if args.command == "deploy":
        from pipeline.commands.deploy import deploy_command

        return deploy_command(args)
    if args.command == "report":
        from pipeline.commands.report import report_command

        return report_command(args)
    parser.error(f"unknown command {args.command}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
