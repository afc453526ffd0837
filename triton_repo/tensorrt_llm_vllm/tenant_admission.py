"""Tenants on vLLM's OpenAI server: the same admission as Triton's vLLM model (pipeline.tenancy.TenantGate), as an
ASGI middleware that vLLM loads itself (``--middleware tenant_admission.TenantAdmission``: vLLM 0.32's
entrypoints/serve/middleware/register.py imports it and calls ``app.add_middleware`` on a class), so vLLM is not
forked. Publish puts this file beside the vLLM model's code with ``tenancy.py`` and ``llm_watchdog.py``, writes the
tenants into the served engine record (``vllm_engine.json``, key ``tenants``) and adds the flag;
``pipeline.serving.launch`` puts that folder on the server's PYTHONPATH.

A completion or chat completion (``POST /v1/completions``, ``/v1/chat/completions``) names its tenant in the
``x-tenant`` header or the body's ``user`` field (none: the default tenant). It is handed to vLLM only while the blocks
of its full length (its prompt's tokens, in the served tokenizer and chat template, plus its max tokens, or the model's
length where it gives none; in vLLM's block size) fit its tenant's share of vLLM's KV pool as vLLM sized it (the
engine core reports ``num_gpu_blocks`` to the server at start), and fewer than ``max_num_seqs`` of them run; until then
it waits here. An unknown tenant, or a request its share could never hold, is a 400 in OpenAI's error shape; a tenant
at its concurrency or token-rate limit a 429 with Retry-After. A client that goes away while its request waits takes
it out of the queue.

On ``/metrics`` (vLLM's Prometheus registry, the default one with a single API server): ``tenant_quota_usage``,
``tenant_quota_limit`` (blocks), ``tenant_requests_total``, ``tenant_rejections_total``, ``tenant_requests_waiting``,
and ``tenant_latency_p99_ms`` / ``tenant_first_token_p99_ms`` over the last minute (first token: the first body chunk
sent, the whole answer where it is not streamed), each with the label ``tenant``, the names the Triton models use.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from pathlib import Path

from llm_watchdog import LatencyWindow
from tenancy import TENANT_HEADER, TenantBook, TenantGate, TenantLimitError, specs_from

ROUTES = ("/v1/completions", "/v1/chat/completions")
ENGINE_FILE = "vllm_engine.json"  # the served engine record, in the folder vLLM serves (--model)
_HEADER = TENANT_HEADER.encode()


class TenantAdmission:
    """The ASGI middleware (one per server process). The gate is built at the first request (vLLM's health check
    is one), when the app's state holds vLLM's sized config."""

    def __init__(self, app):
        self.app = app
        self.gate = None
        self._tokenizer = None
        self._max_len = 0
        self._levels: dict = {}
        self._qos: dict = {}
        self._setup = threading.Lock()
        self._qos_lock = threading.Lock()  # its own: registering the collector reads the windows once
        self._keys = itertools.count()

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if self.gate is None:
            self._build(scope["app"].state)
        if scope["method"] != "POST" or scope["path"] not in ROUTES:
            return await self.app(scope, receive, send)
        t0 = time.monotonic()
        body, disconnected = await _read_body(receive)
        if disconnected:
            return
        try:
            request = json.loads(body or b"{}")
            if not isinstance(request, dict):
                raise ValueError("the request body must be a JSON object")
            header = dict(scope["headers"]).get(_HEADER)
            tenant = header.decode() if header else request.get("user")
            tenant = tenant if isinstance(tenant, str) else None
            tokens = self._full_length(scope["path"], request)
        except ValueError as e:
            return await _error(send, 400, str(e))
        key = f"tenant-{next(self._keys)}"
        admitted = asyncio.Event()
        loop = asyncio.get_running_loop()
        try:
            name = self.gate.submit(tenant, key, tokens=tokens, priority=self._levels.get(tenant or "", 0),
                                    start=lambda: loop.call_soon_threadsafe(admitted.set))
        except TenantLimitError as e:
            return await _error(send, 429, str(e), {"retry-after": str(e.retry_after_s)})
        except ValueError as e:  # an unknown tenant, a request its share could never hold
            return await _error(send, 400, str(e))
        started = False
        try:
            if not await _admitted_or_gone(admitted, receive):
                return  # the client went away while its request waited
            started = True
            first: list = []

            async def timed_send(message):
                if message["type"] == "http.response.body" and not first:
                    first.append(time.monotonic())
                await send(message)

            await self.app(scope, _replay(body, receive), timed_send)
            e2e, ttft = self._windows(name)
            e2e.add(time.monotonic() - t0, [])
            ttft.add((first[0] if first else time.monotonic()) - t0, [])
        finally:
            if started:
                self.gate.finish(key)  # its blocks and slot back: the next requests that fit start
            elif not self.gate.cancel(name, key):
                self.gate.finish(key)  # started in the moment the client left

    def _build(self, state) -> None:
        with self._setup:
            if self.gate is not None:
                return
            config = state.vllm_config
            record = json.loads((Path(state.args.model) / ENGINE_FILE).read_text())
            tenants = record.get("tenants") or []
            book = TenantBook(specs_from(tenants), int(config.cache_config.num_gpu_blocks),
                              slots=int(config.scheduler_config.max_num_seqs))
            self._levels = {t["name"]: int(t.get("priority_level") or 0) for t in tenants}
            self._tokenizer = state.engine_client.tokenizer
            self._max_len = int(config.model_config.max_model_len)
            _register_metrics(self, book)
            self.gate = TenantGate(book, int(config.cache_config.block_size))

    def _windows(self, tenant: str) -> tuple:
        with self._qos_lock:
            if tenant not in self._qos:
                self._qos[tenant] = (LatencyWindow(), LatencyWindow())
            return self._qos[tenant]

    def _full_length(self, path: str, request: dict) -> int:
        """Prompt tokens plus max tokens (for each of ``n`` choices), what the request may hold at its longest."""
        if path.endswith("/chat/completions"):
            prompts = [self._chat_tokens(request.get("messages"))]
            most = request.get("max_completion_tokens") or request.get("max_tokens")
        else:
            prompts = [self._prompt_tokens(p) for p in _prompts(request.get("prompt"))]
            most = request.get("max_tokens")
        if most is not None and (not isinstance(most, int) or most < 0):
            raise ValueError(f"max_tokens must be a non-negative integer, got {most!r}")
        n = request.get("n") or 1
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive integer, got {n!r}")
        return sum(p + n * (most if most is not None else max(self._max_len - p, 0)) for p in prompts)

    def _prompt_tokens(self, prompt) -> int:
        if isinstance(prompt, str):
            return len(self._tokenizer.encode(prompt)) if self._tokenizer is not None else len(prompt.encode())
        return len(prompt)  # token ids

    def _chat_tokens(self, messages) -> int:
        if not isinstance(messages, list) or not messages:
            raise ValueError("messages must be a non-empty list")
        if self._tokenizer is not None:
            try:
                ids = self._tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
                return len(ids["input_ids"] if hasattr(ids, "keys") else ids)  # ids, or a BatchEncoding
            except Exception:  # noqa: BLE001 - content vLLM renders but the template here does not: bound it below
                pass
        # every token is at least one byte of the messages' text (and their roles)
        return len(json.dumps(messages, ensure_ascii=False).encode())


def _prompts(prompt) -> list:
    """A completion's prompts: a string, token ids, or a list of either (one request each)."""
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt) and prompt):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return prompt
    raise ValueError("prompt must be a string, token ids, or a list of them")


async def _read_body(receive) -> tuple[bytes, bool]:
    """(the request's whole body, whether the client went away first)."""
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return b"", True
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            return b"".join(chunks), False


async def _admitted_or_gone(admitted: asyncio.Event, receive) -> bool:
    """Wait for the gate; False where the client disconnects first (the only message left to receive)."""
    if admitted.is_set():
        return True
    wait = asyncio.ensure_future(admitted.wait())
    gone = asyncio.ensure_future(receive())
    done, _ = await asyncio.wait((wait, gone), return_when=asyncio.FIRST_COMPLETED)
    if wait in done:
        gone.cancel()
        return True
    wait.cancel()
    return False


def _replay(body: bytes, receive):
    """The receive vLLM's app sees: the body read here, then the client's own messages (its disconnect)."""
    sent = False

    async def again():
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return again


async def _error(send, status: int, message: str, headers: dict | None = None) -> None:
    """An answer in the OpenAI error shape vLLM's server uses."""
    kind = {400: "BadRequestError", 429: "RateLimitError"}[status]
    payload = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    extra = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
                            *extra]})
    await send({"type": "http.response.body", "body": payload})


def _register_metrics(admission: TenantAdmission, book: TenantBook) -> None:
    """The per-tenant families in the default Prometheus registry, which vLLM's /metrics serves; read at scrape."""
    from prometheus_client import REGISTRY
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class TenantCollector:
        def collect(self):
            stats = book.stats()
            waiting = admission.gate.waiting_by_tenant() if admission.gate is not None else {}
            families = [
                (GaugeMetricFamily, "tenant_quota_usage", "KV blocks its admitted requests reserve (full length)",
                 lambda n, s: s["reserved_blocks"]),
                (GaugeMetricFamily, "tenant_quota_limit", "its share of vLLM's KV blocks",
                 lambda n, s: s["quota_blocks"]),
                (CounterMetricFamily, "tenant_requests", "requests accepted", lambda n, s: s["accepted"]),
                (CounterMetricFamily, "tenant_rejections", "requests refused at its limit", lambda n, s: s["rejected"]),
                (GaugeMetricFamily, "tenant_requests_waiting", "accepted requests waiting for their share",
                 lambda n, s: waiting.get(n, 0)),
                (GaugeMetricFamily, "tenant_latency_p99_ms", "P99 end-to-end latency, the last minute",
                 lambda n, s: admission._windows(n)[0].figures()["latency_p99_ms"]),
                (GaugeMetricFamily, "tenant_first_token_p99_ms", "P99 time to first token, the last minute",
                 lambda n, s: admission._windows(n)[1].figures()["latency_p99_ms"]),
            ]
            for kind, name, text, value in families:
                family = kind(name, f"{text} per tenant (tenant_admission.py)", labels=["tenant"])
                for tenant, figures in stats.items():
                    family.add_metric([tenant], float(value(tenant, figures)))
                yield family

    REGISTRY.register(TenantCollector())
