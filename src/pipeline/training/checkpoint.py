"""Resumable training checkpoints with torch.distributed.checkpoint (DCP).

Layout of `<root>/step_<n>/`:
  dcp/         model + optimizer state (sharded DTensors under FSDP; DCP reshards on load)
  meta.json    step, world size, LR scheduler, trainer counters, the caller's `extra`
  rng/rank_<r>.json   python / numpy / torch (/ cuda) RNG states of each rank
and `<root>/latest` names the newest complete step directory. A save writes a new
directory (`.step_<n>.partial`) and renames it into place only after every rank finished
writing, then replaces `latest` atomically (write + rename): a crash mid-save leaves the
previous checkpoint whole, even when the same step is saved again. A resume takes the
newest checkpoint that loads: one that is damaged is logged and the one before it tried.
Everything besides DCP's own files is JSON; DCP's `.metadata` is a pickle (docs/
architecture.md, security).
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.optim.lr_scheduler import LRScheduler

from pipeline.log import get_logger
from pipeline.training.distributed import barrier, current_dist_info, is_distributed
from pipeline.training.errors import CheckpointError, CheckpointStateError

log = get_logger("training.checkpoint")

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1
_STEP_RE = re.compile(r"^step_(\d+)$")


@dataclass(frozen=True)
class LoadedCheckpoint:
    """What a resume hands back to the caller."""

    step: int
    path: Path
    trainer_state: dict[str, Any]
    extra: dict[str, Any]


def step_dir(root: str | os.PathLike[str], step: int) -> Path:
    return Path(root) / f"step_{step}"


def saved_steps(root: str | os.PathLike[str]) -> list[int]:
    """Steps of the step directories under `root` that hold a meta.json, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = (_STEP_RE.match(p.name) for p in root.iterdir() if (p / META).is_file())
    return sorted((int(m.group(1)) for m in found if m), reverse=True)


def latest_step(root: str | os.PathLike[str]) -> int | None:
    """Step of the newest complete checkpoint under `root`, or None. A `latest` that names
    no step directory (damaged) gives the newest step directory there, with a warning."""
    pointer = Path(root) / LATEST
    if not pointer.is_file():
        return None
    try:
        match = _STEP_RE.match(pointer.read_text().strip())
    except (OSError, UnicodeDecodeError):
        match = None
    if match is not None:
        return int(match.group(1))
    steps = saved_steps(root)
    log.warning("checkpoint_pointer_unreadable", path=str(pointer), newest=steps[:1])
    return steps[0] if steps else None


@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """DCP warns on every single-process save/load even when asked for one explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    with tmp.open("w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def rng_state() -> dict[str, Any]:
    """This process's RNG states as JSON-able values."""
    py_version, py_state, py_gauss = random.getstate()
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()  # type: ignore[misc]
    state: dict[str, Any] = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [
            np_name,
            np.asarray(np_keys).tolist(),
            int(np_pos),
            int(np_has_gauss),
            float(np_gauss),
        ],
        "torch": _b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_unb64(s) for s in state["cuda"]])


def _json(value: Any, what: str) -> str:
    try:
        return json.dumps(value, indent=1, sort_keys=True, allow_nan=True)
    except (TypeError, ValueError) as err:
        raise CheckpointStateError(
            f"{what} must be JSON-serialisable (dicts, lists, str, numbers): {err}"
        ) from err


def save_checkpoint(
    root: str | os.PathLike[str],
    step: int,
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None = None,
    trainer_state: dict[str, Any] | None = None,
    extra: dict[str, Any] | None = None,
    keep_last: int | None = None,
) -> Path:
    """Write `<root>/step_<step>/` and point `latest` at it; every rank must call this.

    `extra` is the caller's opaque JSON state (data cursor, in-flight prompt ids, ...).
    `keep_last` prunes all but the newest that many step directories.
    """
    info = current_dist_info("cpu")
    path = step_dir(root, step)
    meta = {
        "format": FORMAT_VERSION,
        "step": step,
        "world_size": info.world_size,
        "scheduler": None if scheduler is None else scheduler.state_dict(),
        "trainer_state": trainer_state or {},
        "extra": extra or {},
    }
    meta_text = _json(meta, "checkpoint extra/trainer state")
    partial = path.with_name(f".{path.name}.partial")
    if info.is_main:
        shutil.rmtree(partial, ignore_errors=True)  # a save that died before
        (partial / "rng").mkdir(parents=True, exist_ok=True)
    barrier()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    with _single_process_quiet():
        dcp.save(
            {"model": model_sd, "optim": optim_sd},
            checkpoint_id=str(partial / "dcp"),
            no_dist=not is_distributed(),
        )
    _write_atomic(partial / "rng" / f"rank_{info.rank}.json", _json(rng_state(), "rng"))
    if info.is_main:
        _write_atomic(partial / META, meta_text)
    barrier()
    if info.is_main:
        _replace_dir(partial, path)
        _write_atomic(Path(root) / LATEST, f"{path.name}\n")
        if keep_last is not None:
            _prune(Path(root), keep=max(1, keep_last), current=step)
        log.info("checkpoint saved", path=str(path), step=step)
    barrier()
    return path


def _replace_dir(new: Path, path: Path) -> None:
    """`new` renamed to `path`; an existing `path` (the same step saved again) is moved
    aside first and removed after, so one whole copy exists at every instant."""
    old = path.with_name(f".{path.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if path.exists():
        os.replace(path, old)
    os.replace(new, path)
    shutil.rmtree(old, ignore_errors=True)


def _prune(root: Path, keep: int, current: int) -> None:
    steps = sorted(
        int(m.group(1)) for p in root.iterdir() if (m := _STEP_RE.match(p.name)) and p.is_dir()
    )
    for old in steps[:-keep]:
        if old != current:
            shutil.rmtree(step_dir(root, old), ignore_errors=True)


def load_checkpoint(
    root: str | os.PathLike[str],
    *,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None = None,
    step: int | None = None,
    restore_rng: bool = True,
) -> LoadedCheckpoint:
    """Restore model, optimizer, scheduler and RNG in place from `latest` (or `step`); where
    that one does not load (damaged, incomplete), from the newest older one that does,
    each failure logged (`checkpoint_unreadable`). CheckpointError when none loads.

    The world size may differ from the saving run's (DCP reshards); RNG states are then
    restored only for ranks that existed, with a warning.
    """
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointStateError(
                f"no checkpoint under {root}: {Path(root) / LATEST} is missing"
            )
    candidates = [step, *(s for s in saved_steps(root) if s < step)]
    tried: list[tuple[str, str]] = []
    for candidate in candidates:
        path = step_dir(root, candidate)
        try:
            return _load_one(path, model, optimizer, scheduler, restore_rng)
        # DCP raises CheckpointException, a BaseException, for a damaged file; a damaged
        # file may raise anything else while it is read
        except (CheckpointException, Exception) as exc:
            lines = str(exc).strip().splitlines()
            reason = f"{type(exc).__name__}: {lines[-1] if lines else ''}"
            tried.append((str(path), reason))
            log.warning("checkpoint_unreadable", path=str(path), reason=reason)
    raise CheckpointError(str(root), tried)


def _load_one(
    path: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: LRScheduler | None,
    restore_rng: bool,
) -> LoadedCheckpoint:
    info = current_dist_info("cpu")
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointStateError(f"{meta_file} is missing; the checkpoint is incomplete")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointStateError(
            f"{meta_file} has format {meta.get('format')!r}, this code reads {FORMAT_VERSION}"
        )
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not is_distributed())
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng:
        rng_file = path / "rng" / f"rank_{info.rank}.json"
        if rng_file.is_file():
            set_rng_state(json.loads(rng_file.read_text()))
        else:
            log.warning("no RNG state for this rank; keeping the current one", rank=info.rank)
    if meta.get("world_size") != info.world_size:
        log.warning(
            "resuming with a different world size",
            saved=meta.get("world_size"),
            now=info.world_size,
        )
    return LoadedCheckpoint(
        step=int(meta["step"]),
        path=path,
        trainer_state=dict(meta.get("trainer_state") or {}),
        extra=dict(meta.get("extra") or {}),
    )
