"""``qgcli doctor RUN_OR_HISTORY``: the gradient path of a training run checked.

One finding per layer and kind (``ste_broken``, ``no_gradient``, ``range_collapse``, ``range_not_learning``,
``nan``: errors; ``oscillation``, ``observer_default``, ``fake_quant_disabled``: warnings), each with the step
where first seen, the evidence and what to do.  ``--fail-on`` makes findings of that severity (or worse) exit 3.
"""
import click

from qgcli.cli.options import json_option

_EXAMPLE = """\b
Examples:
  qgcli doctor run.qgh                     # a history from qgcli.monitor: every check
  qgcli doctor run.h5 --json               # a run file from qgcli.capture: the checks one step allows
  qgcli doctor run.qgh --fail-on error     # exit 3 when an error is found (CI)
"""

FAIL_EXIT = 3


@click.command(epilog=_EXAMPLE, short_help="Gradient-path findings of a history or a run file; --fail-on for CI.")
@click.argument("target", metavar="RUN_OR_HISTORY", type=click.Path(dir_okay=False))
@click.option("--fail-on", type=click.Choice(["warning", "error"]), default=None,
              help="Exit 3 when a finding of this severity (warning: any finding) is found.")
@json_option()
def doctor(target, fail_on, as_json):
    """Check the gradient path of a monitored run (a history) or of one captured step (a run file).

    A history (written by qgcli.monitor, recognised by content) gets every check; a run file (qgcli.capture)
    the checks one step allows: no_gradient, observer_default, range_collapse, nan, ste_broken.
    """
    from qgcli.monitor.doctor import diagnose
    from qgcli.report.summaries import dump_json
    import textwrap

    from qgcli.monitor.trends import printable as one_line

    doc = {"command": "doctor", **diagnose(target)}
    findings = doc["findings"]
    if as_json:
        dump_json(doc)
    else:
        click.echo(one_line(f"doctor {doc['source']} ({doc['kind']}): {doc['errors']} errors, "
                            f"{doc['warnings']} warnings"))
        for f in findings:
            step = "-" if f["step"] is None else f["step"]
            click.echo(one_line(f"{f['severity']}: {f['kind']} at step {step}: {f['layer']}"))
            for label in ("evidence", "advice"):
                click.echo(textwrap.fill(one_line(f"{label}: {f[label]}"), 80, initial_indent="  ",
                                         subsequent_indent="    "))
    levels = {"warning": ("warning", "error"), "error": ("error",)}
    if fail_on and any(f["severity"] in levels[fail_on] for f in findings):
        raise click.exceptions.Exit(FAIL_EXIT)
