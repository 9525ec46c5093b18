"""The Python sandbox: code runs and its output comes back; writes outside its scratch
directory, sockets, processes and ctypes are refused; time, CPU, memory and file-size
limits end the child alone."""

from __future__ import annotations

import os
import resource
import signal
import socket
from pathlib import Path

import pytest

from pipeline.envs.sandbox import SandboxLimits, run_python


def refused(result_stderr: str) -> bool:
    return "PermissionError: sandbox:" in result_stderr


def test_runs_code_and_returns_stdout() -> None:
    result = run_python("total = sum(range(10))\nprint(total)\nprint('done')")
    assert result.ok
    assert (result.exit_code, result.timed_out, result.stdout) == (0, False, "45\ndone\n")


def test_stdout_head_and_stderr_tail_are_kept() -> None:
    code = "print('x' * 5000)\nraise ValueError('boom')"
    result = run_python(code, SandboxLimits(max_output_chars=100))
    assert (result.stdout, result.stdout_truncated) == ("x" * 100, True)
    assert result.exit_code == 1
    assert result.stderr.rstrip().endswith("ValueError: boom")
    assert 'File "snippet.py", line 2' in result.stderr
    assert "sandbox.py" not in result.stderr  # the runner's own frames are not shown


@pytest.mark.parametrize(
    "code",
    [
        "open({victim!r}, 'w').write('x')",
        "open({victim!r}, 'a').write('x')",
        "import os; os.close(os.open({victim!r}, os.O_WRONLY | os.O_CREAT))",
        "import pathlib; pathlib.Path({victim!r}).write_text('x')",
        "import os; os.symlink({folder!r}, 'link'); open('link/victim.txt', 'w')",
        "import shutil; open('mine.txt', 'w').close(); shutil.copy('mine.txt', {victim!r})",
    ],
)
def test_write_outside_scratch_is_refused(tmp_path: Path, code: str) -> None:
    victim = tmp_path / "victim.txt"
    result = run_python(code.format(victim=str(victim), folder=str(tmp_path)))
    assert result.exit_code == 1 and refused(result.stderr), result.stderr
    assert not victim.exists()


def test_changes_outside_scratch_are_refused(tmp_path: Path) -> None:
    keep = tmp_path / "keep.txt"
    keep.write_text("data")
    calls = [
        f"os.remove({str(keep)!r})",
        f"os.rename({str(keep)!r}, 'moved.txt')",
        f"os.link({str(keep)!r}, 'hard.txt')",
        f"os.truncate({str(keep)!r}, 0)",
        f"os.mkdir({str(tmp_path / 'new')!r})",
        f"shutil.rmtree({str(tmp_path)!r})",
    ]
    code = "import os, shutil\n" + "".join(
        f"try:\n    {call}\nexcept PermissionError:\n    print('refused')\n" for call in calls
    )
    result = run_python(code)
    assert result.ok, result.stderr
    assert result.stdout == "refused\n" * len(calls)
    assert keep.read_text() == "data"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_writes_inside_scratch_work_and_scratch_is_removed() -> None:
    code = (
        "import os, shutil, tempfile\n"
        "os.makedirs('d/e')\n"
        "open('d/e/f.txt', 'w').write('hello')\n"
        "os.rename('d/e/f.txt', 'g.txt')\n"
        "shutil.rmtree('d')\n"
        "fd, name = tempfile.mkstemp()\n"  # TMPDIR is the scratch directory
        "os.close(fd)\n"
        "print(open('g.txt').read())\n"
        "print(os.getcwd())\n"
    )
    result = run_python(code)
    assert result.ok, result.stderr
    text, scratch = result.stdout.splitlines()
    assert text == "hello"
    assert not os.path.exists(scratch)


def test_network_is_refused() -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        listener.settimeout(0.2)
        port = listener.getsockname()[1]
        calls = [
            f"socket.socket().connect(('127.0.0.1', {port}))",
            f"socket.create_connection(('127.0.0.1', {port}), timeout=1)",
            "socket.socket(socket.AF_INET, socket.SOCK_DGRAM)",
            "socket.getaddrinfo('localhost', 80)",
        ]
        code = "import socket\n" + "".join(
            f"try:\n    {call}\nexcept PermissionError:\n    print('refused')\n" for call in calls
        )
        result = run_python(code)
        assert result.ok, result.stderr
        assert result.stdout == "refused\n" * len(calls)
        with pytest.raises(TimeoutError):  # nobody connected
            listener.accept()


@pytest.mark.parametrize(
    "code",
    [
        "import subprocess; subprocess.run(['echo', 'spawned'])",
        "import os; os.system('echo spawned')",
        "import os; os.popen('echo spawned').read()",
        "import os; os.execv('/bin/echo', ['echo', 'spawned'])",
        "import os; os.posix_spawn('/bin/echo', ['echo', 'spawned'], {})",
        "import os; print('spawned' if os.fork() else '')",
    ],
)
def test_process_creation_is_refused(code: str) -> None:
    result = run_python(code)
    assert result.exit_code == 1 and refused(result.stderr), result.stderr
    assert "spawned" not in result.stdout


@pytest.mark.parametrize(
    "code",
    [
        "import ctypes",
        "import os; os.kill(os.getppid(), 0)",
        "import resource; resource.setrlimit(resource.RLIMIT_AS, (-1, -1))",
    ],
)
def test_ways_around_the_guard_are_refused(code: str) -> None:
    result = run_python(code)
    assert result.exit_code == 1 and refused(result.stderr), result.stderr


def test_infinite_loop_is_timed_out_and_the_child_is_gone() -> None:
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=0.5))
    assert result.timed_out and not result.ok
    assert result.exit_code == -signal.SIGKILL
    assert 0.5 <= result.seconds < 3.0
    with pytest.raises(ProcessLookupError):
        os.kill(result.pid, 0)


def test_cpu_limit_ends_a_busy_child() -> None:
    result = run_python("while True:\n    pass", SandboxLimits(timeout_s=4.0, cpu_s=1.0))
    assert result.timed_out
    assert result.exit_code in (-signal.SIGXCPU, -signal.SIGKILL)
    assert result.seconds < 3.5


@pytest.mark.parametrize(
    "code",
    ["x = bytearray(1024 ** 3)", "chunks = []\nwhile True:\n    chunks.append(bytearray(2 ** 20))"],
)
def test_memory_hog_fails_without_hurting_the_caller(code: str) -> None:
    before = resource.getrlimit(resource.RLIMIT_AS)
    result = run_python(code + "\nprint('survived')", SandboxLimits(memory_mb=128))
    assert result.exit_code == 1 and "MemoryError" in result.stderr, result.stderr
    assert result.stdout == ""
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    assert len(bytearray(256 * 2**20)) == 256 * 2**20  # this process can still allocate


def test_file_size_limit() -> None:
    code = "open('big.bin', 'wb').write(b'x' * (2 * 2 ** 20))"
    result = run_python(code, SandboxLimits(file_size_mb=1))
    assert result.exit_code == 1 and "File too large" in result.stderr, result.stderr
