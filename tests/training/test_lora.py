"""LoRA (learner.lora): only the adapters train; the reference is the base model; engines
receive base + B @ A * alpha / rank by the base's names; checkpoints hold the adapters;
the export writes the merged model and a peft-format adapter directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from pipeline.algorithms import AlgorithmConfig
from pipeline.errors import ConfigError
from pipeline.models import CausalLM, load_model
from pipeline.training import PolicyTrainer, TrainerConfig
from pipeline.training.config import LoraSection
from pipeline.training.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_dir
from pipeline.training.reference import ReferencePolicy
from pipeline.weights import PublishConfig, SyncTimeouts, WeightHub, WeightPublisher, WeightReceiver
from pipeline.weights.validate import ParamSpec

from ._helpers import assert_transformers_runs_it, free_port, make_batch, save_tiny_model

LORA = LoraSection(rank=4, alpha=8.0)
CONFIG = TrainerConfig(device="cpu", lr=1e-2, max_tokens_per_micro_batch=40, lora=LORA)
KL = AlgorithmConfig(use_kl_loss=True, kl_loss_coef=0.05)


def _trained(tmp_path: Path, config: TrainerConfig = CONFIG, steps: int = 2) -> PolicyTrainer:
    trainer = PolicyTrainer(save_tiny_model(tmp_path / "model"), config, KL)
    for seed in range(steps):
        trainer.train_step(make_batch(seed=seed))
    return trainer


def _merged_float64(base: CausalLM, trainer: PolicyTrainer) -> dict[str, torch.Tensor]:
    """The engines' weights, computed independently: base + B @ A * alpha / rank."""
    out = {n: p.detach().double() for n, p in base.named_parameters()}
    params = dict(trainer.model.named_parameters())
    for name in list(out):
        module = name.removesuffix(".weight")
        if f"{module}.lora_A" in params:
            a, b = params[f"{module}.lora_A"].double(), params[f"{module}.lora_B"].double()
            out[name] = out[name] + b @ a * (LORA.alpha / LORA.rank)
    return out


def test_only_the_adapters_train_and_hold_optimizer_state(tmp_path: Path):
    base = load_model(save_tiny_model(tmp_path / "base"))
    trainer = _trained(tmp_path)
    params = dict(trainer.model.named_parameters())
    trained = sorted(n for n, p in params.items() if p.requires_grad)
    assert trained and all(n.endswith((".lora_A", ".lora_B")) for n in trained)
    assert len(trained) == 2 * 7 * 2  # A and B of 7 projections in each of 2 layers
    for name, value in base.named_parameters():  # the base is untouched
        assert torch.equal(params[name], value), name
    assert any(params[n].abs().sum() > 0 for n in trained if n.endswith(".lora_B"))
    assert set(trainer.engine.optimizer.state) == {params[n] for n in trained}
    full = PolicyTrainer(save_tiny_model(tmp_path / "full"), CONFIG.replace(lora=LoraSection()))
    lora_bytes = trainer.engine.optimizer_state_bytes
    assert 0 < lora_bytes <= 0.25 * full.engine.optimizer_state_bytes  # tiny model: r=4 of 32


def test_the_reference_is_the_base_model_with_no_second_copy(tmp_path: Path):
    trainer = _trained(tmp_path)
    assert not isinstance(trainer.reference, ReferencePolicy)  # the policy's adapters off
    base = ReferencePolicy(load_model(tmp_path / "model", dtype=torch.float32), CONFIG)
    batch = make_batch(seed=7)
    ref = trainer.ref_logprobs(batch)
    torch.testing.assert_close(ref, base.logprobs(batch), rtol=0, atol=1e-6)
    assert (trainer.compute_logprobs(batch) - ref).abs().max() > 1e-4  # adapters back on


def test_engine_weights_after_a_sync_equal_base_plus_merged_adapters(tmp_path: Path):
    base = load_model(save_tiny_model(tmp_path / "base"))
    trainer = _trained(tmp_path)
    merged = trainer.weights_to_publish()
    # the names and shapes of a full fine-tune: an engine needs no change
    assert {n: p.shape for n, p in base.named_parameters()} == {
        n: t.shape for n, t in merged.items()
    }
    hub = WeightHub(endpoint=f"tcp://127.0.0.1:{free_port()}")
    specs = {n: ParamSpec(tuple(p.shape), torch.float32) for n, p in base.named_parameters()}
    serving = {n: torch.zeros(s.shape) for n, s in specs.items()}
    applied: list[int] = []

    def load(tensors: dict[str, torch.Tensor], version: int) -> None:
        for n, t in tensors.items():
            serving[n].copy_(t)
        applied.append(version)

    timeouts = SyncTimeouts(bucket_timeout_s=5, apply_timeout_s=10)
    receiver = WeightReceiver("e0", hub.endpoint, specs, load, timeouts=timeouts)
    receiver.start()
    try:
        hub.wait_for_members(1, 10)
        config = PublishConfig(dtype=torch.float32, timeouts=timeouts)
        publisher = WeightPublisher(merged, hub=hub, config=config)
        publisher.publish(1)
        trainer.train_step(make_batch(seed=5))  # the next sync carries the new adapters
        publisher.publish(2)
        assert applied == [1, 2]
        want = _merged_float64(base, trainer)
        for name, value in serving.items():
            torch.testing.assert_close(value.double(), want[name], rtol=1e-6, atol=1e-6)
        publisher.close()
    finally:
        receiver.stop()
        hub.close()


def test_export_writes_the_merged_model_and_a_peft_adapter(tmp_path: Path):

    base = load_model(save_tiny_model(tmp_path / "base"))
    trainer = _trained(tmp_path)
    trainer.export_hf(tmp_path / "final")
    want = _merged_float64(base, trainer)
    exported = load_model(tmp_path / "final")
    for name, value in exported.named_parameters():
        torch.testing.assert_close(value.double(), want[name], rtol=1e-6, atol=1e-6)
    assert_transformers_runs_it(tmp_path / "final", trainer.model)

    adapter = adapter_dir(tmp_path / "final")
    config = json.loads((adapter / ADAPTER_CONFIG).read_text())
    assert (config["peft_type"], config["r"], config["lora_alpha"]) == ("LORA", 4, 8.0)
    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    params = dict(trainer.model.named_parameters())
    assert len(tensors) == 28
    for key, value in tensors.items():
        name = key.removeprefix("base_model.model.").removesuffix(".weight")
        assert torch.equal(value, params[name].detach()), key


def test_checkpoint_holds_the_adapters_and_their_state_only(tmp_path: Path):
    from torch.distributed.checkpoint import FileSystemReader

    trainer = _trained(tmp_path, steps=1)
    path = trainer.save_checkpoint(tmp_path / "ckpt")
    keys = FileSystemReader(str(path / "dcp")).read_metadata().state_dict_metadata
    model_keys = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert model_keys and all(k.endswith((".lora_A", ".lora_B")) for k in model_keys)


def test_compiled_blocks_train_the_adapters_as_eager_does(tmp_path: Path):
    compiled = CONFIG.replace(
        compile=True, compile_backend="aot_eager", compile_scope="blocks", padding_free=True
    )
    eager = _trained(tmp_path / "eager", CONFIG.replace(padding_free=True))
    graph = _trained(tmp_path / "compiled", compiled)
    for (name, want), got in zip(
        eager.model.named_parameters(), graph.model.parameters(), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=name)


def test_targets_that_name_no_linear_layer_are_refused(tmp_path: Path):
    config = CONFIG.replace(lora=LoraSection(rank=4, targets=("qkv",)))
    with pytest.raises(ConfigError, match=r"name no nn\.Linear"):
        PolicyTrainer(save_tiny_model(tmp_path / "model"), config)
    with pytest.raises(ConfigError, match=r"learner\.lora\.rank"):
        CONFIG.replace(lora=LoraSection(rank=-1))
