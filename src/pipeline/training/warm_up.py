"""The trainers' compile warm-up: batches of a run's lengths that take every path a step
will take, and the compile counters that show a recompile after it."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pipeline.training.config import TrainerConfig

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig
    from pipeline.training import ExperienceBatch


def compile_counts() -> dict[str, float]:
    """What torch.compile did in this process so far: frames compiled (a recompile is a
    frame compiled again) and graphs made; in every step's metrics, so that a compile
    after the warm-up shows."""
    from torch._dynamo.utils import counters

    return {
        "compile/frames": float(counters["frames"]["ok"]),
        "compile/graphs": float(counters["stats"]["unique_graphs"]),
    }


class Recompiles:
    """Graphs this process compiled since `mark()` (after its warm-up): recompiles. Graphs,
    not frames: dynamo counts no frame for a compiled callable that is not a function (the
    compiled loss, a functools.partial), but every graph it makes."""

    def __init__(self) -> None:
        self.base = 0.0

    def mark(self) -> None:
        self.base = compile_counts()["compile/graphs"]

    def since(self) -> float:
        return compile_counts()["compile/graphs"] - self.base


def compile_report() -> dict[str, Any]:
    """Where a warm-up's compile time went (dynamo's seconds per phase) and what the
    caches gave (inductor's FX graph and AOTAutograd cache hits, misses, bypasses)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    phases = {k: round(sum(v), 2) for k, v in compilation_time_metrics.items() if sum(v) > 0.5}
    caches = {
        f"{group}.{key}": int(value)
        for group in ("inductor", "aot_autograd")
        for key, value in counters[group].items()
        if "cache" in key
    }
    return {"compile_phases": phases, "compile_caches": caches}


def warm_up(log: Any, config: PipelineConfig, parts: list[Any]) -> None:
    """Warm up every part (a trainer or the reference) that compiles, on batches of the
    run's lengths, and log what it took (`warmed_up`)."""
    compiling = [p for p in parts if p is not None and compiles(p.config)]
    if compiling:
        batches = warm_up_batches(config, compiling[0].model.config.vocab_size)
        seconds = sum(part.warm_up(batches) for part in compiling)
        log.info("warmed_up", seconds=round(seconds, 2), **compile_counts(), **compile_report())


def compiles(trainer: TrainerConfig) -> bool:
    """Whether a trainer compiles or captures anything its first step would wait for."""
    return trainer.compile or trainer.compile_loss or trainer.trunk_graphs


def warm_up_batches(config: PipelineConfig, vocab_size: int) -> list[ExperienceBatch]:
    """Three batches of a step's samples at the run's lengths: one whose sequences all have
    the longest prompt and response, one of lengths spread over the upper half (varlen),
    and one of sequences alike whose length is a power of two, so that packed micro-batches
    fill whole buckets and attend as rows (see bucket_filling); with every per-token field a trainer may
    read, so that every estimator's path runs. As many samples as a step trains, so that
    the micro-batches are as large as a step's: inductor guards some fusions on the
    token count. Groups of two (no size 0 or 1, which the compiler special-cases)."""
    import torch

    from pipeline.training import ExperienceBatch

    prompt, response = config.task.max_prompt_tokens, config.rollout.max_new_tokens
    step = config.controller.prompts_per_step * config.rollout.n_samples
    n = max(4, step + step % 2)
    with_ref = config.reference_host() is not None
    generator = torch.Generator().manual_seed(0)
    batches = []
    for lengths in (
        [(prompt, response)] * n,
        [
            (prompt - (3 * i) % max(1, prompt // 2), response - (5 * i) % max(1, response // 2))
            for i in range(n)
        ],
        [bucket_filling(prompt, response)] * n,
    ):
        prompts = [torch.randint(vocab_size, (p,), generator=generator) for p, _ in lengths]
        responses = [torch.randint(vocab_size, (r,), generator=generator) for _, r in lengths]
        zeros = [torch.zeros(r) for _, r in lengths]
        batches.append(
            ExperienceBatch.from_lists(
                prompts,
                responses,
                [z - 1.0 for z in zeros],
                [float(i % 2) for i in range(n)],
                uids=[f"warmup-{i // 2}/{i % 2}" for i in range(n)],
                token_versions=[z.long() for z in zeros],
                # only where the run has them: a step without is another compiled variant
                ref_logprobs=[z - 1.0 for z in zeros] if with_ref else None,
                values=zeros,
                advantages=zeros,
                returns=zeros,
                rewards=zeros,
            )
        )
    return batches


def bucket_filling(prompt: int, response: int) -> tuple[int, int]:
    """A prompt and response length whose sum is the largest power of two they reach: a
    micro-batch of such sequences fills whole buckets (pack_bucket_tokens are powers of
    two) and takes the uniform attention path, which a run meets whenever its samples
    happen to line up so, and which would compile mid-run if the warm-up never took it."""
    length = 1 << max(1, (prompt + response).bit_length() - 1)
    p = min(prompt, max(1, length - response))
    return p, max(1, length - p)
