"""``qgcli trend HISTORY``: per layer, the statistics of a monitored training run over steps, and its events.

The table (one row per layer: its values at the last sample, or at ``--step``) and the events go to stdout,
fitting 80 columns; ``--json`` prints the whole series (``layers[]``, ``events[]``; see qgcli.monitor.trends).
"""
import click

from qgcli.cli.options import json_option

_EXAMPLE = """\b
Examples:
  qgcli trend run.qgh                  # per-layer values at the last sample, and the events
  qgcli trend run.qgh --step 100
  qgcli trend run.qgh --json | jq '.events[]'
"""


@click.command(epilog=_EXAMPLE, short_help="Per-layer statistics and events of a monitored run (a history).")
@click.argument("history", metavar="HISTORY", type=click.Path(exists=True, dir_okay=False))
@click.option("--step", type=click.IntRange(min=1), default=None, help="Show the sample at step N (default: the last).")
@json_option()
def trend(history, step, as_json):
    """Per-layer statistics over steps, and events, of a history written by qgcli.monitor.

    HISTORY is the file a monitor wrote (recognised by its content, whatever its name). Events: the sample
    where a layer's blocked gradient or clipping jumps, a scale collapses or goes negative, min > max, the
    upstream gradient becomes zero, weights oscillate, NaN appears, fake quant is switched off.
    """
    from qgcli.monitor.history import read_history
    from qgcli.monitor.trends import trend as trend_of
    from qgcli.report.summaries import dump_json

    doc = trend_of(read_history(history))
    doc = {"command": "trend", "history": history, **doc}
    if as_json:
        dump_json(doc)
        return
    steps = doc["steps"]
    if step is not None and step not in steps:
        raise click.BadParameter(f"no sample at step {step} (sampled: {_steps_text(steps)})", param_hint="'--step'")
    for line in table_lines(doc, step):
        click.echo(line)


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
