"""`pipeline data convert FORMAT IN OUT`: a public dataset's rows into the RL schema that
`task.dataset` reads (one prompt per row, its data source and ground truth)."""

from __future__ import annotations

import argparse
import sys


def data_command(args: argparse.Namespace) -> int:
    from pipeline.data.formats import read_rows, write_rows
    from pipeline.data.gsm8k import convert_gsm8k
    from pipeline.data.records import DataError

    try:
        rows = convert_gsm8k(read_rows(args.input), args.split)
        out = write_rows(rows, args.output)
    except DataError as exc:
        print(f"pipeline data convert: error: {exc}", file=sys.stderr)
        return 2
    print(f"{len(rows)} {args.format} rows in the RL schema: {out}")
    return 0
