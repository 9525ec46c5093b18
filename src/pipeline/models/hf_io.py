"""Load and save Hugging Face-format checkpoints (config.json + safetensors) from local dirs.

Names are checked strictly in both directions: a checkpoint with missing or extra tensors is
refused with the offending names, because loading it partially would train or sample from a
silently different model. The only tolerated differences are HF's own conventions: a tied
model need not (but may) store lm_head.weight, and a value model may start from a causal-LM
checkpoint (lm_head dropped, score zero-initialised).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from pipeline.errors import PipelineError
from pipeline.models.config import ModelConfig, dtype_name
from pipeline.models.decoder import CausalLM, DecoderBase
from pipeline.models.value_head import ValueModel

CONFIG_NAME = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
DEFAULT_MAX_SHARD_BYTES = 5 * 1024**3


class CheckpointError(PipelineError):
    """A checkpoint directory is incomplete or does not match the model it should fill."""


def read_config(path: str | os.PathLike[str]) -> ModelConfig:
    """ModelConfig from `path/config.json`."""
    config_file = Path(path) / CONFIG_NAME
    if not config_file.is_file():
        raise CheckpointError(f"{config_file} not found; a checkpoint directory needs config.json")
    with config_file.open() as f:
        return ModelConfig.from_hf_dict(json.load(f))


def _weight_files(root: Path) -> dict[str, Path]:
    """tensor name -> file holding it."""
    index = root / INDEX_NAME
    if index.is_file():
        with index.open() as f:
            weight_map: dict[str, str] = json.load(f)["weight_map"]
        absent = sorted({fn for fn in weight_map.values() if not (root / fn).is_file()})
        if absent:
            raise CheckpointError(f"{index} names shard files that are missing: {absent}")
        return {name: root / fn for name, fn in weight_map.items()}
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"no *.safetensors files in {root}")
    out: dict[str, Path] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                out[name] = file
    return out


def load_model(
    path: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    value_head: bool = False,
) -> CausalLM | ValueModel:
    """Build the native model from a local HF checkpoint; dtype defaults to config's."""
    root = Path(path)
    config = read_config(root)
    if dtype is not None:
        config = config.replace(torch_dtype=dtype_name(dtype))
    cls: type[DecoderBase] = ValueModel if value_head else CausalLM
    with torch.device("meta"):
        model = cls(config).to(config.dtype)
    model.to_empty(device=device)
    if isinstance(model, CausalLM):
        model.tie_weights()
    model.reset_buffers()

    files = _weight_files(root)
    targets = model.state_dict()
    expected = set(targets)
    ignored: set[str] = set()
    if isinstance(model, CausalLM) and config.tie_word_embeddings:
        expected.discard("lm_head.weight")
        ignored.add("lm_head.weight")
    if isinstance(model, ValueModel):
        ignored.add("lm_head.weight")
    present = set(files) - ignored
    missing = sorted(expected - present)
    init_score = isinstance(model, ValueModel) and missing == ["score.weight"]
    if init_score:
        missing = []
    unexpected = sorted(present - expected)
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {root} does not match {cls.__name__}({config.model_type}): "
            f"missing {missing}; unexpected {unexpected}"
        )

    by_file: dict[Path, list[str]] = {}
    for name in sorted(present):
        by_file.setdefault(files[name], []).append(name)
    with torch.no_grad():
        for file, names in by_file.items():
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in names:
                    tensor = f.get_tensor(name)
                    target = targets[name]
                    if tensor.shape != target.shape:
                        raise CheckpointError(
                            f"{name} in {file.name} has shape {tuple(tensor.shape)}, the "
                            f"model expects {tuple(target.shape)}"
                        )
                    target.copy_(tensor)
        if isinstance(model, ValueModel) and init_score:
            model.reset_score()
    return model  # type: ignore[return-value]


def _architecture(model: DecoderBase) -> tuple[str, dict[str, object]]:
    config = model.config
    if isinstance(model, ValueModel):
        arch = config.architecture.replace("ForCausalLM", "ForSequenceClassification")
        return arch, {"id2label": {"0": "LABEL_0"}, "label2id": {"LABEL_0": 0}}
    return config.architecture, {}


def _plan_shards(
    tensors: dict[str, torch.Tensor], max_shard_bytes: int
) -> list[dict[str, torch.Tensor]]:
    """Greedy, name-ordered shards of at most max_shard_bytes (a bigger tensor gets its own)."""
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].numel() * tensors[name].element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    return shards


def save_model(
    model: DecoderBase,
    path: str | os.PathLike[str],
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> None:
    """Write config.json + safetensors that transformers' from_pretrained loads.

    The model must hold full (unsharded) tensors: gather an FSDP model's state first.
    Previous model*.safetensors / index files in `path` are removed so shards never mix.
    """
    from torch.distributed.tensor import DTensor

    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if isinstance(model, CausalLM) and model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    sharded = sorted(name for name, t in state.items() if isinstance(t, DTensor))
    if sharded:
        raise CheckpointError(
            f"save_model needs full tensors but {len(sharded)} are DTensors (e.g. {sharded[0]}); "
            "gather a full state dict (torch.distributed.checkpoint.state_dict) first"
        )
    tensors = {name: t.detach().cpu().contiguous() for name, t in state.items()}
    dtype = model.model.embed_tokens.weight.dtype
    arch, extra_keys = _architecture(model)
    config = model.config.replace(torch_dtype=dtype_name(dtype)).to_hf_dict(arch)
    config.update(extra_keys)

    for old in [*root.glob("model*.safetensors"), root / INDEX_NAME]:
        old.unlink(missing_ok=True)
    shards = _plan_shards(tensors, max_shard_bytes)
    metadata = {"format": "pt"}
    if len(shards) == 1:
        save_file(shards[0], str(root / SINGLE_FILE), metadata=metadata)
    else:
        weight_map: dict[str, str] = {}
        for i, shard in enumerate(shards, start=1):
            filename = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, str(root / filename), metadata=metadata)
            weight_map.update(dict.fromkeys(shard, filename))
        total = sum(t.numel() * t.element_size() for t in tensors.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (root / INDEX_NAME).write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    (root / CONFIG_NAME).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
