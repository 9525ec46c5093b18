"""`pipeline run`: the local supervisor over every service of a profile."""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from pipeline.config import load_config, parse_override_args
from pipeline.config.profile import resolve_profile
from pipeline.errors import ConfigError
from pipeline.log import configure_logging


def run_command(args: argparse.Namespace, rest: list[str]) -> int:
    from pipeline.runtime import layout
    from pipeline.runtime.supervisor import Supervisor

    configure_logging()
    profile = str(resolve_profile(args.profile))
    overrides = parse_override_args(rest)
    base = load_config(profile, overrides)
    name = args.name or f"{base.run.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    overrides["run.name"] = name
    config = load_config(profile, overrides)
    existing = layout.run_dir(config)
    if (existing / "config.json").exists() and not args.resume:
        raise ConfigError(
            f"a run named {name!r} exists in {existing}; pass --resume to continue it, or "
            "choose another --name"
        )
    if args.resume and not (existing / "config.json").exists():
        raise ConfigError(f"--resume: no run named {name!r} in {existing.parent}")
    if config.model.path and (Path(config.model.path) / "config.json").is_file():
        from pipeline.models.hf_causal import rollout_choice

        rollout_choice(config.model.path, config.rollout.engine)  # refused here, not mid-run
    if not config.model.path and config.task.warm_start_steps > 0:
        print(
            f"note: the generated tiny model gets a supervised warm start of "
            f"{config.task.warm_start_steps} steps of copying digits before RL "
            "(it never sees the RL task's instruction)"
        )
    supervisor = Supervisor(
        config, profile=profile, overrides=overrides, show_progress=not args.no_progress
    )
    code = supervisor.run()
    run_dir = layout.run_dir(config)
    summary_path = run_dir / "summary.json"
    if summary_path.exists():
        summary = json.loads(summary_path.read_text())
        print(json.dumps(summary, indent=2))
    print(f"run directory: {run_dir}")
    if (run_dir / "metrics" / "steps.jsonl").exists():
        from pipeline.commands.report import make_report

        report = make_report(run_dir)
        first, last = report["reward_first10"], report["reward_last10"]
        if first is not None:
            print(f"mean reward: first 10 steps {first:.3f}, last 10 steps {last:.3f}")
        print(f"report: {run_dir / 'report'} (plots, trace.json for Perfetto)")
    return code
