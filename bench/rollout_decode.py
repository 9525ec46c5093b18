"""Rollout-decode bench: generated tokens/s of the built-in engine against transformers.

    python -m bench.rollout_decode [--shape 0.5b|tiny|7b] [--device cuda|cpu]
        [--batches 64,256] [--prompt 128] [--new 256] [--warmup 2] [--repeats 3] [--json OUT]

A random-weight model of the shape is saved once with `save_model` and loaded from that
directory by `TorchEngine` (CUDA graphs and compiled blocks on CUDA) and by `transformers`. Every system gets the
same random prompts of exactly `--prompt` tokens and generates exactly `--new` tokens per
sample (no stop tokens), sampling at temperature 1 with top-p 1 and no top-k; each run is
timed from the call to the last token on the host (prefill included), after `--warmup`
untimed runs, and the median of `--repeats` runs is reported.
In the same run:
  baselines  transformers `generate`: the default dynamic cache, and
             `cache_implementation="static"` with transformers' own torch.compile of the decode
             forward (CUDA only; on CPU the static cache runs eager)
  bound      bytes that one decode step must read (every weight once, plus each sample's
             cached keys and values) over the device-to-device copy bandwidth measured here
Prints a table, then one JSON object per figure (see docs/performance.md).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_device, device_defaults, emit, figure, table
from bench.profiling import print_profile
from bench.shapes import SHAPES
from pipeline.models import CausalLM, ModelConfig, save_model

BENCH = "rollout_decode"


# per device: what a plain `--device X` run measures
DEFAULTS: dict[str, dict[str, Any]] = {
    "cuda": {"shape": "0.5b", "batches": "64,256", "prompt": 128, "new": 256},
    "cpu": {"shape": "tiny", "batches": "4,8", "prompt": 16, "new": 16},
}
COPY_BW_FORMULA = "2 * nbytes * iters / seconds (bytes read + bytes written by dst.copy_(src))"


# -- helpers shared with learner_step ---------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], Any], device: torch.device) -> tuple[float, Any]:
    """Seconds of one call, with the device drained before and after."""
    sync(device)
    start = time.perf_counter()
    result = fn()
    sync(device)
    return time.perf_counter() - start, result


_START = time.monotonic()


def progress(message: str) -> None:
    """One line on stderr with the seconds since start: where a timed-out run spent them."""
    print(f"[{time.monotonic() - _START:7.1f} s] {message}", file=sys.stderr, flush=True)


def device_label(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_device()


def bench_dtype(device: torch.device) -> torch.dtype:
    """bf16 on GPUs (what rollouts and the learner's compute use there), fp32 on CPU."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def save_random_model(
    shape: str,
    root: Path,
    *,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    vocab_size: int | None = None,
) -> ModelConfig:
    """A randomly initialised CausalLM of `shape` (with `vocab_size` in place of the shape's
    own where given), saved as an HF checkpoint in `root`.

    Built on `device` (a 7B init on the CPU takes minutes) and written in `dtype`."""
    config = SHAPES[shape].replace(
        torch_dtype=str(dtype).removeprefix("torch."),
        vocab_size=vocab_size or SHAPES[shape].vocab_size,
    )
    torch.manual_seed(seed)
    with torch.device(device):
        model = CausalLM(config)
    model.init_weights()
    model.to(dtype)
    save_model(model, root)
    del model
    free_memory(device)
    return config


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def copy_bandwidth(device: torch.device, nbytes: int | None = None) -> float:
    """Bytes/s of dst.copy_(src) on `device`, counting bytes read plus bytes written."""
    if nbytes is None:
        nbytes = 2**30 if device.type == "cuda" else 2**26
    iters = 50 if device.type == "cuda" else 10
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    seconds, _ = timed(lambda: [dst.copy_(src) for _ in range(iters)], device)
    return 2.0 * nbytes * iters / seconds


def matmul_rate(device: torch.device, dtype: torch.dtype, n: int) -> float:
    """FLOP/s of an (n, n) @ (n, n) matmul in `dtype` (2 n^3 FLOPs each)."""
    iters = 50 if device.type == "cuda" else 5
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    for _ in range(3):
        torch.matmul(a, b, out=out)
    seconds, _ = timed(lambda: [torch.matmul(a, b, out=out) for _ in range(iters)], device)
    return 2.0 * n**3 * iters / seconds


def median_runs(
    fn: Callable[[], Any],
    device: torch.device,
    *,
    warmup: int,
    repeats: int,
    check: Callable[[Any], None],
    warmup_fn: Callable[[], Any] | None = None,
) -> list[float]:
    """Seconds of `repeats` timed calls after `warmup` untimed ones; every result checked."""
    for _ in range(warmup):
        result = (warmup_fn or fn)()
        if warmup_fn is None:
            check(result)
    runs = []
    for _ in range(repeats):
        seconds, result = timed(fn, device)
        check(result)
        runs.append(seconds)
    return runs


def _parse_batches(text: str) -> list[int]:
    try:
        batches = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--batches wants comma-separated integers, got {text!r}") from None
    if not batches or min(batches) < 1:
        raise SystemExit(f"--batches wants integers >= 1, got {text!r}")
    return batches


# -- the bound --------------------------------------------------------------------------------


def weight_bytes(model: CausalLM, config: ModelConfig) -> int:
    """Bytes of the weights one decode step reads: every distinct parameter once, except an
    untied input embedding (a decode step gathers only one row of it per sample)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not config.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def kv_bytes_per_token(config: ModelConfig, elem: int) -> int:
    """Cached key + value bytes of one token, all layers."""
    return config.num_hidden_layers * 2 * config.num_key_value_heads * config.head_dim * elem


def decode_bound_tokens_per_s(
    batch: int, prompt: int, new: int, w_bytes: int, kv_token: int, bandwidth: float
) -> float:
    """batch * new / sum over decode steps k = 1..new-1 of (W + batch * (prompt + k) * kv) / BW.

    The first token comes from the prefill, which is compute-bound and left out (the bound is
    optimistic by it); decode step k reads every weight once and the prompt + k cached tokens
    of each sample (the one written in that step included)."""
    steps = max(new - 1, 1)
    kv_tokens = batch * sum(prompt + k for k in range(1, steps + 1))
    seconds = (steps * w_bytes + kv_tokens * kv_token) / bandwidth
    return batch * new / seconds


BOUND_FORMULA = (
    "batch*new / sum_{k=1..new-1} (weight_bytes + batch*(prompt+k)*kv_bytes_per_token) "
    "/ copy_bandwidth; prefill not counted"
)


# -- the systems ------------------------------------------------------------------------------


def _prompts(batch: int, prompt: int, vocab: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(1, vocab, (batch, prompt), generator=gen)  # (batch, prompt)


def run_ours(
    model_dir: Path,
    batches: list[int],
    args: argparse.Namespace,
    device: torch.device,
    **engine_options: Any,
) -> tuple[dict[int, list[float]], dict[str, Any]]:
    from pipeline.engines import GenerationRequest, SamplingParams, TorchEngine, TorchEngineConfig
    from pipeline.models import load_model

    model = load_model(model_dir, dtype=bench_dtype(device), device=device)
    assert isinstance(model, CausalLM)
    graphs = device.type == "cuda" and not args.no_cuda_graphs
    compiled = device.type == "cuda" and not args.no_engine_compile
    params = SamplingParams(
        temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=args.new, stop_token_ids=()
    )
    out: dict[int, list[float]] = {}
    for b in batches:
        engine = TorchEngine(
            model,
            TorchEngineConfig(
                max_batch=b,
                max_seq_len=args.prompt + args.new,
                max_prefill_tokens=b * args.prompt,  # every prompt in one prefill
                use_cuda_graphs=graphs,
                compile=compiled,
                seed=args.seed,
                **engine_options,
            ),
        )
        prompts = _prompts(b, args.prompt, model.config.vocab_size, args.seed).tolist()
        requests = [GenerationRequest(f"r{i}", p, params) for i, p in enumerate(prompts)]

        def check(outputs: Any, b: int = b) -> None:
            lengths = {len(o.output_ids) for o in outputs}
            if len(outputs) != b or lengths != {args.new}:
                raise RuntimeError(f"engine returned {len(outputs)} outputs of lengths {lengths}")

        out[b] = median_runs(
            lambda engine=engine, requests=requests: engine.generate(requests),
            device,
            warmup=args.warmup,
            repeats=args.repeats,
            check=check,
        )
        progress(f"ours b={b}: {[round(x, 3) for x in out[b]]} s")
        if args.torch_profile:
            print_profile(
                lambda engine=engine, requests=requests: engine.generate(requests), device
            )
        info = {"overlap": engine.overlap, "decode_kernel": engine.cache.decode_kernel}
        engine.close()
        del engine
        free_memory(device)
    del model
    free_memory(device)
    return out, {
        "cuda_graphs": graphs,
        "engine_compile": compiled,
        "max_prefill_tokens": "batch * prompt",
        **info,
    }


def run_hf(
    model_dir: Path, batches: list[int], args: argparse.Namespace, device: torch.device
) -> tuple[dict[str, dict[int, list[float]]], dict[str, Any]]:
    """Seconds per batch for the dynamic cache and for the static cache (+ compile on CUDA)."""
    import transformers
    from transformers import AutoModelForCausalLM, GenerationConfig

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=bench_dtype(device)).to(device)
    model.eval()
    compiled = device.type == "cuda" and not args.no_compile

    def gen_config(new: int, static: bool) -> Any:
        extra: dict[str, Any] = {"cache_implementation": "static"} if static else {}
        return GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,  # 0 disables transformers' default top-k of 50
            min_new_tokens=new,
            max_new_tokens=new,
            eos_token_id=None,
            pad_token_id=0,
            disable_compile=not (static and compiled),
            **extra,
        )

    systems: dict[str, dict[int, list[float]]] = {"dynamic": {}, "static": {}}
    for b in batches:
        ids = _prompts(b, args.prompt, model.config.vocab_size, args.seed).to(device)
        mask = torch.ones_like(ids)

        def check(seqs: torch.Tensor, b: int = b) -> None:
            if tuple(seqs.shape) != (b, args.prompt + args.new):
                raise RuntimeError(f"generate returned {tuple(seqs.shape)} tokens")

        for name in ("dynamic", "static"):
            config = gen_config(args.new, name == "static")

            @torch.no_grad()
            def call(config: Any = config, ids: torch.Tensor = ids, mask: torch.Tensor = mask):
                return model.generate(input_ids=ids, attention_mask=mask, generation_config=config)

            # the dynamic cache warms up on a short generation (same kernels, no shapes to
            # specialise); the compiled static cache needs the full length it is compiled for
            short = gen_config(min(args.new, 16), False)

            @torch.no_grad()
            def short_call(ids: torch.Tensor = ids, mask: torch.Tensor = mask, short: Any = short):
                return model.generate(input_ids=ids, attention_mask=mask, generation_config=short)

            systems[name][b] = median_runs(
                call,
                device,
                warmup=args.warmup,
                repeats=args.repeats,
                check=check,
                warmup_fn=short_call if name == "dynamic" else None,
            )
            progress(f"hf {name} b={b}: {[round(x, 3) for x in systems[name][b]]} s")
        free_memory(device)
    info = {
        "transformers": transformers.__version__,
        "hf_compiled": compiled,
        "hf_attn_implementation": "sdpa (default)",
        "hf_static_compile": (
            "transformers auto-compile of the decode forward (default CompileConfig: "
            "inductor, mode=reduce-overhead)"
            if compiled
            else "none (eager)"
        ),
        "hf_dynamic_warmup": f"{args.warmup} runs of min(new, 16) new tokens",
    }
    return systems, info


# -- the bench --------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda but torch sees no CUDA device")
    batches = _parse_batches(args.batches)
    dtype = bench_dtype(device)
    label = device_label(device)
    with tempfile.TemporaryDirectory(prefix="rollout-decode-") as tmp:
        model_dir = Path(tmp)
        config = save_random_model(args.shape, model_dir, dtype=dtype, device=device)
        with torch.device("meta"):
            meta = CausalLM(config).to(dtype)
        w_bytes = weight_bytes(meta, config)
        n_params = sum(p.numel() for p in meta.parameters())
        del meta
        kv_token = kv_bytes_per_token(config, torch.empty((), dtype=dtype).element_size())
        bandwidth = copy_bandwidth(device)
        progress(f"model saved; copy bandwidth {bandwidth / 1e9:.1f} GB/s")
        ours, ours_info = run_ours(model_dir, batches, args, device)
        free_memory(device)
        ablation: dict[int, list[float]] = {}
        if args.ablate:  # the engine without host overlap and without the decode kernel
            ablation, _ = run_ours(
                model_dir, batches, args, device, overlap=False, decode_kernel=False
            )
            free_memory(device)
        if args.no_baselines:  # profiling only: no figures without their baselines
            for b, runs in ours.items():
                progress(f"ours b={b}: {b * args.new / statistics.median(runs):.1f} tokens/s")
            raise SystemExit(0)
        hf, hf_info = run_hf(model_dir, batches, args, device)
        free_memory(device)
    static_name = "hf_generate_static_compiled" if hf_info["hf_compiled"] else "hf_generate_static"
    figures: list[dict[str, Any]] = []
    for b in batches:
        tokens = b * args.new

        def tps(runs: list[float], tokens: int = tokens) -> float:
            return tokens / statistics.median(runs)

        bound = decode_bound_tokens_per_s(b, args.prompt, args.new, w_bytes, kv_token, bandwidth)
        cfg = {
            "shape": args.shape,
            "dtype": str(dtype).removeprefix("torch."),
            "params": n_params,
            "batch": b,
            "prompt": args.prompt,
            "new_tokens": args.new,
            "sampling": "temperature=1.0 top_p=1.0 top_k=0, no stop tokens",
            "warmup": args.warmup,
            "repeats": args.repeats,
            "timing": "median wall seconds of generate() incl. prefill; tokens = batch * new",
            "seconds": {
                "ours": [round(s, 5) for s in ours[b]],
                "hf_dynamic": [round(s, 5) for s in hf["dynamic"][b]],
                "hf_static": [round(s, 5) for s in hf["static"][b]],
            },
            "tokens_per_s": {
                "ours": round(tps(ours[b]), 1),
                **(
                    {"ours_no_overlap_no_decode_kernel": round(tps(ablation[b]), 1)}
                    if ablation
                    else {}
                ),
                "hf_dynamic": round(tps(hf["dynamic"][b]), 1),
                "hf_static": round(tps(hf["static"][b]), 1),
            },
            "weight_bytes": w_bytes,
            "kv_bytes_per_token": kv_token,
            "copy_bandwidth_bytes_per_s": round(bandwidth),
            "copy_bandwidth_formula": COPY_BW_FORMULA,
            "bound_formula": BOUND_FORMULA,
            "torch": torch.__version__,
            **ours_info,
            **hf_info,
        }
        common = {"bound": bound, "config": cfg, "device": label}
        figures.append(
            figure(
                BENCH,
                f"tokens_per_s_b{b}",
                tps(ours[b]),
                baseline=static_name,
                baseline_value=tps(hf["static"][b]),
                **common,
            )
        )
        figures.append(
            figure(
                BENCH,
                f"tokens_per_s_b{b}_vs_dynamic",
                tps(ours[b]),
                baseline="hf_generate_dynamic",
                baseline_value=tps(hf["dynamic"][b]),
                **common,
            )
        )
    return figures


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{BENCH}")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    ap.add_argument("--device", choices=["cpu", "cuda"], default=None)
    ap.add_argument("--shape", choices=sorted(SHAPES), default=None)
    ap.add_argument("--batches", default=None, help="comma-separated batch sizes")
    ap.add_argument("--prompt", type=int, default=None, help="prompt tokens per sample")
    ap.add_argument("--new", type=int, default=None, help="generated tokens per sample")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--no-compile", action="store_true", help="static-cache baseline eager")
    ap.add_argument("--no-cuda-graphs", action="store_true", help="engine without CUDA graphs")
    ap.add_argument(
        "--no-engine-compile", action="store_true", help="engine blocks and sampler eager"
    )
    ap.add_argument("--torch-profile", action="store_true", help="print a torch.profiler table")
    ap.add_argument("--no-baselines", action="store_true", help="skip transformers (profiling)")
    ap.add_argument(
        "--ablate",
        action="store_true",
        help="also time the engine without host overlap and the decode kernel",
    )
    args = ap.parse_args(argv)
    device_defaults(args, DEFAULTS)
    if args.prompt < 1 or args.new < 1 or args.repeats < 1 or args.warmup < 0:
        raise SystemExit("--prompt, --new and --repeats must be >= 1, --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("PIPELINE_LOG_LEVEL", "warning")
    figs = run(args)
    c = figs[0]["config"]
    print(
        f"{BENCH}  shape={args.shape} device={figs[0]['device']} dtype={c['dtype']} "
        f"prompt={args.prompt} new={args.new} batches={args.batches} "
        f"copy_bw={c['copy_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s"
    )
    for f in figs:
        if not f["figure"].endswith("_vs_dynamic"):
            t = f["config"]["tokens_per_s"]
            print(
                f"  b={f['config']['batch']}: ours {t['ours']:.1f}  hf_dynamic "
                f"{t['hf_dynamic']:.1f}  hf_static {t['hf_static']:.1f}  bound {f['bound']:.1f}"
                " tokens/s"
            )
    print(table(figs))
    emit(figs, args.json)


if __name__ == "__main__":
    main()
