"""One side of a CURVE queue test, run as its own process (inside a network namespace).

    python -m tests.transport.curve_peer produce ENDPOINT N [--keys DIR]
    python -m tests.transport.curve_peer consume ENDPOINT N [--keys DIR] [--timeout S]

The producer sends N prompts and exits once all are acknowledged (prints "acked N"); the
consumer prints one received uid per line, then "done", or "timeout" if N never arrived.
"""

from __future__ import annotations

import argparse
import asyncio

import numpy as np

from pipeline.transport import QueueClient, QueueServer
from pipeline.transport.channel import run_async
from pipeline.transport.security import configure
from pipeline.wire.codec import TensorPack
from pipeline.wire.messages import Prompt


async def produce(endpoint: str, n: int) -> None:
    server = QueueServer("prompts", endpoint, run_id="curve", sender="producer")
    server.start()
    acks = []
    for i in range(n):
        pack = TensorPack()
        body = Prompt(uid=f"u{i}", prompt_ids=pack.add(np.arange(4, dtype=np.int32)), n_samples=1)
        acks.append(await server.send(body, pack))
    print("bound", flush=True)
    await asyncio.wait_for(asyncio.gather(*acks), 60)
    print(f"acked {n}", flush=True)
    await server.close()


async def consume(endpoint: str, n: int, timeout: float) -> None:
    client = QueueClient("prompts", [endpoint], run_id="curve", consumer="consumer")
    await client.start()
    try:
        for _ in range(n):
            delivery = await client.get(timeout=timeout)
            print(delivery.uid, flush=True)
            delivery.ack()
        await asyncio.sleep(0.5)  # the last acks go out
        print("done", flush=True)
    except TimeoutError:
        print("timeout", flush=True)
    await client.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("role", choices=["produce", "consume"])
    ap.add_argument("endpoint")
    ap.add_argument("n", type=int)
    ap.add_argument("--keys", default=None)
    ap.add_argument("--timeout", type=float, default=20.0)
    a = ap.parse_args()
    configure(a.keys)
    if a.role == "produce":
        run_async(produce(a.endpoint, a.n))
    else:
        run_async(consume(a.endpoint, a.n, a.timeout))


if __name__ == "__main__":
    main()
