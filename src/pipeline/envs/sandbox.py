"""Run a snippet of model-written Python in a fresh, limited child process.

Each run gets its own isolated interpreter (`python -I -S -B`: no site-packages, no user
environment), started by pid in a new session, with a scratch directory as its working
directory (removed afterwards) and resource limits: wall clock (the parent kills the child's
process group), CPU seconds, address space, file size (stdout and stderr too), open files,
processes. Before the snippet runs, the child installs an audit hook (PEP 578) that raises
PermissionError on writes outside the scratch directory (`open` for writing, remove, rename,
mkdir, rmdir, link, symlink, chmod, ...), on any socket operation, on starting processes
(subprocess, os.system, exec, spawn, fork), on signalling other processes, on raising the
limits, and on ctypes (its import and its events).

This is a guard against accidents and model-written mistakes (a stray `open("/x", "w")`, a
`shutil.rmtree`, a download), NOT a security boundary against a determined attacker: audit
hooks only see what CPython chooses to report, so unaudited calls (`os.mkfifo`,
`_posixsubprocess.fork_exec`), C extension modules, or code that finds and disarms the hook
through introspection get past it; and RLIMIT_NPROC does not bind root. Hostile code needs
an OS boundary: a container, a VM, seccomp, user namespaces.

Standard library only; the child runs this very file as its main program.
"""

from __future__ import annotations

import math
import os
import resource
import signal
import sys
import time
from dataclasses import dataclass
from types import TracebackType

SNIPPET = "snippet.py"  # in the scratch directory, so tracebacks can show its lines
_MB = 1024 * 1024


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 5.0  # wall clock, from start to kill
    cpu_s: float | None = None  # RLIMIT_CPU; None: the wall-clock limit
    memory_mb: int = 256  # RLIMIT_AS
    file_size_mb: int = 16  # RLIMIT_FSIZE, per file (bounds stdout / stderr as well)
    max_output_chars: int = 1000  # kept of stdout (its head) and of stderr (its tail)
    open_files: int = 64


@dataclass(frozen=True)
class SandboxResult:
    stdout: str  # the first `max_output_chars`
    stderr: str  # the last `max_output_chars`
    exit_code: int  # negative: killed by that signal
    timed_out: bool  # wall clock or CPU limit
    seconds: float
    pid: int
    stdout_truncated: bool = False

    @property
    def ok(self) -> bool:
        return self.exit_code == 0 and not self.timed_out


def run_python(code: str, limits: SandboxLimits = SandboxLimits()) -> SandboxResult:
    """Run `code` in a fresh sandboxed interpreter and wait for it (at most the time limit)."""
    # imported here, not above: the child runs this file, and these slow its start ~4x
    import contextlib
    import subprocess
    import tempfile

    run_dir = tempfile.mkdtemp(prefix="pipeline-sandbox-")
    try:
        scratch = os.path.join(run_dir, "scratch")
        os.mkdir(scratch)
        with open(os.path.join(scratch, SNIPPET), "w", encoding="utf-8") as f:
            f.write(code)
        cpu_s = math.ceil(limits.cpu_s if limits.cpu_s is not None else limits.timeout_s)
        argv = [
            sys.executable,
            *("-I", "-S", "-B", "-u", "-X", "utf8"),
            os.path.abspath(__file__),
            scratch,
            str(max(1, cpu_s)),
            str(limits.memory_mb * _MB),
            str(limits.file_size_mb * _MB),
            str(limits.open_files),
        ]
        env = {"PATH": os.defpath, "HOME": scratch, "TMPDIR": scratch, "LC_ALL": "C.UTF-8"}
        out_path, err_path = os.path.join(run_dir, "stdout"), os.path.join(run_dir, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            start = time.monotonic()
            proc = subprocess.Popen(
                argv,
                cwd=scratch,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=err,
                start_new_session=True,  # its group id is its pid: one kill reaches all of it
            )
            timed_out = False
            try:
                proc.wait(timeout=limits.timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            seconds = time.monotonic() - start
        stdout, truncated = _head(out_path, limits.max_output_chars)
        return SandboxResult(
            stdout=stdout,
            stderr=_tail(err_path, limits.max_output_chars),
            exit_code=proc.returncode,
            timed_out=timed_out or proc.returncode == -signal.SIGXCPU,
            seconds=seconds,
            pid=proc.pid,
            stdout_truncated=truncated,
        )
    finally:
        _remove_tree(run_dir)


def _head(path: str, chars: int) -> tuple[str, bool]:
    with open(path, "rb") as f:
        data = f.read(4 * chars + 4)  # enough bytes for `chars` UTF-8 characters
        more = bool(f.read(1))
    text = data.decode("utf-8", "replace")
    return text[:chars], more or len(text) > chars


def _tail(path: str, chars: int) -> str:
    with open(path, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - 4 * chars - 4))
        return f.read().decode("utf-8", "replace")[-chars:] if chars > 0 else ""


def _remove_tree(path: str) -> None:
    import contextlib
    import shutil

    # the snippet may have chmod-ed its directories shut; give them back first
    for root, dirs, _ in os.walk(path):
        for name in dirs:
            with contextlib.suppress(OSError):
                os.chmod(os.path.join(root, name), 0o700)
    shutil.rmtree(path, ignore_errors=True)


# --- the child: everything below runs in the sandboxed interpreter ---------------------

# event -> (path argument, its dir_fd argument or None) pairs that must lie in the scratch dir
_PATH_EVENTS: dict[str, tuple[tuple[int, int | None], ...]] = {
    "os.remove": ((0, 1),),
    "os.rmdir": ((0, 1),),
    "os.mkdir": ((0, 2),),
    "os.rename": ((0, 2), (1, 3)),  # also os.replace
    "os.link": ((0, 2), (1, 3)),  # a hard link inside to a file outside is a write outside
    "os.symlink": ((1, 2),),  # the target is checked when written through
    "os.truncate": ((0, None),),
    "os.chmod": ((0, 2),),
    "os.lchmod": ((0, None),),
    "os.chown": ((0, 3),),
    "os.utime": ((0, 3),),
    "os.chflags": ((0, None),),
    "os.lchflags": ((0, None),),
    "os.setxattr": ((0, None),),
    "os.removexattr": ((0, None),),
    "shutil.rmtree": ((0, 1),),
    "shutil.move": ((0, None), (1, None)),
}
_REFUSED_EVENTS = frozenset(
    {
        "subprocess.Popen",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "resource.setrlimit",
        "resource.prlimit",
    }
)
_REFUSED_PREFIXES = ("socket.", "ctypes.")
_REFUSED_MODULES = frozenset({"ctypes", "_ctypes"})
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


def _install_guard(scratch: str) -> None:
    scratch = os.path.realpath(scratch)

    def inside(path: object, dir_fd: object) -> bool:
        if isinstance(path, int):  # a descriptor: its `open` was checked
            return True
        name = os.fsdecode(path) if isinstance(path, str | bytes | os.PathLike) else str(path)
        if isinstance(dir_fd, int) and dir_fd >= 0 and not os.path.isabs(name):
            name = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), name)
        real = os.path.realpath(name)
        return real in (scratch, os.devnull) or real.startswith(scratch + os.sep)

    def refuse(event: str, detail: object = "") -> None:
        where = f": {detail}" if detail else ""
        raise PermissionError(f"sandbox: {event} is not allowed here{where}")

    def hook(event: str, args: tuple[object, ...]) -> None:
        if event == "open":
            flags = args[2]
            if isinstance(flags, int) and flags & _WRITE_FLAGS and not inside(args[0], None):
                refuse("writing outside the scratch directory", args[0])
        elif event in _PATH_EVENTS:
            for path_at, dir_fd_at in _PATH_EVENTS[event]:
                dir_fd = None if dir_fd_at is None else args[dir_fd_at]
                if not inside(args[path_at], dir_fd):
                    refuse(f"{event} outside the scratch directory", args[path_at])
        elif event in _REFUSED_EVENTS or event.startswith(_REFUSED_PREFIXES):
            refuse(event)
        elif event == "import" and str(args[0]).partition(".")[0] in _REFUSED_MODULES:
            refuse(f"importing {args[0]}")

    sys.addaudithook(hook)


def _set_limit(kind: int, soft: int, hard: int | None = None) -> None:
    _, current_hard = resource.getrlimit(kind)
    hard = soft if hard is None else hard
    if current_hard != resource.RLIM_INFINITY:  # cannot raise past what we were given
        soft, hard = min(soft, current_hard), min(hard, current_hard)
    resource.setrlimit(kind, (soft, hard))


def _child_main(argv: list[str]) -> None:
    scratch = argv[0]
    cpu_s, memory, file_size, open_files = (int(a) for a in argv[1:5])
    with open(os.path.join(scratch, SNIPPET), encoding="utf-8") as f:
        source = f.read()
    _set_limit(resource.RLIMIT_CPU, cpu_s, cpu_s + 1)  # soft: SIGXCPU; hard: SIGKILL
    _set_limit(resource.RLIMIT_AS, memory)
    _set_limit(resource.RLIMIT_FSIZE, file_size)
    _set_limit(resource.RLIMIT_NOFILE, open_files)
    _set_limit(resource.RLIMIT_CORE, 0)
    _set_limit(resource.RLIMIT_NPROC, 0)  # no fork, no threads (ignored for root)
    _install_guard(scratch)
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    try:
        exec(compile(source, SNIPPET, "exec"), namespace)
    except SystemExit:
        raise
    except BaseException as exc:
        exc = exc.with_traceback(_snippet_frames(exc.__traceback__))
        sys.excepthook(type(exc), exc, exc.__traceback__)
        raise SystemExit(1) from None


def _snippet_frames(tb: TracebackType | None) -> TracebackType | None:
    """`tb` without this file's frames (the runner's and the guard's): the model reads it."""
    kept = []
    while tb is not None:
        if tb.tb_frame.f_code.co_filename != __file__:
            kept.append(tb)
        tb = tb.tb_next
    for at, frame in enumerate(kept):
        frame.tb_next = kept[at + 1] if at + 1 < len(kept) else None
    return kept[0] if kept else None


if __name__ == "__main__":
    _child_main(sys.argv[1:])
