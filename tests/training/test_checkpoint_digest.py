"""A resume verifies a checkpoint's digest before anything reads it back (issue 33, defect 4:
DCP unpickles `.metadata` and torch.loads non-tensor items, so a crafted checkpoint file
ran code on resume). A checkpoint that fails its digest is damaged: the one before is
loaded. With a run secret the digest is an HMAC, so files swapped by someone who cannot
read the secret, digest and all, are refused too."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import CriticTrainer, PolicyTrainer, TrainerConfig, load_checkpoint
from pipeline.training.errors import CheckpointError
from pipeline.transport import security

from ._helpers import make_batch, save_tiny_model, state_of
from .test_damaged_checkpoint import _two_checkpoints

CONFIG = TrainerConfig(device="cpu", lr=1e-3)
SECRET = "ab" * 32
OTHER_SECRET = "cd" * 32


class _Touch:
    """Unpickling this creates `path`: stands for any code a crafted pickle runs."""

    def __init__(self, path: Path) -> None:
        self.path = str(path)

    def __reduce__(self):
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("digest") / "model")


@pytest.fixture
def run_secret() -> Iterator[None]:
    """This process has a run secret (as every service has) for the test's duration."""
    before = security.current()
    security.configure(None, run_secret=SECRET)
    try:
        yield
    finally:
        security.configure(before.keys_dir, before.allow_insecure, before.run_secret)


def _resumes_at_one(model_dir: Path, root: Path, at_one: dict[str, torch.Tensor]) -> None:
    fresh = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    loaded = fresh.load_checkpoint(root)
    assert loaded.step == 1 and fresh.step == 1
    for name, value in state_of(fresh.model).items():
        torch.testing.assert_close(value, at_one[name], rtol=0, atol=0, msg=name)


def _reasons(model_dir: Path, root: Path) -> dict[str, str]:
    """Why each checkpoint under `root` was refused (every one must be)."""
    fresh = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    with pytest.raises(CheckpointError) as caught:
        fresh.load_checkpoint(root)
    return {Path(p).name: reason for p, reason in caught.value.tried}


def _data_file(step: Path) -> Path:
    (data,) = (step / "dcp").glob("*.distcp")
    return data


def _flip_byte(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01  # a tensor byte: DCP itself notices nothing
    path.write_bytes(bytes(raw))


def test_a_metadata_pickle_that_runs_code_is_refused_before_it_is_unpickled(
    model_dir: Path, tmp_path: Path
):
    root = tmp_path / "ckpt"
    at_one = _two_checkpoints(model_dir, root)
    marker = tmp_path / "pwned"
    (root / "step_2" / "dcp" / ".metadata").write_bytes(pickle.dumps(_Touch(marker)))
    _resumes_at_one(model_dir, root, at_one)
    assert not marker.exists(), "the crafted .metadata was unpickled"


def test_a_changed_data_byte_is_refused(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    at_one = _two_checkpoints(model_dir, root)
    _flip_byte(_data_file(root / "step_2"))
    _resumes_at_one(model_dir, root, at_one)
    _flip_byte(_data_file(root / "step_1"))
    reasons = _reasons(model_dir, root)
    assert sorted(reasons) == ["step_1", "step_2"]
    assert all(".distcp" in r and "changed" in r for r in reasons.values()), reasons


def test_an_added_or_removed_file_is_refused(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    at_one = _two_checkpoints(model_dir, root)
    (root / "step_2" / "rng" / "rank_0.json").unlink()  # the load only warns without it
    _resumes_at_one(model_dir, root, at_one)
    (root / "step_1" / "dcp" / "__9_0.distcp").write_bytes(b"planted")
    reasons = _reasons(model_dir, root)
    assert "rng/rank_0.json" in reasons["step_2"] and "missing" in reasons["step_2"]
    assert "dcp/__9_0.distcp" in reasons["step_1"] and "not in" in reasons["step_1"]


def test_the_digest_lists_every_file_of_the_step(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    step = root / "step_2"
    digest = json.loads((step / "digest.json").read_text())
    assert digest["key"] == "sha256"  # no run secret in unit tests: damage is caught
    files = {
        str(p.relative_to(step)) for p in step.rglob("*") if p.is_file() and p.name != "digest.json"
    }
    assert set(digest["files"]) == files and "dcp/.metadata" in files
    for name, entry in digest["files"].items():
        assert entry["size"] == (step / name).stat().st_size


def test_a_checkpoint_without_a_digest_is_refused_unless_allowed(
    model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    for step in ("step_1", "step_2"):  # as written before digests existed
        (root / step / "digest.json").unlink(missing_ok=True)
    reasons = _reasons(model_dir, root)
    for reason in reasons.values():
        assert "digest.json is missing" in reason, reason
        assert "PIPELINE_CHECKPOINT_ALLOW_UNVERIFIED=1" in reason, reason
    trainer = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    loaded = load_checkpoint(
        root, model=trainer.model, optimizer=trainer.engine.optimizer, allow_unverified=True
    )
    assert loaded.step == 2
    monkeypatch.setenv("PIPELINE_CHECKPOINT_ALLOW_UNVERIFIED", "1")
    assert CriticTrainer(model_dir, CONFIG, AlgorithmConfig()).load_checkpoint(root).step == 2


def test_with_a_run_secret_the_digest_is_keyed_and_round_trips(
    model_dir: Path, tmp_path: Path, run_secret: None
):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    assert json.loads((root / "step_2" / "digest.json").read_text())["key"] == "hmac-sha256"
    assert CriticTrainer(model_dir, CONFIG, AlgorithmConfig()).load_checkpoint(root).step == 2


def test_a_step_swapped_in_without_the_run_secret_is_refused(
    model_dir: Path, tmp_path: Path, run_secret: None
):
    """Someone who can write the checkpoints but not read run.secret puts in a step made
    elsewhere, with a digest that matches its files: unkeyed, or keyed with another secret."""
    root = tmp_path / "ckpt"
    at_one = _two_checkpoints(model_dir, root)
    for name, secret in (("unkeyed", None), ("other", OTHER_SECRET)):
        security.configure(None, run_secret=secret)
        _two_checkpoints(model_dir, tmp_path / name)
    security.configure(None, run_secret=SECRET)
    for name, why in (("unkeyed", "without the run secret"), ("other", "another run secret")):
        forged = tmp_path / name
        shutil.rmtree(root / "step_2")
        shutil.copytree(forged / "step_2", root / "step_2")
        _resumes_at_one(model_dir, root, at_one)
        shutil.rmtree(root / "step_1")
        shutil.copytree(forged / "step_1", root / "step_1")
        reasons = _reasons(model_dir, root)
        assert sorted(reasons) == ["step_1", "step_2"]
        assert all(why in r for r in reasons.values()), reasons
        shutil.rmtree(root)
        at_one = _two_checkpoints(model_dir, root)


def test_a_keyed_checkpoint_is_refused_without_the_secret(
    model_dir: Path, tmp_path: Path, run_secret: None
):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    security.configure(None, run_secret=None)
    reasons = _reasons(model_dir, root)
    assert all("run secret" in r for r in reasons.values()), reasons


# -- two ranks: rank 0 checks, every rank follows its verdict -----------------------------

WORLD = 2


def _worker(rank: int, rendezvous: str, root: str, phase: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=WORLD)
    try:
        out = Path(root)
        trainer = PolicyTrainer(out / "model", CONFIG, AlgorithmConfig())
        if phase == "save":
            for s in range(2):
                trainer.train_step(make_batch(seed=s).shard(rank, WORLD))
                trainer.save_checkpoint(out / "ckpt", extra={"step": s + 1})
        else:
            loaded = trainer.load_checkpoint(out / "ckpt")
            (out / f"loaded_{rank}.json").write_text(json.dumps(loaded.extra))
    finally:
        dist.destroy_process_group()
    os._exit(0)  # past the work: c10d's threads can abort interpreter teardown


def test_two_ranks_fall_back_together_from_a_changed_file(tmp_path: Path):
    save_tiny_model(tmp_path / "model")
    mp.spawn(_worker, args=(str(tmp_path / "rdzv-save"), str(tmp_path), "save"), nprocs=WORLD)
    step = tmp_path / "ckpt" / "step_2"
    assert len(list((step / "dcp").glob("*.distcp"))) == WORLD
    _flip_byte(sorted((step / "dcp").glob("*.distcp"))[-1])  # rank 1's file
    mp.spawn(_worker, args=(str(tmp_path / "rdzv-load"), str(tmp_path), "load"), nprocs=WORLD)
    for rank in range(WORLD):
        assert json.loads((tmp_path / f"loaded_{rank}.json").read_text()) == {"step": 1}
