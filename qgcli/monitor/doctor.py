"""``qgcli doctor``: the gradient path of a training run checked, one finding per layer and kind.

:func:`diagnose` takes a history (every check) or a run file (the checks one step allows: ``no_gradient``,
``observer_default``, ``range_collapse``, ``nan``, ``ste_broken`` where the captured input gradient can be
compared with the straight-through estimator's) and returns ``{"source", "kind", "findings": [...]}``, each
finding ``{"kind", "severity", "layer", "step", "evidence", "advice"}``, ``step`` the first sample where seen
(a run file's step, or None).  Severities: ``error`` for :data:`ERRORS`, ``warning`` for the kinds that may be
intended (oscillation, observer_default, fake_quant_disabled).

Not findings, by design: an input quantizer whose inputs need no gradient (it never gets one), the zero point
of a symmetric quantizer (reset to 0 every call).
"""
from qgcli.monitor.history import is_history, read_history
from qgcli.monitor.runfile_checks import STE_TOLERANCE
from qgcli.monitor.trends import OSCILLATION_SHARE, conditions, gradient_missing, rows_of

ERRORS = ("ste_broken", "no_gradient", "range_collapse", "range_not_learning", "nan")
WARNINGS = ("oscillation", "observer_default", "fake_quant_disabled")
KINDS = ERRORS + WARNINGS

ADVICE = {
    "ste_broken": "the quantizer's backward is not the straight-through estimator: check a custom autograd "
                  "Function or a framework change (pytorch/ao#4806: a clamp boundary change disabled the STE); "
                  "capture one step (qgcli.capture) and run qgcli verify on it",
    "no_gradient": "nothing trains upstream of here: find what blocks the gradient (a quantizer clipping "
                   "everything, a detach, a no_grad block, an output that is not used)",
    "range_collapse": "the scale or range is shrinking toward zero or went negative: clamp the learnable step "
                      "(ParetoQ clamps it to >= 1e-5), lower its learning rate, or check the range initialisation",
    "range_not_learning": "put the learnable scale / zero point in the optimizer's param groups (create the "
                          "optimizer after prepare_qat / initialize_fake_quantizers), and check static observers "
                          "do not overwrite them",
    "nan": "NaN or Inf in the quantizer's inputs or gradients: lower the learning rate, check the loss scale, "
           "and look at the first layer where it appears",
    "oscillation": "weights oscillate between two grid points: lower the learning rate, freeze oscillating "
                   "weights or add the dampening loss (Nagel et al. 2022), and re-estimate batch-norm statistics "
                   "after; oscillation can be harmless (arXiv 2502.00490)",
    "observer_default": "scale 1 / zero point 0 is the observer's default: the observer never ran (calibrate, or "
                        "enable observers before training) or was disabled too early",
    "fake_quant_disabled": "fake quant is off: the network trains in float here; enable it "
                           "(torch.ao.quantization.enable_fake_quant) unless this is intended",
}


def severity(kind):
    return "error" if kind in ERRORS else "warning"


#: A finding's keys, in order (the columns of doctor --csv / --parquet).
FINDING_KEYS = ("kind", "severity", "layer", "step", "evidence", "advice")


def _finding(kind, layer, step, evidence):
    return {"kind": kind, "severity": severity(kind), "layer": layer, "step": step, "evidence": evidence,
            "advice": ADVICE[kind]}


def diagnose(path):
    """The doctor's document for history or run file ``path``."""
    if is_history(path):
        findings = history_findings(read_history(path))
        kind = "history"
    else:
        from qgcli.monitor.runfile_checks import run_file_findings

        findings = [_finding(*found) for found in run_file_findings(path)]
        kind = "run-file"
    counts = {s: sum(f["severity"] == s for f in findings) for s in ("error", "warning")}
    return {"source": str(path), "kind": kind, "findings": findings, "errors": counts["error"],
            "warnings": counts["warning"]}


def history_findings(history):
    findings = []
    layers = history.layers
    all_rows = {layer["path"]: rows_of(history, layer["path"]) for layer in layers}
    by_step = {}
    for layer in layers:
        for step, row in all_rows[layer["path"]]:
            by_step.setdefault(step, []).append((layer, row))
    for layer in layers:
        rows = all_rows[layer["path"]]
        seen = {}
        for i, (step, row) in enumerate(rows):
            for kind, evidence in _checks(layer, row, [r for _, r in rows[:i]], by_step.get(step, []),
                                          history).items():
                seen.setdefault(kind, (step, evidence))
        findings += [_finding(kind, layer["path"], step, evidence) for kind, (step, evidence) in seen.items()]
    order = {layer["path"]: i for i, layer in enumerate(layers)}
    return sorted(findings, key=lambda f: (KINDS.index(f["kind"]) >= len(ERRORS), f["step"] or 0,
                                           order.get(f["layer"], 0), KINDS.index(f["kind"])))


def _checks(layer, row, earlier, same_step, history):
    """``{kind: evidence}`` of the findings one sample of a layer shows."""
    out = {}
    events = conditions(row, earlier)
    ste = row.get("ste_error")
    if ste is not None and ste > STE_TOLERANCE and row.get("fake_quant_enabled") != 0:
        out["ste_broken"] = (f"the input gradient differs from the STE's (dy where the mask passes) by {ste:.0%} "
                             f"(L1, relative); dx norm {_g(row.get('dx_norm'))}, dy norm {_g(row.get('dy_norm'))}, "
                             f"mask blocks {_pct(row.get('blocked'))} of dy")
    if gradient_missing(row):
        out["no_gradient"] = events["gradient_zero"] + _downstream_cause(layer, same_step)
    for kind in ("scale_negative", "min_gt_max", "range_collapse"):
        if kind in events:
            out["range_collapse"] = events[kind]
            break
    learnable = layer["info"].get("learnable")
    if learnable and row.get("in_optimizer") == 0:
        out["range_not_learning"] = "the learnable scale is not in the optimizer's param groups"
    elif learnable and len(earlier) >= 1 and (row.get("scale_grad_norm") or 0) > 0:
        keys = ("scale_min", "scale_median", "scale_max")
        if all(r.get(k) == row.get(k) for r in earlier for k in keys) and row.get("scale_median") is not None:
            out["range_not_learning"] = (f"the scale has a gradient (norm {_g(row['scale_grad_norm'])}) but stayed "
                                         f"{_g(row['scale_median'])} over {len(earlier) + 1} samples")
    if "nan" in events:
        out["nan"] = events["nan"]
    if "oscillation" in events:
        out["oscillation"] = (events["oscillation"] + f"; frequency threshold {history.meta.get('threshold')}, "
                              f"momentum {history.meta.get('momentum')}")
    if (row.get("scale_min") == row.get("scale_max") == 1 and row.get("zero_point_min") == 0
            and row.get("zero_point_max") == 0 and row.get("fake_quant_enabled") != 0):
        out["observer_default"] = "scale 1 and zero point 0, the observer's defaults"
    if row.get("fake_quant_enabled") == 0:
        was = [i for i, r in enumerate(earlier) if r.get("fake_quant_enabled") == 1]
        out["fake_quant_disabled"] = ("fake quant disabled after being enabled" if was
                                      else "fake quant disabled from the first sample")
    return out


def _downstream_cause(layer, same_step):
    """The nearest layer after ``layer`` (forward order) that receives a gradient but passes none on."""
    for other, row in same_step:
        if other["id"] <= layer["id"]:
            continue
        dy, dx = row.get("dy_norm"), row.get("dx_norm")
        if dy and dy > 0 and dx == 0:
            why = (f"blocks {_pct(row.get('blocked'))} of its upstream gradient, clips "
                   f"{_pct((row.get('clip_low') or 0) + (row.get('clip_high') or 0))}")
            return f"; downstream cause: {other['path']} passes no gradient ({why})"
    return ""


def _g(v):
    return "-" if v is None else f"{v:.4g}"


def _pct(v):
    return "-" if v is None else f"{v:.0%}"


__all__ = ["diagnose", "history_findings", "severity", "KINDS", "OSCILLATION_SHARE", "STE_TOLERANCE"]
