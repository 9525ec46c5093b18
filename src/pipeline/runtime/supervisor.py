"""The local supervisor: every service of the profile as its own OS process.

It restarts a crashed service a bounded number of times, ends the run when the
controller exits by itself, and on Ctrl-C stops every child (SIGTERM, then SIGKILL after
the deadline), always by process id. A controller killed by a signal is restarted like
the others: it resumes the run from its journal and the services rejoin it. One that
exits with a code of its own (done, stalled, or a bug it would only repeat) ends the run.

A replica of several ranks (a trainer with `services.ROLE.fsdp_size = N > 1`, a built-in
engine with `services.rollout.tp = N > 1`) is one child too: `torchrun --standalone
--nproc-per-node N` (its own rendezvous on a free local port) over the role's service
module, whose ranks form one service (`runtime/ranks.py`). Signals
go to torchrun, which passes them on to its ranks; a restart starts every rank again.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from pipeline.config import PipelineConfig
from pipeline.config.schema import ROLES
from pipeline.errors import EXIT_CONFIG
from pipeline.log import get_logger
from pipeline.runtime import layout
from pipeline.runtime.bytecode import bytecode_cache
from pipeline.runtime.gpu_sharing import GpuSharing, MpsDaemon, choose
from pipeline.runtime.restart_budget import RestartBudget, restartable
from pipeline.transport.security import run_secret

# the longest a controller may take to prepare a run (a tiny model's warm start included)
PREPARE_TIMEOUT_S = 900.0
# seconds before a crashed service starts again
RESTART_BACKOFF_S = 0.5
# seconds over which a service's restarts count against supervisor.max_restarts
RESTART_WINDOW_S = 3600.0


@dataclass
class Child:
    role: str
    replica: int
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    budget: RestartBudget | None = None
    log_file: IO[bytes] | None = None
    exits: list[int] = field(default_factory=list)
    started_at: float = 0.0  # wall time of the live process's start

    @property
    def name(self) -> str:
        return f"{self.role}-{self.replica}"


class Supervisor:
    def __init__(
        self,
        config: PipelineConfig,
        *,
        profile: str,
        overrides: dict[str, str],
        show_progress: bool = True,
    ) -> None:
        self.config = config
        self.profile = profile
        self.overrides = overrides
        self.run_dir = layout.run_dir(config)
        self.show_progress = show_progress
        self.children: list[Child] = [
            Child(role, i)
            for role in ROLES
            if role in config.services
            for i in range(config.replicas(role))
        ]
        self.log = get_logger("supervisor")
        self._stopping = False
        self._prepared = False
        self.events: list[dict[str, Any]] = []
        self.bytecode = bytecode_cache(config.run.compile_cache_dir, os.environ)
        if self.bytecode is not None:
            self.log.info(
                "bytecode_cache", prefix=self.bytecode.prefix, reason=self.bytecode.reason
            )
        self.sharing: GpuSharing = choose(config)
        self.mps: MpsDaemon | None = None

    def _argv(self, child: Child) -> list[str]:
        args = [sys.executable, "-m", *launcher_args(self.config, child.role)]
        args += ["--profile", self.profile, "--replica", str(child.replica)]
        for key, value in self.overrides.items():
            args += [f"--{key}", value]
        if child.role != "controller":
            # started beside a controller that answers once it has prepared the run
            wait = max(self.config.run.handshake_timeout_s, PREPARE_TIMEOUT_S)
            args += ["--run.handshake_timeout_s", str(wait)]
        return args

    def start(self, child: Child) -> None:
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if child.log_file is None:
            child.log_file = open(logs / f"{child.name}.log", "ab")  # noqa: SIM115
        env = dict(os.environ, PIPELINE_LOG_JSON="1", PYTHONUNBUFFERED="1")
        if self.bytecode is not None:
            self.bytecode.apply(env)
        self.sharing.apply(env, child.role)
        if self.config.ranks_per_replica(child.role) > 1:  # torchrun asks for it, else warns
            env.setdefault("OMP_NUM_THREADS", str(max(1, self.config.run.torch_threads)))
        child.proc = subprocess.Popen(
            self._argv(child),
            stdout=child.log_file,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        child.started_at = time.time()
        self.log.info("service_started", service=child.name, pid=child.proc.pid)
        self.events.append(
            {"time": child.started_at, "service": child.name, "started": child.proc.pid}
        )

    def _record_exit(self, child: Child, code: int) -> None:
        child.exits.append(code)
        self.events.append({"time": time.time(), "service": child.name, "exit": code})

    def _live(self) -> list[Child]:
        return [c for c in self.children if c.proc is not None and c.proc.poll() is None]

    def await_exits(self, timeout_s: float, interrupted: Callable[[], bool]) -> None:
        """Wait for the services to exit on their own (told to by the controller at the
        run's end; a trainer saves its last checkpoint first), up to `timeout_s`."""
        self._stopping = True  # an exit now is the end of the run, not a crash
        deadline = time.monotonic() + timeout_s
        self._stop_untold()
        waiting = self._live()
        while (live := self._live()) and time.monotonic() < deadline and not interrupted():
            time.sleep(0.2)
        for child in waiting:
            if child not in live:
                assert child.proc is not None and child.proc.returncode is not None
                self._record_exit(child, child.proc.returncode)
        if live:
            self.log.warning("services_still_saving", services=[c.name for c in live])

    def _stop_untold(self) -> None:
        """SIGTERM the services the controller did not tell to stop: restarted as the run
        ended (or after they were told), they never joined it and have nothing to save
        (they would wait for a controller's answer while the supervisor waited for their
        save)."""
        ended = run_end(self.run_dir)
        if ended is None:
            return
        for child in self._live():
            assert child.proc is not None
            if child.role == "controller":
                continue
            if not ended.told(child.name, child.started_at):
                self.log.info("service_not_in_run", service=child.name, pid=child.proc.pid)
                self._signal(child, signal.SIGTERM)

    def stop_all(self) -> None:
        """SIGTERM every live child, SIGKILL what is left after the deadline. Idempotent."""
        self._stopping = True
        live = self._live()
        for child in live:
            self._signal(child, signal.SIGTERM)
        deadline = time.monotonic() + self.config.supervisor.stop_timeout_s
        for child in live:
            assert child.proc is not None
            try:
                child.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.log.warning("service_killed", service=child.name, pid=child.proc.pid)
                self._signal(child, signal.SIGKILL)
        for child in live:  # a killed process may take a while to release its device
            assert child.proc is not None
            try:
                self._record_exit(child, child.proc.wait(timeout=60))
            except subprocess.TimeoutExpired:
                self.log.error("service_unreaped", service=child.name, pid=child.proc.pid)
        for child in self.children:
            if child.log_file is not None:
                child.log_file.close()
                child.log_file = None

    @staticmethod
    def _signal(child: Child, sig: signal.Signals) -> None:
        assert child.proc is not None
        with contextlib.suppress(ProcessLookupError):
            os.killpg(child.proc.pid, sig)

    def _on_exit(self, child: Child, code: int) -> bool:
        """Handle a child that exited; returns False when the run must end."""
        self._record_exit(child, code)
        if code != 0 and not self._stopping:
            log_path = self.run_dir / "logs" / f"{child.name}.log"
            print(
                f"{child.name} exited with code {code}: {failure_cause(log_path)}\n"
                f"  log: {log_path}",
                file=sys.stderr,
            )
        if child.role == "controller" and (code >= 0 or self._stopping):
            self.log.info("controller_exited", code=code)
            return False
        if self._stopping:
            return True
        if not restartable(child.role, code):  # refused its config
            self.log.error("service_failed", service=child.name, code=code, reason="config")
            return False
        if child.budget is None:
            cfg = self.config.supervisor
            child.budget = RestartBudget(cfg.max_restarts, RESTART_WINDOW_S)
        if not child.budget.take(time.monotonic()):
            self.log.error(
                "service_failed",
                service=child.name,
                code=code,
                restarts=child.restarts,
                within_s=RESTART_WINDOW_S,
            )
            return False
        child.restarts += 1
        self.log.warning(
            "service_restarting", service=child.name, code=code, attempt=child.restarts
        )
        time.sleep(RESTART_BACKOFF_S)
        self.start(child)
        return True

    def _note_prepared(self) -> None:
        """Once the controller has prepared the run (`run.json`): say what it dropped."""
        marker = self.run_dir / "run.json"
        if self._prepared or not marker.exists():
            return
        with contextlib.suppress(OSError, ValueError):
            dropped = json.loads(marker.read_text()).get("dropped_long_prompts", 0)
            self._prepared = True
            if dropped:
                print(
                    f"note: {dropped} prompts longer than task.max_prompt_tokens = "
                    f"{self.config.task.max_prompt_tokens} dropped (task.drop_long_prompts)",
                    file=sys.stderr,
                )

    def _start_sharing(self) -> None:
        """The GPU sharing of the run, its MPS daemon started where it is MPS; logged."""
        if self.sharing.mode == "mps" and not self.sharing.running:
            self.mps = MpsDaemon(self.sharing, dict(os.environ))
            self.sharing = self.mps.start(required=self.config.run.gpu_sharing == "mps")
        self.log.info(
            "gpu_sharing",
            mode=self.sharing.mode,
            reason=self.sharing.reason,
            priorities=self.sharing.priorities,
        )

    def run(self) -> int:
        """Start everything, watch, and return the controller's exit code."""
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "run.json").unlink(missing_ok=True)  # readiness marker of this run
        run_secret(self.run_dir)  # before any service: they all read the same one
        previous = signal.getsignal(signal.SIGINT)
        interrupted = False

        def on_sigint(_signum: int, frame: Any) -> None:
            nonlocal interrupted
            interrupted = True

        signal.signal(signal.SIGINT, on_sigint)
        signal.signal(signal.SIGTERM, on_sigint)
        progress = _Progress(self.run_dir, self.config) if self.show_progress else None
        code = 1
        try:
            self._start_sharing()
            # all at once: the services import and start up while the controller prepares
            # the run (data, tokenizer, a tiny model's warm start); their hello waits for it
            for child in self.children:
                self.start(child)
            while not interrupted:
                self._note_prepared()
                if progress is not None:
                    progress.update()
                keep_going = True
                for child in self.children:
                    assert child.proc is not None
                    rc = child.proc.poll()
                    if rc is not None and not (child.role != "controller" and rc == 0):
                        keep_going = self._on_exit(child, rc)
                        if not keep_going:
                            if child.role == "controller" or rc == EXIT_CONFIG:
                                code = rc
                            break
                if not keep_going:
                    break
                time.sleep(0.2)
            if not interrupted and code == 0:
                self.await_exits(self.config.supervisor.save_timeout_s, lambda: interrupted)
            if interrupted:
                self.log.warning("interrupted", message="stopping every service")
                code = 130
        finally:
            self.stop_all()
            if self.mps is not None:
                self.mps.stop()
            if self.config.run.transport == "ipc":  # the run's sockets, now unused
                shutil.rmtree(layout.socket_dir(self.config), ignore_errors=True)
            if progress is not None:
                progress.update()
                progress.close()
            signal.signal(signal.SIGINT, previous)
            (self.run_dir / "supervisor.json").write_text(
                json.dumps(
                    {
                        "events": self.events,
                        "restarts": {c.name: c.restarts for c in self.children},
                        "gpu_sharing": {
                            "mode": self.sharing.mode,
                            "reason": self.sharing.reason,
                            "priorities": self.sharing.priorities,
                        },
                    },
                    indent=2,
                )
            )
        return code


@dataclass(frozen=True)
class RunEnd:
    """Which services the controller told to stop when it ended the run, and when."""

    told_to_stop: tuple[str, ...]
    told_at: float

    def told(self, service: str, started_at: float) -> bool:
        """Whether `service`, started at wall time `started_at`, was told: one restarted
        after it (or never told) never joined the end of the run."""
        return service in self.told_to_stop and started_at <= self.told_at


def run_end(run_dir: Path) -> RunEnd | None:
    """The end of the run as the controller's summary.json says it; None before it."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        return RunEnd(tuple(summary["told_to_stop"]), float(summary["told_at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def launcher_args(config: PipelineConfig, role: str) -> list[str]:
    """What follows `python -m` to start one replica of `role` on this host: its service
    module, under torchrun when a replica is several ranks (a trainer sharded over
    fsdp_size, a built-in engine over tp)."""
    module = config.service_module(role)
    ranks = config.ranks_per_replica(role)
    if ranks <= 1:
        return [module]
    return [
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={ranks}",
        "-m",
        module,
    ]


def kl_text(step: dict[str, Any]) -> str:
    """The KL a step computed: to the reference (k3) when there is one, else between the
    engine's and the learner's log-probs."""
    if "kl/k3" in step:
        return f"kl {step['kl/k3']:.4f}"
    if "mismatch/kl" not in step:  # not measured (reused behaviour log-probs)
        return "mismatch kl -"
    return f"mismatch kl {step['mismatch/kl']:.2e}"


def failure_cause(log_path: Path, limit: int = 1 << 16) -> str:
    """The last error a service logged: its exception's last line, else the last line."""
    try:
        with log_path.open("rb") as f:
            f.seek(max(0, log_path.stat().st_size - limit))
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return "(no log)"
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict) and (
            record.get("exception")
            or record.get("level")
            in (
                "error",
                "critical",
            )
        ):
            text = str(record.get("exception") or "").strip().splitlines()
            detail = text[-1] if text else ""
            return detail or f"{record.get('event')} {record.get('error', '')}".strip()
    tail = [x for x in lines if x.strip()]
    return tail[-1][-300:] if tail else "(empty log)"


class _Progress:
    """A live bar fed by the controller's steps.jsonl: step, reward, KL, tokens/s, staleness."""

    def __init__(self, run_dir: Path, config: PipelineConfig) -> None:
        from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

        self.path = run_dir / "metrics" / "steps.jsonl"
        self.offset = 0
        self.progress = Progress(
            TextColumn("[bold]step {task.completed}/{task.total}"),
            BarColumn(),
            TimeElapsedColumn(),
            TextColumn("{task.fields[info]}"),
            transient=False,
        )
        self.task = self.progress.add_task("run", total=config.controller.steps, info="starting")
        self.services = [
            f"{role}-{i}"
            for role in ROLES
            if role != "controller" and role in config.services
            for i in range(config.replicas(role))
        ]
        self.stepped = False
        self.ready: set[str] = set()  # read once: a resumed run's metrics files are long
        self.progress.start()

    def startup_text(self) -> str:
        """Before the first step: which services are still starting (imports, the
        controller's answer), which set up (model load, compiles, warm-up), which ready."""
        states: dict[str, list[str]] = {"starting": [], "warming up": [], "ready": []}
        for name in self.services:
            path = self.path.parent / f"{name}.jsonl"
            ready = name not in self.ready and path.exists()
            if ready and '"kind": "ready"' in path.read_text(errors="replace"):
                self.ready.add(name)
            if name in self.ready:
                states["ready"].append(name)
            else:
                states["warming up" if path.exists() else "starting"].append(name)
        return "  ".join(f"{k}: {', '.join(v)}" for k, v in states.items() if v)

    def update(self) -> None:
        if not self.stepped:
            self.progress.update(self.task, info=self.startup_text())
        if not self.path.exists():
            return
        with open(self.path) as f:
            f.seek(self.offset)
            lines = f.readlines()
        for line in lines:
            if not line.endswith("\n"):
                break  # written halfway: read it next time
            self.offset += len(line.encode())
            rec = json.loads(line)
            info = (
                f"reward {rec.get('reward_mean', 0):.3f}  {kl_text(rec)}  "
                f"tok/s {rec.get('tokens_per_s', 0):.0f}  stale {rec.get('staleness_max', 0):.0f}"
                f"  sync {rec.get('sync_seconds', 0) * 1000:.0f}ms"
            )
            self.progress.update(self.task, completed=rec["step"] + 1, info=info)
            self.stepped = True

    def close(self) -> None:
        self.progress.stop()
