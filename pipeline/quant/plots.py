"""What a person reads from the sensitivity and plan stages: a sorted Markdown table and two PNG plots."""

from __future__ import annotations

import math
from pathlib import Path

from pipeline.formats import HIGH_PRECISION
from pipeline.records import Plan

MODULE_ORDER = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def table_markdown(table: dict, decision: str) -> str:
    """The table sorted by the ``decision`` column, most sensitive first. No threshold: the measurement is shared
    by every threshold, and the plan stage says which layers pass its own."""
    layers = sorted(table["layers"], key=lambda l: -l["errors"].get(decision, {}).get("error", 0.0))
    fmts = list(layers[0]["errors"]) if layers else []
    lines = [
        f"# Per-layer INT8 sensitivity ({table['calibration']['samples']} x {table['calibration']['seq_len']} "
        f"calibration tokens)",
        "",
        f"error = ||ref(x) - q(x)|| / ||ref(x)|| over the calibration set; {len(layers)} layers, sorted by the "
        f"`{decision}` column; the plan stage judges them against sensitivity.threshold (its plan.md).",
        "mean / max: over calibration samples. outlier ratio: largest input-channel amax / median channel amax.",
        "",
        "| layer | " + " | ".join(f"{f} error (mean / max)" for f in fmts) + " | input amax | outlier ratio | params |",
        "|---|" + "---|" * len(fmts) + "---|---|---|",
    ]
    for l in layers:
        cells = []
        for f in fmts:
            e = l["errors"][f]
            cells.append(f"{e['error']:.4f} ({e['mean']:.4f} / {e['max']:.4f})")
        lines.append(f"| {l['name']} | " + " | ".join(cells) +
                     f" | {l['activation']['amax']:.1f} | {l['activation']['outlier_ratio']:.1f} | "
                     f"{l['in_features'] * l['out_features']:,} |")
    experts = table.get("experts")
    if experts:
        lines += ["", f"## Experts per MoE layer (`{decision}` column: the largest and mean error over the layer's "
                      f"experts per expert type, and the worst expert; routers are kept in high precision)", "",
                  "| layer | calibration tokens routed per expert | " +
                  " | ".join(f"{k} max / mean (worst)" for k in sorted(experts[0]["by_type"])) + " |",
                  "|---|---|" + "---|" * len(experts[0]["by_type"])]
        for e in experts:
            cells = [f"{c[decision]['max']:.4f} / {c[decision]['mean']:.4f} ({c[decision]['worst_expert']})"
                     for _, c in sorted(e["by_type"].items())]
            lines.append(f"| {e['layer']} | {e['routed_tokens']} | " + " | ".join(cells) + " |")
        lines.append("An expert with 0 routed tokens was measured on all of its layer's calibration tokens.")
    emb = table.get("embedding")
    if emb:
        lines += ["", f"Embedding table ({emb['name']}, reported separately, not quantized by the plan): INT8 "
                      f"per-row error {emb['int8_per_row_error']:.4f} over the {emb['rows_checked']} rows the "
                      f"calibration set uses."]
    return "\n".join(lines) + "\n"


def heatmap_grid(table: dict, fmt: str, blocks: list[int]) -> tuple[list[str], list[list[float]]]:
    """The heatmap's rows (the dense modules, then one row per expert type of an MoE model: the largest error
    over a layer's experts, as the table's ``experts`` summary has it) and its values per decoder block (NaN:
    the block has no such module)."""
    kinds = sorted({kind for entry in table.get("experts", []) for kind in entry.get("by_type", {})})
    rows = [*MODULE_ORDER, *(f"experts.{kind} (max)" for kind in kinds)]
    values = [[math.nan] * len(blocks) for _ in rows]
    for l in table["layers"]:
        if l["block"] >= 0 and l["module"] in MODULE_ORDER:
            values[MODULE_ORDER.index(l["module"])][blocks.index(l["block"])] = l["errors"][fmt]["error"]
    for entry in table.get("experts", []):
        for kind, by_format in entry.get("by_type", {}).items():
            values[rows.index(f"experts.{kind} (max)")][blocks.index(entry["layer"])] = by_format[fmt]["max"]
    return rows, values


def heatmap_png(table: dict, formats: tuple[str, ...], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    blocks = sorted({l["block"] for l in table["layers"] if l["block"] >= 0})
    fig, axes = plt.subplots(len(formats), 1, figsize=(max(8, len(blocks) * 0.35 + 2), 2.6 * len(formats) + 0.6),
                             squeeze=False)
    for ax, fmt in zip(axes[:, 0], formats):
        rows, values = heatmap_grid(table, fmt, blocks)
        grid = np.array(values, dtype=float)
        im = ax.imshow(grid, aspect="auto", cmap="magma_r", interpolation="nearest")
        ax.set_yticks(range(len(rows)), rows)
        ax.set_xticks(range(len(blocks)), [str(b) for b in blocks], fontsize=7)
        head = next((l for l in table["layers"] if l["module"] == "lm_head"), None)
        extra = f"; lm_head {head['errors'][fmt]['error']:.3f}" if head else ""
        ax.set_title(f"{fmt}: relative output error per layer (decoder block x module){extra}", fontsize=10)
        ax.set_xlabel("decoder block")
        fig.colorbar(im, ax=ax, fraction=0.025, pad=0.01)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def error_bars_png(table: dict, plan: Plan, decision: str, threshold: float | None, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = table["layers"]
    errs = [l["errors"].get(decision, {}).get("error", 0.0) for l in layers]
    kept = [plan.layers[l["name"]].format == HIGH_PRECISION for l in layers]
    colors = ["#c0392b" if k else "#2e86c1" for k in kept]
    fig, ax = plt.subplots(figsize=(16, 4.8))
    ax.bar(range(len(layers)), errs, color=colors, width=0.85)
    if threshold is not None:
        ax.axhline(threshold, color="black", linestyle="--", linewidth=1)
        ax.text(len(layers) - 1, threshold, f" threshold {threshold}", va="bottom", ha="right", fontsize=9)
    ax.set_yscale("log")
    ticks = [i for i, l in enumerate(layers) if l["module"] in ("q_proj", "lm_head")]
    ax.set_xticks(ticks, [("head" if layers[i]["module"] == "lm_head" else str(layers[i]["block"])) for i in ticks],
                  fontsize=7)
    ax.set_xlabel("linear layers in model order (tick = start of a decoder block)")
    ax.set_ylabel(f"relative output error ({decision})")
    n_kept = sum(kept)
    ax.set_title(f"Per-layer {decision} error; red: kept in high precision by the plan ({n_kept} of {len(layers)})")
    ax.set_xlim(-1, len(layers))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
