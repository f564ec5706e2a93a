"""The report of ``ssl-vit compare``: the table in Markdown, a bar chart of the main metric per
protocol, accuracy against pre-training compute (the ViT paper's Figure 5) and, when results at
fewer labels are there, linear-probe accuracy against the number of labelled images."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ssl_vit.eval.compare import (
    PICKED_COLUMNS,
    Comparison,
    LabelEfficiency,
    few_labels,
    format_label_efficiency,
    grid,
    label_efficiency,
)
from ssl_vit.eval.results import MAIN_METRIC, PROTOCOLS, EvalResult, method_order


def format_markdown(cmp: Comparison, figures: Sequence[Path] = (), note: str | None = None) -> str:
    """The table, how to read it, the figures and the results it used; ``note``: a paragraph above."""
    head, body, names = grid(cmp)
    lines = ["# ssl_vit: comparison of evaluations", "", *([f"**Note:** {note}", ""] if note else [])]
    lines += ["| " + " | ".join(r) + " |" for r in (head, ["---"] * names + ["---:"] * (len(head) - names), *body)]
    picked = " LR / k: what the row's sweep picked on held-out training features." if any(c in PICKED_COLUMNS for _, c in cmp.columns) else ""
    lines += ["", f"Accuracies in %. Δ sup / Δ rand: the protocol's main metric ({', '.join(f'{p}: {m}' for p, m in MAIN_METRIC.items())}) "
              f"minus that of the supervised / random-init row with the same backbone, in percentage points.{picked}", ""]
    lines += [line for fig in figures if not fig.stem.endswith("_labels") for line in (f"![{fig.stem}]({fig.name})", "")]
    if (labels := label_efficiency(cmp.all_results)) is not None:
        rows = format_label_efficiency(labels)
        lines += ["## Few labels", "", "Linear-probe top-1 (%) with this many labelled training images (mean ± std over the draws of "
                  "the labelled images); the supervised row trained on those images alone, the others pretrained without labels.", ""]
        lines += ["| " + " | ".join(r) + " |" for r in (rows[0], ["---"] * 2 + ["---:"] * (len(rows[0]) - 2), *rows[1:])] + [""]
        lines += [line for fig in figures if fig.stem.endswith("_labels") for line in (f"![{fig.stem}]({fig.name})", "")]
    lines += ["## Records", ""]
    lines += [f"- `{r.summary_line()}` (source: `{r.source}`, {r.created})" for r in sorted(cmp.results + few_labels(cmp.all_results), key=lambda r: (r.protocol, method_order(r.method)))]
    return "\n".join(lines) + "\n"


def write_report(cmp: Comparison, out: str | Path, plots: bool = True, note: str | None = None) -> list[Path]:
    """``out`` (Markdown) and, with ``plots``, its figures beside it; returns the paths written."""
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    labels = label_efficiency(cmp.all_results)
    figures = [plot_bars(cmp, out.with_name(f"{out.stem}_bars.png")), plot_compute(cmp.results, out.with_name(f"{out.stem}_compute.png")),
               labels and plot_labels(labels, out.with_name(f"{out.stem}_labels.png"))] if plots else []
    figures = [f for f in figures if f is not None]
    out.write_text(format_markdown(cmp, figures, note), encoding="utf-8")
    return [out, *figures]


def _figure(width: float, height: float, ncols: int = 1) -> tuple[Any, list[Any]]:
    # The object-oriented API on an Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, ncols, squeeze=False)[0])


def _save(fig: Any, path: str | Path, **kwargs: Any) -> Path:
    fig.savefig(path, dpi=120, **kwargs)
    return Path(path)


def plot_bars(cmp: Comparison, path: str | Path) -> Path:
    """Grouped bars: the main metric (%) of every row, one group per protocol."""
    protocols = [p for p in PROTOCOLS if any(c[0] == p for c in cmp.columns)]
    fig, (ax,) = _figure(max(5.0, 1.6 * len(protocols) * max(1, len(cmp.rows)) ** 0.5), 3.8)
    width = 0.8 / max(1, len(cmp.rows))
    for i, row in enumerate(cmp.rows):
        shown = [(j + (i - (len(cmp.rows) - 1) / 2) * width, 100 * v) for j, p in enumerate(protocols) if (v := cmp.get(row, p, MAIN_METRIC[p])) is not None]
        ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=" ".join(row) if cmp.multi_dataset else f"{row[0]} {row[1]}", color=f"C{i % 10}")
    ax.set_xticks(range(len(protocols)), [f"{p} ({MAIN_METRIC[p]})" for p in protocols])
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    fig.legend(fontsize="small", loc="outside right upper")
    return _save(fig, path)


def backbone_family(name: str) -> str:
    """``ViT``, ``ResNet`` or ``hybrid``: the model families of the ViT paper's Figure 5."""
    return "hybrid" if name.startswith("hybrid") else "ResNet" if name.startswith("resnet") else "ViT"


def compute_ticks(lo: float, hi: float) -> list[float]:
    """Ticks of a log axis over ``[lo, hi]``: the finest round steps (m x 10^k, m on steps of 0.1 ...
    1, then 1 2 5, then powers of ten) that put two to six ticks in view (else every n-th, or the ends)."""
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    levels = [[round(1 + step * i, 1) for i in range(round(9 / step))] for step in (0.1, 0.2, 0.5, 1.0)] + [[1, 2, 5], [1]]
    for mantissas in levels:
        ticks = [m * 10.0**k for k in range(k0, k1 + 1) for m in mantissas if lo <= m * 10.0**k <= hi]
        if 2 <= len(ticks) <= 6:
            return ticks
    return ticks[:: math.ceil(len(ticks) / 6)] if len(ticks) > 6 else [lo, hi]


def plot_compute(results: Sequence[EvalResult], path: str | Path) -> Path | None:
    """Main metric against pre-training FLOPs (log x), one panel per protocol (ViT paper Fig. 5): a
    colour per method, a marker per backbone family, a line through one method's results of a
    family, dataset and representation. None (and no file) when no result has ``pretrain.flops``."""
    from matplotlib.ticker import EngFormatter, FixedLocator, NullLocator

    with_flops = [r for r in results if r.pretrain.get("flops") and r.main_metric is not None]
    if not with_flops:
        return None

    def series(r: EvalResult) -> tuple[str, str, str, str]:
        return (backbone_family(r.backbone["name"]), r.data_label, r.features or "", r.encoder or "")

    protocols = [p for p in PROTOCOLS if any(r.protocol == p for r in with_flops)]
    fig, axes = _figure(4.2 * len(protocols), 3.8, ncols=len(protocols))
    markers = {"ViT": "o", "ResNet": "s", "hybrid": "D"}
    methods = sorted({r.method for r in with_flops}, key=method_order)
    families, datasets = {series(r)[0] for r in with_flops}, {r.data_label for r in with_flops}
    # A method's line style tells its series apart, the same in every panel (one legend for all).
    styles = {m: sorted({series(r)[1:] for r in with_flops if r.method == m}) for m in methods}
    for ax, protocol in zip(axes, protocols):
        for i, method in enumerate(methods):
            here = [r for r in with_flops if r.protocol == protocol and r.method == method]
            for family, data, features, encoder in sorted({series(r) for r in here}, key=lambda s: (list(markers).index(s[0]), s[1:])):
                pts = sorted((float(r.pretrain["flops"]), 100 * r.main_metric, r.label) for r in here if series(r) == (family, data, features, encoder))
                tags = [method] + ([family] if len(families) > 1 else []) + ([data] if len(datasets) > 1 else [])
                tags += [f"[{', '.join(t for t in (encoder, features) if t)}]"] if encoder or features else []
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[family], color=f"C{i % 10}",
                        linestyle=["-", "--", ":", "-."][styles[method].index((data, features, encoder)) % 4], label=", ".join(tags))
                for x, y, name in pts:
                    ax.annotate(name, (x, y), fontsize="x-small", textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log")
        ax.margins(0.15)
        # Our own ticks: matplotlib's minor tick labels of a short log axis run into each other.
        lo, hi = ax.get_xlim()
        ax.xaxis.set_major_locator(FixedLocator(compute_ticks(lo, hi)))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # "20G"
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_xlim(lo, hi)
        ax.set(xlabel="pre-training compute (FLOPs)", ylabel=f"{protocol} {MAIN_METRIC[protocol]} (%)", title=protocol)
    # One legend below the panels, where it hides no point.
    shown = {label: handle for ax in axes for handle, label in zip(*ax.get_legend_handles_labels())}
    fig.legend(list(shown.values()), list(shown), fontsize="small", loc="outside lower center", ncols=min(3, len(shown)))
    return _save(fig, path, bbox_inches="tight")


def plot_labels(table: LabelEfficiency, path: str | Path) -> Path:
    """Linear-probe top-1 against the labelled training images (log x), the spread over draws as error bars."""
    fig, (ax,) = _figure(5.5, 3.8)
    for i, (row, sizes) in enumerate(table.cells.items()):
        pts = sorted((n, [100 * v for v in values]) for n, values in sizes.items())
        means = [sum(v) / len(v) for _, v in pts]
        stds = [(sum((x - m) ** 2 for x in v) / (len(v) - 1)) ** 0.5 if len(v) > 1 else 0.0 for (_, v), m in zip(pts, means)]
        ax.errorbar([n for n, _ in pts], means, yerr=stds, marker="o", capsize=3, color=f"C{i % 10}", label=f"{row[0]} {row[1]}")
    ax.set_xscale("log")
    ax.set(xlabel="labelled training images", ylabel="linear top-1 (%)", title="accuracy against labels")
    ax.legend(fontsize="small")
    return _save(fig, path)
