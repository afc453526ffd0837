"""The stage graph: which stages exist, what each depends on, and the adapter that calls its module.

Stages are listed in dependency order. A stage whose ``run`` is None is planned but not built yet; the
runner says so (with its issue number) instead of pretending.
"""

from __future__ import annotations

from . import constants
from .runner import StageContext, StageDef


def _run_model(ctx: StageContext) -> dict:
    from .download import prepare_model

    return prepare_model(ctx.config.model, ctx.out_dir)


def _run_text(ctx: StageContext) -> dict:
    from .text import prepare_text

    return prepare_text(ctx.config.text, ctx.upstream("model") / constants.MODEL_DIR, ctx.out_dir)


def _model_fingerprint(loaded, hash_cache):
    from .download import model_fingerprint

    return model_fingerprint(loaded, hash_cache)


def _text_fingerprint(loaded, hash_cache):
    from .text import text_fingerprint

    return text_fingerprint(loaded, hash_cache)


STAGES: list[StageDef] = [
    StageDef("model", "download the model and prepare an HF-format folder", sections=("model",),
             external_inputs=_model_fingerprint, run=_run_model),
    StageDef("text", "calibration and evaluation token sets", needs=("model",), sections=("text",),
             external_inputs=_text_fingerprint, run=_run_text),
    StageDef("sensitivity", "per-layer INT8 sensitivity table", needs=("model", "text"),
             sections=("sensitivity",), issue=3),
    StageDef("plan", "mixed-precision plan", needs=("sensitivity",), sections=("plan", "sensitivity.threshold"),
             issue=3),
    StageDef("quantize", "ModelOpt quantization, TensorRT-LLM checkpoint export, accuracy gate",
             needs=("model", "text", "plan"), sections=("quantization",), issue=4),
    StageDef("build", "engine / LLM-API options / CPU runtime bundle", needs=("quantize",), sections=("build",),
             issue=5),
    StageDef("publish", "Triton model repository", needs=("build",), sections=("triton",), issue=6),
    StageDef("verify", "real Triton server checks", needs=("publish",), sections=("triton",), issue=6),
    StageDef("bench", "throughput and latency sweep", needs=("publish",), sections=("bench",), issue=7),
    StageDef("report", "the build report", needs=("verify", "bench"), issue=7),
]

# invoke task -> the stages it runs (with their upstream stages, as needed)
TASK_STAGES: dict[str, tuple[str, ...]] = {
    "download": ("model", "text"),
    "sensitivity": ("sensitivity", "plan"),
    "quantize": ("quantize",),
    "build": ("build",),
    "publish": ("publish",),
    "verify": ("verify",),
    "bench": ("bench",),
    "report": ("report",),
}
