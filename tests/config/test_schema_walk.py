"""Accepted means working: every key of the run config is read by the code it configures,
and a value the code cannot honour is refused at load, with the fix."""

from __future__ import annotations

import ast
import dataclasses
import re
import typing
from collections import defaultdict
from pathlib import Path

import pytest

from pipeline.config import load_config
from pipeline.config.schema import PipelineConfig
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
SRC = REPO / "src"
# reads inside these functions check a value, they do not use it
_CHECKS = ("validate", "__post_init__", "_validate", "check_")
# keys that only validation reads, each with why it is accepted
ALLOWED_UNREAD: set[str] = set()


def schema_keys(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, field name) of every leaf key; `*` stands for a table's own names."""
    out = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        path = f"{prefix}.{f.name}" if prefix else f.name
        args = typing.get_args(tp)
        if dataclasses.is_dataclass(tp):
            out += schema_keys(tp, path)  # type: ignore[arg-type]
        elif typing.get_origin(tp) is dict and dataclasses.is_dataclass(args[1]):
            out += schema_keys(args[1], f"{path}.*")
        else:
            out.append((path, f.name))
    return out


def attribute_reads() -> dict[str, set[str]]:
    """Attribute names read anywhere in src/, outside validation, with where."""
    reads: dict[str, set[str]] = defaultdict(set)

    def visit(node: ast.AST, where: str, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = func
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                name = child.name
            load = isinstance(child, ast.Attribute) and isinstance(child.ctx, ast.Load)
            if load and not name.startswith(_CHECKS):
                reads[child.attr].add(f"{where}:{name}")  # type: ignore[attr-defined]
            visit(child, where, name)

    for path in SRC.rglob("*.py"):
        visit(ast.parse(path.read_text()), str(path.relative_to(SRC)), "")
    return reads


def test_every_config_key_is_read_by_code_outside_validation():
    reads = attribute_reads()
    keys = schema_keys(PipelineConfig)
    assert len(keys) > 100  # the walk reaches every section and table
    unread = sorted(path for path, name in keys if not reads.get(name))
    assert unread == sorted(ALLOWED_UNREAD), unread


def test_the_walk_finds_a_key_that_nothing_reads():
    @dataclasses.dataclass(frozen=True)
    class Extra:
        surely_nobody_reads_this_knob: int = 0

    keys = schema_keys(Extra)
    reads = attribute_reads()
    assert [p for p, n in keys if not reads.get(n)] == ["surely_nobody_reads_this_knob"]


def _load(profile: str, **overrides: str) -> PipelineConfig:
    return load_config(str(REPO / "profiles" / profile), dict(overrides))


@pytest.mark.parametrize(
    ("profile", "overrides", "fix"),
    [
        ("local-cpu.toml", {"services.reward.tp": "2"}, "only the rollout's engines split"),
        ("local-cpu.toml", {"services.rollout.tp": "2", "rollout.engine": "hf"}, "the hf engine"),
        ("h200-single.toml", {"services.rollout.tp": "2"}, "devices_per_replica = 2"),
        ("local-cpu.toml", {"services.reward.fsdp_size": "2"}, "raise services.reward.replicas"),
        # the policy's keys are the learner's; temperature and the reference are derived
        (
            "local-cpu-ppo.toml",
            {"critic.trainer.reuse_behaviour_logprobs": "true"},
            "unknown config key 'critic.trainer.reuse_behaviour_logprobs'",
        ),
        ("local-cpu.toml", {"learner.trainer.temperature": "0.5"}, "unknown config key"),
        ("local-cpu.toml", {"learner.trainer.keep_reference": "true"}, "unknown config key"),
        ("local-cpu.toml", {"services.reference.pool": "local"}, "no KL term needs it"),
        (
            "local-cpu.toml",
            {"reference.host": "critic", "algorithm.use_kl_loss": "true"},
            "needs critic.enabled = true",
        ),
        (
            "local-cpu-ppo.toml",
            {"reference.host": "learner", "algorithm.kl_penalty_in_reward": "true"},
            "set reference.host to 'critic', 'service' or 'auto'",
        ),
        (
            "local-cpu-ppo.toml",
            {"reference.host": "service", "algorithm.kl_penalty_in_reward": "true"},
            "needs a [services.reference] placement",
        ),
        ("local-cpu.toml", {"learner.keep_checkpoints": "0"}, "learner.keep_checkpoints must be"),
        (
            "local-cpu.toml",
            {"learner.weights.bucket_mb": "0"},
            "bucket_mb must be at least 64 bytes",
        ),
    ],
)
def test_a_value_the_code_cannot_honour_is_refused_at_load_with_the_fix(
    profile: str, overrides: dict[str, str], fix: str
):
    with pytest.raises(ConfigError, match=re.escape(fix)):
        _load(profile, **overrides)


def test_where_the_reference_runs():
    assert _load("local-cpu.toml").reference_host() is None
    assert _load("local-cpu.toml", **{"algorithm.use_kl_loss": "true"}).reference_host() == (
        "learner"
    )
    ppo = {"algorithm.kl_penalty_in_reward": "true"}
    assert _load("local-cpu-ppo.toml", **ppo).reference_host() == "critic"
    placed = {**ppo, "services.reference.pool": "local"}
    assert _load("local-cpu-ppo.toml", **placed).reference_host() == "service"
