"""``qgcli diff A B``: what changed between two reports (or two histories), layer by layer, worst first.

Two run files or bundles: both sides are the documents ``qgcli report --json`` gives (a run file's ``layers`` or
a bundle's ``rows``), matched by layer path (channel index for a bundle).  Two histories of the training monitor:
both sides are ``qgcli trend --json`` documents, each layer taken at one step, the last step both histories
sampled (or a step given; the last sample of each when they share none), matched by layer path
(:func:`diff_histories`).  Per row: each statistic on both sides and its change; "worse" is more gradient mass
blocked, more clipped, a lower SQNR, more oscillating weights, an upstream gradient lost; a row's score adds it
up: the blocked, clipped and oscillating shares' rises in percent points, the SQNRs' falls in dB / 10, and 100
for an upstream gradient lost (minus as much for what got better).  Rows only one side has are listed apart.

>>> a = {"layers": [{"path": "x", "gradient_blocked": 0.1, "clipped": 0.1, "sqnr_db": 30.0}]}
>>> b = {"layers": [{"path": "x", "gradient_blocked": 0.3, "clipped": 0.2, "sqnr_db": 20.0}]}
>>> d = diff(a, b)
>>> d["rows"][0]["change"]["gradient_blocked"], d["rows"][0]["change"]["sqnr_db"], d["worse"]
(0.2, -10.0, 1)
"""
from qgcli.errors import OptionError
from qgcli.report.history_table import last_samples

#: The statistics compared, and the sign of "worse" (+1: a rise is worse; -1: a fall is worse; 0: shown, not
#: judged).
STATISTICS = (("gradient_blocked", +1), ("clipped", +1), ("clipped_below", +1), ("clipped_above", +1),
              ("sqnr_db", -1), ("suggested_sqnr_db", -1))
#: Those of two histories: the run files' (at one step) and the oscillating share, the gradient norms, the scale
#: and the representable range, the events the layer had up to that step.
HISTORY_STATISTICS = (("gradient_blocked", +1), ("clipped", +1), ("clipped_below", +1), ("clipped_above", +1),
                      ("sqnr_db", -1), ("oscillating", +1), ("dy_norm", 0), ("dx_norm", 0), ("scale_median", 0),
                      ("range_min", 0), ("range_max", 0), ("events", 0))
#: The statistics a row's score adds up (the clipped shares below and above are judged, and in ``clipped``).
SCORED = ("gradient_blocked", "clipped", "sqnr_db", "suggested_sqnr_db", "oscillating")
#: Changes smaller than these are no change: a tenth of a percent of a share, a hundredth of a dB.
SAME = {"gradient_blocked": 1e-3, "clipped": 1e-3, "clipped_below": 1e-3, "clipped_above": 1e-3,
        "sqnr_db": 1e-2, "suggested_sqnr_db": 1e-2, "oscillating": 1e-3}
#: The score of a layer whose upstream gradient was present in A and is not in B (minus that when regained): as
#: much as its whole gradient blocked.
LOST_GRADIENT = 100.0
#: A history's statistic -> the name a diff gives it (the run files' names where they mean the same).
_HISTORY_NAMES = {"blocked": "gradient_blocked", "clip_low": "clipped_below", "clip_high": "clipped_above"}


def _rows(doc, by_layer=False):
    """Rows by layer path (by the layer's name without its step, its latest step, with ``by_layer``), or by
    channel for a bundle's report."""
    if "layers" not in doc:
        return {f"ch {r['channel']}": r for r in doc.get("rows") or ()}
    if not by_layer:
        return {r["path"]: r for r in doc["layers"]}
    latest = {}
    for r in doc["layers"]:
        name = r.get("layer") or r["path"]
        if name not in latest or str(r.get("step")) > str(latest[name].get("step")):
            latest[name] = r
    return latest


def diff(a, b):
    """The comparison of report documents ``a`` (the baseline) and ``b`` (a JSON-safe dict); two run files
    whose paths differ only by their steps are matched by layer, each at its latest step."""
    ra, rb = _rows(a), _rows(b)
    if ra and rb and not set(ra) & set(rb):
        ra, rb = _rows(a, by_layer=True), _rows(b, by_layer=True)
    return compare(ra, rb, STATISTICS)


def history_rows(doc, step=None):
    """``{layer path: row}`` of a ``trend`` document at ``step`` (default: each layer's last sample), in a diff's
    names (:data:`HISTORY_STATISTICS`, ``upstream_gradient``)."""
    layers = {layer["path"]: layer for layer in doc.get("layers") or ()}
    rows = {}
    for r in last_samples(doc, step):
        layer = layers[r["path"]]
        i = layer["steps"].index(r["step"])
        row = {_HISTORY_NAMES.get(k, k): v for k, v in r.items()}
        row.update(range_min=(layer.get("range_min") or [None] * (i + 1))[i],
                   range_max=(layer.get("range_max") or [None] * (i + 1))[i],
                   upstream_gradient=("absent" if r["dy_norm"] is None else "zero" if r["dy_norm"] == 0 else "present"))
        if row["upstream_gradient"] != "present":
            row["gradient_blocked"] = None  # a share of no gradient mass means nothing (as for run files)
        rows[r["path"]] = row
    return rows


def diff_histories(a, b, step=None):
    """The comparison of two ``trend`` documents, ``a`` the baseline: every layer at ``step`` (default: the last
    step both sampled; when they share none, each history's last sample).  The document says the step compared
    (``step``; ``null`` with ``steps``, one per side, when none is shared).  A ``step`` not in both is a
    :class:`qgcli.errors.OptionError`."""
    common = sorted(set(a.get("steps") or ()) & set(b.get("steps") or ()))
    if step is not None and step not in common:
        raise OptionError(f"step {step} is not sampled by both histories (common steps: "
                          f"{', '.join(map(str, common[-5:])) or 'none'})", param_hint="'--step'")
    at = step if step is not None else (common[-1] if common else None)
    doc = compare(history_rows(a, at), history_rows(b, at), HISTORY_STATISTICS)
    sides = [(d.get("steps") or [None])[-1] if at is None else at for d in (a, b)]
    return {"command": "diff", "kind": "histories", "step": at, "steps": sides,
            **{k: v for k, v in doc.items() if k != "command"}}


def compare(ra, rb, statistics):
    """The diff document of rows ``ra`` (the baseline) and ``rb`` (``{key: row}``), on ``statistics``."""
    rows = []
    for key in [k for k in ra if k in rb]:
        x, y = ra[key], rb[key]
        change, score = {}, 0.0
        for name, sign in statistics:
            if x.get(name) is None or y.get(name) is None:
                change[name] = None
                continue
            delta = y[name] - x[name] if isinstance(x[name], int) and isinstance(y[name], int) else \
                round(float(y[name]) - float(x[name]), 12)
            change[name] = delta
            if name in SCORED and abs(delta) >= SAME[name]:
                # worse-ness in comparable units: shares in percent points, SQNR in dB / 10
                score += sign * delta * (0.1 if name.endswith("sqnr_db") else 100.0)
        gradient = [x.get("upstream_gradient"), y.get("upstream_gradient")]
        if gradient[0] != gradient[1] and "present" in gradient and None not in gradient:
            score += LOST_GRADIENT if gradient[0] == "present" else -LOST_GRADIENT
        rows.append({"path": key, "paths": [x.get("path", key), y.get("path", key)],
                     "a": {n: x.get(n) for n, _ in statistics}, "b": {n: y.get(n) for n, _ in statistics},
                     "change": change, "score": round(score, 9), "upstream_gradient": gradient})
    rows.sort(key=lambda r: (-r["score"], r["path"]))
    worse = sum(r["score"] > 0 for r in rows)
    better = sum(r["score"] < 0 for r in rows)
    only_a = [k for k in ra if k not in rb]
    only_b = [k for k in rb if k not in ra]
    return {"command": "diff", "rows": rows, "worse": worse, "better": better,
            "unchanged": len(rows) - worse - better, "only_in_a": only_a, "only_in_b": only_b,
            "verdict": _verdict(rows, worse, better, only_a, only_b)}


def baseline_section(file, doc):
    """The ``baseline`` section a report gets from ``report ... --baseline FILE``: the diff document of FILE
    against the report (``file``, then the diff's keys but ``command``)."""
    return {"file": file, **{k: v for k, v in doc.items() if k != "command"}}


def lost_gradient(row):
    """True when the row's layer had an upstream gradient in A and has none (all zero, or absent) in B."""
    a, b = row.get("upstream_gradient") or (None, None)
    return a == "present" and b in ("zero", "absent")


def _verdict(rows, worse, better, only_a, only_b):
    if not rows:
        return "Verdict: nothing in common to compare."
    parts = [f"{worse} of {len(rows)} {'row' if len(rows) == 1 else 'rows'} worse, {better} better"]
    top = [r for r in rows if r["score"] > 0][:3]
    if top:
        def says(r):
            c = r["change"]
            if lost_gradient(r):
                return f"{r['path']} lost its gradient"
            if c["gradient_blocked"] is not None and abs(c["gradient_blocked"]) >= SAME["gradient_blocked"]:
                return f"{r['path']} blocked {100 * c['gradient_blocked']:+.1f} points"
            if c["clipped"] is not None and abs(c["clipped"]) >= SAME["clipped"]:
                return f"{r['path']} clipped {100 * c['clipped']:+.1f} points"
            if c.get("oscillating") is not None and abs(c["oscillating"]) >= SAME["oscillating"]:
                return f"{r['path']} oscillating {100 * c['oscillating']:+.1f} points"
            if c["sqnr_db"] is not None:
                return f"{r['path']} SQNR {c['sqnr_db']:+.1f} dB"
            return f"{r['path']} worse"
        parts.append("worst: " + ", ".join(says(r) for r in top))
    if only_a or only_b:
        parts.append(f"{len(only_a)} only in A, {len(only_b)} only in B")
    return "Verdict: " + "; ".join(parts) + "."
