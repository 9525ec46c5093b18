"""The controller's write-ahead journal: what a restarted controller needs to carry on.

One JSON object per line in `runs/<name>/controller/journal.jsonl`, appended and fsynced
before the controller acts on it: prompts before they are sent, a learner step before the
step is written to steps.jsonl or announced in heartbeats (the learner takes that
announcement as the controller's acknowledgement). Replaying the file gives a new
controller incarnation the run id, every released prompt, the accounting and the
learner's step and version; prompts released but not settled are released again under
the same uid (consumers de-duplicate by uid). Torch-free, so tests read it cheaply.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipeline.errors import JournalError
from pipeline.runtime.json_lines import DamagedLine, JsonLines, read_json_lines


def prompt_uid(sample_uid: str) -> str:
    """`<prompt uid>/<sample index>` -> `<prompt uid>`."""
    return sample_uid.rsplit("/", 1)[0]


@dataclass(frozen=True)
class ReleasedPrompt:
    """What it takes to send a released prompt again, byte for byte the same prompt."""

    uid: str
    prompt_text: str
    data_source: str
    ground_truth: str
    released_version: int
    # the prompt's own response budget (0: the run's rollout.max_new_tokens)
    max_new_tokens: int = 0
    # the row's ignore_eos: end-of-sequence does not end its samples
    ignore_eos: bool = False


class Accounting:
    """Every released prompt uid ends trained exactly once or dropped; nothing else."""

    def __init__(self) -> None:
        self.released: set[str] = set()
        self.trained: dict[str, int] = {}
        self.dropped: set[str] = set()
        self.duplicates: list[str] = []

    def on_step(self, step: int, trained_uids: list[str], dropped_uids: list[str]) -> None:
        for uid in trained_uids:
            prompt = prompt_uid(uid)
            if prompt in self.trained and self.trained[prompt] != step:
                self.duplicates.append(prompt)
            self.trained[prompt] = step
        self.on_dropped(dropped_uids)

    def on_dropped(self, sample_uids: list[str]) -> None:
        self.dropped.update(prompt_uid(u) for u in sample_uids)

    def settled(self) -> set[str]:
        return set(self.trained) | self.dropped

    def summary(self) -> dict[str, Any]:
        settled = self.settled()
        return {
            "released": len(self.released),
            "trained": len(self.trained),
            "dropped": len(self.dropped - set(self.trained)),
            "duplicates": len(self.duplicates),
            "in_flight_at_end": len(self.released - settled),
            "unknown_trained": len(set(self.trained) - self.released),
        }


def step_key(step: int, policy_version: int, trained_uids: list[str]) -> str:
    """Identifies one learner report: a re-sent StepDone has the same key."""
    text = json.dumps([step, policy_version, sorted(trained_uids)])
    return hashlib.sha1(text.encode()).hexdigest()


@dataclass
class RunState:
    """The controller's run state, rebuilt by applying journal records in order."""

    run_id: str = ""
    started: float = 0.0
    incarnations: int = 0
    released: list[ReleasedPrompt] = field(default_factory=list)
    accounting: Accounting = field(default_factory=Accounting)
    # the learner's next step and current version, never moving back: a report that
    # arrives late (re-sent after a controller restart) must not rewind the clock
    step: int = 0
    learner_version: int = 0
    # steps.jsonl records in the order written, each with its trained sample uids
    steps: list[dict[str, Any]] = field(default_factory=list)
    step_keys: set[str] = field(default_factory=set)

    def apply(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind == "start":
            if self.run_id and record["run_id"] != self.run_id:
                raise JournalError(
                    f"journal mixes runs {self.run_id} and {record['run_id']}; "
                    "remove the run directory or pick another --name"
                )
            self.run_id, self.incarnations = record["run_id"], self.incarnations + 1
            self.started = self.started or float(record["started"])
        elif kind == "release":
            for prompt in record["prompts"]:
                released = ReleasedPrompt(**prompt)
                self.released.append(released)
                self.accounting.released.add(released.uid)
        elif kind == "step":
            self.step_keys.add(record["key"])
            self.accounting.on_step(record["step"], record["trained_uids"], record["dropped_uids"])
            self.step = max(self.step, record["step"] + 1)
            self.learner_version = max(self.learner_version, record["policy_version"])
            self.steps.append(record)
        elif kind == "dropped":
            self.accounting.on_dropped(record["uids"])
        else:
            raise JournalError(f"unknown journal record kind {kind!r}")

    def unsettled(self) -> list[ReleasedPrompt]:
        """Released prompts neither trained nor dropped, in release order."""
        settled = self.accounting.settled()
        return [p for p in self.released if p.uid not in settled]


def release_record(prompts: list[ReleasedPrompt]) -> dict[str, Any]:
    return {"kind": "release", "prompts": [asdict(p) for p in prompts]}


class Journal(JsonLines):
    """Append-only JSON lines, each fsynced before `append` returns."""


def load_state(path: Path) -> RunState | None:
    """The state the journal at `path` describes; None when there is none (a new run)."""
    try:
        records = read_json_lines(path)  # a last line cut by a kill mid-write left out
    except DamagedLine as exc:
        raise JournalError(
            f"{path}:{exc.number} is not JSON ({exc.error}); the journal is damaged: move it "
            "away to start the run over, or restore it"
        ) from exc
    state = RunState()
    for record in records:
        state.apply(record)
    return state if state.incarnations else None
