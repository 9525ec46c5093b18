"""`pipeline service ROLE --pool POOL`: one replica placed on another pool of the profile
(its host and devices), a typed error naming the known pools for a pool that is not one,
and a refusal where the pool's host is not where the run's peers look for that role."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.cli import main
from pipeline.config import load_config
from pipeline.errors import ConfigError, PlacementConflict, UnknownPool
from pipeline.runtime import layout
from pipeline.runtime.cli_args import pin_devices, service_args
from pipeline.transport.security import configure

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _plain_afterwards():
    yield
    configure(None)  # service_args sets this process's CURVE keys


def _profile(tmp_path: Path, transport: str = "ipc") -> Path:
    """rollout on pool `train` (GPUs 0-3 of host .1); `spare` is GPUs 6-7 of the same host,
    `remote` another host."""
    path = tmp_path / "pools.toml"
    path.write_text(
        f"""extends = "{REPO / "profiles/local-cpu.toml"}"
[run]
transport = "{transport}"
controller_port = 29400
allow_insecure = true
[pools.train]
host = "10.0.0.1"
kind = "cuda"
devices = [0, 1, 2, 3]
[pools.spare]
host = "10.0.0.1"
kind = "cuda"
devices = [6, 7]
[pools.remote]
host = "10.0.0.2"
kind = "cuda"
devices = [0, 1]
[services.rollout]
pool = "train"
replicas = 2
devices_per_replica = 1
"""
    )
    return path


def test_pool_places_the_replica_on_that_pools_devices(tmp_path, monkeypatch):
    # the run secret service_args makes goes to tmp_path, not the repository's runs/
    common = ["--profile", str(_profile(tmp_path)), "--run.runs_dir", str(tmp_path)]
    args, config = service_args("rollout", [*common, "--replica", "1"])
    assert config.services["rollout"].pool == "train" and config.devices("rollout", 1) == [1]
    args, config = service_args("rollout", [*common, "--pool", "spare", "--replica", "1"])
    assert args.pool == "spare" and config.services["rollout"].pool == "spare"
    assert config.services["rollout"].devices_per_replica == 1  # the rest of the placement
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    pin_devices(config, "rollout", args.replica)
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "7"
    # its output queue binds on the pool's host (ipc here: the socket dir, host unused)
    tcp = load_config(_profile(tmp_path, "tcp")).placed_on("rollout", "remote")
    assert layout.bind_endpoint(tcp, "rollouts", 0).startswith("tcp://10.0.0.2:")


def test_an_unknown_pool_is_a_typed_error_that_lists_the_pools(tmp_path):
    profile = str(_profile(tmp_path))
    with pytest.raises(UnknownPool) as info:
        service_args("rollout", ["--profile", profile, "--pool", "inference"])
    message = str(info.value)
    assert "'inference'" in message and "['local', 'remote', 'spare', 'train']" in message
    assert isinstance(info.value, ConfigError)


def test_pool_of_an_unplaced_role_says_how_to_place_it(tmp_path):
    with pytest.raises(ConfigError, match=r"add \[services.critic\]"):
        load_config(_profile(tmp_path)).placed_on("critic", "spare")


def test_pool_must_hold_one_replicas_devices(tmp_path):
    config = load_config(
        _profile(tmp_path),
        {"services.rollout.devices_per_replica": "3", "services.rollout.replicas": "1"},
    )
    with pytest.raises(ConfigError, match="devices_per_replica = 3 but pool 'spare' has 2"):
        config.placed_on("rollout", "spare")


def test_pool_on_another_host_needs_the_keys_a_profile_needs(tmp_path):
    overrides = {"run.allow_insecure": "false", "services.rollout.pool": "local"}
    config = load_config(_profile(tmp_path, "tcp"), overrides)  # all on loopback: no keys
    with pytest.raises(ConfigError, match="needs CURVE keys"):
        config.placed_on("rollout", "remote")


def test_the_cli_prints_the_error_and_exits_2(tmp_path, capsys):
    code = main(["service", "reward", "--profile", str(_profile(tmp_path)), "--pool", "nope"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("pipeline service reward: error: --pool 'nope' is not a pool")
    assert "known pools" in err


def test_a_replica_may_not_move_to_a_host_its_peers_do_not_look_on(tmp_path):
    """Consumers and engines find a producer or the learner at the host of the pool the
    run places its role on; another host there would be a replica nobody reaches."""
    run = load_config(_profile(tmp_path, "tcp"))
    assert layout.place_replica(run, "rollout", "spare").services["rollout"].pool == "spare"
    with pytest.raises(PlacementConflict) as info:
        layout.place_replica(run, "rollout", "remote")
    assert "--services.rollout.pool remote" in str(info.value)
    assert "pick a pool on host 10.0.0.1" in str(info.value)
    # a run placed there by the controller accepts it
    moved = load_config(_profile(tmp_path, "tcp"), {"services.rollout.pool": "remote"})
    assert layout.place_replica(moved, "rollout", "remote").services["rollout"].pool == "remote"
    # on one host (ipc) every pool is reachable
    local = load_config(_profile(tmp_path))
    assert layout.place_replica(local, "rollout", "remote").services["rollout"].pool == "remote"
