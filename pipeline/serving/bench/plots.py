"""The sweep's two plots: throughput, and latency percentiles, against concurrency.

Each takes the levels of every swept build by label ({"this build": [...], "baseline": [...]}), in sweep order.
"""

from __future__ import annotations

from pathlib import Path

from pipeline.serving.bench.stats import PERCENTILES

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
LATENCY_PNG = "latency_vs_concurrency.png"


def plot_throughput(levels_by_label: dict[str, list[dict]], knees: dict[str, dict], path: Path) -> None:
    """Output tokens/s and requests/s per level, with each build's knee marked where it was found."""
    import matplotlib  # heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for (label, levels), style, color in zip(levels_by_label.items(), ("-", "--"), ("#1f77b4", "#7f7f7f"),
                                             strict=False):
        c = [l["concurrency"] for l in levels]
        ax.plot(c, [l["output_tokens_per_s"] for l in levels], "o" + style, color=color, label=label)
        ax2.plot(c, [l["requests_per_s"] for l in levels], "s" + style, color=color, label=label)
        knee = knees[label]
        if knee["found"]:
            ax.axvline(knee["concurrency"], color="#2ca02c", linestyle=style, alpha=0.6)
            ax.annotate(f"knee ({label}): c={knee['concurrency']}", (knee["concurrency"], knee["throughput"]),
                        textcoords="offset points", xytext=(6, -14), fontsize=8, color="#2ca02c")
    ticks = [l["concurrency"] for l in next(iter(levels_by_label.values()))]  # the first build's levels
    for a, title in ((ax, "output tokens/s"), (ax2, "requests/s")):
        a.set_xscale("log", base=2)
        a.set_xticks(ticks, [str(x) for x in ticks])
        a.set_xlabel("concurrency (requests in flight)")
        a.set_title(f"{title} vs concurrency (streaming, closed loop)", fontsize=10)
        a.set_ylim(bottom=0)
        a.grid(alpha=0.3)
        a.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_latency(levels_by_label: dict[str, list[dict]], path: Path) -> None:
    """TTFT, inter-token and end-to-end latency at P50/P90/P99 per level, one panel each."""
    import matplotlib  # heavy, and only the plots need it

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = (("ttft_ms", "time to first token (ms)"), ("itl_ms", "inter-token latency (ms)"),
               ("e2e_ms", "end-to-end latency (ms)"))
    colors = {50: "#1f77b4", 90: "#ff7f0e", 99: "#d62728"}
    fig, axes = plt.subplots(1, 3, figsize=(13, 4.2))
    for ax, (key, title) in zip(axes, metrics, strict=True):
        for (label, levels), style in zip(levels_by_label.items(), ("-", "--"), strict=False):
            c = [l["concurrency"] for l in levels]
            for q in PERCENTILES:
                ax.plot(c, [l[key].get(f"p{q}", float("nan")) for l in levels], "o" + style, color=colors[q],
                        markersize=4, label=f"P{q}" + (f" ({label})" if len(levels_by_label) > 1 else ""))
        ax.set_xscale("log", base=2)
        ax.set_xticks(c, [str(x) for x in c])
        ax.set_xlabel("concurrency")
        ax.set_title(title, fontsize=10)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
