"""`pipeline deploy render`: write a profile's Slurm job or Kubernetes manifests."""

from __future__ import annotations

import argparse
import sys

from pipeline.errors import ConfigError


def deploy_command(args: argparse.Namespace) -> int:
    from pipeline.deploy import write

    try:
        path = write(args.profile, args.target, args.out)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0
