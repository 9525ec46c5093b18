"""Your own model and data, as the README says: a local Hugging Face Qwen2 directory
(random weights, a tokenizer trained here, a chat template) and a GSM8K parquet made by
`pipeline data convert`, through profiles/qwen2.5-0.5b-gsm8k.toml on CPU for 3 steps; the
exported final model loads in transformers with the pipeline's logits."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

from pipeline.data.formats import write_rows
from tests.gsm8k_fixture import gsm8k_fixture_rows

REPO = Path(__file__).resolve().parents[2]
PIPELINE = [sys.executable, "-m", "pipeline.cli"]
CHAT = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# what the H200 profile sets that a CPU run of the tiny model cannot or need not do
ON_CPU = {
    "pools.gpu.kind": "cpu",
    "model.dtype": "float32",
    "learner.trainer.param_dtype": "float32",
    "learner.trainer.exp_avg_dtype": "float32",
    "run.torch_threads": "1",
}


def make_hf_qwen2(directory: Path, corpus: list[str]) -> Path:
    """A Qwen2 checkpoint as transformers saves one, with a BPE tokenizer of our own."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=400, special_tokens=special, show_progress=False)
    )
    from tokenizers import decoders

    bpe.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        chat_template=CHAT,
    )
    tokenizer.save_pretrained(directory)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(directory)
    return directory


def test_a_local_hf_model_and_converted_gsm8k_train_and_export_for_transformers(tmp_path):
    rows = gsm8k_fixture_rows()
    raw = write_rows(rows, tmp_path / "gsm8k.jsonl")
    model = make_hf_qwen2(tmp_path / "qwen2", [r["question"] + " " + r["answer"] for r in rows])
    data = tmp_path / "gsm8k-train.parquet"
    subprocess.run([*PIPELINE, "data", "convert", "gsm8k", str(raw), str(data)], check=True)
    cmd = [*PIPELINE, "run", "--no-progress", "--profile", "profiles/qwen2.5-0.5b-gsm8k.toml"]
    cmd += ["--name", "own", "--run.runs_dir", str(tmp_path / "runs")]
    cmd += ["--model.path", str(model), "--task.dataset", str(data)]
    short = {
        "controller.steps": "3",
        "controller.prompts_per_step": "2",
        "rollout.n_samples": "2",
        "rollout.max_new_tokens": "12",
        "rollout.max_batch": "8",
        "services.reward.replicas": "1",
    }
    for key, value in {**ON_CPU, **short}.items():
        cmd += [f"--{key}", value]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    run = tmp_path / "runs" / "own"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["completed"] and summary["steps"] == 3
    from pipeline.wire.recording import QueueReader

    prompt = QueueReader(run / "queues/prompts.log").__iter__().__next__().decode().body
    assert prompt.prompt_text.startswith("<|im_start|>user\n")  # the chat template applied

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.models import load_model

    final = run / "final_model"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (final / name).is_file(), name
    assert (final / "generation_config.json").is_file()
    tokenizer = AutoTokenizer.from_pretrained(final)
    hf = AutoModelForCausalLM.from_pretrained(final, torch_dtype=torch.float32).eval()
    ids = torch.tensor([tokenizer.encode("How many eggs does she sell? #### 18")])
    with torch.no_grad():
        theirs = hf(ids).logits
        ours = load_model(final, dtype=torch.float32)(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)
    trained = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    # three steps of training changed the weights the export holds
    assert not torch.equal(trained.model.embed_tokens.weight, hf.model.embed_tokens.weight)
