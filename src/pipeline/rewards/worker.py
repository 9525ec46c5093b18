"""Reward worker process: runs user reward functions where a hang or crash cannot hurt the
service. Started by `RewardScorer` as `python -m pipeline.rewards.worker --fd N`.

It answers one request at a time, so the scorer's per-sample deadline is exactly the time the
function runs. A hung function is not interrupted here; the scorer kills this process by pid.
"""

from __future__ import annotations

import argparse
import os
import socket

from pipeline.rewards.registry import RewardFn, resolve
from pipeline.rewards.types import coerce_score
from pipeline.runtime.child_worker import describe, exit_when_orphaned, worker_socket
from pipeline.wire.reward import (
    DECODER,
    ENCODER,
    WorkerHello,
    WorkerReply,
    WorkerRequest,
    recv_frame,
    send_frame,
)


def serve(sock: socket.socket, preload: list[str]) -> None:
    """Answer requests until the scorer closes its end of the socket."""
    functions: dict[str, RewardFn] = {}
    load_errors: dict[str, str] = {}
    for spec in preload:
        try:
            functions[spec] = resolve(spec)
        except Exception as exc:
            load_errors[spec] = str(exc)
    send_frame(sock, ENCODER.encode(WorkerHello(pid=os.getpid(), load_errors=load_errors)))
    while True:
        payload = recv_frame(sock)
        if payload is None:
            return
        request = DECODER.decode(payload)
        if not isinstance(request, WorkerRequest):
            continue
        reply = WorkerReply(seq=request.seq)
        try:
            fn = functions.get(request.spec)
            if fn is None:
                fn = functions[request.spec] = resolve(request.spec)
            value = fn(
                request.data_source,
                request.solution_str,
                request.ground_truth,
                request.extra_info,
            )
            reply.score = coerce_score(value)
        except BaseException as exc:  # user code: even SystemExit must not end the worker
            reply.error = describe(exc)
        send_frame(sock, ENCODER.encode(reply))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the worker process."""
    parser = argparse.ArgumentParser(prog="pipeline.rewards.worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket file descriptor")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--preload", action="append", default=[], help="reward spec to load")
    args = parser.parse_args(argv)
    sock = worker_socket(args.fd)
    exit_when_orphaned(args.parent_pid)
    try:
        serve(sock, args.preload)
    except (OSError, EOFError):
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
