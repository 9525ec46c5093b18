"""The progress display before the first step: what each service is doing."""

from __future__ import annotations

import json

from pipeline.config.profile import load_config
from pipeline.runtime.supervisor import _Progress


def test_progress_says_which_services_start_warm_up_and_are_ready(tmp_path):
    config = load_config("profiles/local-cpu.toml")
    metrics = tmp_path / "metrics"
    metrics.mkdir()
    progress = _Progress(tmp_path, config)
    try:
        progress.update()
        text = progress.progress.tasks[0].fields["info"]
        assert text == "starting: rollout-0, reward-0, reward-1, learner-0", text
        # answered by the controller: the service's metrics file exists, its setup runs
        (metrics / "learner-0.jsonl").write_text(json.dumps({"kind": "queues"}) + "\n")
        (metrics / "reward-0.jsonl").write_text(json.dumps({"kind": "ready"}) + "\n")
        progress.update()
        text = progress.progress.tasks[0].fields["info"]
        assert text == "starting: rollout-0, reward-1  warming up: learner-0  ready: reward-0"
        step = {"step": 0, "reward_mean": 0.5, "tokens_per_s": 10.0}
        (metrics / "steps.jsonl").write_text(json.dumps(step) + "\n")
        progress.update()
        assert progress.progress.tasks[0].fields["info"].startswith("reward 0.500")
        progress.update()  # the first step shown: no more start-up text
        assert progress.progress.tasks[0].fields["info"].startswith("reward 0.500")
    finally:
        progress.close()
