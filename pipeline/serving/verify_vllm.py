"""verify stage, vllm target: the published export served both ways (``vllm.frontends``), one server at a time.

**vLLM's OpenAI server** (pipeline.serving.vllm_server), checked with the official ``openai`` client:

- completions, greedy, with token ids (vLLM's ``return_token_ids``): the tokens the build's check got from
  vLLM's offline engine for the same prompts (``vllm_check.json`` beside the export), or first different at
  a near-tie of the server's own log-probabilities (the server schedules and caches prefixes differently from
  the offline engine, and bfloat16 rounds another batch shape differently: seen on SmolLM2 at a gap of 0.25),
  and ``text`` equal to the tokenizer's decoding of its tokens;
- a streamed completion: its pieces concatenate to the unstreamed text;
- a chat completion with the model's chat template: the prompt the server counted is the template's, and
  it answers;
- concurrent requests, each equal to its solo answer or first different at a near-tie of the solo run's own
  log-probabilities (bfloat16: another batch shape rounds differently);
- malformed requests (negative max_tokens, an unknown model) get a 4xx error and the server keeps answering;
- ``/metrics`` carries every series the HPA and the alert rules read (``engine_args.METRIC_SERIES``).

**Triton** with the vLLM Python-backend model (triton_repo/tensorrt_llm_vllm) behind the same ensemble as
every target: pipeline.serving.verify's checks (HTTP and gRPC infer, generate, both streams, concurrent,
malformed), each answer judged against the same offline tokens. An answer may leave them only where it is the
OpenAI server's answer to the same prompt, or leaves that one at a near-tie of its log-probabilities (Triton's
outputs carry none), so with the Triton frontend alone answers must be equal. The OpenAI server is checked
first whatever the order of ``vllm.frontends``. Its checks are named ``triton_<check>``; ``triton_metrics``
finds the series the Triton alert rules and autoscaler read, which the vLLM model fills from vLLM's scheduler.

Every server runs on 127.0.0.1 with free ports and is stopped whatever happens.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Optional

from pipeline import artifacts, console, records
from pipeline.engines.vllm.engine_args import METRIC_SERIES
from pipeline.engines.vllm.target import CHECK_FILE
from pipeline.errors import InputError, StageFailed
from pipeline.summaries import VerifySummary

log = logging.getLogger(__name__)

CHAT_QUESTION = "What is the capital of France?"
METRICS = METRIC_SERIES  # what the HPA and the alert rules read
REQUEST_TIMEOUT_S = 300.0
# logprob gap under which a batched answer may leave its solo one: measured on SmolLM2, the unquantized bf16
# model leaves its own fp32 run at a gap of 0.40; one bf16 rounding step of a logit near 20 is 0.125
BF16_TIE_BOUND = 0.5


def batch_tie(rows: list[dict[int, float]], solo: list[int], got: list[int]) -> dict:
    """Equal to the solo answer, or first different where the solo run's own top-2 log-probabilities (``rows``:
    per position {token: logprob}) are within ``BF16_TIE_BOUND``: in bfloat16 a different batch moves logits
    by rounding steps, which flips a near-tie (the Triton targets' check against an fp32 reference uses 0.1)."""
    if got == solo:
        return {"ok": True, "equal": True}
    at = next((i for i, (a, b) in enumerate(zip(got, solo)) if a != b), min(len(got), len(solo)))
    row = rows[at] if at < len(rows) else {}
    if at >= len(got) or at >= len(solo) or got[at] not in row or solo[at] not in row:
        return {"ok": False, "equal": False, "diverged_at": at, "margin": None}
    margin = round(row[solo[at]] - row[got[at]], 6)
    return {"ok": margin <= BF16_TIE_BOUND, "equal": False, "diverged_at": at, "margin": margin}


class OfflineTokens:
    """What Triton's answers are judged against (pipeline.serving.verify.Verifier's ``expected``): the offline
    engine's greedy tokens per prompt. A different answer passes only where the OpenAI server answered the same
    prompt (``served``, which verify already judged against the offline tokens) and Triton's answer is equal to
    it or first different at a near-tie of that answer's own log-probabilities (``rows``, along ``served``: at
    any other position they belong to another prefix, so the offline tokens are not compared with them)."""

    def __init__(self, tokens: list[list[int]], rows: list[list[dict[int, float]]],
                 served: Optional[list[list[int]]] = None):
        self.tokens, self.rows, self.served = tokens, rows, served or []

    def judge(self, i: int, got: list[int]) -> dict:
        n = min(len(got), len(self.tokens[i]))  # the build's check may have asked for another length
        want = self.tokens[i][:n]
        if got and got[:n] == want:
            return {"ok": True, "equal": True}
        served = self.served[i][:n] if i < len(self.served) else []
        if not got or not served:  # no answer, or no OpenAI run to judge a different one by
            return {"ok": False, "equal": False, "margin": None, "offline_tokens": want, "got_tokens": got}
        verdict = batch_tie(self.rows[i] if i < len(self.rows) else [], served, got[:n])
        return {**verdict, "equal": False, "equal_to_openai": verdict["equal"], "offline_tokens": want,
                "openai_tokens": served, "got_tokens": got}


class VllmVerifier:
    def __init__(self, server, tokenizer, prompts: list[str], expected: list[list[int]], max_tokens: int):
        from openai import OpenAI

        self.server, self.tokenizer, self.prompts, self.expected = server, tokenizer, prompts, expected
        self.max_tokens = max_tokens
        self.client = OpenAI(base_url=server.base_url, api_key="unused", timeout=REQUEST_TIMEOUT_S, max_retries=0)
        self.model = server.model_name
        self.checks: list[dict] = []
        self.latency_ms: dict[str, list[float]] = {}
        self.solo: list[list[int]] = []
        self.top_logprobs: dict[tuple, list[dict[int, float]]] = {}  # (prompt, tokens) -> per position {id: lp}

    def guard(self, name: str, fn: Callable[[], dict]) -> None:
        """Run one check; any exception is that check failing (recorded with its message), not the stage's."""
        try:
            detail = fn()
            ok = detail.pop("ok")
        except Exception as e:  # noqa: BLE001 - a check's failure is data, recorded and reported together
            ok, detail = False, {"error": f"{type(e).__name__}: {e}"}
        self.checks.append({"name": name, "ok": bool(ok), **detail})
        log.log(logging.INFO if ok else logging.ERROR, "verify %s: %s %s", name, "ok" if ok else "FAILED", detail)

    def _complete(self, prompt: str) -> tuple[list[int], str, float]:
        t0 = time.perf_counter()
        r = self.client.completions.create(model=self.model, prompt=prompt, max_tokens=self.max_tokens,
                                           temperature=0.0, logprobs=2,
                                           extra_body={"return_token_ids": True, "return_tokens_as_token_ids": True})
        ms = (time.perf_counter() - t0) * 1000
        choice = r.choices[0]
        ids = getattr(choice, "token_ids", None) or (choice.model_extra or {}).get("token_ids") or []
        top = choice.logprobs.top_logprobs if choice.logprobs and choice.logprobs.top_logprobs else []
        # vLLM names tokens "token_id:<id>" with return_tokens_as_token_ids
        self.top_logprobs[(prompt, tuple(ids))] = [{int(k.split(":", 1)[1]): v for k, v in (row or {}).items()}
                                                   for row in top]
        return list(ids), choice.text, ms

    def batch_tie(self, prompt: str, solo: list[int], got: list[int]) -> dict:
        return batch_tie(self.top_logprobs.get((prompt, tuple(solo))) or [], solo, got)

    def completions(self) -> dict:
        results, ok = [], True
        for prompt, want in zip(self.prompts, self.expected):
            ids, text, ms = self._complete(prompt)
            self.latency_ms.setdefault("completion", []).append(ms)
            self.solo.append(ids)
            decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
            n = min(len(ids), len(want))  # the build's check may have asked for another length: compare the prefix
            # the server's answer is the reference here: its own top-2 log-probabilities say whether the offline
            # engine's token at the first difference was a near-tie
            verdict = batch_tie(self.top_logprobs[(prompt, tuple(ids))], ids[:n], want[:n]) if ids else \
                {"ok": False, "equal": False}
            text_ok = text == decoded
            ok &= verdict["ok"] and text_ok
            results.append({"prompt": prompt, **verdict, "text_is_decoding": text_ok, "text": text,
                            **({} if verdict["equal"] else {"got_tokens": ids, "offline_tokens": want})})
        return {"ok": ok, "results": results}

    def streaming(self) -> dict:
        t0 = time.perf_counter()
        pieces, first_ms = [], None
        stream = self.client.completions.create(model=self.model, prompt=self.prompts[0], max_tokens=self.max_tokens,
                                                temperature=0.0, stream=True)
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                first_ms = first_ms or (time.perf_counter() - t0) * 1000
                pieces.append(chunk.choices[0].text)
        _, whole, _ = self._complete(self.prompts[0])
        self.latency_ms.setdefault("stream_first_token", []).append(first_ms or 0.0)
        return {"ok": "".join(pieces) == whole and len(pieces) > 1, "pieces": len(pieces), "text": "".join(pieces)}

    def chat(self) -> dict:
        messages: list[Any] = [{"role": "user", "content": CHAT_QUESTION}]
        r = self.client.chat.completions.create(model=self.model, messages=messages, max_tokens=self.max_tokens,
                                                temperature=0.0)
        templated = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(templated, dict):  # newer tokenizers return a BatchEncoding
            templated = templated["input_ids"]
        answer = r.choices[0].message.content or ""
        counted = r.usage.prompt_tokens if r.usage else None
        return {"ok": bool(answer.strip()) and counted == len(templated), "answer": answer,
                "prompt_tokens": counted, "template_tokens": len(templated),
                "finish_reason": r.choices[0].finish_reason}

    def concurrent(self, n: int) -> dict:
        jobs = [self.prompts[i % len(self.prompts)] for i in range(n)]
        with ThreadPoolExecutor(n) as pool:
            answers = list(pool.map(self._complete, jobs))
        verdicts = [self.batch_tie(jobs[i], self.solo[i % len(self.prompts)], ids)
                    for i, (ids, _, _) in enumerate(answers)]
        self.latency_ms.setdefault(f"concurrent_{n}", []).extend(ms for _, _, ms in answers)
        differ = {i: v for i, v in enumerate(verdicts) if not v["equal"]}
        return {"ok": all(v["ok"] for v in verdicts), "requests": n, "differ_from_solo": differ}

    def malformed(self) -> dict:
        import openai

        statuses = {}
        for name, call in (
            ("negative_max_tokens",
             lambda: self.client.completions.create(model=self.model, prompt="Hi", max_tokens=-1)),
            ("unknown_model", lambda: self.client.completions.create(model="no-such-model", prompt="Hi", max_tokens=4)),
        ):
            try:
                call()
                statuses[name] = 200
            except openai.APIStatusError as e:
                statuses[name] = e.status_code
        ids, _, _ = self._complete(self.prompts[0])
        still = ids == self.solo[0]
        return {"ok": all(400 <= s < 500 for s in statuses.values()) and still, "statuses": statuses,
                "answers_after": still}

    def metrics(self) -> dict:
        from pipeline.serving.verify import series_found

        found = series_found(self.server.metrics_url, [(m, None, None) for m in METRICS])
        return {"ok": all(found.values()), "found": found}


def verify_vllm(repo: Path, prov: records.Provenance, *, out_dir: Path, prompts: tuple[str, ...], max_tokens: int,
                concurrent: int, frontends: tuple[str, ...] = ("openai", "triton")) -> VerifySummary:
    """The verify stage on a published vllm repository, each frontend in turn; StageFailed (after every check
    ran) when one fails."""
    from transformers import AutoTokenizer

    from pipeline.serving.verify import latency_summary
    from pipeline.serving.vllm_server import published_model

    folder, _, _ = published_model(repo)
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    try:
        check = json.loads((folder / CHECK_FILE).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{folder / CHECK_FILE} is missing or unreadable ({e}): it is the build's vLLM check; "
                         f"rebuild and publish with `invoke publish --force`") from None
    offline = {p["prompt"]: p["vllm_tokens"] for p in check["greedy_tokens"]["prompts"]}
    missing = [p for p in prompts if p not in offline]
    if missing:
        raise StageFailed(f"verify: the build's vLLM check has no tokens for {missing}; rebuild with "
                          f"`invoke build --force`")
    expected = [offline[p] for p in prompts]
    checks: list[dict] = []
    latency_ms: dict[str, list[float]] = {}
    servers: dict[str, dict] = {}
    rows: list[list[dict[int, float]]] = []
    served: list[list[int]] = []
    logs = {f: artifacts.SERVER_LOG_FILE if i == 0 else f"server_{f}.log" for i, f in enumerate(frontends)}
    # the OpenAI server first wherever it serves: its answers and log-probabilities judge Triton's near-ties
    order = sorted(frontends, key=lambda f: f != "openai")
    for frontend in console.track(order, "verify: servers (start, check, stop)"):
        if frontend == "openai":
            v = _openai_checks(repo, out_dir / logs[frontend], tokenizer=tokenizer, prompts=list(prompts),
                               expected=expected, max_tokens=max_tokens, concurrent=concurrent)
            rows = [v.top_logprobs.get((p, tuple(solo))) or [] for p, solo in zip(prompts, v.solo)]
            served = list(v.solo)
            checks += [{**c, "frontend": "openai"} for c in v.checks]
            latency_ms.update({f"openai_{k}": x for k, x in v.latency_ms.items()})
            servers["openai"] = {"startup_s": v.server.startup_s, "log": logs[frontend],
                                 "binary": f"vLLM OpenAI server ({check.get('vllm_version')})"}
        else:
            startup_s, t_checks, t_latency, died = _triton_checks(
                repo, prov, log_path=out_dir / logs[frontend], tokenizer=tokenizer, prompts=list(prompts),
                expected=OfflineTokens(expected, rows, served), max_tokens=max_tokens, concurrent=concurrent)
            checks += [{**c, "name": f"triton_{c['name']}", "frontend": "triton"} for c in t_checks]
            latency_ms.update({f"triton_{k}": x for k, x in t_latency.items()})
            servers["triton"] = {"startup_s": startup_s, "log": logs[frontend], "died_with_exit_code": died,
                                 "binary": "nvidia-pytriton tritonserver, vLLM Python-backend model"}
    failed = [c["name"] for c in checks if not c["ok"]]
    latency = latency_summary(latency_ms)
    results = records.VerifyResults(
        ok=not failed, model_name=prov.model_name, version=prov.version, target="vllm", frontends=list(frontends),
        servers=servers, server=servers[frontends[0]],
        reference="vLLM's offline engine on the same export, in the build's check (vllm_check.json)",
        prompts=list(prompts), max_tokens=max_tokens, latency=latency, checks=checks)
    records.write_verify_results(out_dir, results)
    if failed:
        from pipeline.serving.server import log_tail

        tails = "\n".join(f"{f} ({logs[f]}):\n{log_tail(out_dir / logs[f])}" for f in frontends
                          if any(c["frontend"] == f and not c["ok"] for c in checks))
        raise StageFailed(f"verify: {len(failed)} check(s) failed: {', '.join(failed)}. The answers are in "
                          f"{out_dir / artifacts.VERIFY_RESULTS_FILE}; the servers' logs end:\n{tails}")
    return {"checks": len(checks), "all_ok": True, "frontends": list(frontends),
            "server_startup_s": {f: servers[f]["startup_s"] for f in frontends}, "latency": latency}


def _openai_checks(repo: Path, log_path: Path, *, tokenizer, prompts: list[str], expected: list[list[int]],
                   max_tokens: int, concurrent: int) -> VllmVerifier:
    from pipeline.serving.vllm_server import VllmServer

    with VllmServer(repo, log_path=log_path) as server:
        v = VllmVerifier(server, tokenizer, prompts, expected, max_tokens)
        v.guard("completions", v.completions)
        v.guard("completions_stream", v.streaming)
        v.guard("chat_completions", v.chat)
        v.guard(f"concurrent_{concurrent}", lambda: v.concurrent(concurrent))
        v.guard("malformed_requests", v.malformed)
        v.guard("metrics", v.metrics)
    return v


def _triton_checks(repo: Path, prov: records.Provenance, *, log_path: Path, tokenizer, prompts: list[str],
                   expected: OfflineTokens, max_tokens: int,
                   concurrent: int) -> tuple[Optional[float], list[dict], dict, Optional[int]]:
    """Triton's checks (pipeline.serving.verify) on the vllm repository: (startup s, checks, latencies, the
    server's exit code if it died during them)."""
    from pipeline.serving.publish import model_names
    from pipeline.serving.serve import server_for_target
    from pipeline.serving.verify import triton_checks

    server = server_for_target("vllm", repo, frontend="triton", log_path=log_path)
    v, died = triton_checks(server, repo, names=model_names(prov.model_name), tokenizer=tokenizer, prompts=prompts,
                            expected=expected, max_tokens=max_tokens, concurrent=concurrent, target="vllm")
    return server.startup_s, [c.as_dict() for c in v.checks], v.latency_ms, died
