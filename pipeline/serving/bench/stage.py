"""bench stage: drive the published model on a real Triton server over a concurrency sweep.

The load is closed-loop: at concurrency ``c``, ``c`` clients each send one streaming request to the
decoupled ``M_stream`` model over a gRPC stream (tritonclient's asyncio client, one stream per request),
wait for its last token, and send the next, until ``bench.requests_per_level`` requests are done. Prompts are
windows of ``bench.prompt_tokens`` tokens of the evaluation text (the text stage's held-out samples), each
request a different window; with ``bench.ignore_eos`` every request generates exactly
``bench.output_tokens`` tokens (``end_id`` -1), as LLM benchmarks do, so levels are comparable.

Per level (client side): output tokens/s and requests/s over the level's wall time; time to first token
(TTFT), inter-token latency (ITL = (end-to-end - TTFT) / (tokens - 1), per request) and end-to-end latency
at P50/P90/P99, P99/P50, jitter (std / mean); the padding factor where the build says how batches are padded.
Server side: Triton's own counters from its metrics endpoint, read before and after each level (queue and
compute time per request, per model, and the server's first-response time of the streaming model).

The knee: the lowest level past which throughput gains less than ``bench.knee_min_gain`` per doubling of
concurrency, i.e. where added concurrency stops paying and only adds latency.

Comparison mode (``bench.compare_repository``): a second published repository gets its own server, and
the two are swept level by level, alternating which goes first, so drifting machine load hits both alike;
the results carry this build / baseline ratios.

Why a client of our own: ``perf_analyzer`` (the maintained tool, and what genai-perf drives) is not in
current tritonclient wheels; the one in tritonclient 2.51's wheel runs here with two extra libraries
(libb64, libcudart) and is used to cross-check this client (tests/test_bench.py), not as the stage's tool.
aiperf speaks OpenAI-style HTTP endpoints, which the Triton 2.51 binary of nvidia-pytriton does not serve.

Outputs: ``bench_results.json``, ``throughput_vs_concurrency.png``, ``latency_vs_concurrency.png`` and the
servers' logs.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Sequence

import numpy as np

from pipeline.errors import InputError, StageFailed

log = logging.getLogger(__name__)

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_PNG = "latency_vs_concurrency.png"
BASELINE_SERVER_LOG = "tritonserver_baseline.log"
PERCENTILES = (50, 90, 99)
# Triton's per-model counters (cumulative since the server started; a level's figure is the difference)
TRITON_COUNTERS = ("nv_inference_request_success", "nv_inference_request_failure", "nv_inference_count",
                   "nv_inference_exec_count", "nv_inference_request_duration_us", "nv_inference_queue_duration_us",
                   "nv_inference_compute_input_duration_us", "nv_inference_compute_infer_duration_us",
                   "nv_inference_compute_output_duration_us", "nv_inference_first_response_histogram_ms_sum",
                   "nv_inference_first_response_histogram_ms_count")
# the server's own time to first response of decoupled models, where the server reports it (the Triton
# images do; nvidia-pytriton's 2.51 reports none for Python-backend models, and the figure is then absent)
METRICS_ARGS = ("--metrics-config=histogram_latencies=true",)


# ---------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile with linear interpolation between order statistics (numpy's default method)."""
    if not len(values):
        raise ValueError("percentile of no values")
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def summarize(values: Sequence[float]) -> dict:
    """n, mean, std, min, max, P50/P90/P99, P99/P50 and jitter (std / mean; population std)."""
    if not len(values):
        return {"n": 0}
    x = np.asarray(values, dtype=np.float64)
    mean, std = float(x.mean()), float(x.std())
    out = {"n": int(x.size), "mean": mean, "std": std, "min": float(x.min()), "max": float(x.max())}
    for q in PERCENTILES:
        out[f"p{q}"] = percentile(x, q)
    out["p99_over_p50"] = out["p99"] / out["p50"] if out["p50"] > 0 else None
    out["jitter"] = std / mean if mean > 0 else None
    return out


def find_knee(concurrency: Sequence[int], throughput: Sequence[float], min_gain: float) -> dict:
    """Where added concurrency stops paying: the first level whose next level gains < min_gain per doubling.

    The gain from level c1 to c2 is normalised per doubling, (t2 / t1) ** (1 / log2(c2 / c1)) - 1, so sweeps
    with uneven steps are judged alike. No such level: the knee is not inside the sweep (``found`` false;
    ``concurrency`` is then the highest level, where throughput was still rising).
    """
    if len(concurrency) != len(throughput) or not concurrency:
        raise ValueError("one throughput per concurrency level")
    gains = []
    for (c1, t1), (c2, t2) in zip(zip(concurrency, throughput), zip(concurrency[1:], throughput[1:])):
        gain = (t2 / t1) ** (1.0 / math.log2(c2 / c1)) - 1.0 if t1 > 0 else float("inf")
        gains.append({"from": c1, "to": c2, "gain_per_doubling": gain})
    for i, g in enumerate(gains):
        if g["gain_per_doubling"] < min_gain:
            return {"found": True, "concurrency": concurrency[i], "throughput": throughput[i],
                    "next_gain_per_doubling": g["gain_per_doubling"], "min_gain": min_gain, "gains": gains}
    return {"found": False, "concurrency": concurrency[-1], "throughput": throughput[-1],
            "next_gain_per_doubling": None, "min_gain": min_gain, "gains": gains}


def knee_sentence(knee: dict, levels: list[dict]) -> str:
    by_c = {l["concurrency"]: l for l in levels}
    first, top = levels[0], max(levels, key=lambda l: l["output_tokens_per_s"])
    rise = (f"throughput rises from {first['output_tokens_per_s']:.1f} output tokens/s at concurrency "
            f"{first['concurrency']} to {top['output_tokens_per_s']:.1f} at {top['concurrency']}")
    if not knee["found"]:
        return (f"{rise}, and was still rising at the highest level ({knee['concurrency']}): the knee is beyond "
                f"this sweep; add higher bench.concurrency levels to find it.")
    c = knee["concurrency"]
    nxt = next(g for g in knee["gains"] if g["from"] == c)["to"]
    lat = by_c[nxt]["e2e_ms"]["p50"] / by_c[c]["e2e_ms"]["p50"]
    return (f"{rise}; past concurrency {c} it gains {knee['next_gain_per_doubling'] * 100:.0f}% per doubling "
            f"(below {knee['min_gain'] * 100:.0f}%) while median end-to-end latency grows {lat:.2f}x: the knee is "
            f"at concurrency {c}.")


def padding_factor(settings: Optional[dict], concurrency: int) -> dict:
    """Useful batch slots / processed batch slots in a decode step, where the build says how batches pad."""
    if not settings:
        return {"value": None, "basis": "unknown: no build settings for this repository"}
    live = min(concurrency, int(settings["max_batch_size"]))
    if settings["target"] == "cpu":
        return {"value": 1.0, "basis": "cpu runtime: prompts are prefilled one at a time, unpadded, and each decode "
                                       "step runs exactly the live sequences (attention's K/V padding to the "
                                       "longest sequence is inside the runtime and not counted)"}
    graphs = settings.get("cuda_graphs") or {}
    if graphs.get("enabled") and graphs.get("enable_padding"):
        sizes = sorted(graphs.get("batch_sizes") or [])
        padded = next((s for s in sizes if s >= live), live)
        return {"value": live / padded, "basis": f"CUDA graphs pad a decode batch of {live} to the captured size "
                                                 f"{padded} (batch_sizes {sizes})"}
    return {"value": 1.0, "basis": "no CUDA-graph padding: decode batches are the live sequences"}


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
        for (t0, _), (t1, n) in zip(self.arrivals, self.arrivals[1:]):
            out += [(t1 - t0) * 1e3 / n] * n
        return out


def _stream_inputs(text: str, max_tokens: int, end_id: Optional[int]) -> list:
    import tritonclient.grpc as grpcclient

    arrays = [("text_input", np.array([[text.encode()]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[max_tokens]], dtype=np.int32), "INT32")]
    if end_id is not None:
        arrays.append(("end_id", np.array([[end_id]], dtype=np.int32), "INT32"))
    out = []
    for name, arr, dt in arrays:
        t = grpcclient.InferInput(name, list(arr.shape), dt)
        t.set_data_from_numpy(arr)
        out.append(t)
    return out


async def _one_request(client, model: str, prompt: Prompt, max_tokens: int, end_id: Optional[int],
                       timeout_s: float) -> RequestRecord:
    """One request on its own gRPC stream; the stream ends after the request's final response."""
    inputs = _stream_inputs(prompt.text, max_tokens, end_id)

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
    if rec.error is None and not rec.arrivals:
        rec.error = "the stream ended without a token"
    return rec


async def _drive(grpc_url: str, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int,
                 end_id: Optional[int], timeout_s: float) -> tuple[list[RequestRecord], float]:
    import tritonclient.grpc.aio as grpcaio

    client = grpcaio.InferenceServerClient(grpc_url)
    todo = iter(prompts)  # shared: each client takes the next prompt when its request is done
    records: list[RequestRecord] = []

    async def one_client():
        for prompt in todo:
            records.append(await _one_request(client, model, prompt, max_tokens, end_id, timeout_s))

    t0 = time.perf_counter()
    try:
        await asyncio.gather(*(one_client() for _ in range(concurrency)))
    finally:
        wall = time.perf_counter() - t0
        await client.close()
    return records, wall


def drive(grpc_url: str, model: str, prompts: list[Prompt], concurrency: int, max_tokens: int,
          end_id: Optional[int] = -1, timeout_s: float = 300.0) -> tuple[list[RequestRecord], float]:
    """Send every prompt with ``concurrency`` requests in flight; (records in completion order, wall seconds)."""
    return asyncio.run(_drive(grpc_url, model, prompts, concurrency, max_tokens, end_id, timeout_s))


def level_figures(records: list[RequestRecord], wall_s: float, concurrency: int) -> dict:
    """The client-side figures of one level."""
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
    }


# ---------------------------------------------------------------- Triton's metrics


_METRIC_LINE = re.compile(r"^([a-z_]+)\{([^}]*)\}\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_metrics(text: str) -> dict[tuple[str, str], float]:
    """{(metric, model): value} for Triton's per-model counters (summed over versions)."""
    out: dict[tuple[str, str], float] = {}
    for line in text.splitlines():
        m = _METRIC_LINE.match(line.strip())
        if not m or m.group(1) not in TRITON_COUNTERS:
            continue
        labels = dict(_LABEL.findall(m.group(2)))
        if "model" not in labels:
            continue
        key = (m.group(1), labels["model"])
        out[key] = out.get(key, 0.0) + float(m.group(3))
    return out


def scrape_metrics(url: Optional[str]) -> Optional[dict[tuple[str, str], float]]:
    if url is None:
        return None
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return parse_metrics(r.read().decode(errors="replace"))
    except (urllib.error.URLError, OSError) as e:
        log.warning("could not read Triton's metrics at %s: %s", url, e)
        return None


def metrics_delta(before: Optional[dict], after: Optional[dict], models: Sequence[str]) -> Optional[dict]:
    """Per model, what the level added: requests, executions, average batch, queue/compute ms per request."""
    if before is None or after is None:
        return None
    out = {}
    for model in models:
        d = {k: after.get((k, model), 0.0) - before.get((k, model), 0.0) for k in TRITON_COUNTERS}
        n = d["nv_inference_request_success"]
        if n <= 0:
            continue
        per = lambda k: d[k] / n / 1e3  # noqa: E731 - microseconds per request -> ms
        fig = {
            "requests": int(n),
            "failures": int(d["nv_inference_request_failure"]),
            "executions": int(d["nv_inference_exec_count"]),
            "avg_batch_size": d["nv_inference_count"] / d["nv_inference_exec_count"]
            if d["nv_inference_exec_count"] else None,
            "request_ms": per("nv_inference_request_duration_us"),
            "queue_ms": per("nv_inference_queue_duration_us"),
            "compute_input_ms": per("nv_inference_compute_input_duration_us"),
            "compute_infer_ms": per("nv_inference_compute_infer_duration_us"),
            "compute_output_ms": per("nv_inference_compute_output_duration_us"),
        }
        if d["nv_inference_first_response_histogram_ms_count"] > 0:
            fig["first_response_ms"] = (d["nv_inference_first_response_histogram_ms_sum"]
                                        / d["nv_inference_first_response_histogram_ms_count"])
        out[model] = fig
    return out


# ---------------------------------------------------------------- one published build under load


@dataclass
class Target:
    """A published repository being benchmarked, and the server answering for it."""

    label: str  # "this build" / "baseline"
    repository: Path
    provenance: dict
    settings: Optional[dict]  # build_settings.json, when known
    grpc_url: str = ""
    metrics_url: Optional[str] = None
    server: object = None
    levels: list[dict] = field(default_factory=list)

    @property
    def names(self):
        from pipeline.serving.publish import model_names

        return model_names(self.provenance["model_name"])


def read_repository(path: Path) -> tuple[Path, dict]:
    """A published repository, given it or the work dir that holds it: (repository, its provenance)."""
    from pipeline import artifacts

    for candidate in (path, path / "publish" / artifacts.MODEL_REPOSITORY_DIR, path / artifacts.MODEL_REPOSITORY_DIR):
        if (candidate / artifacts.PROVENANCE_FILE).is_file():
            try:
                return candidate, json.loads((candidate / artifacts.PROVENANCE_FILE).read_text())
            except ValueError:
                break
    raise InputError(f"{path} is not a published model repository (no readable provenance.json there or in "
                     f"publish/model_repository under it); run `invoke publish` for that build first")


def _settings_near(repository: Path) -> Optional[dict]:
    """build_settings.json of the work dir a repository was published from (<work>/publish/model_repository)."""
    p = repository.parent.parent / "build" / "build_settings.json"
    try:
        return json.loads(p.read_text())
    except (OSError, ValueError):
        return None


def _warm_up(target: Target, prompts: list[Prompt], concurrency: int, cfg) -> None:
    if not prompts:
        return
    records, wall = drive(target.grpc_url, target.names.stream, prompts, concurrency, cfg.output_tokens,
                          -1 if cfg.ignore_eos else None, cfg.request_timeout_s)
    _raise_on_errors(target, records, "warm-up")
    log.info("%s: warm-up of %d request(s) in %.1f s", target.label, len(records), wall)


def _raise_on_errors(target: Target, records: list[RequestRecord], what: str) -> None:
    failed = [r.error for r in records if r.error is not None]
    if failed:
        raise StageFailed(f"bench ({target.label}, {what}): {len(failed)} of {len(records)} request(s) failed; "
                          f"first error: {failed[0]}. The server's log is kept beside the stage log.")


def run_level(target: Target, prompts: list[Prompt], concurrency: int, cfg) -> dict:
    models = target.names.all()
    before = scrape_metrics(target.metrics_url)
    records, wall = drive(target.grpc_url, target.names.stream, prompts, concurrency, cfg.output_tokens,
                          -1 if cfg.ignore_eos else None, cfg.request_timeout_s)
    after = scrape_metrics(target.metrics_url)
    _raise_on_errors(target, records, f"concurrency {concurrency}")
    fig = level_figures(records, wall, concurrency)
    fig["padding_factor"] = padding_factor(target.settings, concurrency)
    fig["triton"] = metrics_delta(before, after, models)
    log.info("%s c=%d: %.1f tok/s, %.2f req/s, TTFT p50 %.0f ms, ITL p50 %.1f ms, e2e p50/p99 %.0f/%.0f ms",
             target.label, concurrency, fig["output_tokens_per_s"], fig["requests_per_s"], fig["ttft_ms"]["p50"],
             fig["itl_ms"].get("p50", float("nan")), fig["e2e_ms"]["p50"], fig["e2e_ms"]["p99"])
    return fig


def _check_lengths(cfg, settings: Optional[dict], label: str) -> None:
    if not settings:
        return
    if cfg.prompt_tokens > settings["max_input_len"] or cfg.prompt_tokens + cfg.output_tokens > settings["max_seq_len"]:
        raise InputError(
            f"bench.prompt_tokens {cfg.prompt_tokens} + output_tokens {cfg.output_tokens} do not fit {label}'s "
            f"limits (max_input_len {settings['max_input_len']}, max_seq_len {settings['max_seq_len']}); lower them"
        )


def _check_served(target: Target) -> None:
    """An existing server must serve the published version of every model this build publishes."""
    import tritonclient.grpc as grpcclient

    version = str(target.provenance["version"])
    client = grpcclient.InferenceServerClient(target.grpc_url)
    try:
        missing = [m for m in target.names.all() if not client.is_model_ready(m, version)]
    except Exception as e:  # noqa: BLE001 - any failure to ask is a server we cannot use
        raise InputError(f"bench.grpc_url {target.grpc_url}: cannot ask the server which models are ready ({e}); "
                         f"check the address, or drop bench.grpc_url to start a server here") from None
    finally:
        client.close()
    if missing:
        raise InputError(f"the server at bench.grpc_url {target.grpc_url} does not serve version {version} (the "
                         f"published one) of {', '.join(sorted(set(missing)))}; load that repository there, or "
                         f"drop bench.grpc_url to start a server on it here")


# ---------------------------------------------------------------- plots


def plot_throughput(targets: list[Target], knees: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for t, style, color in zip(targets, ("-", "--"), ("#1f77b4", "#7f7f7f")):
        c = [l["concurrency"] for l in t.levels]
        ax.plot(c, [l["output_tokens_per_s"] for l in t.levels], "o" + style, color=color, label=t.label)
        ax2.plot(c, [l["requests_per_s"] for l in t.levels], "s" + style, color=color, label=t.label)
        knee = knees[t.label]
        if knee["found"]:
            ax.axvline(knee["concurrency"], color="#2ca02c", linestyle=style, alpha=0.6)
            ax.annotate(f"knee ({t.label}): c={knee['concurrency']}", (knee["concurrency"], knee["throughput"]),
                        textcoords="offset points", xytext=(6, -14), fontsize=8, color="#2ca02c")
    for a, title in ((ax, "output tokens/s"), (ax2, "requests/s")):
        levels = [l["concurrency"] for l in targets[0].levels]
        a.set_xscale("log", base=2)
        a.set_xticks(levels, [str(x) for x in levels])
        a.set_xlabel("concurrency (requests in flight)")
        a.set_title(f"{title} vs concurrency (streaming, closed loop)", fontsize=10)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(targets: list[Target], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
               ("e2e_ms", "end-to-end latency (ms)"))
    colors = {50: "#1f77b4", 90: "#ff7f0e", 99: "#d62728"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (key, title) in zip(axes, metrics):
        for t, style in zip(targets, ("-", "--")):
            c = [l["concurrency"] for l in t.levels]
            for q in PERCENTILES:
                ax.plot(c, [l[key].get(f"p{q}", float("nan")) for l in t.levels], "o" + style, color=colors[q],
                        markersize=4, label=f"P{q}" + (f" ({t.label})" if len(targets) > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- the stage


def _ratios(this: list[dict], base: list[dict]) -> list[dict]:
    def r(a, b):
        return a / b if a is not None and b else None

    out = []
    for a, b in zip(this, base):
        out.append({
            "concurrency": a["concurrency"],
            "output_tokens_per_s": r(a["output_tokens_per_s"], b["output_tokens_per_s"]),
            "requests_per_s": r(a["requests_per_s"], b["requests_per_s"]),
            "ttft_p50": r(a["ttft_ms"].get("p50"), b["ttft_ms"].get("p50")),
            "itl_p50": r(a["itl_ms"].get("p50"), b["itl_ms"].get("p50")),
            "e2e_p50": r(a["e2e_ms"].get("p50"), b["e2e_ms"].get("p50")),
            "e2e_p99": r(a["e2e_ms"].get("p99"), b["e2e_ms"].get("p99")),
        })
    return out


def _describe(t: Target) -> dict:
    p = t.provenance
    return {"label": t.label, "repository": str(t.repository), "config_name": p.get("config_name"),
            "model_name": p.get("model_name"), "version": p.get("version"), "quantization": p.get("quantization"),
            "target": (p.get("build") or {}).get("target"), "repository_digest": p.get("repository_digest"),
            "server": "started by bench" if t.server is not None else f"existing server at {t.grpc_url}"}


def run_bench(config, publish_dir: Path, samples_file: Path, build_dir: Optional[Path], out_dir: Path) -> dict:
    """The bench stage: sweep this build (and the comparison baseline, if configured); write results and plots."""
    from transformers import AutoTokenizer

    from pipeline import artifacts
    from pipeline.serving.server import server_for_target

    cfg = config.bench
    repo, prov = read_repository(publish_dir / artifacts.MODEL_REPOSITORY_DIR)
    settings = None
    if build_dir is not None and (build_dir / "build_settings.json").is_file():
        settings = json.loads((build_dir / "build_settings.json").read_text())
    targets = [Target("this build", repo, prov, settings)]
    if cfg.compare_repository is not None:
        base_repo, base_prov = read_repository(cfg.compare_repository)
        if base_prov.get("repository_digest") == prov.get("repository_digest"):
            raise InputError(f"bench.compare_repository {base_repo} is this very build (same repository digest); "
                             f"point it at another build's published repository")
        targets.append(Target("baseline", base_repo, base_prov, _settings_near(base_repo)))
    for t in targets:
        _check_lengths(cfg, t.settings, t.label)
        if not config.triton.decoupled and t is targets[0]:
            raise InputError("bench drives the streaming model, which needs triton.decoupled: true")

    names = targets[0].names
    tokenizer = AutoTokenizer.from_pretrained(str(repo / names.preprocessing / str(prov["version"]) / artifacts.TOKENIZER_DIR))
    levels = list(cfg.concurrency)
    warm_n = cfg.warmup_requests
    prompts = make_prompts(samples_file, tokenizer, cfg.prompt_tokens, warm_n + cfg.requests_per_level * len(levels))
    warm, measured = prompts[:warm_n], prompts[warm_n:]

    t_start = time.perf_counter()
    started = []
    try:
        for i, t in enumerate(targets):
            if i == 0 and cfg.grpc_url is not None:
                t.grpc_url, t.metrics_url = cfg.grpc_url, cfg.metrics_url
                _check_served(t)
                continue
            log_name = artifacts.SERVER_LOG_FILE if i == 0 else BASELINE_SERVER_LOG
            server = server_for_target(t.provenance["build"]["target"], t.repository, log_path=out_dir / log_name,
                                       extra_args=METRICS_ARGS)
            server.start()
            started.append(server)
            t.server, t.grpc_url, t.metrics_url = server, server.grpc_url, server.metrics_url
        for t in targets:
            _warm_up(t, warm, min(len(warm), levels[-1]), cfg)
        for k, c in enumerate(levels):
            batch = measured[k * cfg.requests_per_level:(k + 1) * cfg.requests_per_level]
            order = targets if k % 2 == 0 else list(reversed(targets))  # alternate who goes first
            for t in order:
                t.levels.append(run_level(t, batch, c, cfg))
    finally:
        for server in started:
            server.stop()
    bench_s = time.perf_counter() - t_start

    knees = {t.label: find_knee(levels, [l["output_tokens_per_s"] for l in t.levels], cfg.knee_min_gain)
             for t in targets}
    for t in targets:
        log.info("%s: %s", t.label, knee_sentence(knees[t.label], t.levels))
    plot_throughput(targets, knees, out_dir / THROUGHPUT_PNG)
    plot_latency(targets, out_dir / LATENCY_PNG)

    main = targets[0]
    results = {
        "format_version": 1,
        "tool": "pipeline.bench: tritonclient asyncio gRPC streams, closed loop",
        "settings": {**cfg.model_dump(mode="json"), "model": names.stream,
                     "end_id": -1 if cfg.ignore_eos else "the model's EOS"},
        "definitions": {
            "output_tokens_per_s": "tokens received by all requests of the level / the level's wall time",
            "ttft_ms": "request sent -> first response carrying a token",
            "itl_ms": "per request: (end-to-end - TTFT) / (output tokens - 1)",
            "e2e_ms": "request sent -> last token received",
            "jitter": "standard deviation / mean",
            "token_gap_ms": "time between consecutive responses, per token they carried, over all requests",
            "triton": "Triton's per-model counters, after the level minus before, per successful request; the "
                      "decoupled models return from execute at once, so their compute time is not generation time",
            "knee": f"the first level past which throughput gains < {cfg.knee_min_gain:.0%} per doubling",
        },
        "bench_s": bench_s,
        "targets": [{**_describe(t), "levels": t.levels, "knee": knees[t.label],
                     "knee_sentence": knee_sentence(knees[t.label], t.levels)} for t in targets],
    }
    if len(targets) == 2:
        results["comparison"] = {"ratio": "this build / baseline", "levels": _ratios(targets[0].levels,
                                                                                      targets[1].levels)}
    (out_dir / artifacts.BENCH_RESULTS_FILE).write_text(json.dumps(results, indent=2) + "\n")

    top = max(main.levels, key=lambda l: l["output_tokens_per_s"])
    summary = {
        "levels": [{"concurrency": l["concurrency"], "output_tokens_per_s": round(l["output_tokens_per_s"], 2),
                    "requests_per_s": round(l["requests_per_s"], 3), "ttft_p50_ms": round(l["ttft_ms"]["p50"], 1),
                    "itl_p50_ms": round(l["itl_ms"]["p50"], 2) if l["itl_ms"].get("p50") is not None else None,
                    "e2e_p50_ms": round(l["e2e_ms"]["p50"], 1), "e2e_p99_ms": round(l["e2e_ms"]["p99"], 1)}
                   for l in main.levels],
        "peak_output_tokens_per_s": round(top["output_tokens_per_s"], 2),
        "peak_at_concurrency": top["concurrency"],
        "knee_concurrency": knees[main.label]["concurrency"] if knees[main.label]["found"] else None,
        "knee": knee_sentence(knees[main.label], main.levels),
        "repository_digest": prov.get("repository_digest"),
        "bench_s": round(bench_s, 1),
    }
    if len(targets) == 2:
        comp = results["comparison"]["levels"]
        summary["comparison"] = {
            "baseline": _describe(targets[1]),
            "output_tokens_per_s_ratio": [round(x["output_tokens_per_s"], 3) for x in comp],
            "e2e_p50_ratio": [round(x["e2e_p50"], 3) for x in comp],
        }
    return summary


def compare_fingerprint(cfg) -> dict:
    """The bench stage's outside input: the comparison baseline's published content (its repository digest)."""
    if cfg.compare_repository is None:
        return {}
    repo, prov = read_repository(cfg.compare_repository)
    return {"compare_repository": str(repo), "compare_repository_digest": prov.get("repository_digest")}
