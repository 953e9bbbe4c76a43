"""A history's table: one row per layer at its last sample (or at a given step), from the ``trend --json``
document (qgcli.monitor.trends), as the HTML page, ``--fail-on``, ``--csv``/``--parquet`` and ``diff`` see it.

>>> doc = {"layers": [{"path": "a", "role": "weight", "steps": [1, 10], "blocked": [0.0, 0.25],
...                    "clip_low": [0.0, 0.1], "clip_high": [0.0, 0.05], "sqnr_db": [30.0, 20.0]}],
...        "events": [{"step": 10, "layer": "a", "kind": "blocked_jump", "message": ""}]}
>>> row = last_samples(doc)[0]
>>> row["path"], row["step"], row["blocked"], round(row["clipped"], 2), row["events"]
('a', 10, 0.25, 0.15, 1)
"""

#: The row's keys, in order: the layer, its role and step, then its statistics there (``clipped``: clip_low +
#: clip_high), and how many events the layer had up to that step.
KEYS = ("path", "role", "step", "blocked", "clipped", "clip_low", "clip_high", "sqnr_db", "dy_norm", "dx_norm",
        "scale_median", "oscillating", "events")
#: The statistics of one sample a layer's per-step table shows (its details in the HTML page).
STEP_KEYS = ("step", "blocked", "clip_low", "clip_high", "sqnr_db", "dy_norm", "scale_median", "oscillating")


def last_samples(doc, step=None):
    """One row per layer sampled at ``step`` (default: each layer's last sample), worst (most blocked) first."""
    rows = []
    for layer in doc.get("layers") or ():
        steps = layer.get("steps") or []
        if not steps or (step is not None and step not in steps):
            continue
        i = len(steps) - 1 if step is None else steps.index(step)
        at = {k: (v[i] if isinstance(v, list) and len(v) == len(steps) else None) for k, v in layer.items()}
        low, high = at.get("clip_low"), at.get("clip_high")
        row = {k: at.get(k) for k in KEYS}
        row.update(path=layer["path"], role=layer.get("role"), step=steps[i],
                   clipped=None if low is None and high is None else (low or 0.0) + (high or 0.0),
                   events=sum(e["layer"] == layer["path"] and e["step"] <= steps[i] for e in doc.get("events") or ()))
        rows.append(row)
    rows.sort(key=lambda r: -(r["blocked"] or 0.0))
    return rows


def step_rows(layer):
    """A layer's samples as rows of :data:`STEP_KEYS`, in step order."""
    return [{k: (layer["steps"][i] if k == "step" else (layer.get(k) or [None] * len(layer["steps"]))[i])
             for k in STEP_KEYS} for i in range(len(layer.get("steps") or ()))]
