"""One table of evaluation results, SSL methods against the supervised baseline and random
initialisation (``ssl-vit compare``; its report: :mod:`ssl_vit.eval.report`). Rows are (method,
backbone[, dataset]), with a representation other than [CLS] (``vit/16 [last4]``) and what tells a
method's pretrainings apart (``vit/16 (100 ep)``); columns each protocol's metrics, what a sweep
picked (``linear LR``, ``knn k``), and "Δ sup" / "Δ rand": the protocol's main metric minus that
of the ``supervised`` / ``random`` row of the same backbone and dataset. Results on fewer labelled
images than their dataset's most make the label-efficiency table instead (:func:`label_efficiency`).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssl_vit.eval.results import PROTOCOLS, EvalResult, method_order
from ssl_vit.io import read_json

BASELINES: dict[str, str] = {"supervised": "Δ sup", "random": "Δ rand"}
PICKED: dict[str, tuple[str, str]] = {"linear": ("selected_base_lr", "LR"), "knn": ("selected_k", "k")}  # (key of a sweep's pick, column)
PICKED_COLUMNS = frozenset(name for _, name in PICKED.values())  # settings, not accuracies
SKIPPED_SHOWN = 3  # how many skipped files the error for a folder without results names
RowKey = tuple[str, str, str]  # (method, backbone label, dataset)


def _not_results(d: object) -> str | None:
    """Why parsed JSON is not a result or a list of them (None when it is)."""
    def why_not(r: object) -> str | None:
        if not isinstance(r, dict):
            return f"a JSON {({list: 'list', str: 'string', bool: 'boolean', type(None): 'null'}).get(type(r), 'number')}, not an object"
        missing = [k for k in ("protocol", "metrics") if k not in r]
        return f"no {'/'.join(map(repr, missing))} field{'s' if len(missing) > 1 else ''}" if missing else None

    if not isinstance(d, list):
        return why_not(d)
    if not d:
        return "an empty list"
    return next((f"item [{i}] of a list: {why}" for i, r in enumerate(d) if (why := why_not(r)) is not None), None)


def load_results(paths: Sequence[str | Path]) -> list[EvalResult]:
    """Results from files (one result, or a list of them as the demo's ``results.json``) and folders
    (searched recursively, skipping JSON files that hold no results, an export's ``config.json``; if
    no file holds one, the error says why). A malformed result is an error naming its file (and item)."""
    results: list[EvalResult] = []
    skipped: list[str] = []
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"no result file or folder at {p}")
        for f in sorted(q for q in p.rglob("*.json") if q.is_file()) if p.is_dir() else [p]:
            try:
                d = read_json(f)
            except ValueError:
                if not p.is_dir():
                    raise
                print(f"compare: skipping {f} (not JSON)", file=sys.stderr)
                skipped.append(f"{f}: not JSON")
                continue
            if (why := _not_results(d) if p.is_dir() or d == [] else None) is not None:
                if isinstance(d, list) and any(_not_results(r) is None for r in d):
                    raise ValueError(f"{f}: {why}, beside results")  # broken results, not another kind of file
                skipped.append(f"{f}: {why}")
                continue
            results += [EvalResult.from_dict(r, f"{f}[{i}]") for i, r in enumerate(d)] if isinstance(d, list) else [EvalResult.from_dict(d, str(f))]
    if not results:
        where = ", ".join(map(str, paths))
        if not skipped:
            raise ValueError(f"no results found in {where} (no *.json files)")
        more = f"; and {len(skipped) - SKIPPED_SHOWN} more file(s)" if len(skipped) > SKIPPED_SHOWN else ""
        raise ValueError(f"no results found in {where}: {'; '.join(skipped[:SKIPPED_SHOWN])}{more}")
    # The same result read twice (the demo's files and its results.json) counts once.
    return list({json.dumps(r.to_dict(), sort_keys=True, default=str): r for r in results}.values())


def _metric_order(name: str) -> tuple[int, float, str]:  # top1, top5, top10, then 1shot, 5shot ...
    kind = 0 if name.startswith("top") and name[3:].isdigit() else 1 if name.endswith("shot") and name[:-4].isdigit() else 2
    return (kind, float(name.removeprefix("top").removesuffix("shot")) if kind < 2 else 0.0, name)


@dataclass
class Comparison:
    """The table: ``cells[(row, (protocol, column))]`` holds a fraction, a Δ of fractions or a picked setting."""

    rows: list[RowKey]
    columns: list[tuple[str, str]]
    cells: dict[tuple[RowKey, tuple[str, str]], float] = field(default_factory=dict)
    results: list[EvalResult] = field(default_factory=list)  # those in the table
    all_results: list[EvalResult] = field(default_factory=list)  # with those at fewer labels

    @property
    def multi_dataset(self) -> bool:
        return len({r[2] for r in self.rows}) > 1

    def get(self, row: RowKey, protocol: str, column: str) -> float | None:
        return self.cells.get((row, (protocol, column)))


def pretraining_tags(results: Sequence[EvalResult]) -> list[str]:
    """Short labels telling apart the pretrainings of ``results`` (one each): what differs among the
    data, epochs and steps (``on imagefolder:a/train, 100 ep``), else the files' last differing parts."""
    def distinct(tags: list[list[str]]) -> bool:
        return len({", ".join(t) for t in tags}) == len(tags)

    tags: list[list[str]] = [[] for _ in results]
    shown = {"data": lambda v: f"on {v}", "epochs": lambda v: f"{v:g} ep" if isinstance(v, int | float) else f"{v} ep",
             "steps": lambda v: f"{v} steps"}
    for key, fmt in shown.items():
        values = [r.pretrain.get(key) for r in results]
        if not distinct(tags) and len(set(map(repr, values))) > 1:
            for t, v in zip(tags, values):
                t.append("?" if v is None else fmt(v))
    if not distinct(tags):
        parts = [Path(r.pretraining[0]).parts for r in results]
        longest = max(map(len, parts))
        n = next(n for n in range(1, longest + 1) if n == longest or len({"/".join(p[-n:]) for p in parts}) == len(parts))
        for t, p in zip(tags, parts):
            t.append("/".join(p[-n:]))
    return [", ".join(t) for t in tags]


def full_labels(results: Sequence[EvalResult]) -> list[EvalResult]:
    """The results that used every labelled training image any result of their dataset used."""
    most: dict[str, int] = {}
    for r in results:
        most[r.data_label] = max(most.get(r.data_label, 0), r.data.get("train_size") or 0)
    return [r for r in results if (r.data.get("train_size") or 0) >= most[r.data_label]]


def few_labels(results: Sequence[EvalResult]) -> list[EvalResult]:
    """The others: results at fewer labels than their dataset's most."""
    full = full_labels(results)
    return [r for r in results if r not in full]


@dataclass
class LabelEfficiency:
    """Linear-probe top-1 against labelled training images: ``cells[row][n]``, the accuracies of every draw of ``n``."""

    sizes: list[int]
    cells: dict[RowKey, dict[int, list[float]]]


def label_efficiency(results: Sequence[EvalResult]) -> LabelEfficiency | None:
    """The linear probes at every number of labels (None unless some used fewer than all)."""
    linear = [r for r in results if r.protocol == "linear" and r.data.get("train_size") and r.main_metric is not None]
    sizes = sorted({r.data["train_size"] for r in linear})
    if len(sizes) < 2:
        return None
    cells: dict[RowKey, dict[int, list[float]]] = {}
    for r in sorted(linear, key=lambda r: r.created):
        cells.setdefault((r.method, r.label, r.data_label), {}).setdefault(r.data["train_size"], []).append(r.main_metric)
    order = sorted(cells, key=lambda row: (row[2], row[1], method_order(row[0])))
    return LabelEfficiency(sizes, {row: cells[row] for row in order})


def format_label_efficiency(table: LabelEfficiency) -> list[list[str]]:
    """Header and rows: ``78.95`` for one draw, ``61.20 ± 1.04`` (mean ± std over draws) for several."""
    def cell(values: list[float] | None) -> str:
        if not values:
            return "–"
        mean = sum(values) / len(values)
        std = (sum((v - mean) ** 2 for v in values) / (len(values) - 1)) ** 0.5 if len(values) > 1 else None
        return f"{100 * mean:.2f}" + (f" ± {100 * std:.2f}" if std is not None else "")

    head = ["method", "backbone", *(f"{n} labels" for n in table.sizes)]
    return [head, *([row[0], row[1], *(cell(sizes.get(n)) for n in table.sizes)] for row, sizes in table.cells.items())]


def build_comparison(results: Sequence[EvalResult]) -> Comparison:
    """Tabulate results (module docstring): a row per pretraining, tagged (:func:`pretraining_tags`)
    where a method and backbone have several; of a pretraining's results of one protocol the newest wins."""
    latest: dict[tuple[RowKey, tuple, str], EvalResult] = {}
    for r in full_labels(results):
        key = ((r.method, r.label, r.data_label), r.pretraining, r.protocol)
        if key in latest:
            print(f"compare: several {r.protocol} results for {key[0]} from {r.source}; keeping the newest", file=sys.stderr)
            if r.created < latest[key].created:
                continue
        latest[key] = r
    pretrainings: dict[RowKey, dict[tuple, EvalResult]] = {}
    for (row, pretraining, _), r in latest.items():
        pretrainings.setdefault(row, {}).setdefault(pretraining, r)
    row_of = {}
    for row, found in pretrainings.items():
        for pretraining, tag in zip(found, pretraining_tags(list(found.values())) if len(found) > 1 else [""]):
            row_of[(row, pretraining)] = (row[0], f"{row[1]} ({tag})" if tag else row[1], row[2])
    latest = {(row_of[(row, pretraining)], pretraining, protocol): r for (row, pretraining, protocol), r in latest.items()}
    cmp = Comparison(sorted({k[0] for k in latest}, key=lambda row: (row[2], row[1], method_order(row[0]))), [], {}, list(latest.values()),
                     list(results))
    for protocol in PROTOCOLS:
        here = {row: r for (row, _, p), r in latest.items() if p == protocol}
        names = sorted({m for r in here.values() for m in r.metrics if not m.endswith("_std")}, key=_metric_order)
        cmp.columns += [(protocol, m) for m in names]
        cmp.cells.update({(row, (protocol, m)): r.metrics[m] for row, r in here.items() for m in names if m in r.metrics})
        key, picked = PICKED.get(protocol, ("", ""))
        if any(key in r.protocol_args for r in here.values()):  # a sweep: the setting beside its score
            cmp.columns.append((protocol, picked))
            cmp.cells.update({(row, (protocol, picked)): float(r.protocol_args[key]) for row, r in here.items() if key in r.protocol_args})
        for base, col in BASELINES.items():
            # Against the baseline's row of the same backbone and representation (any encoder; the newest).
            refs = {(r.comparable_label, row[2]): r for row, r in sorted(here.items(), key=lambda item: item[1].created) if row[0] == base}
            if not any(row[0] != base and (r.comparable_label, row[2]) in refs for row, r in here.items()):
                continue  # (a baseline alone against itself: all zeros)
            cmp.columns.append((protocol, col))
            for row, r in here.items():
                ref = refs.get((r.comparable_label, row[2]))
                if ref is not None and r.main_metric is not None and ref.main_metric is not None:
                    cmp.cells[(row, (protocol, col))] = r.main_metric - ref.main_metric
    return cmp


def grid(cmp: Comparison) -> tuple[list[str], list[list[str]], int]:
    """The table as text cells (accuracies in %, Δ in points): header, rows, and how many columns are names."""
    def cell(value: float | None, column: str) -> str:
        if value is None:
            return "–"
        return f"{value:g}" if column in PICKED_COLUMNS else f"{100 * value:+.2f}" if column.startswith("Δ") else f"{100 * value:.2f}"

    names = 3 if cmp.multi_dataset else 2
    head = ["method", "backbone", "data"][:names] + [f"{p} {c}" for p, c in cmp.columns]
    return head, [[*row[:names], *(cell(cmp.get(row, p, c), c) for p, c in cmp.columns)] for row in cmp.rows], names


def aligned(rows: list[list[str]], names: int) -> str:
    """Plain-text columns: the first ``names`` left-aligned, the numbers right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < names else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([line(rows[0]), "  ".join("-" * w for w in widths), *map(line, rows[1:])])


def format_text(cmp: Comparison) -> str:
    """The aligned plain-text table, and the label-efficiency table when there is one."""
    head, body, names = grid(cmp)
    text = aligned([head, *body], names)
    if (labels := label_efficiency(cmp.all_results)) is not None:
        text += "\n\nlinear top-1 by labelled training images:\n" + aligned(format_label_efficiency(labels), 2)
    return text
