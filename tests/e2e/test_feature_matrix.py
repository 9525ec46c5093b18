"""Every configurable training feature in a real run: service processes on CPU, the tiny
model and the toy task, a few steps each. Each case asserts the feature's effect on what
the run recorded (its metrics, queues, logs and checkpoints), an effect that would be
absent if the code ignored the setting; a finished run alone proves nothing here.

The cases of `FAST` run in `make test`; the rest in `make test-slow`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from pipeline.wire.recording import QueueReader
from tests.run_patches import patch_vars

REPO = Path(__file__).resolve().parents[2]
# short runs: 4 prompts x 4 samples a step, one reward replica, a short warm start
BASE = {
    "controller.steps": "5",
    "controller.prompts_per_step": "4",
    "controller.max_inflight_prompts": "16",
    "rollout.n_samples": "4",
    "services.reward.replicas": "1",
    "task.warm_start_steps": "50",
    "learner.trainer.mini_batches": "2",
}
PPO = str(REPO / "profiles/local-cpu-ppo.toml")
GRPO = str(REPO / "profiles/local-cpu.toml")


@dataclasses.dataclass
class Run:
    dir: Path
    config: dict[str, Any]

    @property
    def steps(self) -> list[dict[str, Any]]:
        path = self.dir / "metrics/steps.jsonl"
        return [json.loads(x) for x in path.read_text().splitlines()]

    @property
    def summary(self) -> dict[str, Any]:
        return json.loads((self.dir / "summary.json").read_text())

    def queue(self, name: str) -> list[Any]:
        path = self.dir / "queues" / f"{name}.log"
        return [record.decode() for record in QueueReader(path)] if path.exists() else []

    def log(self, service: str) -> str:
        return (self.dir / "logs" / f"{service}.log").read_text()

    def events(self, service: str, event: str) -> list[dict[str, Any]]:
        out = []
        for line in self.log(service).splitlines():
            if f'"{event}"' in line:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def series(self, key: str) -> list[float]:
        return [float(s[key]) for s in self.steps if key in s]


def _command(runs: Path, name: str, profile: str, overrides: dict[str, str]) -> list[str]:
    args = [sys.executable, "-m", "pipeline.cli", "run", "--profile", profile, "--no-progress"]
    args += ["--name", name, "--run.runs_dir", str(runs)]
    for key, value in {**BASE, **overrides}.items():
        args += [f"--{key}", value]
    return args


def run_pipeline(
    tmp_path: Path,
    profile: str,
    overrides: dict[str, str],
    during: Callable[[subprocess.Popen[bytes], Path], None] | None = None,
    timeout: float = 420,
    env: dict[str, str] | None = None,
) -> Run:
    runs = tmp_path / "runs"
    out = (tmp_path / "run.log").open("wb")
    proc = subprocess.Popen(
        _command(runs, "m", profile, overrides),
        cwd=REPO,
        stdout=out,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, PIPELINE_LOG_JSON="1", **(env or {})),
        start_new_session=True,
    )
    run_dir = runs / "m"
    try:
        if during is not None:
            during(proc, run_dir)
        code = proc.wait(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
        out.close()
    assert code == 0, (tmp_path / "run.log").read_text()[-4000:]
    run = Run(run_dir, json.loads((run_dir / "config.json").read_text()))
    summary = run.summary
    assert summary["completed"] and summary["duplicates"] == 0
    assert summary["trained"] + summary["dropped"] == summary["released"]
    return run


# ------------------------------------------------------------------------------ checks


def _tensors(message: Any, field: str) -> list[np.ndarray]:
    out = []
    for sample in message.body.samples:
        ref = getattr(sample, field)
        out.append(None if ref is None else message.tensor(ref))
    return out


def _learner_input(run: Run) -> list[Any]:
    if run.config["critic"]["enabled"]:
        return run.queue("experience")
    return run.queue("referenced") or run.queue("scored")


def _versions_within_bound(run: Run, bound: int) -> int:
    """The newest token of every trained sample's group, from the recorded learner input
    and the controller's schedule (not the learner's own filter): within `bound` versions
    of the step that trained it. Returns the largest lag of an oldest token seen."""
    step_of = {}
    for line in (run.dir / "schedule.jsonl").read_text().splitlines():
        record = json.loads(line)
        step_of[record["uid"]] = record["step"]
    worst = 0
    for message in _learner_input(run):
        samples = [s for s in message.body.samples if s.uid in step_of]
        if not samples:
            continue  # dropped as stale, or not trained by the end
        versions = [message.tensor(s.token_versions) for s in message.body.samples]
        step = step_of[samples[0].uid]
        newest = max(int(v.max()) for v in versions if len(v))
        assert step - newest <= bound, (message.body.uid, step - newest, bound)
        worst = max(worst, step - min(int(v.min()) for v in versions if len(v)))
    return worst


def _whitened(run: Run) -> None:
    for step in run.steps:
        assert abs(step["actor/advantages_mean"]) < 1e-4, step["actor/advantages_mean"]
        assert step["actor/advantages_std"] == pytest.approx(1.0, abs=0.02)


def _first_batch_loss(run: Run, **algorithm: Any) -> dict[str, float]:
    """The run's first learner step again, in this process, with the algorithm changed:
    the same initial weights and batch give the same metrics (replay is exact)."""
    from pipeline.config import config_from_json
    from pipeline.tasks.prepare import model_dir
    from pipeline.training import PolicyTrainer
    from pipeline.training.batch import ExperienceBatch
    from pipeline.training.config import policy_config
    from pipeline.wire.samples import read_group

    config = config_from_json((run.dir / "config.json").read_text())
    first = set()
    for line in (run.dir / "schedule.jsonl").read_text().splitlines():
        record = json.loads(line)
        if record["step"] == 0:
            first.add(record["uid"].rsplit("/", 1)[0])
    groups = [read_group(m) for m in _learner_input(run) if m.body.uid in first]
    groups = list({g.uid: g for g in groups}.values())  # a redelivery recorded twice
    alg = dataclasses.replace(config.algorithm, **algorithm)
    trainer = PolicyTrainer(str(model_dir(config, run.dir)), policy_config(config), alg)
    return trainer.train_step(ExperienceBatch.from_groups(groups))


# ------------------------------------------------------------------------------ cases


def case_grpo(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, GRPO, {"algorithm.advantage_estimator": "grpo"})
    rloo = _first_batch_loss(run, advantage_estimator="rloo")
    # per-group baselines divided by the group's std: unit scale over the step
    for step in run.steps:
        assert abs(step["actor/advantages_mean"]) < 0.2
    grpo = run.steps[0]
    assert grpo["actor/advantages_std"] > 1.3 * rloo["actor/advantages_std"]


def case_rloo(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, GRPO, {"algorithm.advantage_estimator": "rloo"})
    grpo = _first_batch_loss(run, advantage_estimator="grpo")
    step = run.steps[0]
    assert step["actor/pg_loss"] == pytest.approx(
        _first_batch_loss(run)["actor/pg_loss"], rel=1e-4, abs=1e-6
    )
    assert step["actor/advantages_std"] < 0.75 * grpo["actor/advantages_std"]


def case_gae_with_critic(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, PPO, {"algorithm.use_kl_loss": "false"})
    groups = run.queue("experience")
    assert groups
    for message in groups:
        for name in ("values", "advantages", "returns", "rewards"):
            assert all(t is not None and np.isfinite(t).all() for t in _tensors(message, name))
    steps = run.events("critic-0", "critic_step")
    assert len(steps) == 5
    assert run.steps[-1]["critic/updates"] >= 4  # the critic's stats reach the step
    _whitened(run)


def case_vtrace_staleness_2(tmp_path: Path) -> None:
    run = run_pipeline(
        tmp_path,
        PPO,
        {
            "algorithm.advantage_estimator": "vtrace",
            "controller.max_staleness": "2",
            "controller.steps": "8",
            "algorithm.vtrace_rho_bar": "1.0",
        },
    )
    truncated = run.series("vtrace/truncated_frac")
    change = run.series("vtrace/adv_change")
    lags = run.series("staleness_max")
    assert len(truncated) == 8
    # stale samples: their ratio pi/mu is truncated somewhere; on-policy ones are not
    stale = [t for t, lag in zip(truncated, lags, strict=True) if lag > 0]
    assert stale and max(stale) > 0, (truncated, lags)
    # V-trace's advantages are not the critic's GAE ones on the same batch
    assert max(change) > 1e-3
    assert _versions_within_bound(run, 2) >= 1


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def case_kl_loss(tmp_path: Path, estimator: str) -> None:
    run = run_pipeline(
        tmp_path,
        GRPO,
        {
            "algorithm.use_kl_loss": "true",
            "algorithm.kl_estimator": estimator,
            "algorithm.kl_loss_coef": "0.1",
            # one update a step: the loss's KL and the step's are over the same log-probs
            "learner.trainer.mini_batches": "1",
        },
    )
    later = run.steps[1:]
    assert all(s["kl/k3"] > 0 for s in later)
    for step in later:
        assert step["actor/kl_loss"] == pytest.approx(step[f"kl/{estimator}"], rel=1e-3)
        others = [e for e in ("k1", "k2", "k3") if e != estimator]
        assert all(abs(step["actor/kl_loss"] - step[f"kl/{e}"]) > 1e-4 for e in others)
    # the term is in the loss: loss = pg_loss - entropy bonus + coef * kl_loss
    for step in later:
        entropy = float(run.config["algorithm"]["entropy_coef"]) * step["actor/entropy"]
        expected = step["actor/pg_loss"] - entropy + 0.1 * step["actor/kl_loss"]
        assert step["actor/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)


def _kl_in_reward(tmp_path: Path, ctrl: str, **extra: str) -> Run:
    return run_pipeline(
        tmp_path,
        PPO,
        {
            "algorithm.kl_penalty_in_reward": "true",
            "algorithm.kl_ctrl_type": ctrl,
            "algorithm.init_kl_coef": "0.05",
            "algorithm.target_kl": "1000" if ctrl == "adaptive" else "0.1",
            "algorithm.use_kl_loss": "false",
            "controller.steps": "6",
            **extra,
        },
    )


def case_kl_in_reward_fixed(tmp_path: Path) -> None:
    run = _kl_in_reward(tmp_path, "fixed")
    assert set(run.series("kl/coef")) == {0.05}
    penalty, kl = run.series("kl/reward_penalty"), run.series("kl/reward_kl")
    assert max(penalty) > 0
    for p, k in zip(penalty, kl, strict=True):
        assert p == pytest.approx(0.05 * k, rel=1e-6, abs=1e-12)
    # the penalty is in the rewards the critic shaped: token rewards sum to score - penalty
    shaped = 0
    for message in run.queue("experience"):
        for sample, rewards in zip(message.body.samples, _tensors(message, "rewards"), strict=True):
            shaped += abs(float(rewards.sum()) - sample.score) > 1e-6
    assert shaped > 0


def _critic_checkpoint(run: Run) -> dict[str, Any]:
    root = run.dir / "checkpoints/critic"
    return json.loads((root / (root / "latest").read_text().strip() / "meta.json").read_text())


def case_kl_in_reward_adaptive(tmp_path: Path) -> None:
    # far above what six steps reach, and a short horizon: every group's update lowers the
    # coefficient by its clipped proportional error, 0.2 * 4 samples / 20 (Ziegler et al.)
    run = _kl_in_reward(tmp_path, "adaptive", **{"algorithm.horizon": "20"})
    coefs, kls = run.series("kl/coef"), run.series("kl/reward_seq_kl")
    assert all(k < 0.8 * 1000 for k in kls)
    assert coefs[-1] < coefs[0] < 0.05, coefs
    # the controller's state is checkpointed with the critic, where the last step left it
    last = _critic_checkpoint(run)["extra"]["kl_coef"]
    assert 0 < last < coefs[-1]
    groups = 0.05 / last
    assert math.log(groups) / -math.log(1 - 0.2 * 4 / 20) == pytest.approx(
        round(math.log(groups) / -math.log(1 - 0.2 * 4 / 20)), abs=1e-6
    )


def case_whitening_on(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, PPO, {"algorithm.whiten_advantages": "true"})
    _whitened(run)


def case_whitening_off(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, PPO, {"algorithm.whiten_advantages": "false"})
    # the critic's raw GAE advantages: scores in [0, 1] minus values, nowhere near unit std
    assert all(abs(s["actor/advantages_std"] - 1.0) > 0.1 for s in run.steps)


def case_critic_batches(tmp_path: Path) -> None:
    """critic.annotate_max_groups: groups that waited share a forward (the record says
    which), and `pipeline replay --service critic` follows the record to the same values,
    bit for bit."""
    run = run_pipeline(tmp_path, PPO, {"critic.annotate_max_groups": "4"})
    batches = [
        json.loads(line)["uids"]
        for line in (run.dir / "critic/batches.jsonl").read_text().splitlines()
    ]
    assert max(len(uids) for uids in batches) > 1 and max(len(u) for u in batches) <= 4
    annotated = {m.body.uid: m for m in run.queue("experience")}
    assert {uid for uids in batches for uid in uids} >= set(annotated)
    out = tmp_path / "replay"
    cmd = [sys.executable, "-m", "pipeline.cli", "replay", str(run.dir)]
    proc = subprocess.run(
        [*cmd, "--service", "critic", "--out", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    replayed = {
        m.body.uid: m for m in (r.decode() for r in QueueReader(out / "queues/experience.log"))
    }
    assert replayed.keys() == annotated.keys()
    for uid, message in annotated.items():
        for name in ("values", "advantages", "returns"):
            for a, b in zip(_tensors(message, name), _tensors(replayed[uid], name), strict=True):
                assert np.array_equal(a, b), (uid, name)


def case_reference_service(tmp_path: Path) -> None:
    run = run_pipeline(
        tmp_path,
        PPO,
        {"algorithm.kl_penalty_in_reward": "true", "services.reference.pool": "local"},
    )
    referenced = run.queue("referenced")
    assert referenced and all(
        all(t is not None for t in _tensors(m, "ref_logprobs")) for m in referenced
    )
    assert run.queue("scored") and all(
        all(t is None for t in _tensors(m, "ref_logprobs")) for m in run.queue("scored")
    )
    assert max(run.series("kl/reward_penalty")) > 0  # the critic read them
    assert all(s["kl/k3"] >= 0 for s in run.steps) and run.steps[-1]["kl/k3"] > 0
    assert all(s["reference/recompiles"] == 0 for s in run.steps)  # the service reports it
    built = run.events("learner-0", "trainer_built")
    assert built and not any(e["reference"] for e in built)  # the learner keeps no copy


def case_reference_in_critic(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, PPO, {"algorithm.kl_penalty_in_reward": "true"})
    assert not (run.dir / "logs/reference-0.log").exists()
    experience = run.queue("experience")
    assert all(all(t is not None for t in _tensors(m, "ref_logprobs")) for m in experience)
    assert max(run.series("kl/reward_penalty")) > 0
    assert run.steps[-1]["actor/kl_loss"] > 0  # the learner's KL loss read the critic's
    built = run.events("learner-0", "trainer_built")
    assert built and not any(e["reference"] for e in built)


def case_entropy_bonus(tmp_path: Path) -> None:
    run = run_pipeline(tmp_path, GRPO, {"algorithm.entropy_coef": "0.2"})
    for step in run.steps:
        expected = step["actor/pg_loss"] - 0.2 * step["actor/entropy"]
        assert step["actor/loss"] == pytest.approx(expected, rel=1e-4, abs=1e-6)
        assert step["actor/entropy"] > 0.01


def case_dual_clip(tmp_path: Path) -> None:
    overrides = {"algorithm.clip_ratio_c": "1.01", "controller.max_staleness": "2"}
    run = run_pipeline(tmp_path, GRPO, {**overrides, "controller.steps": "8"})
    assert max(run.series("actor/clip_frac_lower")) > 0
    off = _first_batch_loss(run, clip_ratio_c=None)
    assert off["actor/clip_frac_lower"] == 0


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
def case_loss_aggregation(tmp_path: Path, mode: str) -> None:
    run = run_pipeline(tmp_path, GRPO, {"algorithm.loss_agg_mode": mode})
    logged = run.steps[0]["actor/pg_loss"]
    for other in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"):
        again = _first_batch_loss(run, loss_agg_mode=other)["actor/pg_loss"]
        if other == mode:
            assert logged == pytest.approx(again, rel=1e-4, abs=1e-7)
        else:
            assert abs(logged - again) > 1e-5, other


def case_striped_sync_fsdp_2(tmp_path: Path) -> None:
    run = run_pipeline(
        tmp_path,
        GRPO,
        {
            "services.learner.fsdp_size": "2",  # two learner ranks: striped senders
            # several buckets, so that each rank has a stripe of its own to send
            "learner.weights.bucket_mb": "0.02",
            "controller.max_staleness": "0",
            "controller.steps": "4",
        },
    )
    syncs = run.events("learner-0", "weight_sync")
    assert syncs and all(e["striped"] for e in syncs)
    assert all(e["buckets"] >= 2 for e in syncs)
    senders = {e.get("rank") for e in run.events("learner-0", "weight_stripe_sent")}
    assert senders == {0, 1}, senders
    # synchronous: every step's samples came from the weights the learner had: the
    # engine's log-probs are the learner's (the update arrived whole from both stripes)
    assert all(s["mismatch/kl"] < 1e-4 for s in run.steps), run.series("mismatch/kl")


def _recorded(path: Path) -> int:
    """Records written so far to a queue log that is still being appended to."""
    count = 0
    try:
        for _ in QueueReader(path):
            count += 1
    except Exception:  # the record being written
        pass
    return count


def _pause_rollout(
    seconds: float, at_groups: int
) -> Callable[[subprocess.Popen[bytes], Path], None]:
    """SIGSTOP rollout replica 1 once both engines are in the weight group and the learner
    holds `at_groups` more groups (a step's worth:
    it trains and publishes next, while the replica has nothing of that step left), for
    longer than the sync's deadlines: the publishes meanwhile leave it out (replica 0 keeps
    the run going where the bound lets it), so what it generates after waking up is
    versions stale."""

    def during(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
        from .test_chaos import _children

        deadline = time.monotonic() + 240
        log = run_dir / "logs/learner-0.log"
        # both engines in the weight group (a late registration rebuilds it, which waits)
        while '"engines": 2' not in (log.read_text() if log.exists() else ""):
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        until = at_groups + _recorded(run_dir / "queues/scored.log")
        while _recorded(run_dir / "queues/scored.log") < until:
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.005)
        pid = next(
            p
            for p, cmd in _children(proc.pid).items()
            if "services.rollout " in cmd and "--replica 1" in cmd
        )
        os.kill(pid, signal.SIGSTOP)
        time.sleep(seconds)
        os.kill(pid, signal.SIGCONT)

    return during


# every process of the run takes short deadlines for the weight group and the metadata
# round (module constants): tests/run_patches_site patches them in
SHORT_SYNC = patch_vars("short_sync")


@pytest.mark.parametrize("bound", [0, 1, 2])
def case_staleness(tmp_path: Path, bound: int) -> None:
    run = run_pipeline(
        tmp_path,
        GRPO,
        {
            "controller.max_staleness": str(bound),
            "controller.steps": "12",
            "services.rollout.replicas": "2",
            # a paused replica is slow, not dead: its prompts stay with it
            "queues.peer_timeout_s": "60",
            # a step of several epochs: the pause lands before its publish even when this
            # machine is busy and the watch loop late
            "learner.trainer.ppo_epochs": "6",
        },
        during=_pause_rollout(8.0, at_groups=4 * (bound + 1)),
        env=SHORT_SYNC,  # the group's 2 s, the metadata's, a bucket's and an apply's 1 s
    )
    worst = _versions_within_bound(run, bound)
    assert run.summary["dropped"] > 0, run.summary
    assert sum(run.series("dropped_stale")) > 0
    assert any(s.get("sync_failed") for s in run.steps)
    if bound > 0:
        assert worst >= 1  # asynchronous: some samples were trained a version late


def case_critic_kill_and_resume(tmp_path: Path) -> None:
    killed: list[int] = []

    def during(proc: subprocess.Popen[bytes], run_dir: Path) -> None:
        from .test_chaos import _service_pid

        deadline = time.monotonic() + 240
        while not (run_dir / "checkpoints/critic/step_2/meta.json").exists():
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.05)
        while (pid := _service_pid(proc.pid, "critic")) is None:
            time.sleep(0.05)
        os.kill(pid, signal.SIGKILL)
        killed.append(pid)

    run = run_pipeline(
        tmp_path, PPO, {"learner.checkpoint_every": "1", "controller.steps": "8"}, during=during
    )
    assert killed
    lines = [json.loads(x) for x in run.log("critic-0").splitlines() if x.startswith("{")]
    events = [e for e in lines if e.get("event") in ("resumed", "critic_step")]
    resumed = [i for i, e in enumerate(events) if e["event"] == "resumed"]
    assert len(resumed) == 1 and events[resumed[0]]["step"] >= 1
    after = [e for e in events[resumed[0] + 1 :] if e["event"] == "critic_step"]
    # the value updates go on from the checkpoint: numbered on, not from 1 again
    assert after and after[0]["step"] == events[resumed[0]]["step"] + 1
    assert [e["step"] for e in after] == list(range(after[0]["step"], after[-1]["step"] + 1))
    # the value head starts at zero: only the groups valued before the first update carry
    # zero values; a restart from a fresh model instead of the checkpoint would add more
    fresh = {
        m.body.uid
        for m in run.queue("experience")
        if all(np.all(v == 0) for v in _tensors(m, "values"))
    }
    assert len(fresh) == int(BASE["controller.prompts_per_step"]), sorted(fresh)
    assert _critic_checkpoint(run)["extra"]["steps"] == after[-1]["step"]


def case_compiled_without_recompiles(tmp_path: Path) -> None:
    """Learner and critic compiled (aot_eager: dynamo's frames and guards without kernels),
    warmed up at start: the toy task's responses end at EOS, so every step packs other
    lengths, and none recompiles."""
    # on CPU, kernels "auto" compiles the blocks with this backend (packed micro-batches)
    compiled = patch_vars("compiled_cpu")
    run = run_pipeline(tmp_path, PPO, {"controller.steps": "8"}, env=compiled)
    assert run.events("learner-0", "warmed_up") and run.events("critic-0", "warmed_up")
    lengths = {round(s["response_len_mean"], 3) for s in run.steps}
    assert len(lengths) > 3, lengths  # the lengths did vary
    assert all(s["compile/frames"] > 0 for s in run.steps)
    assert all(s["compile/recompiles"] == 0 for s in run.steps), run.series("compile/recompiles")
    assert all(s["critic/recompiles"] == 0 for s in run.steps)
    assert all(s["rollout/recompiles"] == 0 for s in run.steps)  # the CPU engine compiles none
    assert any(s["response_len_min"] < s["response_len_max"] for s in run.steps)


CASES: dict[str, Callable[..., None]] = {
    name[len("case_") :]: fn for name, fn in dict(globals()).items() if name.startswith("case_")
}
# a case's name (all its variants) or one variant's id. loss_aggregation: one mode other
# than the default runs in make test (the setting reaches the learner the same way for
# each; tests/algorithms/test_aggregation.py checks each mode's arithmetic), and each run
# recomputes its first step under all three modes; the other two runs are slow
FAST = {
    "critic_batches",
    "kl_in_reward_adaptive",
    "vtrace_staleness_2",
    "reference_service",
    "loss_aggregation[seq-mean-token-mean]",
}


def _params(fast: bool) -> list[Any]:
    out = []
    for name, fn in CASES.items():
        marks = getattr(fn, "pytestmark", [])
        variants = [m.args for m in marks if m.name == "parametrize"]
        if variants:
            argname, values = variants[0]
            for value in values:
                id = f"{name}[{value}]"
                if (name in FAST or id in FAST) == fast:
                    out.append(pytest.param(name, {argname: value}, id=id))
        elif (name in FAST) == fast:
            out.append(pytest.param(name, {}, id=name))
    return out


@pytest.mark.parametrize(("case", "kwargs"), _params(fast=True))
def test_feature_fast(tmp_path: Path, case: str, kwargs: dict[str, Any]) -> None:
    CASES[case](tmp_path, **kwargs)


@pytest.mark.slow
@pytest.mark.parametrize(("case", "kwargs"), _params(fast=False))
def test_feature_slow(tmp_path: Path, case: str, kwargs: dict[str, Any]) -> None:
    CASES[case](tmp_path, **kwargs)


def test_every_case_is_collected_once() -> None:
    ids = [p.id for p in _params(True) + _params(False)]
    assert len(ids) == len(set(ids)) == 25
