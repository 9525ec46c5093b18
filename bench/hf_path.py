"""The transformers path's cost: learner tokens/s of a tiny Qwen2 through transformers'
modeling (models/hf_causal.py, `TrainerConfig.implementation = "transformers"`) against the
native decoder, in the same process, on the same batch.

    python -m bench.hf_path [--batch 256] [--seq 24] [--prompt 17] [--steps 5] [--json OUT]

The model is the CPU profile's (profiles/local-cpu.toml: the generated tiny Qwen2 with the
character tokenizer, hidden 64, 2 layers) and so is the step: 4 shuffled mini-batches, one
thread, the CPU's padded micro-batches; the default batch is a step of that profile (32
prompts x 8 samples of about 17 prompt + 7 response tokens). One step is
`PolicyTrainer.train_step` (proximal forward, then forward + backward + AdamW per
mini-batch). tokens = batch * seq per step; the median of `--steps` timed steps after
`--warmup`. Prints one JSON figure (bench/common.py): transformers' tokens/s, the native
decoder's as the baseline.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from bench.common import cpu_device, emit, figure, table
from bench.learner_step import synthetic_batch

BENCH = "hf_path"


def tokens_per_s(model_dir: Path, implementation: str, args: argparse.Namespace) -> float:
    from pipeline.training import PolicyTrainer, TrainerConfig

    config = TrainerConfig(
        device="cpu",
        lr=2e-3,
        mini_batches=4,
        shuffle=True,
        max_tokens_per_micro_batch=16384,
        padding_free=False,  # what `kernels = "auto"` gives on a CPU
        implementation=implementation,  # type: ignore[arg-type]
    )
    trainer = PolicyTrainer(str(model_dir), config)
    vocab = int(trainer.model.config.vocab_size)
    batch, _ = synthetic_batch(args.batch, args.seq, args.prompt, vocab, args.seed)
    for _ in range(args.warmup):
        trainer.train_step(batch)
    seconds = []
    for _ in range(args.steps):
        start = time.perf_counter()
        trainer.train_step(batch)
        seconds.append(time.perf_counter() - start)
    return args.batch * args.seq / statistics.median(seconds)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer
    from pipeline.tasks.tiny_model import make_tiny_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        save_char_tokenizer(model_dir)
        make_tiny_model(model_dir, vocab_size=len(load_tokenizer(model_dir)), seed=args.seed)
        native = tokens_per_s(model_dir, "native", args)
        transformers = tokens_per_s(model_dir, "transformers", args)
    config = {"batch": args.batch, "seq": args.seq, "prompt": args.prompt, "model": "tiny qwen2"}
    return [
        figure(
            BENCH,
            "learner_tokens_per_s_transformers",
            transformers,
            baseline="native decoder",
            baseline_value=native,
            bound=native,
            config=config,
            device=cpu_device(),
        )
    ]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=f"python -m bench.{BENCH}")
    ap.add_argument("--batch", type=int, default=256, help="samples per step")
    ap.add_argument("--seq", type=int, default=24, help="tokens per sample")
    ap.add_argument("--prompt", type=int, default=17, help="prompt tokens per sample")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = ap.parse_args(argv)
    figures = run(args)
    print(table(figures))
    emit(figures, args.json)


if __name__ == "__main__":
    main()
