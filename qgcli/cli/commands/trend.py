"""``qgcli trend HISTORY``: per layer, the statistics of a monitored training run over steps, and its events.

The table (one row per layer: its values at the last sample, or at ``--step``) and the events go to stdout,
fitting 80 columns; ``--json`` prints the whole series (``layers[]``, ``events[]``; see qgcli.monitor.trends).
"""
import click

from qgcli.cli.history_view import show_history
from qgcli.cli.options import fail_on_option, json_option, table_out_options

_EXAMPLE = """\b
Examples:
  qgcli trend run.qgh                  # per-layer values at the last sample, and the events
  qgcli trend run.qgh --step 100
  qgcli trend run.qgh --json | jq '.events[]'
  qgcli trend run.qgh --html run.html --tensorboard tb/ --fail-on 'nan,blocked>20%'
"""


@click.command(epilog=_EXAMPLE, short_help="Per-layer statistics and events of a monitored run (a history).")
@click.argument("history", metavar="HISTORY", type=click.Path(exists=True, dir_okay=False))
@click.option("--step", type=click.IntRange(min=1), default=None, help="Show the sample at step N (default: the last).")
@json_option()
@click.option("--html", "html", metavar="FILE", default=None,
              help="Also write one self-contained HTML page: the events, the sortable table of the layers, the "
                   "figures of 'plot trend' and each layer's samples (no network needed to open it).")
@click.option("--force", is_flag=True, help="Replace an existing --html, --csv or --parquet FILE.")
@table_out_options()
@click.option("--tensorboard", "tensorboard", metavar="LOGDIR", default=None,
              help="Also write TensorBoard event files under LOGDIR: per layer and statistic at each sampled "
                   "step, aggregate curves (pip install 'qgcli[tensorboard]').")
@fail_on_option("trend")
def trend(history, step, as_json, html, force, csv_out, parquet, tensorboard, fail_on):
    """Per-layer statistics over steps, and events, of a history written by qgcli.monitor.

    HISTORY is the file a monitor wrote (recognised by its content, whatever its name). Events: the sample
    where a layer's blocked gradient or clipping jumps, a scale collapses or goes negative, min > max, the
    upstream gradient becomes zero, weights oscillate, NaN appears, fake quant is switched off.
    """
    show_history(history, step=step, as_json=as_json, html=html, force=force, tables=(csv_out, parquet),
                 tensorboard=tensorboard,
                 fail_on=fail_on)
