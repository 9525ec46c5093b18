"""Profiles, overrides and load-time validation."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.config import config_from_json, config_to_json, load_config, parse_override_args
from pipeline.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
PROFILES = sorted((REPO / "profiles").glob("*.toml"))


@pytest.mark.parametrize("profile", PROFILES, ids=lambda p: p.name)
def test_every_profile_loads_and_round_trips(profile):
    config = load_config(profile)
    assert config_from_json(config_to_json(config)) == config


def test_dotted_overrides_are_typed():
    config = load_config(
        REPO / "profiles/local-cpu.toml",
        parse_override_args(["--learner.trainer.lr", "1e-6", "--controller.max_staleness=0"]),
    )
    assert config.learner.trainer.lr == 1e-6
    assert config.controller.max_staleness == 0


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ({"learner.trainer.lrr": "1"}, "did you mean 'lr'"),
        ({"rollout.engine": "nope"}, "one of ['torch', 'hf', 'vllm']"),
        ({"controller.max_staleness": "-1"}, "0 = synchronous PPO"),
        ({"services.rollout.pool": "gpu"}, "define [pools.gpu]"),
        ({"controller.steps": "'ten'"}, "must be an integer"),
        ({"algorithm.lam": "1.5"}, "algorithm.lam"),
        ({"controller.step_timeout_s": "0"}, "step_timeout_s must be > 0"),
        ({"controller.first_step_timeout_s": "-1"}, "first_step_timeout_s >= 0"),
        ({"environment.max_turns": "0"}, "environment.max_turns"),
        ({"environment.workers": "0"}, "environment.workers"),
        ({"environment.step_timeout_s": "0"}, "environment.step_timeout_s > 0"),
        ({"reward.function": "'environment'"}, "set environment.name"),
        ({"environment.nmae": "'toy_lookup'"}, "did you mean 'name'"),
    ],
)
def test_validation_errors_say_how_to_fix(override, message):
    with pytest.raises(ConfigError) as info:
        load_config(REPO / "profiles/local-cpu.toml", override)
    assert message in str(info.value)


def test_missing_profile_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.toml")


def test_profile_extends_another(tmp_path):
    (tmp_path / "base.toml").write_text("[controller]\nsteps = 7\nprompts_per_step = 3\n")
    (tmp_path / "child.toml").write_text('extends = "base.toml"\n[controller]\nsteps = 9\n')
    config = load_config(tmp_path / "child.toml")
    assert (config.controller.steps, config.controller.prompts_per_step) == (9, 3)


def test_cli_help_answers_in_under_a_second():
    subprocess.run([sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True)  # warm
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "--help"], capture_output=True, text=True
    )
    elapsed = time.monotonic() - start
    assert proc.returncode == 0 and "replay" in proc.stdout
    assert elapsed < 1.0, elapsed


def test_resolved_config_is_written_to_the_run_dir(tmp_path):
    from pipeline.config import write_resolved

    config = load_config(REPO / "profiles/local-cpu.toml")
    path = write_resolved(config, tmp_path)
    assert json.loads(path.read_text())["controller"]["steps"] == config.controller.steps


def test_learner_takes_the_samplers_temperature():
    from pipeline.training.config import policy_config

    config = load_config(
        REPO / "profiles/local-cpu.toml", parse_override_args(["--rollout.temperature", "0.7"])
    )
    assert policy_config(config).temperature == 0.7
    greedy = load_config(
        REPO / "profiles/local-cpu.toml", parse_override_args(["--rollout.temperature", "0"])
    )
    assert policy_config(greedy).temperature == 1.0


def test_a_trainer_computes_on_the_kind_of_its_services_pool():
    from pipeline.training.config import critic_config, policy_config, role_device

    assert policy_config(load_config(REPO / "profiles/local-cpu.toml")).device == "cpu"
    learner_on_gpu = {"pools.gpu.kind": "cuda", "services.learner.pool": "gpu"}
    config = load_config(REPO / "profiles/local-cpu-ppo.toml", learner_on_gpu)
    assert role_device(config, "learner") == "cuda"
    # the critic's own pool decides, not the learner's
    assert critic_config(config).device == "cpu"
    with pytest.raises(ConfigError, match=r"unknown config key 'learner\.trainer\.device'"):
        load_config(REPO / "profiles/local-cpu.toml", {"learner.trainer.device": "cpu"})


def test_devices_follow_the_pools_and_decide_the_weight_transport():
    from pipeline.weights.link import publish_config

    single = load_config("profiles/h200-single.toml")
    assert single.devices("rollout") == [0] and single.devices("learner") == [0]
    assert single.devices("reward") == []  # a CPU pool pins nothing
    assert single.shares_device("rollout", "learner")
    assert publish_config(single).transport == "cuda_ipc"  # NCCL cannot share one GPU
    two = load_config("profiles/h200-x2.toml")
    assert two.devices("rollout") == [0] and two.devices("learner") == [1]
    assert two.devices("critic") == [1]
    assert not two.shares_device("rollout", "learner")
    assert publish_config(two).transport == "auto"  # NCCL between the GPUs
    node = load_config("profiles/node-8gpu.toml")
    per = node.services["rollout"].devices_per_replica
    slices = [node.devices("rollout", r) for r in range(node.replicas("rollout"))]
    assert all(len(s) == per for s in slices)
    assert len({d for s in slices for d in s}) == per * len(slices)  # replicas never overlap
    assert publish_config(load_config("profiles/local-cpu.toml")).transport == "auto"
    assert node.devices("rollout", 1) == [2, 3] and node.ranks_per_replica("rollout") == 2


def test_two_roles_on_one_nodes_pool_take_disjoint_gpus_by_first_device():
    hetero = load_config("profiles/hetero-pools.toml")
    assert hetero.services["critic"].pool == hetero.services["learner"].pool == "training"
    assert hetero.devices("learner") == [0, 1, 2, 3, 4, 5]
    assert hetero.devices("critic") == [6, 7]
    assert not hetero.shares_device("critic", "learner")
    # the engines: four TP replicas of two GPUs, every GPU of the node used once
    slices = [hetero.devices("rollout", r) for r in range(hetero.replicas("rollout"))]
    assert sorted(d for s in slices for d in s) == list(range(8))
    with pytest.raises(ConfigError, match="first_device"):
        load_config(
            "profiles/hetero-pools.toml",
            parse_override_args(["--services.critic.first_device", "7"]),
        )


def test_a_service_sees_only_its_replica_devices(monkeypatch):
    from pipeline.runtime.cli_args import pin_devices

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")
    node = load_config("profiles/node-8gpu.toml")
    pin_devices(node, "rollout", 1)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, node.devices("rollout", 1)))
    pin_devices(node, "reward", 0)  # CPU pool: left as it was
    assert os.environ["CUDA_VISIBLE_DEVICES"] == ",".join(map(str, node.devices("rollout", 1)))
