"""What the hand-off files hold: one typed record, one reader and one writer for each.

``pipeline.artifacts`` says where a file is; this module says what is in it. A reader checks a file once,
against the fields the pipeline reads, and a missing, unreadable or mistyped file is an InputError that
names the file and the ``invoke <task> --force`` that writes it again. Records accept fields they do not
know (a newer pipeline may add some). A writer writes its record atomically, in the file's on-disk format.

- ``build_settings.json`` (build): BuildSettings
- ``provenance.json`` (publish): Provenance
- ``plan.yaml`` (the plan stage of ``invoke sensitivity``, or a hand edit): Plan
- ``accuracy.json`` (quantize): Accuracy
- ``verify_results.json`` (verify): VerifyResults
- ``bench_results.json`` (bench): BenchResults
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError, field_validator

from pipeline import artifacts
from pipeline.errors import InputError
from pipeline.formats import HIGH_PRECISION, LAYER_FORMATS
from pipeline.fsutil import atomic_write_text


class _Record(BaseModel):
    # Readers accept fields they do not know (a newer pipeline may add some) and check the ones they use.
    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


R = TypeVar("R", bound=_Record)

# ------------------------------------------------------------------ build_settings.json (build)


class KVCacheSettings(_Record):
    quant_algo: Optional[str]
    tokens_per_block: int
    free_gpu_memory_fraction: float
    enable_block_reuse: bool


class CudaGraphSettings(_Record):
    enabled: bool
    batch_sizes: list[int]
    enable_padding: bool
    cuda_graph_mode: bool
    cuda_graph_cache_size: int


class BuildSettings(_Record):
    """build_settings.json: what the build decided, the same shape for every target."""

    target: str
    artifact_dir: str
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    enable_chunked_context: bool = False  # tensorrt: the Triton backend chunks long contexts
    max_batch_size: int
    max_input_len: int
    max_seq_len: int
    max_num_tokens: Optional[int] = None
    kv_cache: KVCacheSettings
    cuda_graphs: CudaGraphSettings
    trtllm_version: Optional[str]
    provenance: dict
    checkpoint_sha256: str


# ------------------------------------------------------------------ provenance.json (publish)


class PublishedQuantization(_Record):
    weight_format: str
    kv_cache: Optional[str]


class PublishedBuildInfo(_Record):
    target: str
    trtllm_version: Optional[str]
    world_size: int = 1  # GPUs (tensor x pipeline parallel ranks) one server of it needs
    server_ranks: int = 1  # tritonserver processes that serve it: world_size for an engine per rank, else 1
    tensorrt_llm_model: str = ""  # the engine model: the one every rank loads (serving/launch.py)


class PublishedVersion(_Record):
    version: int
    repository_digest: str
    checkpoint_sha256: Optional[str] = None


class Provenance(_Record):
    """provenance.json: what publish served, from what, at which repository digest."""

    config_name: str
    model_name: str
    version: int
    repository_digest: str
    models: list[str] = []
    quantization: PublishedQuantization
    build: PublishedBuildInfo
    checkpoint_sha256: Optional[str] = None
    versions: list[int] = []  # the live repository's: every version it keeps
    history: list[PublishedVersion] = []  # the live repository's: each kept version's digests


# ------------------------------------------------------------------ plan.yaml (the plan stage; may be hand-edited)

PLAN_FORMAT_VERSION = 1


class PlanLayer(_Record):
    format: str
    error: Optional[float] = None  # the layer's measured error in the format it was judged by
    reason: str = ""

    @field_validator("format")
    @classmethod
    def _known_format(cls, fmt: str) -> str:
        if fmt not in LAYER_FORMATS:
            raise ValueError(f"format {fmt!r} is not one of {', '.join(LAYER_FORMATS)}")
        return fmt


class Plan(_Record):
    """plan.yaml: each linear layer's format and why, the budget and a summary (plan.md shows it)."""

    # yaml is read in lax mode: a hand edit writes `error: 1` as well as `error: 1.0`
    model_config = ConfigDict(extra="allow", frozen=True, strict=False)

    # declared in the order the plan stage writes them (a writer keeps the order, and writes only what is set)
    format_version: int
    base_format: Optional[str] = None
    kv_cache: Optional[str] = None
    decision_column: Optional[str] = None
    mode: Optional[str] = None
    threshold: Optional[float] = None
    budget: Optional[dict] = None
    layers: dict[str, PlanLayer]
    summary: Optional[dict] = None

    @field_validator("format_version")
    @classmethod
    def _this_version(cls, v: int) -> int:
        if v != PLAN_FORMAT_VERSION:
            raise ValueError(f"format_version must be {PLAN_FORMAT_VERSION}")
        return v

    def kept_high_precision(self) -> list[str]:
        """The layers kept in high precision, in plan order."""
        return [name for name, layer in self.layers.items() if layer.format == HIGH_PRECISION]

    def quantized_formats(self) -> set[str]:
        """The formats the plan quantizes to (one for a single-format plan, none for an all-kept one)."""
        return {layer.format for layer in self.layers.values()} - {HIGH_PRECISION}


# ------------------------------------------------------------------ accuracy.json (quantize)


class AccuracyFigures(_Record):
    # declared in the order quantize writes them (a writer keeps the order, and writes only what is set)
    tokens: Optional[int] = None
    perplexity_original: float  # the gate's reference: what a served model's perplexity is compared with
    perplexity_quantized: Optional[float] = None
    perplexity_increase_pct: Optional[float] = None
    top1_agreement: Optional[float] = None
    kl_divergence: Optional[float] = None
    tasks: Optional[list[dict]] = None  # lm-eval tasks: task, metric, samples, original, quantized, recovery
    from_checkpoint: Optional[dict] = None  # the exported checkpoint read back (the cpu runtime adds its KV cache)
    from_hf_checkpoint: Optional[dict] = None  # the HF unified checkpoint read back, where one was exported


class Accuracy(_Record):
    """accuracy.json: the gate's figures (the fake-quantized model, then each checkpoint read back) and the
    generations shown in generations.md."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=False)  # JSON writes 3.0 as 3.0, 3 as 3

    accuracy: AccuracyFigures
    generations: list[dict]


# ------------------------------------------------------------------ verify_results.json (verify)


class VerifyResults(_Record):
    """verify_results.json: every check the served model passed or failed, latencies, the servers' start."""

    # declared in the order verify writes them (a writer keeps the order, and writes only what is set)
    ok: bool
    model_name: str
    version: int
    target: str
    frontends: Optional[list[str]] = None  # vllm: the frontends verified, each with its server in `servers`
    servers: Optional[dict] = None
    server: dict
    reference: str
    reference_s: Optional[float] = None
    prompts: list[str]
    max_tokens: int
    latency: dict
    checks: list[dict]


# ------------------------------------------------------------------ bench_results.json (bench)


class BenchResults(_Record):
    """bench_results.json: the settings, what each figure means, and every target's levels and knee."""

    # declared in the order bench writes them (a writer keeps the order, and writes only what is set)
    format_version: int
    tool: str
    open_loop_tool: Optional[str] = None
    settings: dict
    definitions: dict
    sla: Optional[dict] = None
    bench_s: float
    targets: list[dict]
    comparison: Optional[dict] = None  # this build / the baseline, level by level
    frontends: Optional[dict] = None  # Triton's vLLM model / vLLM's OpenAI server, level by level
    cross_check: Optional[dict] = None


# ------------------------------------------------------------------ reading and writing


def _problems(e: ValidationError) -> str:
    return "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())


def _load(path: Path, rerun: str, parse) -> dict:
    try:
        data = parse(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise InputError(f"{path} is missing; run `invoke {rerun}` first") from None
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise InputError(f"{path} is unreadable ({e}); run `invoke {rerun} --force`") from None
    if not isinstance(data, dict):
        raise InputError(f"{path} is not a mapping of fields; run `invoke {rerun} --force`")
    return data


def _read(model: type[R], path: Path, rerun: str, parse=json.loads, fix: str = "") -> R:
    try:
        return model.model_validate(_load(path, rerun, parse))
    except ValidationError as e:
        fix = fix or f"It was written by another pipeline version; run `invoke {rerun} --force`"
        raise InputError(f"{path}: missing or mistyped field(s): {_problems(e)}. {fix}") from None


def _write_json(path: Path, record: _Record, **dumps: Any) -> None:
    atomic_write_text(path, json.dumps(record.model_dump(exclude_unset=True), **dumps) + "\n")


def read_build_settings(build_dir: Path) -> BuildSettings:
    return _read(BuildSettings, build_dir / artifacts.BUILD_SETTINGS_FILE, "build")


def write_build_settings(build_dir: Path, settings: BuildSettings) -> None:
    _write_json(build_dir / artifacts.BUILD_SETTINGS_FILE, settings, indent=2, sort_keys=True, default=str)


def read_provenance(repository_dir: Path) -> Provenance:
    path = repository_dir / artifacts.PROVENANCE_FILE
    if not path.is_file():
        raise InputError(f"No published build at {repository_dir} (no {artifacts.PROVENANCE_FILE}). Run `invoke "
                         f"publish` (or `invoke all`) for this config first.")
    return _read(Provenance, path, "publish")


def write_provenance(repository_dir: Path, provenance: Provenance) -> None:
    _write_json(repository_dir / artifacts.PROVENANCE_FILE, provenance, indent=2, sort_keys=True, default=str)


def read_plan(path: Path, table_layers: Optional[list[str]] = None) -> Plan:
    """plan.yaml, generated or edited; ``table_layers``: the model's layers, which the plan must list exactly."""
    plan = _read(Plan, path, "sensitivity", parse=yaml.safe_load,
                 fix="Fix the edit, or run `invoke sensitivity --force` for a new plan")
    if table_layers is not None:
        missing = sorted(set(table_layers) - set(plan.layers))
        unknown = sorted(set(plan.layers) - set(table_layers))
        if missing or unknown:
            raise InputError(f"{path}: the plan's layers do not match the model's: missing {missing[:3]}, "
                             f"unknown {unknown[:3]}. Fix the edit, or run `invoke sensitivity --force`")
    return plan


def write_plan(path: Path, plan: Plan, header: str) -> None:
    """plan.yaml: ``header`` (comment lines), then the plan in the order it was built."""
    doc = plan.model_dump(exclude_unset=True)  # what was set, no defaults added
    atomic_write_text(path, header + yaml.safe_dump(doc, sort_keys=False, width=120))


def read_accuracy(quantize_dir: Path) -> Accuracy:
    return _read(Accuracy, quantize_dir / artifacts.ACCURACY_FILE, "quantize")


def write_accuracy(quantize_dir: Path, accuracy: Accuracy) -> None:
    atomic_write_text(quantize_dir / artifacts.ACCURACY_FILE,
                      json.dumps(accuracy.model_dump(exclude_unset=True), indent=2))


def read_verify_results(verify_dir: Path) -> VerifyResults:
    return _read(VerifyResults, verify_dir / artifacts.VERIFY_RESULTS_FILE, "verify")


def write_verify_results(verify_dir: Path, results: VerifyResults) -> None:
    _write_json(verify_dir / artifacts.VERIFY_RESULTS_FILE, results, indent=2, default=str)


def read_bench_results(bench_dir: Path) -> BenchResults:
    return _read(BenchResults, bench_dir / artifacts.BENCH_RESULTS_FILE, "bench")


def write_bench_results(bench_dir: Path, results: BenchResults) -> None:
    _write_json(bench_dir / artifacts.BENCH_RESULTS_FILE, results, indent=2)
