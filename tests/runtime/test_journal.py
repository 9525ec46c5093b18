"""The controller's journal: replaying it gives back the run state, whatever the kill cut."""

from __future__ import annotations

import json

import pytest

from pipeline.errors import JournalError
from pipeline.runtime.journal import (
    Journal,
    ReleasedPrompt,
    load_state,
    release_record,
    step_key,
)
from pipeline.runtime.json_lines import complete_lines


def prompt(i: int, version: int = 0) -> ReleasedPrompt:
    return ReleasedPrompt(
        uid=f"{i:06d}:p{i}",
        prompt_text=f"reverse {i} =",
        data_source="toy",
        ground_truth=str(i)[::-1],
        released_version=version,
    )


def step(n: int, trained: list[int], dropped: list[int] = (), version: int | None = None):
    uids = [f"{i:06d}:p{i}/{s}" for i in trained for s in range(2)]
    version = n + 1 if version is None else version
    return {
        "kind": "step",
        "key": step_key(n, version, uids),
        "step": n,
        "policy_version": version,
        "trained_uids": uids,
        "dropped_uids": [f"{i:06d}:p{i}/0" for i in dropped],
        "line": {"time": 1.0, "step": n},
    }


def test_replay_rebuilds_accounting_clock_and_what_is_in_flight(tmp_path):
    path = tmp_path / "controller" / "journal.jsonl"
    assert load_state(path) is None
    journal = Journal(path)
    journal.append({"kind": "start", "run_id": "abc", "started": 5.0, "pid": 1})
    journal.append(release_record([prompt(i) for i in range(6)]))
    journal.append(step(0, [0, 1]))
    journal.append({"kind": "dropped", "uids": ["000002:p2/0", "000002:p2/1"]})
    journal.append(step(1, [3], dropped=[2]))
    journal.append(release_record([prompt(6, version=2)]))
    # a learner that resumed from an older checkpoint reports a lower version late
    journal.append(step(0, [4], version=1))
    journal.close()

    state = load_state(path)
    assert state is not None
    assert (state.run_id, state.started, state.incarnations) == ("abc", 5.0, 1)
    assert (state.step, state.learner_version) == (2, 2)  # never moves back
    assert [p.uid for p in state.unsettled()] == ["000005:p5", "000006:p6"]
    assert state.unsettled()[-1] == prompt(6, version=2)
    summary = state.accounting.summary()
    assert summary == {
        "released": 7,
        "trained": 4,
        "dropped": 1,
        "duplicates": 0,
        "in_flight_at_end": 2,
        "unknown_trained": 0,
    }
    assert step_key(1, 2, step(1, [3])["trained_uids"]) in state.step_keys
    assert [s["step"] for s in state.steps] == [0, 1, 0]


def test_a_line_cut_by_the_kill_is_dropped_and_the_next_incarnation_appends_cleanly(tmp_path):
    path = tmp_path / "journal.jsonl"
    journal = Journal(path)
    journal.append({"kind": "start", "run_id": "abc", "started": 5.0, "pid": 1})
    journal.append(release_record([prompt(0)]))
    journal.close()
    whole = path.read_bytes()
    path.write_bytes(whole + b'{"kind":"release","prom')  # SIGKILL halfway through a write
    state = load_state(path)
    assert state is not None and len(state.released) == 1
    journal = Journal(path)  # the next incarnation
    journal.append({"kind": "start", "run_id": "abc", "started": 9.0, "pid": 2})
    journal.close()
    assert path.read_bytes().startswith(whole)
    state = load_state(path)
    assert state is not None and (state.incarnations, state.started) == (2, 5.0)
    assert complete_lines(path) == 3


def test_a_damaged_or_foreign_journal_is_refused_with_the_fix(tmp_path):
    path = tmp_path / "journal.jsonl"
    path.write_text('{"kind":"start","run_id":"a","started":1,"pid":1}\nnot json\n{}\n')
    with pytest.raises(JournalError, match="move it away"):
        load_state(path)
    lines = [{"kind": "start", "run_id": r, "started": 1, "pid": 1} for r in ("a", "b")]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    with pytest.raises(JournalError, match="another --name"):
        load_state(path)


def test_a_resumed_controller_writes_the_metrics_its_predecessor_journaled_but_lost(tmp_path):
    """Killed between the journal and steps.jsonl: the next incarnation fills the gap."""
    from pipeline.config import PipelineConfig
    from pipeline.data.cursor import PromptCursor
    from services.controller.service import Controller

    run_dir = tmp_path / "run"
    journal = Journal(run_dir / "controller" / "journal.jsonl")
    journal.append({"kind": "start", "run_id": "abc", "started": 5.0, "pid": 1})
    journal.append(release_record([prompt(i) for i in range(3)]))
    journal.append(step(0, [0, 1]))
    journal.close()
    (run_dir / "metrics").mkdir()
    (run_dir / "metrics" / "steps.jsonl").write_text('{"time": 1.0, "st')  # cut mid-line
    rows = [{"time": 1.0, "uid": "000000:p0/0", "step": 0, "version": 1}]
    (run_dir / "schedule.jsonl").write_text(json.dumps(rows[0]) + "\n")

    controller = Controller(PipelineConfig(), run_dir)
    controller._cursor = PromptCursor(list(range(10)), seed=0, shuffle=False)
    controller.open_state()
    assert (controller.run_id, controller.started, controller.step) == ("abc", 5.0, 1)
    assert controller._cursor.next() == 3  # the three released prompts are not handed again
    assert [p.uid for p in controller.state.unsettled()] == ["000002:p2"]
    lines = (run_dir / "metrics" / "steps.jsonl").read_text().splitlines()
    assert [json.loads(x) for x in lines] == [{"time": 1.0, "step": 0}]
    schedule = [json.loads(x) for x in (run_dir / "schedule.jsonl").read_text().splitlines()]
    assert [r["uid"] for r in schedule] == [f"00000{i}:p{i}/{s}" for i in (0, 1) for s in (0, 1)]
    assert controller.state.incarnations == 2
    controller.journal.close()
    assert load_state(run_dir / "controller" / "journal.jsonl").incarnations == 2
