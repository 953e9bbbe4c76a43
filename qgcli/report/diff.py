"""``qgcli diff A B``: what changed between two reports, layer by layer (or channel by channel), worst first.

Both sides are the documents ``qgcli report --json`` gives (a run file's ``layers`` or a bundle's ``rows``),
matched by layer path (channel index for a bundle).  Per row: each statistic on both sides and its change;
"worse" is more gradient mass blocked, more clipped, a lower SQNR.  Rows only one side has are listed apart.

>>> a = {"layers": [{"path": "x", "gradient_blocked": 0.1, "clipped": 0.1, "sqnr_db": 30.0}]}
>>> b = {"layers": [{"path": "x", "gradient_blocked": 0.3, "clipped": 0.2, "sqnr_db": 20.0}]}
>>> d = diff(a, b)
>>> d["rows"][0]["change"]["gradient_blocked"], d["rows"][0]["change"]["sqnr_db"], d["worse"]
(0.2, -10.0, 1)
"""

#: The statistics compared, and the sign of "worse" (+1: a rise is worse; -1: a fall is worse).
STATISTICS = (("gradient_blocked", +1), ("clipped", +1), ("clipped_below", +1), ("clipped_above", +1),
              ("sqnr_db", -1), ("suggested_sqnr_db", -1))
#: Changes smaller than these are no change: a tenth of a percent of a share, a hundredth of a dB.
SAME = {"gradient_blocked": 1e-3, "clipped": 1e-3, "clipped_below": 1e-3, "clipped_above": 1e-3,
        "sqnr_db": 1e-2, "suggested_sqnr_db": 1e-2}


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
    rows = []
    for key in [k for k in ra if k in rb]:
        x, y = ra[key], rb[key]
        change, score = {}, 0.0
        for name, sign in STATISTICS:
            if x.get(name) is None or y.get(name) is None:
                change[name] = None
                continue
            delta = round(float(y[name]) - float(x[name]), 12)
            change[name] = delta
            if abs(delta) >= SAME[name]:
                # worse-ness in comparable units: shares in percent points, SQNR in dB / 10
                score += sign * delta * (100.0 if name != "sqnr_db" and name != "suggested_sqnr_db" else 0.1)
        rows.append({"path": key, "a": {n: x.get(n) for n, _ in STATISTICS}, "b": {n: y.get(n) for n, _ in STATISTICS},
                     "change": change, "score": score,
                     "upstream_gradient": [x.get("upstream_gradient"), y.get("upstream_gradient")]})
    rows.sort(key=lambda r: (-r["score"], r["path"]))
    worse = sum(r["score"] > 0 for r in rows)
    better = sum(r["score"] < 0 for r in rows)
    only_a = [k for k in ra if k not in rb]
    only_b = [k for k in rb if k not in ra]
    return {"command": "diff", "rows": rows, "worse": worse, "better": better,
            "unchanged": len(rows) - worse - better, "only_in_a": only_a, "only_in_b": only_b,
            "verdict": _verdict(rows, worse, better, only_a, only_b)}


def _verdict(rows, worse, better, only_a, only_b):
    if not rows:
        return "Verdict: nothing in common to compare."
    parts = [f"{worse} of {len(rows)} {'row' if len(rows) == 1 else 'rows'} worse, {better} better"]
    top = [r for r in rows if r["score"] > 0][:3]
    if top:
        def says(r):
            c = r["change"]
            if c["gradient_blocked"] is not None and abs(c["gradient_blocked"]) >= SAME["gradient_blocked"]:
                return f"{r['path']} blocked {100 * c['gradient_blocked']:+.1f} points"
            if c["clipped"] is not None and abs(c["clipped"]) >= SAME["clipped"]:
                return f"{r['path']} clipped {100 * c['clipped']:+.1f} points"
            return f"{r['path']} SQNR {c['sqnr_db']:+.1f} dB"
        parts.append("worst: " + ", ".join(says(r) for r in top))
    if only_a or only_b:
        parts.append(f"{len(only_a)} only in A, {len(only_b)} only in B")
    return "Verdict: " + "; ".join(parts) + "."
