"""summary.json (the key figures, copied from the manifests unrounded), the five lines ``invoke all`` prints,
and the chain of content hashes from the weights to the published repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from pipeline import targets
from pipeline.release.report.document import NOT_RUN, mib
from pipeline.release.report.workdir import dig, maybe_build_settings, maybe_provenance, maybe_verify_results


def build_summary(work_dir: Path, manifests: dict[str, Optional[dict]]) -> dict:
    """The key figures, copied from the manifests as recorded (no rounding)."""
    s = {k: (m or {}).get("summary") for k, m in manifests.items()}
    quant_cfg = dig(manifests["quantize"], "inputs", "config", "quantization") or {}
    prov = maybe_provenance(work_dir)
    settings = maybe_build_settings(work_dir)
    verify = maybe_verify_results(work_dir)
    smoke = dig(s["build"], "smoke_test") or {}
    kv_pool = smoke.get("kv_pool_bytes")
    blocks, tpb = dig(s["build"], "kv_blocks"), dig(s["build"], "tokens_per_block")
    acc = dig(s["quantize"], "accuracy")
    chain = hash_chain(work_dir, manifests)
    out = {
        "format_version": 1,
        "config_name": work_dir.name,  # a work dir is named after its config (an upstream stage may come from
                                       # another config's run with the same inputs)
        "stages": {k: ("ok" if m else NOT_RUN) for k, m in manifests.items()},
        "target": dig(settings, "target"),
        "reference_runtime": bool(dig(settings, "target")) and targets.get(dig(settings, "target")).reference_runtime,
        "model": dig(s["model"], "model"),
        "quantization": None if manifests["quantize"] is None else {
            "weight_format": quant_cfg.get("weight_format"),
            "kv_cache": quant_cfg.get("kv_cache"),
            "quant_algo": dig(s["quantize"], "checkpoint", "quant_algo"),
            "kv_cache_quant_algo": dig(s["quantize"], "checkpoint", "kv_cache_quant_algo"),
            "kept_high_precision": dig(s["plan"], "kept_high_precision"),
            "layers": dig(s["plan"], "layers"),
            "effective_bits_per_weight": dig(s["plan"], "effective_bits_per_weight"),
        },
        "accuracy": acc,
        "accuracy_gate": quant_cfg.get("accuracy"),
        # the vllm target: the same figures measured in vLLM on its export at build time, and its KV-cache dtype
        "served_accuracy": dig(s["build"], "check"),
        "served_kv_cache_dtype": dig(s["build"], "kv_cache_dtype"),
        "kv_cache": kv_cache_receipt(quant_cfg.get("kv_cache"), s["build"], dig(settings, "target")),
        "sizes": {
            "model_weight_bytes": dig(s["model"], "model", "weight_bytes"),
            "weight_bytes_fp16": dig(s["plan"], "weight_bytes_fp16"),
            "weight_bytes_planned": dig(s["plan"], "weight_bytes_planned"),
            "checkpoint_bytes": dig(s["quantize"], "checkpoint_bytes"),
            # what the checkpoint holds besides the plan's linears: the embedding, unless it is the tied lm_head
            # the plan counts (stored once: pipeline.quant.tied_head)
            "embedding_bytes": dig(s["quantize"], "checkpoint", "embedding_bytes"),
            "lm_head_shares_embedding": dig(s["quantize"], "checkpoint", "lm_head_shares_embedding"),
            "kv_cache_pool_bytes": kv_pool,
            "kv_cache_bytes_per_token": kv_pool / (blocks * tpb) if kv_pool and blocks and tpb else None,
        },
        "repository": None if prov is None else {
            "model_name": prov.get("model_name"), "version": prov.get("version"),
            "repository_digest": prov.get("repository_digest"), "checkpoint_sha256": prov.get("checkpoint_sha256"),
        },
        "verify": None if verify is None else {
            "ok": verify.get("ok"), "checks": len(verify.get("checks", [])),
            "passed": sum(1 for c in verify.get("checks", []) if c.get("ok")),
            "failed": [c["name"] for c in verify.get("checks", []) if not c.get("ok")],
        },
        "bench": None if s["bench"] is None else {
            k: s["bench"].get(k) for k in ("peak_output_tokens_per_s", "peak_at_concurrency", "knee_concurrency",
                                           "knee", "levels", "comparison", "sla")
        },
        "hash_chain_ok": all(l["ok"] is not False for l in chain) if chain else None,
    }
    return out


# vLLM's kv_cache_dtype -> the KV format it stores (auto: the model's own dtype, unquantized)
VLLM_KV_FORMATS = {"auto": "none", "fp8": "fp8", "fp8_e4m3": "fp8"}


def kv_cache_receipt(gate_kv: Optional[str], build: Optional[dict], target: Optional[str]) -> Optional[dict]:
    """Which KV-cache format the build serves, and what measured it: the quantize stage's accuracy gate (which
    simulates quantization.kv_cache with ModelOpt's K/V quantizers), the engine's own check at build time (vLLM's:
    perplexity through vLLM with the KV dtype it serves), both, or neither. None before a build."""
    if build is None:
        return None
    if build.get("kv_cache_dtype"):  # vLLM chose its own (pipeline.engines.vllm.engine_args.kv_cache_dtype)
        dtype = build["kv_cache_dtype"]
        served = VLLM_KV_FORMATS.get(dtype, dtype)
        checked = dig(build, "check", "kv_cache", "dtype") == dtype
    else:  # the checkpoint's kv_cache_quant_algo, as the runtime loaded it
        served = (build.get("kv_cache_quant_algo") or "none").lower()
        checked = False
    measured_by = [who for who, did in (("the accuracy gate", served == gate_kv),
                                        (f"the build's {_engine_label(target)} check", checked)) if did]
    return {"served": served, "target": target, "gate": gate_kv, "measured_by": measured_by}


def kv_cache_sentence(kv: Optional[dict]) -> str:
    """One sentence: the KV format served and what measured it."""
    if kv is None:
        return f"KV cache: build {NOT_RUN}"
    served = "unquantized (the model's dtype)" if kv["served"] == "none" else kv["served"]
    text = f"KV cache {served} served ({kv['target']} target)"
    if kv["measured_by"]:
        text += ", measured by " + " and ".join(kv["measured_by"])
    else:
        text += ", measured by no accuracy check"
    if "the accuracy gate" not in kv["measured_by"]:
        text += f" (the accuracy gate measured {kv['gate']})"
    return text


def five_lines(summary: dict) -> list[str]:
    """What `invoke all` prints at the end: model and plan, accuracy, sizes, serving, speed."""
    m, q, a, z = summary.get("model") or {}, summary.get("quantization"), summary.get("accuracy"), summary["sizes"]
    lines = []
    if q:
        lines.append(f"{summary['config_name']}: {m.get('architecture', '?')} {m.get('num_parameters', 0) / 1e6:.3g}M "
                     f"params; {q['weight_format']} weights; {q['kept_high_precision']} of "
                     f"{q['layers']} layers kept high precision ({q['effective_bits_per_weight']} bits/weight)")
    else:
        lines.append(f"{summary['config_name']}: quantize {NOT_RUN}")
    if a:
        served = summary.get("served_accuracy")
        lines.append(f"accuracy: perplexity {a['perplexity_original']:.2f} -> {a['perplexity_quantized']:.2f} "
                     f"(+{a['perplexity_increase_pct']:.2f} %), top-1 agreement {a['top1_agreement']:.3f}, "
                     f"KL {a['kl_divergence']:.4f}"
                     + (f"; in vLLM: perplexity {served['perplexity']['vllm']:.2f} "
                        f"(+{served['perplexity_increase_pct']:.2f} %), top-1 agreement "
                        f"{served['top1_agreement_with_original']:.3f}" if served else ""))
    else:
        lines.append(f"accuracy: {NOT_RUN}")
    per_token = z.get("kv_cache_bytes_per_token")
    lines.append(f"size: checkpoint {mib(z.get('checkpoint_bytes'))} (planned {mib(z.get('weight_bytes_planned'))}"
                 + _embedding_clause(z) + f"; all-FP16 linears {mib(z.get('weight_bytes_fp16'))}); "
                 + kv_cache_sentence(summary.get("kv_cache"))
                 + (f", {per_token:,.0f} bytes/token" if per_token else ""))
    r, v = summary.get("repository"), summary.get("verify")
    lines.append(
        (f"serving: {_engine_label(summary.get('target'))} model {r['model_name']} "
         f"v{r['version']} (repository {r['repository_digest'][:12]})"
         if r else f"serving: publish {NOT_RUN}")
        + (f"; verify {v['passed']}/{v['checks']} checks passed" if v else f"; verify {NOT_RUN}"))
    b = summary.get("bench")
    if b:
        knee = (f"knee at concurrency {b['knee_concurrency']}" if b.get("knee_concurrency")
                else "no knee within the sweep")
        c1 = (b.get("levels") or [{}])[0]
        ref = " (CPU reference runtime, not TensorRT)" if summary.get("reference_runtime") else ""
        lines.append(f"speed{ref}: peak {b['peak_output_tokens_per_s']:.1f} output tokens/s at concurrency "
                     f"{b['peak_at_concurrency']}, {knee}; TTFT P50 {c1.get('ttft_p50_ms')} ms at concurrency "
                     f"{c1.get('concurrency')}" + _sla_clause(b.get("sla")))
    else:
        lines.append(f"speed: bench {NOT_RUN}")
    return lines


def _embedding_clause(z: dict) -> str:
    """What the checkpoint holds besides the plan's linears: the embedding when it is not the tied lm_head."""
    if z.get("lm_head_shares_embedding"):
        return ", lm_head stored once as the tied embedding"
    if z.get("embedding_bytes"):
        return f" + the embedding {mib(z['embedding_bytes'])}"
    return ""


def _sla_clause(choice: Optional[dict]) -> str:
    if not choice:
        return ""
    if choice["met"]:
        return f"; SLA kept up to concurrency {choice['concurrency']} (goodput {choice['goodput_rps']:.2f} req/s)"
    return "; no level keeps the SLA"


def hash_chain(work_dir: Path, manifests: dict[str, Optional[dict]]) -> list[dict]:
    """Each link: a stage's recorded input digest of its upstream stage equals that stage's output digest."""
    links = []
    for stage, m in manifests.items():
        if m is None:
            continue
        for dep, recorded in (dig(m, "inputs", "upstream") or {}).items():
            dm = manifests.get(dep)
            actual = dig(dm, "outputs", "digest") if dm else None
            links.append({"stage": stage, "upstream": dep, "recorded": recorded, "actual": actual,
                          "ok": None if dm is None else recorded == actual})
    settings = maybe_build_settings(work_dir)
    prov = maybe_provenance(work_dir)
    if settings and prov:
        links.append({"stage": "publish", "upstream": "build (checkpoint_sha256)",
                      "recorded": prov.get("checkpoint_sha256"), "actual": settings.get("checkpoint_sha256"),
                      "ok": prov.get("checkpoint_sha256") == settings.get("checkpoint_sha256")})
    bench = dig(manifests.get("bench"), "summary", "repository_digest")
    if bench and prov:
        links.append({"stage": "bench", "upstream": "publish (repository_digest)", "recorded": bench,
                      "actual": prov.get("repository_digest"), "ok": bench == prov.get("repository_digest")})
    return links


def _engine_label(name: Optional[str]) -> str:
    """What serves a build of target ``name`` ("vLLM", "Triton"), as the target says (Target.engine_label)."""
    return targets.get(name).engine_label if name in targets.REGISTRY else "Triton"
