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


def _run_sensitivity(ctx: StageContext) -> dict:
    from .child import run_in_child
    from .plan import decision_format
    from .sensitivity import run_analysis

    cfg = ctx.config
    summary, peak_rss = run_in_child(
        run_analysis, ctx.upstream("model") / constants.MODEL_DIR,
        ctx.upstream("text") / constants.CALIBRATION_TOKENS_FILE, cfg.sensitivity, cfg.quantization, ctx.out_dir,
        cfg.plan.decision_format or decision_format(cfg.quantization), cfg.build.target,
        log_path=ctx.out_dir / constants.STAGE_LOG_FILE,
    )
    return {**summary, "peak_rss_bytes": peak_rss}


def _run_plan(ctx: StageContext) -> dict:
    import json

    from .plan import make_plan, plan_markdown, write_plan
    from .sensitivity import TABLE_JSON
    from .sensitivity_report import error_bars_png

    cfg = ctx.config
    table = json.loads((ctx.upstream("sensitivity") / TABLE_JSON).read_text())
    doc = make_plan(table, cfg.plan, cfg.sensitivity, cfg.quantization)
    write_plan(doc, ctx.out_dir, cfg.name)
    (ctx.out_dir / "plan.md").write_text(plan_markdown(doc))
    col = doc["decision_column"] or cfg.sensitivity.formats[0]
    error_bars_png(table, doc, col, doc["threshold"], ctx.out_dir / "sensitivity_errors.png")
    return {**doc["summary"], "budget": doc["budget"], "mode": doc["mode"]}


def _run_quantize(ctx: StageContext) -> dict:
    from .child import run_in_child
    from .plan import PLAN_FILE
    from .quantize import run_quantize
    from .sensitivity import TABLE_JSON

    cfg = ctx.config
    summary, peak_rss = run_in_child(
        run_quantize, ctx.upstream("model") / constants.MODEL_DIR,
        ctx.upstream("text") / constants.CALIBRATION_TOKENS_FILE, ctx.upstream("text") / constants.EVALUATION_TOKENS_FILE,
        ctx.upstream("plan") / PLAN_FILE, ctx.upstream("sensitivity") / TABLE_JSON, cfg.quantization, cfg.build,
        ctx.out_dir, log_path=ctx.out_dir / constants.STAGE_LOG_FILE,
    )
    return {**summary, "peak_rss_bytes": peak_rss}


def _check_edited_plan(stage_dir) -> dict:
    import json

    from .plan import PLAN_FILE, read_plan
    from .sensitivity import TABLE_JSON

    layers = [l["name"] for l in json.loads((stage_dir.parent / "sensitivity" / TABLE_JSON).read_text())["layers"]]
    doc = read_plan(stage_dir / PLAN_FILE, layers)
    kept = [n for n, e in doc["layers"].items() if e["format"] == "high_precision"]
    return {"kept_high_precision": len(kept), "kept_high_precision_layers": kept}


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
             sections=("sensitivity", "quantization.weight_format", "quantization.smoothquant_alpha",
                       "quantization.awq_group_size", "build.target", "plan.decision_format"),
             run=_run_sensitivity),
    StageDef("plan", "mixed-precision plan", needs=("sensitivity",),
             sections=("plan", "sensitivity.threshold", "quantization.weight_format", "quantization.kv_cache",
                       "quantization.awq_group_size"),
             run=_run_plan, editable=("plan.yaml",), accept_edit=_check_edited_plan,
             version=3),  # 2, 3: fused q/k/v share one format
    StageDef("quantize", "ModelOpt quantization, TensorRT-LLM checkpoint export, accuracy gate",
             needs=("model", "text", "sensitivity", "plan"),
             sections=("quantization", "build.dtype", "build.tensor_parallel_size"), run=_run_quantize),
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
