"""The built-in engine over two tensor-parallel ranks (real processes, gloo on CPU) against
the one-rank engine on the same weights (issue 34): greedy generations equal, sampled ones
equal up to round-off of near-ties with log-probs within 1e-4, and a weight update taken as
each rank's shards leaves every shard equal to its slice of the full update and the
generations equal to the one-rank engine's under the full update."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pipeline.engines import TorchEngine, TorchEngineConfig
from pipeline.errors import ConfigError
from pipeline.models import save_model
from pipeline.models.tensor_parallel import TPGroup, shard_model
from tests.engines.helpers import TINY, make_model
from tests.engines.tp_requests import phases, session_turns, update_for

REPO = Path(__file__).resolve().parents[2]
QWEN_LIKE = dataclasses.replace(
    TINY, model_type="qwen2", attention_bias=True, tie_word_embeddings=True
)


def _one_rank(model_dir: Path) -> dict[str, list]:
    engine = TorchEngine.from_pretrained(
        model_dir, config=TorchEngineConfig(max_seq_len=128, max_batch=8)
    )
    update = update_for(engine.model)
    result = {}
    for name, requests in phases():
        if name == "after_update":
            engine.update_weights(update.items(), version=1)
        outs = engine.generate(requests)
        result[name] = [[o.output_ids, o.logprobs, o.token_versions] for o in outs]
    result["sessions"] = session_turns(engine)
    return result


def _two_ranks(model_dir: Path, tmp: Path) -> list[dict]:
    procs = []
    for rank in range(2):
        cmd = [sys.executable, "-m", "tests.engines.tp_peer", "--rank", str(rank)]
        cmd += ["--size", "2", "--init", str(tmp / "init"), "--model", str(model_dir)]
        cmd += ["--out", str(tmp / f"rank{rank}.json")]
        procs.append(subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE))
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, err.decode()[-3000:]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("config", [TINY, QWEN_LIKE], ids=["llama", "qwen2-tied"])
def test_two_rank_engine_generates_as_one_rank(tmp_path: Path, config):
    model_dir = tmp_path / "model"
    save_model(make_model(config), model_dir)
    want = _one_rank(model_dir)
    ranks = _two_ranks(model_dir, tmp_path)
    assert all(r["shards_equal"] for r in ranks)  # each rank holds its slice of the update
    assert [r["version"] for r in ranks] == [1, 1]
    got = ranks[0]
    assert [o[0] for o in got["greedy"]] == [o[0] for o in want["greedy"]]
    same = total = 0
    for phase in ("sampled", "after_update"):
        for (ids, lps, versions), (w_ids, w_lps, w_versions) in zip(
            got[phase], want[phase], strict=True
        ):
            total += 1
            same += ids == w_ids
            prefix = next(
                (i for i, (a, b) in enumerate(zip(ids, w_ids, strict=False)) if a != b), len(ids)
            )
            prefix = min(prefix + 1, len(ids), len(w_ids))  # the first differing draw too
            torch.testing.assert_close(
                torch.tensor(lps[:prefix]), torch.tensor(w_lps[:prefix]), atol=1e-4, rtol=0
            )
            assert versions == w_versions == [int(phase == "after_update")] * len(ids)
    assert same >= 0.9 * total, f"{same} of {total} samples equal"
    # sessions: kept caches and a release taken by every rank at the same step
    assert got["sessions"] == want["sessions"]
    cached = [c for _, c in want["sessions"]]
    assert cached[:2] == [0, 0] and cached[2] > 0 and cached[3] == 0


def test_shards_need_divisible_heads_and_vocabulary():
    odd = dataclasses.replace(TINY, num_key_value_heads=1, num_attention_heads=3, head_dim=16)
    with pytest.raises(ConfigError, match="num_attention_heads divisible by 2"):
        shard_model(make_model(odd), TPGroup(0, 2))
