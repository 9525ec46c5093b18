"""Shared pieces of the weight-sync tests and their helper processes (imported by path)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from pipeline.models import CausalLM, ModelConfig
from pipeline.weights import tp
from pipeline.weights.validate import ParamSpec

HERE = Path(__file__).resolve().parent
ROLLOUT_DTYPE = torch.bfloat16
# hidden_size 31 is odd: FSDP2 shards o_proj/down_proj/norms unevenly (16 + 15 rows) while
# every TP split (q/k/v/gate/up dim 0, o/down dim 1, vocab 96) stays even.
TINY = ModelConfig(
    model_type="llama",
    vocab_size=96,
    hidden_size=31,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    attention_bias=True,
    max_position_embeddings=64,
)
# smaller than the largest tensor (embed/lm_head: 96 * 31 * 2 = 5952 bytes)
SMALL_BUCKET_MB = 2048 / (1 << 20)


def full_shapes(config: ModelConfig = TINY) -> dict[str, tuple[int, ...]]:
    with torch.device("meta"):
        model = CausalLM(config)
    return {n: tuple(p.shape) for n, p in model.named_parameters()}


def shard_specs(tp_rank: int, tp_size: int, config: ModelConfig = TINY) -> dict[str, ParamSpec]:
    out = {}
    for name, shape in full_shapes(config).items():
        sliced = tp.shard(name, torch.empty(shape, device="meta"), tp_rank, tp_size)
        out[name] = ParamSpec(tuple(sliced.shape), ROLLOUT_DTYPE)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def engine_cmd(endpoint: str, name: str, out: Path, *extra: str, tp_size: int = 1) -> list[str]:
    return [
        sys.executable,
        str(HERE / "wsync_engine.py"),
        "--endpoint",
        endpoint,
        "--name",
        name,
        "--out",
        str(out),
        "--tp-size",
        str(tp_size),
        *extra,
    ]


def assert_engine_equal(
    expected: dict[str, torch.Tensor], got: dict[str, torch.Tensor], tp_rank: int, tp_size: int
) -> None:
    """Bitwise equality of an engine's tensors with the learner's (TP-sliced) full tensors."""
    assert set(got) == set(expected)
    for name, full in expected.items():
        want = tp.shard(name, full, tp_rank, tp_size)
        assert got[name].dtype == want.dtype, name
        assert torch.equal(got[name].view(torch.int16), want.contiguous().view(torch.int16)), name


def read_events(proc: subprocess.Popen[bytes], sink: list[dict], stop_on=None) -> None:
    """Collect the JSON lines a helper process prints (run in a thread)."""
    assert proc.stdout is not None
    for raw in proc.stdout:
        try:
            event = json.loads(raw)
        except ValueError:
            continue
        sink.append(event)
        if stop_on is not None:
            stop_on(event)


def wait_for(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what}")
        time.sleep(0.02)
