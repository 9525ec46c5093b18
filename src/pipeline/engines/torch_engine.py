"""The built-in engine: continuous batching on the native decoder with a slot KV cache.

Each step (1) applies staged weights when due, (2) admits waiting samples into free slots
with one batched, right-padded prefill that also samples their first token, and (3) decodes
one token for every sample that was already running, in one batched forward of t = 1.
Samples leave as soon as they emit a stop token or reach max_new_tokens, freeing their slot
for the next waiting sample. Sampling, log-probs, stop detection and lengths stay on the
device; a step synchronises with the host once, to learn which rows finished. On CUDA in
half precision a decode step attends with the Triton kernel of models/decode_attention.py,
which reads each row's cached keys and values in place.

Host overlap (TorchEngineConfig.overlap, on by default on CUDA): reading the finished flags
right after launching a step would leave the GPU idle while Python prepares the next one. With
overlap, a step's flags travel to pinned host memory while the next step is launched, and are
read after it: a sample that finished at step t stays in the batch one more step as a frozen
row (its length, tokens and cache no longer change; its KV write goes to the sink column), its
slot is freed during step t + 1 and its output is returned by step t + 2. Tokens, log-probs and
versions are the same as without overlap.

Weight updates land between steps: step() copies the caller's tensors into the live
parameters and then resolves the update's Future (engines/weights.py). kv_on_update="recompute"
(default) re-prefills every running sample under the new weights before its next token, so
each token tagged with version v is exactly a draw from policy v given its prefix; "keep"
reuses the cached keys and values computed by the old weights (cheaper; later tokens then come
from a mix of versions, as in PipelineRL). drain_on_update stops admitting while an update is
pending and applies it once every running sample has finished, so no sample mixes versions.

Multi-turn sessions (engines/sessions.py): a request with a session keeps its slot and KV
cache when its sample finishes, and the session's next request prefills only the tokens past
the cached prefix, into the same slot.

Determinism: sampling noise is a hash of (sample seed, token index, vocab id), see rng.py.
A request with a seed gets the same tokens whatever it is batched with and whenever it is
admitted (up to round-off of batched logits deciding near-ties); requests without a seed
draw one from the engine's torch.Generator(config.seed) in add_request, so a run is
reproducible from the engine seed and the order of requests. Temperature 0 is greedy.
"""

from __future__ import annotations

import heapq
import os
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, cast

import torch

from pipeline.engines import sample_kernel
from pipeline.engines.base import Engine
from pipeline.engines.cuda_graphs import DecodeGraphs
from pipeline.engines.errors import InvalidRequestError
from pipeline.engines.host_copy import HostCopy, copy_to_host
from pipeline.engines.rng import GumbelNoise, sample_key
from pipeline.engines.sampling import RowParams, sample
from pipeline.engines.sessions import Sessions
from pipeline.engines.slot_state import SlotState
from pipeline.engines.types import GenerationOutput, GenerationRequest, SamplingParams
from pipeline.engines.weights import ModelWeights, ModuleWeightsEngine
from pipeline.errors import ConfigError
from pipeline.log import get_logger
from pipeline.models import CausalLM, KVCache, load_model
from pipeline.models.attention import eager_attend
from pipeline.models.decode_attention import decode_kernel_supported
from pipeline.models.decoder import DecoderBlock
from pipeline.models.fused import fuse_projections
from pipeline.models.tensor_parallel import local_heads
from pipeline.training.compile_limits import allow_recompiles

_log = get_logger("engines.torch")


@dataclass(frozen=True)
class TorchEngineConfig:
    """Capacity and policy knobs of the built-in engine.

    max_batch is the number of KV-cache slots (samples decoded together). max_prefill_tokens
    bounds one prefill's padded size (rows x longest prompt); a single prompt is always
    admitted. seed feeds the generator that seeds requests without their own seed.
    """

    max_batch: int = 32
    max_seq_len: int = 2048
    max_prefill_tokens: int = 16384
    kv_on_update: Literal["recompute", "keep"] = "recompute"
    use_cuda_graphs: bool = False
    # CUDA only: torch.compile each decoder block (attention itself stays eager, see
    # models.attention.eager_attend) and the sampler, so a decode step is a few fused kernels
    # per layer instead of dozens of small ones; costs a compile at start-up
    compile: bool = False
    # read a step's finished flags one step late so the host never waits for the device;
    # None: on for CUDA, off on CPU (where nothing runs asynchronously)
    overlap: bool | None = None
    # decode attention by the Triton kernel that reads the KV cache in place (no per-layer
    # gather of the batch's keys/values); None: wherever it runs (CUDA half precision)
    decode_kernel: bool | None = None
    # prefill one row per prompt of the admitted samples and copy its keys and values to its
    # n - 1 siblings (same logits: only their noise differs)
    shared_prefill: bool = True
    # untruncated sampling (no top-k / top-p) by the Triton kernels of sample_kernel.py, one
    # read of the logits; None: wherever they run (CUDA half precision)
    sample_kernel: bool | None = None
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_batch", "max_seq_len", "max_prefill_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.kv_on_update not in ("recompute", "keep"):
            raise ConfigError(
                f"kv_on_update must be 'recompute' or 'keep', got {self.kv_on_update!r}"
            )


@dataclass
class _Sample:
    """Host bookkeeping of one sample.

    Every running sample gains exactly one token per step, so its token count is known on
    the host without reading the device: generated = engine clock - admit_clock.
    """

    request_id: str
    sample_index: int
    prompt_ids: list[int]
    params: SamplingParams
    key: int
    max_new: int
    session: str | None = None
    slot: int = -1
    admit_clock: int = 0
    offset: int = 0  # prompt tokens whose keys and values the slot already held at admission
    evicted: bool = False  # the session's kept cache was evicted before this turn
    shared: bool = False  # its prompt's keys and values were copied from another's prefill

    @property
    def truncates(self) -> bool:
        p = self.params
        return not p.greedy and (p.top_k > 0 or p.top_p < 1.0)


def _prompt_leaders(samples: list[_Sample], *, same_weights: bool) -> list[int]:
    """Per sample, the index of the first sample that prefills the same tokens: its
    request's first sample; for a session's turn (a group's episodes are requests of their
    own), the first admitted with the same sequence and cached prefix. A continued turn
    shares only where every kept cache holds the current weights' keys (`same_weights`)."""
    first: dict[object, int] = {}
    return [first.setdefault(_prefill_key(s, same_weights), i) for i, s in enumerate(samples)]


def _prefill_key(sample: _Sample, same_weights: bool) -> object:
    if sample.session is None:
        return sample.request_id
    if sample.offset and not same_weights:
        return (sample.session,)
    return (sample.offset, tuple(sample.prompt_ids))


@dataclass
class _RunningView:
    """The running set as the decode step needs it; rebuilt only when the set changes."""

    samples: list[_Sample]
    slots: torch.Tensor  # (b,) slot of each sample, same order
    max_offset: int  # max(prompt_len - admit_clock): kv_len = max_offset + clock
    truncates: bool
    all_greedy: bool


def compile_for_decoding(model: CausalLM) -> None:
    """torch.compile every block in place, with its attention (KV-cache write included)
    left eager: one symbolic-shape graph serves prefill and decode of any batch."""
    allow_recompiles()
    for block in cast(Iterable[DecoderBlock], model.model.layers):
        eager_attend(block.self_attn)
        block.compile(dynamic=True)


class TorchEngine(ModuleWeightsEngine, Engine):
    """Engine over a native `CausalLM` on CPU or CUDA.

    Per step, Python work is proportional to the samples admitted or finished, not to the
    batch: the decode path reuses a cached view of the running set and reads the device
    once (indices of finished rows).
    """

    def __init__(self, model: CausalLM, config: TorchEngineConfig | None = None) -> None:
        self.config = config or TorchEngineConfig()
        cfg = self.config
        self.model = model.eval()
        fuse_projections(model)  # q/k/v and gate/up as one GEMM each (parameters now views)
        self.device = model.lm_head.weight.device
        self.vocab_size = model.config.vocab_size
        heads, kv_heads = local_heads(model)  # this rank's, under tensor parallelism
        self.cache = KVCache(
            model.config.num_hidden_layers,
            cfg.max_batch,
            cfg.max_seq_len,
            kv_heads,
            model.config.head_dim,
            dtype=model.lm_head.weight.dtype,
            device=self.device,
        )
        supported = decode_kernel_supported(self.cache.k, heads)
        if cfg.decode_kernel and not supported:
            raise ConfigError(
                "decode_kernel needs Triton and a CUDA half-precision KV cache with a power-of-2 "
                "head_dim >= 16; set it to false or leave it unset (auto)"
            )
        self.cache.decode_kernel = supported if cfg.decode_kernel is None else cfg.decode_kernel
        self.state = SlotState(cfg.max_batch, cfg.max_seq_len, self.device)
        self.noise = GumbelNoise(self.vocab_size, self.device)
        self.weights = ModelWeights(model)
        self._sample_torch = sample
        if cfg.compile and self.device.type == "cuda":
            compile_for_decoding(model)
            self._sample_torch = torch.compile(sample, dynamic=True)
        kernel_runs = sample_kernel.supported(model.lm_head.weight)  # the logits' dtype
        if cfg.sample_kernel and not kernel_runs:
            raise ConfigError(
                "sample_kernel needs Triton and a CUDA half-precision model; set it to false "
                "or leave it unset (auto)"
            )
        self.sample_kernel = kernel_runs if cfg.sample_kernel is None else cfg.sample_kernel
        self.graphs: DecodeGraphs | None = None
        if cfg.use_cuda_graphs and self.device.type == "cuda":
            self.graphs = DecodeGraphs(model, self.cache, cfg.max_batch)
        self._seed_gen = torch.Generator().manual_seed(cfg.seed)
        # prompt rows run through prefill forwards, and the samples they served
        self.prefill_rows = self.prefill_samples = 0
        # decode steps run and the rows they decoded: the mean decode batch
        self.decode_steps = self.decode_rows = 0
        # running samples prefilled again after a weight update (kv_on_update recompute)
        self.recomputed_rows = 0
        self._waiting: deque[_Sample] = deque()
        self._running: dict[int, _Sample] = {}  # slot -> sample
        self._view: _RunningView | None = None
        self._free: list[int] = list(range(cfg.max_batch))  # min-heap of free slots
        self._unfinished: dict[str, int] = {}  # request_id -> samples not yet returned
        self.sessions = Sessions()
        self._in_engine: set[str] = set()  # sessions with a sample waiting or running
        self._clock = 0  # steps that produced tokens
        self._paused = False
        self.overlap = cfg.overlap if cfg.overlap is not None else self.device.type == "cuda"
        # the last launched step: its rows and their finished flags on their way to the host
        self._inflight: tuple[list[_Sample], HostCopy] | None = None
        # finished samples whose tokens are on their way to the host
        self._gathered: list[tuple[list[_Sample], HostCopy]] = []

    @classmethod
    def from_pretrained(
        cls,
        path: str | os.PathLike[str],
        *,
        device: torch.device | str = "cpu",
        dtype: torch.dtype | None = None,
        config: TorchEngineConfig | None = None,
    ) -> TorchEngine:
        model = load_model(path, dtype=dtype, device=device)
        assert isinstance(model, CausalLM)
        return cls(model, config)

    # -- Engine interface ------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self.weights.version

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running or self._inflight or self._gathered)

    def add_request(self, request: GenerationRequest) -> None:
        params = request.params
        prompt = list(request.prompt_ids)
        max_len = self.config.max_seq_len
        if request.request_id in self._unfinished:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in flight")
        if len(prompt) > max_len:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt of {len(prompt)} tokens exceeds "
                f"max_seq_len={max_len}; raise max_seq_len or shorten the prompt"
            )
        if min(prompt) < 0 or max(prompt) >= self.vocab_size:
            raise InvalidRequestError(
                f"request {request.request_id!r}: prompt ids must lie in [0, {self.vocab_size})"
            )
        session = request.session
        if session is not None and session in self._in_engine:
            raise InvalidRequestError(
                f"request {request.request_id!r}: session {session!r} has a request in flight"
            )
        seed = params.seed
        if seed is None:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._seed_gen).item())
        # the last token of a sample is never fed back, so it may sit at position max_seq_len
        max_new = min(params.max_new_tokens, max_len - len(prompt) + 1)
        for index in range(params.n):
            key = sample_key(seed, index)
            self._waiting.append(
                _Sample(request.request_id, index, prompt, params, key, max_new, session)
            )
        self._unfinished[request.request_id] = params.n
        if session is not None:
            self._in_engine.add(session)

    def release(self, session: str) -> None:
        slot = self.sessions.release(session, in_flight=session in self._in_engine)
        if slot is not None:
            heapq.heappush(self._free, slot)

    @torch.no_grad()
    def step(self) -> list[GenerationOutput]:
        self._apply_weights_if_due()
        launched = None if self._paused else self._launch()
        if self.overlap:  # the previous step's flags, read now that this step is queued
            outputs = self._collect()
            self._resolve(self._inflight)
            self._inflight = launched
            return outputs
        self._resolve(launched)
        return self._collect()

    def _launch(self) -> tuple[list[_Sample], HostCopy] | None:
        """Queue one step (prefill of admitted samples, decode of running ones); its rows and
        their finished flags, on their way to the host."""
        view = self._running_view()  # samples running before this step's admissions
        admitted = self._admit()
        flags: list[torch.Tensor] = []
        if admitted:
            flags.append(self._prefill(admitted))
        if view.samples:
            flags.append(self._decode(view))
            self.decode_steps += 1
            self.decode_rows += len(view.samples)
        if not flags:
            return None
        self._clock += 1
        return [*admitted, *view.samples], copy_to_host(torch.cat(flags))

    # -- scheduling ------------------------------------------------------------------------

    def _generated(self, sample: _Sample) -> int:
        return self._clock - sample.admit_clock

    def _running_view(self) -> _RunningView:
        if self._view is None:
            samples = list(self._running.values())
            self._view = _RunningView(
                samples=samples,
                slots=torch.tensor([s.slot for s in samples], dtype=torch.long, device=self.device),
                max_offset=max((len(s.prompt_ids) - s.admit_clock for s in samples), default=0),
                truncates=any(s.truncates for s in samples),
                all_greedy=all(s.params.greedy for s in samples),
            )
        return self._view

    def _apply_weights_if_due(self) -> None:
        if not self.weights.has_pending():
            return
        self._resolve(self._inflight)  # exact token counts of the running samples
        self._inflight = None
        start = time.perf_counter()
        version = self.weights.apply()
        if version is None:
            return  # withdrawn (the receiver timed out): the old weights keep serving
        self.state.version.fill_(version)  # the tag _emit writes per token, kept on the device
        if self.config.kv_on_update == "recompute":
            self.sessions.mark_stale()
            if self._running:
                self._recompute_kv(list(self._running.values()))
        _log.info(
            "weights applied",
            version=version,
            running=len(self._running),
            kv=self.config.kv_on_update,
            seconds=round(time.perf_counter() - start, 4),
        )

    def _admit(self) -> list[_Sample]:
        admitted: list[_Sample] = []
        longest = 0
        budget = self.config.max_prefill_tokens
        while self._waiting:
            nxt = self._waiting[0]
            kept = self.sessions.peek(nxt.session)
            offset = 0 if kept is None else kept.reusable(nxt.prompt_ids)
            width = max(longest, len(nxt.prompt_ids) - offset)
            if admitted and (len(admitted) + 1) * width > budget:
                break
            # a kept session is evicted only for a sample admitted now
            if kept is None and not self._free and not self._evict():
                break
            self._waiting.popleft()
            if nxt.session is not None:
                _, nxt.evicted = self.sessions.take(nxt.session)
            nxt.slot = heapq.heappop(self._free) if kept is None else kept.slot
            nxt.offset = offset
            nxt.admit_clock = self._clock
            self._running[nxt.slot] = nxt
            admitted.append(nxt)
            longest = width
        if admitted:
            self._view = None
            self._write_params(admitted)
        return admitted

    def _evict(self) -> bool:
        """Free the slot of the least recently kept session, if any is kept."""
        slot = self.sessions.evict()
        if slot is None:
            return False
        heapq.heappush(self._free, slot)
        return True

    def _write_params(self, samples: list[_Sample]) -> None:
        st, dev = self.state, self.device
        slots = torch.tensor([s.slot for s in samples], device=dev)
        st.temperature[slots] = torch.tensor(
            [s.params.temperature for s in samples], dtype=torch.float32, device=dev
        )
        st.top_p[slots] = torch.tensor(
            [s.params.top_p for s in samples], dtype=torch.float32, device=dev
        )
        st.top_k[slots] = torch.tensor([s.params.top_k for s in samples], device=dev)
        st.keys[slots] = torch.tensor([s.key for s in samples], dtype=torch.int32, device=dev)
        st.max_new[slots] = torch.tensor([s.max_new for s in samples], device=dev)
        st.prompt_len[slots] = torch.tensor([len(s.prompt_ids) for s in samples], device=dev)
        st.done[slots] = False
        st.ensure_stop_width(max(len(s.params.stop_token_ids) for s in samples))
        width = st.stop_ids.shape[1]
        stops = [
            [*s.params.stop_token_ids, *[-1] * (width - len(s.params.stop_token_ids))]
            for s in samples
        ]
        st.stop_ids[slots] = torch.tensor(stops, dtype=torch.long, device=dev)

    # -- forward passes --------------------------------------------------------------------

    def _prefill(self, samples: list[_Sample]) -> torch.Tensor:
        """Batched prefill of new samples, sampling their first token; finished flags (k,).
        A session's next turn prefills only its prompt past the slot's cached prefix."""
        chunks = [s.prompt_ids[s.offset :] for s in samples]
        lengths = [len(c) for c in chunks]
        width = max(lengths)
        ids = torch.tensor(
            [c + [0] * (width - n) for c, n in zip(chunks, lengths, strict=True)],
            device=self.device,
        )  # (k, width)
        lens = torch.tensor(lengths, device=self.device)  # (k,)
        offsets = torch.tensor([s.offset for s in samples], device=self.device)  # (k,)
        cols = torch.arange(width, device=self.device)
        positions = torch.where(
            cols[None, :] < lens[:, None], offsets[:, None] + cols[None, :], -1
        )  # (k, width)
        slots = torch.tensor([s.slot for s in samples], device=self.device)  # (k,)
        st = self.state
        st.tokens[slots[:, None], torch.where(positions >= 0, positions, st.sink)] = ids
        st.length[slots] = offsets + lens
        kv_len = max(len(s.prompt_ids) for s in samples)
        logits = self._prefill_forward(samples, ids, positions, slots, lens, kv_len)
        return self._emit(
            slots,
            logits,
            truncate=any(s.truncates for s in samples),
            all_greedy=all(s.params.greedy for s in samples),
        )

    def _prefill_forward(
        self,
        samples: list[_Sample],
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        lens: torch.Tensor,
        kv_len: int,
    ) -> torch.Tensor:
        """The prefill's last-token logits (k, vocab): with shared_prefill, one row per
        prompt, its keys and values copied to its siblings' slots."""
        cfg = self.config
        leader = (
            _prompt_leaders(samples, same_weights=cfg.kv_on_update == "recompute")
            if cfg.shared_prefill
            else list(range(len(ids)))
        )
        leaders = sorted(set(leader))
        self.prefill_rows += len(leaders)
        self.prefill_samples += len(samples)
        if len(leaders) == len(samples):
            return self.model.forward_cached(
                ids, positions, slots, self.cache, kv_len=kv_len, logits_at=lens - 1
            )
        lead = torch.tensor(leaders, device=self.device)  # (u,)
        logits = self.model.forward_cached(
            ids[lead], positions[lead], slots[lead], self.cache, kv_len=kv_len,
            logits_at=lens[lead] - 1,
        )  # fmt: skip
        # indexed on the host: a boolean mask on the device would synchronise
        siblings = [
            (samples[j].slot, s.slot)
            for i, (s, j) in enumerate(zip(samples, leader, strict=True))
            if i != j
        ]
        for i, j in enumerate(leader):
            samples[i].shared = i != j
        src, dst = torch.tensor(siblings, device=self.device).unbind(1)  # (k - u,) each
        for buf in (self.cache.k, self.cache.v):
            buf[:, dst, :kv_len] = buf[:, src, :kv_len]
        row = {j: r for r, j in enumerate(leaders)}
        return logits[torch.tensor([row[j] for j in leader], device=self.device)]

    def _decode(self, view: _RunningView) -> torch.Tensor:
        """One token for every sample of `view`; finished flags (b,) in view order."""
        st, slots = self.state, view.slots
        last = st.length[slots] - 1  # (b,) position of the newest token, not yet cached
        ids = st.tokens[slots, last][:, None]  # (b, 1)
        # rows that finished but are still in the batch (overlap) write to the sink column
        positions = torch.where(st.done[slots], -1, last)[:, None]  # (b, 1)
        kv_len = view.max_offset + self._clock
        if self.graphs is not None:
            logits = self.graphs(ids, positions, slots, kv_len)  # (b, vocab)
        else:
            logits = self.model.forward_cached(ids, positions, slots, self.cache, kv_len=kv_len)
            logits = logits[:, 0]  # (b, vocab)
        return self._emit(slots, logits, truncate=view.truncates, all_greedy=view.all_greedy)

    def _emit(
        self, slots: torch.Tensor, logits: torch.Tensor, *, truncate: bool, all_greedy: bool
    ) -> torch.Tensor:
        """Sample each row's next token, record it with its log-prob and version, and flag
        the rows that finished at this step (stop token or max_new reached). Rows already
        done stay frozen: their token lands past their end and their length stays."""
        st = self.state
        done = st.done[slots]  # (b,)
        length = st.length[slots]  # (b,) column of the new token
        generated = length - st.prompt_len[slots]  # (b,) tokens before this one
        params = RowParams(
            temperature=st.temperature[slots],
            top_p=st.top_p[slots],
            top_k=st.top_k[slots],
            keys=st.keys[slots],
            token_index=generated,
        )
        tokens, logprobs = self._sample(logits, params, truncate=truncate, all_greedy=all_greedy)
        st.tokens[slots, length] = tokens
        st.logprobs[slots, length] = logprobs
        # a device scalar: a Python int here would copy host to device and synchronise
        st.versions[slots, length] = st.version
        st.length[slots] = length + (~done).long()
        hit_stop = (tokens[:, None] == st.stop_ids[slots]).any(dim=1)  # (b,)
        finished = (hit_stop | (generated + 1 >= st.max_new[slots])) & ~done
        st.done[slots] = done | finished
        return finished

    def _sample(
        self, logits: torch.Tensor, params: RowParams, *, truncate: bool, all_greedy: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens (b,) and their log-probs (b,): by the Triton kernels where no row truncates."""
        if self.sample_kernel and not truncate:
            return sample_kernel.sample_rows(
                logits,
                params.temperature,
                params.keys,
                params.token_index,
                self.noise.vocab_hash,
                noise=not all_greedy,
            )
        return self._sample_torch(
            logits, params, self.noise, truncate=truncate, all_greedy=all_greedy
        )

    def _recompute_kv(self, samples: list[_Sample]) -> None:
        """Rebuild the cached keys/values of running samples under the current weights, in
        prefill chunks of at most max_prefill_tokens padded tokens."""
        budget = self.config.max_prefill_tokens
        self.recomputed_rows += len(samples)
        ordered = sorted(samples, key=lambda s: len(s.prompt_ids) + self._generated(s))
        start = 0
        while start < len(ordered):
            end = start + 1
            while end < len(ordered):
                width = len(ordered[end].prompt_ids) + self._generated(ordered[end]) - 1
                if (end - start + 1) * width > budget:
                    break
                end += 1
            self._refill(ordered[start:end])
            start = end

    def _refill(self, samples: list[_Sample]) -> None:
        slots = torch.tensor([s.slot for s in samples], device=self.device)  # (k,)
        cached = self.state.length[slots] - 1  # (k,) tokens that belong in the cache
        width = max(len(s.prompt_ids) + self._generated(s) for s in samples) - 1
        cols = torch.arange(width, device=self.device)
        positions = torch.where(cols[None, :] < cached[:, None], cols[None, :], -1)  # (k, w)
        ids = self.state.tokens[slots, :width]  # (k, width)
        self.model.forward_cached(
            ids, positions, slots, self.cache, kv_len=width, logits_at=cached - 1
        )

    # -- results ---------------------------------------------------------------------------

    def _resolve(self, launched: tuple[list[_Sample], HostCopy] | None) -> None:
        """Read a launched step's finished flags: free the slots of the samples that finished
        and start copying their rows to the host (returned by `_collect`)."""
        if launched is None:
            return
        rows, copy = launched
        (flags,) = copy.wait()
        # each row is flagged once, at the step it finished (_emit)
        finished = [rows[i] for i in flags.nonzero().squeeze(1).tolist()]
        if not finished:
            return
        st = self.state
        slots = torch.tensor([s.slot for s in finished], device=self.device)
        # an upper bound of their lengths (a finished row stops growing before the clock)
        end = max(len(s.prompt_ids) + self._generated(s) for s in finished)
        self._gathered.append(
            (
                finished,
                copy_to_host(
                    st.tokens[slots, :end],
                    st.logprobs[slots, :end],
                    st.versions[slots, :end],
                    st.length[slots],
                ),
            )
        )
        for s in finished:  # the gather above is queued before any later write to the slot
            del self._running[s.slot]
            if s.session is not None:
                self._in_engine.discard(s.session)
                if self.sessions.keep(s.session, s.slot):
                    continue
            heapq.heappush(self._free, s.slot)
        self._view = None

    def _collect(self) -> list[GenerationOutput]:
        """Outputs of the finished samples whose rows have reached the host."""
        outputs = []
        for samples, copy in self._gathered:
            tokens, logprobs, versions, lengths = (t.tolist() for t in copy.wait())
            for i, s in enumerate(samples):
                lo, hi = len(s.prompt_ids), lengths[i]
                out_ids = tokens[i][lo:hi]
                if s.session is not None:
                    self.sessions.collected(s.session, tokens[i][:hi])
                outputs.append(
                    GenerationOutput(
                        request_id=s.request_id,
                        sample_index=s.sample_index,
                        prompt_ids=s.prompt_ids,
                        output_ids=out_ids,
                        logprobs=logprobs[i][lo:hi],
                        token_versions=versions[i][lo:hi],
                        finish_reason=(
                            "stop" if out_ids[-1] in s.params.stop_token_ids else "length"
                        ),
                        cached_tokens=len(s.prompt_ids) if s.shared else s.offset,
                        kv_evicted=s.evicted,
                    )
                )
                left = self._unfinished[s.request_id] - 1
                if left:
                    self._unfinished[s.request_id] = left
                else:
                    del self._unfinished[s.request_id]
        self._gathered.clear()
        return outputs
