"""Greedy decoding of the built-in engine equals transformers and full-forward recomputation."""

from __future__ import annotations

import torch
import transformers

from pipeline.engines import GenerationRequest, SamplingParams
from pipeline.models import CausalLM, load_model

from .helpers import TINY, full_forward_logprobs, greedy_reference, prompts

# float32 on CPU: the engine's cached attention and a dense forward differ by round-off only
LOGPROB_ATOL = 1e-4
LENGTHS = [3, 11, 6, 1, 17]  # different on purpose: right padding in the batched prefill


def test_greedy_tokens_match_hf_generate_for_prompts_of_different_lengths(
    model_dir, make_torch_engine
):
    engine = make_torch_engine(max_batch=8)
    batch = prompts(5, LENGTHS)
    params = SamplingParams(temperature=0.0, max_new_tokens=12)
    outs = engine.generate([GenerationRequest(f"p{i}", p, params) for i, p in enumerate(batch)])
    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.eval()
    for prompt, out in zip(batch, outs, strict=True):
        with torch.no_grad():
            ref = hf.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                do_sample=False,
                max_new_tokens=12,
                min_new_tokens=12,
                pad_token_id=0,
                eos_token_id=None,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref_tokens = ref.sequences[0, len(prompt) :]
        assert out.output_ids == ref_tokens.tolist()
        ref_logprobs = torch.stack(ref.logits, 1)[0].float().log_softmax(-1)  # (12, vocab)
        expected = ref_logprobs.gather(1, ref_tokens[:, None])[:, 0]
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
        assert out.finish_reason == "length"
        assert out.token_versions == [0] * 12


def test_greedy_logprobs_equal_native_full_forward_logprobs(model_dir, make_torch_engine):
    engine = make_torch_engine(max_batch=4)
    model = load_model(model_dir)
    assert isinstance(model, CausalLM)
    batch = prompts(6, LENGTHS, seed=5)
    outs = engine.generate(
        [
            GenerationRequest(f"p{i}", p, SamplingParams(temperature=0.0, max_new_tokens=9))
            for i, p in enumerate(batch)
        ]
    )
    for prompt, out in zip(batch, outs, strict=True):
        assert out.output_ids == greedy_reference(model, prompt, 9)
        torch.testing.assert_close(
            torch.tensor(out.logprobs), full_forward_logprobs(model, out), atol=1e-5, rtol=0
        )


def test_sampled_logprobs_equal_learner_recomputation_at_the_sampling_temperature(
    model_dir, make_torch_engine
):
    """Behaviour log-probs are log_softmax(logits / T) of the full distribution, even with
    top-k / top-p truncation: what the learner recomputes with token_logprobs(temperature)."""
    engine = make_torch_engine(max_batch=8)
    model = load_model(model_dir)
    batch = prompts(4, LENGTHS, seed=6)
    settings = [
        SamplingParams(temperature=0.7, max_new_tokens=10, seed=1),
        SamplingParams(temperature=1.3, top_p=0.8, max_new_tokens=10, seed=2),
        SamplingParams(temperature=0.9, top_k=5, max_new_tokens=10, seed=3),
        SamplingParams(temperature=1.0, top_k=7, top_p=0.9, max_new_tokens=10, seed=4),
    ]
    outs = engine.generate(
        [
            GenerationRequest(f"p{i}", p, s)
            for i, (p, s) in enumerate(zip(batch, settings, strict=True))
        ]
    )
    for out, params in zip(outs, settings, strict=True):
        expected = full_forward_logprobs(model, out, temperature=params.temperature)
        torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-5, rtol=0)


def test_prompt_filling_max_seq_len_finishes_with_length_at_cache_capacity(make_torch_engine):
    engine = make_torch_engine(max_batch=2, max_seq_len=16)
    (out,) = engine.generate(
        [GenerationRequest("p", prompts(1, [14])[0], SamplingParams(0.0, max_new_tokens=50))]
    )
    # 14 prompt tokens + 2 generated fit the cache, and the last token is never fed back
    assert len(out.output_ids) == 3
    assert out.finish_reason == "length"
    assert TINY.vocab_size > max(out.output_ids)
