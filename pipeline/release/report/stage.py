"""report stage: the page people read, made from the stages' manifests and the files they recorded.

``report/index.html`` and its Markdown twin ``report/index.md`` are rendered from one list of blocks, so the
two say the same; ``report/summary.json`` holds the key figures for CI systems, copied from the manifests
unrounded. Plots are copied beside the page (``report/img/``). A stage without a manifest is shown as
"not run", never filled in.
"""

from __future__ import annotations

import json
from pathlib import Path

from pipeline import artifacts
from pipeline.release.report.document import Doc
from pipeline.release.report.sections import add_sections
from pipeline.release.report.summary import build_summary, five_lines, hash_chain
from pipeline.release.report.workdir import read_manifests
from pipeline.summaries import ReportSummary


def render(work_dir: Path, out_dir: Path, description: str = "", alerts=None) -> dict:
    """Write index.html, index.md, summary.json (and img/) into out_dir from work_dir; returns the summary.
    ``alerts``: the config's AlertsSection (the bench levels judged against its thresholds)."""
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
    add_sections(doc, work_dir, out_dir=out_dir, manifests=manifests, summary=summary, chain=chain, alerts=alerts)
    (out_dir / artifacts.REPORT_MD).write_text(doc.markdown(), encoding="utf-8")
    (out_dir / artifacts.REPORT_HTML).write_text(doc.html(title), encoding="utf-8")
    summary["hash_chain"] = chain
    (out_dir / artifacts.REPORT_SUMMARY_JSON).write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def write_report(work_dir: Path, out_dir: Path, loaded=None) -> ReportSummary:
    """The report stage's entry point; the manifest's summary: the five lines and the key flags."""
    summary = render(work_dir, out_dir, loaded.config.description if loaded is not None else "",
                     loaded.config.alerts if loaded is not None else None)
    return {"five_lines": five_lines(summary), "stages": summary["stages"], "hash_chain_ok": summary["hash_chain_ok"],
            "files": [artifacts.REPORT_HTML, artifacts.REPORT_MD, artifacts.REPORT_SUMMARY_JSON]}
