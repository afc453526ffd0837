"""verify stage: a real Triton server loads the published repository and gives the reference's tokens.

The server is the nvidia-pytriton Triton 2.51 binary on a CPU machine, the image's ``tritonserver`` on a GPU
machine (pipeline.serving.server), on 127.0.0.1 with free ports, stopped whatever happens. Through
tritonclient and plain HTTP it checks:

- HTTP infer and gRPC infer on the ensemble, the HTTP ``generate`` endpoint, ``generate_stream`` and a gRPC
  stream on the streaming model: the same greedy tokens everywhere;
- those tokens equal the CPU runtime's own output for the same prompts (cpu target: the bundle inside the
  repository, run in this process before the server starts). Where they differ, the first divergence must
  be a float-rounding tie: the reference model's top-2 logit gap there below ``reference.TIE_BOUND``;
- ``text_output`` equals the tokenizer's decoding of the tokens; streamed pieces concatenate to it;
- 16 concurrent requests, each equal to its solo answer;
- malformed requests get a 400-class error and the server stays up and keeps answering;
- Triton's ``/metrics`` carries every series the alert rules and the autoscaler's queue read
  (``metric_series``: pipeline/release/alerts.py, deploy/monitoring/prometheus-adapter-rules.yaml).

Results: ``verify_results.json`` (every check, latencies, server start time) beside the server's log.
"""

from __future__ import annotations

import json
import logging
import queue
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import numpy as np

from pipeline import artifacts, constants, records, targets
from pipeline.errors import InputError, StageFailed
from pipeline.serving.publish import model_names
from pipeline.serving.serve import server_for_target
from pipeline.serving.server import TritonServer
from pipeline.summaries import VerifySummary

if TYPE_CHECKING:
    from pipeline.engines.reference import Greedy, LoadedReference

log = logging.getLogger(__name__)

PROMPTS = constants.CHECK_PROMPTS
MAX_TOKENS = 16
CONCURRENT_REQUESTS = 16
REQUEST_TIMEOUT_S = 300.0
# The series the Triton alert rules (pipeline/release/alerts.py) and the autoscaler's queue metric
# (deploy/monitoring/prometheus-adapter-rules.yaml) read, as (family, label, label value); label None: the family.
# Triton's own, then the tensorrtllm backend's families (its C++ backend on the tensorrt target; the Python
# models of the cpu, pytorch and vllm targets export the same names: triton_repo/common/llm_serving.py), then
# the family only those Python models export (the latency rules read it).
TRITON_SERIES = (("nv_inference_pending_request_count", None, None), ("nv_inference_request_success", None, None),
                 ("nv_inference_request_failure", None, None))
ENGINE_SERIES = (("nv_trt_llm_request_metrics", "request_type", "waiting"),
                 ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "used"),
                 ("nv_trt_llm_kv_cache_block_metrics", "kv_cache_block_type", "max"))
PIPELINE_SERIES = (("trtllm_pipeline_model_metrics", "metric_type", "latency_p99_over_p50"),
                   ("trtllm_pipeline_model_metrics", "metric_type", "latency_jitter"))


def metric_series(target: str) -> tuple[tuple[str, Optional[str], Optional[str]], ...]:
    """What the metrics check requires of a server of a ``target`` build."""
    return TRITON_SERIES + ENGINE_SERIES + (PIPELINE_SERIES if targets.get(target).pipeline_metrics else ())


def series_found(metrics_url: str, series) -> dict[str, bool]:
    """{series: on the Prometheus endpoint ``metrics_url``} for each (family, label, label value) of ``series``
    (label None: the family alone)."""
    with urllib.request.urlopen(metrics_url, timeout=30) as r:
        lines = [line for line in r.read().decode().splitlines() if line and not line.startswith("#")]
    found = {}
    for family, label, value in series:
        key = family if label is None else f'{family}{{{label}="{value}"}}'
        found[key] = any(line.startswith((family + "{", family + " ")) and
                         (label is None or f'{label}="{value}"' in line) for line in lines)
    return found


@dataclass
class Check:
    name: str
    ok: bool
    detail: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        return {"name": self.name, "ok": self.ok, **self.detail}


def decode(tokenizer, ids: list[int]) -> str:
    """The text the server gives for ``ids`` (postprocessing decodes the same way)."""
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


class Expected:
    """Greedy tokens per prompt from the CPU runtime, and the tie check for tokens that differ."""

    def __init__(self, bundle: Optional[Path], prompt_ids: list[list[int]], max_tokens: int):
        self.bundle, self.prompt_ids, self.max_tokens = bundle, prompt_ids, max_tokens
        self.tokens: Optional[list[list[int]]] = None
        self._ref: Optional[LoadedReference] = None
        self._ref_greedy: dict[int, Greedy] = {}

    def _bundle_dir(self) -> Path:
        if self.bundle is None:
            raise InputError("verify: the published repository has no cpu_bundle beside its engine model, and the "
                             "CPU reference runs it; run `invoke publish` again")
        return self.bundle

    def compute(self) -> None:
        """Run the bundle's runtime on each prompt alone (before the server takes the CPU)."""
        from pipeline.engines.cpu_runtime import CpuRuntime, SamplingParams

        with CpuRuntime.load(self._bundle_dir()) as rt:
            self.tokens = [rt.generate(p, SamplingParams(max_new_tokens=self.max_tokens)) for p in self.prompt_ids]
            self.end_id = rt.eos_token_id

    def judge(self, i: int, got: list[int]) -> dict:
        """{ok, equal, ...}: equal to the runtime's tokens, or diverging first at a reference near-tie."""
        if self.tokens is None:
            return {"ok": True, "equal": None, "note": "no CPU reference on this target"}
        want = self.tokens[i]
        if got == want:
            return {"ok": True, "equal": True}
        from pipeline.engines import reference

        if self._ref is None:
            self._ref = reference.load_reference(self._bundle_dir())  # compute() ran: there is one
        if i not in self._ref_greedy:
            model, algo, scales = self._ref
            self._ref_greedy[i] = reference.greedy(model, self.prompt_ids[i], max_new_tokens=self.max_tokens,
                                                   kv_quant_algo=algo, kv_scales=scales, end_id=self.end_id)
        verdict = reference.compare(got, self._ref_greedy[i])
        return {**verdict, "ok": bool(verdict["ok"]), "equal": False, "runtime_tokens": want, "got_tokens": got}


# ---------------------------------------------------------------- clients


def _np_inputs(module, text: str, max_tokens: int, extra: Optional[dict] = None) -> list:
    arrays = {"text_input": (np.array([[text.encode()]], dtype=object), "BYTES"),
              "max_tokens": (np.array([[max_tokens]], dtype=np.int32), "INT32")}
    for name, (arr, dt) in (extra or {}).items():
        arrays[name] = (arr, dt)
    out = []
    for name, (arr, dt) in arrays.items():
        t = module.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


def _ids_text(result) -> tuple[list[int], str]:
    ids = result.as_numpy("output_ids").reshape(-1).tolist()
    n = int(result.as_numpy("sequence_length").reshape(-1)[0])
    text = result.as_numpy("text_output").reshape(-1)[0]
    return ids[:n], text.decode() if isinstance(text, bytes) else str(text)


def _post_json(url: str, body, timeout: float = REQUEST_TIMEOUT_S) -> tuple[int, str]:
    data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _sse_events(body: str) -> list[dict]:
    return [json.loads(line[len("data: "):]) for line in body.splitlines() if line.startswith("data: ")]


def grpc_stream(url: str, model: str, text: str, max_tokens: int) -> tuple[list[int], list[str], float, float]:
    """(tokens, text pieces, first-piece latency ms, total ms) for one request on a gRPC stream."""
    import tritonclient.grpc as grpcclient

    q: "queue.Queue" = queue.Queue()
    client = grpcclient.InferenceServerClient(url)
    tokens, pieces, first = [], [], None
    t0 = time.perf_counter()
    client.start_stream(callback=lambda result, error: q.put((result, error)))
    try:
        client.async_stream_infer(model, _np_inputs(grpcclient, text, max_tokens), enable_empty_final_response=True)
        while True:
            result, error = q.get(timeout=REQUEST_TIMEOUT_S)
            if error is not None:
                raise StageFailed(f"gRPC stream on {model}: {error}")
            if result.get_response().parameters["triton_final_response"].bool_param:
                break
            if first is None:
                first = (time.perf_counter() - t0) * 1e3
            tokens += result.as_numpy("output_ids").reshape(-1).tolist()
            piece = result.as_numpy("text_output").reshape(-1)[0]
            pieces.append(piece.decode() if isinstance(piece, bytes) else str(piece))
    finally:
        client.stop_stream()
        client.close()
    return tokens, pieces, first or 0.0, (time.perf_counter() - t0) * 1e3


# ---------------------------------------------------------------- the checks


class Verifier:
    def __init__(self, server: TritonServer, names, *, tokenizer, prompts: list[str], expected: Expected,
                 max_tokens: int):
        self.server, self.names, self.tok = server, names, tokenizer
        self.prompts, self.expected, self.max_tokens = prompts, expected, max_tokens
        self.checks: list[Check] = []
        self.latency_ms: dict[str, list[float]] = {}

    def _record(self, name: str, ok: bool, **detail) -> Check:
        c = Check(name, bool(ok), detail)
        self.checks.append(c)
        if c.ok:
            log.info("verify %s: ok", name)
        else:  # every answer into the stage log: the results file is not kept when the stage fails
            log.error("verify %s: FAILED %s", name, json.dumps(detail, default=str))
        return c

    def _guard(self, name: str, fn: Callable[[], None]) -> None:
        """A check that raises is a failed check (with the error), not the end of the run."""
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - recorded as this check's failure; the other checks still run
            self._record(name, False, error=f"{type(e).__name__}: {e}")

    def _judge_all(self, name: str, answers: list[tuple[list[int], str]], **extra) -> None:
        per_prompt = []
        for i, (ids, text) in enumerate(answers):
            verdict = self.expected.judge(i % len(self.prompts), ids)
            text_ok = text == decode(self.tok, ids)
            per_prompt.append({"prompt": self.prompts[i % len(self.prompts)], "tokens": ids, "text": text,
                               "text_equals_decode": text_ok, **verdict, "ok": verdict["ok"] and text_ok})
        self._record(name, all(p["ok"] for p in per_prompt), results=per_prompt, **extra)

    def _time(self, key: str, t0: float) -> float:
        ms = (time.perf_counter() - t0) * 1e3
        self.latency_ms.setdefault(key, []).append(round(ms, 1))
        return ms

    def http_infer(self) -> None:
        import tritonclient.http as httpclient

        client = httpclient.InferenceServerClient(self.server.http_url, network_timeout=REQUEST_TIMEOUT_S)
        answers = []
        for p in self.prompts:
            t0 = time.perf_counter()
            answers.append(_ids_text(client.infer(self.names.ensemble, _np_inputs(httpclient, p, self.max_tokens))))
            self._time("http_infer", t0)
        client.close()
        self.solo = answers
        self._judge_all("http_infer_ensemble", answers)

    def grpc_infer(self) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.server.grpc_url)
        answers = []
        for p in self.prompts:
            t0 = time.perf_counter()
            answers.append(_ids_text(client.infer(self.names.ensemble, _np_inputs(grpcclient, p, self.max_tokens),
                                                  client_timeout=REQUEST_TIMEOUT_S)))
            self._time("grpc_infer", t0)
        client.close()
        self._judge_all("grpc_infer_ensemble", answers)

    def http_generate(self) -> None:
        answers = []
        for p in self.prompts:
            t0 = time.perf_counter()
            status, body = _post_json(f"http://{self.server.http_url}/v2/models/{self.names.ensemble}/generate",
                                      {"text_input": p, "max_tokens": self.max_tokens})
            self._time("http_generate", t0)
            if status != 200:
                raise StageFailed(f"generate answered HTTP {status}: {body[:300]}")
            doc = json.loads(body)
            ids = doc["output_ids"] if isinstance(doc["output_ids"], list) else [doc["output_ids"]]
            answers.append((ids[: int(doc["sequence_length"])], doc["text_output"]))
        self._judge_all("http_generate_ensemble", answers)

    def http_generate_stream(self) -> None:
        answers, events_n = [], []
        for p in self.prompts:
            t0 = time.perf_counter()
            status, body = _post_json(
                f"http://{self.server.http_url}/v2/models/{self.names.stream}/generate_stream",
                {"text_input": p, "max_tokens": self.max_tokens})
            self._time("http_generate_stream", t0)
            events = _sse_events(body)
            errors = [e["error"] for e in events if "error" in e]
            if status != 200 or errors:
                raise StageFailed(f"generate_stream answered HTTP {status}: {errors or body[:300]}")
            ids: list[int] = []
            for e in events:
                ids += e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]]
            answers.append((ids, "".join(e["text_output"] for e in events)))
            events_n.append(len(events))
        self._judge_all("http_generate_stream", answers, events_per_request=events_n)

    def grpc_streaming(self) -> None:
        answers, pieces_n = [], []
        for p in self.prompts:
            ids, pieces, first_ms, total_ms = grpc_stream(self.server.grpc_url, self.names.stream, p, self.max_tokens)
            self.latency_ms.setdefault("grpc_stream_first_piece", []).append(round(first_ms, 1))
            self.latency_ms.setdefault("grpc_stream_total", []).append(round(total_ms, 1))
            answers.append((ids, "".join(pieces)))
            pieces_n.append(len(pieces))
        self._judge_all("grpc_stream", answers, pieces_per_request=pieces_n)

    def concurrent(self, n: int = CONCURRENT_REQUESTS) -> None:
        import tritonclient.grpc as grpcclient

        client = grpcclient.InferenceServerClient(self.server.grpc_url)

        def one(i: int) -> tuple[list[int], str, float]:
            t0 = time.perf_counter()
            r = client.infer(self.names.ensemble, _np_inputs(grpcclient, self.prompts[i % len(self.prompts)],
                                                             self.max_tokens), client_timeout=REQUEST_TIMEOUT_S)
            ids, text = _ids_text(r)
            return ids, text, (time.perf_counter() - t0) * 1e3

        t0 = time.perf_counter()
        with ThreadPoolExecutor(n) as pool:
            got = list(pool.map(one, range(n)))
        wall = time.perf_counter() - t0
        client.close()
        self.latency_ms["concurrent_request"] = [round(ms, 1) for _, _, ms in got]
        tokens = sum(len(ids) for ids, _, _ in got)
        self._judge_all(f"concurrent_{n}", [(ids, text) for ids, text, _ in got], wall_s=round(wall, 2),
                        tokens_per_s=round(tokens / wall, 1))

    def malformed(self) -> None:
        base = f"http://{self.server.http_url}/v2/models/{self.names.ensemble}"
        cases = {
            "missing max_tokens": (f"{base}/infer", {"inputs": [
                {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]}]}),
            "wrong datatype": (f"{base}/infer", {"inputs": [
                {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": ["hello"]},
                {"name": "max_tokens", "shape": [1, 1], "datatype": "FP32", "data": [4.0]}]}),
            "max_tokens 0": (f"{base}/generate", {"text_input": "hello", "max_tokens": 0}),
            "empty prompt": (f"{base}/generate", {"text_input": "", "max_tokens": 4}),
        }
        answers: dict[str, dict[str, Any]] = {}
        for label, (url, body) in cases.items():
            status, text = _post_json(url, body)
            answers[label] = {"status": status, "error": text[:200]}
        live = self.server.is_alive() and _post_json(f"{base}/generate", {"text_input": self.prompts[0],
                                                                          "max_tokens": 2})[0] == 200
        ok = all(400 <= a["status"] < 500 for a in answers.values()) and live
        self._record("malformed_requests", ok, answers=answers, server_still_answering=live)

    def metrics(self, series) -> None:
        """Every one of ``series`` (see ``metric_series``) on the server's metrics endpoint."""
        found = series_found(self.server.metrics_url, series)
        self._record("metrics", all(found.values()), found=found)


def _bundle_in(repo: Path, names, version: int) -> Optional[Path]:
    b = repo / names.tensorrt_llm / str(version) / "cpu_bundle"
    return b if b.is_dir() else None


def triton_checks(server: TritonServer, repo: Path, *, names, tokenizer, prompts: list[str], expected, max_tokens: int,
                  concurrent: int, target: str) -> tuple[Verifier, Optional[int]]:
    """Start ``server``, run every Triton check, stop it: (the verifier with its checks, the server's exit code
    if it died during them). ``expected.judge(i, tokens)`` judges each answer to prompt ``i``; ``target``: the
    build's, for the metrics it must export."""
    with server:
        v = Verifier(server, names, tokenizer=tokenizer, prompts=prompts, expected=expected, max_tokens=max_tokens)
        v._guard("http_infer_ensemble", v.http_infer)
        v._guard("grpc_infer_ensemble", v.grpc_infer)
        v._guard("http_generate_ensemble", v.http_generate)
        if (repo / names.stream).is_dir():
            v._guard("http_generate_stream", v.http_generate_stream)
            v._guard("grpc_stream", v.grpc_streaming)
        else:
            v._record("streaming", True, skipped="triton.decoupled is false: no streaming model was published")
        v._guard(f"concurrent_{concurrent}", lambda: v.concurrent(concurrent))
        v._guard("malformed_requests", v.malformed)
        v._guard("metrics", lambda: v.metrics(metric_series(target)))
        # a failed check may be a dead server (killed a moment ago: give it 2 s to be reaped)
        died = server.exit_code_within(2.0) if any(not c.ok for c in v.checks) else None
    return v, died


def latency_summary(latency_ms: dict[str, list[float]]) -> dict:
    """Per kind of request: median, max and count of its latencies (ms)."""
    return {k: {"median_ms": round(float(np.median(x)), 1), "max_ms": round(max(x), 1), "n": len(x)}
            for k, x in latency_ms.items() if x}


def verify(publish_dir: Path, out_dir: Path, *, prompts: tuple[str, ...] = PROMPTS,
           max_tokens: int = MAX_TOKENS, concurrent: int = CONCURRENT_REQUESTS,
           vllm_frontends: tuple[str, ...] = ("openai", "triton")) -> VerifySummary:
    """The verify stage. Raises StageFailed (after logging every check) when any check fails."""
    from transformers import AutoTokenizer

    repo = publish_dir / artifacts.MODEL_REPOSITORY_DIR
    prov = records.read_provenance(repo)
    own = targets.get(prov.build.target).verify_entry
    if own is not None:  # a target with servers of its own (vLLM's OpenAI server and Triton's vLLM model)
        return targets.resolve_entry(own)(repo, prov, out_dir=out_dir, prompts=prompts, max_tokens=max_tokens,
                                          concurrent=concurrent, frontends=vllm_frontends)
    names = model_names(prov.model_name)
    version, target = prov.version, prov.build.target
    engine = targets.get(target)
    tokenizer = AutoTokenizer.from_pretrained(str(repo / names.preprocessing / str(version) / artifacts.TOKENIZER_DIR))
    prompt_ids = [tokenizer(p).input_ids for p in prompts]

    t0 = time.perf_counter()
    expected = Expected(_bundle_in(repo, names, version), prompt_ids, max_tokens)
    if engine.reference_runtime:
        expected.compute()
    reference_s = time.perf_counter() - t0

    server = server_for_target(target, repo, log_path=out_dir / artifacts.SERVER_LOG_FILE)
    v, died = triton_checks(server, repo, names=names, tokenizer=tokenizer, prompts=list(prompts), expected=expected,
                            max_tokens=max_tokens, concurrent=concurrent, target=target)
    startup_s = server.startup_s
    failed = [c.name for c in v.checks if not c.ok]
    latency = latency_summary(v.latency_ms)
    results = records.VerifyResults(
        ok=not failed, model_name=names.ensemble, version=version, target=target,
        server={"startup_s": startup_s, "binary": "image tritonserver" if engine.gpu_only
                else "nvidia-pytriton tritonserver", "log": artifacts.SERVER_LOG_FILE},
        reference=("the CPU runtime on the repository's own bundle, each prompt alone" if engine.reference_runtime
                   else "none (GPU target: answers are checked for agreement only)"),
        reference_s=round(reference_s, 1), prompts=list(prompts), max_tokens=max_tokens, latency=latency,
        checks=[c.as_dict() for c in v.checks])
    records.write_verify_results(out_dir, results)
    if died is not None:
        from pipeline.serving.server import log_tail

        raise StageFailed(f"verify: tritonserver died during the checks (exit code {died}); {len(failed)} check(s) "
                          f"failed after it: {', '.join(failed) or 'none'}. A server failure, not a wrong answer. "
                          f"Last lines of its log ({artifacts.SERVER_LOG_FILE}):\n"
                          f"{log_tail(out_dir / artifacts.SERVER_LOG_FILE)}")
    if failed:
        from pipeline.serving.server import log_tail

        log.error("the server's log (%s), last lines:\n%s", artifacts.SERVER_LOG_FILE,
                  log_tail(out_dir / artifacts.SERVER_LOG_FILE))
        raise StageFailed(f"verify: {len(failed)} check(s) failed: {', '.join(failed)}. Every check's answers "
                          f"are in the stage log, with the end of the server's log.")
    diverged = [r for c in v.checks for r in c.detail.get("results", []) if r.get("equal") is False]
    return {"checks": len(v.checks), "all_ok": True, "server_startup_s": startup_s,
            "tie_divergences": len(diverged), "latency": latency}
