"""What a run trains on: prompts, tokenizer and model directory, made or loaded locally."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.config import PipelineConfig
from pipeline.errors import ConfigError


@dataclass
class Task:
    records: list[Any]
    tokenizer: Any
    model_dir: Path


def model_dir(config: PipelineConfig, run_dir: Path) -> Path:
    """The policy's local HF directory: the profile's, or the one made in the run dir."""
    return Path(config.model.path) if config.model.path else run_dir / "model"


def prepare_task(config: PipelineConfig, run_dir: Path) -> Task:
    from pipeline.data.tokenizer import load_tokenizer, save_char_tokenizer

    directory = model_dir(config, run_dir)
    # written last: a controller killed halfway through the warm start makes it again
    made = directory / ".made"
    if not config.model.path and not made.exists():
        save_char_tokenizer(directory)
        from pipeline.tasks.tiny_model import make_tiny_model

        make_tiny_model(
            directory,
            vocab_size=len(load_tokenizer(directory)),
            seed=config.run.seed,
            warm_start_steps=config.task.warm_start_steps,
            warm_start_task="copy_ask" if config.task.dataset == "toy_lookup" else "copy",
        )
        made.touch()
    elif config.model.path and not directory.exists():
        raise ConfigError(
            f"model.path {directory} does not exist; point it at a local HF directory"
        )
    tokenizer = load_tokenizer(directory)
    dataset = config.task.dataset
    if dataset == "toy_reverse":
        from pipeline.tasks.toy_task import make_toy_dataset

        records = make_toy_dataset(config.task.dataset_size, seed=config.run.seed)
    elif dataset == "toy_lookup":
        from pipeline.tasks.toy_lookup import make_lookup_dataset

        records = make_lookup_dataset(config.task.dataset_size, seed=config.run.seed)
    else:
        from pipeline.data.loader import load_prompts

        if not Path(dataset).exists():
            raise ConfigError(
                f"task.dataset {dataset!r} is neither 'toy_reverse', 'toy_lookup' nor an existing "
                ".parquet/.jsonl file"
            )
        records = load_prompts(dataset, tokenizer=tokenizer)
        limit = config.rollout.max_new_tokens
        for record in records:
            if record.max_new_tokens > limit:
                raise ConfigError(
                    f"prompt {record.uid!r} of {dataset} asks for max_new_tokens "
                    f"{record.max_new_tokens}, more than rollout.max_new_tokens {limit}: "
                    "lower the row's budget or raise the run's limit"
                )
    return Task(records=records, tokenizer=tokenizer, model_dir=directory)
