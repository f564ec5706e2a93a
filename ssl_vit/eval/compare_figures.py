"""The figures of ``ssl-vit compare``'s report: the main metric of every row per protocol, and
accuracy against pre-training compute (the ViT paper's Figure 5)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ssl_vit.eval.results import MAIN_METRIC, PROTOCOLS, EvalResult, method_order

if TYPE_CHECKING:
    from ssl_vit.eval.compare import Comparison


def _figure(width: float, height: float, ncols: int = 1):
    # The object-oriented API with an Agg canvas: no pyplot state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, fig.subplots(1, ncols, squeeze=False)[0]


def plot_bars(cmp: Comparison, path: str | Path) -> Path:
    """Grouped bars: the main metric (%) of every row, one group per protocol."""
    protocols = [p for p in PROTOCOLS if any(c[0] == p for c in cmp.columns)]
    fig, (ax,) = _figure(max(5.0, 1.6 * len(protocols) * max(1, len(cmp.rows)) ** 0.5), 3.8)
    width = 0.8 / max(1, len(cmp.rows))
    for i, row in enumerate(cmp.rows):
        values = [cmp.get(row, p, MAIN_METRIC[p]) for p in protocols]
        xs = [j + (i - (len(cmp.rows) - 1) / 2) * width for j in range(len(protocols))]
        label = " ".join(row) if cmp.multi_dataset else f"{row[0]} {row[1]}"
        shown = [(x, 100 * v) for x, v in zip(xs, values) if v is not None]
        ax.bar([x for x, _ in shown], [v for _, v in shown], width, label=label, color=f"C{i % 10}")
    ax.set_xticks(range(len(protocols)), [f"{p} ({MAIN_METRIC[p]})" for p in protocols])
    ax.set_ylabel("accuracy (%)")
    ax.set_ylim(0, 100)
    fig.legend(fontsize="small", loc="outside right upper")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    return path


def backbone_family(name: str) -> str:
    """``ViT``, ``ResNet`` or ``hybrid``: the model families of the ViT paper's Figure 5."""
    if name.startswith("hybrid"):
        return "hybrid"
    if name.startswith("resnet"):
        return "ResNet"
    return "ViT"


def compute_ticks(lo: float, hi: float) -> list[float]:
    """Tick positions for a log axis over ``[lo, hi]``: the finest of m x 10^k with m on steps of
    0.1, 0.2, 0.5, 1, then m in (1, 2, 5), then powers of ten, that puts two to six ticks in view
    (every n-th power of ten over many decades)."""
    k0, k1 = math.floor(math.log10(lo)), math.ceil(math.log10(hi))
    levels = [[round(1 + step * i, 1) for i in range(round(9 / step))] for step in (0.1, 0.2, 0.5, 1.0)]
    levels += [[1, 2, 5], [1]]
    for mantissas in levels:
        ticks = [m * 10.0**k for k in range(k0, k1 + 1) for m in mantissas if lo <= m * 10.0**k <= hi]
        if 2 <= len(ticks) <= 6:
            return ticks
    return ticks[:: math.ceil(len(ticks) / 6)] if len(ticks) > 6 else [lo, hi]


def _series(r: EvalResult) -> tuple[str, str, str]:
    """What tells a method's lines apart in the compute plot: dataset, representation, encoder."""
    return (r.data_label, r.features or "", r.encoder or "")


def plot_compute(results: Sequence[EvalResult], path: str | Path) -> Path | None:
    """Main metric against pre-training FLOPs (log x), one panel per protocol (ViT paper Fig. 5):
    one colour per method, one marker per backbone family (ViT, ResNet, hybrid), a line through
    the sizes of one family trained by one method. ``None`` (and no file) when no record has
    ``pretrain.flops``."""
    with_flops = [r for r in results if r.pretrain.get("flops") and r.main_metric is not None]
    if not with_flops:
        return None
    from matplotlib.ticker import EngFormatter, FixedLocator, NullFormatter, NullLocator

    protocols = [p for p in PROTOCOLS if any(r.protocol == p for r in with_flops)]
    fig, axes = _figure(4.2 * len(protocols), 3.8, ncols=len(protocols))
    markers = {"ViT": "o", "ResNet": "s", "hybrid": "D"}
    methods = sorted({r.method for r in with_flops}, key=method_order)
    families = sorted({backbone_family(r.backbone.get("name", "")) for r in with_flops}, key=list(markers).index)
    # A line joins results of one method, family, dataset, representation and encoder (the sizes
    # of a family, or one size at several training lengths); lines never cross datasets, and a
    # checkpoint's other encoder (DINO's student) is a line of its own, not a step at equal FLOPs.
    datasets = sorted({r.data_label for r in with_flops})
    # A method's line style tells its series apart, the same in every panel (the legend is
    # shared: a style numbered per panel would give two series one entry's look).
    variants = {m: sorted({_series(r) for r in with_flops if r.method == m}) for m in methods}
    for ax, protocol in zip(axes, protocols):
        for i, method in enumerate(methods):
            for family in families:
                here = [r for r in with_flops
                        if r.protocol == protocol and r.method == method and backbone_family(r.backbone.get("name", "")) == family]
                for series in sorted({_series(r) for r in here}):
                    data, features, encoder = series
                    j = variants[method].index(series)
                    pts = sorted((float(r.pretrain["flops"]), 100 * r.main_metric, r.label) for r in here if _series(r) == series)
                    tags = [method] + ([family] if len(families) > 1 else []) + ([data] if len(datasets) > 1 else [])
                    tags += [f"[{', '.join(t for t in (encoder, features) if t)}]"] if encoder or features else []
                    ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=markers[family], color=f"C{i % 10}",
                            linestyle=["-", "--", ":", "-."][j % 4], label=", ".join(tags))
                    for x, y, name in pts:
                        ax.annotate(name, (x, y), fontsize="x-small", textcoords="offset points", xytext=(3, 3))
        ax.set_xscale("log")
        ax.margins(0.15)
        # Ticks chosen here: matplotlib labels the minor ticks of a log axis that spans less than
        # about two decades, and those labels run into each other.
        lo, hi = ax.get_xlim()
        ax.xaxis.set_major_locator(FixedLocator(compute_ticks(lo, hi)))
        ax.xaxis.set_major_formatter(EngFormatter(sep=""))  # "20G": short labels, the unit is on the axis
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlim(lo, hi)
        ax.set_xlabel("pre-training compute (FLOPs)")
        ax.set_ylabel(f"{protocol} {MAIN_METRIC[protocol]} (%)")
        ax.set_title(protocol)
    # One legend for all panels, below them, where it hides no point; the figure grows to hold
    # the points' labels that reach past the panels.
    shown: dict[str, Any] = {}
    for ax in axes:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            shown.setdefault(label, handle)
    fig.legend(list(shown.values()), list(shown), fontsize="small", loc="outside lower center", ncols=min(3, len(shown)))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120, bbox_inches="tight")
    return path
