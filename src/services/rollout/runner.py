"""The rollout service's engine, driven on its own thread so the event loop stays live.

Prompts from concurrent `generate` calls join the engine's running batch (continuous
batching); a weight update is offered from any thread (the weight receiver) and the engine
thread applies it between two steps, also when it has nothing to generate, so sequences in
flight record both versions and the receiver's WeightDone follows the apply.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Awaitable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from pipeline.log import get_logger
from pipeline.wire.messages import Prompt, TensorRef
from pipeline.wire.samples import SampleArrays

if TYPE_CHECKING:
    from pipeline.engines import GenerationRequest

# a pause ends with the next weight update; this bounds it for a learner that hangs
# mid-step (a restarted one publishes on the engine's registration, which ends it sooner)
PAUSE_MAX_S = 120.0


@dataclass
class _Pending:
    prompt: Prompt
    future: asyncio.Future[list[SampleArrays]]
    outputs: dict[int, Any] = field(default_factory=dict)


class EngineRunner:
    def __init__(
        self,
        engine: Any,
        tokenizer: Any,
        loop: asyncio.AbstractEventLoop,
        *,
        burst_quiet_s: float = 0.003,
        burst_max_s: float = 0.025,
    ) -> None:
        self.engine = engine
        # an idle engine given a prompt waits while more keep coming (burst_quiet_s apart at
        # most, burst_max_s in all) so that a step's prompts start together (_gather_burst)
        self.burst_quiet_s = burst_quiet_s
        self.burst_max_s = burst_max_s
        self.tokenizer = tokenizer
        self.loop = loop
        # requests with their callers' futures, and the sessions to release
        self._submit: queue.SimpleQueue[tuple[GenerationRequest, _Pending] | str] = (
            queue.SimpleQueue()
        )
        self._pending: dict[str, _Pending] = {}
        self._wake = threading.Event()
        self._closed = False
        self._error: BaseException | None = None
        self._update: Future[int] | None = None  # the latest weight update offered
        # turns (run.gpu_sharing): no decoding until this version is offered, or the deadline
        self._paused_until: int | None = None
        self._pause_deadline = 0.0
        self.paused_s = 0.0  # time spent paused so far
        self.pauses = 0
        self.log = get_logger("engine_runner")
        self._thread = threading.Thread(target=self._loop, name="engine", daemon=True)
        self._thread.start()

    @property
    def version(self) -> int:
        return int(self.engine.version)

    def engine_stats(self) -> dict[str, float]:
        """Prompt rows prefilled per sample so far (built-in engine): 1 / n_samples with
        shared prefill, 1 without; and the mean rows of a decode step so far."""
        engine = getattr(self.engine, "engine", self.engine)  # a TP rank's TorchEngine
        out = {}
        if samples := getattr(engine, "prefill_samples", 0):
            out["rollout/prefill_rows_per_sample"] = engine.prefill_rows / samples
        if steps := getattr(engine, "decode_steps", 0):
            out["rollout/decode_batch_mean"] = engine.decode_rows / steps
        if hasattr(engine, "recomputed_rows"):
            out["rollout/recomputed_rows"] = float(engine.recomputed_rows)
        if (sessions := getattr(engine, "sessions", None)) is not None:
            out["rollout/kv_kept"] = float(len(sessions))
            out["rollout/kv_evictions"] = float(sessions.evictions)
        if self.pauses:
            out["rollout/pauses"] = float(self.pauses)
            out["rollout/paused_s"] = self.paused_s
        return out

    def stop_ids(self, prompt: Prompt) -> tuple[int, ...]:
        """End-of-sequence, unless the prompt's row says ignore_eos."""
        eos = self.tokenizer.eos_token_id
        return () if eos is None or prompt.ignore_eos else (int(eos),)

    async def generate(
        self, prompt: Prompt, prompt_ids: np.ndarray, extra_stop_ids: tuple[int, ...] = ()
    ) -> list[SampleArrays]:
        """The prompt's `n_samples` responses; each ends at end-of-sequence (unless the
        prompt's ignore_eos), at one of `extra_stop_ids` or at the prompt's token limit."""
        return await self._submit_prompt(prompt, prompt_ids, extra_stop_ids).future

    async def generate_turn(
        self,
        prompt: Prompt,
        prompt_ids: np.ndarray,
        extra_stop_ids: tuple[int, ...],
        session: str | None,
    ) -> tuple[SampleArrays, int, bool]:
        """One turn of an episode (`prompt.n_samples` is 1) in `session` (None: keep no KV
        cache): its sample, the prompt tokens served from the session's kept cache, and
        whether that cache had been evicted."""
        pending = self._submit_prompt(prompt, prompt_ids, extra_stop_ids, session)
        (sample,) = await pending.future
        out = pending.outputs[0]
        return sample, out.cached_tokens, out.kv_evicted

    def release(self, session: str) -> None:
        """End an episode's session: the engine frees the KV cache it kept."""
        self._submit.put(session)
        self._wake.set()

    def _submit_prompt(
        self,
        prompt: Prompt,
        prompt_ids: np.ndarray,
        extra_stop_ids: tuple[int, ...],
        session: str | None = None,
    ) -> _Pending:
        from pipeline.engines import GenerationRequest, SamplingParams

        if self._error is not None:
            raise self._error
        params = SamplingParams(
            temperature=prompt.temperature,
            top_p=prompt.top_p,
            top_k=max(0, prompt.top_k),
            max_new_tokens=prompt.max_new_tokens,
            stop_token_ids=(*self.stop_ids(prompt), *extra_stop_ids),
            n=prompt.n_samples,
        )
        pending = _Pending(prompt=prompt, future=self.loop.create_future())
        ids = [int(t) for t in prompt_ids]
        self._submit.put((GenerationRequest(prompt.uid, ids, params, session), pending))
        self._wake.set()
        return pending

    async def warm_up(self, prompts: int, samples: int, prompt_len: int, new_tokens: int) -> float:
        """Generate one step's worth of random prompts at the run's lengths before serving:
        the engine compiles its blocks and sampler and captures its decode graphs for the
        batch sizes a step meets, while the trainers warm up too. Then one sample and two
        on their own: the end of a step decodes one or two rows, a size the compiler
        specialises. Its seconds."""
        start = self.loop.time()
        rng = np.random.default_rng(0)
        vocab = max(2, len(self.tokenizer))

        def call(i: int, n: int, tokens: int) -> Awaitable[list[SampleArrays]]:
            ids = rng.integers(0, vocab, prompt_len).astype(np.int32)
            ref = TensorRef(dtype="int32", shape=(prompt_len,), frame=0)
            # every sample to the run's length: the batch sizes of a step's whole tail
            prompt = Prompt(
                uid=f"warmup-{i}",
                prompt_ids=ref,
                n_samples=n,
                max_new_tokens=tokens,
                ignore_eos=True,
            )
            return self.generate(prompt, ids)

        await asyncio.gather(*(call(i, samples, new_tokens) for i in range(prompts)))
        for n in (1, 2):
            await call(prompts + n, n, min(4, new_tokens))
        return self.loop.time() - start

    def update_weights(self, tensors: Mapping[str, Any], version: int) -> Future[int]:
        """The weight receiver's apply: offer its staging tensors (validated against the
        engine's parameters by the receiver); the Future resolves once the engine thread has
        copied them into its live weights at its next safe point."""
        if self._error is not None:
            raise self._error
        future = self.engine.update_weights(tensors.items(), version, checked=True)
        self._update = future
        if self._closed:  # the loop has ended or is ending: no safe point will come
            future.cancel()
        self._wake.set()
        return future

    def pause(self, version: int) -> None:
        """Stop decoding until the weights of `version` are offered (the learner trains the
        step that makes them on the device this engine shares): the running samples keep
        their KV cache and resume under the new weights. A learner that never publishes
        (it died mid-step) frees the engine after PAUSE_MAX_S."""
        if version <= self.version:
            return
        self._pause_deadline = time.monotonic() + PAUSE_MAX_S
        self._paused_until = version
        self.pauses += 1

    def _paused(self) -> bool:
        until = self._paused_until
        if until is None:
            return False
        if self._update_due() or self.version >= until or time.monotonic() > self._pause_deadline:
            self._paused_until = None
            return False
        return True

    def _update_due(self) -> bool:
        update = self._update
        return update is not None and not update.done()

    def _finish(self, pending: _Pending) -> None:
        samples = []
        for index in range(pending.prompt.n_samples):
            out = pending.outputs[index]
            ids = np.asarray(out.output_ids, np.int32)
            samples.append(
                SampleArrays(
                    uid=f"{pending.prompt.uid}/{index}",
                    response_ids=ids,
                    behaviour_logprobs=np.asarray(out.logprobs, np.float32),
                    token_versions=np.asarray(out.token_versions, np.int32),
                    finish_reason=out.finish_reason,
                    response_text=self.tokenizer.decode(ids.tolist(), skip_special_tokens=True),
                )
            )
        self.loop.call_soon_threadsafe(_resolve, pending.future, samples)

    def _take_submitted(self) -> None:
        while not self._submit.empty():
            item = self._submit.get()
            if isinstance(item, str):
                self.engine.release(item)
                continue
            request, pending = item
            self._pending[request.request_id] = pending
            self.engine.add_request(request)

    def _loop(self) -> None:
        try:
            while not self._closed:
                idle = not self.engine.has_unfinished()
                self._take_submitted()
                if idle and self.engine.has_unfinished():
                    self._gather_burst()
                if not self.engine.has_unfinished() and not self._update_due():
                    self._wake.wait(0.05)
                    self._wake.clear()
                    continue
                if self._paused():
                    start = time.monotonic()
                    self._wake.wait(0.05)
                    self._wake.clear()
                    self.paused_s += time.monotonic() - start
                    continue
                for out in self.engine.step():
                    pending = self._pending[out.request_id]
                    pending.outputs[out.sample_index] = out
                    if len(pending.outputs) == pending.prompt.n_samples:
                        del self._pending[out.request_id]
                        self._finish(pending)
        except BaseException as exc:  # fail the service visibly, never hang its callers
            self._error = exc
            self.log.exception("engine_failed")
            for pending in self._pending.values():
                self.loop.call_soon_threadsafe(_fail, pending.future, exc)
        finally:
            self._closed = True
            if self._update is not None:
                self._update.cancel()  # no safe point will come: the receiver stops waiting

    def _gather_burst(self) -> None:
        """The prompts of a burst into an idle engine before its first step. The event loop
        hands a step's prompts over one at a time, and without this the engine started on
        the first few alone and the others finished several decode steps after them."""
        deadline = time.monotonic() + self.burst_max_s
        while not self._closed:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            self._wake.clear()
            if self._submit.empty() and not self._wake.wait(min(self.burst_quiet_s, left)):
                return
            self._take_submitted()

    async def close(self) -> None:
        self._closed = True
        self._wake.set()
        await asyncio.to_thread(self._thread.join, 10)
        self.engine.close()


def _resolve(future: asyncio.Future[Any], value: Any) -> None:
    if not future.done():
        future.set_result(value)


def _fail(future: asyncio.Future[Any], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)


def prompts_in_flight(config: Any) -> int:
    """rollout.prompts_in_flight, or by default: fill max_batch on a GPU, 8 on a CPU."""
    rollout = config.rollout
    if rollout.prompts_in_flight > 0:
        return int(rollout.prompts_in_flight)
    if config.pools[config.services["rollout"].pool].kind == "cuda":
        return max(1, rollout.max_batch // max(1, rollout.n_samples))
    return 8


def engine_device(config: Any) -> str:
    return "cuda" if config.pools[config.services["rollout"].pool].kind == "cuda" else "cpu"


def tp_group(ctx: Any) -> Any:
    """This process's place in its TP engine replica (None: a one-process replica)."""
    if ctx.ranks is None:
        return None
    from pipeline.models.tensor_parallel import TPGroup

    return TPGroup(ctx.ranks.rank, ctx.ranks.world, control=ctx.ranks.group)


def build_engine(ctx: Any) -> Any:
    """The configured engine on the run's model directory (blocking): on a rank of a TP
    replica, that rank's TPEngine over its shard of the model."""
    import torch

    from pipeline.engines import make_engine
    from pipeline.models.hf_causal import log_choice, rollout_choice
    from pipeline.tasks.prepare import model_dir

    config = ctx.config
    device = engine_device(config)
    options: dict[str, Any] = {}
    if config.rollout.engine == "torch" and device == "cuda":
        fast = config.rollout.kernels == "auto"
        options = {"use_cuda_graphs": fast, "compile": fast, "overlap": fast}
        if not fast:  # None, the engine's default: wherever the kernels run
            options |= {"decode_kernel": False, "sample_kernel": False}
    if config.rollout.engine == "torch":
        options["kv_on_update"] = config.rollout.kv_on_update
    if config.rollout.engine == "torch" and ctx.ranks is not None:
        options["tp"] = tp_group(ctx)
    if config.rollout.engine == "vllm" and config.services["rollout"].tp > 1:
        options["tensor_parallel_size"] = config.services["rollout"].tp
    directory = model_dir(config, ctx.run_dir)
    log_choice("rollout", rollout_choice(directory, config.rollout.engine))
    return make_engine(
        config.rollout.engine,
        directory,
        device=device,
        dtype=getattr(torch, config.model.dtype),
        max_batch=config.rollout.max_batch,
        max_seq_len=config.task.max_prompt_tokens + config.rollout.max_new_tokens + 1,
        seed=config.run.seed + ctx.replica,
        **options,
    )


async def start_engine(ctx: Any) -> EngineRunner:
    """Build the configured engine and drive it from its own thread (warmed up on a GPU).
    A TP replica's leader tells its other ranks to build theirs first (they follow)."""
    from pipeline.data.tokenizer import load_tokenizer
    from pipeline.tasks.prepare import model_dir

    config = ctx.config
    if ctx.ranks is not None:
        from pipeline.wire.messages import RankCommand, RankOp

        await asyncio.to_thread(ctx.ranks.send, RankCommand(op=RankOp.ENGINE))
    tokenizer = load_tokenizer(model_dir(config, ctx.run_dir))
    device = engine_device(config)
    # off the loop: loading and graph capture take a while
    engine = await asyncio.to_thread(build_engine, ctx)
    rollout = config.rollout
    runner = EngineRunner(engine, tokenizer, asyncio.get_running_loop())
    if device == "cuda" and rollout.kernels == "auto":
        seconds = await runner.warm_up(
            prompts_in_flight(config),
            rollout.n_samples,
            config.task.max_prompt_tokens,
            rollout.max_new_tokens,
        )
        from pipeline.training.warm_up import compile_counts

        runner.log.info("warmed_up", seconds=round(seconds, 2), **compile_counts())
    return runner


class EngineFollower:
    """A TP replica's rank other than 0 (`RolloutService.follower`): on ENGINE it builds
    its shard of the engine and a weight receiver for its shards, then steps in lockstep
    with the leader until the leader closes the engine."""

    def __init__(self, ctx: Any) -> None:
        self.ctx = ctx
        self.log = get_logger("engine_follower")

    def execute(self, command: Any) -> None:
        from pipeline.weights.link import start_receiver
        from pipeline.wire.messages import RankOp

        if command.op != RankOp.ENGINE:
            raise RuntimeError(f"a TP engine rank has no part in {RankOp(command.op).name}")
        engine = build_engine(self.ctx)
        ranks = self.ctx.ranks

        def apply(tensors: Mapping[str, Any], version: int) -> Future[int]:
            return engine.update_weights(tensors.items(), version, checked=True)

        receiver = start_receiver(
            self.ctx, engine.model, apply, engine.version, tp_rank=ranks.rank, tp_size=ranks.world
        )
        self.log.info("engine_following", rank=ranks.rank, tp=ranks.world)
        try:
            engine.follow()
        finally:
            receiver.stop()
