"""tensorrt_llm for the ``vllm`` target: vLLM's async engine (``AsyncLLM``) in the Python backend.

What upstream's vllm_backend does, with the ``tensorrtllm`` backend's inputs and outputs (see llm_serving.py),
so the preprocessing, postprocessing, ensemble and streaming models of the other targets serve a vLLM model
unchanged. Runs in the vLLM serving environment (vLLM imported when the model loads). The engine is built
from the export beside this file and the engine arguments the build recorded with it (``vllm_engine.json``:
the same record vLLM's OpenAI server starts from). Parameters: ``model_dir`` (relative to the version folder).

vLLM's engine is asynchronous: one event loop runs in a thread of its own, every request is a coroutine on
it, and its tokens reach the request's responder thread through a queue. Token ids go in and out (the
preprocessing model tokenizes), so vLLM's own tokenizer only detokenizes for its stop strings: turned off.
Triton's metrics get the tensorrtllm backend's request, batcher and KV-cache families (llm_serving.py) from
vLLM's own scheduler: a stat logger of vLLM's (``StatLoggerBase``, v1/metrics/loggers.py) keeps the figures of
its last step (requests running and waiting, the KV cache's share in use), so the queue the autoscaler reads
and the KV alerts see vLLM's queue and cache, as its OpenAI server's ``vllm:num_requests_waiting`` and
``vllm:kv_cache_usage_perc`` do.

With tenants (parameter ``tenants``, a JSON list of the config's), every request passes a gate before vLLM
(``tenancy.TenantGate``, a copy of pipeline/tenancy.py that publish puts beside this file): it is handed to vLLM only
while the blocks of its full length (prompt plus max tokens, in vLLM's block size) fit its tenant's share of vLLM's
KV pool, and fewer than ``max_num_seqs`` requests run; until then it waits in the gate. vLLM's scheduler runs below,
unchanged.
"""

import asyncio
import json
import os
import queue
import sys
import threading
import uuid

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from llm_serving import GenerationModel, Handle  # noqa: E402

ENGINE_FILE = "vllm_engine.json"  # pipeline.artifacts.VLLM_ENGINE_FILE
SERVER_ONLY = ("served_model_name",)  # engine-record fields for vLLM's server, not its engine
_END = object()


def _utf8_locale():
    """The stub's embedded Python reads text files in the locale's encoding, and without LANG that is ASCII:
    torch's inductor templates (imported by vLLM) are UTF-8 and fail to load. Set for this process."""
    import locale

    if locale.getpreferredencoding(False).lower().replace("-", "") != "utf8":
        for name in ("C.UTF-8", "C.utf8", "en_US.UTF-8"):
            try:
                locale.setlocale(locale.LC_CTYPE, name)
                return
            except locale.Error:
                continue


class _VllmHandle(Handle):
    def __init__(self, model, request_id, tokens):
        self.model, self.request_id, self.tokens = model, request_id, tokens
        self.tenant = ""  # the tenant the gate resolved (with tenants)
        self.cancelled = False

    def stream(self):
        while True:
            item = self.tokens.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item

    def cancel(self):
        self.cancelled = True  # a request the gate starts after this ends at once
        gate = self.model.gate
        if gate is not None and gate.cancel(self.tenant, self.request_id):
            self.tokens.put(_END)  # it was still waiting in the gate: vLLM never had it
            return
        self.model.call(self.model.engine.abort(self.request_id))


def _figures(cache, running=0, waiting=0, kv_usage=0.0):
    """Scheduler figures in the vocabulary of llm_serving's metric families, from vLLM's cache config (its block
    count is set once the engine core has sized the cache) and one step's counts; the defaults: nothing running."""
    blocks = int(cache.num_gpu_blocks or 0)
    used = min(blocks, round(kv_usage * blocks))
    return {"requests_scheduled": running, "requests_generating": running, "requests_waiting": waiting,
            "kv_max_blocks": blocks, "kv_used_blocks": used, "kv_free_blocks": blocks - used,
            "kv_tokens_per_block": int(cache.block_size)}


def _scheduler_logger(on_step):
    """A stat-logger class for vLLM's engine (its factories are classes called with the config and the engine's
    index): each step's figures (``_figures``) are handed to ``on_step`` as a new dict. vLLM calls ``record`` on
    its event loop after every step's outputs."""
    from vllm.v1.metrics.loggers import StatLoggerBase

    class SchedulerFigures(StatLoggerBase):
        def __init__(self, vllm_config, engine_index=0):
            self.cache = vllm_config.cache_config

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                # waiting as vLLM's own vllm:num_requests_waiting counts them: the waiting ones and those deferred
                on_step(_figures(self.cache, scheduler_stats.num_running_reqs,
                                 scheduler_stats.num_waiting_reqs + scheduler_stats.num_skipped_waiting_reqs,
                                 scheduler_stats.kv_cache_usage))

        def log_engine_initialized(self):
            pass

    return SchedulerFigures


class TritonPythonModel(GenerationModel):
    def load(self, version_dir, params):
        folder = version_dir / params["model_dir"]
        record = json.loads((folder / ENGINE_FILE).read_text())
        for key, value in record.get("env", {}).items():  # e.g. VLLM_CPU_KVCACHE_SPACE: read by the engine
            os.environ.setdefault(key, value)
        # The engine core runs in a child process; "spawn" would start it from sys.executable, which inside
        # the stub is not a Python. "fork" is vLLM's default on a machine without CUDA; made explicit here.
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "fork")
        os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
        _utf8_locale()
        from vllm import SamplingParams
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        self._sampling = SamplingParams
        args = {k: v for k, v in record["engine_args"].items() if k not in SERVER_ONLY}
        if int(params.get("priority_levels") or 0):
            # request classes: vLLM's waiting queue by priority, the lower first (as Triton's levels), ties by arrival
            args["scheduling_policy"] = "priority"
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, name="vllm-loop", daemon=True).start()
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(folder), **args),
                                                stat_loggers=[_scheduler_logger(self._on_step)])
        self._cache = self.engine.vllm_config.cache_config  # sized by now
        self._scheduler = _figures(self._cache)  # the last step's: replaced whole (the metrics thread reads it)
        self._running = 0
        self._max_seqs = int(self.engine.vllm_config.scheduler_config.max_num_seqs)
        self._count = threading.Lock()
        self.gate = self._tenant_gate(json.loads(params.get("tenants") or "[]"))

    def _tenant_gate(self, tenants):
        """The tenants' admission over vLLM's KV pool as it was sized (None without tenants)."""
        if not tenants:
            return None
        from tenancy import TenantBook, TenantGate, specs_from

        book = TenantBook(specs_from(tenants), int(self._cache.num_gpu_blocks), slots=self._max_seqs)
        return TenantGate(book, int(self._cache.block_size))

    def _on_step(self, figures):
        self._scheduler = figures

    def call(self, coro, timeout_s=60):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout_s)

    def submit(self, job):
        greedy = job.temperature == 0
        stop_ids = [w[0] for w in job.stop_words if len(w) == 1]
        params = self._sampling(
            max_tokens=job.max_new_tokens,
            temperature=0.0 if greedy else job.temperature,
            top_k=-1 if greedy or not job.top_k else job.top_k,
            top_p=1.0 if greedy else job.top_p,
            seed=job.seed,
            # end_id replaces the model's EOS as the token that ends a sequence (kept in the output, as both
            # TensorRT-LLM and vLLM keep a stop token); none given: the model's EOS; negative: none at all
            stop_token_ids=([job.end_id] if job.end_id is not None and job.end_id >= 0 else []) + stop_ids,
            ignore_eos=job.end_id is not None,
            detokenize=False,
        )
        handle = _VllmHandle(self, uuid.uuid4().hex, queue.SimpleQueue())

        def start():
            asyncio.run_coroutine_threadsafe(self._generate(job.prompt, params, handle, job.priority), self.loop)

        if self.gate is None:
            start()
        else:  # refused here (an InputError, a TenantLimitError) or started now or once its blocks fit
            handle.tenant = self.gate.submit(job.tenant or None, handle.request_id,
                                             tokens=len(job.prompt) + job.max_new_tokens, priority=job.priority,
                                             start=start)
        return handle

    async def _generate(self, prompt, params, handle, priority):
        request_id, tokens = handle.request_id, handle.tokens
        with self._count:
            self._running += 1
        sent = 0
        try:
            if handle.cancelled:  # cancelled between the gate's start and now
                tokens.put(_END)
                return
            async for output in self.engine.generate({"prompt_token_ids": prompt}, params, request_id,
                                                     priority=priority):
                ids = output.outputs[0].token_ids  # cumulative: all tokens generated so far
                for token in ids[sent:]:
                    tokens.put(int(token))
                sent = len(ids)
            tokens.put(_END)
        except BaseException as e:  # noqa: BLE001 - the responder thread raises it into the request
            tokens.put(e if isinstance(e, Exception) else RuntimeError(f"vLLM request ended: {e!r}"))
        finally:
            with self._count:
                self._running -= 1
            if self.gate is not None:
                self.gate.finish(request_id)  # its blocks back: the gate's next requests start

    def stats(self):
        with self._count:
            active = self._running
        # with none in flight, nothing runs: vLLM's last step still counts the requests it ended
        figures = self._scheduler if active else _figures(self._cache)
        if self.gate is None:
            return {**figures, "requests_active": active, "requests_max": self._max_seqs}
        waiting = self.gate.waiting()  # queued before vLLM's queue: waiting all the same
        return {**figures, "requests_waiting": figures["requests_waiting"] + waiting,
                "requests_active": active + waiting, "requests_max": self._max_seqs, "tenants": self.gate.book.stats()}

    def close(self):
        self.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
