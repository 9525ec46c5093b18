"""One TP rank of a tensor-parallel engine replica (a real process; gloo on CPU), driven by
tests/engines/test_tensor_parallel.py: generate, take a weight update as this rank's shards,
generate again (a follower's shards come late: its step waits for them). The leader writes
the outputs; every rank checks its shards."""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.engines import TorchEngineConfig
from pipeline.engines.torch_engine import TorchEngine
from pipeline.engines.tp_engine import TPEngine
from pipeline.models import load_model
from pipeline.models.tensor_parallel import TPGroup, shard_model
from pipeline.weights.tp import shard
from tests.engines.tp_requests import phases, session_turns, update_for


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--init", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    dist.init_process_group(
        "gloo", init_method=f"file://{args.init}", rank=args.rank, world_size=args.size
    )
    torch.manual_seed(0)
    model = load_model(args.model, dtype=torch.float32)
    update = update_for(model)
    shard_model(model, TPGroup(args.rank, args.size))
    engine = TPEngine(
        TorchEngine(model, TorchEngineConfig(max_seq_len=128, max_batch=8)), rank=args.rank
    )
    mine = {k: shard(k, v, args.rank, args.size) for k, v in update.items()}
    result: dict[str, object] = {}
    flag = Path(args.init).with_name("leader-parked")
    if args.rank == 0:
        for name, requests in phases():
            if name == "after_update":
                engine.update_weights(mine.items(), version=1)
                flag.touch()  # the follower parks its shards only after this
            outs = engine.generate(requests)
            result[name] = [[o.output_ids, o.logprobs, o.token_versions] for o in outs]
        result["sessions"] = session_turns(engine)
        engine.close()
    else:

        def park_late() -> None:
            # as a receiver thread whose shards come after the leader's: the follower's
            # step waits for them (it must not apply version 0 again or skip the update)
            while not flag.exists():
                time.sleep(0.01)
            time.sleep(0.3)
            engine.update_weights(mine.items(), version=1)

        parker = threading.Thread(target=park_late)
        parker.start()
        engine.follow()
        parker.join()
    params = dict(engine.model.state_dict())
    result["shards_equal"] = all(torch.equal(params[k], v) for k, v in mine.items())
    result["version"] = engine.version
    Path(args.out).write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
