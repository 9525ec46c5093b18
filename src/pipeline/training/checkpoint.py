"""Resumable training checkpoints with torch.distributed.checkpoint (DCP).

Layout of `<root>/step_<n>/`:
  dcp/         model + optimizer state (sharded DTensors under FSDP; DCP reshards on load)
  meta.json    step, world size, LR scheduler, trainer counters, the caller's `extra`
  rng/rank_<r>.json   python / numpy / torch (/ cuda) RNG states of each rank
  digest.json  size and HMAC-SHA256 (keyed with the run's secret; SHA-256 without one) of
               every other file, written by rank 0 once every rank has written
and `<root>/latest` names the newest complete step directory. A save writes a new
directory (`.step_<n>.partial`) and renames it into place only after every rank finished
writing, then replaces `latest` atomically (write + rename): a crash mid-save leaves the
previous checkpoint whole, even when the same step is saved again. A resume takes the
newest checkpoint that loads: one that is damaged is logged and the one before it tried.
Everything besides DCP's own files is JSON; DCP's `.metadata` is a pickle and its data
files may hold torch.save'd items, so a load checks the digest before anything reads the
directory back: a checkpoint that fails it is damaged (docs/architecture.md, security).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import os
import random
import re
import shutil
import stat
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.optim.lr_scheduler import LRScheduler

from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.training.distributed import (
    all_reduce_ints,
    barrier,
    current_dist_info,
    is_distributed,
)
from pipeline.training.errors import CheckpointDigestError, CheckpointError, CheckpointStateError

log = get_logger("training.checkpoint")

LATEST = "latest"
META = "meta.json"
FORMAT_VERSION = 1
DIGEST = "digest.json"
DIGEST_FORMAT = 1
# checkpoints without a usable digest (written before digests existed) load only with it
ALLOW_UNVERIFIED_ENV = "PIPELINE_CHECKPOINT_ALLOW_UNVERIFIED"
_SEGMENT = 64 << 20  # bytes per digest: one rank's single big file still hashes in parallel
_CHUNK = 8 << 20
_HASH_THREADS = max(1, min(8, os.cpu_count() or 1))  # hashlib releases the GIL
_STEP_RE = re.compile(r"^step_(\d+)$")
# frozen parameters (LoRA's base) are not saved: they are the initial weights the trainer
# is built from again, as the reference is. Their keys are missing from the state put back
# (DCP's load already fails on a trained key that the checkpoint lacks)
_LOAD_TRAINED = StateDictOptions(strict=False)


def _trained_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The model's and optimizer's state dicts without frozen parameters (each name of a
    tied one: DCP's own filter keeps a frozen tied output layer)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    frozen = {n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {"model": {k: v for k, v in model_sd.items() if k not in frozen}, "optim": optim_sd}


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
    np_name, np_keys, np_pos, np_has_gauss, np_gauss = np.random.get_state()
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


# -- digest ---------------------------------------------------------------------------------


def _run_key() -> bytes | None:
    # imported here: the training library needs no transport (zmq) until it saves or loads
    from pipeline.transport.security import current

    secret = current().run_secret
    return secret.encode() if secret else None


def _key_id(key: bytes) -> str:
    """Names the key without revealing it: tells 'another run secret' from 'edited'."""
    return hmac.new(key, b"pipeline checkpoint key id", "sha256").hexdigest()[:16]


def _hasher(key: bytes | None) -> Any:
    return hmac.new(key, digestmod="sha256") if key is not None else hashlib.sha256()


def _segment_digest(root: Path, name: str, offset: int, length: int, key: bytes | None) -> str:
    h = _hasher(key)
    h.update(os.fsencode(name) + f"\0{offset}\0".encode())  # binds the bytes to their place
    buf = memoryview(bytearray(min(_CHUNK, length) or 1))
    with (root / name).open("rb", buffering=0) as f:
        f.seek(offset)
        while length > 0:
            n = f.readinto(buf[: min(length, len(buf))])
            if not n:  # shorter than listed: the digest then differs
                break
            h.update(buf[:n])
            length -= n
    return h.hexdigest()


def _file_sizes(root: Path) -> dict[str, int]:
    """Relative path -> size of every file under `root` but the digest; a symlink or any
    other non-regular entry is refused (it could point anywhere)."""
    sizes: dict[str, int] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            entry = Path(dirpath) / name
            mode = entry.lstat().st_mode
            rel = entry.relative_to(root).as_posix()
            if stat.S_ISDIR(mode):
                continue
            if not stat.S_ISREG(mode):
                raise CheckpointDigestError(str(root), f"{rel} is not a regular file")
            if rel != DIGEST:
                sizes[rel] = entry.stat().st_size
    return sizes


def _segments(
    root: Path, sizes: dict[str, int], segment: int, key: bytes | None
) -> dict[str, list[str]]:
    """name -> digests of its `segment`-byte pieces, hashed in a few threads."""
    jobs = [
        (name, offset, min(segment, size - offset))
        for name, size in sorted(sizes.items())
        for offset in range(0, max(size, 1), segment)
    ]
    workers = max(1, min(_HASH_THREADS, len(jobs)))

    def job_digest(job: tuple[str, int, int]) -> str:
        return _segment_digest(root, *job, key)

    with ThreadPoolExecutor(workers, thread_name_prefix="checkpoint-digest") as pool:
        found = list(pool.map(job_digest, jobs))
    out: dict[str, list[str]] = {name: [] for name in sizes}
    for (name, _, _), digest in zip(jobs, found, strict=True):
        out[name].append(digest)
    return out


def _mac(body: dict[str, Any], key: bytes | None) -> str:
    """Over the whole document: an entry dropped or edited (with its file) shows."""
    h = _hasher(key)
    h.update(json.dumps(body, sort_keys=True, separators=(",", ":")).encode())
    return h.hexdigest()


def write_digest(path: Path) -> Path:
    """`path/digest.json` for the files under `path` as they are now (rank 0, once every
    rank has written): keyed with the run's secret where this process has one."""
    key = _run_key()
    sizes = _file_sizes(path)
    digests = _segments(path, sizes, _SEGMENT, key)
    body = {
        "format": DIGEST_FORMAT,
        "key": "sha256" if key is None else "hmac-sha256",
        "key_id": None if key is None else _key_id(key),
        "segment": _SEGMENT,
        "files": {n: {"size": sizes[n], "digests": digests[n]} for n in sorted(sizes)},
    }
    _write_atomic(path / DIGEST, json.dumps({**body, "mac": _mac(body, key)}, indent=1))
    return path / DIGEST


def _unverified(path: Path, allow: bool, why: str) -> None:
    """Refused, unless the caller accepts what cannot be checked (then a warning)."""
    if not allow:
        raise CheckpointDigestError(
            str(path),
            f"{why}; if nobody else could have written it, load it anyway with "
            f"{ALLOW_UNVERIFIED_ENV}=1 (or load_checkpoint(..., allow_unverified=True))",
        )
    log.warning("checkpoint_unverified", path=str(path), reason=why)


def _read_digest(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads((path / DIGEST).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise CheckpointDigestError(str(path), f"{DIGEST} is unreadable: {exc}") from exc
    files = doc.get("files") if isinstance(doc, dict) else None
    well_formed = (
        isinstance(files, dict)
        and doc.get("format") == DIGEST_FORMAT
        and doc.get("key") in ("sha256", "hmac-sha256")
        and isinstance(doc.get("mac"), str)
        and type(doc.get("segment")) is int
        and doc["segment"] >= _CHUNK  # a tiny segment would only cost time
        and all(
            isinstance(e, dict)
            and type(e.get("size")) is int
            and e["size"] >= 0
            and isinstance(e.get("digests"), list)
            for e in files.values()
        )
    )
    if not well_formed:
        raise CheckpointDigestError(str(path), f"{DIGEST} is malformed")
    return doc


def verify_checkpoint(path: str | os.PathLike[str], *, allow_unverified: bool = False) -> None:
    """Check `path` against its digest.json before anything reads it back; a
    CheckpointDigestError says why not. `allow_unverified` accepts, with a warning, a
    checkpoint this process cannot check (no digest; no key, or another, for its HMAC),
    never one whose check fails."""
    path = Path(path)
    if not (path / DIGEST).is_file():
        _unverified(path, allow_unverified, f"{DIGEST} is missing (saved by an older version?)")
        return
    doc = _read_digest(path)
    key = _run_key()
    if doc["key"] == "hmac-sha256":
        if key is None:
            _unverified(
                path, allow_unverified, "it was saved with a run secret, this process has none"
            )
            return
        if doc.get("key_id") != _key_id(key):
            _unverified(path, allow_unverified, "its digest was made with another run secret")
            return
    elif key is not None:
        # anyone can write an unkeyed digest: it vouches for nothing here
        _unverified(path, allow_unverified, "its digest was made without the run secret")
        key = None  # still catches damage
    body = {k: v for k, v in doc.items() if k != "mac"}
    if not hmac.compare_digest(_mac(body, key), doc["mac"]):
        raise CheckpointDigestError(str(path), f"{DIGEST} was edited: its MAC does not match")
    listed: dict[str, Any] = doc["files"]
    sizes = _file_sizes(path)
    if missing := sorted(set(listed) - set(sizes)):
        raise CheckpointDigestError(str(path), f"missing: {', '.join(missing)}")
    if extra := sorted(set(sizes) - set(listed)):
        raise CheckpointDigestError(str(path), f"not in {DIGEST}: {', '.join(extra)}")
    segment = doc["segment"]
    for name in sorted(listed):
        size, n = listed[name]["size"], len(listed[name]["digests"])
        if sizes[name] != size or n != max(1, -(-size // segment)):
            raise CheckpointDigestError(
                str(path), f"{name} changed: {sizes[name]} bytes, {DIGEST} says {size}"
            )
    found = _segments(path, sizes, segment, key)
    for name in sorted(listed):
        if found[name] != listed[name]["digests"]:
            raise CheckpointDigestError(str(path), f"{name} changed: its content differs")


def _allow_unverified_env() -> bool:
    raw = os.environ.get(ALLOW_UNVERIFIED_ENV, "").strip().lower()
    if raw in ("", "0", "false", "no"):
        return False
    if raw in ("1", "true", "yes"):
        return True
    raise ConfigError(f"{ALLOW_UNVERIFIED_ENV}={raw!r}: set it to 1 (accept) or 0")


def _verify_collectively(path: Path, allow_unverified: bool) -> None:
    """Rank 0 checks (one read of the files, not one per rank) and every rank follows its
    verdict: a rank going on alone into DCP's collective load would wait there forever."""
    refusal: CheckpointDigestError | None = None
    if current_dist_info("cpu").is_main:
        try:
            verify_checkpoint(path, allow_unverified=allow_unverified)
        except CheckpointDigestError as exc:
            refusal = exc
        except Exception as exc:  # an unreadable file: refused, still in step with the rest
            refusal = CheckpointDigestError(str(path), f"{type(exc).__name__}: {exc}")
    if all_reduce_ints([int(refusal is not None)], "max")[0]:
        raise refusal or CheckpointDigestError(
            str(path), "rank 0 refused its digest (its checkpoint_unreadable says why)"
        )


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
    with _single_process_quiet():
        dcp.save(
            _trained_state(model, optimizer),
            checkpoint_id=str(partial / "dcp"),
            no_dist=not is_distributed(),
        )
    _write_atomic(partial / "rng" / f"rank_{info.rank}.json", _json(rng_state(), "rng"))
    if info.is_main:
        _write_atomic(partial / META, meta_text)
    barrier()
    if info.is_main:
        started = time.perf_counter()
        write_digest(partial)  # every rank has written: the files are final
        digest_s = round(time.perf_counter() - started, 3)
        _replace_dir(partial, path)
        _write_atomic(Path(root) / LATEST, f"{path.name}\n")
        if keep_last is not None:
            _prune(Path(root), keep=max(1, keep_last), current=step)
        log.info("checkpoint saved", path=str(path), step=step, digest_s=digest_s)
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
    allow_unverified: bool | None = None,
) -> LoadedCheckpoint:
    """Restore model, optimizer, scheduler and RNG in place from `latest` (or `step`); where
    that one does not load (damaged, incomplete, not matching its digest), from the newest
    older one that does, each failure logged (`checkpoint_unreadable`). CheckpointError
    when none loads. `allow_unverified` (default: $PIPELINE_CHECKPOINT_ALLOW_UNVERIFIED)
    accepts checkpoints whose digest cannot be checked, e.g. saved before digests existed.

    The world size may differ from the saving run's (DCP reshards); RNG states are then
    restored only for ranks that existed, with a warning.
    """
    if step is None:
        step = latest_step(root)
        if step is None:
            raise CheckpointStateError(
                f"no checkpoint under {root}: {Path(root) / LATEST} is missing"
            )
    if allow_unverified is None:
        allow_unverified = _allow_unverified_env()
    candidates = [step, *(s for s in saved_steps(root) if s < step)]
    tried: list[tuple[str, str]] = []
    for candidate in candidates:
        path = step_dir(root, candidate)
        try:
            return _load_one(path, model, optimizer, scheduler, restore_rng, allow_unverified)
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
    allow_unverified: bool,
) -> LoadedCheckpoint:
    info = current_dist_info("cpu")
    _verify_collectively(path, allow_unverified)  # before anything could unpickle
    meta_file = path / META
    if not meta_file.is_file():
        raise CheckpointStateError(f"{meta_file} is missing; the checkpoint is incomplete")
    meta = json.loads(meta_file.read_text())
    if meta.get("format") != FORMAT_VERSION:
        raise CheckpointStateError(
            f"{meta_file} has format {meta.get('format')!r}, this code reads {FORMAT_VERSION}"
        )
    state = _trained_state(model, optimizer)
    with _single_process_quiet():
        dcp.load(state, checkpoint_id=str(path / "dcp"), no_dist=not is_distributed())
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_LOAD_TRAINED,
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
