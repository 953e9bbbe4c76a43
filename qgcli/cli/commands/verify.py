"""``qgcli verify``: does the framework's own result of every layer of a run file equal qgcli's?

The table (worst first) goes to stdout, or one JSON document with ``--json``.  Exit 0 when every layer with
a ``reference/`` subgroup passes, 1 when one does not (a fake-quant layer not bit-identical, a batch norm or
a reduction beyond ``--rtol``), 2 for bad usage or a file that is no run file.
"""
import click

from qgcli.cli.options import fail_on_option, gate, json_option, scheduler_option, table_options, table_out_options
from qgcli.report.summaries import dump_json, number, stdout_console

_EXAMPLE = """\b
Examples:
  qgcli verify run.h5                  # every captured layer against qgcli's recomputation
  qgcli verify run.h5:step_000003 --json
"""


@click.command(epilog=_EXAMPLE, short_help="A captured run file recomputed: qgcli vs the framework, per layer.")
@click.argument("run", metavar="RUN", type=click.Path(dir_okay=False))
@click.option("--rtol", type=click.FloatRange(min=0.0), default=1e-5, show_default=True,
              help="Largest difference allowed, relative to the largest reference value, for batch-norm outputs "
                   "and fake-quant reductions (element-wise fake-quant outputs must be bit-identical).")
@click.option("--top", type=click.IntRange(min=1), default=None, help="Show only the N worst layers.")
@json_option()
@click.option("--html", "html", metavar="FILE", default=None,
              help="Also write one self-contained HTML page of the result (the verdict, the sortable table).")
@click.option("--force", is_flag=True, help="Replace an existing --html, --csv or --parquet FILE.")
@table_out_options()
@fail_on_option("verify")
@scheduler_option()
@table_options
def verify(run, rtol, top, as_json, html, force, csv_out, parquet, fail_on, scheduler):
    """Recompute every layer of run file RUN with qgcli and compare with the framework's own results.

    RUN is a run file written by qgcli.capture (or any run file whose groups hold a reference/ subgroup of
    the framework's outputs under qgcli's output names), or one group of it (run.h5:step_000300).
    Per layer: bitwise equal, or the largest difference in ulps and relative to the largest value.
    """
    from qgcli.report import table_out
    from qgcli.report.verify import verify as verify_run

    from qgcli.execution.dispatch import default_scheduler

    if html is not None:
        from qgcli.storage.outputs import check_figure_output

        check_figure_output(html, inputs=[run.split(":", 1)[0]], force=force, option="--html", format="html")
    table_out.check(csv_out, parquet, force=force, inputs=[run.split(":", 1)[0]], as_json=as_json)
    summary = verify_run(run, rtol=rtol, scheduler=scheduler or default_scheduler())
    if html is not None:
        from qgcli.report import html as pages

        pages.write(html, pages.page(summary), force=force, inputs=[run.split(":", 1)[0]])
    table_out.write(summary["layers"], csv=csv_out, parquet=parquet, force=force, inputs=[run.split(":", 1)[0]])
    if as_json:
        dump_json(summary)
    elif "-" not in (csv_out, parquet):
        _render(stdout_console(), summary, top)
    gate(summary, fail_on)
    if not summary["ok"]:
        raise click.ClickException(f"{summary['failed']} of {summary['verified']} layers differ from the "
                                   "framework's results (see the table, or --json)")


def _held_to(row, rtol):
    """The rule the output with the most ulps was held to, so that a large count reads as what it is: "bitwise"
    (0 ulps), "rtol 1e-05" (of the largest reference value) or "sum bound" (float32's worst-case summation
    error, where it is the larger)."""
    compared = [c for c in row["outputs"].values() if c.get("compared", True) and "rule" in c]
    if not compared or not row["max_ulps"]:
        return "-"  # identical, or nothing compared: no count to explain
    worst = max(compared, key=lambda c: c.get("max_ulps") or 0)
    if worst["rule"] != "bitwise" and worst.get("bound") is not None and (worst.get("rel") or 0.0) > rtol:
        return "sum bound"
    return worst["rule"]


_COLS = None


def _cols():
    """verify's columns, ranked by what a reader needs at 80 columns: the layer (shortened from the middle
    when it must be), its status, the count and the rule it was held to; the op and the output go first."""
    global _COLS
    if _COLS is None:
        from qgcli.report.tables import Col

        _COLS = (Col("layer", "left", priority=0, shorten=True), Col("op", "left", priority=2),
                 Col("status", "left", priority=0), Col("max ulps", priority=1),
                 Col("held to", "left", help="the rule the output with the most ulps was held to", priority=1),
                 Col("rel", help="largest difference relative to the largest reference value", priority=1),
                 Col("worst output", "left", priority=3))
    return _COLS


def _render(console, s, top):
    from rich.text import Text

    from qgcli.report.tables import print_items, print_table
    from qgcli.report.text import counted, markup, printable_doc

    s = printable_doc(s)
    print_items(console, f"[bold]verify[/] {markup(s['run_file'])}: {s['passed']} of {s['verified']} layers pass "
                f"({s['identical']} bit-identical), {s['failed']} fail; rtol {s['rtol']:g}"
                + (f"; {counted(s['no_reference'], 'group')} without a reference" if s["no_reference"] else ""))
    rows = []
    all_rows = [r for r in s["layers"] if r["status"] != "no-reference"]
    for r in all_rows[:top] if top else all_rows:
        worst = max(((name, c) for name, c in r["outputs"].items() if c.get("compared", True)),
                    key=lambda item: (item[1].get("rel") or 0.0), default=(None, None))[0] if r["rel"] else None
        status = r["status"]
        colour = {"identical": "green", "within-rtol": "green", "differs": "red", "failed": "red"}[status]
        rows.append([r["path"], r["op"] or "", Text(status, style=colour), number(r["max_ulps"]),
                     _held_to(r, s["rtol"]), number(r["rel"], 3), r["error"] or worst or ""])
    print_table(console, _cols(), rows, choice=True, legend=False)
