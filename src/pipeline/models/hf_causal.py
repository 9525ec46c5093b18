"""Any Hugging Face causal LM for the trainers: transformers' own modeling where the native
decoder does not know the architecture (Gemma, Phi-3, OLMo 2, Mixtral, Qwen3-MoE, ...).

`choose_implementation` decides per model directory: the native decoder for the families
it implements (llama, qwen2, qwen3, mistral without a binding window), transformers for any
other decoder-only model that `AutoModelForCausalLM` builds, and a ConfigError with the
reason for what neither can train (encoder-decoders, models without a causal-LM head,
multimodal checkpoints). The wrappers below give transformers' models the entry points the
trainers call on a native `CausalLM` / `ValueModel` (`token_logprobs`, `forward_packed`,
`forward`) and keep transformers' parameter names (the wrapper registers the model's own
children, so `model.layers.0.self_attn.q_proj.weight` stays that name in checkpoints,
exports and weight sync: the hf engine and vLLM take the learner's updates unchanged).

Packed micro-batches are unpacked into a right-padded batch (one row per sequence) before
transformers' forward: exact for every architecture (sliding windows, soft-capping, MoE
routing) at the cost of the padding. The logits are materialised (b, s, vocab) as
transformers computes them, final soft-capping included, so the learner's log-probs are the
exported model's.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn

from pipeline.errors import ConfigError
from pipeline.log import get_logger

Implementation = Literal["auto", "native", "transformers"]
# the model types the native decoder implements (models/config.py)
NATIVE_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


@dataclass(frozen=True)
class ImplementationChoice:
    """Which modeling a role runs for a checkpoint, and why (logged as `model_implementation`)."""

    implementation: Literal["native", "transformers", "vllm"]
    model_type: str
    reason: str


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ConfigError(f"{config_file} not found; a model directory needs config.json")
    raw: dict[str, Any] = json.loads(config_file.read_text())
    return raw


def native_refusal(raw: dict[str, Any]) -> str | None:
    """Why the native decoder cannot run this config.json exactly, or None if it can."""
    from pipeline.models.config import ModelConfig

    model_type = raw.get("model_type")
    if model_type not in NATIVE_MODEL_TYPES:
        return f"the native decoder implements {', '.join(NATIVE_MODEL_TYPES)}, not {model_type!r}"
    try:
        ModelConfig.from_hf_dict(raw)
    except ConfigError as err:
        return str(err)
    return None


def transformers_refusal(raw: dict[str, Any]) -> str | None:
    """Why transformers' modeling cannot train this config.json here, or None if it can."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = raw.get("model_type")
    if raw.get("is_encoder_decoder"):
        return f"model_type {model_type!r} is an encoder-decoder; only decoder-only models train"
    if "vision_config" in raw or "audio_config" in raw:
        return (
            f"model_type {model_type!r} is multimodal; use its text-only checkpoint (e.g. "
            "gemma3_text for gemma3)"
        )
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        return (
            f"model_type {model_type!r} has no causal-LM head in transformers "
            "(AutoModelForCausalLM does not build it)"
        )
    return None


def choose_implementation(
    path: str | os.PathLike[str], requested: Implementation = "auto"
) -> ImplementationChoice:
    """Native where it runs the checkpoint exactly (the fast path), else transformers; a
    ConfigError with both reasons when neither can train it."""
    raw = read_hf_config(path)
    model_type = str(raw.get("model_type"))
    refused = native_refusal(raw)
    if requested != "transformers" and refused is None:
        reason = f"model_type {model_type!r} runs on the native decoder"
        return ImplementationChoice("native", model_type, reason)
    if requested == "native":
        raise ConfigError(f"{path}: the native decoder cannot run it: {refused}")
    not_hf = transformers_refusal(raw)
    if not_hf is not None:
        raise ConfigError(f"{path}: {not_hf}")
    if requested == "transformers":
        reason = "transformers' modeling was asked for (implementation = 'transformers')"
    else:
        reason = f"not native: {refused}"
    return ImplementationChoice("transformers", model_type, reason)


def log_choice(role: str, choice: ImplementationChoice) -> None:
    get_logger("models").info(
        "model_implementation",
        role=role,
        implementation=choice.implementation,
        model_type=choice.model_type,
        reason=choice.reason,
    )


class HFModule(nn.Module):
    """A transformers model whose children are this module's own (same parameter names)."""

    hf: Any  # the transformers model (a PreTrainedModel), not a submodule

    def __init__(self, hf_model: nn.Module) -> None:
        super().__init__()
        if next(hf_model.named_parameters(recurse=False), None) is not None:
            raise ConfigError(f"{type(hf_model).__name__} has parameters outside its submodules")
        # not a submodule: its children are registered here instead, so the names are its own
        object.__setattr__(self, "hf", hf_model)
        for name, child in hf_model.named_children():
            self.add_module(name, child)
        self.config: Any = hf_model.config

    def train(self, mode: bool = True) -> HFModule:
        super().train(mode)
        self.hf.training = mode
        return self

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        """The model's output per position, (b, s, ...)."""
        raise NotImplementedError

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """(b, s, ...) outputs; attention_mask (b, s) of 1/0 for padding."""
        return self._run(input_ids, position_ids, attention_mask)

    def forward_packed(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_seqlen: int | None = None,
        uniform: bool = False,
    ) -> torch.Tensor:
        """(1, total, ...) outputs of packed sequences (run padded, see the module doc)."""
        ids, positions, mask, flat = _unpack(input_ids, position_ids, cu_seqlens)
        out = self._run(ids, positions, mask)
        return out.reshape(-1, *out.shape[2:])[flat].unsqueeze(0)

    def decoder_layers(self) -> list[nn.Module]:
        """The repeated blocks (transformers' `_no_split_modules`): one FSDP group each."""
        names = set(getattr(self.hf, "_no_split_modules", None) or [])
        layers = [m for m in self.modules() if type(m).__name__ in names]
        if not layers:
            raise ConfigError(
                f"{type(self.hf).__name__} names no decoder layer class (_no_split_modules); "
                "it cannot be sharded per layer"
            )
        return layers


def _unpack(
    input_ids: torch.Tensor, position_ids: torch.Tensor, cu_seqlens: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(1, total) packed sequences -> right-padded (k, L) ids, positions, attention mask, and
    the flat padded index of every packed position (total,). Tail padding after cu_seqlens'
    last entry becomes a sequence of its own (its outputs are never read)."""
    total = input_ids.shape[1]
    bounds = [int(b) for b in cu_seqlens.tolist()]
    if bounds[-1] < total:
        bounds.append(total)
    starts, ends = bounds[:-1], bounds[1:]
    lengths = [e - s for s, e in zip(starts, ends, strict=True)]
    width = max(lengths)
    device = input_ids.device
    flat = torch.cat(
        [torch.arange(n, device=device) + i * width for i, n in enumerate(lengths)]
    )  # (total,)
    ids = input_ids.new_zeros(len(lengths) * width)
    ids[flat] = input_ids[0]
    positions = position_ids.new_zeros(len(lengths) * width)
    positions[flat] = position_ids[0]
    mask = torch.zeros(len(lengths) * width, dtype=torch.long, device=device)
    mask[flat] = 1
    shape = (len(lengths), width)
    return ids.view(shape), positions.view(shape), mask.view(shape), flat


def _token_stats(
    logits: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log p(target) and entropy of (..., vocab) logits at `temperature`, float32."""
    logp_all = torch.log_softmax(logits.float() / temperature, dim=-1)
    logp = logp_all.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    if not with_entropy:
        return logp, None
    return logp, -(logp_all.exp() * logp_all).sum(-1)


class HFCausalLM(HFModule):
    """`AutoModelForCausalLM` with the native CausalLM's training entry points: its
    outputs are the logits (b, s, vocab)."""

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        out = self.hf(
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
        )
        logits: torch.Tensor = out.logits
        return logits  # (b, s, vocab)

    def token_logprobs(
        self,
        input_ids: torch.Tensor,
        target_ids: torch.Tensor,
        *,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cu_seqlens: torch.Tensor | None = None,
        max_seqlen: int | None = None,
        uniform: bool = False,
        chunk_tokens: int = 1024,
        temperature: float = 1.0,
        return_entropy: bool = False,
        keep_logits: bool = False,
        score_index: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """CausalLM.token_logprobs' contract: log p(target_ids) (b, s) float32, or (n,) at
        the flat positions `score_index`; and the entropy when asked."""
        if cu_seqlens is not None:
            if position_ids is None:
                raise ValueError("packed token_logprobs needs position_ids")
            logits = self.forward_packed(input_ids, position_ids, cu_seqlens)  # (1, total, V)
        else:
            logits = self._run(input_ids, position_ids, attention_mask)
        if score_index is not None:
            logits = logits.reshape(-1, logits.shape[-1]).index_select(0, score_index)
            target_ids = target_ids.reshape(-1)[score_index]  # (n,)
        logp, entropy = _token_stats(logits, target_ids, temperature, return_entropy)
        if entropy is None:
            return logp
        return logp, entropy


class HFValueModel(HFModule):
    """A transformers trunk (`AutoModel`, named `model.` as in `*ForSequenceClassification`)
    with the native ValueModel's zero-initialised `score` head and entry points."""

    def __init__(self, trunk: Any) -> None:
        holder = nn.Module()
        holder.config = trunk.config
        holder.model = trunk
        super().__init__(holder)
        object.__setattr__(self, "hf", trunk)
        hidden = int(trunk.config.get_text_config().hidden_size)
        self.score = nn.Linear(hidden, 1, bias=False)
        self.reset_score()

    def reset_score(self) -> None:
        """Zero head, as the native value head: a fresh critic predicts 0 everywhere."""
        nn.init.zeros_(self.score.weight)

    def _run(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
    ) -> torch.Tensor:
        out = self.hf(  # the trunk
            input_ids=input_ids,
            position_ids=position_ids,
            attention_mask=attention_mask,
            use_cache=False,
        )
        hidden: torch.Tensor = out.last_hidden_state  # (b, s, hidden)
        return self.score(hidden).squeeze(-1).float()  # values (b, s), float32


def load_hf_causal_lm(path: str | os.PathLike[str]) -> HFCausalLM:
    """transformers' causal LM of a local directory, float32 (the trainers' master weights)."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
    return HFCausalLM(hf)


def load_hf_value_model(path: str | os.PathLike[str]) -> HFValueModel:
    """A value model on transformers' trunk, from a causal-LM checkpoint (zero head) or a
    value model's own export (its `score.weight`)."""
    import warnings

    from transformers import AutoModel

    from pipeline.models.hf_io import _weight_files

    with warnings.catch_warnings():  # a causal LM's lm_head is not the trunk's
        warnings.simplefilter("ignore")
        trunk = AutoModel.from_pretrained(str(path), dtype=torch.float32)
    model = HFValueModel(trunk)
    files = _weight_files(Path(path))
    if "score.weight" in files:
        from safetensors import safe_open

        with safe_open(str(files["score.weight"]), framework="pt") as f, torch.no_grad():
            model.score.weight.copy_(f.get_tensor("score.weight"))
    return model


def save_hf_model(
    model: HFModule, state: dict[str, torch.Tensor], path: str | os.PathLike[str]
) -> None:
    """Write `state` (full tensors of `model`) as a directory transformers loads: the causal
    LM's own class, or the trunk's `*ForSequenceClassification` (one label) for a value model."""
    import copy

    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    config = copy.deepcopy(model.config)
    config.dtype = next(iter(state.values())).dtype
    with torch.device("meta"):
        if isinstance(model, HFValueModel):
            config.num_labels = 1
            twin = AutoModelForSequenceClassification.from_config(config)
        else:
            twin = AutoModelForCausalLM.from_config(config)
    twin.load_state_dict(state, strict=False, assign=True)
    twin.tie_weights()
    missing = sorted(n for n, p in twin.named_parameters() if p.is_meta)
    if missing:
        raise ConfigError(f"export of {type(twin).__name__}: no tensors for {missing[:5]}")
    twin.save_pretrained(str(path))


def load_for_training(
    path: str | os.PathLike[str],
    *,
    value_head: bool = False,
    implementation: Implementation = "auto",
    role: str = "learner",
) -> nn.Module:
    """The model a trainer (or the reference) starts from, float32: the native CausalLM /
    ValueModel, or its transformers counterpart; logs which and why (`model_implementation`)."""
    choice = choose_implementation(path, implementation)
    log_choice(role, choice)
    if choice.implementation == "native":
        from pipeline.models.hf_io import load_model

        return load_model(path, dtype=torch.float32, value_head=value_head)
    return load_hf_value_model(path) if value_head else load_hf_causal_lm(path)


def meta_causal_lm(path: str | os.PathLike[str]) -> nn.Module:
    """The causal LM of `path` on the meta device (names and shapes only), in whichever
    modeling the learner runs for it."""
    if choose_implementation(path).implementation == "native":
        from pipeline.models.config import ModelConfig
        from pipeline.models.decoder import CausalLM

        with torch.device("meta"):
            return CausalLM(ModelConfig.from_hf_dict(read_hf_config(path)))
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return HFCausalLM(AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path)))


def rollout_choice(path: str | os.PathLike[str], engine: str) -> ImplementationChoice:
    """What the rollout's engine runs for `path`. The built-in torch engine runs the native
    decoder only: with another architecture it is refused (not switched), since its settings
    (kernels, kv_on_update, tp) would silently stop applying and the choice between hf
    (any device, slow) and vLLM (GPU, fast) is the user's."""
    choice = choose_implementation(path)
    if engine == "torch" and choice.implementation != "native":
        raise ConfigError(
            f"rollout.engine = 'torch' runs the native decoder only, and {path} is not native "
            f"({choice.reason}); set rollout.engine = 'hf' (transformers' generate, any "
            "device) or 'vllm' (GPU)"
        )
    if engine == "torch":
        return choice
    reason = f"rollout.engine = {engine!r} runs its own modeling of {choice.model_type!r}"
    implementation: Literal["transformers", "vllm"] = "vllm" if engine == "vllm" else "transformers"
    return ImplementationChoice(implementation, choice.model_type, reason)
