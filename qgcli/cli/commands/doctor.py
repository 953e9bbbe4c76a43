"""``qgcli doctor RUN_OR_HISTORY``: the gradient path of a training run checked.

One finding per layer and kind (``ste_broken``, ``no_gradient``, ``range_collapse``, ``range_not_learning``,
``nan``: errors; ``oscillation``, ``observer_default``, ``fake_quant_disabled``: warnings), each with the step
where first seen, the evidence and what to do.  ``--fail-on error`` (``warning``: any finding; or a kind,
``no_gradient,nan``) exits 3 after printing, naming the findings on stderr (qgcli.report.gates).
"""
import click

from qgcli.cli.options import fail_on_option, gate, json_option, table_out_options

_EXAMPLE = """\b
Examples:
  qgcli doctor run.qgh                     # a history from qgcli.monitor: every check
  qgcli doctor run.h5 --json               # a run file from qgcli.capture: the checks one step allows
  qgcli doctor run.qgh --fail-on error     # exit 3 when an error is found (CI)
  qgcli doctor run.qgh --html doctor.html  # the findings as a page
"""

@click.command(epilog=_EXAMPLE, short_help="Gradient-path findings of a history or a run file; --fail-on for CI.")
@click.argument("target", metavar="RUN_OR_HISTORY", type=click.Path(dir_okay=False))
@fail_on_option("doctor")
@json_option()
@click.option("--html", "html", metavar="FILE", default=None,
              help="Also write one self-contained HTML page: the findings in a sortable table, with their "
                   "evidence and advice (no network needed to open it).")
@click.option("--force", is_flag=True, help="Replace an existing --html, --csv or --parquet FILE.")
@table_out_options()
def doctor(target, fail_on, as_json, html, force, csv_out, parquet):
    """Check the gradient path of a monitored run (a history) or of one captured step (a run file).

    A history (written by qgcli.monitor, recognised by content) gets every check; a run file (qgcli.capture)
    the checks one step allows: no_gradient, observer_default, range_collapse, nan, ste_broken.
    """
    from qgcli.monitor.doctor import diagnose, FINDING_KEYS
    from qgcli.report import table_out
    from qgcli.report.summaries import dump_json
    import textwrap

    from qgcli.monitor.trends import printable as one_line

    if html is not None:
        from qgcli.storage.outputs import check_figure_output

        check_figure_output(html, inputs=[target], force=force, option="--html", format="html")  # before the work
    table_out.check(csv_out, parquet, force=force, inputs=[target], as_json=as_json)
    doc = {"command": "doctor", **diagnose(target)}
    if html is not None:
        from qgcli.report import html as pages

        pages.write(html, pages.page(doc), force=force, inputs=[target])
    findings = doc["findings"]
    table_out.write(findings, FINDING_KEYS, csv=csv_out, parquet=parquet, force=force, inputs=[target])
    if as_json:
        dump_json(doc)
    elif "-" not in (csv_out, parquet):
        click.echo(one_line(f"doctor {doc['source']} ({doc['kind']}): {doc['errors']} errors, "
                            f"{doc['warnings']} warnings"))
        for f in findings:
            step = "-" if f["step"] is None else f["step"]
            click.echo(one_line(f"{f['severity']}: {f['kind']} at step {step}: {f['layer']}"))
            for label in ("evidence", "advice"):
                click.echo(textwrap.fill(one_line(f"{label}: {f[label]}"), 80, initial_indent="  ",
                                         subsequent_indent="    "))
    gate(doc, fail_on)
