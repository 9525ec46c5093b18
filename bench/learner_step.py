"""Learner-step bench: tokens/s and MFU of one PPO update of `PolicyTrainer`.

    python -m bench.learner_step [--shape 0.5b|tiny|7b] [--device cuda|cpu]
        [--batch 16] [--seq 512] [--prompt 128] [--steps 10] [--warmup 2] [--json OUT]

A random-weight model of the shape is saved once with `save_model`; `PolicyTrainer` loads it
as the trainer always does (fp32 master weights with bf16 compute copies on CUDA, packed
micro-batches, fused chunked log-probs, grad clipping, AdamW), with the batching and compile
knobs of `--profile` (on CUDA profiles/h200-single.toml), no reference model and no KL loss,
and runs `train_step` on a fixed synthetic batch of `--batch` samples of `--prompt` prompt +
`--seq - --prompt` response tokens. One step is the whole update: forward + backward +
optimizer step over every token (with one optimizer step per update the proximal log-probs
come from that forward, `trainer.fuse_proximal`). After `--warmup` untimed steps each system
is timed two ways, in the same run:
  consecutive  `--windows` runs of `--steps` steps back to back, the device drained only
               before and after each run; each step is queued before the previous step's
               metrics (ours: `submit_step(...).result()`; transformers: the loss) are read,
               as a training loop runs them. A step's seconds run from a CUDA event queued
               when it is submitted to the next step's (the device's time per step, its
               waits for the host included); reported: the median over all runs' steps,
               with each run's mean wall seconds per step and the host's seconds in
               each submission (ours waits there, at its optimizer, for the previous
               step's outcome: in steady state it equals the step's seconds, whichever
               side bounds it; the profiler tells which).
  drained      `--steps` single steps, each with the device drained before and after (the
               host's work before a step's first kernel is then exposed); the median.
`--timing` picks the headline figures (default consecutive); the other timing's figures
follow them with a `_drained` / `_consecutive` suffix. tokens = batch * seq per step (every
token goes through backward).
In the same run:
  baselines  a `transformers` training step on the same tokens from the same directory: bf16
             parameters, fused AdamW (CUDA), cross-entropy over all tokens; eager and under
             `torch.compile` (CUDA only; warmed up like ours), timed both ways
  bound      the bf16 8192^3 matmul rate measured here (fp32 1024^3 on CPU), as
             tokens/s = rate / (model FLOPs per token)
MFU = model FLOPs per token * tokens / seconds / peak (989e12 bf16 dense on an H200; on CPU the
measured matmul rate), with model FLOPs per token = 6 * params + 6 * layers * (heads *
head_dim) * seq: the weights' matmuls plus causal attention (QK^T and AV over half the
score matrix, forward and backward), the definition of the PaLM paper with the causal half
and the one behind the reference figures of docs/performance.md (transformers compiled at 131k
tokens/s = 40.2 %). `mfu_6n` (weights only) is reported next to it. The proximal forward
is not counted. Our trainer sends only the positions that predict response tokens through
the output layer (the loss reads nothing else), so its step executes fewer FLOPs than the
model FLOPs counted (0.5B shape, prompt 128 of 512: 6.7 % fewer); `mfu_executed` counts
only those it executes (transformers' step computes every position's logits).
On CUDA a thread samples the GPU's SM clock, power and clock-limit reasons through NVML
every 10 ms (bench/gpu_clocks.py): the JSON gives each consecutive step its clock
(`clock_consecutive`) and each system's median step among those run wholly at the run's top
clock (`at_top_clock`), since an H200 at its 700 W cap lowers the clock under this load.
Prints a table, then one JSON object per figure (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import device_defaults, emit, figure, table
from bench.gpu_clocks import ClockSampler, at_top_clock, per_step
from bench.optimizer_paths import optimizer_paths
from bench.profiling import print_profile, sync_sites
from bench.rollout_decode import (
    SHAPES,
    bench_dtype,
    device_label,
    free_memory,
    matmul_rate,
    progress,
    save_random_model,
    sync,
    timed,
)

BENCH = "learner_step"
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s of one H200 (SXM), without sparsity
TRAIN_RANGES = ("train/forward", "train/backward", "train/optimizer")  # marked by TrainEngine

DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"shape": "0.5b", "batch": 16, "seq": 512},
    "cpu": {"shape": "tiny", "batch": 2, "seq": 64},
}


def synthetic_batch(
    batch: int, seq: int, prompt: int, vocab: int, seed: int
) -> tuple[Any, torch.Tensor]:
    """(ExperienceBatch for the trainer, the same tokens as a (batch, seq) id tensor)."""
    from pipeline.training import ExperienceBatch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (batch, seq), generator=gen)  # (batch, seq)
    response = seq - prompt
    behaviour = -math.log(vocab) + 0.1 * torch.randn(batch, response, generator=gen)
    advantages = torch.randn(batch, response, generator=gen)
    experience = ExperienceBatch.from_lists(
        prompt_ids=list(ids[:, :prompt]),
        response_ids=list(ids[:, prompt:]),
        behaviour_logprobs=list(behaviour),
        scores=torch.zeros(batch),
        uids=[f"p{i // 4}/{i % 4}" for i in range(batch)],
        advantages=list(advantages),
    )
    return experience, ids


# how a batch is pushed through the model: the profile's [learner.trainer] and its kernels
PROFILE_KNOBS = (
    "compile",
    "padding_free",
    "max_tokens_per_micro_batch",
    "logprob_chunk_tokens",
    "logprob_keep_logits",
    "compile_mode",
    "compile_options",
    "pack_bucket_tokens",
    "fused_rope",
    "trunk_graphs",
    "fused_norm",
    "packed_mlp",
    "uniform_attention",
    "tied_grad_rows",
    "exp_avg_dtype",
    "compile_loss",
)


# reported with them in the JSON (the bench sets or leaves these itself)
REPORTED_KNOBS = ("param_dtype", "grad_clip", "flat_optimizer")


def profile_knobs(path: Path | None, device: str) -> dict[str, Any]:
    """The profile's micro-batch budget and first moment, and the switches its learner's
    kernels stand for on this device (one process)."""
    if path is None:
        return {}
    from pipeline.config import load_config
    from pipeline.training.config import kernel_switches

    trainer = load_config(path, {}).learner.trainer
    return {
        "max_tokens_per_micro_batch": trainer.max_tokens_per_micro_batch,
        "exp_avg_dtype": trainer.exp_avg_dtype,
        **kernel_switches(trainer.kernels, device, sharded=False, policy=True),
    }


def parse_variant(text: str) -> dict[str, Any]:
    """ "key=value,key=value" of TrainerConfig fields; values parsed as TOML (an inline
    table's or array's commas do not split: compile_options={ "a" = false, "b" = true })."""
    import tomllib

    items, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"{": 1, "[": 1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(text[start:i])
            start = i + 1
    items.append(text[start:])
    out: dict[str, Any] = {}
    for item in filter(str.strip, items):
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--variant wants key=value pairs, got {item!r}")
        try:
            out[key.strip()] = tomllib.loads(f"v = {value.strip()}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = value.strip()  # a bare string such as reduce-overhead
    return out


def tagged_path(path: str | None, tag: str) -> str | None:
    """`path` with "-tag" before its .json suffix (one trace file per timed trainer)."""
    if path is None:
        return None
    cut = path.find(".json")
    return f"{path[:cut]}-{tag}{path[cut:]}" if cut >= 0 else f"{path}-{tag}"


# "drained": seconds per step; "consecutive": each step's seconds in runs of consecutive
# steps; "consecutive_wall": each run's mean wall seconds per step; "consecutive_host": the
# host's seconds in each submission (ours: waits for the previous step at its optimizer)
Timings = dict[str, list[float]]


def time_consecutive(
    runs: Timings,
    submit: Callable[[], Any],
    settle: Callable[[Any], Any],
    device: torch.device,
    steps: int,
    windows: int,
    sampler: ClockSampler | None = None,
) -> list[dict[str, Any]]:
    """`windows` runs of `steps` steps back to back, each submitted before the previous
    one is settled (its metrics or loss read), the device drained only before the first
    and after the last of a run; into `runs`' consecutive entries. A step's seconds run
    from a mark queued when it is submitted to the next step's mark (CUDA events: the
    device's time per step, idle waits for the host included). Returns each step's clock
    samples (`gpu_clocks.per_step`; none without a sampler): the device is idle when a
    run's first mark is queued, so that mark runs at once and anchors the device's step
    times on the host's clock."""
    clocks: list[dict[str, Any]] = []
    for _ in range(windows):
        sync(device)
        start = time.perf_counter()
        marks, pending = [_mark(device)], None
        anchor = time.perf_counter()  # when the first mark ran: the device is idle
        for k in range(steps):
            if k:
                marks.append(_mark(device))
            before = time.perf_counter()
            queued = submit()
            runs.setdefault("consecutive_host", []).append(time.perf_counter() - before)
            if pending is not None:
                settle(pending)
            pending = queued
        settle(pending)
        marks.append(_mark(device))
        sync(device)
        runs.setdefault("consecutive_wall", []).append((time.perf_counter() - start) / steps)
        runs.setdefault("consecutive", []).extend(
            _seconds_between(a, b) for a, b in itertools.pairwise(marks)
        )
        if sampler is not None:
            edges = [_seconds_between(marks[0], m) for m in marks]
            clocks += per_step(sampler.samples, anchor, edges)
    return clocks


def _mark(device: torch.device) -> Any:
    if device.type != "cuda":
        return time.perf_counter()
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    return event


def _seconds_between(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if isinstance(a, torch.cuda.Event) else b - a


def trainer_config(
    args: argparse.Namespace, peak: float, *, kl: bool, overrides: dict[str, Any] | None = None
) -> Any:
    from pipeline.training import TrainerConfig

    fields: dict[str, Any] = {
        **profile_knobs(args.profile, args.device),
        "lr": 1e-6,
        "device": args.device,
        "param_dtype": "bfloat16" if args.device == "cuda" else "float32",
        "keep_reference": kl,
        "peak_flops": peak,
    }
    if args.trainer_compile is not None:
        fields["compile"] = args.trainer_compile
    if args.padded:
        fields["padding_free"] = False
    if args.micro_tokens:
        fields["max_tokens_per_micro_batch"] = args.micro_tokens
    if args.chunk_tokens:
        fields["logprob_chunk_tokens"] = args.chunk_tokens
    fields.update(overrides or {})
    return TrainerConfig(**fields)


def rounded(runs: Timings) -> dict[str, list[float]]:
    return {k: [round(x, 5) for x in v] for k, v in runs.items()}


def run_ours(
    model_dir: Path,
    experience: Any,
    args: argparse.Namespace,
    device: torch.device,
    peak: float,
    *,
    kl: bool,
    overrides: dict[str, Any] | None = None,
    trace: str | None = None,
) -> tuple[Timings, dict[str, Any]]:
    from pipeline.algorithms import AlgorithmConfig
    from pipeline.training import PolicyTrainer

    config = trainer_config(
        args, peak, kl=kl, overrides={**parse_variant(args.set), **(overrides or {})}
    )
    algorithm = AlgorithmConfig(advantage_estimator="grpo", use_kl_loss=kl)
    trainer = PolicyTrainer(model_dir, config, algorithm)
    metrics: dict[str, float] = {}

    def step() -> dict[str, float]:
        return trainer.train_step(experience)

    for _ in range(args.warmup):
        metrics = step()
    runs: Timings = {"drained": []}
    for _ in range(args.steps):
        seconds, metrics = timed(step, device)
        runs["drained"].append(seconds)
    results: list[dict[str, float]] = []
    clocks = time_consecutive(
        runs,
        lambda: trainer.submit_step(experience),
        lambda pending: results.append(pending.result()),
        device,
        args.steps,
        args.windows,
        args.sampler,
    )
    skipped = sum(m.get("actor/skipped_updates", 0.0) for m in [metrics, *results])
    progress(f"ours (kl={kl}, {overrides or 'profile'}): {rounded(runs)} s")
    profiled, profiled_consecutive = None, None
    if args.torch_profile:
        profiled = print_profile(step, device, rows=50, ranges=TRAIN_RANGES, trace=trace)
        profiled_consecutive = profile_consecutive(
            trainer, experience, device, args.steps, tagged_path(trace, "consecutive")
        )
    syncs = sync_sites(step, device) if args.sync_debug else None
    if skipped > 0:
        raise RuntimeError(f"the trainer skipped {skipped:.0f} updates (non-finite loss)")
    # the no-grad proximal forward alone: how much of a step is not forward + backward + step
    prox = [timed(lambda: trainer.compute_logprobs(experience), device)[0] for _ in range(3)]
    optimizer = optimizer_paths(trainer.engine, device)  # last: it moves the weights
    info = {
        "params": trainer.engine.num_params,
        "trainer": {
            "profile": str(args.profile) if args.profile else None,
            **{k: getattr(config, k) for k in (*PROFILE_KNOBS, *REPORTED_KNOBS)},
            "keep_reference": kl,
            "use_kl_loss": kl,
        },
        "trainer_reported_step_s": round(metrics.get("perf/step_time_s", float("nan")), 5),
        "prox_logprobs_s": round(statistics.median(prox), 5),
        **({"optimizer_paths": optimizer} if optimizer else {}),
        **({"profile": profiled} if profiled else {}),
        **({"profile_consecutive": profiled_consecutive} if profiled_consecutive else {}),
        **({"sync_sites": syncs} if syncs is not None else {}),
        **({"clocks": clocks} if clocks else {}),
    }
    return runs, info


def profile_consecutive(
    trainer: Any, experience: Any, device: torch.device, steps: int, trace: str | None
) -> dict[str, Any]:
    """--torch-profile, as the headline timing runs steps: `steps` submitted back to back
    (each queued before the previous one's result is read) under torch.profiler. Returns
    print_profile's summary of the whole run with its wall and device-busy/idle ms and
    kernel count per step (`per_step`): in steady state, whether the device idles."""

    def run() -> None:  # one run of the headline timing's loop (its figures not kept)
        time_consecutive(
            {},
            lambda: trainer.submit_step(experience),
            lambda pending: pending.result(),
            device,
            steps,
            1,
        )

    summary = print_profile(run, device, rows=50, ranges=TRAIN_RANGES, trace=trace)
    keys = ("wall_ms", "device_busy_ms", "device_idle_ms", "kernels")
    return {**summary, "steps": steps, "per_step": {k: round(summary[k] / steps, 3) for k in keys}}


def run_hf(
    model_dir: Path, ids: torch.Tensor, args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, Timings], dict[str, Any]]:
    """Seconds per transformers training step, eager and (CUDA) compiled."""
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=bench_dtype(device)).to(device)
    model.train()
    cuda = device.type == "cuda"
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, fused=cuda, foreach=not cuda)
    tokens = ids.to(device)
    compiled = cuda and not args.no_compile
    systems: dict[str, Any] = {"eager": model}
    if compiled:
        systems["compiled"] = torch.compile(model)
    out: dict[str, Timings] = {}
    clocks: dict[str, list[dict[str, Any]]] = {}
    for name, module in systems.items():

        def step(module: Any = module) -> torch.Tensor:
            loss = module(input_ids=tokens, labels=tokens, use_cache=False).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            return loss.detach()

        warmup = max(args.warmup, 2) if name == "compiled" else args.warmup
        for _ in range(warmup):
            step()
        runs: Timings = {"drained": []}
        losses: list[float] = []
        for _ in range(args.steps):
            seconds, loss = timed(step, device)
            runs["drained"].append(seconds)
            losses.append(float(loss))
        # the loss read one step late, like ours' metrics
        clocks[f"hf_{name}"] = time_consecutive(
            runs,
            step,
            lambda loss, out=losses: out.append(float(loss)),
            device,
            args.steps,
            args.windows,
            args.sampler,
        )
        if not all(math.isfinite(x) for x in losses):
            raise RuntimeError(f"transformers {name} step produced a non-finite loss")
        out[name] = runs
        progress(f"hf {name}: {rounded(runs)} s")
    info = {
        "transformers": transformers.__version__,
        "hf_dtype": str(bench_dtype(device)).removeprefix("torch."),
        "hf_optimizer": "AdamW fused" if cuda else "AdamW foreach",
        "hf_loss": "model(input_ids, labels=input_ids).loss (shifted CE over all tokens)",
        "hf_compile": "torch.compile(model), default mode" if compiled else "none",
        "hf_compiled": compiled,
        "clocks": clocks,
    }
    return out, info


def model_flops_per_token(n_params: int, config: Any, seq: int) -> int:
    """Training FLOPs per token of a `seq`-token sequence: 6 * params for the weights'
    matmuls, plus causal attention: QK^T and AV (2 * 2 * seq * heads * head_dim per token
    for the full score matrix, half of it causal) times 3 for forward and backward."""
    attn_width = config.num_attention_heads * config.head_dim
    return 6 * n_params + 6 * config.num_hidden_layers * attn_width * seq


def executed_flops_per_token(per_token: int, config: Any, seq: int, prompt: int) -> float:
    """`model_flops_per_token` less the output layer's 6 * vocab * hidden for the prompt
    positions, which our trainer never sends through it (only positions that predict a
    response token are scored: `score_index`): the FLOPs its step executes, per token of
    the batch. transformers' step scores every position (its executed FLOPs are the model
    FLOPs)."""
    head = 6 * config.vocab_size * config.hidden_size
    return per_token - head * prompt / seq


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    label = device_label(device)
    cuda = device.type == "cuda"
    mm_dtype, mm_n = (torch.bfloat16, 8192) if cuda else (torch.float32, 1024)
    rate = matmul_rate(device, mm_dtype, mm_n)
    progress(f"matmul {mm_n}^3: {rate / 1e12:.2f} TFLOP/s")
    if args.peak_flops:
        peak, peak_source = args.peak_flops, "--peak-flops"
    elif cuda:
        peak, peak_source = H200_BF16_PEAK, "H200 dense bf16 spec, 989e12"
    else:
        peak, peak_source = rate, "measured fp32 matmul rate (CPU has no spec peak here)"
    with tempfile.TemporaryDirectory(prefix="learner-step-") as tmp:
        model_dir = Path(tmp)
        config = save_random_model(args.shape, model_dir, dtype=bench_dtype(device), device=device)
        experience, ids = synthetic_batch(
            args.batch, args.seq, args.prompt, config.vocab_size, args.seed
        )
        ours, ours_info = run_ours(
            model_dir, experience, args, device, peak, kl=False, trace=args.trace
        )
        clocks = {"ours": ours_info.pop("clocks", [])}
        free_memory(device)
        variants: dict[str, Timings] = {}
        variant_info: dict[str, Any] = {}
        for i, text in enumerate(args.variant, 1):
            name = f"ours[{text}]"
            try:
                runs, vinfo = run_ours(
                    model_dir,
                    experience,
                    args,
                    device,
                    peak,
                    kl=False,
                    overrides=parse_variant(text),
                    trace=tagged_path(args.trace, f"v{i}"),
                )
            except Exception as exc:  # a variant is an experiment: report it, keep the rest
                progress(f"{name} failed: {type(exc).__name__}: {exc}")
                variant_info[name] = {"error": f"{type(exc).__name__}: {exc}"[:2000]}
            else:
                variants[name] = runs
                clocks[name] = vinfo.pop("clocks", [])
                keep = ("trainer", "profile", "profile_consecutive", "sync_sites")
                variant_info[name] = {k: vinfo[k] for k in keep if k in vinfo}
            free_memory(device)
        ours_kl: Timings | None = None
        if args.kl:
            ours_kl, _ = run_ours(
                model_dir,
                experience,
                args,
                device,
                peak,
                kl=True,
                trace=tagged_path(args.trace, "kl"),
            )
            free_memory(device)
        hf, hf_info = run_hf(model_dir, ids, args, device)
        clocks.update(hf_info.pop("clocks"))
        free_memory(device)
    tokens = args.batch * args.seq
    n_params = ours_info["params"]
    flops_per_token = model_flops_per_token(n_params, config, args.seq)
    executed = executed_flops_per_token(flops_per_token, config, args.seq, args.prompt)
    ours_names = ["ours", *variants]
    systems: dict[str, Timings] = {
        "ours": ours,
        **variants,
        **({"ours_kl": ours_kl} if ours_kl else {}),
        **{f"hf_{k}": v for k, v in hf.items()},
    }
    other = "drained" if args.timing == "consecutive" else "consecutive"

    def tps(name: str, timing: str = args.timing) -> float:
        return tokens / statistics.median(systems[name][timing])

    def mfu(name: str, timing: str = args.timing, per_token: float = flops_per_token) -> float:
        return per_token * tps(name, timing) / peak

    base = "hf_compiled" if hf_info["hf_compiled"] else "hf_eager"
    base_name = f"hf_train_step_{base.removeprefix('hf_')}"
    seconds = rounded_all(systems)
    per_system = {
        timing: {
            "tokens_per_s": {k: round(tps(k, timing), 1) for k in systems},
            "mfu": {k: round(mfu(k, timing), 4) for k in systems if k != "ours_kl"},
            "mfu_6n": {
                k: round(mfu(k, timing, 6 * n_params), 4) for k in systems if k != "ours_kl"
            },
            "mfu_executed": {k: round(mfu(k, timing, executed), 4) for k in ours_names},
        }
        for timing in ("consecutive", "drained")
    }
    cfg: dict[str, Any] = {
        "shape": args.shape,
        "params": n_params,
        "batch": args.batch,
        "seq": args.seq,
        "prompt": args.prompt,
        "response": args.seq - args.prompt,
        "tokens_per_step": tokens,
        "warmup": args.warmup,
        "steps": args.steps,
        "windows": args.windows,
        "torch_threads": torch.get_num_threads(),  # the host's CPU ops (--threads)
        "timing": args.timing,
        "timings": {
            "consecutive": f"median seconds per step over {args.windows} runs of "
            f"{args.steps} steps back to back (each queued before the previous one's "
            "metrics or loss are read; device drained before and after each run), a step's "
            "seconds from a CUDA event queued at its submission to the next step's",
            "drained": "median wall seconds of one train_step / training step, device "
            "drained before and after it",
        },
        "seconds": {k: v["drained"] for k, v in seconds.items()},
        "seconds_consecutive": {k: v["consecutive"] for k, v in seconds.items()},
        "seconds_consecutive_wall": {k: v["consecutive_wall"] for k, v in seconds.items()},
        # the host's seconds per submission (ours includes its wait for the previous step)
        "seconds_consecutive_host": {k: v["consecutive_host"] for k, v in seconds.items()},
        **per_system[args.timing],
        **{f"{k}_{other}": v for k, v in per_system[other].items()},
        "mfu_formula": "(6 * params + 6 * layers * heads * head_dim * seq) * batch * seq "
        "/ seconds / peak_flops (causal attention counted; mfu_6n: 6 * params only)",
        "flops_per_token": flops_per_token,
        "mfu_executed_formula": "as mfu, less the output layer's 6 * vocab * hidden FLOPs for "
        "the batch's prompt positions, which ours does not compute (it scores response "
        "positions only; transformers' step computes and scores every position)",
        "executed_flops_per_token": round(executed),
        "peak_flops": peak,
        "peak_source": peak_source,
        "matmul_flops_per_s": round(rate),
        "matmul": f"{mm_n}^3 {str(mm_dtype).removeprefix('torch.')}, 2*n^3 FLOPs each",
        "bound_formula": "tokens_per_s: matmul_flops_per_s / flops_per_token; mfu: matmul / peak",
        "algorithm": "grpo advantages given, ppo clip 0.2, no KL loss, entropy not trained",
        "torch": torch.__version__,
        **{k: v for k, v in ours_info.items() if k != "params"},
        **({"variants": variant_info} if variant_info else {}),
        **hf_info,
        **clock_figures(systems, clocks, flops_per_token, tokens, peak),
    }
    bound_tps = rate / flops_per_token

    def fig(name: str, value: float, baseline: str, baseline_value: float, bound: float) -> Any:
        return figure(
            BENCH,
            name,
            value,
            baseline=baseline,
            baseline_value=baseline_value,
            bound=bound,
            config=cfg,
            device=label,
        )

    figures = []
    for timing, suffix in ((args.timing, ""), (other, f"_{other}")):
        figures += [
            fig(
                f"tokens_per_s{suffix}",
                tps("ours", timing),
                base_name,
                tps(base, timing),
                bound_tps,
            ),
            fig(
                f"tokens_per_s_vs_eager{suffix}",
                tps("ours", timing),
                "hf_train_step_eager",
                tps("hf_eager", timing),
                bound_tps,
            ),
            fig(
                f"mfu{suffix}",
                mfu("ours", timing),
                base_name,
                mfu(base, timing),
                rate / peak,
            ),
        ]
    if ours_kl:
        figures.append(
            figure(
                BENCH,
                "tokens_per_s_kl",
                tps("ours_kl"),
                baseline=base_name,
                baseline_value=tps(base),
                bound=bound_tps,
                config={**cfg, "variant": "reference model kept, k3 KL loss"},
                device=label,
            )
        )
    return figures


def clock_figures(
    systems: dict[str, Timings],
    clocks: dict[str, list[dict[str, Any]]],
    flops_per_token: float,
    tokens: int,
    peak: float,
) -> dict[str, Any]:
    """The consecutive steps' SM clocks and power (sampled through NVML; nothing where it
    is missing), and each system's median step among the steps run entirely at the top
    SM clock seen: what the code does when the board does not lower its clock."""
    if not any(clocks.values()):
        return {}
    top = max(c["sm_mhz_min"] for steps in clocks.values() for c in steps if c)
    at_top: dict[str, Any] = {}
    for name, steps in clocks.items():
        fast = at_top_clock(systems[name]["consecutive"], steps, top) if steps else []
        if fast:
            seconds = statistics.median(fast)
            at_top[name] = {
                "steps": len(fast),
                "of": len(steps),
                "median_s": round(seconds, 5),
                "mfu": round(flops_per_token * tokens / seconds / peak, 4),
            }
    return {
        "clock_consecutive": clocks,
        "clock_top_sm_mhz": top,
        "at_top_clock": at_top,
        "clock_note": "per consecutive step: the median and lowest SM clock (MHz), mean "
        "power (W), highest temperature and the clock-limit reasons of the NVML samples "
        "(every 10 ms) that fell in it; at_top_clock: the steps whose every sample ran at "
        "the top clock seen in the run, their median seconds and the MFU of that median",
    }


def rounded_all(systems: dict[str, Timings]) -> dict[str, dict[str, list[float]]]:
    return {name: rounded(runs) for name, runs in systems.items()}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{BENCH}")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--batch", type=int, default=None, help="sequences per step")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens (default seq/4)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=10, help="timed steps per timing run")
    ap.add_argument("--windows", type=int, default=3, help="runs of --steps consecutive steps")
    ap.add_argument(
        "--timing",
        choices=["consecutive", "drained"],
        default="consecutive",
        help="which timing the headline figures use (both are measured and reported)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--peak-flops", type=float, default=None, help="MFU denominator")
    ap.add_argument("--no-compile", action="store_true", help="skip the compiled HF baseline")
    ap.add_argument("--kl", action="store_true", help="also time the KL-loss variant")
    ap.add_argument(
        "--torch-profile",
        action="store_true",
        help="print torch.profiler tables of one step and of --steps consecutive steps",
    )
    ap.add_argument(
        "--trace",
        default=None,
        help="with --torch-profile: write the timelines (.json[.gz]; the consecutive steps' "
        "with -consecutive); variants add -v1, -v2...",
    )
    ap.add_argument(
        "--sync-debug", action="store_true", help="list where a step makes the host wait (CUDA)"
    )
    ap.add_argument(
        "--profile",
        type=Path,
        default=None,
        help="take the trainer's batching/compile knobs from this profile's [learner.trainer] "
        "(default on cuda: profiles/h200-single.toml; on cpu: none)",
    )
    ap.add_argument(
        "--trainer-compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="override trainer.compile",
    )
    ap.add_argument("--padded", action="store_true", help="trainer.padding_free=false")
    ap.add_argument("--micro-tokens", type=int, default=None, help="max_tokens_per_micro_batch")
    ap.add_argument("--chunk-tokens", type=int, default=None, help="logprob_chunk_tokens")
    ap.add_argument(
        "--set",
        default="",
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="TrainerConfig overrides of ours (after the profile's knobs)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="KEY=VALUE[,KEY=VALUE]",
        help="also time the trainer with these TrainerConfig overrides (repeatable); reported "
        "next to ours in the same run",
    )
    args = ap.parse_args(argv)
    device_defaults(args, DEFAULTS)
    if args.profile is None and args.device == "cuda":
        args.profile = Path(__file__).resolve().parents[1] / "profiles" / "h200-single.toml"
    if args.prompt is None:
        args.prompt = args.seq // 4
    if (
        not 1 <= args.prompt < args.seq
        or args.batch < 1
        or args.steps < 1
        or args.warmup < 0
        or args.windows < 1
    ):
        raise SystemExit(
            "need 1 <= --prompt < --seq, --batch >= 1, --steps >= 1, --windows >= 1, --warmup >= 0"
        )
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("PIPELINE_LOG_LEVEL", "warning")
    args.sampler = ClockSampler.open(torch.device(args.device))
    if args.sampler is not None:
        args.sampler.start()
    try:
        figs = run(args)
    finally:
        if args.sampler is not None:
            args.sampler.close()
    c = figs[0]["config"]
    print(
        f"{BENCH}  shape={args.shape} device={figs[0]['device']} batch={args.batch} "
        f"seq={args.seq} (prompt {args.prompt}) params={c['params'] / 1e6:.1f}M "
        f"matmul={c['matmul_flops_per_s'] / 1e12:.2f} TFLOP/s peak={c['peak_flops'] / 1e12:.2f}"
    )
    other = "drained" if c["timing"] == "consecutive" else "consecutive"
    for label, suffix in ((c["timing"], ""), (other, f"_{other}")):
        tps, mfu = c[f"tokens_per_s{suffix}"], c[f"mfu{suffix}"]
        print(f"  {label}:")
        print("    tokens/s " + "  ".join(f"{k} {v:.1f}" for k, v in tps.items()))
        print("    mfu      " + "  ".join(f"{k} {v:.4f}" for k, v in mfu.items()))
    if c.get("at_top_clock"):
        top = "  ".join(
            f"{k} {v['median_s'] * 1e3:.2f} ms ({v['steps']}/{v['of']} steps) mfu {v['mfu']:.4f}"
            for k, v in c["at_top_clock"].items()
        )
        print(f"  at the top SM clock ({c['clock_top_sm_mhz']} MHz): {top}")
    print(table(figs))
    emit(figs, args.json)


if __name__ == "__main__":
    main()
