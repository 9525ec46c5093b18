"""The requests of the tensor-parallel test, by phase (shared by the test and its peers)."""

from __future__ import annotations

import torch

from pipeline.engines import GenerationRequest, SamplingParams
from pipeline.models import CausalLM
from tests.engines.helpers import perturbed_state, prompts


def update_for(model: CausalLM) -> dict[str, torch.Tensor]:
    """The weight update of the test (a tied output layer gets the embedding's tensor)."""
    update = perturbed_state(model, seed=5)
    if model.config.tie_word_embeddings:
        update["lm_head.weight"] = update["model.embed_tokens.weight"]
    return update


def phases() -> list[tuple[str, list[GenerationRequest]]]:
    """Greedy, sampled (seeded and unseeded), then sampled again under the update."""
    texts = prompts(6, [5, 9, 13], seed=3)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=12)
    sampled = SamplingParams(temperature=1.0, max_new_tokens=12, n=3, seed=11)
    unseeded = SamplingParams(temperature=0.8, top_k=20, max_new_tokens=10, n=2)
    return [
        ("greedy", [GenerationRequest(f"g{i}", p, greedy) for i, p in enumerate(texts)]),
        (
            "sampled",
            [GenerationRequest(f"s{i}", p, sampled) for i, p in enumerate(texts[:3])]
            + [GenerationRequest(f"u{i}", p, unseeded) for i, p in enumerate(texts[3:])],
        ),
        ("after_update", [GenerationRequest(f"a{i}", p, sampled) for i, p in enumerate(texts)]),
    ]


def session_turns(engine) -> list[list]:
    """Two episodes' two greedy turns: episode 0 continues from its kept cache, episode 1
    is released in between and prefills its second turn from scratch. A rank that missed
    the release would admit episode 1 into its kept slot and part from its leader."""
    texts = prompts(2, [6, 8], seed=4)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = engine.generate(
        [GenerationRequest(f"e{i}t0", p, greedy, f"e{i}") for i, p in enumerate(texts)]
    )
    engine.release("e1")
    second = engine.generate(
        [
            GenerationRequest(f"e{i}t1", [*o.prompt_ids, *o.output_ids, 5, 6, 7], greedy, f"e{i}")
            for i, o in enumerate(first)
        ]
    )
    return [[o.output_ids, o.cached_tokens] for o in [*first, *second]]
