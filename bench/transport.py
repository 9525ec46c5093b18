"""Transport bench: msgs/s and GB/s of the queue layer for 1 KiB, 1 MiB and 64 MiB tensors.

    python -m bench.transport [--json OUT] [--seconds S] [--repeats R] [--sizes ...]

Producer and consumer always run in separate processes (this module re-run with `--role`,
arguments ints and strings only), over ipc:// (unix sockets) for every system:
  ours      `QueueServer` -> `QueueClient`, credit and acks on: the producer sends `Prompt`s
            whose tensor is the payload, the consumer views the tensor and acks each item
  baseline  raw pyzmq PUSH/PULL of the same payload bytes, copy=False both ways, high-water
            marks set to the credit window `ours` runs with
  bound     an AF_UNIX stream socket: sendall() of the same bytes (small messages 256 KiB
            at a time), recv_into() a reused buffer
`ours` authenticates every connection as a run does (ZeroMQ PLAIN with a per-run secret;
`--no-auth` leaves it out). Each run warms up, then the consumer times a window; runs of the three systems are
interleaved and repeated, and the medians are reported. Prints a table, the CPU time per
message of each process (steadier than msgs/s on a shared machine), then one JSON object
per figure (`bench.common`); `ratio` is ours / baseline. `--profile DIR` runs every
process under cProfile to see where the time goes.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

KIB, MIB = 1024, 1024 * 1024
SIZES = {"1KiB": KIB, "1MiB": MIB, "64MiB": 64 * MIB}
SYSTEMS = ("ours", "zmq", "socket")
BASELINE = "raw_pyzmq_push_pull"
RUN_ID = "bench"
# a timed window also needs this many messages, so 64 MiB figures rest on a few dozen
MIN_MSGS = {KIB: 2000, MIB: 100, 64 * MIB: 24}
BATCH_BYTES = 256 * KIB  # the bound's smallest write


def label(size: int) -> str:
    for name, n in SIZES.items():
        if n == size:
            return name
    return f"{size}B"


def parse_size(text: str) -> int:
    if text in SIZES:
        return SIZES[text]
    for suffix, mult in (("KiB", KIB), ("MiB", MIB)):
        if text.endswith(suffix):
            return int(text[: -len(suffix)]) * mult
    return int(text)


def min_msgs(size: int, a: argparse.Namespace) -> int:
    return a.min_msgs if a.min_msgs is not None else MIN_MSGS.get(size, 16)


def credit_window(size: int) -> int:
    """Prefetch, max_pending and baseline HWM: ~32 MiB in flight, between 4 and 64 items.

    One credit per item would make every item wait a round trip; a window this deep keeps
    the pipe full while bounding the consumer's buffered bytes. Deeper windows do not help
    small items: the producer's per-ack work grows with its pending queue (`_on_ack` scans
    it), so max_pending stays equal to prefetch.
    """
    return max(4, min(64, (32 * MIB) // size))


# ----------------------------------------------------------------------------- consumers


class Window:
    """Warm-up, then one timed window, both measured where the data lands (the consumer)."""

    def __init__(self, size: int, seconds: float, warmup: float, min_msgs: int) -> None:
        self.size = size
        self.seconds = seconds
        self.warmup = warmup
        self.min_msgs = min_msgs
        self.first: float | None = None
        self.t0: float | None = None
        self.cpu0 = 0.0
        self.bytes = 0

    def add(self, nbytes: int) -> bool:
        """Count bytes received; True once the window is complete."""
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        if self.t0 is None:
            if now - self.first >= self.warmup:
                self.t0 = now  # this arrival opens the window; bytes after it count
                self.cpu0 = time.process_time()
            return False
        self.bytes += nbytes
        return now - self.t0 >= self.seconds and self.bytes >= self.min_msgs * self.size

    def report(self) -> None:
        assert self.t0 is not None
        elapsed = time.perf_counter() - self.t0
        cpu = time.process_time() - self.cpu0  # every thread of the process, ZeroMQ's too
        msgs = self.bytes / self.size
        print(json.dumps({"msgs": msgs, "seconds": elapsed, "cpu_s": cpu}), flush=True)


class Meter:
    """A producer's messages and CPU time since its first send, reported when it is stopped.

    CPU per message barely moves when other work shares the cores, unlike msgs/s, so it
    shows where the layer's cost lies even on a busy machine.
    """

    def __init__(self) -> None:
        self.msgs = 0.0
        self.cpu0: float | None = None

    def tick(self, msgs: float = 1.0) -> None:
        if self.cpu0 is None:
            self.cpu0 = time.process_time()
        self.msgs += msgs

    def report(self) -> None:
        cpu = time.process_time() - self.cpu0 if self.cpu0 is not None else 0.0
        print(json.dumps({"msgs": self.msgs, "cpu_s": cpu}), flush=True)


METER = Meter()


def ours_consumer(a: argparse.Namespace) -> None:
    from pipeline.transport.channel import run_async

    async def main() -> None:
        from pipeline.transport import QueueClient

        client = QueueClient(
            "prompts", [a.endpoint], run_id=RUN_ID, consumer="bench", config=config(a)
        )
        await client.start()
        window = Window(a.size, a.seconds, a.warmup, a.min_msgs)
        done = False
        while not done:
            delivery = await client.get()
            tensor = delivery.message.tensor(delivery.body.prompt_ids)  # zero-copy view
            done = window.add(tensor.nbytes)
            delivery.ack()
        window.report()
        await client.close()

    run_async(main())


def zmq_consumer(a: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVHWM, a.hwm)
    sock.connect(a.endpoint)
    window = Window(a.size, a.seconds, a.warmup, a.min_msgs)
    while not window.add(len(sock.recv(copy=False).buffer)):
        pass
    window.report()
    sock.close(linger=0)
    ctx.term()


def socket_consumer(a: argparse.Namespace) -> None:
    path = a.endpoint.removeprefix("ipc://")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    deadline = time.monotonic() + 30
    while True:
        try:
            sock.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)
    buf = memoryview(bytearray(max(a.size, 4 * MIB)))
    window = Window(a.size, a.seconds, a.warmup, a.min_msgs)
    while True:
        n = sock.recv_into(buf)
        if n == 0:
            raise SystemExit("producer closed the socket")
        if window.add(n):
            break
    window.report()
    sock.close()


# ----------------------------------------------------------------------------- producers


def payload(size: int) -> Any:
    import numpy as np

    return np.random.default_rng(size).integers(0, 256, size=size, dtype=np.uint8)


def ours_producer(a: argparse.Namespace) -> None:
    from pipeline.transport.channel import run_async

    async def main() -> None:
        from pipeline.transport import QueueServer
        from pipeline.wire.codec import TensorPack
        from pipeline.wire.messages import Prompt

        server = QueueServer("prompts", a.endpoint, run_id=RUN_ID, sender="bench", config=config(a))
        server.start()
        data = payload(a.size)
        i = 0
        while True:  # until the orchestrator stops this process
            pack = TensorPack()
            body = Prompt(uid=str(i), prompt_ids=pack.add(data), n_samples=1)
            await server.send(body, pack)  # the ack future resolves as the consumer acks
            METER.tick()
            i += 1

    run_async(main())


def zmq_producer(a: argparse.Namespace) -> None:
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, a.hwm)
    sock.bind(a.endpoint)
    data = payload(a.size)
    while True:
        sock.send(data, copy=False)
        METER.tick()


def socket_producer(a: argparse.Namespace) -> None:
    path = a.endpoint.removeprefix("ipc://")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path)
    server.listen(1)
    conn, _ = server.accept()
    # small messages go out many per call, as ZeroMQ batches them: the bound is the wire's
    # byte rate, not Python's cost per syscall
    per_call = max(1, BATCH_BYTES // a.size)
    data = memoryview(payload(a.size).tobytes() * per_call)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        while True:
            conn.sendall(data)
            METER.tick(per_call)


def config(a: argparse.Namespace) -> Any:
    from pipeline.transport import ChannelConfig

    return ChannelConfig(prefetch=a.prefetch, max_pending=a.max_pending)


ROLES = {
    "ours-producer": ours_producer,
    "ours-consumer": ours_consumer,
    "zmq-producer": zmq_producer,
    "zmq-consumer": zmq_consumer,
    "socket-producer": socket_producer,
    "socket-consumer": socket_consumer,
}


# ----------------------------------------------------------------------------- orchestration


def _role_args(role: str, endpoint: str, size: int, a: argparse.Namespace) -> list[str]:
    window = credit_window(size) if a.prefetch is None else a.prefetch
    pending = a.max_pending or window
    return [
        sys.executable,
        "-m",
        "bench.transport",
        "--role",
        role,
        "--endpoint",
        endpoint,
        "--size",
        str(size),
        "--seconds",
        str(a.seconds),
        "--warmup",
        str(a.warmup),
        "--prefetch",
        str(window),
        "--max-pending",
        str(pending),
        "--hwm",
        str(window),
        "--min-msgs",
        str(min_msgs(size, a)),
        *(["--profile", str(a.profile)] if a.profile is not None else []),
        *(["--secret", a.secret] if a.secret and role.startswith("ours") else []),
    ]


def run_pair(system: str, size: int, tmp: Path, a: argparse.Namespace) -> dict[str, float]:
    """One producer and one consumer process; the consumer's timed window is the result."""
    endpoint = f"ipc://{tmp}/{system}-{size}.sock"
    env = dict(os.environ)
    env.setdefault("PIPELINE_LOG_LEVEL", "warning")
    producer = subprocess.Popen(
        _role_args(f"{system}-producer", endpoint, size, a),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    consumer = subprocess.Popen(
        _role_args(f"{system}-consumer", endpoint, size, a),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        out, err = consumer.communicate(timeout=a.timeout)
        if consumer.returncode != 0:
            raise SystemExit(f"{system} consumer ({label(size)}) failed:\n{err[-3000:]}")
        result = json.loads(out.strip().splitlines()[-1])
        if producer.poll() is None:
            producer.send_signal(signal.SIGTERM)
        sent = _last_json(producer.communicate(timeout=30)[0])
        result["producer_cpu_s"] = sent.get("cpu_s", 0.0)
        result["producer_msgs"] = sent.get("msgs", 0.0)
        return result
    except subprocess.TimeoutExpired:
        raise SystemExit(
            f"{system} {label(size)} produced no result within {a.timeout}s "
            f"(producer exit code {producer.poll()})"
        ) from None
    finally:
        for proc in (consumer, producer):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=5)
            for stream in (proc.stdout, proc.stderr):
                if stream is not None:
                    stream.close()


def _last_json(text: str) -> dict[str, Any]:
    lines = [line for line in text.strip().splitlines() if line.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def measure(a: argparse.Namespace) -> dict[tuple[str, int], list[dict[str, float]]]:
    runs: dict[tuple[str, int], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-transport-") as tmp:
        for _ in range(a.repeats):
            for size in a.sizes:
                for system in SYSTEMS:  # interleaved, so drift hits all three alike
                    runs.setdefault((system, size), []).append(run_pair(system, size, Path(tmp), a))
    return runs


def _median_us(runs: list[dict[str, float]], cpu_key: str, msgs_key: str) -> float:
    """Median CPU microseconds per message (all threads of one process) over the repeats."""
    per = [r[cpu_key] / r[msgs_key] * 1e6 for r in runs if r.get(msgs_key)]
    return round(statistics.median(per), 2) if per else 0.0


def figures(
    runs: dict[tuple[str, int], list[dict[str, float]]], a: argparse.Namespace
) -> list[dict]:
    from bench.common import cpu_device, figure, git_sha, now_iso

    device, git, date = cpu_device(), git_sha(), now_iso()
    out = []
    for size in a.sizes:
        rates = {s: [r["msgs"] / r["seconds"] for r in runs[(s, size)]] for s in SYSTEMS}
        med = {s: statistics.median(v) for s, v in rates.items()}
        cpu = {
            s: {
                "producer": _median_us(runs[(s, size)], "producer_cpu_s", "producer_msgs"),
                "consumer": _median_us(runs[(s, size)], "cpu_s", "msgs"),
            }
            for s in SYSTEMS
        }
        window = credit_window(size) if a.prefetch is None else a.prefetch
        config = {
            "payload_bytes": size,
            "seconds": a.seconds,
            "warmup_s": a.warmup,
            "repeats": a.repeats,
            "min_msgs": min_msgs(size, a),
            "msgs_per_s_runs": {s: [round(v, 1) for v in rates[s]] for s in SYSTEMS},
            "cpu_us_per_msg": cpu,
            "prefetch": window,
            "max_pending": a.max_pending or window,
            "acks": True,
            "message": "Prompt with one uint8 tensor frame",
            "transport": "ipc",
            # ours: every connection authenticated as the pipeline's are (PLAIN, a run secret)
            "auth": "none" if a.no_auth else "plain run secret",
            "baseline_kind": f"PUSH/PULL, payload frame only, copy=False, SNDHWM=RCVHWM={window}",
            "bound_kind": "AF_UNIX stream, sendall >= 256 KiB / recv_into a reused buffer",
            "timing": "consumer side, median of repeats; GB = 1e9 payload bytes",
        }
        common = {
            "baseline": BASELINE,
            "config": config,
            "device": device,
            "git": git,
            "date": date,
        }
        name = label(size)
        out.append(
            figure(
                "transport",
                f"msgs_per_s_{name}",
                med["ours"],
                baseline_value=med["zmq"],
                bound=med["socket"],
                **common,
            )
        )
        gb = size / 1e9
        out.append(
            figure(
                "transport",
                f"gbps_{name}",
                med["ours"] * gb,
                baseline_value=med["zmq"] * gb,
                bound=med["socket"] * gb,
                **common,
            )
        )
    return out


def run_role(a: argparse.Namespace) -> None:
    """One side of one run; with --profile, under cProfile until the orchestrator stops it.

    Producers run until SIGTERM, then print their `Meter` (and dump the profile).
    """
    producer = a.role.endswith("-producer")
    if a.secret:  # the pipeline's own sockets, authenticated as in a run
        from pipeline.transport.security import configure

        configure(None, run_secret=a.secret)

    def stop(signum: int, frame: Any) -> None:
        METER.report()
        if a.profile is not None:
            raise SystemExit(0)  # unwinds into the profiler, which writes its file
        os._exit(0)

    if producer:
        signal.signal(signal.SIGTERM, stop)
    if a.profile is None:
        ROLES[a.role](a)
    else:
        import cProfile

        a.profile.mkdir(parents=True, exist_ok=True)
        prof = cProfile.Profile()
        try:
            prof.runcall(ROLES[a.role], a)
        finally:
            prof.dump_stats(a.profile / f"{a.role}-{label(a.size)}.prof")
    if producer:  # the consumer hung up first (raw socket)
        METER.report()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m bench.transport", description=__doc__.split("\n")[0]
    )
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--seconds", type=float, default=1.0, help="timed window per run")
    ap.add_argument("--warmup", type=float, default=0.3, help="untimed seconds before it")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sizes", default="1KiB,1MiB,64MiB", help="comma-separated payload sizes")
    ap.add_argument("--prefetch", type=int, default=None, help="default: ~32 MiB in flight")
    ap.add_argument("--max-pending", type=int, default=None, help="default: = prefetch")
    ap.add_argument("--min-msgs", type=int, default=None, help="per window; default by size")
    ap.add_argument("--timeout", type=float, default=120.0, help="per run, seconds")
    # internal: one side of one run
    ap.add_argument("--role", choices=sorted(ROLES), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", default="", help=argparse.SUPPRESS)
    ap.add_argument("--size", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--hwm", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--profile", type=Path, default=None, help="cProfile each process into DIR")
    ap.add_argument("--no-auth", action="store_true", help="ours without the run's authentication")
    ap.add_argument("--secret", default="", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.role is not None:
        run_role(a)
        return
    if not a.no_auth:
        import secrets

        a.secret = secrets.token_hex(32)
    a.sizes = [parse_size(s.strip()) for s in a.sizes.split(",") if s.strip()]
    started = time.monotonic()
    figs = figures(measure(a), a)
    from bench.common import emit, table

    print(
        f"transport  device={figs[0]['device']}  ipc  producer/consumer in separate processes  "
        f"{a.repeats} repeats x {a.seconds}s (medians)  took {time.monotonic() - started:.0f}s"
    )
    print(table(figs))
    print(cpu_table(figs))
    emit(figs, a.json)


def cpu_table(figs: list[dict]) -> str:
    """CPU per message of each process (all its threads): robust where msgs/s is noisy."""
    lines = [f"{'cpu us/msg (producer / consumer)':<34}" + "".join(f"{s:>20}" for s in SYSTEMS)]
    for f in figs:
        if f["figure"].startswith("msgs_per_s_"):
            cpu = f["config"]["cpu_us_per_msg"]
            cells = "".join(
                f"{cpu[s]['producer']:>10.1f} /{cpu[s]['consumer']:>8.1f}" for s in SYSTEMS
            )
            lines.append(f"{f['figure'].removeprefix('msgs_per_s_'):<34}{cells}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
