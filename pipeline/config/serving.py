"""The serving sections: ``triton`` (the served model and how its runtime batches), ``verify``, ``sla``, ``bench``,
``tune`` and ``optimize``. Which target reads which ``triton`` key is held in :mod:`pipeline.config.schema`."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import SafeName, Strict


class WatchdogSection(Strict):
    """The serving model's watchdog (triton_repo/common/llm_watchdog.py; cpu, pytorch and vllm targets: the
    tensorrt target's C++ backend has none, its liveness probe stands in): past a limit the model turns
    unready and stops its server, for the orchestrator (or `invoke serve --supervise`) to restart it.
    0 turns a signal off."""

    # failed requests (the engine raised; bad client input is not counted) in the last minute; 5: the seeds'
    # "more than 5 CUDA errors a minute"
    errors_per_minute: int = Field(5, ge=0)
    # the model process's resident memory growing faster than this over memory_window_s (1 MB/s: the seeds')
    memory_mb_per_s: float = Field(1.0, ge=0)
    memory_window_s: int = Field(300, ge=5, le=86400)


class TritonSection(Strict):
    model_name: SafeName = "llm"
    instance_count: int = Field(1, ge=1, le=64)
    max_queue_delay_us: int = Field(100, ge=0)
    decoupled: bool = True  # streaming responses (gRPC streams, generate_stream)
    keep_versions: int = Field(3, ge=1, le=100)
    server_url: Optional[str] = None  # if set, publish asks this server to reload the model
    # The live repository a server reads, where versions accumulate across publishes (an absolute path).
    # Default: <work dir>/model_repository. It cannot be the publish stage's own folder: the runner replaces
    # that folder on every run (the stage's publish/model_repository is a snapshot of the latest version).
    repository_dir: Optional[Path] = None
    # Where servers will see repository_dir (e.g. /models in a container): the tensorrtllm backend needs an
    # absolute engine path in its config. Default: repository_dir itself.
    serving_repository_path: Optional[str] = None
    overwrite: bool = False  # replace models in repository_dir that this pipeline did not write
    apply_chat_template: bool = False  # wrap prompts in the tokenizer's chat template unless a request says
    cpu_threads: int = Field(0, ge=0, le=1024)  # cpu target: torch threads in the server (0: torch's default)
    # The batch size adapts at run time. cpu target: the runtime keeps its step time (the gap between two tokens
    # of a sequence) at sla.p99_itl_ms (pipeline/engines/cpu_runtime.py AdaptiveBatchLimit). pytorch target:
    # TensorRT-LLM's own tuning (scheduler_config.dynamic_batch_config: batch size and max_num_tokens from
    # moving averages of the requests' lengths; pipeline/engines/trtllm/targets.py serving_llm_api_options).
    adaptive_batch: bool = False
    # At most this many sequences run at once (None: build.max_batch_size, the most it can be). cpu target: the
    # runtime's KV pool is sized for them; pytorch target: the LLM API's max_batch_size (CUDA graphs captured up
    # to it); vllm target: vLLM's max_num_seqs as served (publish writes it into the served engine record, for
    # both frontends). The tensorrt engine's limit is build.max_batch_size itself. `invoke tune` measures it.
    max_running: Optional[int] = Field(None, ge=1)
    # cpu target: prompt tokens the runtime prefills per scheduler step, between decode steps (chunked prefill,
    # as TensorRT-LLM's chunked context): a running sequence waits for one chunk between two of its tokens, not
    # for every newly admitted prompt whole (None: whole prompts)
    prefill_chunk_tokens: Optional[int] = Field(None, ge=1)
    # GPU targets (tensorrt, pytorch): the executor's capacity scheduler (None: guaranteed_no_evict, the
    # backend's default). max_utilization packs more sequences and may pause some when the KV cache fills.
    scheduler_policy: Optional[Literal["guaranteed_no_evict", "max_utilization"]] = None
    # GPU targets: the share of free GPU memory given to the KV cache at load (None: build.kv_cache's).
    kv_cache_free_gpu_memory_fraction: Optional[float] = Field(None, gt=0, le=1)
    # cpu and vllm targets: request classes. Levels 1..N, 1 the highest (Triton's priority levels); a request's
    # optional `priority` input picks one (none or 0: default_priority_level, else the lowest). The runtime
    # takes waiting requests by level, first come first served within one (cpu: admission and prefill order;
    # vllm: its priority scheduling policy, through Triton); Triton's own queues take the same levels from a
    # request's priority parameter. None: one class.
    priority_levels: Optional[int] = Field(None, ge=2, le=16)
    default_priority_level: Optional[int] = Field(None, ge=1)
    watchdog: WatchdogSection = WatchdogSection()

    @field_validator("repository_dir")
    @classmethod
    def _absolute_dir(cls, v: Optional[Path]) -> Optional[Path]:
        if v is not None and not v.expanduser().is_absolute():
            raise ValueError("must be an absolute path (the repository a server reads), e.g. /srv/triton/models")
        return v.expanduser() if v is not None else None

    @field_validator("serving_repository_path")
    @classmethod
    def _absolute_path(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not v.startswith("/"):
            raise ValueError("must be an absolute path as the server sees it, e.g. /models")
        return v

    @field_validator("server_url")
    @classmethod
    def _url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^(https?://)?[A-Za-z0-9.\-\[\]:]+(:\d+)?/?$", v):
            raise ValueError("must be the server's HTTP endpoint, e.g. http://127.0.0.1:8000")
        return v


class TenantSection(Strict):
    """One tenant of a shared deployment (the top-level ``tenants:`` list; pipeline/tenancy.py,
    docs/serving/tenants.md). cpu and vllm targets: its requests are admitted only while their KV blocks (prompt
    and max tokens, at full length) fit its share of the runtime's pool (the cpu runtime's, or vLLM's as it sized it,
    admitted by Triton's vLLM model or the tenant middleware on vLLM's OpenAI server); the tenant ``default``
    (requests naming none) takes the blocks no tenant has."""

    name: SafeName  # as requests name it (their tenant input, the x-tenant header, or OpenAI's user field)
    kv_share: Optional[float] = Field(None, gt=0, le=1)  # a fraction of the KV pool's blocks
    kv_blocks: Optional[int] = Field(None, ge=1)  # or a count of them (cpu target: vLLM sizes its pool at start)
    priority_level: Optional[int] = Field(None, ge=1)  # its request class (triton.priority_levels), when it sends none
    max_concurrency: Optional[int] = Field(None, ge=1)  # requests in flight (waiting or running); more are refused
    tokens_per_minute: Optional[int] = Field(None, ge=1)  # prompt plus max tokens, a bucket of one minute's

    @model_validator(mode="after")
    def _one_share(self) -> "TenantSection":
        if (self.kv_share is None) == (self.kv_blocks is None):
            raise ValueError(f"tenant {self.name}: give exactly one of kv_share (a fraction of the KV pool) and "
                             f"kv_blocks (a block count)")
        return self


class VerifySection(Strict):
    """`invoke verify` (pipeline/serving/verify.py): how much each check asks of the server."""

    max_tokens: int = Field(16, ge=1, le=256)  # greedy tokens per prompt, in every check
    # sent at once in the concurrency check (more than build.max_batch_size also tests the queue)
    concurrent_requests: int = Field(16, ge=1, le=256)


class SlaSection(Strict):
    """The latency a deployment must keep, as P99 bounds in milliseconds (unset: no bound). It applies to the
    bench's request mix (bench.prompt_tokens, bench.output_tokens): bench reports goodput against it."""

    p99_e2e_ms: Optional[float] = Field(None, gt=0)  # request sent -> last token
    p99_ttft_ms: Optional[float] = Field(None, gt=0)  # request sent -> first token
    p99_itl_ms: Optional[float] = Field(None, gt=0)  # per request: (e2e - TTFT) / (output tokens - 1)

    def bounds(self) -> dict[str, float]:
        """{metric (e2e_ms, ttft_ms, itl_ms): bound} for the bounds that are set."""
        return {k[len("p99_"):]: v for k, v in self.model_dump().items() if v is not None}


class BenchSection(Strict):
    """`invoke bench` (pipeline/serving/bench/): a closed-loop concurrency sweep over the streaming model."""

    concurrency: tuple[int, ...] = (1, 2, 4, 8)
    requests_per_level: int = Field(32, ge=1)  # measured requests per level, after the warm-up
    warmup_requests: int = Field(4, ge=0)  # sent once per server before the sweep, not measured
    prompt_tokens: int = Field(64, ge=1)  # each prompt: this many tokens of the evaluation text
    output_tokens: int = Field(64, ge=1)
    # every request generates exactly output_tokens (end_id -1, as LLM benchmarks do); false: stop at EOS
    ignore_eos: bool = True
    # more concurrency "stops paying" where throughput gains less than this per doubling: the knee
    knee_min_gain: float = Field(0.10, gt=0, lt=1)
    request_timeout_s: float = Field(300.0, gt=0)
    # drive a running server instead of starting one on the published repository: its gRPC endpoint
    # (host:port) and, for Triton's own queue and compute times, its metrics URL (http://host:port/metrics)
    grpc_url: Optional[str] = None
    metrics_url: Optional[str] = None
    # comparison mode: a second published repository (absolute; e.g. an unquantized baseline's
    # <work root>/<name>/publish/model_repository, or that work dir), swept in the same run as this build
    # (bench.servers says how the two take turns); the results carry this/baseline ratios
    compare_repository: Optional[Path] = None
    # open-loop load after the sweep (pipeline/serving/bench/openloop.py): requests arriving at each of these
    # rates (requests/s, Poisson arrivals; requests_per_level each), driven by NVIDIA's aiperf from
    # .venv-aiperf; the highest rate sustained under the SLA. Empty: none.
    request_rates: tuple[float, ...] = ()
    # the sweep measured this many times (rounds, each walking every level); a level reports the median over
    # rounds of each figure, with the spread of throughput and P99 end-to-end latency (noise made visible)
    repeats: int = Field(1, ge=1)
    # how the servers of a run with more than one target (a vllm build's two frontends, a compare_repository) are
    # up: "alone", one at a time (each round of the sweep starts each target's server in turn, the order reversed
    # from round to round), so no target's figures carry another's idle engine on the same cores or GPU;
    # "together", all up for the whole run and the levels interleaved (drift between levels hits all alike, but
    # the servers share the host: on 2 CPU cores an idle vLLM engine beside Triton made its TTFT 4-7x). The same
    # for invoke tune's A/B and invoke optimize's side-by-side rounds
    servers: Literal["alone", "together"] = "alone"
    # one of the concurrency levels: after the sweep, aiperf drives the same closed loop at it on every target,
    # and the results set its figures beside our client's (a cross-check of the client). None: no cross-check
    cross_check_concurrency: Optional[int] = None

    @property
    def uses_aiperf(self) -> bool:
        """Whether the stage runs aiperf (open-loop rates or the cross-check): it must be installed."""
        return bool(self.request_rates) or self.cross_check_concurrency is not None

    @field_validator("concurrency")
    @classmethod
    def _levels(cls, v: tuple[int, ...]) -> tuple[int, ...]:
        if not v or list(v) != sorted(set(v)) or v[0] < 1:
            raise ValueError("must be positive, unique and ascending, e.g. [1, 2, 4, 8]")
        return v

    @field_validator("request_rates")
    @classmethod
    def _rates(cls, v: tuple[float, ...]) -> tuple[float, ...]:
        if v and (list(v) != sorted(set(v)) or v[0] <= 0):
            raise ValueError("must be positive, unique and ascending requests per second, e.g. [0.5, 1, 2]")
        return v

    @field_validator("grpc_url")
    @classmethod
    def _grpc_url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^[A-Za-z0-9.\-\[\]:]+:\d+$", v):
            raise ValueError("must be the server's gRPC endpoint as host:port, e.g. 127.0.0.1:8001")
        return v

    @field_validator("metrics_url")
    @classmethod
    def _metrics_url(cls, v: Optional[str]) -> Optional[str]:
        if v is not None and not re.match(r"^https?://[A-Za-z0-9.\-\[\]:]+(:\d+)?(/[A-Za-z0-9_./-]*)?$", v):
            raise ValueError("must be the server's metrics URL, e.g. http://127.0.0.1:8002/metrics")
        return v

    @field_validator("compare_repository")
    @classmethod
    def _absolute_compare(cls, v: Optional[Path]) -> Optional[Path]:
        if v is not None and not v.expanduser().is_absolute():
            raise ValueError("must be an absolute path: a published model repository or the work dir holding it")
        return v.expanduser() if v is not None else None

    @model_validator(mode="after")
    def _metrics_needs_url(self) -> "BenchSection":
        if self.metrics_url is not None and self.grpc_url is None:
            raise ValueError("metrics_url is only used with grpc_url (a started server's metrics are found by itself)")
        if self.request_rates and self.grpc_url is not None:
            raise ValueError("request_rates drives the HTTP endpoint of a server bench starts itself; with grpc_url "
                             "(a running server) leave request_rates empty")
        c = self.cross_check_concurrency
        if c is not None and c not in self.concurrency:
            raise ValueError(f"bench.cross_check_concurrency ({c}) must be one of bench.concurrency "
                             f"{list(self.concurrency)}: the cross-check sets aiperf beside our client's level")
        if c is not None and self.grpc_url is not None:
            raise ValueError("bench.cross_check_concurrency drives the HTTP endpoint of a server bench starts "
                             "itself; with grpc_url (a running server) leave it unset")
        return self


class TuneSection(Strict):
    """`invoke tune` (pipeline/serving/tune.py): the serving settings searched against the SLA on a real server."""

    # the load each setting is measured under, closed loop: this many requests in flight. None: twice the
    # highest bench.concurrency level, more clients than the server should run at once (where a limit matters)
    concurrency: Optional[int] = Field(None, ge=1, le=1024)
    # measured requests per point (after bench.warmup_requests per server); at least tune.concurrency
    requests: int = Field(32, ge=4)
    # a smaller limit is measured next only while the last one raised goodput by at least this fraction, and
    # a setting replaces the default only if it beats the default's goodput by it (noise is not a gain)
    min_gain: float = Field(0.05, ge=0, lt=1)
    # tuned vs default after the search, alternating which goes first, the servers up as bench.servers says (one
    # at a time by default); the medians over the rounds must confirm the choice (pipeline/serving/tune.py: confirm)
    ab_rounds: int = Field(3, ge=1, le=10)
    # cpu target, with sla.p99_itl_ms set: the chunked prefill (triton.prefill_chunk_tokens) the search tries,
    # alone and with the adaptive limit (null: not tried). 8 held SmolLM2's inter-token P99 within its bound
    # on 2 cores (README: scripts/bench_adaptive.py), at the cost of time to first token
    prefill_chunk_tokens: Optional[int] = Field(8, ge=1)
    apply: bool = True  # publish applies <work dir>/tune/tuned_settings.yaml where tune wrote one


# the config fields a candidate plan of `invoke optimize` may set: what changes the plan and the quantization.
# The accuracy floor (quantization.accuracy) is the same for every candidate: it is what they are judged by.
CANDIDATE_FIELDS = ("sensitivity.threshold", "plan.", "quantization.")
CANDIDATE_FIXED = ("quantization.accuracy",)


class OptimizeCandidate(Strict):
    """A plan `invoke optimize` builds, gates and measures: the config with these fields set."""

    # the candidate's name: its work dir is <work dir>/optimize/candidates/<name>/ ("seed" is the config's own)
    name: SafeName
    # dotted config fields and their values, as --set takes them, e.g. {sensitivity.threshold: 0.2} or
    # {quantization.weight_format: int8_wo}
    set: dict[str, Any] = {}

    @field_validator("set")
    @classmethod
    def _fields(cls, v: dict[str, Any]) -> dict[str, Any]:
        bad = [k for k in v if not k.startswith(CANDIDATE_FIELDS) or k.startswith(CANDIDATE_FIXED)]
        if bad:
            raise ValueError(f"a candidate sets only the plan's and the quantization's fields (sensitivity.threshold, "
                             f"plan.*, quantization.* but quantization.accuracy, the floor every candidate is judged "
                             f"by); not {', '.join(bad)}")
        return v


class OptimizeSection(Strict):
    """`invoke optimize` (pipeline/optimize.py): the plan and the serving settings chosen together, by measurement."""

    # the plans tried; none: the config's own plan ("seed"), its sensitivity.threshold halved and doubled, and
    # every layer in quantization.weight_format but those plan.rules keep ("all-<format>")
    candidates: tuple[OptimizeCandidate, ...] = ()
    # the accuracy floor: "gate", the quantize stage's gate (quantization.accuracy); "seed", the gate and no worse
    # than the config's own plan on perplexity, top-1 agreement and KL
    floor: Literal["gate", "seed"] = "gate"
    # goodput: the most good requests/s within the SLA; memory: the fewest weight bytes among the deployments
    # keeping the SLA with at least min_goodput_rps
    goal: Literal["goodput", "memory"] = "goodput"
    # goal memory: the goodput (good requests/s under tune's load) the smallest deployment must keep
    min_goodput_rps: Optional[float] = Field(None, gt=0)
    # the plans whose serving settings are searched (invoke tune's search) after the halving rounds
    finalists: int = Field(1, ge=1, le=8)
    serving_search: bool = True  # false: every candidate at the config's own serving settings
    # measured beside the choice at the end, tune.ab_rounds rounds alternating the order (must be candidates)
    compare_with: tuple[SafeName, ...] = ("seed",)

    @model_validator(mode="after")
    def _check(self) -> "OptimizeSection":
        names = [c.name for c in self.candidates]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"candidates named more than once: {', '.join(twice)}")
        if self.goal == "memory" and self.min_goodput_rps is None:
            raise ValueError("goal: memory needs min_goodput_rps, the goodput the smallest deployment must keep")
        if self.goal == "goodput" and self.min_goodput_rps is not None:
            raise ValueError("min_goodput_rps is only used with goal: memory")
        return self
