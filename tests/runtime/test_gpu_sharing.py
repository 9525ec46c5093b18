"""Which GPU sharing a run gets (runtime/gpu_sharing.py): MPS where services share a GPU and
the MPS tools run, turns where asked for, time-slicing otherwise, with the reason."""

from __future__ import annotations

import shutil

import pytest

from pipeline.config.profile import load_config
from pipeline.errors import ConfigError
from pipeline.runtime.gpu_sharing import MpsDaemon, choose, shared_gpus, takes_turns


def _found(name: str) -> str:
    return f"/usr/bin/{name}"


def test_one_gpu_profile_shares_its_gpu_under_mps():
    config = load_config("profiles/h200-single.toml", {"run.gpu_sharing": "mps"})
    assert shared_gpus(config) == {"127.0.0.1:0": ["rollout-0", "critic-0", "learner-0"]}
    sharing = choose(config, which=_found, environ={})
    assert sharing.mode == "mps"
    assert "127.0.0.1:0 (rollout-0 critic-0 learner-0)" in sharing.reason
    sharing.directory = "/tmp/x"
    rollout: dict[str, str] = {}
    sharing.apply(rollout, "rollout")
    assert rollout["CUDA_MPS_PIPE_DIRECTORY"] == "/tmp/x/pipe"
    assert rollout["CUDA_MPS_LOG_DIRECTORY"] == "/tmp/x/log"


def test_a_daemon_that_runs_already_is_used(tmp_path):
    (tmp_path / "control").touch()
    config = load_config("profiles/h200-single.toml")
    sharing = choose(
        config, which=lambda name: None, environ={"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}
    )
    assert sharing.mode == "mps" and sharing.running == str(tmp_path)
    env: dict[str, str] = {}
    sharing.apply(env, "rollout")
    assert env == {"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path)}


def test_auto_takes_mps_where_generation_runs_beside_training_and_says_why():
    """Staleness >= 1 on a shared GPU: MPS, the trainers below normal priority
    (docs/performance.md); staleness 0 or no shared GPU: time-slicing; turns only where
    asked for, without an MPS environment."""
    config = load_config("profiles/h200-single.toml")
    sharing = choose(config, which=_found, environ={})
    assert sharing.mode == "mps" and sharing.priorities == {"critic": 1, "learner": 1}
    assert not takes_turns(config)
    sharing.directory = "/tmp/x"
    env: dict[str, str] = {}
    sharing.apply(env, "learner")
    assert env["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    turns = load_config("profiles/h200-single.toml", {"run.gpu_sharing": "turns"})
    taking = choose(turns, which=_found, environ={})
    assert (taking.mode, taking.reason) == ("turns", "run.gpu_sharing = turns")
    assert takes_turns(turns)
    env = {}
    taking.apply(env, "rollout")
    assert env == {}
    sync = load_config("profiles/h200-single.toml", {"controller.max_staleness": "0"})
    sync_sharing = choose(sync, which=_found, environ={})
    assert sync_sharing.mode == "time-slice" and "staleness 0" in sync_sharing.reason
    env = {}
    sync_sharing.apply(env, "learner")
    assert env == {}
    assert choose(sync, which=lambda name: None, environ={}).mode == "time-slice"
    cpu_config = load_config("profiles/local-cpu.toml")
    cpu = choose(cpu_config, which=_found)
    assert (cpu.mode, cpu.reason) == ("time-slice", "no GPU is shared by two services")
    asked = load_config("profiles/local-cpu.toml", {"run.gpu_sharing": "turns"})
    assert takes_turns(asked) and choose(asked, which=_found).mode == "turns"
    two = load_config("profiles/h200-x2.toml")
    assert choose(two, which=_found, environ={}).mode == "time-slice"


def test_mps_asked_for_where_it_cannot_run_is_refused():
    config = load_config("profiles/h200-single.toml", {"run.gpu_sharing": "mps"})
    with pytest.raises(ConfigError, match="not on PATH"):
        choose(config, which=lambda name: None, environ={})
    with pytest.raises(ConfigError, match="no GPU is shared"):
        choose(load_config("profiles/local-cpu.toml", {"run.gpu_sharing": "mps"}))


@pytest.mark.skipif(shutil.which("nvidia-cuda-mps-control") is not None, reason="MPS here")
def test_a_daemon_that_does_not_start_leaves_time_slicing_or_refuses():
    config = load_config("profiles/h200-single.toml", {"run.gpu_sharing": "mps"})
    daemon = MpsDaemon(choose(config, which=_found), {})
    fallback = daemon.start(required=False)
    assert fallback.mode == "time-slice" and "failed" in fallback.reason
    assert not daemon.started
    with pytest.raises(ConfigError, match="-d failed"):
        MpsDaemon(choose(config, which=_found), {}).start(required=True)


def test_a_role_below_normal_priority_gets_the_mps_client_priority_and_no_other_role_does():
    overrides = {
        "services.learner.gpu_priority": "below_normal",
        "services.critic.gpu_priority": "normal",
        "run.gpu_sharing": "mps",
    }
    sharing = choose(load_config("profiles/h200-single.toml", overrides), which=_found, environ={})
    sharing.directory = "/tmp/x"
    learner: dict[str, str] = {}
    sharing.apply(learner, "learner")
    critic = rollout = {"CUDA_MPS_CLIENT_PRIORITY": "1"}  # inherited: not theirs
    sharing.apply(rollout, "rollout")
    sharing.apply(critic, "critic")
    assert learner["CUDA_MPS_CLIENT_PRIORITY"] == "1"
    assert "CUDA_MPS_CLIENT_PRIORITY" not in rollout and "CUDA_MPS_CLIENT_PRIORITY" not in critic
    with pytest.raises(ConfigError, match="gpu_priority"):
        load_config("profiles/h200-single.toml", {"services.learner.gpu_priority": "high"})
