"""report stage: the page people read, made from the stages' manifests and the files they recorded.

``report/index.html`` and its Markdown twin ``report/index.md`` are rendered from one list of blocks, so the
two say the same; ``report/summary.json`` holds the key figures for CI systems, copied from the manifests
unrounded. Plots are copied beside the page (``report/img/``). A stage without a manifest is shown as
"not run", never filled in.

Sections: at a glance (the five lines ``invoke all`` prints), source, text, sensitivity, plan, quantization
and accuracy, sizes (checkpoint, KV cache), build, the Triton repository, verify, bench, the chain of
content hashes from the weights to the repository, and the stage runs (when, how long, tool versions).
"""

from __future__ import annotations

import html
import json
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from pipeline import artifacts

IMG_DIR = "img"
STAGES = tuple(s for s in artifacts.STAGE_TASK if s != "report")  # the stages the report covers
NOT_RUN = "not run"
TOP_LAYERS = 15  # rows of the sensitivity table on the page (the full table is linked)


# ---------------------------------------------------------------- one document, two renderings


@dataclass
class Doc:
    """Blocks rendered both as Markdown and as HTML."""

    blocks: list[tuple[str, Any]] = field(default_factory=list)

    def h(self, level: int, text: str) -> None:
        self.blocks.append(("h", (level, text)))

    def p(self, text: str) -> None:
        self.blocks.append(("p", text))

    def bullets(self, items: list[str]) -> None:
        self.blocks.append(("ul", items))

    def table(self, header: list[str], rows: list[list[Any]]) -> None:
        self.blocks.append(("table", (header, rows)))

    def kv(self, pairs: list[tuple[str, Any]]) -> None:
        self.table(["", ""], [[k, v] for k, v in pairs])

    def image(self, src: str, alt: str) -> None:
        self.blocks.append(("img", (src, alt)))

    def code(self, text: str) -> None:
        self.blocks.append(("pre", text))

    def not_run(self, stage: str) -> None:
        task = artifacts.STAGE_TASK.get(stage, stage)
        self.p(f"**{NOT_RUN}**: the `{stage}` stage has no manifest in this work dir (`invoke {task}` runs it).")

    def markdown(self) -> str:
        out = []
        for kind, arg in self.blocks:
            if kind == "h":
                out.append("#" * arg[0] + " " + arg[1])
            elif kind == "p":
                out.append(arg)
            elif kind == "ul":
                out.append("\n".join(f"- {i}" for i in arg))
            elif kind == "table":
                header, rows = arg
                cell = lambda v: _text(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
                lines = ["| " + " | ".join(cell(h) for h in header) + " |", "|" + "---|" * len(header)]
                lines += ["| " + " | ".join(cell(v) for v in r) + " |" for r in rows]
                out.append("\n".join(lines))
            elif kind == "img":
                out.append(f"![{arg[1]}]({arg[0]})")
            elif kind == "pre":
                out.append("```\n" + arg.rstrip("\n") + "\n```")
        return "\n\n".join(out) + "\n"

    def html(self, title: str) -> str:
        body = []
        for kind, arg in self.blocks:
            if kind == "h":
                level, text = arg
                anchor = f' id="{_slug(text)}"' if level == 2 else ""
                body.append(f"<h{level}{anchor}>{_inline(text)}</h{level}>")
            elif kind == "p":
                body.append(f"<p>{_inline(arg)}</p>")
            elif kind == "ul":
                body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in arg) + "</ul>")
            elif kind == "table":
                header, rows = arg
                head = "" if not any(header) else \
                    "<thead><tr>" + "".join(f"<th>{_inline(_text(h))}</th>" for h in header) + "</tr></thead>"
                trs = "".join("<tr>" + "".join(f"<td>{_inline(_text(v))}</td>" for v in r) + "</tr>" for r in rows)
                body.append(f"<table>{head}<tbody>{trs}</tbody></table>")
            elif kind == "img":
                body.append(f'<figure><img src="{html.escape(arg[0])}" alt="{html.escape(arg[1])}">'
                            f"<figcaption>{html.escape(arg[1])}</figcaption></figure>")
            elif kind == "pre":
                body.append(f"<pre>{html.escape(arg)}</pre>")
        toc = "".join(f'<a href="#{_slug(a[1])}">{html.escape(a[1])}</a>' for k, a in self.blocks
                      if k == "h" and a[0] == 2)
        return (f"<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
                f"<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
                f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body><nav>{toc}</nav>"
                f"<main>\n" + "\n".join(body) + "\n</main></body></html>\n")


_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",sans-serif;color:#1d2330;margin:0;background:#f6f7f9}
nav{position:sticky;top:0;background:#1d2330;padding:6px 16px;z-index:1}
nav a{color:#cfd6e4;margin-right:14px;text-decoration:none;font-size:12px}
main{max-width:1180px;margin:0 auto;padding:8px 24px 48px;background:#fff}
h1{font-size:24px;margin:18px 0 6px}
h2{font-size:19px;margin:30px 0 8px;border-bottom:2px solid #e3e6ec;padding-bottom:4px}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:8px 0 14px;font-size:12.5px;display:block;overflow-x:auto}
th,td{border:1px solid #dde1e8;padding:3px 8px;text-align:left;vertical-align:top}
th{background:#eef1f5}tbody tr:nth-child(even){background:#fafbfc}
code{background:#eef1f5;padding:0 3px;border-radius:3px;font-size:12px;overflow-wrap:anywhere}
pre{background:#f0f2f5;padding:8px;overflow-x:auto;font-size:12px}
figure{margin:10px 0}img{max-width:100%;border:1px solid #e3e6ec}figcaption{font-size:12px;color:#5a6272}
.ok{color:#1e7d32;font-weight:600}.bad{color:#c62828;font-weight:600}
"""


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in text.lower()).strip("-")


def _text(v: Any) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1000 else f"{v:,.0f}"
    if isinstance(v, int):
        return f"{v:,}" if abs(v) >= 10000 else str(v)
    if isinstance(v, (list, tuple)):
        return ", ".join(_text(x) for x in v)
    if isinstance(v, dict):
        return ", ".join(f"{k}: {_text(x)}" for k, x in v.items())
    return str(v)


_LINK = re.compile(r"\[([^\]`]+)\]\(([A-Za-z0-9_./#-]+)\)")


def _inline(text: str) -> str:
    """HTML for the little Markdown the report uses: `code`, **bold**, [links](href), ✓/✗ marks."""
    out, i = [], 0
    s = html.escape(text, quote=False)
    while i < len(s):
        link = _LINK.match(s, i)
        if link:
            out.append(f'<a href="{html.escape(link.group(2))}">{link.group(1)}</a>')
            i = link.end()
        elif s[i] == "`" and "`" in s[i + 1:]:
            j = s.index("`", i + 1)
            out.append(f"<code>{s[i + 1:j]}</code>")
            i = j + 1
        elif s.startswith("**", i) and "**" in s[i + 2:]:
            j = s.index("**", i + 2)
            out.append(f"<strong>{s[i + 2:j]}</strong>")
            i = j + 2
        else:
            out.append(s[i])
            i += 1
    return "".join(out).replace("✓", '<span class="ok">✓</span>').replace("✗", '<span class="bad">✗</span>')


# ---------------------------------------------------------------- reading the work dir


def read_manifests(work_dir: Path) -> dict[str, Optional[dict]]:
    """Each stage's manifest (None: not run, or its last run did not finish ok)."""
    out = {}
    for stage in STAGES:
        try:
            m = json.loads((work_dir / stage / artifacts.MANIFEST_FILE).read_text())
        except (OSError, ValueError):
            m = None
        out[stage] = m if m and m.get("status") == "ok" else None
    return out


def _json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _get(d: Optional[dict], *keys, default=None):
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return default
        d = d[k]
    return d


def _mib(n: Optional[float]) -> str:
    return "—" if n is None else f"{n / 2**20:,.1f} MiB"


def _short(h: Optional[str]) -> str:
    return f"`{h[:16]}…`" if h else "—"


def _mark(ok: Optional[bool]) -> str:
    return "—" if ok is None else ("✓" if ok else "✗")


# ---------------------------------------------------------------- summary.json


def build_summary(work_dir: Path, manifests: dict[str, Optional[dict]]) -> dict:
    """The key figures, copied from the manifests as recorded (no rounding)."""
    s = {k: (m or {}).get("summary") for k, m in manifests.items()}
    quant_cfg = _get(manifests["quantize"], "inputs", "config", "quantization") or {}
    prov = _json(work_dir / "publish" / "model_repository" / "provenance.json")
    settings = _json(work_dir / "build" / "build_settings.json")
    verify = _json(work_dir / "verify" / "verify_results.json")
    smoke = _get(s["build"], "smoke_test") or {}
    kv_pool = smoke.get("kv_pool_bytes")
    blocks, tpb = _get(s["build"], "kv_blocks"), _get(s["build"], "tokens_per_block")
    acc = _get(s["quantize"], "accuracy")
    chain = hash_chain(work_dir, manifests)
    out = {
        "format_version": 1,
        "config_name": next((m["config_name"] for m in manifests.values() if m), work_dir.name),
        "stages": {k: ("ok" if m else NOT_RUN) for k, m in manifests.items()},
        "target": _get(settings, "target"),
        "reference_runtime": _get(settings, "target") == "cpu",
        "model": _get(s["model"], "model"),
        "quantization": None if manifests["quantize"] is None else {
            "weight_format": quant_cfg.get("weight_format"),
            "kv_cache": quant_cfg.get("kv_cache"),
            "quant_algo": _get(s["quantize"], "checkpoint", "quant_algo"),
            "kv_cache_quant_algo": _get(s["quantize"], "checkpoint", "kv_cache_quant_algo"),
            "kept_high_precision": _get(s["plan"], "kept_high_precision"),
            "layers": _get(s["plan"], "layers"),
            "effective_bits_per_weight": _get(s["plan"], "effective_bits_per_weight"),
        },
        "accuracy": acc,
        "accuracy_gate": quant_cfg.get("accuracy"),
        "sizes": {
            "model_weight_bytes": _get(s["model"], "model", "weight_bytes"),
            "weight_bytes_fp16": _get(s["plan"], "weight_bytes_fp16"),
            "weight_bytes_planned": _get(s["plan"], "weight_bytes_planned"),
            "checkpoint_bytes": _get(s["quantize"], "checkpoint_bytes"),
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
                                           "knee", "levels", "comparison")
        },
        "hash_chain_ok": all(l["ok"] is not False for l in chain) if chain else None,
    }
    return out


def five_lines(summary: dict) -> list[str]:
    """What `invoke all` prints at the end: model and plan, accuracy, sizes, serving, speed."""
    m, q, a, z = summary.get("model") or {}, summary.get("quantization"), summary.get("accuracy"), summary["sizes"]
    lines = []
    if q:
        lines.append(f"{summary['config_name']}: {m.get('architecture', '?')} {m.get('num_parameters', 0) / 1e6:.3g}M "
                     f"params; {q['weight_format']} weights, {q['kv_cache']} KV cache; {q['kept_high_precision']} of "
                     f"{q['layers']} layers kept high precision ({q['effective_bits_per_weight']} bits/weight)")
    else:
        lines.append(f"{summary['config_name']}: quantize {NOT_RUN}")
    if a:
        lines.append(f"accuracy: perplexity {a['perplexity_original']:.2f} -> {a['perplexity_quantized']:.2f} "
                     f"(+{a['perplexity_increase_pct']:.2f} %), top-1 agreement {a['top1_agreement']:.3f}, "
                     f"KL {a['kl_divergence']:.4f}")
    else:
        lines.append(f"accuracy: {NOT_RUN}")
    kv = z.get("kv_cache_bytes_per_token")
    lines.append(f"size: checkpoint {_mib(z.get('checkpoint_bytes'))} "
                 f"(all-FP16 linears {_mib(z.get('weight_bytes_fp16'))}, "
                 f"planned {_mib(z.get('weight_bytes_planned'))}); KV cache "
                 f"{f'{kv:,.0f} bytes/token' if kv else NOT_RUN}")
    r, v = summary.get("repository"), summary.get("verify")
    lines.append(
        (f"serving: Triton model {r['model_name']} v{r['version']} (repository {r['repository_digest'][:12]})"
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
                     f"{c1.get('concurrency')}")
    else:
        lines.append(f"speed: bench {NOT_RUN}")
    return lines


# ---------------------------------------------------------------- the hash chain


def hash_chain(work_dir: Path, manifests: dict[str, Optional[dict]]) -> list[dict]:
    """Each link: a stage's recorded input digest of its upstream stage equals that stage's output digest."""
    links = []
    for stage, m in manifests.items():
        if m is None:
            continue
        for dep, recorded in (_get(m, "inputs", "upstream") or {}).items():
            dm = manifests.get(dep)
            actual = _get(dm, "outputs", "digest") if dm else None
            links.append({"stage": stage, "upstream": dep, "recorded": recorded, "actual": actual,
                          "ok": None if dm is None else recorded == actual})
    settings = _json(work_dir / "build" / "build_settings.json")
    prov = _json(work_dir / "publish" / "model_repository" / "provenance.json")
    if settings and prov:
        links.append({"stage": "publish", "upstream": "build (checkpoint_sha256)",
                      "recorded": prov.get("checkpoint_sha256"), "actual": settings.get("checkpoint_sha256"),
                      "ok": prov.get("checkpoint_sha256") == settings.get("checkpoint_sha256")})
    bench = _get(manifests.get("bench"), "summary", "repository_digest")
    if bench and prov:
        links.append({"stage": "bench", "upstream": "publish (repository_digest)", "recorded": bench,
                      "actual": prov.get("repository_digest"), "ok": bench == prov.get("repository_digest")})
    return links


# ---------------------------------------------------------------- sections


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
    ext = _get(m, "inputs", "external") or {}
    cfg_src = _get(m, "inputs", "config", "model", "source") or {}
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
        pairs.append(("conversion checks", ", ".join(f"{k}: {_text(v)}" for k, v in checks.items()
                                                     if not isinstance(v, dict))))
    doc.kv(pairs)
    doc.h(3, "Architecture")
    doc.kv([(k, v) for k, v in arch.items()])
    doc.h(3, "Files of the prepared model folder")
    files = m["outputs"]["files"]
    doc.table(["file", "size", "sha256"], [[f"`{k}`", _mib(v["size_bytes"]) if v["size_bytes"] > 2**20 else
                                            f"{v['size_bytes']:,} B", f"`{v['sha256']}`"] for k, v in files.items()])


def _section_text(doc: Doc, m: Optional[dict]) -> None:
    doc.h(2, "Calibration and evaluation text")
    if m is None:
        return doc.not_run("text")
    s = m["summary"]
    rows = [[name, s[name]["num_samples"], s[name]["seq_len"], s[name]["tokens"], len(s[name]["documents"])]
            for name in ("calibration", "evaluation") if name in s]
    doc.p(f"{s.get('source_documents')} source documents, split by document so calibration and evaluation never "
          f"share text; source `{_get(m, 'inputs', 'config', 'text', 'source', 'kind')}`.")
    doc.table(["set", "samples", "tokens per sample", "tokens", "documents"], rows)


def _section_sensitivity(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Sensitivity")
    if m is None:
        return doc.not_run("sensitivity")
    s = m["summary"]
    decision = s.get("decision_column")
    doc.p(f"Per-layer relative output error ||ref(x) − q(x)|| / ||ref(x)|| on {s.get('calibration_tokens'):,} "
          f"calibration tokens, one layer quantized at a time; the plan decides on the `{decision}` column with "
          f"threshold {s.get('threshold')}.")
    doc.kv([("layers", s.get("layers")), ("over the threshold", s.get("over_threshold")),
            ("embedding INT8 error (reported, not quantized)", s.get("embedding_int8_error")),
            ("analysis time", f"{s.get('analysis_s')} s"), ("peak memory", _mib(s.get("peak_rss_bytes")))])
    table = _json(work_dir / "sensitivity" / "sensitivity_table.json")
    if table and table.get("layers"):
        fmts = list(table["layers"][0]["errors"])
        layers = sorted(table["layers"], key=lambda l: -l["errors"].get(decision, {}).get("error", 0.0))
        doc.h(3, f"The {TOP_LAYERS} most sensitive layers (of {len(layers)})")
        doc.table(["layer"] + [f"{f} error" for f in fmts] + ["input amax", "outlier ratio"],
                  [[f"`{l['name']}`"] + [l["errors"][f]["error"] for f in fmts] +
                   [l["activation"]["amax"], l["activation"]["outlier_ratio"]] for l in layers[:TOP_LAYERS]])
        if (work_dir / "sensitivity" / "sensitivity_table.md").is_file():
            shutil.copy2(work_dir / "sensitivity" / "sensitivity_table.md", out_dir / "sensitivity_table.md")
            doc.p("The full table: [sensitivity_table.md](sensitivity_table.md).")
    img = _copy_image(work_dir / "sensitivity" / "sensitivity_heatmap.png", out_dir, "sensitivity_heatmap.png")
    if img:
        doc.image(img, "Relative output error per layer (decoder block x module), per format")


def _section_plan(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Plan")
    if m is None:
        return doc.not_run("plan")
    s = m["summary"]
    doc.kv([("mode", s.get("mode")), ("formats", s.get("formats")), ("layers", s.get("layers")),
            ("kept in high precision", s.get("kept_high_precision")), ("mixed precision", s.get("mixed_precision")),
            ("effective bits per weight", s.get("effective_bits_per_weight")),
            ("weight bytes planned / all-FP16", f"{_mib(s.get('weight_bytes_planned'))} / "
                                                f"{_mib(s.get('weight_bytes_fp16'))}"),
            ("error left in quantized layers (sum)", s.get("total_error_left")), ("budget", s.get("budget")),
            ("edited by hand", s.get("hand_edited", False))])
    plan = _plan_layers(work_dir / "plan" / "plan.yaml")
    if plan:
        base = plan.get("base_format")
        special = [(n, e) for n, e in plan["layers"].items() if e.get("format") != base]
        doc.h(3, f"Layers not in the base format ({base}), with the plan's reasons")
        doc.table(["layer", "format", "error", "reason"],
                  [[f"`{n}`", e.get("format"), e.get("error"), e.get("reason")] for n, e in special])
    img = _copy_image(work_dir / "plan" / "sensitivity_errors.png", out_dir, "plan_errors.png")
    if img:
        doc.image(img, "Per-layer error on the decision column; red: kept in high precision")


def _plan_layers(path: Path) -> Optional[dict]:
    import yaml

    try:
        return yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError):
        return None


def _section_quantize(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Quantization and accuracy")
    if m is None:
        return doc.not_run("quantize")
    s = m["summary"]
    q = _get(m, "inputs", "config", "quantization") or {}
    ck = s.get("checkpoint") or {}
    doc.kv([("weight format", q.get("weight_format")), ("KV cache", q.get("kv_cache")),
            ("SmoothQuant alpha", q.get("smoothquant_alpha")), ("checkpoint quant_algo", ck.get("quant_algo")),
            ("checkpoint KV-cache algo", ck.get("kv_cache_quant_algo")), ("weight dtypes", ck.get("weight_dtypes")),
            ("modules excluded from quantization", len(ck.get("exclude_modules") or [])),
            ("read back by the pipeline's reader", _get(ck, "read_back")),
            ("calibration tokens", s.get("calibration_tokens")), ("evaluation tokens", s.get("evaluation_tokens")),
            ("time", s.get("timing_s")), ("peak memory", _mib(s.get("peak_rss_bytes")))])
    a, gate = s.get("accuracy") or {}, q.get("accuracy") or {}
    fc = a.get("from_checkpoint") or {}
    doc.h(3, "Accuracy on the held-out evaluation text")
    doc.table(["figure", "quantized model (fake-quant)", "exported checkpoint (read back)", "gate"], [
        ["perplexity, original", a.get("perplexity_original"), a.get("perplexity_original"), ""],
        ["perplexity, quantized", a.get("perplexity_quantized"), fc.get("perplexity_quantized"), ""],
        ["perplexity increase %", a.get("perplexity_increase_pct"), fc.get("perplexity_increase_pct"),
         f"≤ {gate.get('max_perplexity_increase_pct')}"],
        ["top-1 agreement", a.get("top1_agreement"), fc.get("top1_agreement"), f"≥ {gate.get('min_top1_agreement')}"],
        ["KL divergence", a.get("kl_divergence"), fc.get("kl_divergence"), f"≤ {gate.get('max_kl_divergence')}"],
    ])
    doc.p(f"{a.get('tokens')} evaluation tokens, teacher-forced. The gate passed (the stage fails otherwise). The "
          f"read-back column runs the exported checkpoint through the pipeline's own reader, without the KV-cache "
          f"quantization (the CPU runtime adds it).")
    gens = _get(_json(work_dir / "quantize" / "accuracy.json"), "generations")
    if gens:
        doc.h(3, "Greedy generations (a poor accuracy signal on a small model; shown for a feel)")
        doc.table(["prompt", "original", "quantized"], [[g["prompt"], g["original"], g["quantized"]] for g in gens])


def _section_sizes(doc: Doc, summary: dict, build: Optional[dict]) -> None:
    doc.h(2, "Checkpoint and KV-cache sizes")
    z = summary["sizes"]
    doc.table(["what", "bytes", ""], [
        ["prepared model weights (as loaded)", z.get("model_weight_bytes"), _mib(z.get("model_weight_bytes"))],
        ["linear layers, all FP16", z.get("weight_bytes_fp16"), _mib(z.get("weight_bytes_fp16"))],
        ["linear layers, as planned", z.get("weight_bytes_planned"), _mib(z.get("weight_bytes_planned"))],
        ["TensorRT-LLM checkpoint on disk", z.get("checkpoint_bytes"), _mib(z.get("checkpoint_bytes"))],
        ["KV-cache pool (cpu runtime)", z.get("kv_cache_pool_bytes"), _mib(z.get("kv_cache_pool_bytes"))],
        ["KV cache per token", z.get("kv_cache_bytes_per_token"), ""],
    ])
    if build:
        b = build["summary"]
        doc.p(f"KV cache: {b.get('kv_cache_quant_algo') or 'unquantized'}, {b.get('kv_blocks')} blocks of "
              f"{b.get('tokens_per_block')} tokens.")


def _section_build(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Build")
    if m is None:
        return doc.not_run("build")
    settings = _json(work_dir / "build" / "build_settings.json") or {}
    if settings.get("target") == "cpu":
        doc.p("Target `cpu`: the CPU reference runtime (pipeline.cpu_runtime) serving the exported quantized "
              "checkpoint. A reference for correctness and wiring, **not a TensorRT engine**; its speed says "
              "nothing about a GPU's.")
    doc.kv([(k, v) for k, v in settings.items() if k != "provenance"])
    doc.h(3, "Provenance")
    doc.kv([(k, v) for k, v in (settings.get("provenance") or {}).items()])
    smoke = m["summary"].get("smoke_test")
    if smoke:
        doc.p(f"Smoke test after the build: `{smoke.get('prompt')}` → `{smoke.get('output')}` "
              f"(loaded in {smoke.get('load_s')} s).")


def _section_repository(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Triton repository")
    if m is None:
        return doc.not_run("publish")
    prov = _json(work_dir / "publish" / "model_repository" / "provenance.json") or {}
    doc.kv([(k, v if not isinstance(v, str) or len(v) < 40 else f"`{v}`") for k, v in prov.items()
            if k not in ("model_source", "build", "models")])
    models = m["summary"].get("models") or sorted({f.split("/")[1] for f in m["outputs"]["files"]
                                                   if f.startswith("model_repository/") and f.count("/") >= 2})
    files = m["outputs"]["files"]
    rows = []
    for name in models:
        mine = {k: v for k, v in files.items() if k.startswith(f"model_repository/{name}/")}
        cfg = _model_config(work_dir / "publish" / "model_repository" / name / "config.pbtxt")
        rows.append([f"`{name}`", cfg.get("kind"), cfg.get("max_batch_size"), cfg.get("decoupled"),
                     cfg.get("inputs"), cfg.get("outputs"), len(mine),
                     _mib(sum(v["size_bytes"] for v in mine.values()))])
    doc.table(["model", "backend / platform", "max batch", "decoupled", "inputs", "outputs", "files", "size"], rows)
    doc.p(f"Live repository (where versions accumulate): `{m['summary'].get('repository_dir')}`; versions kept: "
          f"{_text(m['summary'].get('versions_kept'))}. The stage's own copy holds the version just published.")
    doc.p(f"Published repository digest (sha256 over every file of the version, sorted by path): "
          f"`{prov.get('repository_digest')}`.")


def _model_config(path: Path) -> dict:
    """What a reader wants from a config.pbtxt (parsed as the ModelConfig protobuf it was written from)."""
    try:
        from pipeline.serving.publish import read_config

        msg = read_config(path)
    except Exception:  # noqa: BLE001 - an unreadable config is shown as unknown, the report still renders
        return {}
    return {"kind": msg.backend or msg.platform, "max_batch_size": msg.max_batch_size,
            "decoupled": msg.model_transaction_policy.decoupled,
            "inputs": ", ".join(i.name + ("?" if i.optional else "") for i in msg.input),
            "outputs": ", ".join(o.name for o in msg.output)}


def _section_verify(doc: Doc, work_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Verify")
    if m is None:
        return doc.not_run("verify")
    r = _json(work_dir / "verify" / "verify_results.json") or {}
    doc.p(f"A real Triton server ({_get(r, 'server', 'binary')}, ready in {_get(r, 'server', 'startup_s')} s) "
          f"loaded model `{r.get('model_name')}` version {r.get('version')}; reference: {r.get('reference')}.")
    rows = []
    for c in r.get("checks", []):
        res = c.get("results") or []
        eq = sum(1 for x in res if x.get("equal") is True)
        detail = f"{eq}/{len(res)} equal to the reference" if res else \
            ", ".join(f"{k}: {_text(v)}" for k, v in c.items() if k not in ("name", "ok", "answers"))[:160]
        rows.append([c.get("name"), _mark(c.get("ok")), detail])
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
        post_calls = tri(l, "_postprocessing", "requests")
        stream_n = tri(l, "_stream", "requests")
        rows.append([
            l["concurrency"], l["requests"], l["output_tokens_per_s"], l["requests_per_s"],
            ms(l["ttft_ms"]["p50"], l["ttft_ms"]["p90"], l["ttft_ms"]["p99"]),
            ms(l["itl_ms"].get("p50"), l["itl_ms"].get("p90"), l["itl_ms"].get("p99")),
            ms(l["e2e_ms"]["p50"], l["e2e_ms"]["p90"], l["e2e_ms"]["p99"]),
            l["e2e_ms"]["p99_over_p50"], l["e2e_ms"]["jitter"], l["token_gap_ms"].get("jitter"),
            _get(l, "padding_factor", "value"),
            ms(tri(l, "_stream", "queue_ms"), tri(l, "_preprocessing", "queue_ms"),
               tri(l, "_tensorrt_llm", "queue_ms")),
            ms(tri(l, "_preprocessing", "compute_infer_ms"), tri(l, "_postprocessing", "compute_infer_ms")),
            post_calls / stream_n if post_calls and stream_n else None,
        ])
    return rows


LEVEL_HEADER = ["concurrency", "requests", "output tok/s", "req/s", "TTFT ms P50 / P90 / P99",
                "ITL ms P50 / P90 / P99", "e2e ms P50 / P90 / P99", "e2e P99/P50", "e2e jitter", "token-gap jitter",
                "padding factor", "Triton queue ms: stream / pre / llm", "Triton compute ms: pre / post",
                "post calls per request"]


def _section_bench(doc: Doc, work_dir: Path, out_dir: Path, m: Optional[dict]) -> None:
    doc.h(2, "Bench")
    if m is None:
        return doc.not_run("bench")
    r = _json(work_dir / "bench" / "bench_results.json") or {}
    st = r.get("settings") or {}
    doc.p(f"Closed-loop sweep over the streaming model `{st.get('model')}` ({r.get('tool')}): at each concurrency, "
          f"{st.get('requests_per_level')} requests of {st.get('prompt_tokens')} prompt tokens (windows of the "
          f"evaluation text) and {st.get('output_tokens')} output tokens (end_id {st.get('end_id')}), after "
          f"{st.get('warmup_requests')} warm-up requests; {r.get('bench_s', 0):.0f} s in all.")
    for t in r.get("targets", []):
        doc.h(3, f"{t['label']}: {t.get('config_name')} ({_text(t.get('quantization'))}), {t.get('server')}")
        doc.table(LEVEL_HEADER, _level_rows(t["levels"]))
        doc.p(f"**Knee**: {t.get('knee_sentence')}")
        pads = {_get(l, "padding_factor", "basis") for l in t["levels"]}
        doc.p("Padding factor (useful / processed batch slots): " + "; ".join(p for p in pads if p) + ".")
        first = [(l["concurrency"], tri) for l in t["levels"] for k, tri in (l.get("triton") or {}).items()
                 if k.endswith("_stream") and tri.get("first_response_ms") is not None]
        if first:
            doc.p("Triton's own time to first response of the streaming model: " +
                  ", ".join(f"{f['first_response_ms']:.0f} ms at concurrency {c}" for c, f in first) + ".")
    doc.p("Triton's queue and compute times are per request of each model, from its metrics endpoint (the level's "
          "counters after minus before). The generation itself waits in the runtime's own scheduler, which Triton "
          "does not see: the decoupled models return from execute at once, so their compute time is not generation "
          "time. Postprocessing is called once per streamed piece.")
    comp = r.get("comparison")
    if comp:
        doc.h(3, f"Comparison ({comp['ratio']})")
        doc.table(["concurrency", "output tok/s", "req/s", "TTFT P50", "ITL P50", "e2e P50", "e2e P99"],
                  [[c["concurrency"], c["output_tokens_per_s"], c["requests_per_s"], c["ttft_p50"], c["itl_p50"],
                    c["e2e_p50"], c["e2e_p99"]] for c in comp["levels"]])
        if all(t.get("target") == "cpu" for t in r.get("targets", [])):
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
    for name, alt in (("throughput_vs_concurrency.png", "Throughput vs concurrency"),
                      ("latency_vs_concurrency.png", "TTFT, inter-token and end-to-end latency percentiles vs "
                                                     "concurrency")):
        img = _copy_image(work_dir / "bench" / name, out_dir, name)
        if img:
            doc.image(img, alt)


def _section_chain(doc: Doc, chain: list[dict], work_dir: Path, manifests: dict) -> None:
    doc.h(2, "Chain of content hashes")
    doc.p("Each stage records the output digest of every stage it read; a link holds when that record equals the "
          "upstream stage's current output digest. From the source weights to the served repository:")
    weights = [(k, v["sha256"]) for k, v in (_get(manifests.get("model"), "outputs", "files") or {}).items()
               if k.endswith((".safetensors", ".gguf"))]
    ext = _get(manifests.get("model"), "inputs", "external", "sha256")
    prov = _json(work_dir / "publish" / "model_repository" / "provenance.json") or {}
    settings = _json(work_dir / "build" / "build_settings.json") or {}
    steps = []
    if ext:
        steps.append(["source", "the model file as downloaded", f"`{ext}`"])
    steps += [["model", f"prepared weights `{k}`", f"`{h}`"] for k, h in weights]
    for stage in STAGES:
        dig = _get(manifests.get(stage), "outputs", "digest")
        if dig:
            steps.append([stage, "stage output digest", f"`{dig}`"])
        if stage == "build" and settings.get("checkpoint_sha256"):
            steps.append(["build", "checkpoint the build serves (checkpoint_sha256)",
                          f"`{settings['checkpoint_sha256']}`"])
        if stage == "publish" and prov.get("repository_digest"):
            steps.append(["publish", "published repository (repository_digest)", f"`{prov['repository_digest']}`"])
    doc.table(["stage", "what", "sha256"], steps)
    doc.table(["stage", "read", "recorded digest", "current digest", "holds"],
              [[l["stage"], l["upstream"], _short(l["recorded"]), _short(l["actual"]), _mark(l["ok"])] for l in chain])


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


# ---------------------------------------------------------------- the stage


def render(work_dir: Path, out_dir: Path, description: str = "") -> dict:
    """Write index.html, index.md, summary.json (and img/) into out_dir from work_dir; returns the summary."""
    manifests = read_manifests(work_dir)
    summary = build_summary(work_dir, manifests)
    chain = hash_chain(work_dir, manifests)
    doc = Doc()
    title = f"Build report: {summary['config_name']}"
    doc.h(1, title)
    if description:
        doc.p(description)
    if summary.get("reference_runtime"):
        doc.p("Served by the **CPU reference runtime**: correctness and wiring, not TensorRT speed.")
    doc.h(2, "At a glance")
    doc.bullets(five_lines(summary))
    doc.table(["stage"] + list(STAGES), [["status"] + [summary["stages"][s] for s in STAGES]])
    _section_source(doc, work_dir, manifests["model"])
    _section_text(doc, manifests["text"])
    _section_sensitivity(doc, work_dir, out_dir, manifests["sensitivity"])
    _section_plan(doc, work_dir, out_dir, manifests["plan"])
    _section_quantize(doc, work_dir, manifests["quantize"])
    _section_sizes(doc, summary, manifests["build"])
    _section_build(doc, work_dir, manifests["build"])
    _section_repository(doc, work_dir, manifests["publish"])
    _section_verify(doc, work_dir, manifests["verify"])
    _section_bench(doc, work_dir, out_dir, manifests["bench"])
    _section_chain(doc, chain, work_dir, manifests)
    _section_runs(doc, manifests)
    (out_dir / artifacts.REPORT_MD).write_text(doc.markdown(), encoding="utf-8")
    (out_dir / artifacts.REPORT_HTML).write_text(doc.html(title), encoding="utf-8")
    summary["hash_chain"] = chain
    (out_dir / artifacts.REPORT_SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_report(work_dir: Path, out_dir: Path, loaded=None) -> dict:
    """The report stage's entry point; the manifest's summary: the five lines and the key flags."""
    summary = render(work_dir, out_dir, loaded.config.description if loaded is not None else "")
    return {"five_lines": five_lines(summary), "stages": summary["stages"], "hash_chain_ok": summary["hash_chain_ok"],
            "files": [artifacts.REPORT_HTML, artifacts.REPORT_MD, artifacts.REPORT_SUMMARY_JSON]}
