"""One self-contained HTML page of a ``report``, ``verify``, ``doctor`` or ``trend`` document (``--html FILE``).

The page is built from the same document that ``--json`` prints: the verdict first, then the table (sortable by
any column, filtered by name, worst first as the command ranks it), the figures inline (PNG data URIs), and for
each layer a details section (its per-channel table and its histogram against the range) drawn by the page's
own script only when opened, so that a run file of hundreds of layers gives a page of a few kilobytes a layer.
Nothing is fetched: styles, script, data and figures are inline, and a Content-Security-Policy forbids every
request, so the page opens the same offline, from a mail attachment or a CI artifact.
"""
import base64
import html
import io
import json
import sys

from qgcli.report.diff import HISTORY_STATISTICS, SAME, STATISTICS
from qgcli.report.history_table import last_samples, step_rows
from qgcli.report.summaries import json_safe
from qgcli.storage.figures import drawn_printable
from qgcli.storage.outputs import check_figure_output

#: What a table column shows: (document key, header, format: "text", "pct", "num", "int", "shape").
LAYER_COLUMNS = (("path", "layer", "text"), ("op", "op", "text"), ("family", "family", "text"),
                 ("shape", "shape", "shape"), ("clipped_below", "clip<", "pct"), ("clipped_above", "clip>", "pct"),
                 ("gradient_blocked", "blocked", "pct"), ("upstream_gradient", "gradient", "text"),
                 ("sqnr_db", "SQNR dB", "num"), ("suggested_sqnr_db", "SQNR' dB", "num"),
                 ("worst_channel", "worst ch", "int"), ("worst_channel_gradient_blocked", "its blocked", "pct"))
CHANNEL_COLUMNS = (("channel", "ch", "int"), ("data_min", "data min", "num"), ("data_max", "data max", "num"),
                   ("nudged_min", "nudged min", "num"), ("nudged_max", "nudged max", "num"),
                   ("clipped_below", "clip<", "pct"), ("clipped_above", "clip>", "pct"),
                   ("gradient_blocked", "blocked", "pct"), ("sqnr_db", "SQNR dB", "num"),
                   ("suggested_min", "suggested min", "num"), ("suggested_max", "suggested max", "num"),
                   ("suggested_sqnr_db", "SQNR' dB", "num"))
VERIFY_COLUMNS = (("path", "layer", "text"), ("op", "op", "text"), ("status", "status", "text"),
                  ("max_ulps", "max ulps", "int"), ("rel", "rel", "num"), ("error", "error", "text"))
TREND_COLUMNS = (("path", "layer", "text"), ("role", "role", "text"), ("step", "step", "int"),
                 ("blocked", "blocked", "pct"), ("clipped", "clipped", "pct"), ("sqnr_db", "SQNR dB", "num"),
                 ("dy_norm", "dy norm", "num"), ("scale_median", "scale", "num"), ("oscillating", "oscillating", "pct"),
                 ("events", "events", "int"))
STEP_COLUMNS = (("step", "step", "int"), ("blocked", "blocked", "pct"), ("clip_low", "clip<", "pct"),
                ("clip_high", "clip>", "pct"), ("sqnr_db", "SQNR dB", "num"), ("dy_norm", "dy norm", "num"),
                ("scale_median", "scale", "num"), ("oscillating", "oscillating", "pct"))
#: With a baseline (``report --baseline``): the column of each layer's score (how much worse than the baseline),
#: and the diff's name of a table column's statistic where it differs (a history's ``blocked``).
SCORE_COLUMN = ("_score", "Δ worse", "score")
CHANGE_KEYS = {"blocked": "gradient_blocked"}
_SIGNS = dict(STATISTICS + HISTORY_STATISTICS)
FINDING_COLUMNS = (("severity", "severity", "text"), ("kind", "kind", "text"), ("layer", "layer", "text"),
                   ("step", "step", "int"), ("evidence", "evidence", "text"), ("advice", "advice", "text"))

_STYLE = """
body{font:14px/1.45 system-ui,sans-serif;margin:1.5em auto;max-width:78em;padding:0 1em;color:#1b1f24}
h1{font-size:1.35em;margin:.2em 0}h2{font-size:1.1em;margin:1.4em 0 .4em}
.meta{color:#57606a;font-size:.9em}.verdict{font-size:1.1em;padding:.7em 1em;border-radius:6px;margin:1em 0;
background:#fff8c5;border:1px solid #d4a72c}.verdict.ok{background:#dafbe1;border-color:#4ac26b}
table{border-collapse:collapse;width:100%;font-variant-numeric:tabular-nums}
th,td{padding:.25em .6em;border-bottom:1px solid #d0d7de;text-align:right;white-space:nowrap}
th{cursor:pointer;user-select:none;background:#f6f8fa;position:sticky;top:0}th:hover{background:#eaeef2}
th[aria-sort=ascending]::after{content:" \\25B2"}th[aria-sort=descending]::after{content:" \\25BC"}
td.text,th.text{text-align:left}tr.flagged td{background:#fff1f0}td .lnk{cursor:pointer;color:#0969da}
.wrap{overflow-x:auto}input.filter{font:inherit;padding:.3em .5em;width:24em;margin:.3em 0 .6em}
details{border:1px solid #d0d7de;border-radius:6px;margin:.4em 0;padding:.3em .8em}
summary{cursor:pointer;font-weight:600}.fig{max-width:100%}.note{color:#57606a}
.d{font-size:.85em;margin-left:.35em;color:#57606a}.d.worse{color:#cf222e;font-weight:600}.d.better{color:#1a7f37}
.verdict.baseline{background:#f6f8fa;border-color:#d0d7de}
svg text{font:11px system-ui,sans-serif}
"""

_SCRIPT = r"""
(function(){
function val(td){var v=td.getAttribute('data-v');if(v===null||v==='')return null;var n=Number(v);return isNaN(n)?v:n;}
function sortTable(table,col,th){
  var body=table.tBodies[0],rows=Array.prototype.slice.call(body.rows);
  var dir=th.getAttribute('aria-sort')==='descending'?1:-1;
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(c){c.removeAttribute('aria-sort');});
  th.setAttribute('aria-sort',dir===1?'ascending':'descending');
  rows.sort(function(a,b){var x=val(a.cells[col]),y=val(b.cells[col]);
    if(x===null&&y===null)return 0;if(x===null)return 1;if(y===null)return -1;
    if(typeof x==='number'&&typeof y==='number')return dir*(x-y);return dir*String(x).localeCompare(String(y));});
  rows.forEach(function(r){body.appendChild(r);});
}
document.querySelectorAll('table.sortable').forEach(function(table){
  Array.prototype.forEach.call(table.tHead.rows[0].cells,function(th,i){
    th.addEventListener('click',function(){sortTable(table,i,th);});});
});
document.querySelectorAll('input.filter').forEach(function(box){
  var table=document.getElementById(box.getAttribute('data-table'));
  box.addEventListener('input',function(){var q=box.value.toLowerCase();
    Array.prototype.forEach.call(table.tBodies[0].rows,function(r){
      r.style.display=r.cells[0].textContent.toLowerCase().indexOf(q)>=0?'':'none';});});
});
var store=document.getElementById('qg-details');
var details=store?JSON.parse(store.textContent):{};
var NS='http://www.w3.org/2000/svg';
function el(name,attrs,parent){var e=document.createElementNS(NS,name);
  for(var k in attrs)e.setAttribute(k,attrs[k]);if(parent)parent.appendChild(e);return e;}
function fmt(v){return v===null||v===undefined?'-':(Math.abs(v)>=1e4||(Math.abs(v)<1e-3&&v!==0))?v.toExponential(3):+v.toPrecision(4);}
function histogram(d){
  var W=560,H=170,L=46,B=26,svg=el('svg',{width:W,height:H,viewBox:'0 0 '+W+' '+H,role:'img'});
  var e=d.edges,c=d.counts,lo=e[0],hi=e[e.length-1],top=Math.max.apply(null,c)||1;
  function x(v){return L+(W-L-8)*(v-lo)/((hi-lo)||1);}function y(v){return H-B-(H-B-8)*v/top;}
  if(d.range){var a=Math.max(lo,d.range[0]),b=Math.min(hi,d.range[1]);
    el('rect',{x:x(lo),y:8,width:Math.max(0,x(a)-x(lo)),height:H-B-8,fill:'#ffebe9'},svg);
    el('rect',{x:x(b),y:8,width:Math.max(0,x(hi)-x(b)),height:H-B-8,fill:'#ffebe9'},svg);}
  for(var i=0;i<c.length;i++)el('rect',{x:x(e[i]),y:y(c[i]),width:Math.max(1,x(e[i+1])-x(e[i])-1),
    height:H-B-y(c[i]),fill:'#0969da'},svg);
  if(d.range)d.range.forEach(function(v){if(v>=lo&&v<=hi)el('line',{x1:x(v),x2:x(v),y1:8,y2:H-B,
    stroke:'#cf222e','stroke-width':1.5},svg);});
  el('line',{x1:L,x2:W-8,y1:H-B,y2:H-B,stroke:'#57606a'},svg);
  [lo,(lo+hi)/2,hi].forEach(function(v,i){var t=el('text',{x:x(v),y:H-8,'text-anchor':['start','middle','end'][i]},svg);
    t.textContent=fmt(v);});
  var t=el('text',{x:4,y:16},svg);t.textContent='highest bin: '+top+' values';
  return svg;
}
function channelTable(rows,cols){
  var t=document.createElement('table');var h=t.createTHead().insertRow();
  cols.forEach(function(c){var th=document.createElement('th');th.textContent=c[1];h.appendChild(th);});
  var b=t.createTBody();rows.forEach(function(r){var tr=b.insertRow();cols.forEach(function(c){
    var v=r[c[0]],td=tr.insertCell();td.textContent=v===null||v===undefined?'-':c[2]==='pct'?(100*v).toFixed(1)+'%':
      c[2]==='int'?String(v):fmt(v);});});
  return t;
}
document.querySelectorAll('details[data-layer]').forEach(function(box){
  box.addEventListener('toggle',function(){
    if(!box.open||box.getAttribute('data-drawn'))return;box.setAttribute('data-drawn','1');
    var d=details[box.getAttribute('data-layer')],body=box.querySelector('.body');
    if(!d){body.textContent='No details were recorded for this layer.';return;}
    if(d.note){var p=document.createElement('p');p.className='note';p.textContent=d.note;body.appendChild(p);}
    if(d.hist){var cap=document.createElement('p');cap.className='note';
      cap.textContent='Inputs, '+d.hist.counts.length+' bins; red: outside the (nudged) range, where the STE mask blocks the gradient.';
      body.appendChild(cap);body.appendChild(histogram(d.hist));}
    if(d.channels&&d.channels.length){var w=document.createElement('div');w.className='wrap';
      w.appendChild(channelTable(d.channels,d.columns));body.appendChild(w);}
  });
});
document.querySelectorAll('.lnk[data-open]').forEach(function(a){a.addEventListener('click',function(){
  var box=document.getElementById(a.getAttribute('data-open'));if(!box)return;box.open=true;box.scrollIntoView();});});
})();
"""


def page(doc, *, figures=(), details=None, title=None):
    """The page of ``doc`` (a ``report``, ``verify`` or ``doctor`` document) as one string.

    ``figures``: ``(caption, matplotlib Figure)`` pairs, drawn inline; ``details``: ``{layer path: dict}`` with
    ``hist`` (``edges``, ``counts``, ``range``), ``channels`` (per-channel rows of :data:`CHANNEL_COLUMNS`) and
    ``note``, drawn when the layer's section is opened.

    >>> text = page({"command": "verify", "ok": True, "run_file": "run.h5", "groups": 1, "verified": 1,
    ...              "passed": 1, "failed": 0, "layers": [{"path": "a/b", "op": "FakeQuantWithMinMaxVars",
    ...              "status": "identical", "max_ulps": 0, "rel": 0.0, "passed": True}]})
    >>> text.startswith("<!doctype html>") and "a/b" in text and "http:" not in text.split("</head>")[0]
    True
    """
    command = doc.get("command", "report")
    parts = [f"<h1>{_e(title or _title(doc))}</h1>",
             f'<p class="meta">qgcli {_e(doc.get("qgcli_version", ""))} {_e(command)}</p>']
    verdict, ok = _verdict(doc)
    parts.append(f'<p class="verdict{" ok" if ok else ""}" id="verdict">{_e(verdict)}</p>')
    base = doc.get("baseline")
    if base:
        at = "" if base.get("kind") != "histories" else (f" at step {base['step']}" if base["step"] is not None
                                                         else " (no step in common: each one's last sample)")
        parts.append(f'<p class="verdict baseline" id="baseline">Against the baseline {_e(base["file"])}{_e(at)}: '
                     f'{_e(base["verdict"])}</p>')
    for caption, fig in figures:
        parts.append(f"<h2>{_e(caption)}</h2>{_figure(fig, caption)}")
    rows, columns, flagged = _table_of(doc)
    if rows is not None and base:
        rows, columns = _with_changes(rows, columns, base)
    if rows is not None:
        parts.append(_table(rows, columns, flagged, with_details=details is not None))
    if details is not None:
        parts.append(_details_sections(rows or [], details))
    if doc.get("command") == "trend":
        parts.append(_events(doc.get("events") or []))
    for note in doc.get("notes") or ():
        parts.append(f'<p class="note">{_e(note)}</p>')
    csp = "default-src 'none'; img-src data:; style-src 'unsafe-inline'; script-src 'unsafe-inline'"
    return ("<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<meta http-equiv=\"Content-Security-Policy\" content=\"{csp}\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>{_e(title or _title(doc))}</title><style>{_STYLE}</style></head><body>\n"
            + "\n".join(parts) + f"\n<script>{_SCRIPT}</script>\n</body></html>\n")


def write(path, text, *, force=False, inputs=()):
    """Write the page atomically to ``path`` (checked as a figure is: ``force`` to replace, never an input), or
    to stdout for ``-``."""
    from qgcli.storage.io import atomic_write

    check_figure_output(path, inputs=list(inputs), force=force, option="--html", format="html")
    if path == "-":
        sys.stdout.write(text)
        sys.stdout.flush()
        return

    def save(target):
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(text)

    atomic_write(path, save)


def _title(doc):
    command = doc.get("command", "report")
    source = (doc.get("run_file") or ", ".join(doc.get("run_files") or ()) or doc.get("source") or doc.get("history")
              or "")
    return f"qgcli {command}" + (f": {source}" if source else "")


def _verdict(doc):
    command = doc.get("command")
    if command == "verify":
        ok = bool(doc.get("ok"))
        return (f"{doc.get('passed', 0)} of {doc.get('verified', 0)} layers pass, {doc.get('failed', 0)} fail"
                f" ({doc.get('groups', 0)} groups)", ok)
    if command == "trend":
        events = doc.get("events") or []
        layers = len({e["layer"] for e in events})
        steps = doc.get("steps") or []
        return (f"{len(events)} {'event' if len(events) == 1 else 'events'} in {layers} of "
                f"{len(doc.get('layers') or [])} layers over {len(steps)} samples"
                + (f" (steps {steps[0]}..{steps[-1]})" if steps else ""), not events)
    if command == "doctor":
        findings = doc.get("findings") or []
        errors = sum(f.get("severity") == "error" for f in findings)
        return (doc.get("verdict") or f"{len(findings)} findings, {errors} errors", not findings)
    verdict = doc.get("verdict") or ""
    return verdict, verdict.startswith("Verdict: OK")


def _table_of(doc):
    """``(rows, columns, flagged)`` of the document's main table, or ``(None, None, None)``."""
    if doc.get("command") == "verify":
        return doc.get("layers") or [], VERIFY_COLUMNS, lambda r: not r.get("passed", True)
    if doc.get("command") == "doctor":
        return doc.get("findings") or [], FINDING_COLUMNS, lambda r: r.get("severity") == "error"
    if doc.get("command") == "trend":  # at the step a baseline was compared at (default: each layer's last)
        step = (doc.get("baseline") or {}).get("step")
        return last_samples(doc, step), TREND_COLUMNS, lambda r: bool(r.get("events"))
    if "layers" in doc:
        return doc["layers"], LAYER_COLUMNS, lambda r: bool(r.get("flagged"))
    if "rows" in doc:
        return doc["rows"], CHANNEL_COLUMNS, lambda r: bool(r.get("flagged"))
    return None, None, None


def _with_changes(rows, columns, base):
    """The rows worst change first (the baseline's diff order; rows it has not compared last, as they were),
    each with its diff row under ``_diff`` and its score under ``_score``, and the score's column second."""
    compared = {r["paths"][1]: r for r in base.get("rows") or ()}
    order = {path: i for i, path in enumerate(compared)}
    ranked = sorted(range(len(rows)), key=lambda i: (order.get(rows[i].get("path"), len(order)), i))
    out = []
    for i in ranked:
        found = compared.get(rows[i].get("path"))
        out.append(dict(rows[i], _diff=found, _score=None if found is None else found["score"]))
    return out, (columns[0], SCORE_COLUMN, *columns[1:])


def _change(row, key, kind):
    """The ``<span>`` of a cell's change against the baseline (worse, better or the same), or ``""``."""
    compared = row.get("_diff")
    name = CHANGE_KEYS.get(key, key)
    delta = None if compared is None else compared["change"].get(name)
    same = SAME.get(name, 0.0)
    if delta is None or abs(delta) < same or not delta:  # no change: nothing beside the value
        return ""
    text = (f"{100 * delta:+.1f}" if kind == "pct" else f"{delta:+d}" if isinstance(delta, int) else
            f"{delta:+.1f}" if name.endswith("sqnr_db") else f"{delta:+.3g}")
    worse = _SIGNS.get(name, 0) * delta
    judged = "worse" if worse > 0 else "better" if worse < 0 else "same"
    what = "percent points" if kind == "pct" else "dB" if name.endswith("sqnr_db") else "change"
    return f' <span class="d {judged}" title="against the baseline ({what})">{_e(text)}</span>'


def _table(rows, columns, flagged, *, with_details):
    shown = [c for c in columns if any(r.get(c[0]) is not None for r in rows)] or list(columns[:1])
    head = "".join(f'<th class="{kind}" scope="col">{_e(header)}</th>' for _, header, kind in shown)
    body = []
    for i, row in enumerate(rows):
        cells = []
        for j, (key, _, kind) in enumerate(shown):
            value = row.get(key)
            text = _e(_format(value, kind)) + (_change(row, key, kind) if "_diff" in row else "")
            if j == 0 and with_details:
                text = f'<span class="lnk" data-open="d{i}">{text}</span>'
            cells.append(f'<td class="{kind}" data-v="{_e(_sort_value(value, kind))}">{text}</td>')
        body.append(f'<tr{" class=flagged" if flagged(row) else ""}>{"".join(cells)}</tr>')
    first = shown[0][1]
    return (f'<h2>{len(rows)} {"row" if len(rows) == 1 else "rows"}</h2>'
            f'<input class="filter" type="search" placeholder="filter by {_e(first)}" data-table="qg-table" '
            f'aria-label="filter by {_e(first)}">'
            f'<div class="wrap"><table class="sortable" id="qg-table"><thead><tr>{head}</tr></thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def _details_sections(rows, details):
    known = {}
    sections = []
    for i, row in enumerate(rows):
        path = row.get("path")
        if path is None:
            continue
        if path in details:
            known[path] = details[path]
        sections.append(f'<details id="d{i}" data-layer="{_e(path)}"><summary>{_e(path)}</summary>'
                        '<div class="body"></div></details>')
    data = json.dumps(_json_safe(known), separators=(",", ":")).replace("</", "<\\/")
    return (f'<h2>Layers</h2>{"".join(sections)}'
            f'<script type="application/json" id="qg-details">{data}</script>')


def history_details(doc):
    """``{layer path: details}`` of a ``trend`` document: each layer's samples, a row per step."""
    columns = [list(c) for c in STEP_COLUMNS]
    return {layer["path"]: {"channels": step_rows(layer), "columns": columns,
                            "note": f"{layer.get('role') or 'layer'} {layer['path']}: every sample, in step order"}
            for layer in doc.get("layers") or ()}


def _events(events):
    items = "".join(f"<li>step {_e(e['step'])}: <b>{_e(e['layer'])}</b>: {_e(e['kind'])}: {_e(e['message'])}</li>"
                    for e in events)
    return f"<h2>Events</h2><ul class=\"events\">{items}</ul>" if events else "<h2>Events</h2><p>none</p>"


def _figure(fig, caption):
    buffer = io.BytesIO()
    drawn_printable(fig)  # names from the file: no control character drawn or warned about on stderr
    fig.savefig(buffer, format="png", dpi=100)
    encoded = base64.b64encode(buffer.getvalue()).decode("ascii")
    return f'<img class="fig" alt="{_e(caption)}" src="data:image/png;base64,{encoded}">'


def _format(value, kind):
    if value is None:
        return "-"
    if kind == "pct":
        return f"{100 * value:.1f}%"
    if kind == "score":
        return f"{value:+.1f}" if value else "0"
    if kind == "num":
        return f"{value:.4g}"
    if kind == "shape":
        return "x".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)
    return str(value)


def _sort_value(value, kind):
    if value is None:
        return ""
    if kind in ("pct", "num", "int", "score") and isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(value)
    if kind == "shape" and isinstance(value, (list, tuple)):
        size = 1
        for n in value:
            size *= n
        return repr(size)
    return str(value)


def _json_safe(value):
    return json_safe(value)


def _e(text):
    return html.escape(str(text), quote=True)
