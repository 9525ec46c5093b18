"""A damaged latest checkpoint does not end a run: the resume takes the newest one that
loads, and says which it could not; with none loadable a typed CheckpointError names each
(issue 33, defect 3: DCP's CheckpointException, a BaseException, crashed the service, and
a damaged meta.json gave a bare JSONDecodeError). Saving a step again replaces it whole."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from pipeline.algorithms import AlgorithmConfig
from pipeline.training import CriticTrainer, TrainerConfig, latest_step
from pipeline.training.errors import CheckpointError

from ._helpers import make_batch, save_tiny_model, state_of

CONFIG = TrainerConfig(device="cpu", lr=1e-3)


def _truncate(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGE = {
    "tensor data cut": lambda d: [_truncate(p) for p in (d / "dcp").glob("*.distcp")],
    "dcp metadata garbled": lambda d: (d / "dcp" / ".metadata").write_bytes(b"\x80\x04junk"),
    "dcp metadata gone": lambda d: (d / "dcp" / ".metadata").unlink(),
    "meta.json cut": lambda d: _truncate(d / "meta.json"),
    "tensor data gone": lambda d: [p.unlink() for p in (d / "dcp").glob("*.distcp")],
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("damaged") / "model")


def _two_checkpoints(model_dir: Path, root: Path) -> dict[str, torch.Tensor]:
    """Steps 1 and 2 saved; the weights at step 1."""
    trainer = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    batch, _ = trainer.compute_advantages(make_batch(seed=0, advantages=False))
    trainer.train_step(batch)
    trainer.save_checkpoint(root)
    at_one = state_of(trainer.model)
    trainer.train_step(batch)
    trainer.save_checkpoint(root)
    return at_one


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_latest_falls_back_to_the_one_before(model_dir: Path, tmp_path: Path, damage):
    root = tmp_path / "ckpt"
    at_one = _two_checkpoints(model_dir, root)
    DAMAGE[damage](root / "step_2")
    fresh = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    loaded = fresh.load_checkpoint(root, step=latest_step(root))
    assert loaded.step == 1 and fresh.step == 1
    for name, value in state_of(fresh.model).items():
        torch.testing.assert_close(value, at_one[name], rtol=0, atol=0, msg=name)


def test_with_every_checkpoint_damaged_the_error_names_each(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    for step in (1, 2):
        DAMAGE["dcp metadata garbled"](root / f"step_{step}")
    fresh = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    with pytest.raises(CheckpointError) as caught:
        fresh.load_checkpoint(root)
    assert [Path(p).name for p, _ in caught.value.tried] == ["step_2", "step_1"]
    assert str(root / "step_2") in str(caught.value)


def test_a_damaged_latest_pointer_gives_the_newest_step(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    _two_checkpoints(model_dir, root)
    (root / "latest").write_bytes(b"\xff\xfe")
    assert latest_step(root) == 2


def test_saving_a_step_again_replaces_it_whole(model_dir: Path, tmp_path: Path):
    root = tmp_path / "ckpt"
    trainer = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    batch, _ = trainer.compute_advantages(make_batch(seed=0, advantages=False))
    trainer.train_step(batch)
    first = trainer.save_checkpoint(root, extra={"n": 1})
    files = {p.name for p in (first / "dcp").iterdir()}
    second = trainer.save_checkpoint(root, extra={"n": 2})  # the run's end saves step 1 again
    assert second == first and {p.name for p in (second / "dcp").iterdir()} == files
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]  # nothing left over
    fresh = CriticTrainer(model_dir, CONFIG, AlgorithmConfig())
    assert fresh.load_checkpoint(root).extra == {"n": 2}
