"""One node of a producer -> relay -> sink chain, run as its own process by the tests.

usage: python chain_node.py producer ENDPOINT N DONE_FILE
       python chain_node.py relay IN_ENDPOINT OUT_ENDPOINT DELAY_S
       python chain_node.py sink IN_ENDPOINT OUT_FILE
       python chain_node.py flood ENDPOINT PAYLOAD_BYTES STATS_FILE
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

import numpy as np

from pipeline.transport import ChannelConfig, QueueClient, QueueServer
from pipeline.transport.channel import run_async
from pipeline.wire.codec import TensorPack
from pipeline.wire.messages import Prompt, Rollout
from pipeline.wire.samples import GroupArrays, SampleArrays, read_group, write_group

CFG = ChannelConfig(prefetch=4, max_pending=16, heartbeat_s=0.1, peer_timeout_s=1.0)
RUN = "chain"


def prompt(i: int, payload: int = 4) -> tuple[Prompt, TensorPack]:
    pack = TensorPack()
    ref = pack.add(np.full(payload, i % 100, dtype=np.int32))
    return Prompt(uid=f"u{i:05d}", prompt_ids=ref, n_samples=1), pack


async def producer(endpoint: str, n: int, done_file: str) -> None:
    server = QueueServer("prompts", endpoint, run_id=RUN, sender="producer", config=CFG).start()
    acks = [await server.send(*prompt(i)) for i in range(n)]
    await asyncio.gather(*acks)
    with open(done_file, "w") as f:
        json.dump(server.stats.as_dict(), f)
    await server.close()


async def relay(in_ep: str, out_ep: str, delay: float) -> None:
    out = QueueServer("rollouts", out_ep, run_id=RUN, sender="relay", config=CFG).start()
    inp = await QueueClient("prompts", [in_ep], run_id=RUN, consumer="relay", config=CFG).start()
    pending: set[asyncio.Future[None]] = set()
    while True:
        d = await inp.get()
        await asyncio.sleep(delay)
        ids = d.message.tensor(d.body.prompt_ids)
        group = GroupArrays(
            uid=d.uid,
            prompt_ids=ids,
            samples=[
                SampleArrays(
                    uid=f"{d.uid}/0",
                    response_ids=ids[::-1].copy(),
                    behaviour_logprobs=np.zeros(len(ids), np.float32),
                    token_versions=np.zeros(len(ids), np.int32),
                )
            ],
        )
        ack = await out.send(*write_group(group, Rollout))
        ack.add_done_callback(lambda f, d=d: d.ack())
        pending.add(ack)


async def sink(in_ep: str, out_file: str) -> None:
    inp = await QueueClient("rollouts", [in_ep], run_id=RUN, consumer="sink", config=CFG).start()
    fd = os.open(out_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    while True:
        d = await inp.get()
        group = read_group(d.message)
        assert group.samples[0].response_ids.tolist() == group.prompt_ids[::-1].tolist()
        os.write(fd, (d.uid + "\n").encode())
        os.fsync(fd)
        d.ack()


async def flood(endpoint: str, payload: int, stats_file: str) -> None:
    """Send as fast as credit allows forever; record sends and RSS over time."""
    server = QueueServer("prompts", endpoint, run_id=RUN, sender="flood", config=CFG).start()
    start = time.monotonic()
    i = 0

    async def sample() -> None:
        while True:
            with open("/proc/self/statm") as f:
                rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
            with open(stats_file, "a") as f:
                f.write(
                    json.dumps(
                        {
                            "t": time.monotonic() - start,
                            "rss": rss,
                            "sent": server.stats.sent,
                            "queued": i,
                            "pending": server.pending,
                        }
                    )
                    + "\n"
                )
            await asyncio.sleep(0.2)

    task = asyncio.create_task(sample())
    while True:
        await server.send(*prompt(i, payload // 4))
        i += 1
    task.cancel()


def main() -> None:
    role, *args = sys.argv[1:]
    if role == "producer":
        run_async(producer(args[0], int(args[1]), args[2]))
    elif role == "relay":
        run_async(relay(args[0], args[1], float(args[2])))
    elif role == "sink":
        run_async(sink(args[0], args[1]))
    elif role == "flood":
        run_async(flood(args[0], int(args[1]), args[2]))
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
