"""The stage graph: which stages exist, what each depends on, and the adapter that calls its module.

Stages are listed in dependency order (the order of ``artifacts.STAGE_TASK``). Each adapter reads its
upstream artifacts by the names in ``pipeline.artifacts`` and calls one stage module's entry point; heavy
imports stay inside the adapters, so listing the stages (``invoke explain``) imports no torch.
"""

from __future__ import annotations

from pipeline import artifacts, summaries
from pipeline.runner import StageContext, StageDef


def _run_model(ctx: StageContext) -> summaries.ModelSummary:
    from pipeline.source.download import prepare_model

    return prepare_model(ctx.config.model, ctx.out_dir)


def _run_text(ctx: StageContext) -> summaries.TextSummary:
    from pipeline.source.text import prepare_text

    return prepare_text(ctx.config.text, ctx.upstream("model") / artifacts.MODEL_DIR, ctx.out_dir)


def _run_sensitivity(ctx: StageContext) -> summaries.SensitivitySummary:
    import json

    from pipeline import compute, families
    from pipeline.child import run_in_child
    from pipeline.quant.plan import decision_format
    from pipeline.quant.sensitivity import run_analysis

    cfg = ctx.config
    model_dir = ctx.upstream("model") / artifacts.MODEL_DIR
    # the family, and whether the target serves it, before any compute (config.json alone tells)
    families.family(json.loads((model_dir / "config.json").read_text()).get("model_type"), cfg.build.target)
    bound = compute.host_memory_bound(cfg.compute)
    if cfg.compute.device == "cpu" or compute.nvidia_gpu_count() == 0:  # on a GPU the layer lives there
        compute.check_layer_fits(model_dir, cfg.sensitivity.reference_dtype, bound, "sensitivity")
    figures: summaries.SensitivityFigures  # run_analysis's, from the child process
    figures, peak_rss = run_in_child(
        run_analysis, model_dir, ctx.upstream("text") / artifacts.CALIBRATION_TOKENS_FILE,
        section=cfg.sensitivity, quant=cfg.quantization, out_dir=ctx.out_dir,
        decision=cfg.plan.decision_format or decision_format(cfg.quantization), target=cfg.build.target,
        compute=cfg.compute, memory_bound=bound,
        log_path=ctx.out_dir / artifacts.STAGE_LOG_FILE, what="sensitivity", bound=bound,
    )
    return {**figures, "peak_rss_bytes": peak_rss}


def _run_plan(ctx: StageContext) -> summaries.PlanSummary:
    import json

    from pipeline import artifacts, records
    from pipeline.quant.plan import make_plan, over_threshold, plan_markdown, write_plan
    from pipeline.quant.plots import error_bars_png

    cfg = ctx.config
    table = json.loads((ctx.upstream("sensitivity") / artifacts.SENSITIVITY_TABLE_JSON).read_text())
    doc = make_plan(table, cfg.plan, cfg.sensitivity, cfg.quantization)
    plan = records.Plan.model_validate(doc)
    write_plan(plan, ctx.out_dir, cfg.name)
    # the threshold is judged here, not in the sensitivity stage: a new threshold reruns only this stage
    over = over_threshold(table, plan.threshold) if plan.threshold is not None else None
    (ctx.out_dir / "plan.md").write_text(plan_markdown(doc, over))
    col = plan.decision_column or cfg.sensitivity.formats[0]
    error_bars_png(table, plan, col, plan.threshold, ctx.out_dir / "sensitivity_errors.png")
    figures: summaries.PlanFigures = doc["summary"]
    return {**figures, "budget": doc["budget"], "mode": doc["mode"], "threshold": plan.threshold,
            "over_threshold": over}


def _run_quantize(ctx: StageContext) -> summaries.QuantizeSummary:
    from pipeline import artifacts, compute
    from pipeline.quant.memory import quantize_streams
    from pipeline.quant.quantize import run_stage

    cfg = ctx.config
    model_dir = ctx.upstream("model") / artifacts.MODEL_DIR
    bound = compute.host_memory_bound(cfg.compute)
    stream = quantize_streams(model_dir, cfg, bound)
    summary, peak_rss = run_stage(
        model_dir, ctx.upstream("text") / artifacts.CALIBRATION_TOKENS_FILE,
        evaluation_file=ctx.upstream("text") / artifacts.EVALUATION_TOKENS_FILE,
        plan_file=ctx.upstream("plan") / artifacts.PLAN_FILE,
        table_file=ctx.upstream("sensitivity") / artifacts.SENSITIVITY_TABLE_JSON, quant=cfg.quantization,
        build=cfg.build, out_dir=ctx.out_dir, compute=cfg.compute, stream=stream, bound=bound,
        log_path=ctx.out_dir / artifacts.STAGE_LOG_FILE)
    return {**summary, "peak_rss_bytes": peak_rss}


def _compute_preflight(loaded) -> None:
    from pipeline.compute import check_device  # compute.device: cuda without a GPU stops before any work

    check_device(loaded.config.compute)


def _quantize_inputs(loaded, hash_cache, work_dir) -> dict:
    """The content of the local lm-eval task folders the gate scores (their YAML and data files); none without."""
    tasks = [t for t in loaded.config.quantization.accuracy.tasks if t.path is not None]
    return {t.name: {str(p.relative_to(t.path)): hash_cache.sha256(p) for p in sorted(t.path.rglob("*"))
                     if p.is_file()} for t in tasks}


def _quantize_preflight(loaded) -> None:
    _compute_preflight(loaded)
    tasks = loaded.config.quantization.accuracy.tasks
    if tasks:  # a task lm-eval cannot find or read stops here, before any stage runs
        import logging

        from pipeline.quant.tasks import load_tasks

        lm_eval_log = logging.getLogger("lm_eval")
        level = lm_eval_log.level
        lm_eval_log.setLevel(logging.ERROR)  # its notes while indexing tasks; there is no stage log to hold them yet
        try:
            load_tasks(tasks)
        finally:
            lm_eval_log.setLevel(level)


def _run_build(ctx: StageContext) -> summaries.BuildSummary:
    import json

    from pipeline import families, targets

    model_dir = ctx.upstream("model") / artifacts.MODEL_DIR
    fam = families.family(json.loads((model_dir / "config.json").read_text()).get("model_type"))
    target = targets.get(ctx.config.build.target)
    # the TensorRT-LLM checkpoint, or the HF unified one where it is the only export (Family.trtllm_checkpoint) or
    # what the target serves
    hf = target.serves_hf_checkpoint or not fam.trtllm_checkpoint
    ckpt = ctx.upstream("quantize") / (artifacts.HF_CHECKPOINT_DIR if hf else artifacts.TRTLLM_CHECKPOINT_DIR)
    return target.call(target.build_entry, ctx, ckpt, hf_checkpoint=not fam.trtllm_checkpoint)


def _build_preflight(loaded) -> None:
    from pipeline import targets

    target = targets.get(loaded.config.build.target)
    if target.preflight_entry is not None:  # what this machine lacks for the target, before any work
        target.call(target.preflight_entry, loaded)


# the stages that serve the build on this machine: a device-only target (Target.device_only) has them on its device
# (`invoke all` skips them; commands.refuse_device_only stops a task that asks for them)
SERVING_STAGES = ("verify", "bench", "report")


def host_stages(target) -> list[str]:
    """The stages `invoke all` runs for ``target`` here: all, or up to publish for a device-only one."""
    return [s.name for s in STAGES if not (target.device_only and s.name in SERVING_STAGES)]


def _bench_preflight(loaded) -> None:
    if loaded.config.bench.uses_aiperf:
        from pipeline.serving.bench.openloop import aiperf_executable  # the open-loop load's driver, or stop here

        aiperf_executable()


def _run_publish(ctx: StageContext) -> summaries.PublishSummary:
    from pipeline import targets
    from pipeline.serving.publish import publish
    from pipeline.serving.tuned import apply_tuned

    target = targets.get(ctx.config.build.target)
    if target.publish_entry is not None:  # not a Triton repository: the target's own hand-over (the edge bundle)
        return target.call(target.publish_entry, ctx)
    # the serving settings `invoke tune` chose, where it wrote them (tune.apply; the config's own values win)
    config, tuned = apply_tuned(ctx.config, ctx.work_dir)
    # the live repository (triton.repository_dir, default <work dir>/model_repository) is outside this
    # stage's folder, which the runner replaces on every run: see pipeline/serving/publish.py
    summary = publish(config, ctx.loaded.name, work_dir=ctx.work_dir, build_dir=ctx.upstream("build"),
                      model_dir=ctx.upstream("model") / artifacts.MODEL_DIR, out_dir=ctx.out_dir)
    if not tuned:
        return summary
    return {**summary, "tuned_settings": tuned}


def _publish_fingerprint(loaded, hash_cache, work_dir):
    from pipeline.serving.publish import sources_digest
    from pipeline.serving.tuned import tuned_fingerprint  # the tuned settings file is an input outside the config

    # and the serving model code it copies (triton_repo/), which is outside the config too
    return {**tuned_fingerprint(loaded.config, work_dir), "model_code_sha256": sources_digest()}


def _run_verify(ctx: StageContext) -> summaries.VerifySummary:
    from pipeline.serving.verify import verify

    v = ctx.config.verify
    return verify(ctx.upstream("publish"), ctx.out_dir, max_tokens=v.max_tokens, concurrent=v.concurrent_requests,
                  vllm_frontends=tuple(ctx.config.vllm.frontends))


def _run_bench(ctx: StageContext) -> summaries.BenchSummary:
    from pipeline.serving.bench.stage import run_bench

    return run_bench(ctx.config, ctx.upstream("publish"), ctx.upstream("text") / artifacts.EVALUATION_TEXT_FILE,
                     ctx.upstream("build"), ctx.out_dir)


def _bench_fingerprint(loaded, hash_cache, work_dir):
    from pipeline.serving.bench.stage import (
        compare_fingerprint,  # the comparison baseline is an input outside this work dir
    )

    return compare_fingerprint(loaded.config.bench)


def _report_fingerprint(loaded, hash_cache, work_dir):
    """What the report reads from outside the stages: `invoke tune`'s and `invoke optimize`'s last results."""
    from pipeline.serving.tuned import RESULTS_FILE, TUNE_DIR

    files = {"tune": work_dir / TUNE_DIR / RESULTS_FILE,
             "optimize": work_dir / artifacts.OPTIMIZE_DIR / artifacts.OPTIMIZE_RESULTS_DIR
             / artifacts.OPTIMIZE_RESULTS_FILE}
    return {k: hash_cache.sha256(p) if p.is_file() else None for k, p in files.items()}


def _run_report(ctx: StageContext) -> summaries.ReportSummary:
    from pipeline.release.report.stage import write_report

    return write_report(ctx.work_dir, ctx.out_dir, ctx.loaded)


def _check_edited_plan(stage_dir) -> summaries.PlanEditFigures:
    import json

    from pipeline import artifacts, records

    table = json.loads((stage_dir.parent / "sensitivity" / artifacts.SENSITIVITY_TABLE_JSON).read_text())
    layers = [l["name"] for l in table["layers"]]
    kept = records.read_plan(stage_dir / artifacts.PLAN_FILE, layers).kept_high_precision()
    return {"kept_high_precision": len(kept), "kept_high_precision_layers": kept}


def _model_fingerprint(loaded, hash_cache, work_dir):
    from pipeline.source.download import model_fingerprint

    return model_fingerprint(loaded, hash_cache)


def _text_fingerprint(loaded, hash_cache, work_dir):
    from pipeline.source.text import text_fingerprint

    return text_fingerprint(loaded, hash_cache)


# the vllm section's engine fields: the build depends on them, not on vllm.frontends (what verify and bench serve)
VLLM_ENGINE_FIELDS = tuple(f"vllm.{name}" for name in ("device", "dtype", "kv_cache_dtype", "gpu_memory_utilization",
                                                       "cpu_kv_cache_gib", "kv_offloading_gib", "served_model_name"))

# the sensitivity section's fields the measurement depends on: all but sensitivity.threshold, which only the plan
# reads, so a changed threshold reruns the plan and not the measurement
SENSITIVITY_MEASURED_FIELDS = tuple(f"sensitivity.{name}" for name in ("formats", "reference_dtype", "end_to_end"))

STAGES: list[StageDef] = [
    StageDef("model", "download the model and prepare an HF-format folder", sections=("model",),
             external_inputs=_model_fingerprint, run=_run_model),
    StageDef("text", "calibration and evaluation token sets", needs=("model",), sections=("text",),
             external_inputs=_text_fingerprint, run=_run_text),
    StageDef("sensitivity", "per-layer INT8 sensitivity table", needs=("model", "text"),
             sections=(*SENSITIVITY_MEASURED_FIELDS, "quantization.weight_format", "quantization.smoothquant_alpha",
                       "quantization.awq_group_size", "build.target", "plan.decision_format", "compute.device"),
             run=_run_sensitivity, preflight=_compute_preflight,
             version=2),  # 2: no threshold in its inputs or outputs (the plan judges against it)
    StageDef("plan", "mixed-precision plan", needs=("sensitivity",),
             sections=("plan", "sensitivity.threshold", "quantization.weight_format", "quantization.kv_cache",
                       "quantization.awq_group_size"),
             run=_run_plan, editable=("plan.yaml",), accept_edit=_check_edited_plan,
             version=4),  # 2, 3: fused q/k/v share one format; 4: plan.md counts the layers over the threshold
    StageDef("quantize", "ModelOpt quantization, TensorRT-LLM checkpoint export, accuracy gate",
             needs=("model", "text", "sensitivity", "plan"),
             sections=("quantization", "build.dtype", "build.tensor_parallel_size", "compute.device"),
             external_inputs=_quantize_inputs, run=_run_quantize, preflight=_quantize_preflight,
             version=2),  # 2: mixed formats, INT4 and tensor-parallel read-back, HF unified checkpoint
    StageDef("build", "engine / LLM-API options / CPU runtime bundle / vLLM export",
             needs=("model", "text", "quantize"),
             sections=("build", *VLLM_ENGINE_FIELDS), run=_run_build, preflight=_build_preflight),
    StageDef("publish", "Triton model repository", needs=("model", "plan", "build"),
             sections=("triton", "tenants", "sla.p99_itl_ms", "build.target", "build.trtllm_version",
                       "image.base_tag", "image.base_trtllm_version", "tune.apply"),
             external_inputs=_publish_fingerprint, run=_run_publish),
    StageDef("verify", "real Triton server checks", needs=("publish",), sections=("triton", "verify", "vllm.frontends"),
             run=_run_verify),
    StageDef("bench", "throughput and latency sweep", needs=("text", "build", "publish"),
             sections=("bench", "sla", "vllm.frontends"),
             external_inputs=_bench_fingerprint, run=_run_bench, preflight=_bench_preflight),
    StageDef("report", "the build report", needs=("verify", "bench"), external_inputs=_report_fingerprint,
             run=_run_report),
]

# invoke task -> the stages it runs (with their upstream stages, as needed)
TASK_STAGES: dict[str, tuple[str, ...]] = {}
for _stage, _task in artifacts.STAGE_TASK.items():
    TASK_STAGES[_task] = TASK_STAGES.get(_task, ()) + (_stage,)
