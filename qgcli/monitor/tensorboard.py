"""A history as TensorBoard events: written live by a monitor (``tensorboard=LOGDIR``) or afterwards from the
finished file (``qgcli trend HISTORY --tensorboard LOGDIR``), the same events either way.

Each sample goes to :class:`qgcli.report.tensorboard.SampleEvents` with the layers where an event's condition
(:func:`qgcli.monitor.trends.conditions`) holds at that sample, which needs each layer's previous sample and the
largest median scale before it: that is all the state kept.
"""
from qgcli.monitor.trends import conditions


class LiveEvents:
    """Event files under ``logdir``, one :meth:`add_sample` per history sample (``{layer path: stats}``)."""

    def __init__(self, logdir):
        from qgcli.report.tensorboard import SampleEvents

        self._events = SampleEvents(logdir)
        self._previous = {}  # path -> (its last sample's row, the largest median scale sampled so far)

    def add_sample(self, step, rows):
        # NaN is a statistic with nothing to measure: None, as the history stores it (NULL)
        rows = {path: {k: v for k, v in row.items() if v is not None and v == v} for path, row in rows.items()}
        with_events = []
        for path, row in rows.items():
            prev, top = self._previous.get(path, (None, None))
            earlier = [] if prev is None else [{"scale_median": top}, prev]
            if conditions(row, earlier):
                with_events.append(path)
            scale = row.get("scale_median")
            self._previous[path] = (row, top if scale is None or (top is not None and top >= scale) else scale)
        self._events.add_sample(step, rows, with_events)

    def close(self):
        self._events.close()


def write_history(logdir, history):
    """The events of a finished :class:`qgcli.monitor.history.History` under ``logdir``; returns the samples."""
    from qgcli.monitor.history import NAMES

    by_step = {}
    for layer in history.layers:
        s = history.series(layer["path"])
        for i, step in enumerate(s["steps"]):
            by_step.setdefault(step, {})[layer["path"]] = {n: s[n][i] for n in NAMES}
    events = LiveEvents(logdir)
    try:
        for step in sorted(by_step):
            events.add_sample(step, by_step[step])
    finally:
        events.close()
    return len(by_step)
