"""``qgcli diff A B``: two run files (or bundles), or two histories, compared layer by layer, worst changes
first."""
import click

from qgcli.cli.options import fail_on_option, gate, json_option, table_out_options
from qgcli.report.summaries import dump_json, stdout_console

_EXAMPLE = """\b
Examples:
  qgcli diff baseline_run.h5 new_run.h5            # what the change did to each quantizer
  qgcli diff old.h5 new.h5 --json | jq '.rows[0]'
  qgcli diff baseline.qgh new.qgh --fail-on 'blocked>5%,no-gradient'   # two monitor histories
"""


@click.command(epilog=_EXAMPLE, short_help="Two run files (or bundles), or two histories, compared layer by layer, "
                                            "worst changes first.")
@click.argument("a", metavar="A", type=click.Path(dir_okay=False))
@click.argument("b", metavar="B", type=click.Path(dir_okay=False))
@click.option("--top", type=click.IntRange(min=1), default=None, metavar="K", help="Show the K worst changes only.")
@click.option("--step", type=int, default=None, metavar="N",
              help="Two histories: compare at step N (default: the last step both sampled).")
@json_option("Print one JSON document on stdout: rows with both sides and the change, worst first.")
@table_out_options(with_force=True)
@fail_on_option("diff")
def diff(a, b, top, step, as_json, csv_out, parquet, force, fail_on):
    """Compare two run files, A (the baseline) and B (each RUN or RUN:GROUP; a bundle is one layer): per
    layer, by group path, or by layer name at its latest step when the files' steps differ, the change of the
    gradient mass blocked, the clipped shares and the SQNR, worst first.

    Two histories of the training monitor (recognised by their content): per layer at the last step both
    sampled (--step N: at step N), the same and the oscillating share, the gradient norms, the scale, the
    range and the events so far; a layer that lost its upstream gradient is the worst change."""
    import os

    from qgcli.report import table_out
    from qgcli.report.diff import diff as compare

    inputs = [a.split(":")[0], b.split(":")[0]]
    table_out.check(csv_out, parquet, force=force, inputs=inputs, as_json=as_json)
    histories = [_is_history(a), _is_history(b)]
    if histories[0] != histories[1]:  # one line, before any work
        other = b if histories[0] else a
        if not (os.path.exists(other.split(":")[0]) or os.path.exists(other)):
            raise click.BadParameter(f"no such file: {other}", param_hint="'B'" if histories[0] else "'A'")
        raise click.BadParameter(f"{b} is {'not ' if histories[0] else ''}a history and A ({a}) is"
                                 f"{'' if histories[0] else ' not'}: compare two histories, or two run files "
                                 "(or bundles)", param_hint="'B'")
    if all(histories):
        doc = _histories(a, b, step)
    else:
        if step is not None:
            raise click.BadParameter("applies to two histories (a run file's steps are its groups: A:step_N)",
                                     param_hint="'--step'")
        from qgcli.report.layers import run_file_document

        doc = compare(run_file_document([a]), run_file_document([b]))
    doc.update(a=a, b=b)
    if top is not None:
        doc["rows"] = doc["rows"][:top]
    table_out.write(doc["rows"], csv=csv_out, parquet=parquet, force=force, inputs=inputs)
    if as_json:
        dump_json(doc)
    elif "-" not in (csv_out, parquet):
        _render(stdout_console(), doc)
    gate(doc, fail_on)


def _is_history(path):
    import os

    from qgcli.monitor.history import is_history

    return os.path.isfile(path) and is_history(path)


def _histories(a, b, step):
    from qgcli.monitor.history import read_history
    from qgcli.monitor.trends import trend
    from qgcli.report.diff import diff_histories

    return diff_histories(trend(read_history(a)), trend(read_history(b)), step)


def _render(console, doc):
    from qgcli.report.summaries import number
    from qgcli.report.tables import Col, print_items, print_table
    from qgcli.report.text import printable_doc

    doc = printable_doc(doc)

    def pct(v):
        return "-" if v is None else f"{100 * v:.1f}%"

    def points(v):
        return "-" if v is None else f"{100 * v:+.1f}"

    def db(v, signed=False):
        return "-" if v is None else (f"{v:+.1f}" if signed else f"{v:.1f}")

    cols = (Col("layer", justify="left", priority=0), Col("blocked", priority=0), Col("Δ", help="change, in "
            "percent points (blocked, clipped) or dB (SQNR)", priority=0), Col("clipped", priority=1),
            Col("Δc", priority=1), Col("SQNR", help="dB", priority=1), Col("Δs", priority=1))
    rows = [[r["path"], f"{pct(r['a']['gradient_blocked'])}→{pct(r['b']['gradient_blocked'])}",
             points(r["change"]["gradient_blocked"]), f"{pct(r['a']['clipped'])}→{pct(r['b']['clipped'])}",
             points(r["change"]["clipped"]), f"{db(r['a']['sqnr_db'])}→{db(r['b']['sqnr_db'])}",
             db(r["change"]["sqnr_db"], signed=True)] for r in doc["rows"]]
    if doc.get("kind") == "histories":
        at = doc["step"] if doc["step"] is not None else f"{doc['steps'][0]} (A) and {doc['steps'][1]} (B), no " \
            "step in common"
        print_items(console, f"histories compared at step {at}")
        cols += (Col("dy norm", help="upstream gradient's L2 norm", priority=2), Col("osc", help="oscillating "
                 "weights", priority=2))
        for row, r in zip(rows, doc["rows"]):
            row += [f"{number(r['a']['dy_norm'], 3)}→{number(r['b']['dy_norm'], 3)}",
                    f"{pct(r['a']['oscillating'])}→{pct(r['b']['oscillating'])}"]
    print_table(console, cols, rows, styles=["red" if r["score"] > 0 else None for r in doc["rows"]])
    for side, names in (("A", doc["only_in_a"]), ("B", doc["only_in_b"])):
        if names:
            print_items(console, f"only in {side}: {', '.join(names[:5])}" + (" ..." if len(names) > 5 else ""))
    console.print(doc["verdict"], soft_wrap=True)
