"""User reward functions that misbehave on purpose; loaded by path in a worker process."""

from __future__ import annotations

import os
import time


def exact(data_source, solution_str, ground_truth, extra_info):
    return float(solution_str.strip() == ground_truth.strip())


def raises(data_source, solution_str, ground_truth, extra_info):
    raise RuntimeError("reward bug on purpose")


def hangs(data_source, solution_str, ground_truth, extra_info):
    time.sleep(60)
    return 1.0


def nan(data_source, solution_str, ground_truth, extra_info):
    return float("nan")


def as_dict(data_source, solution_str, ground_truth, extra_info):
    return {"score": 0.25, "acc": True}


def exits(data_source, solution_str, ground_truth, extra_info):
    os._exit(7)


def pid(data_source, solution_str, ground_truth, extra_info):
    return float(os.getpid())


NOT_CALLABLE = 3
