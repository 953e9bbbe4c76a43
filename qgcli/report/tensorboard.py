"""TensorBoard event files of a report (``report RUN --tensorboard LOGDIR``), written with tensorboardX (the
``[tensorboard]`` extra: a maintained writer of TensorBoard's own format, without TensorFlow).

Scalars per layer under one tag family per statistic (``gradient_blocked/<layer>``, ``clipped/<layer>``,
``sqnr_db/<layer>``), at the run file's step numbers (``step_000300`` is step 300; a file without steps is
step 0); a few aggregate curves that stay readable with hundreds of layers (``aggregate/worst_5_gradient_blocked``,
the mean of the five worst layers, ``aggregate/share_flagged``, ``aggregate/median_sqnr_db``); and per step a
histogram of the layers' blocked shares (``distribution/gradient_blocked``).  A history (``trend HISTORY
--tensorboard``, or a monitor's ``tensorboard=LOGDIR`` while it trains) is written sample by sample by
:class:`SampleEvents`.
"""
import re

import numpy as np

from qgcli.errors import OutputError

#: The per-layer statistics written, row key -> tag family.
STATISTICS = (("gradient_blocked", "gradient_blocked"), ("clipped", "clipped"), ("sqnr_db", "sqnr_db"))
WORST = 5

_DIGITS = re.compile(r"(\d+)$")


def step_number(step):
    """``step_000300`` -> 300; None or a name without a number -> 0."""
    m = _DIGITS.search(str(step or ""))
    return int(m.group(1)) if m else 0


def write_report(logdir, doc):
    """Write the event file of a run-file ``report`` document (its ``layers`` rows) under ``logdir``; returns
    the number of scalars written."""
    writer = _writer(logdir)
    written = 0
    try:
        by_step = {}
        for row in doc.get("layers") or ():
            step = step_number(row.get("step"))
            by_step.setdefault(step, []).append(row)
            for key, family in STATISTICS:
                value = row.get(key)
                if value is not None:
                    writer.add_scalar(f"{family}/{row.get('layer') or row['path']}", float(value), step)
                    written += 1
        for step, rows in sorted(by_step.items()):
            blocked = sorted((r["gradient_blocked"] for r in rows if r.get("gradient_blocked") is not None),
                             reverse=True)
            sqnr = [r["sqnr_db"] for r in rows if r.get("sqnr_db") is not None]
            if blocked:
                writer.add_scalar(f"aggregate/worst_{WORST}_gradient_blocked", float(np.mean(blocked[:WORST])), step)
                writer.add_histogram("distribution/gradient_blocked", np.asarray(blocked, np.float64), step)
                written += 1
            if sqnr:
                writer.add_scalar("aggregate/median_sqnr_db", float(np.median(sqnr)), step)
                written += 1
            writer.add_scalar("aggregate/share_flagged", sum(bool(r.get("flagged")) for r in rows) / len(rows), step)
            written += 1
    finally:
        writer.close()
    return written


#: A history's per-layer statistics written (``trend --tensorboard``, the monitor's ``tensorboard=``): the name in
#: a sample's row (``clipped``: clip_low + clip_high) -> tag family.
HISTORY_STATISTICS = (("blocked", "gradient_blocked"), ("clipped", "clipped"), ("sqnr_db", "sqnr_db"),
                      ("dy_norm", "upstream_gradient_norm"), ("scale_median", "scale_median"),
                      ("oscillating", "oscillating"))


class SampleEvents:
    """The event file of a history, one sample at a time (so that a monitor writes it live and ``trend
    --tensorboard`` writes the same from the finished history): per layer a scalar per statistic of
    :data:`HISTORY_STATISTICS`; per sample ``aggregate/worst_5_gradient_blocked``, ``aggregate/share_with_events``
    (the share of the sampled layers where an event's condition holds, qgcli.monitor.trends) and a histogram of
    the layers' blocked shares."""

    def __init__(self, logdir):
        # tensorboardX writes events from a thread of its own, and its flush() flushes what that thread has
        # written, not what is still queued for it: the thread's own flush, every second here (not every 120 s),
        # puts each sample on disk within about a second of add_sample
        self._writer = _writer(logdir, flush_secs=1)

    def add_sample(self, step, rows, with_events=()):
        """``rows``: ``{layer path: {statistic: value}}`` (clip_low and clip_high give ``clipped``);
        ``with_events``: the paths where an event's condition holds."""
        w = self._writer
        blocked = []
        for path, stats in rows.items():
            low, high = stats.get("clip_low"), stats.get("clip_high")
            values = dict(stats, clipped=None if low is None and high is None else (low or 0.0) + (high or 0.0))
            for key, family in HISTORY_STATISTICS:
                if values.get(key) is not None:
                    w.add_scalar(f"{family}/{path}", float(values[key]), step)
            if values.get("blocked") is not None:
                blocked.append(float(values["blocked"]))
        if blocked:
            blocked.sort(reverse=True)
            w.add_scalar(f"aggregate/worst_{WORST}_gradient_blocked", float(np.mean(blocked[:WORST])), step)
            w.add_histogram("distribution/gradient_blocked", np.asarray(blocked, np.float64), step)
        if rows:
            w.add_scalar("aggregate/share_with_events", len(set(with_events) & set(rows)) / len(rows), step)
        w.flush()  # a TensorBoard watching the folder sees each sample as it is written

    def close(self):
        self._writer.close()


def _writer(logdir, flush_secs=120):
    try:
        from tensorboardX import SummaryWriter
    except ImportError:
        raise OutputError("writing TensorBoard event files needs tensorboardX: pip install 'qgcli[tensorboard]'",
                          operand="--tensorboard") from None
    try:
        return SummaryWriter(logdir=logdir, flush_secs=flush_secs)
    except OSError as exc:
        raise OutputError(f"cannot write to {logdir}: {exc.strerror or exc}", operand="--tensorboard") from None
