"""The report's sections, one per stage, each from that stage's manifest and the files it recorded.

At a glance (the five lines ``invoke all`` prints), source, text, sensitivity, plan, quantization and accuracy,
sizes (checkpoint, KV cache), build, the Triton repository, verify, bench, the chain of content hashes from
the weights to the repository, and the stage runs (when, how long, tool versions). A stage without a manifest
is shown as "not run", never filled in. Plots are copied beside the page (``img/``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional

from pipeline import artifacts, targets
from pipeline.config import AlertsSection
from pipeline.release.deploy import ALERTS_RULE_FILE, DASHBOARD_FILE, RENDERED_DIR
from pipeline.release.report.document import NOT_RUN, Doc, fmt, mark, mib, short_hash
from pipeline.release.report.summary import five_lines, kv_cache_sentence
from pipeline.release.report.workdir import (
    STAGES,
    dig,
    maybe_accuracy,
    maybe_bench_results,
    maybe_build_settings,
    maybe_plan,
    maybe_provenance,
    maybe_sensitivity_table,
    maybe_verify_results,
    published_model_config,
)
from pipeline.serving.bench.plots import LATENCY_PNG, THROUGHPUT_PNG
from pipeline.serving.tuned import PLAN_FILE, PLOT_FILE, RESULTS_FILE, TABLE_FILE, TUNE_DIR, servers_said

IMG_DIR = "img"
TOP_LAYERS = 15  # rows of the sensitivity table on the page (the full table is linked)


def add_sections(doc: Doc, work_dir: Path, *, out_dir: Path, manifests: dict[str, Optional[dict]], summary: dict,
                 chain: list[dict], alerts: Optional[AlertsSection] = None) -> None:
    """Every section, in page order; plots and the full sensitivity table are copied into out_dir. ``alerts``:
    the config's alert thresholds (their defaults if None)."""
    _section_glance(doc, summary)
    _section_source(doc, work_dir, manifests["model"])
    _section_text(doc, manifests["text"])
    _section_sensitivity(doc, work_dir, out_dir, manifests["sensitivity"], manifests["plan"])
    _section_plan(doc, work_dir, out_dir, manifests["plan"])
    section_quantize(doc, work_dir, manifests["quantize"])
    _section_sizes(doc, summary, manifests["build"])
    _section_build(doc, work_dir, manifests["build"])
    _section_repository(doc, work_dir, manifests["publish"])
    _section_verify(doc, work_dir, manifests["verify"])
    _section_bench(doc, work_dir, out_dir, manifests["bench"])
    _section_serving_settings(doc, work_dir, out_dir, manifests["publish"])
    _section_optimize(doc, work_dir, out_dir)
    _section_monitoring(doc, work_dir, out_dir, manifests["bench"], alerts or AlertsSection())
    _section_chain(doc, chain, work_dir, manifests)
    _section_runs(doc, manifests)


def _section_glance(doc: Doc, summary: dict) -> None:
    doc.h(2, "At a glance")
    doc.bullets(five_lines(summary))
    doc.table(["stage"] + list(STAGES), [["status"] + [summary["stages"][s] for s in STAGES]])


def _copy_image(src: Path, out_dir: Path, name: str) -> Optional[str]:
    if not src.is_file():
        return None
    (out_dir / IMG_DIR).mkdir(exist_ok=True)
    shutil.copy2(src, out_dir / IMG_DIR / name)
    return f"{IMG_DIR}/{name}"


def _section_source(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Source")
    if m is None:
        return doc.not_run("model")
    src, arch = m["summary"].get("source", {}), m["summary"].get("model", {})
    ext = dig(m, "inputs", "external") or {}
    cfg_src = dig(m, "inputs", "config", "model", "source") or {}
    pairs = [("kind", src.get("kind") or cfg_src.get("kind"))]
    for key in ("repo_id", "revision", "resolved_revision", "package", "file", "path"):
        val = src.get(key, cfg_src.get(key))
        if val is not None:
            pairs.append((key, f"`{val}`"))
    if ext.get("sha256"):
        pairs.append(("source file sha256", f"`{ext['sha256']}`"))
    if ext.get("revision"):
        pairs.append(("pinned revision", f"`{ext['revision']}`"))
    checks = src.get("checks") or {}
    if checks:
        pairs.append(("conversion checks", ", ".join(f"{k}: {fmt(v)}" for k, v in checks.items()
                                                     if not isinstance(v, dict))))
    doc.kv(pairs)
    doc.h(3, "Architecture")
    doc.kv([(k, v) for k, v in arch.items()])
    doc.h(3, "Files of the prepared model folder")
    files = m["outputs"]["files"]
    doc.table(["file", "size", "sha256"], [[f"`{k}`", mib(v["size_bytes"]) if v["size_bytes"] > 2**20 else
                                            f"{v['size_bytes']:,} B", f"`{v['sha256']}`"] for k, v in files.items()])


def _section_text(doc: Doc, m: Optional[dict]) -> None:
    doc.h(2, "Calibration and evaluation text")
    if m is None:
        return doc.not_run("text")
    s = m["summary"]
    rows = [[name, s[name]["num_samples"], s[name]["seq_len"], s[name]["tokens"], len(s[name]["documents"])]
            for name in ("calibration", "evaluation") if name in s]
    doc.p(f"{s.get('source_documents')} source documents, split by document so calibration and evaluation never "
          f"share text; source `{dig(m, 'inputs', 'config', 'text', 'source', 'kind')}`.")
    doc.table(["set", "samples", "tokens per sample", "tokens", "documents"], rows)


def _judged_by(plan: Optional[dict]) -> tuple[str, object]:
    """How the plan judged the table (the sensitivity stage does not read the threshold, so the plan's manifest
    says it), and the layers over its threshold per format: threshold mode only."""
    if plan is None:
        return "(its threshold is the plan stage's, which has not run)", None
    p = plan["summary"]
    if p.get("threshold") is None:
        return f"in {p.get('mode')} mode (no threshold)", None
    return f"with threshold {p['threshold']}", p.get("over_threshold")


def _section_sensitivity(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict],
                         plan: Optional[dict]) -> None:
    doc.h(2, "Sensitivity")
    if m is None:
        return doc.not_run("sensitivity")
    sens_dir = artifacts.stage_dir(work_dir, "sensitivity")
    s = m["summary"]
    decision = s.get("decision_column")
    judged, over = _judged_by(plan)
    doc.p(f"Per-layer relative output error ||ref(x) − q(x)|| / ||ref(x)|| on {s.get('calibration_tokens'):,} "
          f"calibration tokens, one layer quantized at a time; the plan decides on the `{decision}` column "
          f"{judged}.")
    doc.kv([("layers", s.get("layers")), ("over the plan's threshold", over),
            ("embedding INT8 error (reported, not quantized)", s.get("embedding_int8_error")),
            ("analysis time", f"{s.get('analysis_s')} s"), ("ran on", ran_on(s)),
            ("peak memory", mib(s.get("peak_rss_bytes")))])
    table = maybe_sensitivity_table(work_dir)
    if table and table.get("layers"):
        fmts = list(table["layers"][0]["errors"])
        layers = sorted(table["layers"], key=lambda l: -l["errors"].get(decision, {}).get("error", 0.0))
        doc.h(3, f"The {TOP_LAYERS} most sensitive layers (of {len(layers)})")
        doc.table(["layer"] + [f"{f} error" for f in fmts] + ["input amax", "outlier ratio"],
                  [[f"`{l['name']}`"] + [l["errors"][f]["error"] for f in fmts] +
                   [l["activation"]["amax"], l["activation"]["outlier_ratio"]] for l in layers[:TOP_LAYERS]])
        full = sens_dir / artifacts.SENSITIVITY_TABLE_MD
        if full.is_file():
            shutil.copy2(full, out_dir / artifacts.SENSITIVITY_TABLE_MD)
            doc.p(f"The full table: [{artifacts.SENSITIVITY_TABLE_MD}]({artifacts.SENSITIVITY_TABLE_MD}).")
    img = _copy_image(sens_dir / artifacts.SENSITIVITY_HEATMAP_PNG, out_dir, artifacts.SENSITIVITY_HEATMAP_PNG)
    if img:
        doc.image(img, "Relative output error per layer (decoder block x module), per format")


def ran_on(summary: dict) -> Optional[str]:
    """A model stage's device and dtype, its memory bound and its peak GPU memory (manifests without them: None)."""
    c = summary.get("compute")
    if not c:
        return None
    gpu = f", peak GPU {mib(c['peak_gpu_bytes'])}" if c.get("peak_gpu_bytes") else ""
    return f"{c.get('device')} in {c.get('dtype')}; bound {mib(c.get('host_memory_bound_bytes'))}{gpu}"


def _section_plan(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Plan")
    if m is None:
        return doc.not_run("plan")
    s = m["summary"]
    doc.kv([("mode", s.get("mode")), ("formats", s.get("formats")), ("layers", s.get("layers")),
            ("kept in high precision", s.get("kept_high_precision")), ("mixed precision", s.get("mixed_precision")),
            ("effective bits per weight", s.get("effective_bits_per_weight")),
            ("weight bytes planned / all-FP16", f"{mib(s.get('weight_bytes_planned'))} / "
                                                f"{mib(s.get('weight_bytes_fp16'))}"),
            ("error left in quantized layers (sum)", s.get("total_error_left")), ("budget", s.get("budget")),
            ("edited by hand", s.get("hand_edited", False))])
    plan = maybe_plan(work_dir)
    if plan:
        base = plan.get("base_format")
        special = [(n, e) for n, e in plan["layers"].items() if e.get("format") != base]
        doc.h(3, f"Layers not in the base format ({base}), with the plan's reasons")
        doc.table(["layer", "format", "error", "reason"],
                  [[f"`{n}`", e.get("format"), e.get("error"), e.get("reason")] for n, e in special])
    img = _copy_image(artifacts.stage_dir(work_dir, "plan") / artifacts.PLAN_ERRORS_PNG, out_dir, "plan_errors.png")
    if img:
        doc.image(img, "Per-layer error on the decision column; red: kept in high precision")


def section_quantize(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Quantization and accuracy")
    if m is None:
        return doc.not_run("quantize")
    s = m["summary"]
    q = dig(m, "inputs", "config", "quantization") or {}
    ck = s.get("checkpoint") or {}
    doc.kv([("weight format", q.get("weight_format")), ("KV cache", q.get("kv_cache")),
            ("SmoothQuant alpha", q.get("smoothquant_alpha")), ("checkpoint quant_algo", ck.get("quant_algo")),
            ("checkpoint KV-cache algo", ck.get("kv_cache_quant_algo")), ("weight dtypes", ck.get("weight_dtypes")),
            ("modules excluded from quantization", len(ck.get("exclude_modules") or [])),
            ("read back by the pipeline's reader", dig(ck, "read_back")),
            ("calibration tokens", s.get("calibration_tokens")), ("evaluation tokens", s.get("evaluation_tokens")),
            ("time", s.get("timing_s")), ("ran on", ran_on(s)), ("peak memory", mib(s.get("peak_rss_bytes")))])
    a, gate = s.get("accuracy") or {}, q.get("accuracy") or {}
    read_back = [("exported checkpoint (read back)", a.get("from_checkpoint") or {})]
    if a.get("from_hf_checkpoint"):
        read_back.append(("HF unified checkpoint (read back, gated)", a["from_hf_checkpoint"]))
    doc.h(3, "Accuracy on the held-out evaluation text")
    doc.table(["figure", "quantized model (fake-quant)", *(title for title, _ in read_back), "gate"], [
        ["perplexity, original", a.get("perplexity_original"), *(a.get("perplexity_original") for _ in read_back), ""],
        *([label, a.get(key), *(fc.get(key) for _, fc in read_back), limit] for label, key, limit in (
            ("perplexity, quantized", "perplexity_quantized", ""),
            ("perplexity increase %", "perplexity_increase_pct", f"≤ {gate.get('max_perplexity_increase_pct')}"),
            ("top-1 agreement", "top1_agreement", f"≥ {gate.get('min_top1_agreement')}"),
            ("KL divergence", "kl_divergence", f"≤ {gate.get('max_kl_divergence')}"))),
    ])
    doc.p(f"{a.get('tokens')} evaluation tokens, teacher-forced. The gate passed (the stage fails otherwise). The "
          f"read-back columns run the exported checkpoints through the pipeline's own readers, without the KV-cache "
          f"quantization (the CPU runtime adds it).")
    if a.get("tasks"):
        doc.h(3, "Task accuracy (lm-evaluation-harness)")
        doc.table(["task", "metric", "examples", "original", "quantized (fake-quant)", "recovery", "gate"],
                  [[t["task"], t["metric"], t["samples"], t["original"], t["quantized"], t["recovery"],
                    f"≥ {gate.get('min_task_recovery')}"] for t in a["tasks"]])
        doc.p("Each task scored in-process on the original and the quantized model; recovery = quantized / "
              "original (original / quantized for a lower-is-better metric).")
    gens = dig(maybe_accuracy(work_dir), "generations")
    if gens:
        doc.h(3, "Greedy generations (a poor accuracy signal on a small model; shown for a feel)")
        doc.table(["prompt", "original", "quantized"], [[g["prompt"], g["original"], g["quantized"]] for g in gens])


def _section_sizes(doc: Doc, summary: dict, build: Optional[dict]) -> None:
    doc.h(2, "Checkpoint and KV-cache sizes")
    z = summary["sizes"]
    doc.table(["what", "bytes", ""], [
        ["prepared model weights (as loaded)", z.get("model_weight_bytes"), mib(z.get("model_weight_bytes"))],
        ["linear layers, all FP16", z.get("weight_bytes_fp16"), mib(z.get("weight_bytes_fp16"))],
        ["linear layers, as planned", z.get("weight_bytes_planned"), mib(z.get("weight_bytes_planned"))],
        ["the embedding in the checkpoint" + (" (also lm_head: tied, stored once)"
                                              if z.get("lm_head_shares_embedding") else ""),
         z.get("embedding_bytes"), mib(z.get("embedding_bytes"))],
        ["TensorRT-LLM checkpoint on disk", z.get("checkpoint_bytes"), mib(z.get("checkpoint_bytes"))],
        ["KV-cache pool (cpu runtime)", z.get("kv_cache_pool_bytes"), mib(z.get("kv_cache_pool_bytes"))],
        ["KV cache per token", z.get("kv_cache_bytes_per_token"), ""],
    ])
    doc.p(f"The checkpoint holds the planned linears, the embedding where it is not the tied lm_head the plan "
          f"counts, the norms and the quantization scales. {kv_cache_sentence(summary.get('kv_cache'))}.")
    if build:
        b = build["summary"]
        if b.get("kv_cache_dtype"):  # an engine that chose its own KV cache (vLLM)
            doc.p(f"KV cache: vLLM's `kv_cache_dtype` {b.get('kv_cache_dtype')} (paged, blocks sized by vLLM).")
        else:
            doc.p(f"KV cache: {b.get('kv_cache_quant_algo') or 'unquantized'}, {b.get('kv_blocks')} blocks of "
                  f"{b.get('tokens_per_block')} tokens.")


def _section_build(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Build")
    if m is None:
        return doc.not_run("build")
    settings = maybe_build_settings(work_dir) or {}
    target = targets.get(settings["target"]) if settings.get("target") in targets.REGISTRY else None
    if target is not None and target.report_note:
        doc.p(target.report_note)
    if "check" in m["summary"]:  # the build checked the export in its own engine (vLLM)
        _vllm_check(doc, m["summary"])
    doc.kv([(k, v) for k, v in settings.items() if k != "provenance"])
    doc.h(3, "Provenance")
    doc.kv([(k, v) for k, v in (settings.get("provenance") or {}).items()])
    smoke = m["summary"].get("smoke_test")
    if smoke:
        doc.p(f"Smoke test after the build: `{smoke.get('prompt')}` → `{smoke.get('output')}` "
              f"(loaded in {smoke.get('load_s')} s).")


def _vllm_check(doc: Doc, b: dict) -> None:
    """The vllm target: the export and what vLLM computed with it, against the simulated checkpoint."""
    c, e, g = b.get("check") or {}, b.get("export") or {}, b.get("greedy_tokens") or {}
    ppl = c.get("perplexity") or {}
    doc.p(f"Target `vllm`: the checkpoint exported for vLLM {b.get('vllm')} in compressed-tensors format "
          f"({e.get('quantized_linears')} INT8 W8A8 linears, {e.get('high_precision_linears')} in "
          f"{e.get('dtype')}), served by vLLM's own OpenAI server. SmoothQuant scales folded into "
          f"{fmt(e.get('smoothing_folded_into'))}; written in high precision because their smoothing cannot be "
          f"folded (grouped-query attention): {len(e.get('dequantized_smoothing_not_foldable') or [])} linear(s).")
    doc.table(["checked in vLLM (evaluation tokens: %s)" % c.get("evaluation_tokens"), "vLLM", "simulated checkpoint",
               "original"], [
        ["perplexity", ppl.get("vllm"), ppl.get("simulated"), ppl.get("original")],
        ["top-1 agreement with the original", c.get("top1_agreement_with_original"), "", 1.0],
        ["top-1 agreement with the simulated checkpoint", c.get("top1_agreement_with_simulated"), 1.0, ""],
    ])
    doc.p(f"Greedy tokens for verify's prompts against the simulated checkpoint: {g.get('equal')} equal, "
          f"{g.get('near_tie')} diverging at a near-tie, {g.get('diverged')} diverging beyond it (vLLM computes "
          f"in bfloat16 on a CPU; recorded, not gated: the accuracy bounds above are).")


def _section_repository(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Triton repository")
    if m is None:
        return doc.not_run("publish")
    prov = maybe_provenance(work_dir) or {}
    repo = artifacts.MODEL_REPOSITORY_DIR  # the stage's own copy, as its manifest lists it
    doc.kv([(k, v if not isinstance(v, str) or len(v) < 40 else f"`{v}`") for k, v in prov.items()
            if k not in ("model_source", "build", "models")])
    models = m["summary"].get("models") or sorted({f.split("/")[1] for f in m["outputs"]["files"]
                                                   if f.startswith(f"{repo}/") and f.count("/") >= 2})
    files = m["outputs"]["files"]
    rows = []
    for name in models:
        mine = {k: v for k, v in files.items() if k.startswith(f"{repo}/{name}/")}
        cfg = published_model_config(work_dir, name)
        rows.append([f"`{name}`", cfg.get("kind"), cfg.get("max_batch_size"), cfg.get("decoupled"),
                     cfg.get("inputs"), cfg.get("outputs"), len(mine),
                     mib(sum(v["size_bytes"] for v in mine.values()))])
    doc.table(["model", "backend / platform", "max batch", "decoupled", "inputs", "outputs", "files", "size"], rows)
    doc.p(f"Live repository (where versions accumulate): `{m['summary'].get('repository_dir')}`; versions kept: "
          f"{fmt(m['summary'].get('versions_kept'))}. The stage's own copy holds the version just published.")
    doc.p(f"Published repository digest (sha256 over every file of the version, sorted by path): "
          f"`{prov.get('repository_digest')}`.")


def _section_verify(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Verify")
    if m is None:
        return doc.not_run("verify")
    r = maybe_verify_results(work_dir) or {}
    doc.p(f"A real Triton server ({dig(r, 'server', 'binary')}, ready in {dig(r, 'server', 'startup_s')} s) "
          f"loaded model `{r.get('model_name')}` version {r.get('version')}; reference: {r.get('reference')}.")
    rows = []
    for c in r.get("checks", []):
        res = c.get("results") or []
        eq = sum(1 for x in res if x.get("equal") is True)
        detail = f"{eq}/{len(res)} equal to the reference" if res else \
            ", ".join(f"{k}: {fmt(v)}" for k, v in c.items() if k not in ("name", "ok", "answers"))[:160]
        rows.append([c.get("name"), mark(c.get("ok")), detail])
    doc.table(["check", "ok", "detail"], rows)
    lat = r.get("latency") or {}
    if lat:
        doc.table(["latency", "median ms", "max ms", "n"],
                  [[k, v.get("median_ms"), v.get("max_ms"), v.get("n")] for k, v in lat.items()])


def _level_rows(levels: list[dict]) -> list[list]:
    def tri(level: dict, suffix: str, key: str):
        return next((v.get(key) for k, v in (level.get("triton") or {}).items() if k.endswith(suffix)), None)

    def ms(*values) -> str:
        return " / ".join("—" if v is None else f"{v:.1f}" for v in values)

    rows = []
    for l in levels:
        rows.append([
            l["concurrency"], l["requests"], l["output_tokens_per_s"], l["requests_per_s"],
            ms(l["ttft_ms"]["p50"], l["ttft_ms"]["p90"], l["ttft_ms"]["p99"]),
            ms(l["itl_ms"].get("p50"), l["itl_ms"].get("p90"), l["itl_ms"].get("p99")),
            ms(l["e2e_ms"]["p50"], l["e2e_ms"]["p90"], l["e2e_ms"]["p99"]),
            l["e2e_ms"]["p99_over_p50"], l["e2e_ms"]["jitter"], l["token_gap_ms"].get("jitter"),
            dig(l, "padding_factor", "value"),
            ms(tri(l, "_stream", "queue_ms"), tri(l, "_tensorrt_llm", "queue_ms")),
            ms(dig(l, "cpu_ms_per_token", "frontend_ms"), dig(l, "cpu_ms_per_token", "engine_ms"),
               dig(l, "cpu_ms_per_token", "total_ms")),
        ])
    return rows


LEVEL_HEADER = ["concurrency", "requests", "output tok/s", "req/s", "TTFT ms P50 / P90 / P99",
                "ITL ms P50 / P90 / P99", "e2e ms P50 / P90 / P99", "e2e P99/P50", "e2e jitter", "token-gap jitter",
                "padding factor", "Triton queue ms: stream / llm",
                "CPU ms per token: frontend / engine / all"]


def _ratio_table(doc: Doc, levels: list[dict]) -> None:
    """Per concurrency, the ratios of two sweeps' figures (bench's ``stats.ratios``)."""
    doc.table(["concurrency", "output tok/s", "req/s", "TTFT P50", "ITL P50", "e2e P50", "e2e P99"],
              [[c["concurrency"], c["output_tokens_per_s"], c["requests_per_s"], c["ttft_p50"], c["itl_p50"],
                c["e2e_p50"], c["e2e_p99"]] for c in levels])


def _open_loop_table(doc: Doc, t: dict) -> None:
    """The open-loop load (bench.request_rates, driven by aiperf): one row per rate, and the sustainable rate."""
    def ms(d: dict) -> str:
        return " / ".join("—" if d.get(k) is None else f"{d[k]:.0f}" for k in ("p50", "p90", "p99"))

    doc.p("**Open loop** (Poisson arrivals, aiperf): requests arrive at the rate whether or not earlier ones are "
          "done, so queueing shows, as it does in production.")
    doc.table(["rate req/s", "arrived req/s", "completed req/s", "output tok/s", "TTFT ms P50 / P90 / P99",
               "ITL ms P50 / P90 / P99", "e2e ms P50 / P90 / P99", "goodput req/s", "SLA", "errors"],
              [[r["request_rate"], r.get("arrived_rps"), r["requests_per_s"], r.get("output_tokens_per_s"),
                ms(r["ttft_ms"]), ms(r["itl_ms"]), ms(r["e2e_ms"]), dig(r, "sla", "goodput_rps"),
                mark(dig(r, "sla", "met")) if r.get("sla") else "—", r["errors"]] for r in t["rates"]])
    doc.p(f"**Sustainable rate**: {t['sustainable_rate']['sentence'].rstrip('.')}.")


def _section_bench(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Bench")
    if m is None:
        return doc.not_run("bench")
    r = maybe_bench_results(work_dir) or {}
    st = r.get("settings") or {}
    doc.p(f"Closed-loop sweep over the streaming model `{st.get('model')}` ({r.get('tool')}): at each concurrency, "
          f"{st.get('requests_per_level')} requests of {st.get('prompt_tokens')} prompt tokens (windows of the "
          f"evaluation text) and {st.get('output_tokens')} output tokens (end_id {st.get('end_id')}), after "
          f"{st.get('warmup_requests')} warm-up requests; {r.get('bench_s', 0):.0f} s in all.")
    for t in r.get("targets", []):
        doc.h(3, f"{t['label']}: {t.get('config_name')} ({fmt(t.get('quantization'))}), {t.get('server')}")
        doc.table(LEVEL_HEADER, _level_rows(t["levels"]))
        doc.p(f"**Knee**: {t.get('knee_sentence')}")
        if t.get("sla_choice"):
            doc.p(f"**SLA**: {t['sla_choice']['sentence']}. Goodput per level (requests/s within every bound): " +
                  ", ".join(f"{l['sla']['goodput_rps']:.2f} at {l['concurrency']}"
                            + ("" if l["sla"]["met"] else f" (P99 over: {', '.join(l['sla']['violations'])})")
                            for l in t["levels"]) + ".")
        pads = {dig(l, "padding_factor", "basis") for l in t["levels"]}
        doc.p("Padding factor (useful / processed batch slots): " + "; ".join(p for p in pads if p) + ".")
        first = [(l["concurrency"], tri) for l in t["levels"] for k, tri in (l.get("triton") or {}).items()
                 if k.endswith("_stream") and tri.get("first_response_ms") is not None]
        if first:
            doc.p("Triton's own time to first response of the streaming model: " +
                  ", ".join(f"{f['first_response_ms']:.0f} ms at concurrency {c}" for c, f in first) + ".")
        if t.get("rates"):
            _open_loop_table(doc, t)
    if any(t.get("frontend") == "openai" for t in r.get("targets", [])):
        doc.p("vLLM's OpenAI server is driven with streamed completions (each chunk's token ids counted); Triton's "
              "counters do not apply to it (vLLM's own are on its /metrics). Through Triton, the vLLM build is "
              "driven like every target: gRPC streams on the streaming model.")
    both = r.get("frontends")
    if both:
        doc.h(3, f"One vLLM build, two frontends ({both['ratio']})")
        _ratio_table(doc, both["levels"])
    doc.p("Triton's queue and compute times are per request of each model, from its metrics endpoint (the level's "
          "counters after minus before). The generation itself waits in the runtime's own scheduler, which Triton "
          "does not see: the decoupled models return from execute at once, so their compute time is not generation "
          "time. The streaming model turns tokens into text itself: it calls no postprocessing model.")
    comp = r.get("comparison")
    if comp:
        doc.h(3, f"Comparison ({comp['ratio']})")
        _ratio_table(doc, comp["levels"])
        reference = [targets.get(t["target"]).reference_runtime for t in r.get("targets", [])
                     if t.get("target") in targets.REGISTRY]
        if reference and any(reference) and not all(reference):
            doc.p("vLLM (its CPU build: bfloat16 compute, oneDNN INT8 GEMMs, its own continuous batching and paged "
                  "attention) against the CPU reference runtime (fp32 matmuls around simulated quantization): two "
                  "engines on the same machine and prompts"
                  + (", alternating level by level." if st.get("servers", "together") == "together" else
                     ", one server up at a time."))
        if reference and all(reference):
            doc.p("Both builds run on the CPU reference runtime, which turns quantized weights back into FP32 and "
                  "simulates activation and KV-cache quantization around the same FP32 matmuls: a quantized build "
                  "does more work per token there. These ratios measure that simulation, not what INT8 or FP8 buys "
                  "on a GPU.")
    else:
        doc.p(f"Comparison with a baseline: {NOT_RUN} (set bench.compare_repository, or `invoke bench "
              f"--compare-with <published repository>`).")
    d = r.get("definitions") or {}
    if d:
        doc.bullets([f"`{k}`: {v}" for k, v in d.items()])
    for name, alt in ((THROUGHPUT_PNG, "Throughput vs concurrency"),
                      (LATENCY_PNG, "TTFT, inter-token and end-to-end latency percentiles vs concurrency")):
        img = _copy_image(artifacts.stage_dir(work_dir, "bench") / name, out_dir, name)
        if img:
            doc.image(img, alt)


# what `invoke deploy-manifests` renders into the work dir
DEPLOY_DASHBOARD = (RENDERED_DIR, *DASHBOARD_FILE.split("/"))
DEPLOY_RULES = (RENDERED_DIR, *ALERTS_RULE_FILE.split("/"))


def alerts_during_bench(bench: Optional[dict], section: AlertsSection) -> list[dict]:
    """The bench levels whose figures pass an alert rule's threshold: {target, concurrency, alert, value,
    threshold}. Judged on the bench's own figures (the client's end-to-end latency over the level's requests);
    the rules hold a condition for ``for_minutes`` before firing, longer than a level lasts, so these are
    the alerts that would fire were the level's load sustained. A failed request stops bench, so the error-rate
    rule has nothing to judge here."""
    out = []
    for t in (bench or {}).get("targets", []):
        prefix = "Vllm" if t.get("frontend") == "openai" else "Triton"
        for level in t.get("levels", []):
            for alert, key, threshold in ((f"{prefix}LatencyTail", "p99_over_p50", section.latency_p99_over_p50),
                                          (f"{prefix}LatencyJitter", "jitter", section.latency_jitter)):
                value = dig(level, "e2e_ms", key)
                if value is not None and value > threshold:
                    out.append({"target": t["label"], "concurrency": level["concurrency"], "alert": alert,
                                "value": value, "threshold": threshold})
    return out


def _section_monitoring(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict], section: AlertsSection) -> None:
    doc.h(2, "Monitoring")
    dashboard, rules = work_dir.joinpath(*DEPLOY_DASHBOARD), work_dir.joinpath(*DEPLOY_RULES)
    if dashboard.is_file():
        doc.p(f"Dashboard (Grafana JSON; the ConfigMap beside it loads it through Grafana's sidecar): "
              f"[{dashboard.name}]({os.path.relpath(dashboard, out_dir)}); alert rules: "
              f"[{rules.name}]({os.path.relpath(rules, out_dir)}).")
    else:
        doc.p("Dashboard and alert rules: not rendered yet (`invoke deploy-manifests` writes them to "
              f"`{'/'.join(DEPLOY_DASHBOARD[:2])}/` in the work dir).")
    if m is None:
        return doc.not_run("bench (the alerts during bench)")
    fired = alerts_during_bench(maybe_bench_results(work_dir), section)
    if not fired:
        doc.p(f"Alerts during bench: none of the latency rules' thresholds was passed at any level (end-to-end "
              f"P99 / P50 over {section.latency_p99_over_p50:g}, jitter over {section.latency_jitter:g}).")
        return
    doc.p(f"Alerts during bench: these levels passed a rule's threshold. Each rule waits {section.for_minutes} "
          f"min before it fires, longer than a level lasts: they would fire were the load sustained.")
    doc.table(["target", "concurrency", "alert", "value", "threshold"],
              [[a["target"], a["concurrency"], a["alert"], f"{a['value']:.2f}", f"{a['threshold']:g}"] for a in fired])


def _section_serving_settings(doc: Doc, work_dir: Path, out_dir: Path, publish: Optional[dict]) -> None:
    """`invoke tune`'s choice against the SLA and its evidence, and what the published repository applies."""
    doc.h(2, "Serving settings")
    r = _read_json(work_dir / TUNE_DIR / RESULTS_FILE)
    if r is None:
        name = dig(publish or {}, "summary", "target")
        target = targets.get(name) if name in targets.REGISTRY else None
        how = ("`invoke tune`, with an SLA set, measures the serving settings on real servers and republishes with "
               "the best one" if target is None or target.tunable
               else f"`invoke tune` does not tune the {name} target's settings")
        if target is not None and target.gpu_only:
            how += (f"; where no tritonserver runs it writes the plan of points to measure ({PLAN_FILE}) and "
                    f"`invoke tune --results FILE` chooses from figures measured on the GPU")
        doc.p(f"Not tuned ({how}): the published repository uses the config's settings.")
        return
    load = r["load"]
    elsewhere = (f" Measured elsewhere: the figures are {r['measured_elsewhere']}'s, the choice was made here."
                 if r.get("measured_elsewhere") else "")
    doc.p(f"`invoke tune`: each setting published and measured on its own server under the same load "
          f"({load['requests']} requests of {load['prompt_tokens']} + {load['output_tokens']} tokens, "
          f"{load['concurrency']} in flight, closed loop); chosen: the most goodput among the settings whose P99s "
          f"keep the SLA ({fmt(r['sla'])} ms), the default unless another beats it by {r['min_gain']:.0%} "
          f"(`{TUNE_DIR}/{TABLE_FILE}`; the rule: pipeline/serving/tune.py).{elsewhere}")
    doc.table(["setting", "goodput req/s", "output tok/s", "TTFT P99 ms", "ITL P99 ms", "e2e P99 ms", "SLA"],
              [[p["label"], p["goodput_rps"], p["output_tokens_per_s"], p["ttft_p99_ms"], p["itl_p99_ms"],
                p["e2e_p99_ms"], "kept" if p["sla_met"] else "missed: " + ", ".join(p["violations"])]
               for p in r["points"]])
    doc.p(f"**Chosen**: {r['why']}.")
    ab = r.get("ab")
    if ab:
        doc.p(f"**A/B** (tuned vs default, {ab['rounds']} alternating round(s), {servers_said(ab)}, medians): goodput "
              f"{fmt(ab['tuned']['goodput_rps'])} vs {fmt(ab['default']['goodput_rps'])} req/s "
              f"(ratio {fmt(ab['goodput_ratio'])}); output tokens/s ratio {fmt(ab['output_tokens_per_s_ratio'])}.")
    tuned = dig(publish or {}, "summary", "tuned_settings") or {}
    if tuned.get("not_applied"):
        doc.p(f"Not applied by publish: {tuned['not_applied']}.")
    elif tuned:
        doc.p(f"Published with the tuned settings {fmt(tuned.get('applied'))}" +
              (f"; the config's own {fmt(tuned['config_wins'])} kept" if tuned.get("config_wins") else "") + ".")
    img = _copy_image(work_dir / TUNE_DIR / PLOT_FILE, out_dir, PLOT_FILE)
    if img:
        doc.image(img, "Output tokens/s against each bounded P99, one point per setting")


def _section_optimize(doc: Doc, work_dir: Path, out_dir: Path) -> None:
    """`invoke optimize`'s last choice: the candidates, the measured front, the choice, the side-by-side, the cost."""
    doc.h(2, "Plan and settings chosen together (invoke optimize)")
    folder = work_dir / artifacts.OPTIMIZE_DIR / artifacts.OPTIMIZE_RESULTS_DIR
    r = _read_json(folder / artifacts.OPTIMIZE_RESULTS_FILE)
    if r is None:
        doc.p("Not run: `invoke optimize` (with an SLA set) builds and gates candidate plans, measures them on real "
              "servers and publishes the best (plan, serving settings); this report's build is the config's own plan.")
        return
    doc.p(f"Objective: {r['goal']}, floor: {r['floor']}, SLA {fmt(r['sla'])} ms. Every candidate built and gated; "
          f"the survivors measured by successive halving (`{artifacts.OPTIMIZE_DIR}/{artifacts.OPTIMIZE_RESULTS_DIR}/"
          f"{artifacts.OPTIMIZE_TABLE_FILE}`; the rule: pipeline/optimize.py).")
    doc.table(["candidate", "outcome", "perplexity + %", "weights MiB", "best goodput req/s"],
              [[c["name"], c["status"] + (f": {c['why']}" if c["why"] else ""),
                dig(c, "accuracy", "perplexity_increase_pct"),
                round(c["weight_bytes"] / 2**20, 1) if c["weight_bytes"] else None,
                max((p["goodput_rps"] for p in c["points"]), default=None)] for c in r["candidates"]])
    front = ", ".join(f"{p['candidate']} ({p['label']})" for p in r["front"]) or "none"
    doc.p(f"**On the front** (no other point has more goodput, less perplexity increase and fewer weight bytes): "
          f"{front}.")
    doc.p(f"**Chosen**: {r['why']}." + (f" Published in {r['published']['repository']}." if r.get("published") else ""))
    side = r.get("side_by_side")
    if side:
        chosen = side["sides"][0]["key"]
        doc.p(f"**Side by side** ({side['rounds']} round(s), {servers_said(side)}, medians): " + "; ".join(
            f"{chosen} vs {k}: goodput {fmt(v['goodput'])}x, output tokens/s {fmt(v['output_tokens_per_s'])}x"
            for k, v in side["chosen_over"].items()) + ".")
    cost = r["cost"]
    doc.p(f"Cost: {cost['candidates']} candidates, {cost['built']} built, {cost['measured']} measured, "
          f"{cost['server_runs']} server runs, {cost['total_s']:.0f} s.")
    img = _copy_image(folder / artifacts.OPTIMIZE_PLOT_FILE, out_dir, artifacts.OPTIMIZE_PLOT_FILE)
    if img:
        doc.image(img, "Goodput against perplexity increase, one point per measured plan and settings")


def _read_json(path: Path) -> Optional[dict]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _section_chain(doc: Doc, chain: list[dict], work_dir: Path, manifests: dict) -> None:
    doc.h(2, "Chain of content hashes")
    doc.p("Each stage records the output digest of every stage it read; a link holds when that record equals the "
          "upstream stage's current output digest. From the source weights to the served repository:")
    weights = [(k, v["sha256"]) for k, v in (dig(manifests.get("model"), "outputs", "files") or {}).items()
               if k.endswith((".safetensors", ".gguf"))]
    ext = dig(manifests.get("model"), "inputs", "external", "sha256")
    prov = maybe_provenance(work_dir) or {}
    settings = maybe_build_settings(work_dir) or {}
    steps = []
    if ext:
        steps.append(["source", "the model file as downloaded", f"`{ext}`"])
    steps += [["model", f"prepared weights `{k}`", f"`{h}`"] for k, h in weights]
    for stage in STAGES:
        digest = dig(manifests.get(stage), "outputs", "digest")
        if digest:
            steps.append([stage, "stage output digest", f"`{digest}`"])
        if stage == "build" and settings.get("checkpoint_sha256"):
            steps.append(["build", "checkpoint the build serves (checkpoint_sha256)",
                          f"`{settings['checkpoint_sha256']}`"])
        if stage == "publish" and prov.get("repository_digest"):
            steps.append(["publish", "published repository (repository_digest)", f"`{prov['repository_digest']}`"])
    doc.table(["stage", "what", "sha256"], steps)
    doc.table(["stage", "read", "recorded digest", "current digest", "holds"],
              [[l["stage"], l["upstream"], short_hash(l["recorded"]), short_hash(l["actual"]), mark(l["ok"])]
               for l in chain])


def _section_runs(doc: Doc, manifests: dict) -> None:
    doc.h(2, "Stage runs")
    rows = []
    for stage, m in manifests.items():
        if m is None:
            rows.append([stage, NOT_RUN, "", "", ""])
            continue
        tv = m.get("tool_versions") or {}
        tools = ", ".join(f"{k} {tv[k]}" for k in ("torch", "transformers", "nvidia-modelopt", "tritonclient",
                                                   "nvidia-pytriton") if k in tv)
        rows.append([stage, "ok", m.get("finished_at"), f"{m.get('duration_s')} s", tools])
    doc.table(["stage", "status", "finished", "took", "tools"], rows)
