"""What a user sees when a run cannot go on: the cause on the terminal (stderr), config
errors with exit code 2, a run name that exists refused, a dataset of overlong prompts
refused (or dropped and counted), and `pipeline config` / `pipeline data convert`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PIPELINE = [sys.executable, "-m", "pipeline.cli"]


def _run(
    tmp_path: Path, name: str, *extra: str, timeout: float = 240
) -> subprocess.CompletedProcess:
    cmd = [*PIPELINE, "run", "--no-progress", "--run.runs_dir", str(tmp_path / "runs")]
    cmd += ["--name", name, "--controller.steps", "2", "--task.warm_start_steps", "0", *extra]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout)


def _said(proc: subprocess.CompletedProcess) -> str:
    """stderr without the supervisor's JSON log lines: what the user reads."""
    return "\n".join(x for x in proc.stderr.splitlines() if not x.startswith("{"))


def _ended_with(tmp_path: Path, reason: str, name: str, *extra: str) -> dict:
    """Run `name`; it must end with exit code 1 and `reason` on stderr. Its summary."""
    proc = _run(tmp_path, name, *extra)
    said = _said(proc)
    assert proc.returncode == 1, said
    assert reason in said, said
    return json.loads((tmp_path / f"runs/{name}/summary.json").read_text())


def test_a_bad_dataset_row_and_a_missing_model_path_show_their_cause_on_stderr(tmp_path):
    data = tmp_path / "bad.jsonl"
    rows = [{"data_source": "x", "prompt": "hi", "reward_model": {"ground_truth": "1"}}]
    rows.append({"data_source": "x"})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = _run(tmp_path, "bad", "--task.dataset", str(data))
    said = _said(bad)
    assert bad.returncode != 0
    assert "controller-0 exited with code" in said and "row 1: missing 'prompt'" in said, said
    assert str(tmp_path / "runs/bad/logs/controller-0.log") in said
    missing = _run(tmp_path, "nomodel", "--model.path", str(tmp_path / "no/such/model"))
    said = _said(missing)
    assert missing.returncode != 0 and "does not exist" in said and "model.path" in said, said


def test_config_errors_exit_2_on_stderr_and_an_existing_run_name_needs_resume(tmp_path):
    typo = _run(tmp_path, "typo", "--controller.stepz", "3")
    assert typo.returncode == 2 and "did you mean 'steps'" in typo.stderr and not typo.stdout
    (tmp_path / "runs/taken").mkdir(parents=True)
    (tmp_path / "runs/taken/config.json").write_text("{}")
    again = _run(tmp_path, "taken")
    assert again.returncode == 2 and "pass --resume" in again.stderr
    fresh = _run(tmp_path, "never", "--resume")
    assert fresh.returncode == 2 and "no run named 'never'" in fresh.stderr


def test_a_service_that_refuses_its_config_ends_the_run_with_exit_2_and_no_restart(tmp_path):
    """A bfloat16 first moment needs the flat optimizer, which only the learner that builds
    its optimizer knows it has not (on CPU): the cause on stderr, exit code 2, no restart."""
    bad = _run(tmp_path, "badopt", "--learner.trainer.exp_avg_dtype", "bfloat16")
    said = _said(bad)
    assert bad.returncode == 2, said
    assert "learner-0 exited with code 2" in said and "needs the flat optimizer" in said
    events = json.loads((tmp_path / "runs/badopt/supervisor.json").read_text())
    assert events["restarts"]["learner-0"] == 0


def test_overlong_prompts_are_refused_with_the_fix_or_dropped_and_counted(tmp_path):
    data = tmp_path / "long.jsonl"
    rows = [
        {"data_source": "toy_reverse", "prompt": p, "reward_model": {"ground_truth": "1"}}
        for p in ("reverse 12 =", "reverse 34 =", "reverse " + "9" * 80 + " =")
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    refused = _run(tmp_path, "long", "--task.dataset", str(data))
    said = _said(refused)
    assert refused.returncode != 0
    assert "1 of 3 prompts are longer than task.max_prompt_tokens = 64" in said, said
    assert "task.drop_long_prompts = true" in said
    dropped = _run(
        tmp_path,
        "dropped",
        "--task.dataset",
        str(data),
        "--task.drop_long_prompts",
        "true",
        "--controller.prompts_per_step",
        "2",
        "--services.reward.replicas",
        "1",
    )
    assert dropped.returncode == 0, dropped.stderr[-3000:]
    assert "note: 1 prompts longer than task.max_prompt_tokens = 64 dropped" in _said(dropped)


def test_config_show_and_keys(tmp_path):
    show = subprocess.run(
        [
            *PIPELINE,
            "config",
            "show",
            "--profile",
            "profiles/local-cpu-ppo.toml",
            "--controller.steps",
            "7",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    resolved = json.loads(show.stdout)
    assert resolved["controller"]["steps"] == 7 and resolved["critic"]["enabled"] is True
    keys = subprocess.run(
        [*PIPELINE, "config", "keys"], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.splitlines()
    from pipeline.config.schema import PipelineConfig
    from tests.config.test_schema_walk import schema_keys

    listed = {line.split(" = ", 1)[0] for line in keys}
    assert listed == {path for path, _ in schema_keys(PipelineConfig)}
    assert all("  # " in line for line in keys), [x for x in keys if "  # " not in x]
    assert "controller.max_staleness = 1  # versions a trained sample may lag" in "\n".join(keys)


def test_data_convert_gsm8k(tmp_path):
    from pipeline.data.formats import read_rows, write_rows

    raw = tmp_path / "gsm8k.jsonl"
    write_rows([{"question": "What is 2 + 3?", "answer": "2 + 3 = <<2+3=5>>5\n#### 5"}], raw)
    out = tmp_path / "rl.parquet"
    done = subprocess.run(
        [*PIPELINE, "data", "convert", "gsm8k", str(raw), str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    (row,) = read_rows(out)
    assert row["reward_model"]["ground_truth"] == "5" and row["data_source"] == "openai/gsm8k"
    broken = tmp_path / "broken.jsonl"
    write_rows([{"question": "no answer field"}], broken)
    bad = subprocess.run(
        [*PIPELINE, "data", "convert", "gsm8k", str(broken), str(tmp_path / "x.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "row 0" in bad.stderr


def test_a_run_whose_learner_skips_every_update_ends_with_an_error(tmp_path):
    """A policy that diverges (lr 1e30: the first update's weights overflow the next
    forward) makes every later loss non-finite: after controller.failed_steps
    steps with every optimizer step skipped the run ends, exit code 1, the reason on stderr
    (it used to run to its last step and exit 0, having trained on nothing)."""
    summary = _ended_with(
        tmp_path,
        "skipped every optimizer step of the last 2 steps",
        *("diverged", "--learner.trainer.lr", "1e30", "--controller.steps", "12"),
        *("--controller.failed_steps", "2"),
    )
    assert not summary["completed"] and summary["steps"] < 12
    steps = [json.loads(x) for x in (tmp_path / "runs/diverged/metrics/steps.jsonl").open()]
    assert steps[-1]["actor/skipped_updates"] == steps[-1]["actor/updates"] > 0


def test_a_run_whose_every_reward_fails_ends_with_an_error(tmp_path):
    """Every verifier call raises: after controller.failed_steps such steps in a
    row the run ends, exit code 1, the reason on stderr (issue 33, defect 9: exit 0)."""
    summary = _ended_with(
        tmp_path,
        "every reward failed in the last 2 steps",
        *("norewards", "--reward.function", "tests.standin.failing_reward:reward_fn"),
        *("--controller.steps", "8", "--controller.failed_steps", "2"),
    )
    assert not summary["completed"] and summary["steps"] == 2 and "verifier" in summary["failure"]
