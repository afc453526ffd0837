"""The load: prompts from the evaluation text, a closed-loop gRPC streaming client, and one level's client figures.

The load is closed-loop: at concurrency ``c``, ``c`` clients each send one streaming request to the
decoupled ``M_stream`` model over a gRPC stream (tritonclient's asyncio client, one stream per request),
wait for its last token, and send the next, until every prompt is sent. Prompts are windows of
``bench.prompt_tokens`` tokens of the evaluation text (the text stage's held-out samples), each request a
different window; with ``end_id`` -1 (``bench.ignore_eos``) every request generates exactly its
``max_tokens``, as LLM benchmarks do, so levels are comparable.

Client-side figures of a level: output tokens/s and requests/s over the level's wall time; time to first
token (TTFT), inter-token latency (ITL = (end-to-end - TTFT) / (tokens - 1), per request) and end-to-end
latency at P50/P90/P99, P99/P50, jitter (std / mean).

Why a client of our own: ``perf_analyzer`` (the maintained tool, and what genai-perf drives) is not in
current tritonclient wheels; the one in tritonclient 2.51's wheel runs here with two extra libraries
(libb64, libcudart) and is used to cross-check this client (tests/serving/bench/test_bench.py), not as the stage's tool.
aiperf speaks OpenAI-style HTTP endpoints, which the Triton 2.51 binary of nvidia-pytriton does not serve.
The vllm target is driven the same way over vLLM's OpenAI API (``drive_openai``: streamed completions).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import numpy as np

from pipeline.errors import InputError
from pipeline.serving.bench.stats import goodput, summarize

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- prompts


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as the server's tokenizer counts the text


def make_prompts(samples_file: Path, tokenizer, prompt_tokens: int, count: int) -> list[Prompt]:
    """``count`` prompts of ``prompt_tokens`` tokens: consecutive windows of the evaluation text.

    The samples are joined into one token stream (special tokens such as the document separator removed)
    and cut into windows; when the text has fewer windows than requests, windows repeat (said in the log).
    """
    texts = []
    for line in samples_file.read_text(encoding="utf-8").splitlines():
        if line.strip():
            texts.append(json.loads(line)["text"])
    if not texts:
        raise InputError(f"{samples_file} has no samples; run `invoke download --force`")
    specials = [t for t in tokenizer.all_special_tokens if t]
    stream: list[int] = []
    for text in texts:
        for tok in specials:
            text = text.replace(tok, "\n")
        stream += tokenizer(text, add_special_tokens=False).input_ids
    windows = len(stream) // prompt_tokens
    if windows < 1:
        raise InputError(f"the evaluation text has {len(stream)} tokens, fewer than bench.prompt_tokens "
                         f"({prompt_tokens}); lower bench.prompt_tokens or raise text.evaluation")
    if windows < count:
        log.info("the evaluation text holds %d distinct %d-token prompts for %d requests: prompts repeat",
                 windows, prompt_tokens, count)
    prompts, cache = [], {}
    for i in range(count):
        w = i % windows
        if w not in cache:
            text = tokenizer.decode(stream[w * prompt_tokens:(w + 1) * prompt_tokens], skip_special_tokens=True,
                                    clean_up_tokenization_spaces=False)
            cache[w] = Prompt(text, len(tokenizer(text).input_ids))  # as the server tokenizes it
        prompts.append(cache[w])
    return prompts


# ---------------------------------------------------------------- the load generator


@dataclass
class RequestRecord:
    prompt_tokens: int
    sent: float  # perf_counter seconds
    arrivals: list[tuple[float, int]] = field(default_factory=list)  # (time, tokens in that response)
    error: Optional[str] = None

    @property
    def output_tokens(self) -> int:
        return sum(n for _, n in self.arrivals)

    @property
    def ttft_ms(self) -> float:
        return (self.arrivals[0][0] - self.sent) * 1e3

    @property
    def e2e_ms(self) -> float:
        return (self.arrivals[-1][0] - self.sent) * 1e3

    @property
    def itl_ms(self) -> Optional[float]:
        n = self.output_tokens
        return (self.e2e_ms - self.ttft_ms) / (n - 1) if n > 1 else None

    def token_gaps_ms(self) -> list[float]:
        """Time between consecutive responses, per token they carried."""
        out = []
        for (t0, _), (t1, n) in itertools.pairwise(self.arrivals):
            out += [(t1 - t0) * 1e3 / n] * n
        return out


def _ended(rec: RequestRecord) -> RequestRecord:
    """A request whose stream ended: one without any token is an error too."""
    if rec.error is None and not rec.arrivals:
        rec.error = "the stream ended without a token"
    return rec


def _stream_inputs(text: str, max_tokens: int, end_id: Optional[int], priority: Optional[int] = None,
                   tenant: Optional[str] = None) -> list:
    import tritonclient.grpc as grpcclient  # optional and heavy (gRPC stubs): only when a load is driven

    arrays = [("text_input", np.array([[text.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32")]
    if end_id is not None:
        arrays.append(("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    if priority is not None:  # the request's class (triton.priority_levels)
        arrays.append(("priority", np.array([[priority]], dtype=np.int32), "INT32"))
    if tenant is not None:  # the tenant it belongs to (the config's tenants)
        arrays.append(("tenant", np.array([[tenant.encode()]], dtype=object), "BYTES"))
    out = []
    for name, arr, dt in arrays:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


async def one_request(client, model: str, *, prompt: Prompt, max_tokens: int, end_id: Optional[int],
                      timeout_s: float, priority: Optional[int] = None, tenant: Optional[str] = None) -> RequestRecord:
    """One request on its own gRPC stream (``client``: tritonclient's asyncio gRPC client); the stream ends
    after the request's final response. ``priority``: its class, where the repository has request classes;
    ``tenant``: its tenant, where it has tenants."""
    inputs = _stream_inputs(prompt.text, max_tokens, end_id, priority, tenant)

    async def requests():
        yield {"model_name": model, "inputs": inputs}

    rec = RequestRecord(prompt.tokens, time.perf_counter())
    try:
        async for result, error in client.stream_infer(requests(), stream_timeout=timeout_s):
            if error is not None:
                rec.error = str(error)
                break
            ids = result.as_numpy("output_ids")
            n = int(ids.size) if ids is not None else 0
            if n:
                rec.arrivals.append((time.perf_counter(), n))
    except Exception as e:  # noqa: BLE001 - a failed request is recorded; the level then fails as a whole
        rec.error = f"{type(e).__name__}: {e}"
    return _ended(rec)


async def unary_request(client, model: str, *, prompt: Prompt, max_tokens: int, end_id: Optional[int],
                        timeout_s: float) -> RequestRecord:
    """One request answered whole (gRPC infer on the ensemble ``model``): one arrival, all its tokens."""
    inputs = _stream_inputs(prompt.text, max_tokens, end_id)
    rec = RequestRecord(prompt.tokens, time.perf_counter())
    try:
        result = await client.infer(model, inputs, client_timeout=timeout_s)
        ids = result.as_numpy("output_ids")
        if ids is not None and ids.size:
            rec.arrivals.append((time.perf_counter(), int(ids.size)))
    except Exception as e:  # noqa: BLE001 - a failed request is recorded; the level then fails as a whole
        rec.error = f"{type(e).__name__}: {e}"
    return _ended(rec)


async def _closed_loop(send, prompts: list[Prompt], concurrency: int) -> tuple[list[RequestRecord], float]:
    """``concurrency`` clients, each sending the next prompt (``await send(prompt)``) when its request is done,
    until every prompt is sent: (records in completion order, wall seconds)."""
    todo = iter(prompts)  # shared: each client takes the next prompt when its request is done
    records: list[RequestRecord] = []

    async def one_client():
        for prompt in todo:
            records.append(await send(prompt))

    t0 = time.perf_counter()
    await asyncio.gather(*(one_client() for _ in range(concurrency)))
    return records, time.perf_counter() - t0


async def _drive(grpc_url: str, model: str, *, prompts: list[Prompt], concurrency: int, max_tokens: int,
                 end_id: Optional[int], timeout_s: float, stream: bool) -> tuple[list[RequestRecord], float]:
    import tritonclient.grpc.aio as grpcaio  # optional and heavy (gRPC stubs): only when a load is driven

    client = grpcaio.InferenceServerClient(grpc_url)
    request = one_request if stream else unary_request
    try:
        return await _closed_loop(lambda p: request(client, model, prompt=p, max_tokens=max_tokens, end_id=end_id,
                                                    timeout_s=timeout_s),
                                  prompts, concurrency)
    finally:
        await client.close()


def drive(grpc_url: str, model: str, *, prompts: list[Prompt], concurrency: int, max_tokens: int,
          end_id: Optional[int] = -1, timeout_s: float = 300.0,
          stream: bool = True) -> tuple[list[RequestRecord], float]:
    """Send every prompt with ``concurrency`` requests in flight; (records in completion order, wall seconds).
    ``stream`` False: each request answered whole (``model`` the ensemble, not the streaming model)."""
    return asyncio.run(_drive(grpc_url, model, prompts=prompts, concurrency=concurrency, max_tokens=max_tokens,
                              end_id=end_id, timeout_s=timeout_s, stream=stream))


async def _openai_request(client, model: str, *, prompt: Prompt, max_tokens: int, ignore_eos: bool,
                          stream: bool = True) -> RequestRecord:
    """One streamed completion; each chunk's tokens counted from vLLM's ``token_ids`` (``return_token_ids``).
    ``stream`` False: one completion answered whole, its tokens the usage's ``completion_tokens``."""
    rec = RequestRecord(prompt.tokens, time.perf_counter())
    try:
        if not stream:
            whole = await client.completions.create(model=model, prompt=prompt.text, max_tokens=max_tokens,
                                                    temperature=0.0, extra_body={"ignore_eos": ignore_eos})
            if whole.usage is not None and whole.usage.completion_tokens:
                rec.arrivals.append((time.perf_counter(), int(whole.usage.completion_tokens)))
            return _ended(rec)
        chunks = await client.completions.create(model=model, prompt=prompt.text, max_tokens=max_tokens,
                                                 temperature=0.0, stream=True,
                                                 extra_body={"ignore_eos": ignore_eos, "return_token_ids": True})
        async for chunk in chunks:
            for choice in chunk.choices:
                extra = choice.model_extra or {}
                n = len(getattr(choice, "token_ids", None) or extra.get("token_ids") or [])
                if n:
                    rec.arrivals.append((time.perf_counter(), n))
    except Exception as e:  # noqa: BLE001 - a failed request is recorded; the level then fails as a whole
        rec.error = f"{type(e).__name__}: {e}"
    return _ended(rec)


async def _drive_openai(base_url: str, model: str, *, prompts: list[Prompt], concurrency: int, max_tokens: int,
                        ignore_eos: bool, timeout_s: float, stream: bool) -> tuple[list[RequestRecord], float]:
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base_url, api_key="unused", timeout=timeout_s, max_retries=0)
    try:
        return await _closed_loop(lambda p: _openai_request(client, model, prompt=p, max_tokens=max_tokens,
                                                                ignore_eos=ignore_eos, stream=stream),
                                  prompts, concurrency)
    finally:
        await client.close()


def drive_openai(base_url: str, model: str, *, prompts: list[Prompt], concurrency: int, max_tokens: int,
                 ignore_eos: bool = True, timeout_s: float = 300.0,
                 stream: bool = True) -> tuple[list[RequestRecord], float]:
    """The same closed loop as ``drive``, against an OpenAI-compatible server (vLLM's): streamed completions
    (``stream`` False: answered whole)."""
    return asyncio.run(_drive_openai(base_url, model, prompts=prompts, concurrency=concurrency, max_tokens=max_tokens,
                                     ignore_eos=ignore_eos, timeout_s=timeout_s, stream=stream))


def level_figures(records: list[RequestRecord], wall_s: float, concurrency: int,
                  sla: Optional[dict[str, float]] = None) -> dict:
    """The client-side figures of one level; with ``sla`` bounds ({metric: P99 ms}), its goodput against them."""
    ok = [r for r in records if r.error is None]
    out_tokens = sum(r.output_tokens for r in ok)
    gaps = [g for r in ok for g in r.token_gaps_ms()]
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "errors": len(records) - len(ok),
        "wall_s": wall_s,
        "output_tokens": out_tokens,
        "output_tokens_per_s": out_tokens / wall_s if wall_s > 0 else 0.0,
        "requests_per_s": len(ok) / wall_s if wall_s > 0 else 0.0,
        "prompt_tokens_mean": float(np.mean([r.prompt_tokens for r in ok])) if ok else None,
        "output_tokens_mean": out_tokens / len(ok) if ok else None,
        "ttft_ms": summarize([r.ttft_ms for r in ok]),
        "itl_ms": summarize([r.itl_ms for r in ok if r.itl_ms is not None]),
        "e2e_ms": summarize([r.e2e_ms for r in ok]),
        "token_gap_ms": summarize(gaps),
        "sla": goodput([{"e2e_ms": r.e2e_ms, "ttft_ms": r.ttft_ms, "itl_ms": r.itl_ms} for r in ok], wall_s, sla)
        if sla else None,
    }
