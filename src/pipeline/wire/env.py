"""Messages between the rollout service and its environment workers (msgspec, no pickle);
framed as the reward workers' are (`pipeline.wire.reward`)."""

from __future__ import annotations

from typing import Any

import msgspec


class Episode(msgspec.Struct, frozen=True):
    """What an environment's `reset` is told (it crosses to the environment worker): the sample's uid and its prompt record."""

    uid: str
    prompt_text: str
    ground_truth: str = ""
    data_source: str = ""


class EnvHello(msgspec.Struct, tag="hello"):
    """Sent once by a started worker: the class's stop strings, or why it did not load.
    `concurrent`: its step is a coroutine, so the worker takes episodes' calls together."""

    pid: int
    stop: list[str] = []
    load_error: str = ""
    concurrent: bool = False


class EnvOpen(msgspec.Struct, tag="open"):
    seq: int
    episode: Episode


class EnvStep(msgspec.Struct, tag="step"):
    seq: int
    uid: str
    action: str


class EnvClose(msgspec.Struct, tag="close"):
    seq: int
    uid: str
    cancelled: bool


class EnvReply(msgspec.Struct, tag="reply"):
    """The call's answer, or the environment's exception as text in `error`."""

    seq: int
    observation: str = ""
    reward: float = 0.0
    done: bool = False
    tool_call: bool = False
    tool_error: bool = False
    error: str | None = None


EnvMessage = EnvHello | EnvOpen | EnvStep | EnvClose | EnvReply
ENCODER = msgspec.msgpack.Encoder()
DECODER: msgspec.msgpack.Decoder[Any] = msgspec.msgpack.Decoder(EnvMessage)
