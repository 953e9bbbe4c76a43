"""A history on the command line: ``trend HISTORY`` and ``report HISTORY`` print its table (or JSON), write its
page and TensorBoard events when asked, then apply ``--fail-on``.

The table (one row per layer: its values at the last sample, or at ``--step``) and the events fit 80 columns.
"""
import click

from qgcli.cli.options import gate


def show_history(history, *, step=None, as_json=False, html=None, force=False, tensorboard=None, fail_on=(),
                 quiet=False, baseline=None, tables=(None, None)):
    """``trend`` (and ``report`` of a history): the table or JSON on stdout, the page and events if asked, then
    the ``--fail-on`` gate; ``baseline``: another history, compared as ``qgcli diff BASELINE HISTORY`` does (the
    document's ``baseline`` section, the changes in the page, its verdict after the table)."""
    from qgcli.monitor.history import read_history
    from qgcli.monitor.trends import trend as trend_of
    from qgcli.report.summaries import dump_json

    from qgcli.report import table_out

    if html is not None:
        from qgcli.storage.outputs import check_figure_output

        check_figure_output(html, inputs=[history], force=force, option="--html", format="html")  # before the work
    table_out.check(*tables, force=force, inputs=[history], as_json=as_json)
    read = read_history(history)
    doc = {"command": "trend", "history": history, **trend_of(read)}
    steps = doc["steps"]
    if step is not None and step not in steps:
        raise click.BadParameter(f"no sample at step {step} (sampled: {_steps_text(steps)})", param_hint="'--step'")
    if baseline is not None:
        from qgcli.report.diff import baseline_section, diff_histories

        doc["baseline"] = baseline_section(baseline, diff_histories(trend_of(read_history(baseline)), doc))
    if tensorboard is not None:
        from qgcli.monitor.tensorboard import write_history

        write_history(tensorboard, read)
        if not quiet:
            click.echo(f"wrote TensorBoard events to {tensorboard}", err=True)
    if html is not None:
        _write_page(html, force, doc, history)
    if tables != (None, None):  # --csv / --parquet: the rows of the page's table (qgcli.report.history_table)
        from qgcli.report.history_table import KEYS, last_samples

        table_out.write(last_samples(doc, step), KEYS, csv=tables[0], parquet=tables[1], force=force,
                        inputs=[history])
    if as_json:
        dump_json(doc)
    elif "-" in tables:
        pass  # the table went to stdout as CSV or Parquet
    else:
        for line in table_lines(doc, step):
            click.echo(line)
        if baseline is not None:
            from qgcli.monitor.trends import printable

            at = doc["baseline"]["step"]
            click.echo(printable(f"Against the baseline {baseline}"
                                 + (f" at step {at}" if at is not None else " (no step in common: last samples)")
                                 + f": {doc['baseline']['verdict']}"))
    gate(doc, fail_on)


def _write_page(dest, force, doc, history):
    from qgcli.monitor.figures import trend_figure
    from qgcli.report import html as pages

    figures = [("Blocked gradient, clipping and oscillation per layer and step", trend_figure(doc))] \
        if doc["layers"] and doc["steps"] else []
    pages.write(dest, pages.page(doc, figures=figures, details=pages.history_details(doc)), force=force,
                inputs=[history])


def _steps_text(steps):
    return ", ".join(map(str, steps[:5])) + (f", ... {steps[-1]}" if len(steps) > 5 else "") if steps else "none"


def _cell(v, kind):
    if v is None:
        return "-"
    if kind == "pct":
        return f"{v:.0%}" if v >= 0.01 or v == 0 else "<1%"
    return f"{v:.3g}" if kind == "num" else f"{v:.1f}"


def table_lines(doc, step=None):
    import textwrap

    from qgcli.monitor.trends import printable as one_line

    steps = doc["steps"]
    at = step if step is not None else (steps[-1] if steps else None)
    yield one_line(f"trend {doc['history']}: {len(doc['layers'])} layers, {len(steps)} samples "
                   f"(steps {_steps_text(steps)}); values at step {at if at is not None else '-'}")
    cols = [("clip", "pct", 6, lambda r: None if r["clip_low"] is None else r["clip_low"] + (r["clip_high"] or 0)),
            ("block", "pct", 6, lambda r: r["blocked"]), ("dy norm", "num", 10, lambda r: r["dy_norm"]),
            ("scale", "num", 10, lambda r: r["scale_median"]), ("osc", "pct", 5, lambda r: r["oscillating"]),
            ("sqnr", "db", 6, lambda r: r["sqnr_db"])]
    width = 28  # 28 + 7 + 43: 78 columns
    yield f"{'layer':<{width}} {'role':<6}" + "".join(f"{name:>{w}}" for name, _, w, _ in cols)
    for layer in doc["layers"]:
        if at not in layer["steps"]:
            continue
        i = layer["steps"].index(at)
        row = {k: v[i] for k, v in layer.items() if isinstance(v, list) and k != "steps"}
        path = one_line(layer["path"])
        path = path if len(path) <= width else "..." + path[-(width - 3):]
        role = {"weight": "weight", "activation": "act", "batch_norm": "bn"}.get(layer["role"], layer["role"] or "-")
        yield f"{path:<{width}} {role:<6}" + "".join(f"{_cell(get(row), kind):>{w}}" for _, kind, w, get in cols)
    events = doc["events"]
    yield f"events: {len(events)}"
    for e in events:
        yield textwrap.fill(one_line(f"step {e['step']}: {e['layer']}: {e['kind']}: {e['message']}"), 80,
                            initial_indent="  ", subsequent_indent="    ")
