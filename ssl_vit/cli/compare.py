"""``ssl-vit compare RESULTS... [--out report.md]``: one table of evaluation results, SSL methods
against the supervised baseline and random initialisation (:mod:`ssl_vit.eval.compare`), printed
and written as a Markdown report with its figures (:mod:`ssl_vit.eval.report`)."""

from __future__ import annotations

from ssl_vit.errors import ArgumentParser


def main(argv: list[str] | None = None) -> int:
    parser = ArgumentParser(prog="ssl-vit compare", description="Tabulate evaluation result JSONs: SSL methods vs the supervised baseline vs random init.")
    parser.add_argument("results", nargs="+", help="result JSON files or folders (searched recursively)")
    parser.add_argument("--out", help="write a Markdown report here, with its PNG figures beside it")
    parser.add_argument("--no-plots", action="store_true", help="with --out: write the Markdown report only")
    args = parser.parse_args(argv)
    from ssl_vit.eval.compare import build_comparison, format_text, load_results
    from ssl_vit.eval.report import write_report

    cmp = build_comparison(load_results(args.results))
    print(format_text(cmp))
    for path in write_report(cmp, args.out, plots=not args.no_plots) if args.out else []:
        print(f"wrote {path}")
    return 0
