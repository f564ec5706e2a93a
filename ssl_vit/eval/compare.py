"""``ssl-vit compare RESULTS... [--out report.md]``: one table of every result record, SSL
methods against the supervised baseline and random initialisation (specs §5 "SSL vs
supervised"), printed as text and written as a Markdown report with two figures: the main metric
per method and protocol, and accuracy against pre-training compute (ViT paper Fig. 5 style).

Rows are (method, backbone[, dataset]), the backbone with the representation evaluated when it
is not [CLS] (``vit/16 [last4]``) and, when one method and backbone were pretrained more than
once, what tells the pretrainings apart (``vit/16 (100 ep)``); columns are the metrics of each protocol, then
what a sweep picked for the row when any record of the protocol swept (``linear LR``: the probe's
base LR, ``knn k``), followed by "Δ sup" and "Δ rand": the protocol's main metric minus that of
the ``supervised`` / ``random`` row with the same backbone and dataset, in percentage points.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from ssl_vit.errors import ArgumentParser
from ssl_vit.eval.compare_figures import plot_bars, plot_compute
from ssl_vit.eval.results import MAIN_METRIC, PROTOCOLS, EvalResult, method_order, read_json

BASELINES: dict[str, str] = {"supervised": "Δ sup", "random": "Δ rand"}
# protocol -> (the record's protocol_args key of what its sweep picked, the column's name)
PICKED: dict[str, tuple[str, str]] = {"linear": ("selected_base_lr", "LR"), "knn": ("selected_k", "k")}
PICKED_COLUMNS = frozenset(name for _, name in PICKED.values())  # settings, not accuracies
RowKey = tuple[str, str, str]  # (method, backbone label, dataset)


# ------------------------------------------------------------------------------------ loading
# How many skipped files the error for a folder without records names.
SKIPPED_SHOWN = 3


def _not_records(d: object) -> str | None:
    """Why the parsed JSON ``d`` is not a result record or a list of them (None when it is)."""

    def why_not(r: object) -> str | None:
        if not isinstance(r, dict):
            kind = {list: "list", str: "string", bool: "boolean", type(None): "null"}.get(type(r), "number")
            return f"a JSON {kind}, not an object"
        missing = [k for k in ("protocol", "metrics") if k not in r]
        return f"no {'/'.join(map(repr, missing))} field{'s' if len(missing) > 1 else ''}" if missing else None

    if not isinstance(d, list):
        return why_not(d)
    if not d:
        return "an empty list"
    for i, r in enumerate(d):
        why = why_not(r)
        if why is not None:
            return f"item [{i}] of a list: {why}"
    return None


def load_results(paths: Sequence[str | Path]) -> list[EvalResult]:
    """Result records from files (one record, or a list of them as the demo's ``results.json``)
    and folders (searched recursively for ``*.json`` records). In folders, JSON files that are not
    result records (no ``protocol``/``metrics``, e.g. an export's ``config.json``) are skipped (when
    no file anywhere holds a record, the error says why each was skipped); a malformed record is an
    error naming its file."""
    results: list[EvalResult] = []
    skipped: list[str] = []  # "file: why" of each JSON file that holds no records
    for p in map(Path, paths):
        if p.is_dir():
            for f in sorted(p.rglob("*.json")):
                if not f.is_file():  # a folder named *.json
                    continue
                try:
                    d = json.loads(f.read_text(encoding="utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError):
                    print(f"compare: skipping {f} (not JSON)", file=sys.stderr)
                    skipped.append(f"{f}: not JSON")
                    continue
                why = _not_records(d)
                if why is not None and isinstance(d, list) and any(_not_records(r) is None for r in d):
                    # some items are records: the others are broken records, not another kind of file
                    raise ValueError(f"{f}: {why}, beside result records")
                if why is not None:
                    skipped.append(f"{f}: {why}")
                    continue
                records = d if isinstance(d, list) else [d]  # a list: the demo's results.json
                results += [EvalResult.from_dict(r, where=str(f) if r is d else f"{f}[{i}]") for i, r in enumerate(records)]
        elif p.is_file():
            d = read_json(p)
            if d == []:
                skipped.append(f"{p}: an empty list")
            elif isinstance(d, list):  # a list of records (the demo's results.json)
                results += [EvalResult.from_dict(r, where=f"{p}[{i}]") for i, r in enumerate(d)]
            else:
                results.append(EvalResult.from_dict(d, where=str(p)))
        else:
            raise FileNotFoundError(f"no result file or folder at {p}")
    if not results:
        where = ", ".join(map(str, paths))
        if not skipped:
            raise ValueError(f"no result records found in {where} (no *.json files)")
        more = f"; and {len(skipped) - SKIPPED_SHOWN} more file(s)" if len(skipped) > SKIPPED_SHOWN else ""
        raise ValueError(f"no result records found in {where}: {'; '.join(skipped[:SKIPPED_SHOWN])}{more}")
    # The same record read twice (a folder holding the demo's records and its results.json list):
    # alike in everything but the file it was read from.
    unique: dict[str, EvalResult] = {}
    for r in results:
        unique.setdefault(json.dumps(r.to_dict(), sort_keys=True, default=str), r)
    return list(unique.values())


# -------------------------------------------------------------------------------------- table
def _metric_order(name: str) -> tuple[int, float, str]:
    if name.startswith("top") and name[3:].isdigit():
        return (0, float(name[3:]), name)
    if name.endswith("shot") and name[:-4].isdigit():
        return (1, float(name[:-4]), name)
    return (2, 0.0, name)


@dataclass
class Comparison:
    """The comparison table: ``cells[(row, (protocol, column))]`` holds a fraction (metric
    columns) or a difference of fractions (Δ columns); missing cells are absent."""

    rows: list[RowKey]
    columns: list[tuple[str, str]]
    cells: dict[tuple[RowKey, tuple[str, str]], float] = field(default_factory=dict)
    results: list[EvalResult] = field(default_factory=list)

    @property
    def multi_dataset(self) -> bool:
        return len({r[2] for r in self.rows}) > 1

    def get(self, row: RowKey, protocol: str, column: str) -> float | None:
        return self.cells.get((row, (protocol, column)))


def _distinct(values: Sequence[str]) -> bool:
    return len(set(values)) == len(values)


def pretraining_tags(records: Sequence[EvalResult]) -> list[str]:
    """Short labels telling apart the pretrainings of ``records`` (one record per pretraining, all
    of one method, backbone and dataset): what differs among the data pretrained on, the epochs
    and the steps, as many of those as it takes (``100 ep``, ``on imagefolder:a/train, 100 ep``),
    then the files' paths (their last parts that differ) when those leave two alike."""
    tags: list[list[str]] = [[] for _ in records]
    shown = {"data": lambda v: f"on {v}", "epochs": lambda v: f"{v:g} ep" if isinstance(v, int | float) else f"{v} ep",
             "steps": lambda v: f"{v} steps"}
    for key, fmt in shown.items():
        if _distinct([", ".join(t) for t in tags]):
            break
        values = [r.pretrain.get(key) for r in records]
        if len(set(map(repr, values))) > 1:
            for t, v in zip(tags, values):
                t.append("?" if v is None else fmt(v))
    if not _distinct([", ".join(t) for t in tags]):
        parts = [Path(r.pretraining[0]).parts for r in records]
        for n in range(1, max(map(len, parts)) + 1):
            if _distinct(["/".join(p[-n:]) for p in parts]) or n == max(map(len, parts)):
                for t, p in zip(tags, parts):
                    t.append("/".join(p[-n:]))
                break
    return [", ".join(t) for t in tags]


def build_comparison(results: Sequence[EvalResult]) -> Comparison:
    """Tabulate results (module docstring). A row is one pretraining (``EvalResult.pretraining``)
    of a method and backbone on a dataset; when one (method, backbone, dataset) comes from several
    pretrainings, their rows' backbone labels carry :func:`pretraining_tags` (``vit/16 (100 ep)``).
    When one pretraining was evaluated by a protocol more than once, the newest record
    (``created``) wins and a note goes to stderr."""
    latest: dict[tuple[RowKey, tuple, str], EvalResult] = {}
    for r in results:
        key = ((r.method, r.label, r.data_label), r.pretraining, r.protocol)
        if key in latest:
            print(f"compare: several {r.protocol} results for {key[0]} from {r.source}; keeping the newest", file=sys.stderr)
            if r.created < latest[key].created:
                continue
        latest[key] = r
    pretrainings: dict[RowKey, dict[tuple, EvalResult]] = {}
    for (row, pretraining, _), r in latest.items():
        pretrainings.setdefault(row, {}).setdefault(pretraining, r)
    row_of: dict[tuple[RowKey, tuple], RowKey] = {}
    for row, records in pretrainings.items():
        tags = pretraining_tags(list(records.values())) if len(records) > 1 else [""]
        for pretraining, tag in zip(records, tags):
            row_of[(row, pretraining)] = (row[0], f"{row[1]} ({tag})" if tag else row[1], row[2])
    latest = {(row_of[(row, pretraining)], pretraining, protocol): r for (row, pretraining, protocol), r in latest.items()}
    rows = sorted({k[0] for k in latest}, key=lambda row: (row[2], row[1], method_order(row[0])))
    columns: list[tuple[str, str]] = []
    cells: dict[tuple[RowKey, tuple[str, str]], float] = {}
    for protocol in PROTOCOLS:
        here = {row: r for (row, _, p), r in latest.items() if p == protocol}
        if not here:
            continue
        names = sorted({m for r in here.values() for m in r.metrics if not m.endswith("_std")}, key=_metric_order)
        columns += [(protocol, m) for m in names]
        for row, r in here.items():
            for m in names:
                if m in r.metrics:
                    cells[(row, (protocol, m))] = r.metrics[m]
        key, picked = PICKED.get(protocol, ("", ""))
        if any(key in r.protocol_args for r in here.values()):  # a sweep: the score's setting beside it
            columns.append((protocol, picked))
            for row, r in here.items():
                if key in r.protocol_args:
                    cells[(row, (protocol, picked))] = float(r.protocol_args[key])
        for base, col in BASELINES.items():
            # A row is compared with the baseline's row on the same backbone and representation
            # (whichever encoder of its own checkpoint it is); of several such baselines (several
            # pretrainings), the newest.
            refs: dict[tuple[str, str], EvalResult] = {}
            for row, r in sorted(here.items(), key=lambda item: item[1].created):
                if row[0] == base:
                    refs[(r.comparable_label, row[2])] = r
            # No column where no other row has that baseline on its backbone (a baseline against
            # itself: all zeros).
            if not any(row[0] != base and (r.comparable_label, row[2]) in refs for row, r in here.items()):
                continue
            columns.append((protocol, col))
            for row, r in here.items():
                ref = refs.get((r.comparable_label, row[2]))
                if ref is not None and r.main_metric is not None and ref.main_metric is not None:
                    cells[(row, (protocol, col))] = r.main_metric - ref.main_metric
    return Comparison(rows, columns, cells, list(latest.values()))


def _cell(value: float | None, column: str) -> str:
    if value is None:
        return "–"
    if column in PICKED_COLUMNS:
        return f"{value:g}"
    return f"{100 * value:+.2f}" if column.startswith("Δ") else f"{100 * value:.2f}"


def _grid(cmp: Comparison) -> tuple[list[str], list[list[str]]]:
    head = ["method", "backbone"] + (["data"] if cmp.multi_dataset else [])
    head += [f"{p} {c}" for p, c in cmp.columns]
    body = []
    for row in cmp.rows:
        cells = [row[0], row[1]] + ([row[2]] if cmp.multi_dataset else [])
        cells += [_cell(cmp.get(row, p, c), c) for p, c in cmp.columns]
        body.append(cells)
    return head, body


def format_text(cmp: Comparison) -> str:
    """Aligned plain-text table (accuracies in %, Δ in percentage points)."""
    head, body = _grid(cmp)
    widths = [max(len(r[i]) for r in [head, *body]) for i in range(len(head))]

    n_left = 3 if cmp.multi_dataset else 2  # the names (method, backbone, data) left, the numbers right

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i < n_left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(head), rule, *map(line, body)])


def format_markdown(cmp: Comparison, figures: Sequence[Path] = (), note: str | None = None) -> str:
    """The Markdown report: the table, how to read it, the figures and the records it used;
    ``note``: a paragraph above the table (what the numbers are and are not)."""
    head, body = _grid(cmp)
    n_left = 3 if cmp.multi_dataset else 2
    align = ["---"] * n_left + ["---:"] * (len(head) - n_left)
    lines = ["# ssl_vit: comparison of evaluations", ""] + ([f"**Note:** {note}", ""] if note else [])
    lines += ["| " + " | ".join(head) + " |", "| " + " | ".join(align) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    main = ", ".join(f"{p}: {m}" for p, m in MAIN_METRIC.items())
    lines += [
        "",
        "Accuracies in %. Δ sup / Δ rand: the protocol's main metric "
        f"({main}) minus that of the supervised / random-init row with the same backbone, "
        "in percentage points." + (" LR / k: what the row's sweep picked on held-out training features." if
                                   any(c[1] in PICKED_COLUMNS for c in cmp.columns) else ""),
        "",
    ]
    for fig in figures:
        lines += [f"![{fig.stem}]({fig.name})", ""]
    lines += ["## Records", ""]
    for r in sorted(cmp.results, key=lambda r: (r.protocol, method_order(r.method))):
        lines.append(f"- `{r.summary_line()}` (source: `{r.source}`, {r.created})")
    return "\n".join(lines) + "\n"


def write_report(cmp: Comparison, out: str | Path, plots: bool = True, note: str | None = None) -> list[Path]:
    """Write the Markdown report (with ``note`` above its table) and, with ``plots``,
    ``<stem>_bars.png`` and (when FLOPs are known) ``<stem>_compute.png`` beside it. Returns the
    paths written."""
    out = Path(out)
    figures: list[Path] = []
    if plots:
        figures.append(plot_bars(cmp, out.with_name(f"{out.stem}_bars.png")))
        compute = plot_compute(cmp.results, out.with_name(f"{out.stem}_compute.png"))
        if compute is not None:
            figures.append(compute)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(format_markdown(cmp, figures, note), encoding="utf-8")
    return [out, *figures]


# ---------------------------------------------------------------------------------------- CLI
def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(
        prog="ssl-vit compare",
        description="Tabulate evaluation result JSONs: SSL methods vs the supervised baseline vs random init.",
    )
    parser.add_argument("results", nargs="+", help="result JSON files or folders (searched recursively)")
    parser.add_argument("--out", help="write a Markdown report here, with its PNG figures beside it")
    parser.add_argument("--no-plots", action="store_true", help="with --out: write the Markdown report only")
    args = parser.parse_args(argv)
    cmp = build_comparison(load_results(args.results))
    print(format_text(cmp))
    if args.out:
        for p in write_report(cmp, args.out, plots=not args.no_plots):
            print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
