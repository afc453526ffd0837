"""The edge target: NVIDIA TensorRT Edge-LLM for a Jetson. On this machine Edge-LLM's host-side export turns the HF
unified quantized checkpoint into ONNX plus weights, and the build checks it (pipeline/engines/edgellm/). The
engine is built and run on the device itself, from the commands the build writes beside the export: publish
hands over that device bundle, and verify and bench run there (the bundle's device check), not here."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

from pipeline import artifacts
from pipeline.errors import InputError
from pipeline.formats import EDGE_PLATFORMS, HIGH_PRECISION, NO_QUANT, EdgePlatform
from pipeline.targets.base import NEEDS_EDGELLM_ENV, Target

if TYPE_CHECKING:
    from pipeline.config import PipelineConfig


def platform_of(target_sm: Optional[int]) -> Optional[EdgePlatform]:
    """The Edge-LLM platform ``build.target_sm`` names (pipeline.formats.EDGE_PLATFORMS); None for another SM."""
    return EDGE_PLATFORMS.get(target_sm or 0)


class EdgeTarget(Target):
    name = "edge"
    summary = ("TensorRT Edge-LLM: ONNX exported here from the quantized checkpoint, the engine built and run on a "
               "Jetson; device only")
    engine_label = "TensorRT Edge-LLM"
    artifact_dir = artifacts.EDGE_BUNDLE_DIR
    artifact_files = (artifacts.EDGE_MANIFEST_FILE, f"{artifacts.EDGE_ONNX_DIR}/llm/model.onnx",
                      f"{artifacts.EDGE_ONNX_DIR}/llm/config.json", artifacts.EDGE_BUILD_SCRIPT,
                      artifacts.EDGE_RUN_SCRIPT)
    build_entry = "pipeline.engines.edgellm.target:build_stage"
    preflight_entry = "pipeline.engines.edgellm.target:preflight"
    publish_entry = "pipeline.engines.edgellm.target:publish_stage"
    serves_hf_checkpoint = True  # Edge-LLM's export reads ModelOpt's unified HF checkpoint
    device_only = True
    kv_formats = ("none",)  # the KV format of each platform: EDGE_PLATFORMS (the config rules below)
    single_process = True  # one device: tensor and pipeline parallel sizes 1
    pipeline_metrics = False
    tunable = False
    untuned_why = "the device runtime's own limits: build.max_batch_size and build.max_seq_len"
    default_frontends = ()
    every_family = False
    families_note = ("TensorRT Edge-LLM 0.11's supported models list Llama 3.x, Qwen2/2.5 and Qwen3 of this "
                     "pipeline's families; its export has no checked path for the others")
    report_note = ("Target `edge`: TensorRT Edge-LLM. The ONNX export ran here and was read back; the engine build "
                   "and its tokens/s run on the device (the bundle's device check).")

    def frontends(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        return ()

    def on_cpu(self, cfg: "PipelineConfig") -> bool:
        return False

    def docker_stage(self, cfg: "PipelineConfig") -> str:
        raise InputError("the edge target ships as the device bundle publish writes, not a serving image")

    def device_hand_over(self, publish_dir: Path) -> str:
        return (f"copy {publish_dir / artifacts.EDGE_BUNDLE_DIR} to the Jetson and run {artifacts.EDGE_BUILD_SCRIPT}, "
                f"then {artifacts.EDGE_RUN_SCRIPT} there (docs/targets/edge.md)")

    def requirements(self, cfg: "PipelineConfig") -> tuple[str, ...]:
        return (NEEDS_EDGELLM_ENV,)

    def serves_format(self, weight_format: str, setting: Callable[[str], Any]) -> bool:
        platform = platform_of(setting("build.target_sm"))
        return platform is not None and weight_format in platform.weight_formats

    def serving_setting_note(self, key: str) -> str:
        return " (the device runtime batches to build.max_batch_size)"

    def check(self, cfg: "PipelineConfig") -> list[str]:
        """What the device cannot run, refused before any work (facts: pipeline.formats.EDGE_PLATFORMS)."""
        b, q = cfg.build, cfg.quantization
        platform = platform_of(b.target_sm)
        if platform is None:
            known = ", ".join(f"{sm} ({p.name})" for sm, p in EDGE_PLATFORMS.items())
            return [f"build.target_sm {b.target_sm}: the edge target builds for {known}; set build.target_sm to one "
                    f"of them"]
        runs = ", ".join(platform.weight_formats)
        if q.weight_format not in platform.weight_formats:
            return [f"quantization.weight_format {q.weight_format}: {platform.name} does not run it under TensorRT "
                    f"Edge-LLM {platform.edgellm_version}; the formats that run there: {runs}"]
        named = [("plan.budget.wider_formats", f) for f in (cfg.plan.budget.wider_formats if cfg.plan.budget else ())]
        named += [(f"plan.rules {r.pattern!r}", r.format) for r in cfg.plan.rules if r.format is not None]
        bad = [f"{where}: {f}" for where, f in named if f not in (*platform.weight_formats, HIGH_PRECISION)]
        if bad:
            return [f"{'; '.join(bad)}: {platform.name} runs {runs} (and high_precision)"]
        # an unset kv_cache is chosen to fit (pipeline.autoconfig, from kv_formats) after this first validation
        if q.weight_format != NO_QUANT and q.kv_cache not in platform.kv_formats and "kv_cache" in q.model_fields_set:
            return [f"quantization.kv_cache {q.kv_cache}: {platform.name}'s KV cache under Edge-LLM is "
                    f"{' or '.join(platform.kv_formats)} (none: the engine's own FP16)"]
        return []
