"""The ``tensorrt_llm`` model's request handling for the Python-backend variants (cpu and pytorch targets).

Both variants speak exactly the I/O of the ``tensorrtllm`` backend's model, so everything around them
(preprocessing, postprocessing, the ensemble, the streaming model) is shared by every target:

inputs (with the batch dimension; one sequence per request): ``input_ids`` INT32 [-1], ``input_lengths``
INT32 [1], ``request_output_len`` INT32 [1]; optional ``end_id``, ``pad_id`` INT32 [1], ``temperature`` FP32
[1], ``runtime_top_k`` INT32 [1], ``runtime_top_p`` FP32 [1], ``seed`` UINT64 [1], ``streaming`` BOOL
[1], ``stop_words_list`` INT32 [2, -1]; with request classes (parameter ``priority_levels``: cpu, vllm)
``priority`` INT32 [1]: a level 1..N, 1 the highest (Triton's convention), none or 0 the default level; with
tenants (parameter ``tenants``, a JSON list: cpu) ``tenant`` BYTES [1] or the ``x-tenant`` header, none the
default tenant;
outputs: ``output_ids`` INT32 [-1, -1] (beam x generated tokens, the prompt excluded), ``sequence_length``
INT32 [-1] (tokens per beam in this response).

Text in and out besides (parameter ``tokenizer_dir``, relative to the version folder, with the preprocessing
model's ``add_special_tokens``, ``apply_chat_template``, ``max_input_len``, ``max_seq_len``): a request with
``text_input`` STRING [1] and ``max_tokens`` INT32 [1] (optional ``stop_words`` STRING [-1],
``apply_chat_template`` BOOL [1]) in place of the token inputs is tokenized here (llm_io.Prompter, the
preprocessing model's code), and every response carries ``text_output`` STRING [1] as well: on a decoupled model
the request streams, each response the new text and the tokens behind it (llm_io.TextStream: a token that ends
inside a multi-byte character waits for the rest of it). What upstream's vllm_backend does in its one model; the
streaming model of these targets is an ensemble of this model alone, so a token crosses no other stub process
(publish.py; a decoupled BLS call cost another stub process per token).

``execute`` only validates and submits: every request is answered from its own thread through its response
sender, so one model instance serves many sequences at once (the engine batches them). Non-streaming: one
response with all tokens. Streaming (decoupled models only): one response per generated token, then an
empty final flag. A stop word ends the sequence with the word included (as TensorRT-LLM does); a request
the client cancelled stops the sequence.

Each model runs a watchdog (llm_watchdog.py; parameters ``watchdog_errors_per_minute``, ``watchdog_memory_mb_per_s``,
``watchdog_memory_window_s``): failing requests or leaking memory stop the server so that it is restarted.
Besides the tensorrtllm backend's families it exports the figures the backend lacks in one family of its own
(``PIPELINE_FAMILY``; see PIPELINE_VALUES).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Optional

import llm_io
import llm_watchdog as watchdog
import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL
METRICS_S = 0.5  # how often the gauges are refreshed from the engine
# The tensorrtllm backend's metric families and label values (custom_metrics_reporter.cc; the label values as
# its metrics tests list them), so dashboards and alerts read the same series on every target.
KV_FAMILY, KV_LABEL = "nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type"
KV_VALUES = {"max": "kv_max_blocks", "free": "kv_free_blocks", "used": "kv_used_blocks",
             "tokens_per": "kv_tokens_per_block"}
REQUEST_FAMILY, REQUEST_LABEL = "nv_trt_llm_request_metrics", "request_type"
REQUEST_VALUES = {"active": "requests_active", "scheduled": "requests_scheduled", "waiting": "requests_waiting",
                  "max": "requests_max"}
# (label values as the backend's custom_metrics_verification_tests.py lists them)
BATCHER_FAMILY, BATCHER_LABEL = "nv_trt_llm_inflight_batcher_metrics", "inflight_batcher_specific_metric"
BATCHER_VALUES = {"generation_requests": "requests_generating", "paused_requests": "requests_paused"}
# What the backend does not export, in one family of ours, one label value a figure:
# kv_fragmentation: the share of the used KV blocks' token slots that hold no token (partly filled last blocks);
# padding_factor: decode-step tokens computed / tokens that are real (sequences padded to the batch's longest),
#   over the last METRICS_S (1: no padding; 0: no decode step then);
# failed_requests_last_minute, resident_memory_bytes, resident_memory_growth_bytes_per_s (over the watchdog's
#   window; 0 until it is full), watchdog_tripped (1 once the watchdog has stopped the server);
# quality of service over the requests answered in the last minute (llm_watchdog.LatencyWindow): latency_p50_ms,
#   latency_p99_ms, latency_p99_over_p50, latency_jitter (std / mean), token_gap_jitter.
PIPELINE_FAMILY, PIPELINE_LABEL = "trtllm_pipeline_model_metrics", "metric_type"
PIPELINE_VALUES = ("kv_fragmentation", "padding_factor", "failed_requests_last_minute", "resident_memory_bytes",
                   "resident_memory_growth_bytes_per_s", "watchdog_tripped", "latency_p50_ms", "latency_p99_ms",
                   "latency_p99_over_p50", "latency_jitter", "token_gap_jitter")
# With tenants (the engine's stats() has "tenants"), one series per tenant, label "tenant" (the seeds' names for the
# quota pair; pipeline/release/alerts.py's TENANT_SERIES lists them for the rules and the dashboard):
# tenant_quota_usage: KV blocks reserved by its admitted requests (each at its full length), tenant_quota_limit: its
# share; tenant_requests_total / tenant_rejections_total (counters): requests accepted / refused at its limit;
# tenant_latency_p99_ms, tenant_first_token_p99_ms: over its requests answered in the last minute.
TENANT_GAUGES = {"tenant_quota_usage": "reserved_blocks", "tenant_quota_limit": "quota_blocks"}
TENANT_COUNTERS = {"tenant_requests_total": "accepted", "tenant_rejections_total": "rejected"}
TENANT_QOS = ("tenant_latency_p99_ms", "tenant_first_token_p99_ms")
DEFAULT_TENANT = "default"  # pipeline.tenancy.DEFAULT_TENANT: requests naming no tenant


class BadRequest(ValueError):
    pass


@dataclass
class Job:
    prompt: list[int]
    max_new_tokens: int
    end_id: Optional[int]
    temperature: float
    top_k: int
    top_p: float
    seed: Optional[int]
    streaming: bool
    stop_words: list[list[int]]
    priority: int = 0  # the request's class, 1 the highest (0: one class for all)
    tenant: str = ""  # the tenant it names ("": none, the default tenant)
    text: bool = False  # it came as text: the responses carry text_output too


class Handle:
    """What an engine gives back for a submitted job."""

    def stream(self) -> Iterator[int]:
        raise NotImplementedError

    def cancel(self) -> None:
        raise NotImplementedError


class GenerationModel:
    """Subclasses implement ``load(version_dir, params)`` and ``submit(job) -> Handle``."""

    def initialize(self, args):
        from pathlib import Path

        llm_io.exit_with_server()
        llm_io.stacks_on_signal()
        self.model_config = json.loads(args["model_config"])
        self.params = llm_io.parameters(self.model_config)
        self.decoupled = pb_utils.using_decoupled_model_transaction_policy(self.model_config)
        version_dir = Path(args["model_repository"]) / args["model_version"]
        self.load(version_dir, self.params)
        self.prompter: Optional[llm_io.Prompter] = None  # text in and out: where the model has a tokenizer
        if self.params.get("tokenizer_dir"):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(str(version_dir / self.params["tokenizer_dir"]))
            self.prompter = llm_io.Prompter(tokenizer, self.params)
        self._tokenizing = threading.Lock()  # a fast tokenizer is used by one request thread at a time
        self.responder = llm_io.Responder(FINAL)  # every response sent from one thread
        self._threads: set[threading.Thread] = set()
        self._lock = threading.Lock()
        name = args["model_name"]
        self.watchdog = watchdog.Watchdog(
            errors_per_minute=int(self.params.get("watchdog_errors_per_minute") or 0),
            memory_mb_per_s=float(self.params.get("watchdog_memory_mb_per_s") or 0),
            memory_window_s=float(self.params.get("watchdog_memory_window_s") or 300),
            on_trip=lambda cause: watchdog.stop_server(name, cause))
        self.faults = watchdog.Faults()
        self.latency = watchdog.LatencyWindow()
        tenants = json.loads(self.params.get("tenants") or "[]")
        self._tenant_levels = {t["name"]: int(t.get("priority_level") or 0) for t in tenants}
        # per tenant: end-to-end and first-token latency windows (TENANT_QOS), made as tenants are seen
        self._tenant_qos: dict[str, tuple] = {}
        self._memory_growth = 0.0
        threading.Thread(target=self._watch, name="watchdog", daemon=True).start()
        self._start_metrics(name, args["model_version"])
        llm_io.freeze_heap()  # last: the engine's objects (vLLM, torch) never walked by a full collection

    def load(self, version_dir, params: dict) -> None:
        raise NotImplementedError

    def stats(self) -> Optional[dict]:
        """The engine's KV-pool and queue figures (see KV_VALUES, REQUEST_VALUES, BATCHER_VALUES); None: it has
        none to give."""
        return None

    def _watch(self) -> None:
        """The watchdog's memory samples, and the test-only fault switch, every watchdog.SAMPLE_S."""
        while True:
            self.faults.poll()
            self.faults.leak(watchdog.SAMPLE_S)
            self._memory_growth = self.watchdog.sample() or 0.0
            time.sleep(watchdog.SAMPLE_S)

    def _start_metrics(self, model: str, version: str) -> None:
        """Gauges on Triton's metrics endpoint, refreshed every METRICS_S: the tensorrtllm backend's families
        (where the engine has figures: ``stats()``) and ours (PIPELINE_FAMILY)."""
        labels = {"model": model, "version": str(version)}
        gauges, ours = {}, {}
        fraction = None
        self._metric_families = []  # a family must outlive its metrics: the model holds them
        engine_families = ((KV_FAMILY, KV_LABEL, KV_VALUES, "KV cache block metrics"),
                           (REQUEST_FAMILY, REQUEST_LABEL, REQUEST_VALUES, "request metrics"),
                           (BATCHER_FAMILY, BATCHER_LABEL, BATCHER_VALUES, "inflight batcher metrics"))
        for family, label, values, text in engine_families if self.stats() is not None else ():
            fam = pb_utils.MetricFamily(name=family, description=f"{text} (the tensorrtllm backend's names)",
                                        kind=pb_utils.MetricFamily.GAUGE)
            self._metric_families.append(fam)
            for value, key in values.items():
                gauges[key] = fam.Metric(labels={label: value, **labels})
            if family == KV_FAMILY:
                fraction = fam.Metric(labels={KV_LABEL: "fraction", **labels})
        fam = pb_utils.MetricFamily(name=PIPELINE_FAMILY, description="serving figures the tensorrtllm backend "
                                    "does not export (triton_repo/common/llm_serving.py)",
                                    kind=pb_utils.MetricFamily.GAUGE)
        self._metric_families.append(fam)
        for value in PIPELINE_VALUES:
            ours[value] = fam.Metric(labels={PIPELINE_LABEL: value, **labels})

        tenant_series = self._tenant_metrics(labels)

        def refresh() -> None:
            before = (0, 0)
            while True:
                figures = self.stats() or {}
                tenant_series(figures.get("tenants") or {})
                for key, gauge in gauges.items():
                    gauge.set(float(figures.get(key, 0)))
                used, most = figures.get("kv_used_blocks", 0), figures.get("kv_max_blocks", 0)
                if fraction is not None:
                    fraction.set(used / most if most else 0.0)
                computed, real = figures.get("decode_computed_tokens", 0), figures.get("decode_real_tokens", 0)
                ours["padding_factor"].set((computed - before[0]) / (real - before[1]) if real > before[1] else 0.0)
                before = (computed, real)
                ours["kv_fragmentation"].set(float(figures.get("kv_fragmentation", 0.0)))
                ours["failed_requests_last_minute"].set(float(self.watchdog.errors_last_minute()))
                ours["resident_memory_bytes"].set(float(self.watchdog.last_rss))
                ours["resident_memory_growth_bytes_per_s"].set(self._memory_growth * 1e6)
                ours["watchdog_tripped"].set(1.0 if self.watchdog.tripped else 0.0)
                for key, value in self.latency.figures().items():
                    ours[key].set(value)
                time.sleep(METRICS_S)

        threading.Thread(target=refresh, name="metrics", daemon=True).start()

    def _tenant_metrics(self, labels: dict):
        """The per-tenant families (TENANT_GAUGES, TENANT_COUNTERS, TENANT_QOS) where the model has tenants; returns
        the refresh for one stats() reading of them ({tenant: figures})."""
        if not self._tenant_levels:
            return lambda tenants: None
        kinds = {**dict.fromkeys(TENANT_GAUGES, pb_utils.MetricFamily.GAUGE),
                 **dict.fromkeys(TENANT_COUNTERS, pb_utils.MetricFamily.COUNTER),
                 **dict.fromkeys(TENANT_QOS, pb_utils.MetricFamily.GAUGE)}
        families = {name: pb_utils.MetricFamily(name=name, description=f"{name} per tenant (llm_serving.py)",
                                                kind=kind) for name, kind in kinds.items()}
        self._metric_families += list(families.values())
        metrics: dict[tuple[str, str], object] = {}
        counted: dict[tuple[str, str], float] = {}

        def metric(name: str, tenant: str):
            if (name, tenant) not in metrics:
                metrics[name, tenant] = families[name].Metric(labels={"tenant": tenant, **labels})
            return metrics[name, tenant]

        def refresh(tenants: dict) -> None:
            for tenant, figures in tenants.items():
                for name, key in TENANT_GAUGES.items():
                    metric(name, tenant).set(float(figures.get(key, 0)))
                for name, key in TENANT_COUNTERS.items():
                    now, before = float(figures.get(key, 0)), counted.get((name, tenant), 0.0)
                    counter = metric(name, tenant)  # exported from 0 on, before the first request
                    if now > before:
                        counter.increment(now - before)
                    counted[name, tenant] = now
                e2e, first = self._qos_of(tenant)
                metric("tenant_latency_p99_ms", tenant).set(e2e.figures()["latency_p99_ms"])
                metric("tenant_first_token_p99_ms", tenant).set(first.figures()["latency_p99_ms"])

        return refresh

    def _qos_of(self, tenant: str) -> tuple:
        """The tenant's (end-to-end, first-token) latency windows."""
        with self._lock:
            if tenant not in self._tenant_qos:
                self._tenant_qos[tenant] = (watchdog.LatencyWindow(), watchdog.LatencyWindow())
            return self._tenant_qos[tenant]

    def submit(self, job: Job) -> Handle:
        raise NotImplementedError

    def close(self) -> None:
        pass

    def execute(self, requests):
        for request in requests:
            arrived = time.monotonic()
            out = self.responder.stream(request, request.get_response_sender())
            if self.watchdog.tripped:
                out.send(_error(f"{llm_io.NOT_READY}: its watchdog stopped the server "
                                f"({self.watchdog.tripped}); retry once it is restarted",
                                pb_utils.TritonError.UNAVAILABLE), final=True)
                continue
            try:
                job = self._parse(request)
                handle = _FaultyHandle() if self.faults.raising else self.submit(job)
            except (BadRequest, ValueError) as e:  # the engines' input errors are ValueErrors too
                out.send(_error(str(e), pb_utils.TritonError.INVALID_ARG), final=True)
                continue
            except Exception as e:  # noqa: BLE001 - answered, logged by the server
                retry_after = getattr(e, "retry_after_s", None)  # a tenant at its limit: pipeline.tenancy
                if retry_after is not None:
                    # Triton's HTTP frontend answers UNAVAILABLE with 503 and sets no header from a model, so the
                    # time travels in the message (a gateway in front answers 429 and Retry-After:
                    # docs/serving/tenants.md)
                    out.send(_error(f"{e}{llm_io.RETRY_MARK}{retry_after} s", pb_utils.TritonError.UNAVAILABLE),
                             final=True)
                    continue
                out.send(_error(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL), final=True)
                self.watchdog.error()
                continue
            t = threading.Thread(target=self._respond, args=(out, handle, job, arrived), daemon=True)
            with self._lock:
                self._threads.add(t)
            t.start()
        return None

    def finalize(self):
        self.close()

    # ------------------------------------------------------------ one request

    def _parse(self, request) -> Job:
        get = lambda name: pb_utils.get_input_tensor_by_name(request, name)  # noqa: E731
        text = get("text_input") is not None
        if text:
            prompt, max_new_tokens, stop_words, end_id = self._from_text(get)
            streaming = self.decoupled
        else:
            prompt, max_new_tokens, stop_words, end_id = self._from_ids(get)
            streaming = bool(llm_io.scalar(get("streaming"), False))
        if streaming and not self.decoupled:
            raise BadRequest("streaming needs the decoupled model (triton.decoupled: true)")
        seed = llm_io.scalar(get("seed"))
        try:
            tenant = llm_io.request_tenant(request, get("tenant")) if self._tenant_levels else ""
        except ValueError as e:
            raise BadRequest(str(e)) from None
        return Job(
            prompt=prompt,
            max_new_tokens=max_new_tokens,
            end_id=int(end_id) if end_id is not None else None,
            temperature=float(llm_io.scalar(get("temperature"), 0.0)),
            top_k=int(llm_io.scalar(get("runtime_top_k"), 0)),
            top_p=float(llm_io.scalar(get("runtime_top_p"), 1.0)),
            seed=int(seed) if seed is not None else None,
            streaming=streaming,
            stop_words=stop_words,
            priority=self._priority(llm_io.scalar(get("priority"), 0) or self._tenant_levels.get(tenant, 0)),
            tenant=tenant,
            text=text,
        )

    @staticmethod
    def _from_ids(get) -> tuple[list[int], int, list[list[int]], Optional[int]]:
        """(prompt, max new tokens, stop words, end id) of a request in the tensorrtllm backend's token inputs."""
        ids_in, wanted = get("input_ids"), get("request_output_len")
        if ids_in is None or wanted is None:
            raise BadRequest("send input_ids and request_output_len (token ids), or text_input and max_tokens (text)")
        ids = ids_in.as_numpy()
        if ids.shape[0] != 1:
            raise BadRequest(f"one sequence per request (batch dimension 1), got {ids.shape[0]}")
        lengths = get("input_lengths")
        n = int(llm_io.scalar(lengths)) if lengths is not None else ids.shape[-1]
        if not 0 < n <= ids.shape[-1]:
            raise BadRequest(f"input_lengths {n} does not fit input_ids of length {ids.shape[-1]}")
        words = get("stop_words_list")
        return ([int(t) for t in ids.reshape(-1)[:n]], int(llm_io.scalar(wanted)),
                llm_io.list_to_words(words.as_numpy()[0] if words is not None else None), llm_io.scalar(get("end_id")))

    def _from_text(self, get) -> tuple[list[int], int, list[list[int]], Optional[int]]:
        """The same of a request in text (the preprocessing model's inputs), tokenized here; its end id the
        model's EOS where it sends none, as the preprocessing model makes it."""
        if self.prompter is None:
            raise BadRequest("this model takes token ids (input_ids, request_output_len): it has no tokenizer_dir")
        max_tokens = get("max_tokens")
        if max_tokens is None:
            raise BadRequest("text_input needs max_tokens: send the number of tokens to generate")
        stop = get("stop_words")
        with self._tokenizing:
            prompt = self.prompter.prompt_ids(llm_io.as_str(llm_io.scalar(get("text_input"))),
                                              int(llm_io.scalar(max_tokens)), llm_io.scalar(get("apply_chat_template")))
            words = self.prompter.stop_words(stop.as_numpy().reshape(-1) if stop is not None else [])
        return prompt, int(llm_io.scalar(max_tokens)), llm_io.list_to_words(words), \
            llm_io.scalar(get("end_id"), self.prompter.eos_id)

    def _priority(self, level) -> int:
        """The request's level: 1..priority_levels, 0 (none sent) the default level; 0 without classes."""
        levels = int(self.params.get("priority_levels") or 0)
        if not levels:
            return 0
        default = int(self.params.get("default_priority_level") or levels)
        if not 0 <= int(level) <= levels:
            raise BadRequest(f"priority {level} is outside 1..{levels} (1 the highest; 0 or none: the default "
                             f"level {default})")
        return int(level) or default

    def _respond(self, out: llm_io.ResponseStream, handle: Handle, job: Job, arrived: float) -> None:
        tokens: list[int] = []
        times: list[float] = []
        text = llm_io.TextStream(self.prompter.tokenizer, self._tokenizing) if job.text and self.prompter else None
        try:
            for token in handle.stream():
                tokens.append(token)
                times.append(time.monotonic())
                if job.streaming:
                    if text is None:
                        out.send(_tokens(out.wanted, [token]))
                    elif (piece := text.push([token])) is not None:
                        out.send(_tokens(out.wanted, piece[1], piece[0]))
                # a stream's cancel as its responder last saw it; a request answered at the end asks itself (as
                # upstream's vllm_backend does)
                if llm_io.ends_with_any(tokens, job.stop_words) or (out.cancelled if job.streaming else out.check()):
                    handle.cancel()
                    break
            if job.streaming:
                held = text.flush() if text else None  # an incomplete character at the end, as it decodes
                if held is not None:
                    out.send(_tokens(out.wanted, held[1], held[0]))
                out.send(final=True)
            elif text is not None:
                out.send(_tokens(out.wanted, tokens, text.whole(tokens)), final=True)
            else:
                out.send(_tokens(out.wanted, tokens), final=True)
            if times:
                self.latency.add(times[-1] - arrived, [b - a for a, b in zip(times, times[1:])])
                if self._tenant_levels:
                    e2e, first = self._qos_of(job.tenant or DEFAULT_TENANT)
                    e2e.add(times[-1] - arrived, [])
                    first.add(times[0] - arrived, [])
        except Exception as e:  # noqa: BLE001 - the request gets the error; the model keeps serving
            handle.cancel()
            out.send(_error(f"{type(e).__name__}: {e}", pb_utils.TritonError.INTERNAL), final=True)
            self.watchdog.error()
        finally:
            with self._lock:
                self._threads.discard(threading.current_thread())


class _FaultyHandle(Handle):
    """What a request gets while the test-only fault switch says ``raise`` (llm_watchdog.Faults)."""

    def stream(self) -> Iterator[int]:
        raise RuntimeError(f"injected fault ({watchdog.FAULT_ENV})")

    def cancel(self) -> None:
        pass


def _tokens(wanted: frozenset, ids: list[int], text: Optional[str] = None):
    """A response: the tokens, and their text where the request came as text; only the outputs in ``wanted`` are
    made (llm_io.wanted_outputs: one made and not asked for is freed without the GIL)."""
    tensors = []
    if "output_ids" in wanted:
        tensors.append(pb_utils.Tensor("output_ids", np.asarray(ids, dtype=np.int32).reshape(1, 1, -1)))
    if "sequence_length" in wanted:
        tensors.append(pb_utils.Tensor("sequence_length", np.array([[len(ids)]], dtype=np.int32)))
    if text is not None and "text_output" in wanted:
        tensors.append(pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=object)))
    return pb_utils.InferenceResponse(tensors)


def _error(message: str, code):
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, code))

