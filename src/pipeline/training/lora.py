"""LoRA training (learner.lora): adapters on the policy, the base frozen.

Our own small implementation rather than peft: the adapters must sit inside the project's
own decoder (whose attention and MLP concatenate projections into one GEMM), keep the base
weights' names (the publisher sends merged weights under them, so engines need no change),
and go through FSDP2's fully_shard and the compiled blocks like any other parameter. A
`LoraLinear` (models/lora.py) replaces each targeted nn.Linear in place; everything else
here works on the module tree: freezing, switching the adapters off (the reference is the
base model: no second copy of it), the merged weights the engines receive, and the export
of a merged HF directory plus a peft-format adapter directory.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from pipeline.errors import ConfigError
from pipeline.models.lora import LoraLinear
from pipeline.training.config import LoraSection

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# peft's names of a causal LM's adapter tensors: <prefix><module>.lora_A.weight
_PEFT_PREFIX = "base_model.model."


def apply_lora(model: nn.Module, lora: LoraSection, *, seed: int = 0) -> list[str]:
    """Freeze every parameter of `model` and replace each nn.Linear whose name ends with
    one of `lora.targets` by a LoraLinear sharing its weight (in place, before placement:
    FSDP then shards the adapters with the rest). A's init is seeded by `seed` (a run's
    replay stays exact); returns the adapted modules' names."""
    for p in model.parameters():
        p.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    targets = set(lora.targets)
    adapted: list[str] = []
    for name, module in list(model.named_modules()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf not in targets or not isinstance(module, nn.Linear):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        wrapped = LoraLinear.adapt(module, lora.rank, lora.alpha, lora.dropout, generator)
        setattr(parent, leaf, wrapped)
        adapted.append(name)
    if not adapted:
        linears = sorted(
            {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)}
        )
        raise ConfigError(
            f"learner.lora.targets {list(lora.targets)} name no nn.Linear of the model; "
            f"its linear layers are: {linears}"
        )
    return adapted


def adapters(model: nn.Module) -> list[tuple[str, LoraLinear]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLinear)]


@contextlib.contextmanager
def adapters_off(model: nn.Module) -> Iterator[None]:
    """The base model inside (every adapter's update skipped)."""
    found = adapters(model)
    for _, m in found:
        m.adapters_on = False
    try:
        yield
    finally:
        for _, m in found:
            m.adapters_on = True


def _local(t: Tensor) -> Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


@torch.no_grad()
def merged_weight(module: LoraLinear) -> Tensor:
    """W + scaling * B @ A, laid out as W (under FSDP2 each rank merges its rows of W and B
    with the whole of A: one all-gather of A, collective)."""
    w, a, b = module.weight, module.lora_A, module.lora_B
    a_full = a.full_tensor() if isinstance(a, DTensor) else a
    local = torch.addmm(_local(w), _local(b).to(w.dtype), a_full.to(w.dtype), alpha=module.scaling)
    if isinstance(w, DTensor):
        return DTensor.from_local(
            local, w.device_mesh, w.placements, shape=w.shape, stride=w.stride()
        )
    return local


class MergedWeights(Mapping[str, Tensor]):
    """The weights an engine serves, by the base model's names: the frozen parameters as
    they are, each adapted weight merged (computed when read; reading them all is
    collective under FSDP2, in the same order on every rank)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self._adapted = {f"{n}.weight": m for n, m in adapters(model)}
        self._names = [n for n, _ in model.named_parameters() if not _is_adapter(n)]

    def __getitem__(self, name: str) -> Tensor:
        module = self._adapted.get(name)
        if module is not None:
            return merged_weight(module)
        if name not in self._names:
            raise KeyError(name)
        return self.model.get_parameter(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def _is_adapter(name: str) -> bool:
    return name.endswith((".lora_A", ".lora_B"))


def split_state(
    state: Mapping[str, Tensor], scaling: float
) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
    """A full state dict of an adapted model -> (merged base state, adapter tensors)."""
    base = {k: v for k, v in state.items() if not _is_adapter(k)}
    found = {k: v for k, v in state.items() if _is_adapter(k)}
    for key in found:
        if key.endswith(".lora_A"):
            module = key.removesuffix(".lora_A")
            a, b = found[key], found[f"{module}.lora_B"]
            w = base[f"{module}.weight"]
            base[f"{module}.weight"] = torch.addmm(w, b.to(w.dtype), a.to(w.dtype), alpha=scaling)
    return base, found


def write_adapter(
    adapter: Mapping[str, Tensor],
    lora: LoraSection,
    path: str | os.PathLike[str],
    *,
    base_model: str = "",
) -> None:
    """A peft-format adapter directory: adapter_model.safetensors (lora_A / lora_B of each
    module) and adapter_config.json (rank, alpha, dropout, targets)."""
    from safetensors.torch import save_file

    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {
        f"{_PEFT_PREFIX}{k}.weight": v.detach().cpu().contiguous() for k, v in adapter.items()
    }
    save_file(tensors, str(out / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lora.rank,
        "lora_alpha": lora.alpha,
        "lora_dropout": lora.dropout,
        "target_modules": sorted(lora.targets),
        "bias": "none",
        "base_model_name_or_path": base_model,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")


def adapter_dir(path: str | os.PathLike[str]) -> Path:
    """Where the export of a LoRA run puts its adapters, beside the merged model."""
    path = Path(path)
    return path.with_name(f"{path.name}_adapter")


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the optimizer's state tensors on this rank (its shards under FSDP2)."""
    total = 0
    for state in optimizer.state.values():
        for value in state.values():
            if isinstance(value, Tensor):
                local = _local(value)
                total += local.numel() * local.element_size()
    return total
