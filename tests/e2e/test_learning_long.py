"""The toy task learns to the end of a run: under a generous response limit on CPU, and on
the GPU profile as committed, GRPO and KL-PPO, synchronous and asynchronous.

Each case is a whole 500-step `pipeline run`: the CPU ones run in `make test-slow`, the GPU
ones in `make test-gpu`. They assert what the README promises of the default runs: the
mean reward over the first 10 steps at most 0.2 and over the last 10 at least 0.75, and,
where engine and learner hold the same weights, that they compute the same log-probs.
"""

from __future__ import annotations

import statistics
from pathlib import Path

import pytest
from bench.e2e_workload import VARIANTS

from tests.e2e.cli_run import cli_run, step_records

# the critic-free variant of a KL-PPO profile (the e2e bench's GRPO preset)
GRPO = tuple(VARIANTS["grpo"])
# every step measures the same-version mismatch (the lagged check, and no reused step)
CHECKED = (
    *("--learner.trainer.mismatch_check_every", "1"),
    *("--learner.trainer.reuse_behaviour_logprobs", "false"),
)


def assert_learned(run: Path) -> list[dict]:
    steps = step_records(run)
    assert len(steps) == 500, len(steps)
    rewards = [s["reward_mean"] for s in steps]
    first, last = statistics.mean(rewards[:10]), statistics.mean(rewards[-10:])
    assert first <= 0.2 and last >= 0.75, (first, last)
    assert all(s.get("actor/skipped_updates", 0) == 0 for s in steps)
    return steps


# issue 53, open: runs settle on one answer length for every prompt (0.55-0.6) in some
# seeds and runs, GRPO and KL-PPO alike (docs/performance.md); each passes once it is fixed
SETTLES = pytest.mark.xfail(reason="issue 53: runs settle near 0.55-0.6", strict=False)


@pytest.mark.slow
@pytest.mark.parametrize(
    "profile, overrides",
    [
        pytest.param("profiles/local-cpu.toml", (), marks=SETTLES, id="grpo"),
        pytest.param("profiles/local-cpu-ppo.toml", (), marks=SETTLES, id="kl-ppo"),
    ],
)
def test_cpu_profiles_learn_under_a_generous_response_limit(
    tmp_path: Path, profile: str, overrides: tuple[str, ...]
) -> None:
    run = cli_run(
        tmp_path,
        "long-limit",
        *("--rollout.max_new_tokens", "256", *overrides),
        profile=profile,
        timeout=1800,
    )
    assert_learned(run)


# issue 53, open: on an H100 the same-version mismatch passed 1e-3 at 2-3 of 500 steps
# (GRPO learned to 0.80 / 0.78, KL-PPO settled at 0.43 / 0.50)
@pytest.mark.gpu
@pytest.mark.xfail(reason="issue 53: KL-PPO settles; mismatch spikes above 1e-3", strict=False)
@pytest.mark.parametrize("staleness", [0, 1])
@pytest.mark.parametrize("variant", ["kl-ppo", "grpo"])
def test_gpu_profile_learns_like_the_cpu_one(tmp_path: Path, variant: str, staleness: int) -> None:
    run = cli_run(
        tmp_path,
        f"gpu-{variant}-s{staleness}",
        *("--controller.max_staleness", str(staleness), *CHECKED),
        *(GRPO if variant == "grpo" else ()),
        profile="profiles/h200-single.toml",
        timeout=1200,
    )
    steps = assert_learned(run)
    measured = [s["mismatch/same_version_kl"] for s in steps if "mismatch/same_version_kl" in s]
    # the first step has no kept weights yet; every later one measures
    assert len(measured) >= len(steps) - 1, len(measured)
    assert max(measured) < 1e-3, max(measured)
