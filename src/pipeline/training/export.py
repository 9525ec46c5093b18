"""Export the (possibly FSDP-sharded) weights as a Hugging Face checkpoint directory.

The full state dict is gathered to rank 0's CPU memory and poured into a meta-device twin
of the model with `assign=True` (no second copy), which `pipeline.models.save_model` then
writes as config.json + safetensors that transformers' `from_pretrained` and vLLM load.
"""

from __future__ import annotations

import os
from typing import cast

import torch
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from pipeline.models import CausalLM, DecoderBase, ValueModel, save_model
from pipeline.training.config import LoraSection
from pipeline.training.distributed import barrier, current_dist_info, is_distributed


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU tensors on rank 0 (empty on other ranks); collective when distributed."""
    if not is_distributed():
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return cast(dict[str, torch.Tensor], get_model_state_dict(model, options=options))


def export_hf(
    model: DecoderBase,
    path: str | os.PathLike[str],
    *,
    dtype: torch.dtype | None = None,
    lora: LoraSection | None = None,
) -> None:
    """Write `path` as a HF checkpoint of `model`'s current weights (every rank must call).

    `dtype` casts the exported tensors (e.g. bfloat16 for serving); default: as trained.
    `lora`: the model carries adapters; `path` gets the merged weights and
    `lora.adapter_dir(path)` the adapters alone (peft's format).
    """
    from pipeline.models.hf_causal import HFModule, save_hf_model

    state = full_state_dict(model)
    if current_dist_info("cpu").is_main:
        if lora is not None:
            from pipeline.training.lora import adapter_dir, split_state, write_adapter

            state, adapter = split_state(state, lora.alpha / lora.rank)
            write_adapter(adapter, lora, adapter_dir(path))
        if dtype is not None:
            state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        if isinstance(model, HFModule):  # transformers' modeling: its own save_pretrained
            save_hf_model(model, state, path)
            barrier()
            return
        # type(model) may be FSDP's dynamic subclass; build the plain class
        cls: type[DecoderBase] = ValueModel if isinstance(model, ValueModel) else CausalLM
        with torch.device("meta"):
            twin = cls(model.config)
        if isinstance(twin, CausalLM) and model.config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state["model.embed_tokens.weight"])
        twin.load_state_dict(state, strict=True, assign=True)
        if isinstance(twin, CausalLM):
            twin.tie_weights()
        save_model(twin, path)
    barrier()


# the tokenizer's files as transformers writes them (any that the source directory has)
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
)


def complete_hf_dir(source: str | os.PathLike[str], out: str | os.PathLike[str]) -> None:
    """Make an exported checkpoint self-contained: the tokenizer files of the model it
    was trained from, and a generation config (the source's, or one with the tokenizer's
    special tokens), so that transformers and vLLM load `out` alone."""
    import shutil
    from pathlib import Path

    from transformers import AutoTokenizer, GenerationConfig

    src, dst = Path(source), Path(out)
    for name in _TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
    if (src / "generation_config.json").is_file():
        shutil.copy2(src / "generation_config.json", dst / "generation_config.json")
        return
    tokenizer = AutoTokenizer.from_pretrained(src)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    ).save_pretrained(dst)
