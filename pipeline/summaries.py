"""The typed shape of each stage's summary: what a stage's run function returns and the runner writes, as it is,
as the ``summary`` of the stage's manifest.

One ``TypedDict`` per stage, so mypy checks the keys where a producer builds its summary and where an adapter in
``pipeline.stages`` passes it on. At run time a summary is a plain dict: typing it changes no key and no value of
a manifest. Top-level keys are typed; nested records stay ``dict[str, Any]``. Keys that only some build targets
write (or only some runs: a tuned publish, a compared bench) sit in a ``total=False`` base.
"""

from __future__ import annotations

from typing import Any, Optional, TypedDict, Union


class ModelSummary(TypedDict):
    """pipeline.source.download.prepare_model."""
    source: dict[str, Any]  # where the weights came from: kind (hub, local, gguf) and its facts
    model: dict[str, Any]  # the prepared folder's architecture facts (inspect_hf_folder)


class TextSummary(TypedDict):
    """pipeline.source.text.prepare_text."""
    tokenizer_eos_id: int
    source_documents: int
    calibration: dict[str, Any]  # num_samples, seq_len, tokens, documents
    evaluation: dict[str, Any]


class SensitivityFigures(TypedDict):
    """pipeline.quant.sensitivity.run_analysis (in a child process); the adapter adds the child's peak RSS."""
    layers: int
    decision_column: str
    analysis_s: float
    calibration_tokens: int
    embedding_int8_error: float
    compute: dict[str, Any]  # pipeline.compute.compute_record


class SensitivitySummary(SensitivityFigures):
    peak_rss_bytes: int


class PlanFigures(TypedDict):
    """The plan document's own ``summary`` (pipeline.quant.plan)."""
    layers: int
    kept_high_precision: int
    kept_high_precision_layers: list[str]
    formats: list[str]
    mixed_precision: bool
    weight_bytes_fp16: int
    weight_bytes_planned: int
    effective_bits_per_weight: Optional[float]
    total_error_left: float


class PlanEditFigures(TypedDict):
    """What a hand-edited plan, once checked, records over the summary (pipeline.stages' accept_edit)."""
    kept_high_precision: int
    kept_high_precision_layers: list[str]


class _PlanEdited(TypedDict, total=False):
    hand_edited: bool  # the runner's mark on an accepted hand edit


class PlanSummary(PlanFigures, _PlanEdited):
    """The plan stage: the plan's figures, its budget (budget mode; else None), its mode, and in threshold mode
    sensitivity.threshold and how many layers' error passes it per measured format (budget mode: None)."""
    budget: Optional[dict[str, Any]]
    mode: str
    threshold: Optional[float]
    over_threshold: Optional[dict[str, int]]  # format -> layers whose error exceeds the threshold


class QuantizeFigures(TypedDict):
    """pipeline.quant.quantize (in child processes); the adapter adds the largest child's peak RSS."""
    accuracy: dict[str, Any]
    checkpoint: dict[str, Any]
    checkpoint_bytes: int
    hf_checkpoint: Optional[dict[str, Any]]
    layer_streaming: bool
    kept_high_precision: int
    calibration_tokens: int
    evaluation_tokens: int
    compute: dict[str, Any]
    timing_s: dict[str, float]


class QuantizeSummary(QuantizeFigures):
    peak_rss_bytes: int


class _TargetBuildKeys(TypedDict, total=False):
    # cpu (pipeline.engines.build)
    kv_blocks: int
    tokens_per_block: int
    smoke_test: dict[str, Any]
    peak_rss_bytes: int
    # cpu, tensorrt, pytorch
    kv_cache_quant_algo: Optional[str]
    # tensorrt, pytorch (pipeline.engines.trtllm.targets)
    quant_algo: Optional[str]
    gpu: str
    gpu_sm: int
    trtllm_version: Optional[str]
    # tensorrt
    ranks: int
    engine_bytes: int
    paged_context_fmha: bool
    cuda_graphs: dict[str, Any]
    timing_cache_reused: bool
    # pytorch
    llm_api_options: dict[str, Any]
    # vllm (pipeline.engines.vllm.target)
    vllm: str
    export: dict[str, Any]
    check: dict[str, Any]
    greedy_tokens: dict[str, Any]
    # vllm, edge
    kv_cache_dtype: Optional[str]
    # edge (pipeline.engines.edgellm.target)
    platform: str
    jetpack: str
    tensorrt_edgellm: Optional[str]
    layer_formats: dict[str, int]
    custom_ops: Any
    onnx_bytes: int
    export_s: float


class BuildSummary(_TargetBuildKeys):
    """The build stage: each target's build entry (Target.build_entry)."""
    target: str
    checkpoint_sha256: str
    timing_s: float


class _TargetPublishKeys(TypedDict, total=False):
    # a Triton repository (pipeline.serving.publish.publish)
    model_name: str
    version: int
    models: list[str]
    repository_dir: str
    versions_kept: list[int]
    repository_digest: str
    foreign_models_kept: list[str]
    reloaded: Optional[dict[str, Any]]  # the running server's reload, where triton.server_url is set
    tuned_settings: dict[str, Any]  # the settings `invoke tune` chose, where publish applied them
    # the edge bundle (Target.publish_entry: pipeline.engines.edgellm.target.publish_stage)
    bundle: str
    bundle_bytes: int
    platform: str
    jetpack: str
    device_commands: Any


class PublishSummary(_TargetPublishKeys):
    target: str


class _VerifyFrontends(TypedDict, total=False):
    tie_divergences: int  # Triton's own checks (pipeline.serving.verify)
    frontends: list[str]  # vLLM's servers (pipeline.serving.verify_vllm)


class VerifySummary(_VerifyFrontends):
    checks: int
    all_ok: bool
    server_startup_s: Union[Optional[float], dict[str, Optional[float]]]  # per frontend on the vllm target
    latency: dict[str, Any]


class _BenchExtras(TypedDict, total=False):
    sustainable_rate: dict[str, Any]  # bench.request_rates set
    frontends: dict[str, Any]  # served both ways (vLLM's OpenAI server and Triton)
    comparison: dict[str, Any]  # bench.compare_repository set


class BenchSummary(_BenchExtras):
    """pipeline.serving.bench.stage.run_bench."""
    levels: list[dict[str, Any]]
    peak_output_tokens_per_s: float
    peak_at_concurrency: int
    knee_concurrency: Optional[int]
    knee: str
    sla: Optional[dict[str, Any]]
    repository_digest: str
    bench_s: float


class ReportSummary(TypedDict):
    """pipeline.release.report.stage.write_report."""
    five_lines: list[str]
    stages: dict[str, str]
    hash_chain_ok: Optional[bool]
    files: list[str]


StageSummary = Union[ModelSummary, TextSummary, SensitivitySummary, PlanSummary, QuantizeSummary, BuildSummary,
                     PublishSummary, VerifySummary, BenchSummary, ReportSummary]

# stage name -> its summary's shape (the names of pipeline.stages.STAGES)
BY_STAGE: dict[str, type] = {
    "model": ModelSummary, "text": TextSummary, "sensitivity": SensitivitySummary, "plan": PlanSummary,
    "quantize": QuantizeSummary, "build": BuildSummary, "publish": PublishSummary, "verify": VerifySummary,
    "bench": BenchSummary, "report": ReportSummary,
}
