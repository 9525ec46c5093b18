"""Every schema that crosses a process boundary is defined under `pipeline.wire`.

The messages each channel decodes (the queues' and the control plane's, the weight sync's,
the rank commands, the environment and reward workers' framing, a recording's header) and
every struct inside them live in one package; a struct defined anywhere else is a file or
config format, named below with what it is for."""

from __future__ import annotations

import ast
import pathlib
import typing

import msgspec
import msgspec.inspect

from pipeline.wire import env, messages, recording, reward, weights

SRC = pathlib.Path(__file__).resolve().parents[2] / "src"

# structs outside the wire: none crosses a process boundary
NOT_WIRE = {
    "pipeline/data/cursor.py": {"CursorState"},  # the dataset cursor in a checkpoint file
    "pipeline/data/records.py": {"PromptRecord"},  # a dataset row, read in the process
    "pipeline/envs/types.py": {"StepResult"},  # an environment's answer, inside its worker
    "pipeline/rewards/format.py": {"FormatReward"},  # a reward's options
    "pipeline/rewards/types.py": {"ScoreItem", "ScoreResult", "ScorerCounters"},  # in-process
}


def _roots() -> list[typing.Any]:
    return [
        *messages.MESSAGE_TYPES.values(),
        messages.RankCommand,
        env.EnvMessage,
        reward.WorkerMessage,
        recording.RecordingHeader,
        weights.SyncFailure,
    ]


def _structs(node: msgspec.inspect.Type, seen: set[type]) -> None:
    if isinstance(node, msgspec.inspect.StructType):
        if node.cls in seen:
            return
        seen.add(node.cls)
        for f in node.fields:
            _structs(f.type, seen)
        return
    for attr in ("item_type", "key_type", "value_type"):
        if (child := getattr(node, attr, None)) is not None:
            _structs(child, seen)
    for child in getattr(node, "types", None) or getattr(node, "item_types", None) or ():
        _structs(child, seen)


def test_every_struct_a_channel_decodes_is_defined_under_wire():
    seen: set[type] = set()
    for root in _roots():
        _structs(msgspec.inspect.type_info(root), seen)
    assert len(seen) > 30  # the walk reaches into the messages' fields
    outside = sorted(
        f"{c.__module__}.{c.__qualname__}"
        for c in seen
        if not c.__module__.startswith("pipeline.wire.")
    )
    assert not outside, f"define these under src/pipeline/wire/: {outside}"


def test_a_struct_outside_the_wire_is_a_named_file_or_config_format():
    found: dict[str, set[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith("pipeline/wire/"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                "Struct" in ast.unparse(base) for base in node.bases
            ):
                found.setdefault(rel, set()).add(node.name)
    assert found == NOT_WIRE, (
        "a msgspec.Struct outside src/pipeline/wire/: move it there if it crosses a process "
        "boundary, else add it to NOT_WIRE with what it is for"
    )
