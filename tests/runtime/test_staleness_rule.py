"""The staleness bound: a group is trained while its generation ended at most
`controller.max_staleness` versions ago, however many versions its long samples spanned;
one that ended longer ago is dropped (the feature matrix's staleness cases cut an engine
off from the weights for that)."""

from __future__ import annotations

import json

import numpy as np

from pipeline.wire.samples import GroupArrays, SampleArrays, finished_age, staleness
from tests.e2e.cli_run import cli_run
from tests.runtime.budget_rows import budget_rows


def _group(*versions: list[int]) -> GroupArrays:
    samples = [
        SampleArrays(
            uid=f"g/{i}",
            response_ids=np.zeros(len(v), np.int32),
            behaviour_logprobs=np.zeros(len(v), np.float32),
            token_versions=np.asarray(v, np.int32),
        )
        for i, v in enumerate(versions)
    ]
    return GroupArrays(uid="g", prompt_ids=np.zeros(3, np.int32), samples=samples)


def test_the_age_is_the_newest_tokens_and_the_lag_the_oldest():
    spanning = _group([3, 3, 4, 5, 6], [3, 3])
    assert finished_age(spanning, 6) == 0 and staleness(spanning, 6) == 3
    ended_long_ago = _group([3, 4], [4])
    assert finished_age(ended_long_ago, 6) == 2
    assert finished_age(_group([]), 6) == 0  # nothing generated: nothing stale


def test_long_samples_that_span_updates_are_trained_not_dropped(tmp_path):
    """One prompt in eight runs for hundreds of tokens (EOS ignored) while the others end
    after three: the learner moves on several versions while a long one is generated. Under
    the bound on the oldest token they were dropped; now each is trained."""
    data = budget_rows(tmp_path / "data.jsonl", [400, 3, 3, 3, 3, 3, 3, 3] * 8, ignore_eos=True)
    run = cli_run(
        tmp_path / "runs",
        "span",
        *("--task.dataset", str(data), "--task.warm_start_steps", "0"),
        *("--rollout.max_new_tokens", "400"),
        *("--rollout.n_samples", "2", "--controller.prompts_per_step", "4"),
        *("--controller.steps", "24", "--controller.max_staleness", "1"),
        *(
            "--services.reward.replicas",
            "1",
        ),
        timeout=600,
    )
    summary = json.loads((run / "summary.json").read_text())
    assert summary["dropped"] == 0, summary
    from pipeline.wire.recording import QueueReader

    step_of = {}
    for line in (run / "schedule.jsonl").read_text().splitlines():
        record = json.loads(line)
        step_of[record["uid"]] = record["step"]
    spans = []
    for record in QueueReader(run / "queues/scored.log"):
        message = record.decode()
        for sample in message.body.samples:
            if sample.uid not in step_of:
                continue
            versions = message.tensor(sample.token_versions)
            assert step_of[sample.uid] - int(versions.max()) <= 1, sample.uid
            spans.append(step_of[sample.uid] - int(versions.min()))
    # long samples were trained although their first tokens were beyond the bound
    assert max(spans) >= 2, spans
