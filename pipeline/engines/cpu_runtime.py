"""The ``cpu`` target's reference runtime: the exported quantized checkpoint, served on a CPU.

A reference for correctness and wiring, not a TensorRT engine. What it computes is what the engine is built
from:
- weights: the TensorRT-LLM checkpoint read back by ``pipeline.quant.checkpoint`` (INT8/FP8/INT4 codes times their
  scales), with the calibrated activation quantization (SmoothQuant pre-scales, per-tensor INT8/FP8) applied
  in front of each quantized GEMM; held whole in fp32, or, when that does not fit this process's memory
  bound, streamed: each decoder layer read from the checkpoint when a forward reaches it (``weights_streamed``);
- KV cache: a paged block pool (``tokens_per_block`` tokens per block, blocks handed out as sequences grow)
  that stores K and V as INT8 or FP8 codes with the checkpoint's per-layer ``kv_cache_scaling_factor``, as
  TensorRT-LLM's quantized KV cache does. Like the engine's context phase (paged context FMHA is off with an
  INT8 KV cache), a prompt attends to its own unquantized K/V; every later step reads the quantized cache;
- scheduling: continuous batching. A scheduler thread admits new requests between decode steps (each
  prompt is prefilled on its own, then joins the running batch), decodes all running sequences in one
  forward, and streams each token to its request as soon as it exists.

transformers' Llama code does the math: this module gives it a per-step cache view (``_StepCache``) that
writes new K/V into the pool and hands back each sequence's dequantized history, padded, with a 4-D mask.

API (what the Triton model and the tests use)::

    rt = CpuRuntime.load(bundle_dir)
    req = rt.submit(prompt_ids, SamplingParams(max_new_tokens=16))
    for token_id in req.stream(): ...
    req.cancel(); req.result(); req.finish_reason
    rt.close()
"""

from __future__ import annotations

import json
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from pipeline import artifacts, families
from pipeline.errors import InputError, IntegrityError
from pipeline.quant.quant_math import FP8_MAX
from pipeline.tenancy import DEFAULT_TENANT, TenantBook, TenantSpec

log = logging.getLogger(__name__)

KV_STORAGE = {"INT8": torch.int8, "FP8": torch.float8_e4m3fn, None: torch.float32}
_INT8_MAX = 127.0
_DONE = object()  # end-of-stream marker in a request's token queue


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 16
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0
    seed: Optional[int] = None
    end_id: Optional[int] = None  # default: the model's EOS
    stop_token_ids: tuple[int, ...] = ()

    def check(self) -> None:
        if self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be at least 1, got {self.max_new_tokens}")
        if self.temperature < 0 or not math.isfinite(self.temperature):
            raise InputError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1], got {self.top_p}")


# ---------------------------------------------------------------- the paged, quantized KV cache


class KVBlockPool:
    """K and V for every layer in fixed-size blocks: [num_blocks * tokens_per_block, kv_heads, head_dim] codes (V
    ``v_head_dim`` wide where it differs from K: multi-head latent attention, ``families.kv_head_dims``).

    ``quant_algo`` INT8: codes = clamp(round(x / scale), +-127) as int8; FP8: (x / scale) as float8_e4m3fn;
    None: float32. ``scales[layer]`` is the checkpoint's kv_cache_scaling_factor (amax / 127 or amax / 448).
    A value beyond -amax saturates at -127 here, where ModelOpt's KV quantizer (not narrow-range, as
    pipeline.quant.quant_math now is) gives -128. Kept so: at -128 verify's concurrent check on SmolLM2 (cpu
    target) failed 3 times in 3, its batched answer leaving the solo one where the reference's gap was 0.198
    (> TIE_BOUND), and passed at -127. Batched prompts attend to their own quantized K/V (chunked prefill),
    solo ones to the unquantized K/V, and SmolLM2's prompts saturate some K channels; which saturation
    TensorRT-LLM's INT8 KV cache applies, and a tie bound that holds for both, are still to be measured.
    """

    def __init__(self, num_layers: int, *, kv_heads: int, head_dim: int, tokens_per_block: int, num_blocks: int,
                 quant_algo: Optional[str], scales: Optional[list[float]] = None, v_head_dim: Optional[int] = None):
        if quant_algo not in KV_STORAGE:
            raise IntegrityError(f"KV-cache quant_algo {quant_algo!r} is not supported (INT8, FP8 or none)")
        if quant_algo is not None and (scales is None or len(scales) != num_layers):
            raise IntegrityError(f"a {quant_algo} KV cache needs one scaling factor per layer ({num_layers})")
        self.tokens_per_block, self.num_blocks, self.quant_algo = tokens_per_block, num_blocks, quant_algo
        dtype = KV_STORAGE[quant_algo]
        rows = num_blocks * tokens_per_block
        self.k = [torch.zeros((rows, kv_heads, head_dim), dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros((rows, kv_heads, v_head_dim or head_dim), dtype=dtype) for _ in range(num_layers)]
        # one per layer for a quantized cache (checked above), empty for a float32 one
        self.scales = [torch.tensor(float(s), dtype=torch.float32) for s in scales or ()]
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v))

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"KV block pool exhausted ({n} needed, {len(self._free)} free)")
        return [self._free.pop() for _ in range(n)]

    def release(self, blocks: list[int]) -> None:
        self._free.extend(reversed(blocks))

    def _slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        pos = torch.arange(start, stop)
        blocks = torch.tensor(table, dtype=torch.long)[pos // self.tokens_per_block]
        return blocks * self.tokens_per_block + pos % self.tokens_per_block

    def encode(self, x: torch.Tensor, layer: int) -> torch.Tensor:
        if self.quant_algo == "INT8":
            return torch.clamp(torch.round(x.float() / self.scales[layer]), -_INT8_MAX, _INT8_MAX).to(torch.int8)
        if self.quant_algo == "FP8":
            return (x.float() / self.scales[layer]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return x.float()

    def decode(self, codes: torch.Tensor, layer: int) -> torch.Tensor:
        return codes.float() * self.scales[layer] if self.quant_algo else codes

    def write(self, layer: int, table: list[int], start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, T, head_dim] for positions start .. start+T-1 of the sequence owning ``table``."""
        slots = self._slots(table, start, start + k.shape[1])
        self.k[layer][slots] = self.encode(k.transpose(0, 1), layer)
        self.v[layer][slots] = self.encode(v.transpose(0, 1), layer)

    def slots(self, table: list[int], start: int, stop: int) -> torch.Tensor:
        """Pool rows of positions start .. stop-1 of the sequence owning ``table``."""
        return self._slots(table, start, stop)

    def write_rows(self, layer: int, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim], one pool row each (a decode step: one row per sequence)."""
        self.k[layer][rows] = self.encode(k, layer)
        self.v[layer][rows] = self.encode(v, layer)

    def gather(self, layer: int, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """rows: [B, L] pool rows -> dequantized K, V as [B, kv_heads, L, head_dim]."""
        return (self.decode(self.k[layer][rows], layer).permute(0, 2, 1, 3),
                self.decode(self.v[layer][rows], layer).permute(0, 2, 1, 3))

    def read(self, layer: int, table: list[int], length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sequence's first ``length`` positions, dequantized: two [kv_heads, length, head_dim] tensors."""
        slots = self._slots(table, 0, length)
        return (self.decode(self.k[layer][slots], layer).transpose(0, 1),
                self.decode(self.v[layer][slots], layer).transpose(0, 1))


class _StepCache:
    """The cache object transformers' attention calls for one forward over a batch of sequences.

    ``update`` stores each sequence's new K/V in its blocks and returns what attention should see: in a
    prefill (one sequence, empty history) its own unquantized K/V; in a decode step every sequence's
    dequantized history including the new token, right-padded to the longest (the 4-D mask hides padding).
    ``packed`` (chunked prefill): one row holding several sequences' new tokens; the tuple gives their pool
    rows, in order, and the rows of every sequence's positions up to its newest, one sequence after the other,
    which attention reads back dequantized; the 4-D mask keeps each token to its own sequence's keys, causally.
    """

    def __init__(self, pool: KVBlockPool, seqs: list["_Sequence"], prefill: bool,
                 packed: Optional[tuple[torch.Tensor, torch.Tensor]] = None):
        self.pool, self.seqs, self.prefill = pool, seqs, prefill
        self.is_compileable = False
        if packed is not None:
            self.new_rows, self.read_rows = packed[0], packed[1][None]
        elif not prefill:  # the same rows for every layer: computed once per step
            longest = max(s.cached + 1 for s in seqs)
            self.new_rows = torch.cat([pool.slots(s.blocks, s.cached, s.cached + 1) for s in seqs])
            # padding points at the sequence's own first row: finite values, hidden by the mask
            self.read_rows = torch.stack([
                torch.nn.functional.pad(pool.slots(s.blocks, 0, s.cached + 1), (0, longest - s.cached - 1),
                                        value=int(pool.slots(s.blocks, 0, 1)[0]))
                for s in seqs])

    def update(self, key_states, value_states, layer_idx, cache_kwargs=None):
        if self.prefill:
            s = self.seqs[0]
            self.pool.write(layer_idx, s.blocks, 0, key_states[0], value_states[0])
            return key_states, value_states
        # decode: [B, kv_heads, 1, head_dim], the new token of each sequence; packed: [1, kv_heads, T, head_dim]
        # -> one [N, kv_heads, head_dim] row per new token, in new_rows' order
        new_k, new_v = (x.transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]) for x in (key_states, value_states))
        self.pool.write_rows(layer_idx, self.new_rows, new_k, new_v)
        keys, values = self.pool.gather(layer_idx, self.read_rows)
        return keys.to(key_states.dtype), values.to(value_states.dtype)

    def get_seq_length(self, layer_idx: int = 0) -> int:  # transformers asks; positions are passed explicitly
        return 0

    def get_mask_sizes(self, cache_position, layer_idx: int = 0) -> tuple[int, int]:
        # prefill only (decode passes its own 4-D mask): keys are the prompt itself, so transformers builds
        # the same causal mask as for a model without a cache
        return cache_position.shape[0], 0


# ---------------------------------------------------------------- requests and sequences


class Request:
    """One submitted prompt: stream its tokens, wait for all of them, or cancel it (thread-safe)."""

    def __init__(self, request_id: int, prompt_ids: list[int], *, params: SamplingParams, priority: int = 0,
                 tenant: str = DEFAULT_TENANT, on_finish: Optional[Callable[["Request"], None]] = None):
        self.id, self.prompt_ids, self.params, self.priority = request_id, prompt_ids, params, priority
        self.tenant = tenant
        self._on_finish = on_finish  # the runtime's: its tenant's blocks and place in flight come back
        self.output_ids: list[int] = []
        self.first_token_at: Optional[float] = None  # time.perf_counter() when its first token came out
        self.finished_at: Optional[float] = None  # time.perf_counter() when it ended
        self.finish_reason: Optional[str] = None  # length | stop | cancelled | error
        self.error: Optional[str] = None
        self._tokens: "queue.Queue" = queue.Queue()
        self._cancelled = threading.Event()
        self._done = threading.Event()

    def stream(self) -> Iterator[int]:
        while True:
            item = self._tokens.get()
            if item is _DONE:
                if self.finish_reason == "error":
                    raise RuntimeError(f"cpu runtime failed on request {self.id}: {self.error}")
                return
            yield item

    def result(self, timeout: Optional[float] = None) -> list[int]:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} did not finish within {timeout} s")
        if self.finish_reason == "error":
            raise RuntimeError(f"cpu runtime failed on request {self.id}: {self.error}")
        return list(self.output_ids)

    def cancel(self) -> None:
        self._cancelled.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    def _emit(self, token: int) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.output_ids.append(token)
        self._tokens.put(token)

    def _finish(self, reason: str, error: Optional[str] = None) -> None:
        if self._done.is_set():
            return
        self.finish_reason, self.error, self.finished_at = reason, error, time.perf_counter()
        if self._on_finish is not None:
            self._on_finish(self)
        self._tokens.put(_DONE)
        self._done.set()


@dataclass
class _Sequence:
    request: Request
    blocks: list[int] = field(default_factory=list)
    cached: int = 0  # positions whose K/V are in the pool
    last_token: int = -1
    generator: Optional[torch.Generator] = None
    finish: Optional[str] = None  # set when the last token is out: stop | length


# ---------------------------------------------------------------- the runtime


class AdaptiveBatchLimit:
    """How many sequences the scheduler runs at once, and with chunked prefill how many prompt tokens a step
    carries, kept to a step-latency target as load moves.

    After each scheduler step (the prefills it admitted plus one decode step: the gap every running sequence
    sees between two of its tokens) the step's time goes into an exponentially weighted average (weight
    ``alpha`` for the newest). Above ``high`` x target: the prompt chunk halves (down to ``chunk``, where one
    is set), else the limit halves. Below ``low`` x target: while prompts wait for prefill the chunk grows by one
    token (up to ``max_chunk``: the step's slack goes to prefill, so first tokens come sooner), else, while
    the limit is what holds sequences back (as many running as it allows), the limit grows by one. After a
    change the average starts again from the next step, so one slow step changes a knob once, not on every
    step after. Bounds: 1 and the runtime's max_running; the KV pool's free blocks bound admission besides.
    """

    def __init__(self, target_ms: float, max_batch_size: int, *, alpha: float = 0.3, high: float = 1.1,
                 low: float = 0.9, chunk: Optional[int] = None, max_chunk: Optional[int] = None):
        if target_ms <= 0:
            raise InputError(f"the adaptive batch limit needs a positive step-latency target, got {target_ms} ms")
        self.target_ms, self.max_batch_size = target_ms, max_batch_size
        self.alpha, self.high, self.low = alpha, high, low
        self.limit = max_batch_size
        self.chunk_step, self.chunk = chunk, chunk  # None: prompts are prefilled whole
        self.max_chunk = max(max_chunk or 0, chunk or 0)
        self.ewma_ms: Optional[float] = None
        self.changes = 0

    def observe(self, step_ms: float, running: int, prefill_waiting: bool = False) -> int:
        """One step's time, how many sequences it ran and whether prompt tokens are left to prefill after it;
        returns the limit for the next admission (``chunk``: the next step's prompt tokens)."""
        e = step_ms if self.ewma_ms is None else self.alpha * step_ms + (1 - self.alpha) * self.ewma_ms
        self.ewma_ms = e
        before = (self.limit, self.chunk)
        if e > self.high * self.target_ms:
            if self.chunk is not None and self.chunk_step is not None and self.chunk > self.chunk_step:
                self.chunk = max(self.chunk_step, self.chunk // 2)
            elif self.limit > 1:
                self.limit = max(1, self.limit // 2)
        elif e < self.low * self.target_ms:
            if self.chunk is not None and self.chunk_step is not None and prefill_waiting \
                    and self.chunk < self.max_chunk:
                self.chunk = min(self.max_chunk, self.chunk + 1)
            elif running >= self.limit and self.limit < self.max_batch_size:
                self.limit += 1
        if (self.limit, self.chunk) != before:
            self.ewma_ms, self.changes = None, self.changes + 1
        return self.limit


class CpuRuntime:
    """Loads a cpu bundle and serves it with continuous batching on a scheduler thread.

    ``adaptive``: an ``AdaptiveBatchLimit`` that sets how many sequences run at once (default: always
    ``max_running``, which defaults to the build's max_batch_size). ``prefill_chunk``: prompt tokens prefilled
    per scheduler step, in the same forward as the running sequences' next tokens (chunked prefill, as
    TensorRT-LLM's chunked context: a running sequence then waits for one chunk's compute between two of its
    tokens, not for every admitted prompt whole); None: each admitted prompt is prefilled whole, in a forward
    of its own, in the step that admits it.

    ``tenants``: partitions of the KV pool (``pipeline.tenancy``): a tenant's requests are admitted only while the
    blocks of their full lengths fit its share, and wait otherwise; other tenants' requests go past them."""

    def __init__(self, model, pool: KVBlockPool, *, settings: dict, eos_token_id: Optional[int],
                 adaptive: Optional[AdaptiveBatchLimit] = None, max_running: Optional[int] = None,
                 prefill_chunk: Optional[int] = None, tenants: Sequence[TenantSpec] = ()):
        if prefill_chunk is not None and prefill_chunk < 1:
            raise InputError(f"prefill_chunk must be a positive number of tokens, got {prefill_chunk}")
        self.model, self.pool, self.settings = model, pool, settings
        self.window, self.window_per_type = families.attention_window(model.config)
        self.eos_token_id = eos_token_id
        self.adaptive = adaptive
        self.prefill_chunk = prefill_chunk
        self.layer_streaming = False  # whether the model's decoder layers are streamed (set by load)
        # how many sequences run at once: the serving setting (triton.max_running), within the build's limit
        self.max_running = running_limit(settings, max_running)
        self.max_input_len = settings["max_input_len"]
        self.max_seq_len = settings["max_seq_len"]
        self.tokens_per_block = settings["tokens_per_block"]
        self.tenants = TenantBook(tenants, pool.num_blocks, slots=self.max_running) if tenants else None
        self._waiting: list[Request] = []
        self._prefilling: list[_Sequence] = []  # admitted; their prompts partly in the pool (chunked prefill)
        self._running: list[_Sequence] = []
        self._paused: list[_Sequence] = []  # running sequences a more urgent request took the slot of (blocks kept)
        self._lock = threading.Condition()
        self._closed = False
        self._next_id = 0
        # forwards: prefill (whole prompts), decode, packed (chunked prefill: decode tokens and a prompt chunk)
        # decode_computed / decode_real: key positions a decode step's attention computed (every sequence padded to
        # the batch's longest) and those that are real; packed steps pad nothing
        self.steps = {"prefill": 0, "prefill_chunks": 0, "decode": 0, "decode_sequences": 0, "packed": 0,
                      "decode_computed": 0, "decode_real": 0, "paused": 0}
        self._thread = threading.Thread(target=self._loop, name="cpu-runtime-scheduler", daemon=True)
        self._thread.start()

    @classmethod
    def load(cls, bundle_dir: Path | str, *, quantize_kv_cache: bool = True, threads: Optional[int] = None,
             layer_streaming: Optional[str] = None, adaptive_target_ms: Optional[float] = None,
             max_running: Optional[int] = None, prefill_chunk: Optional[int] = None,
             tenants: Sequence[TenantSpec] = ()) -> "CpuRuntime":
        """``quantize_kv_cache=False`` keeps the KV cache in fp32 (for comparisons with the unquantized cache).
        ``layer_streaming`` (auto | always | never) overrides the bundle's ``runtime.json``: see
        ``weights_streamed``. ``adaptive_target_ms``: keep the step latency there with an
        ``AdaptiveBatchLimit`` (None: run up to the limit at once, always). ``max_running``: at most this many
        sequences at once (None: the build's max_batch_size; more is refused); the KV pool is sized for them.
        ``prefill_chunk``: prompt tokens prefilled per step (None: whole prompts). ``tenants``: the KV pool's
        partitions (none: one pool for every request)."""
        bundle = Path(bundle_dir)
        settings = read_settings(bundle)
        limit = running_limit(settings, max_running)
        if threads:
            torch.set_num_threads(threads)
        ckpt = bundle / artifacts.CPU_CHECKPOINT_SUBDIR
        kv_algo = kv_cache_algo(ckpt) if quantize_kv_cache else None
        model, facts, streamed, why = bundle_model(bundle, settings, layer_streaming)
        cfg = model.config
        scales = kv_cache_scales(ckpt, cfg.num_hidden_layers) if kv_algo else None
        # the pool the build sized for max_batch_size sequences of max_seq_len, cut to the running limit's share
        num_blocks = -(-settings["num_blocks"] * limit // settings["max_batch_size"])
        k_dim, v_dim = families.kv_head_dims(cfg)
        pool = KVBlockPool(cfg.num_hidden_layers, kv_heads=cfg.num_key_value_heads, head_dim=k_dim,
                           tokens_per_block=settings["tokens_per_block"], num_blocks=num_blocks, quant_algo=kv_algo,
                           scales=scales, v_head_dim=v_dim)
        eos = getattr(model.generation_config, "eos_token_id", None) or cfg.eos_token_id
        if isinstance(eos, (list, tuple)):
            eos = eos[0]
        log.info("cpu runtime: %s weights (%s), KV cache %s in %d blocks of %d tokens (%.1f MB)",
                 facts.get("quant_algo"), why, kv_algo or "fp32", pool.num_blocks, pool.tokens_per_block,
                 pool.bytes / 1e6)
        adaptive = (AdaptiveBatchLimit(adaptive_target_ms, limit, chunk=prefill_chunk,
                                       max_chunk=settings["max_input_len"]) if adaptive_target_ms else None)
        rt = cls(model, pool, settings=settings, eos_token_id=eos, adaptive=adaptive, max_running=limit,
                 prefill_chunk=prefill_chunk, tenants=tenants)
        rt.layer_streaming = streamed
        return rt

    # -- public API

    def submit(self, prompt_ids: list[int], params: SamplingParams = SamplingParams(), priority: int = 0,
               tenant: Optional[str] = None) -> Request:
        """Queue a prompt. ``priority``: the lower, the sooner it is admitted (and prefilled) among the waiting
        requests, as Triton's priority levels (1 the highest) and vLLM's priority order; equal priorities go first
        come, first served. When every slot is taken, a request of a more urgent class pauses the least urgent
        running sequence of a less urgent one (the latest admitted among equals), as TensorRT-LLM's scheduler
        pauses requests: its KV blocks stay in the pool, and it resumes, ahead of its class's waiting requests, when
        a slot frees. A sequence is only paused where the pool holds the urgent request's full length beside it.

        ``tenant``: with tenants, the request's (none: the default tenant); an unknown one, or a request its share
        could never hold, is an InputError; a tenant at its concurrency or token-rate limit gets
        ``pipeline.tenancy.TenantLimitError``, which says when to retry."""
        prompt = [int(t) for t in prompt_ids]
        params.check()
        vocab = self.model.config.vocab_size
        if not prompt:
            raise InputError("the prompt is empty: send at least one token id")
        if len(prompt) > self.max_input_len:
            raise InputError(f"the prompt has {len(prompt)} tokens; this build accepts at most max_input_len="
                             f"{self.max_input_len}")
        if len(prompt) + params.max_new_tokens > self.max_seq_len:
            raise InputError(f"prompt ({len(prompt)}) + max_new_tokens ({params.max_new_tokens}) exceeds "
                             f"max_seq_len={self.max_seq_len}; ask for at most {self.max_seq_len - len(prompt)} tokens")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise InputError(f"token ids {bad[:5]} are outside the vocabulary (0..{vocab - 1})")
        if self.tenants is None and tenant:
            raise InputError(f"unknown tenant {tenant!r}: this deployment has no tenants (send none)")
        name = self.tenants.resolve(tenant) if self.tenants is not None else DEFAULT_TENANT
        with self._lock:
            if self._closed:
                raise RuntimeError("the runtime is closed")
            req = Request(self._next_id, prompt, params=params, priority=int(priority), tenant=name,
                          on_finish=self._tenant_done if self.tenants is not None else None)
            if self.tenants is not None:
                self.tenants.accept(name, req.id, len(prompt) + params.max_new_tokens, self._full_blocks(req))
            self._next_id += 1
            self._waiting.append(req)
            self._lock.notify()
        return req

    def stats(self) -> dict:
        """The KV pool and the request queue now, in the vocabulary of the tensorrtllm backend's metrics; and
        what it lacks: ``kv_fragmentation`` (the share of the held blocks' token slots that hold no token) and
        the decode steps' attention positions computed and real so far (their ratio: the padding factor)."""
        with self._lock:
            free, waiting, paused = self.pool.free_blocks, len(self._waiting), len(self._paused)
            seqs = self._prefilling + self._running + self._paused
            slots = sum(len(s.blocks) for s in seqs) * self.pool.tokens_per_block
            held = sum(min(s.cached, len(s.blocks) * self.pool.tokens_per_block) for s in seqs)
            computed, real = self.steps["decode_computed"], self.steps["decode_real"]
        return {"kv_max_blocks": self.pool.num_blocks, "kv_free_blocks": free,
                "kv_used_blocks": self.pool.num_blocks - free, "kv_tokens_per_block": self.pool.tokens_per_block,
                "requests_active": waiting + len(seqs), "requests_scheduled": len(seqs) - paused,
                "requests_waiting": waiting, "requests_paused": paused, "requests_generating": len(self._running),
                "requests_max": self.max_running, "batch_limit": self._batch_limit(),
                "kv_fragmentation": 1 - held / slots if slots else 0.0,
                "decode_computed_tokens": computed, "decode_real_tokens": real,
                **({"tenants": self.tenants.stats()} if self.tenants is not None else {})}

    def generate(self, prompt_ids: list[int], params: SamplingParams = SamplingParams()) -> list[int]:
        return self.submit(prompt_ids, params).result()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._lock.notify()
        self._thread.join(timeout=60)

    def __enter__(self) -> "CpuRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- scheduler

    def _loop(self) -> None:
        torch.set_grad_enabled(False)
        while True:
            with self._lock:
                while not self._closed and not self._waiting and not self._prefilling and not self._running \
                        and not self._paused:
                    self._lock.wait()
                if self._closed:
                    pending = self._waiting + [s.request for s in self._prefilling + self._running + self._paused]
                    self._waiting = []
                    break
                admit = self._schedule()
            try:
                t0 = time.perf_counter()
                admitted = len(self._prefilling) + len(self._running) + len(admit)
                for req in admit:
                    self._admit(req)
                if self.prefill_chunk is None:
                    self._prefill_whole()
                    self._drop_finished()
                    if self._running:
                        self._decode_step()
                elif self._drop_cancelled_prefills() or self._running:
                    self._packed_step()
                self._drop_finished()
                if self.adaptive is not None and admitted:
                    self.adaptive.observe((time.perf_counter() - t0) * 1e3, admitted, bool(self._prefilling))
            except Exception as e:  # noqa: BLE001 - a crash ends the requests in flight with its message
                log.exception("cpu runtime step failed")
                for s in self._prefilling + self._running + self._paused:
                    s.request._finish("error", f"{type(e).__name__}: {e}")
                    self.pool.release(s.blocks)
                self._prefilling, self._running, self._paused = [], [], []
        for req in pending:
            req._finish("cancelled")

    def _chunk(self) -> int:
        """Prompt tokens the next packed step carries: the adaptive limit's, else prefill_chunk."""
        if self.adaptive is not None and self.adaptive.chunk is not None:
            return self.adaptive.chunk
        return self.prefill_chunk or 0

    def _schedule(self) -> list[Request]:
        """The waiting requests to admit this step (holding the lock). Paused sequences and waiting requests take
        free slots most urgent first: the lowest priority value, the earliest submitted among equals (so a
        paused sequence resumes before its class's waiting requests). With every slot taken, a request more
        urgent than the least urgent running sequence pauses it.

        A request is admitted only where the pool holds its full length (prompt and max_new_tokens) beside the
        full lengths of every admitted sequence, paused ones included: a running sequence never finds the pool
        empty. Where the most urgent request does not fit, nothing waiting overtakes it, but paused sequences
        resume into free slots (their blocks are already theirs), so the blocks they hold come back.

        With tenants, a waiting request whose tenant's share cannot hold it beside its tenant's admitted requests
        is passed over: it waits for its own tenant's blocks, never another's, and holds no one else back. Slots
        are shared the same way (``TenantBook.slot_share``): with every slot taken, only a tenant below its slot
        share is a candidate, and where no less urgent sequence can be paused for it, the latest sequence of a
        tenant above its slot share is (never a more urgent one)."""
        self._paused = self._without_cancelled(self._paused)
        self._waiting = self._waiting_not_cancelled()
        admit: list[Request] = []
        while True:
            full = len(self._prefilling) + len(self._running) + len(admit) >= self._batch_limit()
            candidates = [((r.priority, r.id), i, False) for i, r in enumerate(self._waiting)
                          if self._tenant_fits(r) and (not full or self._owed_a_slot(r.tenant, admit))]
            candidates += [((s.request.priority, s.request.id), i, True) for i, s in enumerate(self._paused)
                           if not full or self._owed_a_slot(s.request.tenant, admit)]
            if not candidates:
                break
            key, i, is_paused = min(candidates)
            if not is_paused and self._full_blocks(self._waiting[i]) > self._spare_blocks(admit):
                slots = self._batch_limit() - len(self._prefilling) - len(self._running) - len(admit)
                self._paused.sort(key=lambda s: (s.request.priority, s.request.id))
                self._running += self._paused[:max(slots, 0)]
                del self._paused[:max(slots, 0)]
                break  # it waits for blocks; nothing waiting and less urgent overtakes it
            if full:
                victims = [s for s in self._running if s.finish is None and s.request.priority > key[0]]
                if not victims and self.tenants is not None:  # one of a tenant running past its slot share
                    victims = [s for s in self._running if s.finish is None and s.request.priority >= key[0]
                               and not self._owed_a_slot(s.request.tenant, admit, running=True)]
                if not victims:
                    break
                victim = max(victims, key=lambda s: (s.request.priority, s.request.id))
                self._running.remove(victim)
                self._paused.append(victim)
                self.steps["paused"] += 1
            if is_paused:
                self._running.append(self._paused.pop(i))
            else:
                req = self._waiting.pop(i)
                if self.tenants is not None:
                    self.tenants.reserve(req.tenant, req.id, self._full_blocks(req))
                admit.append(req)
        return admit

    def _owed_a_slot(self, tenant: str, admit: list[Request], running: bool = False) -> bool:
        """Whether ``tenant`` runs fewer sequences than its slot share (``running``: one of them counted out, so
        True means at most its share: a sequence of a tenant that holds more is one to pause). Without tenants,
        every request is owed one (slots go by priority alone)."""
        if self.tenants is None:
            return True
        share = self.tenants.slot_share(tenant)
        held = sum(s.request.tenant == tenant for s in self._prefilling + self._running)
        held += sum(r.tenant == tenant for r in admit)
        return share is None or held - running < share

    def _tenant_fits(self, req: Request) -> bool:
        return self.tenants is None or self.tenants.fits(req.tenant, self._full_blocks(req))

    def _tenant_done(self, req: Request) -> None:
        if self.tenants is not None:
            self.tenants.finish(req.tenant, req.id)

    def _waiting_not_cancelled(self) -> list[Request]:
        """The waiting requests less those cancelled before admission, which end here (with tenants, one may
        wait long for its tenant's blocks)."""
        keep = []
        for req in self._waiting:
            if req._cancelled.is_set():
                req._finish("cancelled")
            else:
                keep.append(req)
        return keep

    def _batch_limit(self) -> int:
        return self.adaptive.limit if self.adaptive is not None else self.max_running

    def _blocks_for(self, positions: int) -> int:
        return -(-positions // self.tokens_per_block)

    def _full_blocks(self, req: Request) -> int:
        """The blocks a request holds at its full length: its prompt and every token it may generate."""
        return self._blocks_for(len(req.prompt_ids) + req.params.max_new_tokens)

    def _spare_blocks(self, admitting: list[Request]) -> int:
        """Free blocks not promised to admitted sequences (each may grow to its full length)."""
        promised = sum(self._full_blocks(s.request) - len(s.blocks)
                       for s in self._prefilling + self._running + self._paused)
        promised += sum(self._full_blocks(r) for r in admitting)
        return self.pool.free_blocks - promised

    def _admit(self, req: Request) -> None:
        """A sequence for the request, its prompt's blocks taken; its prompt goes through the model in
        ``_prefill_whole`` or, chunk by chunk, in ``_packed_step``."""
        if req._cancelled.is_set():
            req._finish("cancelled")
            return
        gen = None
        if req.params.temperature > 0:
            gen = torch.Generator().manual_seed(req.params.seed if req.params.seed is not None else req.id)
        seq = _Sequence(req, blocks=self.pool.allocate(self._blocks_for(len(req.prompt_ids))), generator=gen)
        # chunks go to the first prefilling sequence: a more urgent prompt goes ahead of less urgent ones
        at = next((i for i, s in enumerate(self._prefilling) if s.request.priority > req.priority),
                  len(self._prefilling))
        self._prefilling.insert(at, seq)

    def _prefill_whole(self) -> None:
        """Each admitted prompt through the model whole; its first token, and it runs."""
        self._drop_cancelled_prefills()
        while self._prefilling:
            seq = self._prefilling.pop(0)
            n = len(seq.request.prompt_ids)
            out = self.model(input_ids=torch.tensor([seq.request.prompt_ids]), position_ids=torch.arange(n)[None],
                             attention_mask=None, past_key_values=_StepCache(self.pool, [seq], prefill=True),
                             use_cache=True, cache_position=torch.arange(n), logits_to_keep=1)
            seq.cached = n
            self.steps["prefill"] += 1
            self._running.append(seq)
            self._accept(seq, out.logits[0, -1])

    def _drop_cancelled_prefills(self) -> bool:
        """Release cancelled sequences not yet running; whether any prefill is left."""
        self._prefilling = self._without_cancelled(self._prefilling)
        return bool(self._prefilling)

    def _without_cancelled(self, seqs: list[_Sequence]) -> list[_Sequence]:
        """``seqs`` less the cancelled ones, whose blocks go back to the pool and whose requests end."""
        keep = []
        for seq in seqs:
            if seq.request._cancelled.is_set():
                self.pool.release(seq.blocks)
                seq.request._finish("cancelled")
            else:
                keep.append(seq)
        return keep

    def _packed_step(self) -> None:
        """Chunked prefill: one forward over one packed row, the running sequences' next tokens and at most
        ``prefill_chunk`` prompt tokens of the first sequence still prefilling (as TensorRT-LLM batches context
        chunks with generation tokens), so a chunk costs the running sequences its tokens' compute, not a
        forward of its own. Each token attends to its own sequence's keys in the pool (dequantized), causally."""
        decode = self._running
        for s in decode:  # a block for the position this step writes
            if s.cached // self.tokens_per_block >= len(s.blocks):
                s.blocks += self.pool.allocate(1)
        chunk = self._prefilling[0] if self._prefilling else None
        spans = [(s, s.cached, 1) for s in decode]  # (sequence, first new position, new tokens)
        ids = [s.last_token for s in decode]
        if chunk is not None:
            n = min(self._chunk(), len(chunk.request.prompt_ids) - chunk.cached)
            spans.append((chunk, chunk.cached, n))
            ids += chunk.request.prompt_ids[chunk.cached:chunk.cached + n]
        new_rows, read_rows, positions, query_seq, key_seq, key_pos = [], [], [], [], [], []
        for i, (s, start, n) in enumerate(spans):
            new_rows.append(self.pool.slots(s.blocks, start, start + n))
            read_rows.append(self.pool.slots(s.blocks, 0, start + n))
            positions.append(torch.arange(start, start + n))
            query_seq += [i] * n
            key_seq += [i] * (start + n)
            key_pos.append(torch.arange(start + n))
        pos, kpos = torch.cat(positions), torch.cat(key_pos)
        allowed = (torch.tensor(key_seq)[None, :] == torch.tensor(query_seq)[:, None]) & (kpos[None, :] <= pos[:, None])
        mask = self._masks(allowed[None, None], pos[:, None], kpos[None, :])
        keep = list(range(len(decode))) + ([len(ids) - 1] if chunk is not None else [])
        out = self.model(input_ids=torch.tensor([ids]), position_ids=pos[None], attention_mask=mask,
                         past_key_values=_StepCache(self.pool, decode + ([chunk] if chunk else []), prefill=False,
                                                    packed=(torch.cat(new_rows), torch.cat(read_rows))),
                         use_cache=True, cache_position=pos, logits_to_keep=torch.tensor(keep))
        self.steps["packed"] += 1
        if decode:
            self.steps["decode"] += 1
            self.steps["decode_sequences"] += len(decode)
        for i, s in enumerate(decode):
            s.cached += 1
            self._accept(s, out.logits[0, i])
        if chunk is not None:
            chunk.cached += spans[-1][2]
            self.steps["prefill_chunks"] += 1
            if chunk.cached == len(chunk.request.prompt_ids):
                self._prefilling.pop(0)
                self.steps["prefill"] += 1
                self._running.append(chunk)
                self._accept(chunk, out.logits[0, -1])

    def _masks(self, allowed, qpos, kpos):
        """The additive 4-D attention mask(s) for a forward whose queries at positions ``qpos`` may see the keys
        at ``kpos`` where ``allowed``: one mask, with the sliding window applied where every layer slides; for a
        model whose layers differ (``layer_types``), one per layer type, as transformers takes them."""
        windowed = families.additive_mask(allowed, qpos, kpos, self.window)
        if not self.window_per_type:
            return windowed
        return {"full_attention": families.additive_mask(allowed, qpos, kpos), "sliding_attention": windowed}

    def _decode_step(self) -> None:
        seqs = self._running
        for s in seqs:  # a block for the position this step writes
            if s.cached // self.tokens_per_block >= len(s.blocks):
                s.blocks += self.pool.allocate(1)
        longest = max(s.cached + 1 for s in seqs)
        positions = torch.tensor([[s.cached] for s in seqs])
        kpos = torch.arange(longest)[None, None, None, :]
        qpos = positions[:, None, :, None]
        mask = self._masks(kpos <= qpos, qpos, kpos)
        ids = torch.tensor([[s.last_token] for s in seqs])
        out = self.model(input_ids=ids, position_ids=positions, attention_mask=mask,
                         past_key_values=_StepCache(self.pool, seqs, prefill=False), use_cache=True,
                         cache_position=positions[0], logits_to_keep=1)
        self.steps["decode"] += 1
        self.steps["decode_sequences"] += len(seqs)
        self.steps["decode_computed"] += len(seqs) * longest
        self.steps["decode_real"] += sum(s.cached + 1 for s in seqs)
        for i, s in enumerate(seqs):
            s.cached += 1
            self._accept(s, out.logits[i, -1])

    def _accept(self, seq: _Sequence, logits: torch.Tensor) -> None:
        req, p = seq.request, seq.request.params
        token = _sample(logits, p, seq.generator)
        seq.last_token = token
        req._emit(token)
        end = p.end_id if p.end_id is not None else self.eos_token_id
        if token == end or token in p.stop_token_ids:
            seq.finish = "stop"
        elif len(req.output_ids) >= p.max_new_tokens:
            seq.finish = "length"

    def _drop_finished(self) -> None:
        """Release finished or cancelled sequences' blocks, then tell their requests (in that order, so a
        caller that sees its result also sees the blocks back in the pool)."""
        keep = []
        for s in self._running:
            reason = s.finish or ("cancelled" if s.request._cancelled.is_set() else None)
            if reason:
                self.pool.release(s.blocks)
                s.request._finish(reason)
            else:
                keep.append(s)
        self._running = keep


def running_limit(settings: dict, max_running: Optional[int]) -> int:
    """How many sequences may run at once: ``max_running`` (None: the build's max_batch_size), which the build's
    limit bounds (the pool and the Triton models are sized for it)."""
    if max_running is None:
        return settings["max_batch_size"]
    if not 1 <= max_running <= settings["max_batch_size"]:
        raise InputError(f"max_running {max_running} is outside 1..{settings['max_batch_size']} (the build's "
                         f"max_batch_size); lower triton.max_running or rebuild with a larger build.max_batch_size")
    return max_running


def read_settings(bundle: Path) -> dict:
    settings_file = bundle / artifacts.CPU_RUNTIME_FILE
    if not settings_file.is_file():
        raise InputError(f"{bundle} is not a cpu runtime bundle (no {artifacts.CPU_RUNTIME_FILE}); "
                         "run `invoke build` first")
    return json.loads(settings_file.read_text())


def is_hf_checkpoint(ckpt: Path) -> bool:
    """Whether a bundle's checkpoint is ModelOpt's HF unified one (a family without a TensorRT-LLM checkpoint here,
    ``Family.trtllm_checkpoint``) rather than the TensorRT-LLM one."""
    return (Path(ckpt) / artifacts.HF_QUANT_CONFIG_FILE).is_file()


def kv_cache_algo(ckpt: Path) -> Optional[str]:
    """The checkpoint's KV-cache quantization (INT8, FP8 or None), from whichever config file its kind keeps it in."""
    name = artifacts.HF_QUANT_CONFIG_FILE if is_hf_checkpoint(ckpt) else "config.json"
    return json.loads((Path(ckpt) / name).read_text()).get("quantization", {}).get("kv_cache_quant_algo")


def bundle_model(bundle: Path, settings: dict, layer_streaming: Optional[str] = None):
    """The bundle's checkpoint rebuilt as an fp32 model, its layers streamed when ``weights_streamed`` says so
    (``layer_streaming`` overrides runtime.json's mode): (model, facts, streamed, why). An HF unified checkpoint
    (``pipeline.quant.hf_checkpoint``) is held whole: its reader does not stream."""
    from pipeline.quant.checkpoint import rebuild
    from pipeline.quant.hf_checkpoint import rebuild_hf

    ckpt = bundle / artifacts.CPU_CHECKPOINT_SUBDIR
    streamed, why = weights_streamed(bundle, settings, layer_streaming or settings.get("layer_streaming", "auto"))
    if is_hf_checkpoint(ckpt):
        if streamed:
            raise InputError(f"{bundle}: {why}, but the bundle holds an HF unified checkpoint, which the runtime "
                             f"reads whole only; give the server more memory, or set compute.layer_streaming: never")
        model, facts = rebuild_hf(ckpt)
    else:
        model, facts = rebuild(ckpt, bundle / artifacts.CPU_MODEL_SUBDIR, streamed=streamed)
    return model.eval(), facts, streamed, why


# Room for a step's activations and temporaries and the request threads. The libraries (torch and
# transformers: 0.27 GB of anonymous memory, CPU wheels, measured) are loaded by the time the bound is
# taken, which already leaves them out (the cgroup's holdings, or the available RAM).
RUNTIME_HEADROOM_BYTES = 128 * 2**20


def weights_streamed(bundle: Path, settings: dict, mode: str) -> tuple[bool, str]:
    """Whether the runtime streams its decoder layers from the checkpoint (``rebuild(streamed=True)``), and why.

    ``auto``: when the model held whole in fp32, the KV block pool and a step's room do not fit what this
    process may use here (``compute.host_memory_bound``: the memory cgroup's limit or the available RAM, less
    what the cgroup's other processes hold, less ``memory_margin``). Streamed, each forward reads and
    dequantizes every layer again: far slower, but any model whose largest piece fits is served. Refuses a
    bound that cannot hold even that (the embedding and lm_head, one decoder layer, the pool)."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    from pipeline import compute

    if mode not in ("auto", "always", "never"):
        raise InputError(f"{bundle}: layer_streaming must be auto, always or never, got {mode!r}")
    if mode != "auto":
        return mode == "always", f"layer streaming {mode}"
    hf = AutoConfig.from_pretrained(bundle / artifacts.CPU_MODEL_SUBDIR)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(hf)
    whole = 4 * sum(p.numel() for p in model.parameters())
    layer = 4 * max(sum(p.numel() for p in layer.parameters()) for layer in model.model.layers)
    pool = hf.num_hidden_layers * settings["num_blocks"] * settings["tokens_per_block"] * \
        hf.num_key_value_heads * sum(families.kv_head_dims(hf)) * (1 if settings.get("kv_cache_quant_algo") else 4)
    section = _Margin(settings.get("memory_margin", 0.1))
    bound = compute.host_memory_bound(section)
    need = whole + pool + RUNTIME_HEADROOM_BYTES
    if need <= bound.bytes:
        return False, f"held whole: {compute.gib(need)} within {bound.text()}"
    least = whole - layer * (hf.num_hidden_layers - 1) + pool + RUNTIME_HEADROOM_BYTES
    if least > bound.bytes:
        raise InputError(
            f"{bundle}: this model needs at least {compute.gib(least)} to serve even one decoder layer at a time "
            f"(the embedding and lm_head, one layer of {compute.gib(layer)} in fp32, a KV block pool of "
            f"{compute.gib(pool)}, room for a step), more than {bound.text()}. Give the server more memory, or "
            f"build with a smaller build.max_batch_size / build.max_seq_len (the pool).")
    return True, f"streamed layer by layer: {compute.gib(need)} held whole would not fit {bound.text()}"


@dataclass(frozen=True)
class _Margin:  # the part of the compute config section host_memory_bound reads, for a serving process
    memory_margin: float
    max_host_memory: Optional[int] = None


def kv_cache_scales(ckpt_dir: Path, num_layers: int) -> list[float]:
    """The checkpoint's per-layer ``kv_cache_scaling_factor`` (one scale for K and V, as TensorRT-LLM uses). An HF
    unified checkpoint keeps a layer's K and V scales apart (``*.k_scale``, ``*.v_scale``): the layer's scale is
    the larger, as ModelOpt's TensorRT-LLM export joins them (model_config_utils.py: kv_cache_scaling_factor =
    maximum of the two)."""
    from safetensors import safe_open

    if not is_hf_checkpoint(ckpt_dir):
        with safe_open(str(Path(ckpt_dir) / "rank0.safetensors"), framework="pt") as f:
            return [float(f.get_tensor(f"transformer.layers.{i}.attention.kv_cache_scaling_factor"))
                    for i in range(num_layers)]
    from pipeline.quant.hf_checkpoint import kv_scales

    return [max(k, v) for k, v in kv_scales(Path(ckpt_dir), num_layers)]


def _sample(logits: torch.Tensor, p: SamplingParams, gen: Optional[torch.Generator]) -> int:
    logits = logits.float()
    if p.temperature == 0:
        return int(logits.argmax())
    logits = logits / p.temperature
    if p.top_k:
        kth = torch.topk(logits, min(p.top_k, logits.numel())).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1:
        sorted_p, order = probs.sort(descending=True)
        drop = sorted_p.cumsum(0) - sorted_p > p.top_p  # keep the smallest prefix reaching top_p
        probs = probs.scatter(0, order, sorted_p.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return int(torch.multinomial(probs, 1, generator=gen))


def bundle_settings(build, quant_kv: Optional[str], compute_section) -> dict:
    """runtime.json for a cpu bundle: the limits, the block pool sized so every sequence can reach max_seq_len,
    and how the weights are held (compute.layer_streaming; the bound is the serving machine's, found there)."""
    blocks_per_seq = -(-build.max_seq_len // build.kv_cache.tokens_per_block)
    return {"max_batch_size": build.max_batch_size, "max_input_len": build.max_input_len,
            "max_seq_len": build.max_seq_len, "max_num_tokens": build.max_num_tokens,
            "tokens_per_block": build.kv_cache.tokens_per_block, "num_blocks": build.max_batch_size * blocks_per_seq,
            "kv_cache_quant_algo": quant_kv, "layer_streaming": compute_section.layer_streaming,
            "memory_margin": compute_section.memory_margin}
