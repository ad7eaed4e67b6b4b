"""The accept-length report of `make eval`: a markdown table like the public draft cards, the JSON
behind it, and a PNG of the per-position acceptance (share of passes whose drafts 1..k were all
accepted), simulated against measured."""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any


def gap(sim: float, real: float) -> float:
    """Relative gap of the simulation to vLLM's measurement."""
    return (sim - real) / real if real else float("nan")


def table(results: Mapping[str, Mapping[str, Any]], sampled_label: str | None) -> str:
    """Markdown: one row per category, simulated and real side by side."""
    head = ["Category", "Benchmark", "N", "Acc Len greedy (sim)", "Acc Len greedy (vLLM)", "sim - vLLM"]
    if sampled_label:
        head += [f"Acc Len {sampled_label} (sim)", f"Acc Len {sampled_label} (vLLM)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    for name, r in results.items():
        sim, real = r["sim"], r["real"]
        row = [name, r["benchmark"], str(r["n"]), f"{sim['greedy']['accept_length']:.3f}",
               f"{real['greedy']['accept_length']:.3f}", f"{100 * r['greedy_gap']:+.1f}%"]
        if sampled_label:
            row += [f"{sim['sampled']['accept_length']:.3f}", f"{real['sampled']['accept_length']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> Path:
    """Per-position acceptance: vLLM solid, simulation dashed; greedy left, sampled right."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in ("greedy", "sampled") if all(m in r["real"] for r in results.values())]
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for i, (name, r) in enumerate(results.items()):
            real = r["real"][mode]["per_position"]
            sim = r["sim"][mode]["per_position"]
            x = list(range(1, len(real) + 1))
            color = f"C{i}"
            ax.plot(x, real, "-o", color=color, label=f"{name} vLLM ({r['real'][mode]['accept_length']:.2f})")
            ax.plot(x, sim, "--x", color=color, label=f"{name} sim ({r['sim'][mode]['accept_length']:.2f})")
        ax.set_xticks(x)
        ax.set_xlabel("draft position k")
        ax.set_ylabel("passes with drafts 1..k accepted")
        ax.set_ylim(0, 1)
        ax.set_title(mode)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
