"""The GPU benches (rollout_decode, learner_step) run end to end on CPU with the tiny shape.

Numbers are not checked (a shared 2-core machine makes them noise); the figure format is,
because all_gpu, the README and other tools read these lines. all_gpu's bookkeeping (file
names, skips, merging) is checked without running any bench.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from bench.common import KEYS
from tests.run_patches import patch_vars

from bench import all_gpu

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PIPELINE_LOG_LEVEL": "warning"}
# kernels "auto" on CPU: the trainers' blocks compiled by aot_eager (no kernels generated)
COMPILED = patch_vars("compiled_cpu")


def run_bench(
    module: str, tmp_path: Path, *extra: str, env: dict[str, str] | None = None
) -> tuple[list[dict[str, Any]], list[str]]:
    out_file = tmp_path / f"{module}.json"
    cmd = [sys.executable, "-m", f"bench.{module}", "--shape", "tiny"]
    cmd += ["--device", "cpu", "--threads", "1", "--warmup", "1", "--json", str(out_file)]
    cmd += list(extra)
    done = subprocess.run(
        cmd, capture_output=True, text=True, timeout=300, check=False, env={**ENV, **(env or {})}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    figs = [json.loads(line) for line in lines if line.startswith("{")]
    assert figs
    # the JSON lines come last, after the human table; --json holds the same list
    assert all(line.startswith("{") for line in lines[-len(figs) :])
    assert any(line.startswith("figure") for line in lines[: -len(figs)])
    assert json.loads(out_file.read_text()) == figs
    return figs, lines


def check_common(fig: dict[str, Any], bench: str) -> None:
    assert list(fig) == list(KEYS)
    assert fig["bench"] == bench
    assert fig["device"].startswith("cpu (")
    assert fig["git"] and fig["date"]
    for key in ("value", "baseline_value", "ratio", "bound", "fraction_of_bound"):
        assert isinstance(fig[key], float) and fig[key] > 0, key
    assert abs(fig["ratio"] - fig["value"] / fig["baseline_value"]) < 1e-3 * fig["ratio"] + 1e-4
    assert (
        abs(fig["fraction_of_bound"] - fig["value"] / fig["bound"])
        < 1e-3 * fig["fraction_of_bound"] + 1e-4
    )


def test_rollout_decode_tiny_cpu(tmp_path: Path) -> None:
    figs, _ = run_bench("rollout_decode", tmp_path, "--repeats", "1")
    assert [f["figure"] for f in figs] == [
        "tokens_per_s_b4",
        "tokens_per_s_b4_vs_dynamic",
        "tokens_per_s_b8",
        "tokens_per_s_b8_vs_dynamic",
    ]
    for fig in figs:
        check_common(fig, "rollout_decode")
        config = fig["config"]
        assert config["shape"] == "tiny" and config["prompt"] == 16 and config["new_tokens"] == 16
        assert config["batch"] in (4, 8) and config["repeats"] == 1
        assert set(config["tokens_per_s"]) == {"ours", "hf_dynamic", "hf_static"}
        assert config["copy_bandwidth_bytes_per_s"] > 0 and config["weight_bytes"] > 0
        assert "bound_formula" in config and "copy_bandwidth_formula" in config
        # on CPU the static-cache baseline runs eager
        expected = "hf_generate_dynamic" if fig["figure"].endswith("_vs_dynamic") else None
        assert fig["baseline"] == (expected or "hf_generate_static")
        assert config["hf_compiled"] is False and config["cuda_graphs"] is False
        assert fig["value"] == pytest.approx(config["tokens_per_s"]["ours"], rel=1e-3)


@pytest.mark.slow
def test_learner_step_tiny_cpu(tmp_path: Path) -> None:
    figs, _ = run_bench(
        "learner_step",
        tmp_path,
        *("--steps", "2", "--windows", "2", "--set", "pack_bucket_tokens=16", "--torch-profile"),
        *("--variant", "logprob_keep_logits=true", "--variant", "no_such_knob=1"),
        *("--trace", str(tmp_path / "trace.json.gz")),
        env={"PIPELINE_GIT_SHA": "0123abc"},  # a copied tree's commit, named by the caller
    )
    # two timelines (one step; consecutive steps) per timed trainer: ours, and the variant
    # that ran (not the failed one)
    assert sorted(p.name for p in tmp_path.glob("trace*")) == [
        "trace-consecutive.json.gz",
        "trace-v1-consecutive.json.gz",
        "trace-v1.json.gz",
        "trace.json.gz",
    ]
    headline = ["tokens_per_s", "tokens_per_s_vs_eager", "mfu"]
    assert [f["figure"] for f in figs] == [*headline, *(f"{n}_drained" for n in headline)]
    for fig in figs:
        check_common(fig, "learner_step")
        config = fig["config"]
        assert config["batch"] == 2 and config["seq"] == 64 and config["prompt"] == 16
        assert config["tokens_per_step"] == 128 and config["params"] > 0
        assert config["trainer"]["keep_reference"] is False
        assert config["trainer"]["use_kl_loss"] is False
        assert config["hf_compiled"] is False
        assert fig["baseline"] in ("hf_train_step_eager", "hf_train_step_compiled")
        assert fig["git"] == "0123abc"
        assert config["trainer"]["pack_bucket_tokens"] == 16  # --set reaches ours
        systems = {"ours", "ours[logprob_keep_logits=true]", "hf_eager"}
        assert set(config["seconds"]) == set(config["seconds_consecutive"]) == systems
        assert len(config["seconds"]["ours"]) == 2  # --steps drained steps
        assert len(config["seconds_consecutive"]["ours"]) == 4  # --windows x --steps
        assert len(config["seconds_consecutive_wall"]["ours"]) == 2  # one mean per run
        host = config["seconds_consecutive_host"]["ours"]  # each submission's host seconds
        assert len(host) == 4 and all(x > 0 for x in host)
        assert config["timing"] == "consecutive" and set(config["timings"]) == {
            "consecutive",
            "drained",
        }
        variants = config["variants"]
        assert variants["ours[logprob_keep_logits=true]"]["trainer"]["logprob_keep_logits"]
        assert "no_such_knob" in variants["ours[no_such_knob=1]"]["error"]  # reported, not fatal
        # --torch-profile: the trainer's marked ranges took host time inside the profiled step
        ranges = config["profile"]["host_ms_per_range"]
        assert set(ranges) == {"train/forward", "train/backward", "train/optimizer"}
        assert all(ms > 0 for ms in ranges.values())
        assert sum(ranges.values()) <= config["profile"]["wall_ms"]
        # and --steps consecutive submitted steps, with per-step figures
        consecutive = config["profile_consecutive"]
        assert consecutive["steps"] == 2
        per_step = consecutive["per_step"]
        assert per_step["wall_ms"] == pytest.approx(consecutive["wall_ms"] / 2, abs=1e-2)
        ranges = consecutive["host_ms_per_range"]
        assert all(ms > 0 for ms in ranges.values())
        assert sum(ranges.values()) <= consecutive["wall_ms"]
    tps, _, mfu = figs[:3]
    # the headline is the consecutive timing; the drained one follows with its own baseline
    seconds = config["seconds_consecutive"]
    assert tps["value"] == pytest.approx(128 / statistics.median(seconds["ours"]), rel=1e-3)
    assert tps["baseline_value"] == pytest.approx(
        128 / statistics.median(seconds["hf_eager"]), rel=1e-3
    )
    drained = figs[3]
    assert drained["value"] == pytest.approx(
        128 / statistics.median(config["seconds"]["ours"]), rel=1e-3
    )
    # mfu is tokens/s in units of the peak: model FLOPs per token * tokens/s / peak, the
    # weights' 6 * params plus causal attention of the tiny shape (4 layers, 4 x 64 wide)
    config = mfu["config"]
    assert config["flops_per_token"] == 6 * config["params"] + 6 * 4 * 256 * 64
    expected = config["flops_per_token"] * tps["value"] / config["peak_flops"]
    assert mfu["value"] == pytest.approx(expected, rel=1e-3)
    weights_only = 6 * config["params"] * tps["value"] / config["peak_flops"]
    assert config["mfu_6n"]["ours"] == pytest.approx(weights_only, rel=1e-3, abs=1e-4)
    # executed: the output layer (vocab 8192 x hidden 256) skips the 16 prompt positions of
    # each 64-token sequence; transformers' step has no such figure (it computes them all)
    executed = config["flops_per_token"] - 6 * 8192 * 256 * 16 / 64
    assert config["executed_flops_per_token"] == round(executed)
    assert set(config["mfu_executed"]) == {"ours", "ours[logprob_keep_logits=true]"}
    assert config["mfu_executed"]["ours"] == pytest.approx(
        executed * tps["value"] / config["peak_flops"], rel=1e-3, abs=1e-4
    )


def test_kernels_tiny_cpu(tmp_path: Path) -> None:
    """The kernels bench on CPU: every op of the learner step it covers, timed against its
    formula (eager here, so the two are the same code) with the copy bandwidth as bound."""
    figs, _ = run_bench("kernels", tmp_path, "--reps", "2", "--repeats", "2")
    ops = ["norm_forward", "norm_backward", "swiglu_forward", "swiglu_backward"]
    ops += ["rope_forward", "rope_backward", "logit_stats", "logit_grad"]
    assert [f["figure"] for f in figs] == [f"{op}_gb_per_s" for op in ops]
    for op, fig in zip(ops, figs, strict=True):
        check_common(fig, "kernels")
        config = fig["config"]
        assert fig["baseline"] == f"torch_eager_{op}"
        assert config["tokens"] == 256 and config["logit_rows"] == 64
        us = config["us"]
        assert set(us) == {"ours", "torch_eager"}
        assert fig["value"] == pytest.approx(config["bytes"] / us["ours"] / 1e3, rel=1e-2)
        assert len({f["bound"] for f in figs}) == 1  # one copy bandwidth for all
    by_op = {op: f["config"]["bytes"] for op, f in zip(ops, figs, strict=True)}
    # tiny shape, float32: hidden 256, vocab 8192
    assert by_op["norm_forward"] == 4 * 256 * 256 * 4 + 4 * 256
    assert by_op["logit_grad"] == 2 * by_op["logit_stats"] == 2 * 64 * 8192 * 4


def test_mfu_definition_reproduces_the_reference_figures() -> None:
    """BENCHMARKS.md's reference transformers steps on the 0.5B shape at 16 x 512 (eager
    83k tokens/s = 25.5 %, compiled 131k = 40.2 % of 989 TFLOP/s) are the causal-attention
    definition; weights only would give 24.9 % and 39.3 %."""
    from bench.learner_step import H200_BF16_PEAK, model_flops_per_token
    from bench.shapes import SHAPES

    per_token = model_flops_per_token(494_032_768, SHAPES["0.5b"], 512)
    for tokens_per_s, stated in ((83e3, 0.255), (131e3, 0.402)):
        assert per_token * tokens_per_s / H200_BF16_PEAK == pytest.approx(stated, abs=0.0015)
        assert 6 * 494_032_768 * tokens_per_s / H200_BF16_PEAK < stated - 0.005


def test_all_gpu_bookkeeping(tmp_path: Path) -> None:
    assert all_gpu.device_slug("NVIDIA H200") == "h200"
    assert all_gpu.device_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"
    assert all_gpu.device_slug("cpu (AMD EPYC)") == "cpu"
    names = [j.bench for j in all_gpu.jobs("cuda")]
    assert names == [
        *("weight_sync", "weight_sync", "rollout_decode", "learner_step", "kernels"),
        *("cold_start", "e2e"),
    ]

    missing = all_gpu.Job("nope", "no_such_bench_module", [])
    skipped = all_gpu.run_job(missing, "cuda", 100.0, tmp_path)
    assert skipped.status == "skipped" and "does not exist" in skipped.note
    late = all_gpu.run_job(all_gpu.jobs("cuda")[2], "cuda", 1.0, tmp_path)
    assert late.status == "skipped" and "left" in late.note

    def fig(bench: str, shape: str) -> dict[str, Any]:
        return {"bench": bench, "figure": "f", "device": "NVIDIA H200", "config": {"s": shape}}

    ok = [
        all_gpu.Outcome(all_gpu.jobs("cuda")[0], "ok", 1.0, figures=[fig("weight_sync", "a")]),
        all_gpu.Outcome(all_gpu.jobs("cuda")[1], "ok", 1.0, figures=[fig("weight_sync", "b")]),
        all_gpu.Outcome(all_gpu.jobs("cuda")[3], "failed", 1.0, "exit code 1"),
    ]
    written = all_gpu.write_results(ok, tmp_path / "results")
    assert written == {"weight_sync": tmp_path / "results" / "weight_sync-h200.json"}
    merged = json.loads(written["weight_sync"].read_text())
    assert [f["config"]["s"] for f in merged] == ["a", "b"]
    text = all_gpu.summary(ok, written)
    assert "failed" in text and "exit code 1" in text


def _bench_figures(
    cmd: list[str], out_file: Path, env: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """Run a bench's command line; the figures it wrote."""
    env = {**ENV, **(env or {})}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out_file.read_text())


# slow since it was added (c2372c1; 7ebb3d9 moved the mark onto the helper by mistake): two
# whole compiled runs, ~160 s on 2 cores. In make test, test_warm_up_cpu runs a bench's
# cold and warm children and checks their figures, tests/e2e/test_early_build.py a compiled
# learner's warm-up at start, tests/training/test_compile_warmup.py no recompile after it.
@pytest.mark.slow
def test_cold_start_cpu(tmp_path: Path) -> None:
    """Two short real runs (an empty compile cache, then the one it filled): each service's
    ready before the first step, the first step before the tenth would be, no recompile."""
    out_file = tmp_path / "cold_start.json"
    cmd = [sys.executable, "-m", "bench.cold_start", "--device", "cpu", "--shape", ""]
    cmd += ["--profile", "profiles/local-cpu.toml", "--variants", "grpo", "--steps", "4"]
    cmd += ["--json", str(out_file)]
    figs = _bench_figures(cmd, out_file, COMPILED)
    assert [f["figure"] for f in figs] == ["first_step_s_grpo_cold", "first_step_s_grpo_warm"]
    for fig in figs:
        assert list(fig) == list(KEYS)
        config = fig["config"]
        ready = [v for k, v in config.items() if k.startswith("ready_s.")]
        assert len(ready) >= 3 and 0 < max(ready) <= fig["value"]
        assert config["recompiles_after_step0"] == 0 and config["steps"] == 4
        assert 0 < fig["bound"] < fig["value"]
    assert figs[1]["baseline_value"] == figs[0]["value"]


@pytest.mark.slow
def test_warm_up_cpu(tmp_path: Path) -> None:
    """bench.warm_up on CPU (aot_eager): a cold and a warm child each build and warm
    up the learner; the figures carry what the compile did, the warm one against the cold;
    the profiled child lists its most expensive functions."""
    out_file = tmp_path / "warm_up.json"
    cmd = [sys.executable, "-m", "bench.warm_up", "--device", "cpu", "--shape", "tiny"]
    cmd += ["--profile", "profiles/local-cpu.toml", "--cprofile", "5", "--json", str(out_file)]
    # a step of 16 samples (not 256): the same cold and warm children and figures in ~50 s
    cmd += ["--controller.prompts_per_step", "4", "--rollout.n_samples", "4"]
    figs = _bench_figures(cmd, out_file, COMPILED)
    assert [f["figure"] for f in figs] == ["learner_warm_up_s_cold", "learner_warm_up_s_warm"]
    for fig in figs:
        assert list(fig) == list(KEYS)
        config = fig["config"]
        assert config["compile/frames"] > 0 and config["total_s"] == fig["value"]
        assert 0 < config["build_s"] < fig["value"] and config["cpu_kernels"] == []
    assert figs[1]["baseline_value"] == figs[0]["value"]
    assert len(figs[1]["config"]["cprofile_cumulative"]) == 5


@pytest.mark.slow
def test_e2e_preset_cpu(tmp_path: Path) -> None:
    """The one-GPU workload's preset, KL-PPO, shortened for a CPU: its prompts of 62 tokens,
    the critic's busy seconds, each pool's idle share, the bounds of the phases."""
    out_file = tmp_path / "e2e.json"
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "bench.e2e", "--preset", "one-gpu", "--variant", "ppo"]
    cmd += ["--device", "cpu", "--shape", "tiny", "--profile", "profiles/local-cpu-ppo.toml"]
    cmd += ["--steps", "4", "--skip", "1", "--staleness", "0", "--json", str(out_file)]
    cmd += ["--runs-dir", str(runs), "--rollout.max_new_tokens", "6"]
    cmd += ["--controller.prompts_per_step", "4", "--learner.trainer.mini_batches", "2"]
    (fig,) = _bench_figures(cmd, out_file)
    config = fig["config"]
    assert fig["figure"] == "samples_per_s_staleness0_local-cpu-ppo"
    assert config["preset"] == "one-gpu ppo" and config["samples_per_step"] == 4 * 8
    assert config["critic_s_per_step"] > 0 and 0 <= config["idle_share.local"] < 1
    # the critic's busy time is its annotation and its value updates (spans may overlap)
    annotate, update = config["critic_annotate_s_per_step"], config["critic_update_s_per_step"]
    assert annotate > 0 and update > 0
    assert max(annotate, update) <= config["critic_s_per_step"] <= annotate + update + 1e-6
    assert config["critic_tail_s"] > 0  # a step's last group leaves the critic after the rollout
    assert config["bound_max_s_per_step"] <= config["bound_sum_s_per_step"]
    assert config["skipped_updates"] == 0  # counted: the bench fails a run that skipped
    # the policy's gradient norm, at step 0 and over the run (to set beside a baseline's)
    assert 0 < config["grad_norm_step0"] < math.inf and 0 < config["grad_norm_median"] < math.inf
    # a step's groups finish within its generation phase
    assert 0 <= config["gen_end_spread_s"] <= config["gen_busy_s_per_step"]
    # the rollout phase against the decode memory bound at this device's copy bandwidth
    tokens = config["samples_per_step"] * 6 / config["gen_busy_s_per_step"]
    assert config["gen_tokens_per_s"] == pytest.approx(tokens, rel=1e-4)  # from rounded seconds
    assert 0 < config["decode_bound_fraction"] < 1 and config["copy_bandwidth_bytes_per_s"] > 0
    run_config = json.loads((runs / "e2e-local-cpu-ppo-s0/config.json").read_text())
    # the rows ignore end-of-sequence (the decode bound above needs every sample at 6 tokens)
    assert run_config["task"]["max_prompt_tokens"] == 62
    assert run_config["algorithm"]["use_kl_loss"] and run_config["critic"]["enabled"]


def test_the_e2e_workload_prompts_have_62_tokens(tmp_path: Path) -> None:
    from bench.e2e_workload import ROWS, write_prompts

    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer

    save_char_tokenizer(tmp_path / "tok")
    path = write_prompts(tmp_path / "p.jsonl", tmp_path / "tok")
    tokenizer = load_tokenizer(tmp_path / "tok")
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    assert len(rows) == ROWS and len({r["prompt"] for r in rows}) == ROWS
    assert {len(tokenizer.encode(r["prompt"])) for r in rows} == {62}
    assert all(r["ignore_eos"] is True for r in rows)  # every sample runs to its budget


def test_a_variant_may_set_an_inline_table() -> None:
    """--variant's commas split pairs, not an inline table's: a bisect of the compile
    options (triton.enable_pdl under an SM share) needs the whole table as one value."""
    from bench.learner_step import parse_variant

    text = 'compile_options={ "triton.enable_pdl" = false, "a" = 1 },compile_mode=default'
    assert parse_variant(text) == {
        "compile_options": {"triton.enable_pdl": False, "a": 1},
        "compile_mode": "default",
    }
    assert parse_variant("sizes=[1, 2],x=true") == {"sizes": [1, 2], "x": True}
    with pytest.raises(SystemExit, match="key=value"):
        parse_variant("trunk_graphs")


@pytest.mark.slow
def test_e2e_long_tail_preset_cpu(tmp_path: Path) -> None:
    """The long-tail workload at a tiny size: every prompt's samples run to its own budget
    (a capped lognormal), and each run reports its generated tokens/s, the decode batch,
    the dropped share of generated tokens and the older-version share of trained ones."""
    from bench.e2e_workload import long_tail_budgets

    from pipeline.wire.recording import QueueReader

    budgets = long_tail_budgets(4096, 40)
    assert min(budgets) >= 1 and max(budgets) == 40
    assert 8 <= sorted(budgets)[len(budgets) // 2] <= 12  # median cap / 4
    assert 0.02 < sum(b == 40 for b in budgets) / len(budgets) < 0.07  # the capped tail
    out_file = tmp_path / "e2e.json"
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "bench.e2e", "--preset", "one-gpu-long-tail"]
    cmd += ["--device", "cpu", "--shape", "tiny", "--profile", "profiles/local-cpu.toml"]
    cmd += ["--cap", "40", "--prompt-tokens", "16", "--steps", "5", "--skip", "1"]
    cmd += ["--json", str(out_file), "--runs-dir", str(runs)]
    cmd += ["--controller.prompts_per_step", "4", "--learner.trainer.mini_batches", "2"]
    sync, asynchronous = _bench_figures(cmd, out_file)
    assert sync["config"]["workload"] == "long-tail (cap 40)"
    for fig in (sync, asynchronous):
        config = fig["config"]
        assert config["generated_tokens_per_s"] > 0 and config["decode_batch_mean"] > 0
        assert 0 < config["decode_batch_occupancy"] <= 1
        assert 0 <= config["dropped_token_share"] < 1
        assert config["skipped_updates"] == 0 and config["grad_norm_median"] > 0
    assert sync["config"]["older_version_token_share"] == 0  # synchronous: all current
    assert asynchronous["config"]["older_version_token_share"] > 0
    want = dict(enumerate(budgets))
    for record in QueueReader(runs / "e2e-local-cpu-s1/queues/rollouts.log"):
        message = record.decode()
        budget = want[int(message.body.uid.rsplit("-", 1)[1])]
        lengths = {len(message.tensor(s.response_ids)) for s in message.body.samples}
        assert message.body.max_new_tokens == budget and lengths == {budget}
