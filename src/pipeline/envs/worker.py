"""Environment worker process: hosts the episodes' environment instances where a hang or a
crash cannot hurt the rollout service. Started by `EnvPool` as
`python -m pipeline.envs.worker --fd N --parent-pid P --spec SPEC --options JSON`.

It answers one call at a time; a hung call is not interrupted here, the pool kills this
process by pid (and the episodes it hosted end as lost).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import socket
from typing import Any

from pipeline.envs.types import checked_result
from pipeline.runtime.child_worker import describe, exit_when_orphaned, worker_socket
from pipeline.wire.env import (
    DECODER,
    ENCODER,
    EnvClose,
    EnvHello,
    EnvOpen,
    EnvReply,
    EnvStep,
)
from pipeline.wire.reward import MAX_FRAME_BYTES, recv_frame, send_frame


def _call(loop: asyncio.AbstractEventLoop, method: Any, *args: Any) -> Any:
    result = method(*args)
    return loop.run_until_complete(result) if inspect.isawaitable(result) else result


def _answer(
    loop: asyncio.AbstractEventLoop,
    cls: type,
    options: dict[str, Any],
    live: dict[str, Any],
    request: Any,
) -> EnvReply:
    reply = EnvReply(seq=request.seq)
    if isinstance(request, EnvOpen):
        env = cls(**options)
        live[request.episode.uid] = env
        observation = _call(loop, env.reset, request.episode)
        if not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not str")
        reply.observation = observation
    elif isinstance(request, EnvStep):
        result = checked_result(_call(loop, live[request.uid].step, request.action))
        reply.observation, reply.reward, reply.done = result.observation, result.reward, result.done
        reply.tool_call, reply.tool_error = result.tool_call, result.tool_error
    elif isinstance(request, EnvClose):
        env = live.pop(request.uid, None)
        if env is not None and hasattr(env, "close"):
            _call(loop, env.close, request.cancelled)
    return reply


def serve(sock: socket.socket, spec: str, options: dict[str, Any]) -> None:
    """Answer calls until the pool closes its end of the socket."""
    from pipeline.envs.registry import resolve

    try:
        cls = resolve(spec)
        stop = [str(s) for s in getattr(cls, "stop", ())]
    except Exception as exc:
        send_frame(sock, ENCODER.encode(EnvHello(pid=os.getpid(), load_error=str(exc))))
        return
    send_frame(sock, ENCODER.encode(EnvHello(pid=os.getpid(), stop=stop)))
    live: dict[str, Any] = {}
    loop = asyncio.new_event_loop()
    while True:
        payload = recv_frame(sock)
        if payload is None:
            return
        request = DECODER.decode(payload)
        if not isinstance(request, EnvOpen | EnvStep | EnvClose):
            continue
        try:
            # encoded here too: a reply msgpack cannot take (a str with a lone surrogate) or
            # one over the frame limit is this call's error, not a crash of every episode
            # the worker hosts
            payload = ENCODER.encode(_answer(loop, cls, options, live, request))
            if len(payload) > MAX_FRAME_BYTES:
                raise ValueError(f"reply of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
        except BaseException as exc:  # user code: even SystemExit must not end the worker
            error = describe(exc).encode("utf-8", "backslashreplace").decode()
            payload = ENCODER.encode(EnvReply(seq=request.seq, error=error))
        send_frame(sock, payload)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="pipeline.envs.worker")
    parser.add_argument("--fd", type=int, required=True, help="inherited socket file descriptor")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--spec", required=True, help="environment name or module:Class")
    parser.add_argument("--options", default="{}", help="JSON keyword arguments of the class")
    args = parser.parse_args(argv)
    sock = worker_socket(args.fd)
    exit_when_orphaned(args.parent_pid)
    try:
        serve(sock, args.spec, json.loads(args.options))
    except (OSError, EOFError):
        return 1
    finally:
        sock.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
