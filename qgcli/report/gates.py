"""``--fail-on``: conditions on a command's document that make it exit 3 (a CI gate), after it has printed.

A condition is a named one (``any``, ``no-gradient``, ``failed`` ...) or a comparison of a per-row statistic
with a number (``blocked>10%``, ``sqnr<20``, ``ulps>0``); several are joined with commas and any one that holds
fails the gate.  Each command names the rows and statistics it offers (:data:`GATES`).

>>> doc = {"command": "report", "layers": [{"path": "a", "gradient_blocked": 0.2, "sqnr_db": 30.0},
...                                         {"path": "b", "gradient_blocked": 0.01, "sqnr_db": 12.0}]}
>>> failures(doc, parse("blocked>10%,sqnr<20", "report"))
['blocked>10%: a (20.0%)', 'sqnr<20: b (12)']
>>> failures(doc, parse("blocked>50%", "report"))
[]
"""
import operator
import re

from qgcli.errors import OptionError
from qgcli.report.diff import lost_gradient
from qgcli.report.history_table import last_samples

#: The exit code of a command whose --fail-on condition holds.
EXIT_CODE = 3

_OPS = {">": operator.gt, ">=": operator.ge, "<": operator.lt, "<=": operator.le}
_COMPARISON = re.compile(r"^\s*([a-z_-]+?)\s*(>=|<=|>|<)\s*(-?[0-9.]+(?:e-?[0-9]+)?)\s*(%?)\s*$")


def _rows(key):
    return lambda doc: doc.get(key) or []


#: The finding kinds of ``doctor`` and the event kinds of ``trend`` (qgcli.monitor.doctor, qgcli.monitor.trends),
#: each a condition of its own (``--fail-on no_gradient,nan``; ``-`` and ``_`` alike).
DOCTOR_KINDS = ("ste_broken", "no_gradient", "range_collapse", "range_not_learning", "nan", "oscillation",
                "observer_default", "fake_quant_disabled")
TREND_KINDS = ("blocked_jump", "clipping_jump", "scale_negative", "min_gt_max", "range_collapse", "gradient_zero",
               "oscillation", "nan", "fake_quant_disabled")


def _kinds(kinds, no_gradient):
    """A condition per kind, under both spellings, and ``no-gradient`` for the kind that means it."""
    named = {}
    for kind in kinds:
        test = (lambda r, kind=kind: r.get("kind") == kind)
        named[kind] = named[kind.replace("_", "-")] = test
    named["no-gradient"] = named[no_gradient]
    return named


#: command -> (the rows of its document, {statistic name: (row key or accessor, is a share)}, {named condition: test})
GATES = {
    "report": (lambda doc: doc.get("layers") or doc.get("rows") or [],
               {"blocked": ("gradient_blocked", True), "clipped": ("clipped", True),
                "below": ("clipped_below", True), "above": ("clipped_above", True), "sqnr": ("sqnr_db", False)},
               {"any": lambda r: bool(r.get("flagged")),
                "no-gradient": lambda r: r.get("upstream_gradient") in ("zero", "absent")}),
    "verify": (_rows("layers"),
               {"ulps": ("max_ulps", False), "rel": ("rel", False)},
               {"any": lambda r: not r.get("passed", True), "failed": lambda r: r.get("status") == "failed",
                "differs": lambda r: r.get("status") == "differs"}),
    "doctor": (_rows("findings"), {},
               {"any": lambda r: True, "warning": lambda r: r.get("severity") in ("warning", "error"),
                "error": lambda r: r.get("severity") == "error", **_kinds(DOCTOR_KINDS, "no_gradient")}),
    # trend: its events (by kind), and the statistics of each layer at its last sample
    "trend": (lambda doc: (doc.get("events") or []) + last_samples(doc),
              {"blocked": ("blocked", True), "clipped": ("clipped", True), "sqnr": ("sqnr_db", False)},
              {"any": lambda r: "kind" in r, **_kinds(TREND_KINDS, "gradient_zero")}),
    # diff: the statistics are the changes (blocked>5%: blocked rose by more than 5 points; sqnr<-3: fell by 3 dB;
    # oscillating, of two histories); no-gradient: a layer whose upstream gradient B lost
    "diff": (_rows("rows"), {"blocked": (lambda r: r["change"]["gradient_blocked"], True),
                             "clipped": (lambda r: r["change"]["clipped"], True),
                             "sqnr": (lambda r: r["change"]["sqnr_db"], False),
                             "oscillating": (lambda r: r["change"].get("oscillating"), True)},
             {"any": lambda r: r.get("score", 0) > 0, "no-gradient": lost_gradient}),
}


def names(command):
    """The named conditions of ``command`` as its help lists them (a kind once, in its ``_`` spelling)."""
    named = GATES[command][2]
    return [n for n in named if not ("-" in n and n.replace("-", "_") in named)]


def parse(text, command, *, option="--fail-on"):
    """The conditions of ``text`` for ``command``: ``[(label, test(row) -> None or the value shown)]``."""
    if text is None:
        return []
    _, stats, named = GATES[command]
    conditions = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in named:
            test = named[part]
            conditions.append((part, lambda r, test=test: "" if test(r) else None))
            continue
        m = _COMPARISON.match(part)
        if m is None or m.group(1) not in stats:
            choices = sorted(names(command)) + [f"{name}>N" for name in sorted(stats)]
            raise OptionError(f"{part!r} is not a condition of {command}; use {', '.join(choices)}", param_hint=f"'{option}'")
        name, op, number, percent = m.groups()
        key, share = stats[name]
        limit = float(number) / (100.0 if percent else 1.0)
        if percent and not share:
            raise OptionError(f"{name} is not a share: write {name}{op}{number}", param_hint=f"'{option}'")

        def test(r, key=key, op=_OPS[op], limit=limit, share=share):
            value = key(r) if callable(key) else r.get(key)
            if value is None or not op(value, limit):
                return None
            return f"{100 * value:.1f}%" if share else f"{value:.4g}"

        conditions.append((part, test))
    if not conditions:
        raise OptionError("name at least one condition", param_hint=f"'{option}'")
    return conditions


def _block(r):
    """A per-block row's name: ``block`` and its index (``all``: the tensor as one block)."""
    index = r.get("index")
    return "block " + (",".join(map(str, index)) if index else "all" if index is not None else str(r["block"]))


def failures(doc, conditions):
    """One line per condition that holds: its label, then the rows (by path, layer or kind) where it holds."""
    rows_of = GATES[doc.get("command", "report")][0]
    rows = rows_of(doc)
    out = []
    for label, test in conditions:
        hits = []
        for r in rows:
            shown = test(r)
            if shown is not None:
                name = r.get("path") or r.get("layer") or (f"ch {r['channel']}" if "channel" in r else
                                                            _block(r) if "block" in r else r.get("kind"))
                hits.append(f"{name} ({shown})" if shown else str(name))
        if hits:
            more = f" and {len(hits) - 3} more" if len(hits) > 3 else ""
            out.append(f"{label}: {', '.join(hits[:3])}{more}")
    return out
