"""Environment worker process: hosts the episodes' environment instances where a hang or a
crash cannot hurt the rollout service. Started by `EnvPool` as
`python -m pipeline.envs.worker --fd N --parent-pid P --spec SPEC --options JSON`.

Every call runs as a task of one event loop: a coroutine method that awaits (a remote tool,
a sleep) lets the calls of other episodes run meanwhile; a plain method holds the loop until
it returns. The pool sends one call at a time unless the class's `step` is a coroutine
(`EnvHello.concurrent`). A hung call is not interrupted here, the pool kills this process by
pid (and the episodes it hosted end as lost).
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import json
import os
import socket
import threading
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


async def _call(method: Any, *args: Any) -> Any:
    result = method(*args)
    return await result if inspect.isawaitable(result) else result


async def _answer(
    cls: type, options: dict[str, Any], live: dict[str, Any], request: Any
) -> EnvReply:
    reply = EnvReply(seq=request.seq)
    if isinstance(request, EnvOpen):
        env = cls(**options)
        live[request.episode.uid] = env
        observation = await _call(env.reset, request.episode)
        if not isinstance(observation, str):
            raise TypeError(f"reset returned {type(observation).__name__}, not str")
        reply.observation = observation
    elif isinstance(request, EnvStep):
        result = checked_result(await _call(live[request.uid].step, request.action))
        reply.observation, reply.reward, reply.done = result.observation, result.reward, result.done
        reply.tool_call, reply.tool_error = result.tool_call, result.tool_error
    elif isinstance(request, EnvClose):
        env = live.pop(request.uid, None)
        if env is not None and hasattr(env, "close"):
            await _call(env.close, request.cancelled)
    return reply


async def _reply(
    sock: socket.socket, cls: type, options: dict[str, Any], live: dict[str, Any], request: Any
) -> None:
    try:
        # encoded here too: a reply msgpack cannot take (a str with a lone surrogate) or
        # one over the frame limit is this call's error, not a crash of every episode
        # the worker hosts
        payload = ENCODER.encode(await _answer(cls, options, live, request))
        if len(payload) > MAX_FRAME_BYTES:
            raise ValueError(f"reply of {len(payload)} bytes exceeds {MAX_FRAME_BYTES}")
    except asyncio.CancelledError:  # the loop is closing: the pool is gone
        raise
    except BaseException as exc:  # user code: even SystemExit must not end the worker
        error = describe(exc).encode("utf-8", "backslashreplace").decode()
        payload = ENCODER.encode(EnvReply(seq=request.seq, error=error))
    send_frame(sock, payload)


async def _serve(sock: socket.socket, cls: type, options: dict[str, Any]) -> None:
    loop = asyncio.get_running_loop()
    frames: asyncio.Queue[bytes | BaseException | None] = asyncio.Queue()

    def read() -> None:  # a thread: the loop runs the calls while this waits for the next
        try:
            while (payload := recv_frame(sock)) is not None:
                loop.call_soon_threadsafe(frames.put_nowait, payload)
        except BaseException as exc:
            loop.call_soon_threadsafe(frames.put_nowait, exc)
        loop.call_soon_threadsafe(frames.put_nowait, None)

    threading.Thread(target=read, name="env-frames", daemon=True).start()
    live: dict[str, Any] = {}
    running: set[asyncio.Task[None]] = set()
    while (frame := await frames.get()) is not None:
        if isinstance(frame, BaseException):
            raise frame
        request = DECODER.decode(frame)
        if not isinstance(request, EnvOpen | EnvStep | EnvClose):
            continue
        task = asyncio.create_task(_reply(sock, cls, options, live, request))
        running.add(task)  # held until done: the loop keeps only weak references
        task.add_done_callback(running.discard)


def serve(sock: socket.socket, spec: str, options: dict[str, Any]) -> None:
    """Answer calls until the pool closes its end of the socket."""
    from pipeline.envs.registry import resolve

    try:
        cls = resolve(spec)
        stop = [str(s) for s in getattr(cls, "stop", ())]
        concurrent = inspect.iscoroutinefunction(getattr(cls, "step", None))
    except Exception as exc:
        send_frame(sock, ENCODER.encode(EnvHello(pid=os.getpid(), load_error=str(exc))))
        return
    hello = EnvHello(pid=os.getpid(), stop=stop, concurrent=concurrent)
    send_frame(sock, ENCODER.encode(hello))
    asyncio.run(_serve(sock, cls, options))


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
