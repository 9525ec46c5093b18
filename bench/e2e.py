"""End to end: trained samples/s of async (staleness >= 1) against sync (staleness 0).

    python -m bench.e2e [--profile P] [--steps N] [--staleness 0,1,2]
        [--shape 0.5b|7b|tiny] [--json OUT] [--section.key VALUE ...]
    python -m bench.e2e --preset one-gpu [--variant grpo|ppo] [--json OUT]

Each setting is a whole `pipeline run` of the same profile and the same number of steps,
one after the other in this run; sync (staleness 0) is the baseline. The bound is the
slower of generation and training alone, estimated from the sync run's own spans (busy
seconds of the rollout service and of the learner per step). The idle share of each side
is 1 - busy / wall over the steady part of the run.

`--preset one-gpu` is the one-GPU workload of bench/e2e_workload.py on
profiles/h200-single.toml: 30 steps, the last 10 measured, staleness 0 and 1; `--variant
ppo` with the critic. Per step it reports each phase's busy seconds (generation, the
learner's reference, proximal and update phases on its device, the critic, the weight
sync), each device's idle share (1 - the union of the busy spans of the services placed on
it, over the wall time) and the bounds: the phases in series, and generation beside the rest.

`--workload agentic` (bench/e2e_workload.py): multi-turn GRPO episodes of the toy tool task
whose tool calls wait (`--tool-delay-s`, the median of a seeded lognormal), on
profiles/local-cpu-tool.toml unless `--profile` says otherwise, with a tiny model made once for
all the runs; `--preset one-gpu-agentic` on one GPU. Its figures add, per episode: turns,
environment seconds, tokens prefilled and tokens recomputed.

`--shape` runs a randomly initialised model of that standard shape (docs/performance.md) with the
profile's task and the char-level tokenizer instead of the generated tiny model, no warm
start: the rewards mean nothing then, the work per step (every sample runs to
max_new_tokens) is what is measured.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.common import covered, emit, emit_file, figure


def _jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip().endswith("}")]


def _busy(spans: list[dict[str, Any]], start: float, end: float) -> float:
    """Seconds inside [start, end] covered by at least one span (overlaps counted once)."""
    return covered((max(s["start"], start), min(s["end"], end)) for s in spans)


def _service_spans(run_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """The busy spans of each service (`role-replica`) of a run."""
    return {
        path.stem: [r for r in _jsonl(path) if r.get("kind") == "span"]
        for path in (run_dir / "metrics").glob("*-*.jsonl")
    }


def step_ends(
    spans: list[dict[str, Any]], per_step: int, t0: float, t1: float
) -> dict[int, list[float]]:
    """The end times of the per-group spans inside [t0, t1], by the step that released the
    group (a prompt's uid starts with its release index); steps with every group only."""
    ends: dict[int, list[float]] = {}
    for span in spans:
        if t0 <= span["start"] and span["end"] <= t1 and ":" in str(span.get("uid", "")):
            index = int(str(span["uid"]).split(":", 1)[0])
            ends.setdefault(index // per_step, []).append(span["end"])
    return {step: e for step, e in ends.items() if len(e) == per_step}


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def end_spread(spans: list[dict[str, Any]], per_step: int, t0: float, t1: float) -> float:
    """The median, over the steps released inside [t0, t1], of the seconds between the first
    and the last of a step's rollout groups to finish: how far a step's prompts started
    apart in the engine."""
    return _median([max(e) - min(e) for e in step_ends(spans, per_step, t0, t1).values()])


def critic_tail(
    rollout: list[dict[str, Any]], critic: list[dict[str, Any]], per_step: int, t0: float, t1: float
) -> float:
    """The median, over the steps, of the seconds from a step's last group leaving the
    rollout to its last group leaving the critic: what the critic adds before the learner
    has the whole step."""
    generated = step_ends(rollout, per_step, t0, t1)
    annotated = step_ends(critic, per_step, t0, t1)
    return _median(
        [max(annotated[k]) - max(generated[k]) for k in generated.keys() & annotated.keys()]
    )


def device_idle(run_dir: Path, spans: dict[str, list[dict[str, Any]]], t0: float, t1: float):
    """1 - busy / wall of each device the run placed services on (`idle_share.<pool>.<id>`;
    a pool that lists no devices, a CPU pool, counts as one: `idle_share.<pool>`), a device
    busy while any service on it is."""
    from pipeline.config.profile import config_from_json

    config = config_from_json((run_dir / "config.json").read_text())
    on: dict[str, list[dict[str, Any]]] = {}
    for service, found in spans.items():
        role, _, replica = service.rpartition("-")
        placement = config.services.get(role)
        if placement is None or not replica.isdigit():
            continue
        devices = [f".{d}" for d in config.devices(role, int(replica))] or [""]
        for device in devices:
            on.setdefault(f"idle_share.{placement.pool}{device}", []).extend(found)
    return {key: 1 - _busy(found, t0, t1) / (t1 - t0) for key, found in sorted(on.items())}


def token_shares(run_dir: Path, t0: float, t1: float) -> dict[str, float]:
    """From the recorded rollouts and the controller's schedule: the tokens generated a
    second between t0 and t1, and over the whole run the share of generated tokens in
    samples never trained (dropped) and the share of trained tokens that a policy version
    older than the step's sampled."""
    from pipeline.wire.recording import QueueReader

    log = run_dir / "queues" / "rollouts.log"
    if not log.exists():
        return {}
    trained_at = {r["uid"]: r["step"] for r in _jsonl(run_dir / "schedule.jsonl") if "uid" in r}
    seen: set[str] = set()
    generated = dropped = trained = older = steady = 0
    for record in QueueReader(log):
        inside = t0 <= record.wall_time <= t1
        message = record.decode()
        for sample in message.body.samples:
            if sample.uid in seen:  # a redelivered group
                continue
            seen.add(sample.uid)
            versions = message.tensor(sample.token_versions)
            generated += len(versions)
            steady += len(versions) if inside else 0
            step = trained_at.get(sample.uid)
            if step is None:
                dropped += len(versions)
            else:
                trained += len(versions)
                older += int((versions < step).sum())
    return {
        "generated_tokens": float(generated),
        "generated_tokens_per_s": steady / (t1 - t0),
        "dropped_token_share": dropped / max(generated, 1),
        "older_version_token_share": older / max(trained, 1),
    }


EPISODE_FIGURES = {
    "turns_per_episode": "rollout/turns",
    "env_s_per_episode": "rollout/env_seconds",
    "prefill_tokens_per_episode": "rollout/prefill_tokens",
    "recomputed_tokens_per_episode": "rollout/recomputed_tokens",
    "tool_calls_per_episode": "rollout/tool_calls",
}


def episode_figures(steady: list[dict[str, Any]]) -> dict[str, float]:
    """Multi-turn episodes' per-episode means over the measured steps (each step's metric is
    the mean over its groups of the per-episode means), for the metrics the run has."""
    out = {}
    for name, key in EPISODE_FIGURES.items():
        values = [s[key] for s in steady if key in s]
        if values:
            out[name] = sum(values) / len(values)
    return out


def measure(run_dir: Path, skip: int) -> dict[str, float]:
    from pipeline.config.profile import config_from_json

    steps = _jsonl(run_dir / "metrics" / "steps.jsonl")
    config = config_from_json((run_dir / "config.json").read_text())
    if len(steps) <= skip + 1:
        raise SystemExit(f"{run_dir}: only {len(steps)} steps; raise --steps")
    t0, t1 = steps[skip]["time"], steps[-1]["time"]
    samples = sum(s["trained"] for s in steps[skip + 1 :])
    by_service = _service_spans(run_dir)
    spans: dict[str, list[dict[str, Any]]] = {"rollout": [], "learner": [], "critic": []}
    for service, found in by_service.items():
        role = service.split("-")[0]
        if role in spans:
            spans[role].extend(found)
    wall = t1 - t0
    decode_batch = float(steps[-1].get("rollout/decode_batch_mean", float("nan")))
    gen_busy = _busy(spans["rollout"], t0, t1)
    train_busy = _busy([s for s in spans["learner"] if s["name"] == "train"], t0, t1)
    critic_busy = _busy(spans["critic"], t0, t1)
    # the critic's per-group annotation (its handle spans) and its value updates
    annotate = [s for s in spans["critic"] if s["name"] != "critic_update"]
    critic_update = [s for s in spans["critic"] if s["name"] == "critic_update"]
    per_step = config.controller.prompts_per_step
    steady = steps[skip + 1 :]
    # the learner's phases on its device (perf/*_s) and the weight sync, per step
    phases = {
        name: sum(s.get(key, 0.0) for s in steady) / len(steady)
        for name, key in (
            ("reference", "perf/reference_s"),
            ("proximal", "perf/proximal_s"),
            ("update", "perf/update_s"),
            ("weight_sync", "sync_seconds"),
        )
    }
    gen_per_step = gen_busy / len(steady)
    critic_per_step = critic_busy / len(steady)
    train_phases = phases["reference"] + phases["proximal"] + phases["update"]
    rest = train_phases + critic_per_step + phases["weight_sync"]
    return {
        **{f"{name}_s_per_step": value for name, value in phases.items()},
        "critic_s_per_step": critic_per_step,
        "critic_annotate_s_per_step": _busy(annotate, t0, t1) / len(steady),
        "critic_update_s_per_step": _busy(critic_update, t0, t1) / len(steady),
        "critic_tail_s": critic_tail(spans["rollout"], annotate, per_step, t0, t1),
        # one step with the phases in series, and with generation beside the rest
        "bound_sum_s_per_step": gen_per_step + rest,
        "bound_max_s_per_step": max(gen_per_step, rest),
        **device_idle(run_dir, by_service, t0, t1),
        "samples_per_s": samples / wall,
        "wall_s": wall,
        "samples": samples,
        "gen_idle_share": 1 - gen_busy / wall,
        "train_idle_share": 1 - train_busy / wall,
        "gen_busy_s_per_step": gen_busy / (len(steps) - skip - 1),
        "gen_end_spread_s": end_spread(spans["rollout"], per_step, t0, t1),
        "train_busy_s_per_step": train_busy / (len(steps) - skip - 1),
        "samples_per_step": samples / (len(steps) - skip - 1),
        "mismatch_kl_step0": float(steps[0].get("mismatch/kl", float("nan"))),
        "same_version_kl_max": max(
            (s["mismatch/same_version_kl"] for s in steps if "mismatch/same_version_kl" in s),
            default=float("nan"),
        ),
        "decode_batch_mean": decode_batch,
        **episode_figures(steady),
        "decode_batch_occupancy": decode_batch / config.rollout.max_batch,
        **token_shares(run_dir, t0, t1),
        # the policy's gradient norm, to set beside a baseline's: a run at an SM share
        # trained on norms 4000 times too large while its log-probs still matched
        "grad_norm_step0": float(steps[0].get("actor/grad_norm", float("nan"))),
        "grad_norm_median": _median(
            [s["actor/grad_norm"] for s in steps if "actor/grad_norm" in s]
        ),
        # optimizer steps skipped for a non-finite loss or gradient: a run that skipped
        # them trained on nothing, and its speed measures nothing
        "skipped_updates": sum(
            s.get("actor/skipped_updates", 0.0) + s.get("critic/skipped_updates", 0.0)
            for s in steps
        ),
    }


def shape_model(shape: str, directory: Path, device: str, *, char_vocab: bool = False) -> list[str]:
    """Save a random model of `shape` with the char tokenizer; the overrides that use it.
    `char_vocab`: the model's vocabulary is the tokenizer's, not the shape's, so that it
    samples every character about equally often (the shape's 152k ids would almost never
    give one of the ~90 characters)."""
    import torch

    from bench.rollout_decode import save_random_model
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer

    on = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    save_char_tokenizer(directory)
    vocab = len(load_tokenizer(directory)) if char_vocab else None
    save_random_model(shape, directory, dtype=torch.bfloat16, device=on, vocab_size=vocab)
    return ["--model.path", str(directory), "--task.warm_start_steps", "0"]


def _rows_ignore_eos(dataset: str) -> bool:
    """Every row of the run's dataset file runs its samples past end-of-sequence."""
    if not Path(dataset).is_file():  # a built-in task: its samples end at EOS
        return False
    from pipeline.data.loader import load_prompts

    return all(record.ignore_eos for record in load_prompts(dataset))


def decode_bound(run_dir: Path, result: dict[str, float], shape: str, bandwidth: float):
    """The rollout phase's generated tokens/s against the decode memory bound of
    rollout_decode (every weight and each sample's cached keys and values read once a decode
    step, at the copy bandwidth measured in this bench): where every sample runs to
    max_new_tokens (every row of the dataset says ignore_eos) and one engine decodes a
    step's samples at once."""
    import torch

    from bench.rollout_decode import (
        decode_bound_tokens_per_s,
        kv_bytes_per_token,
        weight_bytes,
    )
    from bench.shapes import SHAPES
    from pipeline.config.profile import config_from_json
    from pipeline.models import CausalLM

    config = config_from_json((run_dir / "config.json").read_text())
    batch = round(result["samples_per_step"])
    if not _rows_ignore_eos(config.task.dataset) or batch > config.rollout.max_batch:
        return {}
    model_config = SHAPES[shape]
    dtype = getattr(torch, config.model.dtype)
    with torch.device("meta"):
        model = CausalLM(model_config).to(dtype)
    elem = dtype.itemsize
    weights = weight_bytes(model, model_config)
    new = config.rollout.max_new_tokens
    bound = decode_bound_tokens_per_s(
        batch,
        config.task.max_prompt_tokens,
        new,
        weights,
        kv_bytes_per_token(model_config, elem),
        bandwidth,
    )
    tokens_per_s = batch * new / result["gen_busy_s_per_step"]
    return {
        "gen_tokens_per_s": tokens_per_s,
        "decode_bound_tokens_per_s": bound,
        "decode_bound_fraction": tokens_per_s / bound,
        "copy_bandwidth_bytes_per_s": bandwidth,
    }


def device_label(device: str) -> str:
    if device == "cpu":
        from bench.common import cpu_device

        return cpu_device()
    import torch

    return torch.cuda.get_device_name(0)  # the profile (figure name) says how many are used


def run_one(profile: str, steps: int, staleness: int, runs: Path, extra: list[str]) -> Path:
    name = f"e2e-{Path(profile).stem}-s{staleness}"
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        "--no-progress",
        "--profile",
        profile,
        "--name",
        name,
        "--run.runs_dir",
        str(runs),
        "--controller.steps",
        str(steps),
        "--controller.max_staleness",
        str(staleness),
        *extra,
    ]
    print(f"=== {' '.join(cmd[2:])}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"run {name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return runs / name


def copy_bandwidth(device: str) -> float:
    """Bytes/s of a device-to-device copy (read plus written), before any run starts."""
    import torch

    from bench.rollout_decode import copy_bandwidth as measured

    on = torch.device("cuda" if device != "cpu" and torch.cuda.is_available() else "cpu")
    bandwidth = measured(on)
    if on.type == "cuda":
        torch.cuda.empty_cache()  # the runs' own processes take the memory
    return bandwidth


def gpu_sharing(run_dir: Path) -> str:
    """How the run's services shared their GPUs (the supervisor's choice and reason)."""
    try:
        sharing = json.loads((run_dir / "supervisor.json").read_text())["gpu_sharing"]
    except (OSError, ValueError, KeyError):
        return "unknown"
    text = f"{sharing['mode']} ({sharing['reason']})"
    if sharing["mode"] != "mps":
        return text
    if found := ",".join(f"{k}={v}" for k, v in sorted(sharing["priorities"].items())):
        text += f" priorities {found}"
    return text


# one GPU, a random model of the 0.5B shape, synchronous then staleness 1
_ONE_GPU = {
    "profile": "profiles/h200-single.toml",
    "shape": "0.5b",
    "device": "cuda",
    "staleness": "0,1",
}
PRESETS = {
    "one-gpu": {**_ONE_GPU, "steps": 30, "skip": 20},
    # budgets per prompt up to 2048 tokens (e2e_workload.long_tail_budgets)
    "one-gpu-long-tail": {**_ONE_GPU, "steps": 20, "skip": 8, "workload": "long-tail", "cap": 2048},
    # the toy tool task's multi-turn episodes, tool calls of a median 0.5 s wait
    # (e2e_workload.agentic_overrides)
    "one-gpu-agentic": {**_ONE_GPU, "steps": 20, "skip": 8, "workload": "agentic"},
}


def workload_label(args: argparse.Namespace) -> str:
    if args.workload == "agentic":
        return f"agentic (tool delay median {args.tool_delay_s}s)"
    return f"{args.workload} (cap {args.cap})" if args.workload != "fixed" else "fixed"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default=None)
    ap.add_argument("--variant", default="grpo", help="with --preset: grpo or ppo")
    ap.add_argument("--profile", default="profiles/local-cpu.toml")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--skip", type=int, default=5, help="warm-up steps left out")
    ap.add_argument("--staleness", default="0,1,2")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (labelled by GPU name)")
    ap.add_argument("--shape", default=None, help="random model of this shape (e.g. 0.5b)")
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here")
    ap.add_argument(
        "--workload", default="fixed", help="fixed or long-tail (with a preset), or agentic"
    )
    ap.add_argument("--tool-delay-s", type=float, default=0.5, help="agentic: median tool wait")
    ap.add_argument("--warm-start-steps", type=int, default=120, help="agentic: its tiny model's")
    ap.add_argument("--cap", type=int, default=2048, help="long-tail: the largest budget")
    ap.add_argument("--prompt-tokens", type=int, default=62, help="with a preset")
    known, _ = ap.parse_known_args(argv)
    if known.preset is not None:  # the preset's values, unless given on the command line
        ap.set_defaults(**PRESETS[known.preset])
    elif known.workload == "agentic":
        ap.set_defaults(profile="profiles/local-cpu-tool.toml")
    args, extra = ap.parse_known_args(argv)
    levels = [int(x) for x in args.staleness.split(",")]
    # the baseline first (sync when asked for, else the first level): partial results stand
    levels = [0, *(x for x in levels if x != 0)] if 0 in levels else levels
    config = {
        "preset": f"{args.preset} {args.variant}" if args.preset else "none",
        "workload": workload_label(args),
        "profile": args.profile,
        "shape": args.shape or "profile's model",
        "steps": args.steps,
        "skip": args.skip,
    }
    results: dict[int, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="e2e-bench-") as tmp:
        if args.shape:
            # agentic: random turns must end at the tool call's character now and then
            made = shape_model(
                args.shape, Path(tmp) / "model", args.device, char_vocab=args.workload == "agentic"
            )
            extra = [*extra, *made]
        if args.workload == "agentic":
            from bench.e2e_workload import agentic_model, agentic_overrides

            if not args.shape:  # made once: every run starts from the same policy
                made = agentic_model(Path(tmp) / "model", steps=args.warm_start_steps)
                extra = [*made, *extra]
            gpu = args.preset is not None
            overrides = agentic_overrides(args.variant, delay_s=args.tool_delay_s, gpu=gpu)
            extra = [*overrides, *extra]
        elif args.preset:
            from bench.e2e_workload import workload_overrides

            if not args.shape:
                raise SystemExit("--preset needs a --shape (its model's tokenizer sizes prompts)")
            overrides = workload_overrides(
                args.variant,
                Path(tmp) / "model",
                Path(tmp),
                workload=args.workload,
                cap=args.cap,
                prompt_tokens=args.prompt_tokens,
            )
            extra = [*overrides, *extra]
        config["extra"] = " ".join(extra).replace(str(Path(tempfile.gettempdir())), "$TMP")
        runs = args.runs_dir or Path(tmp)
        bandwidth = copy_bandwidth(args.device) if args.shape else 0.0
        for level in levels:
            run_dir = run_one(args.profile, args.steps, level, runs, extra)
            results[level] = measure(run_dir, args.skip)
            if args.shape:
                results[level].update(decode_bound(run_dir, results[level], args.shape, bandwidth))
            config[f"gpu_sharing_s{level}"] = gpu_sharing(run_dir)
            figs = figures(results, config, args)
            if args.json is not None:  # after every run: a bench killed at its limit keeps these
                emit_file(figs, args.json)
    print(f"{'staleness':>9} {'samples/s':>10} {'gen idle':>9} {'train idle':>10}", end="")
    print(f" {'turns':>6} {'env s':>6}" if args.workload == "agentic" else "")
    for level, r in results.items():
        print(
            f"{level:>9} {r['samples_per_s']:>10.1f} {r['gen_idle_share']:>9.2f} "
            f"{r['train_idle_share']:>10.2f}",
            end="",
        )
        turns, env_s = r.get("turns_per_episode", 0.0), r.get("env_s_per_episode", 0.0)
        print(f" {turns:>6.2f} {env_s:>6.2f}" if args.workload == "agentic" else "")
    emit(figs)  # the file already holds these (written after the last run)
    if bad := {level: r["skipped_updates"] for level, r in results.items() if r["skipped_updates"]}:
        raise SystemExit(
            f"skipped optimizer steps (non-finite loss or gradients) by staleness: {bad}"
        )


def figures(
    results: dict[int, dict[str, float]], config: dict[str, Any], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """One figure per staleness level run so far, each against the sync (level 0) run, or
    the first level run where sync was not asked for."""
    base = 0 if 0 in results else next(iter(results))
    sync = results[base]
    bound = sync["samples_per_step"] / max(
        sync["gen_busy_s_per_step"], sync["train_busy_s_per_step"]
    )
    # figures of another profile than the default carry its name (h200-x2 next to h200-single)
    stem = Path(args.profile).stem
    suffix = "" if stem == "local-cpu" else f"_{stem}"
    suffix += "_agentic" if args.workload == "agentic" else ""
    return [
        figure(
            "e2e",
            f"samples_per_s_staleness{level}{suffix}",
            r["samples_per_s"],
            baseline=f"{'sync_' if base == 0 else ''}staleness{base}",
            baseline_value=sync["samples_per_s"],
            bound=bound,
            config={**config, "staleness": level, **{k: round(v, 6) for k, v in r.items()}},
            device=device_label(args.device),
        )
        for level, r in results.items()
    ]


if __name__ == "__main__":
    main()
