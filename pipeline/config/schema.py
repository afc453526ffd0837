"""The whole config: :class:`PipelineConfig`, one field per section, and the rules that tie sections together.

The sections are defined in the modules beside this one (``sources``, ``quantization``, ``build``, ``serving``,
``release``), including sections that later stages fill in, so a config written today keeps validating as stages
land.
"""

from __future__ import annotations

from pydantic import model_validator

from pipeline import targets, tenancy
from pipeline.config.base import SafeName, Strict
from pipeline.config.build import BuildSection, VllmSection
from pipeline.config.quantization import ComputeSection, PlanSection, QuantizationSection, SensitivitySection
from pipeline.config.release import AlertsSection, ImageSection
from pipeline.config.serving import (
    BenchSection,
    OptimizeSection,
    SlaSection,
    TenantSection,
    TritonSection,
    TuneSection,
    VerifySection,
)
from pipeline.config.sources import ModelSection, TextSection
from pipeline.errors import InputError
from pipeline.formats import DECISION_COLUMN
from pipeline.targets.cpu import ADAPTIVE_BATCH_WHAT


class PipelineConfig(Strict):
    name: SafeName
    description: str = ""
    model: ModelSection
    text: TextSection
    compute: ComputeSection = ComputeSection()
    sensitivity: SensitivitySection = SensitivitySection()
    plan: PlanSection = PlanSection()
    quantization: QuantizationSection = QuantizationSection()
    build: BuildSection = BuildSection()
    vllm: VllmSection = VllmSection()
    triton: TritonSection = TritonSection()
    verify: VerifySection = VerifySection()
    sla: SlaSection = SlaSection()
    bench: BenchSection = BenchSection()
    tune: TuneSection = TuneSection()
    optimize: OptimizeSection = OptimizeSection()
    tenants: list[TenantSection] = []
    alerts: AlertsSection = AlertsSection()
    image: ImageSection = ImageSection()

    @model_validator(mode="after")
    def _cross(self) -> "PipelineConfig":
        q, b = self.quantization, self.build
        problems = targets.get(b.target).check(self)
        if problems:
            raise ValueError("; ".join(problems))
        decision = DECISION_COLUMN.get(q.weight_format)
        if self.plan.budget is not None:
            unmeasured = [f for f in self.plan.budget.wider_formats
                          if DECISION_COLUMN.get(f, f) not in self.sensitivity.formats]
            if unmeasured:
                raise ValueError(
                    f"plan.budget.wider_formats {unmeasured} are not measured: add them to sensitivity.formats"
                )
        if self.plan.decision_format is not None:
            decision = self.plan.decision_format
        if decision is not None and decision not in self.sensitivity.formats:
            raise ValueError(
                f"the plan decides {q.weight_format} layers on the sensitivity column {decision}: "
                f"add {decision} to sensitivity.formats (now {list(self.sensitivity.formats)})"
            )
        if q.accuracy.tasks and self.compute.layer_streaming == "always":
            raise ValueError(
                "quantization.accuracy.tasks scores the whole original and quantized models in memory, and "
                "compute.layer_streaming: always holds one decoder layer at a time: drop the tasks, or set "
                "layer_streaming to auto or never (on a machine the model fits)"
            )
        _check_serving_keys(self.triton, b, self.sla)
        _check_tenants(self.tenants, self.triton, b)
        if max(self.bench.concurrency) > b.max_batch_size * self.triton.instance_count * 4:
            raise ValueError(
                f"bench.concurrency goes up to {max(self.bench.concurrency)}, far beyond what "
                f"max_batch_size {b.max_batch_size} x {self.triton.instance_count} instance(s) can serve"
            )
        return self


def _check_serving_keys(t: TritonSection, b: BuildSection, sla: SlaSection) -> None:
    """The triton keys that set how the runtime batches, held to the targets whose runtime reads them
    (``Target.serving_settings``)."""
    target = targets.get(b.target)
    reads = target.serving_settings
    if t.adaptive_batch and "adaptive_batch" not in reads:
        raise ValueError(ADAPTIVE_BATCH_WHAT + f"the {b.target} target has no such setting at run time"
                         + target.serving_setting_note("adaptive_batch"))
    if t.max_running is not None and ("max_running" not in reads or t.max_running > b.max_batch_size):
        raise ValueError(
            f"triton.max_running {t.max_running}: the runtime's limit on sequences run at once (cpu, pytorch and "
            f"vllm targets), at most build.max_batch_size ({b.max_batch_size}); " + (
                (target.serving_setting_note("max_running")
                 or f"the {b.target} target's limit is build.max_batch_size itself")
                if "max_running" not in reads else "lower it, or raise build.max_batch_size (a rebuild)"))
    if t.prefill_chunk_tokens is not None and "prefill_chunk_tokens" not in reads:
        raise ValueError(f"triton.prefill_chunk_tokens is the cpu runtime's chunked prefill; the {b.target} target "
                         f"does not read it" + target.serving_setting_note("prefill_chunk_tokens"))
    if t.default_priority_level is not None and (t.priority_levels is None
                                                 or t.default_priority_level > t.priority_levels):
        raise ValueError(f"triton.default_priority_level {t.default_priority_level}: must be one of the levels "
                         f"1..triton.priority_levels ({t.priority_levels or 'not set'})")
    if t.priority_levels is not None and "priority_levels" not in reads:
        raise ValueError(
            f"triton.priority_levels: request classes reach the cpu runtime's and vLLM's schedulers; the "
            f"{b.target} target's runtime is given no priority ({target.serving_setting_note('priority_levels')})")
    unread = [k for k in ("scheduler_policy", "kv_cache_free_gpu_memory_fraction")
              if getattr(t, k) is not None and k not in reads]
    if unread:
        raise ValueError(f"triton.{unread[0]} sets TensorRT-LLM's executor (build.target: tensorrt or pytorch); "
                         f"the {b.target} target has no such setting")


def _check_tenants(tenants: list[TenantSection], t: TritonSection, b: BuildSection) -> None:
    """Tenants on a target whose runtime partitions its KV pool, named once each, their shares within the pool the
    runtime will hold (max_running or max_batch_size sequences of max_seq_len), their classes among the levels."""
    if not tenants:
        return
    target = targets.get(b.target)
    if "tenants" not in target.serving_settings:
        raise ValueError(f"tenants: the cpu runtime partitions its KV pool per tenant, and Triton's vLLM model admits "
                         f"requests to vLLM by their tenants' shares; the {b.target} target does neither "
                         f"(yet){target.serving_setting_note('tenants')}. Serve tenants with build.target: cpu or vllm")
    for i, x in enumerate(tenants):
        if x.priority_level is not None and x.priority_level > (t.priority_levels or 0):
            raise ValueError(f"tenants[{i}].priority_level {x.priority_level}: must be one of the levels "
                             f"1..triton.priority_levels ({t.priority_levels or 'not set'})")
    pool = target.tenant_pool_blocks(t, b)
    if pool is None:  # sized as the engine starts: fractions only, whose sum the config can check
        counted = [i for i, x in enumerate(tenants) if x.kv_blocks is not None]
        if counted:
            raise ValueError(f"tenants[{counted[0]}].kv_blocks: the {b.target} target's engine sizes its KV pool as it "
                             f"starts, so a count of blocks cannot be checked here; give a fraction, kv_share")
        total = sum(x.kv_share or 0 for x in tenants)
        if total > 1:
            parts = ", ".join(f"tenants[{i}].kv_share {x.kv_share} ({x.name})" for i, x in enumerate(tenants))
            raise ValueError(f"tenants: the kv_share fractions sum to {total:g}, past the whole pool, 1 ({parts}); "
                             f"lower them")
    try:
        if pool is None:  # the names only: the shares are resolved against vLLM's pool at load
            tenancy.check_names(tenancy.specs_from(tenants))
        else:
            tenancy.TenantBook(tenancy.specs_from(tenants), pool)
    except InputError as e:
        raise ValueError(str(e)) from None
