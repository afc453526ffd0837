"""The model stages' sections: ``compute`` (where they run), ``sensitivity``, ``plan`` and ``quantization``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional

from pydantic import ByteSize, Field, field_validator, model_validator

from pipeline.config.base import Dtype, KVCacheFormat, SensitivityFormat, Strict, WeightFormat


class ComputeSection(Strict):
    """Where the model stages (sensitivity, quantize) run and how much memory they may hold."""

    # auto: CUDA when torch sees a GPU, else the CPU. On a GPU the reference runs in bfloat16 (float16 before
    # SM 80); on a CPU in sensitivity.reference_dtype (float32 by default).
    device: Literal["auto", "cpu", "cuda"] = "auto"
    # Host memory the model stages may hold, e.g. "24GB" or "2.5GiB". None: what this process may use here
    # (the memory cgroup's limit where there is one, else the available RAM) less memory_margin.
    max_host_memory: Optional[ByteSize] = None
    # GPU memory per GPU. None: the GPU's free memory less memory_margin.
    max_gpu_memory: Optional[ByteSize] = None
    memory_margin: float = Field(0.1, ge=0.0, lt=0.9)  # the share of the default bounds left free
    # quantize one decoder layer at a time (pipeline/quant/streaming.py): auto = when the model held whole in
    # memory would not fit max_host_memory (on the CPU); always; never = refuse such a model
    layer_streaming: Literal["auto", "always", "never"] = "auto"


class SensitivitySection(Strict):
    threshold: float = Field(0.1, gt=0, lt=10)  # relative output error above which a layer is sensitive
    formats: tuple[SensitivityFormat, ...] = Field(("int8_sq",), min_length=1)
    # fp32 on a CPU (fp16 matmuls there are ~300x slower); float16/bfloat16 on a GPU
    reference_dtype: Dtype = "float32"
    end_to_end: bool = False  # also measure the error at the logits with one layer quantized (slow)


class PlanRule(Strict):
    pattern: str = Field(min_length=1)  # fnmatch pattern over layer names, e.g. "lm_head", "*.down_proj"
    keep_high_precision: bool = False
    format: Optional[WeightFormat] = None

    @model_validator(mode="after")
    def _one_action(self) -> "PlanRule":
        if self.keep_high_precision == (self.format is not None):
            raise ValueError("a rule sets exactly one of keep_high_precision: true or format: <format>")
        return self


class PlanBudget(Strict):
    weight_bytes: Optional[int] = Field(None, gt=0)
    avg_bits_per_weight: Optional[float] = Field(None, gt=0, le=32)
    # besides high precision, formats a layer may be moved to when that removes more error per byte
    # (e.g. int8_wo under an int4_awq base); each must be measured (listed in sensitivity.formats)
    wider_formats: tuple[WeightFormat, ...] = ()

    @model_validator(mode="after")
    def _one(self) -> "PlanBudget":
        if (self.weight_bytes is None) == (self.avg_bits_per_weight is None):
            raise ValueError("set exactly one of weight_bytes or avg_bits_per_weight")
        return self


class PlanSection(Strict):
    mode: Literal["threshold", "budget"] = "threshold"
    # the sensitivity column that judges layers in the base format; default: the one matching
    # quantization.weight_format. A stricter column (int8_w8a8 for an int8_sq model) keeps more layers.
    decision_format: Optional[SensitivityFormat] = None
    budget: Optional[PlanBudget] = None
    rules: tuple[PlanRule, ...] = ()

    @model_validator(mode="after")
    def _budget(self) -> "PlanSection":
        if self.mode == "budget" and self.budget is None:
            raise ValueError("mode: budget needs a budget: {weight_bytes: N} or {avg_bits_per_weight: X}")
        if self.mode == "threshold" and self.budget is not None:
            raise ValueError("budget is only used with mode: budget")
        return self


class AccuracyTask(Strict):
    """A task of lm-evaluation-harness the gate scores on the original and the quantized model: a local one (a
    folder with the task's YAML and its data file, read offline) or one lm-eval registers, its Hub dataset pinned."""

    name: str = Field(min_length=1)  # the task's name: its YAML's `task:`
    path: Optional[Path] = None  # local: the folder holding the task's YAML and data (relative to this config)
    dataset_revision: Optional[str] = Field(None, min_length=1)  # registered: the Hub dataset's commit (or tag)
    # the figure compared, as lm-eval names it: metric, then its filter after a comma where the task has several
    # (e.g. "exact_match,strict-match" for gsm8k); "acc" means "acc,none"
    metric: str = Field("acc", min_length=1)
    limit: Optional[int] = Field(None, gt=0)  # score only the task's first N examples (a CPU takes minutes on MMLU)

    @model_validator(mode="after")
    def _one_source(self) -> "AccuracyTask":
        if (self.path is None) == (self.dataset_revision is None):
            raise ValueError(
                f"task {self.name!r}: set exactly one of path (a local task folder) or dataset_revision (a task "
                "lm-eval registers, with its Hub dataset pinned to a commit)"
            )
        return self


class AccuracyTolerance(Strict):
    max_perplexity_increase_pct: float = Field(10.0, ge=0)
    min_top1_agreement: float = Field(0.8, ge=0, le=1)
    max_kl_divergence: float = Field(0.1, ge=0)
    # lm-evaluation-harness tasks scored on both models (none by default); each must keep at least
    # min_task_recovery of the original's score (quantized / original, inverted for a lower-is-better metric)
    tasks: tuple[AccuracyTask, ...] = ()
    min_task_recovery: float = Field(0.95, gt=0, le=2)

    @field_validator("tasks")
    @classmethod
    def _unique(cls, v: tuple[AccuracyTask, ...]) -> tuple[AccuracyTask, ...]:
        names = [t.name for t in v]
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ValueError(f"tasks named more than once: {', '.join(twice)}")
        return v


class QuantizationSection(Strict):
    weight_format: WeightFormat = "int8_sq"
    kv_cache: KVCacheFormat = "int8"
    awq_group_size: Literal[32, 64, 128] = 64
    smoothquant_alpha: float = Field(1.0, ge=0, le=1)  # ModelOpt's default; 0.5 lost 3x more on SmolLM2
    export_hf_checkpoint: bool = False  # the unified HF checkpoint the `pytorch` target serves
    accuracy: AccuracyTolerance = AccuracyTolerance()
    # a few greedy generations, original vs quantized, in generations.md (for reading; not gated). With layer
    # streaming every token reads both models again: on a 2B model twice the rest of quantize's time
    greedy_generations: bool = True

    @field_validator("weight_format", mode="before")
    @classmethod
    def _gpu_only(cls, v: Any) -> Any:
        if isinstance(v, str) and (v.lower().startswith(("nvfp4", "mx")) or v.lower() in ("fp4", "w4a8_mxfp4_fp8")):
            raise ValueError(
                f"{v} needs a GPU: ModelOpt quantizes NVFP4 and MX formats only with CUDA (TensorRT-LLM serves "
                "them on Blackwell GPUs), and this pipeline quantizes on the CPU; use int4_awq, w4a8_awq, fp8, "
                "int8_sq or int8_wo"
            )
        return v

    @model_validator(mode="after")
    def _combos(self) -> "QuantizationSection":
        explicit = self.model_fields_set
        if self.weight_format == "none" and self.kv_cache != "none" and "kv_cache" in explicit:
            raise ValueError(
                "weight_format: none builds the unquantized baseline, whose KV cache is unquantized too: "
                "set kv_cache: none"
            )
        if self.export_hf_checkpoint and self.kv_cache == "int8" and "kv_cache" in explicit:
            raise ValueError(
                "an INT8 KV cache cannot be exported as an HF unified checkpoint (ModelOpt refuses it); "
                "use kv_cache: fp8 or none, or export_hf_checkpoint: false"
            )
        return self
