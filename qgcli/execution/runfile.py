"""The run-file executor: a job over every group of its kind in a run file (:mod:`qgcli.storage.runfile`).

Every group is checked first (from shapes and attributes, nothing read): a bad group refuses the whole run
before anything is computed, unless ``--skip-invalid``.  Each group then runs through the runner of its
family exactly as a single bundle would (same runner, same job fields), so its outputs are bit for bit the
single-bundle outputs; they are written at the same group paths: ``-o out.h5`` one HDF5 group per layer
(streamed under ``--memory-limit`` where the runner streams), ``.npz`` keys ``group/name``, ``DIR/`` one
folder per group, ``-`` an npz on stdout.  Nothing is written unless every group that runs succeeds.
"""
import os

from qgcli.backend import to_numpy
from qgcli.errors import OptionError, OutputError, QgcliError, UsageProblem
from qgcli.execution import blocks, memory
from qgcli.families import groups, registry
from qgcli.families.groups import OVERRIDABLE
from qgcli.report.summaries import json_safe, percent
from qgcli.report.tables import Col, print_items, print_table
from qgcli.report.text import counted, printable
from qgcli.signals import raise_pending
from qgcli.storage import runfile
from qgcli.storage.operands import Operands


def execute_run(job, *, runner_for, memory_plan, remote=None):
    """Run a :class:`qgcli.jobs.RunFileJob`; returns its summary (a JSON-safe dict): one ``layers`` entry
    per group that ran, whole with ``job.output.as_json`` and for the table's first :data:`TABLE_ROWS`,
    path, op, family and overrides only for the others (see :func:`_record`).

    ``runner_for`` is :mod:`qgcli.execution.dispatch`' own (handed over, so that the import runs one way),
    ``memory_plan`` :func:`qgcli.execution.memory.plan` (or none, on a cluster).  ``remote``
    (:mod:`qgcli.execution.cluster`) computes the groups elsewhere: ``remote.start(job, path, layers)`` before
    any is written, then ``remote.result(layer)`` gives each group's Result in place of ``runner.compute``;
    everything else (checks, writing) stays here."""
    _TOOLS.update(runner_for=runner_for, memory_plan=memory_plan, remote=remote)

    path, group, container = runfile.open_target(job.target, operand="BUNDLE",
                                                 not_a_run_file=f"{job.target} is not an HDF5 run file")
    try:
        layers = groups.discover(container._opened(), group, label=path,
                                 prefetch=_prefetch(job) if remote is None else 0)  # (read there)
        kind = registry.KIND_OF_COMMAND[job.command]
        mine, other, bad, forward = [], [], [], []
        for layer in layers:
            if layer.kind is not None and layer.kind != kind:
                other.append(layer)
            elif groups.forward_only(layer, job.command):
                forward.append(layer)
            elif groups.validate(layer, job.command) is not None:
                bad.append(layer)
            else:
                mine.append(layer)
                continue
            layer.arrays = {}  # read ahead by discovery, for a group that does not run
        where = f"{path}:{group}" if group else path
        if bad and not job.skip_invalid:
            raise QgcliError(refusal(where, bad, len(mine) + len(bad)))
        if not mine:
            what = "FakeQuant/QuantizeV2/PyTorch fake-quant" if kind == registry.FAKE_QUANT else "FusedBatchNorm"
            skipped = f" ({len(bad)} invalid, skipped)" if bad else ""
            if forward:
                skipped += f" ({counted(len(forward), 'forward-only group')}, without {_upstream(forward)}, skipped)"
            raise QgcliError(f"{where}: no group holds a {what} op to run{skipped}; "
                             f"{counted(len(other), 'group')} of the other kind ({', '.join(sorted({l.label for l in other})) or 'none'})")
        if remote is not None:
            remote.start(job, path, mine)
        ran, skipped = _run_and_write(job, container, path, mine)
    finally:
        container.close()
    return _summary(job, where, layers, ran, other, bad + skipped, forward)


#: The share of --memory-limit that discovery may read ahead (at most :data:`qgcli.storage.runfile.PREFETCH_BYTES`).
PREFETCH_SHARE = 8


def _prefetch(job):
    """The bytes of small datasets discovery reads ahead: what is read ahead is held until its group runs, so
    a part of --memory-limit (the default limit, a quarter of the machine's memory, leaves the 32 MiB)."""
    return min(runfile.PREFETCH_BYTES, memory.parse_memory_limit(job.output.memory_limit) // PREFETCH_SHARE)


def refusal(where, bad, total):
    """One message listing every bad group with its reason."""
    items = "; ".join(f"{l.path}: {l.error}" for l in bad)
    return (f"{len(bad)} of {total} groups of {where} cannot run, so nothing was computed or written "
            f"(--skip-invalid runs the others): {items}")


# --- running the groups ---------------------------------------------------------------------------------

def _prepared(job, container, path, layer, output=None):
    """``(group job, runner, operands, overrides)`` of one layer, its results going to ``output`` (default:
    the run's)."""
    specs = groups.operand_specs(layer)  # literal operands a group carries as attributes
    replaced = dict(job.ranges).get(layer.path) if getattr(job, "ranges", ()) else None
    if replaced:  # --ranges: the group's range parameters from the ranges file
        specs = specs.__class__(specs.bundle, tuple({**specs.as_dict(), **dict(replaced)}.items()))
    group_job, overrides = groups.job_from_group(job, layer, specs, output or job.output)
    runner = _TOOLS["runner_for"](group_job)
    operands = Operands.in_group(container, path, layer.path, specs.as_dict(), literal_ok=runner.LITERAL_OK,
                                 known=layer.datasets, arrays=layer.arrays)
    return group_job, runner, operands, overrides


def _failure(layer, exc):
    if isinstance(exc, OptionError) and exc.param_hint:
        return str(exc).replace("Invalid value for ", "")
    return str(exc)


_TOOLS = {}


def _errors():
    return (QgcliError, UsageProblem)


def _each(job, container, path, layers, skipped, ran):
    """Yield ``(layer, group job, runner, operands, overrides)``; a layer that fails to build goes to
    ``skipped`` with --skip-invalid, else stops the run.  A group whose summary :func:`_record` will not keep
    (``ran``: the groups recorded so far) runs as under --quiet: what only feeds its summary is skipped."""
    quiet = job.output._replace(quiet=True)
    for layer in layers:
        try:
            yield (layer, *_prepared(job, container, path, layer, job.output if _keeps(job, ran) else quiet))
        except _errors() as exc:
            layer.error = _failure(layer, exc)
            if not job.skip_invalid:
                raise QgcliError(f"{layer.path}: {layer.error}") from None
            skipped.append(layer)


def _compute(job, layer, group_job, runner, operands, skipped, kept=None):
    """The runner's Result for one group, or None when it failed and --skip-invalid lets the run go on.
    ``kept``: where a runner that reuses its output arrays from group to group (``REUSES_OUTPUTS``) keeps them,
    given when the sink has written a group's outputs once ``add`` returns (None: fresh arrays each group), and
    only to a forward run: a gradient run's forward only feeds its summary."""
    remote = _TOOLS.get("remote")
    try:
        if remote is not None:
            return remote.result(layer)
        if kept is not None and getattr(runner, "REUSES_OUTPUTS", False) and not group_job.with_gradients \
                and group_job.output.device == "cpu":  # nothing held on a GPU beyond its group
            return runner.compute(group_job, operands, kept=kept)
        return runner.compute(group_job, operands)
    except _errors() as exc:
        _failed(job, layer, exc, skipped)
        return None


def _run_and_write(job, container, path, layers):
    """Compute every layer and write its outputs through the target format's group sink
    (:mod:`qgcli.storage.formats`); returns (ran: list of dicts, skipped layers)."""
    out = job.output
    fmt = _check_destination(out.destination, path, out.force)
    if hasattr(fmt, "check_group_paths"):  # a Zarr store: names it cannot take are refused before any work
        fmt.check_group_paths([layer.path for layer in layers])
    ran, skipped, budgets = [], [], {}
    with fmt.group_sink(out.destination, compression=out.compression) as sink:
        kept = {} if getattr(sink, "writes_on_add", False) else None  # the output arrays reused group to group
        for layer, group_job, runner, operands, overrides in _each(job, container, path, layers, skipped, ran):
            raise_pending()
            try:
                summary = _group(job, sink, layer, group_job, runner, operands, skipped, kept, budgets)
            finally:
                operands.close()
                layer.arrays = {}  # what the group did not read of what discovery read ahead
            if summary is not None:
                _record(job, ran, layer, group_job, summary, overrides)
    return ran, skipped


def _group(job, sink, layer, group_job, runner, operands, skipped, kept, budgets):
    """Compute one group and write its outputs through ``sink``; returns its summary, or None when it failed
    and --skip-invalid lets the run go on (its group discarded).  ``kept`` (the arrays earlier groups left for
    reuse, :func:`qgcli.families.block_rows.keep`) counts against --memory-limit: it is dropped before a group
    that would not fit beside it."""
    from qgcli.families.block_rows import held_bytes

    held = held_bytes(kept) if kept else 0
    fits = _fits(layer, group_job, budgets, held)
    if held and not fits:
        kept.clear()
        fits = _fits(layer, group_job, budgets)
    if sink.streams:  # .h5: a group too large for memory is computed into the file
        streams = hasattr(runner, "block_setup") and group_job.output.device == "cpu"
        plan = None if fits else \
            _planned(job, layer, skipped, group_job, operands, streams=streams, mode=runner.mode(group_job))
    else:
        plan = _planned(job, layer, skipped, group_job, operands, streams=False,
                        mode=f"{runner.mode(group_job)} writing {job.output.destination}")
    if plan is False:
        return None
    if plan is None:
        result = _compute(job, layer, group_job, runner, operands, skipped, kept)
        if result is None:
            sink.discard(layer.path)
            return None
        sink.add(layer.path, {k: to_numpy(v) for k, v in result.outputs.items()}, result.attrs)
        return result.summary
    if kept:
        kept.clear()  # a streamed group has the whole budget
    try:  # computed into the group (a group in memory is made by add)
        streamed = blocks.stream(runner, group_job, operands, *plan)
        small = streamed.compute(sink.begin(layer.path), lambda n: None)
        sink.add(layer.path, small, streamed.attrs)
        return streamed.summarise(small)
    except _errors() as exc:
        sink.discard(layer.path)
        _failed(job, layer, exc, skipped)
        return None


def _planned(job, layer, skipped, group_job, operands, **how):
    """The memory plan of one group (:func:`qgcli.execution.memory.plan`), or False when it refused the group
    and --skip-invalid lets the run go on."""
    try:
        return _TOOLS["memory_plan"](group_job, operands, **how)
    except _errors() as exc:
        _failed(job, layer, exc, skipped)
        return False


def _failed(job, layer, exc, skipped):
    """A group that failed: the run stops naming it, or with --skip-invalid it is listed as skipped."""
    layer.error = _failure(layer, exc)
    if not job.skip_invalid:
        raise QgcliError(f"{layer.path}: {layer.error}; nothing was written") from None
    skipped.append(layer)


def _check_destination(dest, source, force):
    """The output's format (:mod:`qgcli.storage.formats`), once the target is checked."""
    from qgcli.storage import formats, io

    fmt = formats.get(io.check_output(dest, inputs=[source], force=force))
    if not hasattr(fmt, "group_sink"):  # .npy: one array per file
        raise OutputError("a run file gives several outputs per group; use .h5, .npz, DIR/ or -", operand="--output")
    if fmt is formats.DIRECTORY:
        directory = dest.rstrip("/") or "/"
        if os.path.isdir(directory) and os.listdir(directory) and not force:
            raise OutputError(f"{directory} exists and is not empty; use --force to write into it", operand="--output")
    return fmt


#: Groups the rendered table shows (the rest are counted).
TABLE_ROWS = 40


def _record(job, ran, layer, group_job, summary, overrides):
    """One ran group.  Its whole summary is kept only where it will be shown (``--json``, or a row of the
    table): 20,000 groups' summaries are 100 MB, and memory must not grow with the groups beyond the
    listing.  Past the table, without --json, a group keeps its path, op, family and overrides."""
    keep = _keeps(job, ran)
    ran.append({"path": layer.path, "op": layer.op, "job_op": summary.get("op"), "family": group_job.family,
                "overrides": overrides, "summary": summary if keep else {}})


def _keeps(job, ran):
    """Whether the next group's whole summary is kept (:func:`_record`)."""
    return job.output.as_json or len(ran) < TABLE_ROWS


def _fits(layer, group_job, budgets, held=0):
    """Whether the group's large operands, by the shapes discovery found, fit the memory budget less ``held``
    bytes (:func:`qgcli.execution.memory.shapes_fit`): then the memory plan is None without opening a dataset.
    False means "ask the memory plan" (which decides, and checks, as for a single bundle)."""
    limit = group_job.output.memory_limit
    if limit not in budgets:
        budgets[limit] = memory.parse_memory_limit(limit)
    return bool(memory.shapes_fit(layer.datasets, group_job.large_operands, budgets[limit] - held))


def _upstream(layers):
    """The upstream-gradient datasets the forward-only ``layers`` lack, in words."""
    return " / ".join(sorted({groups.upstream_gradient(l) for l in layers}))


def _summary(job, where, layers, ran, other, skipped, forward):
    overrides = {}
    for r in ran:
        for name, change in r["overrides"].items():
            entry = overrides.setdefault(name, {"option": OVERRIDABLE.get(name, name), "value": change["option"],
                                                "groups": []})
            entry["groups"].append({"path": r["path"], "group_value": change["group"]})
    notes = [f"{e['option']} {e['value']} given on the command line overrides the attribute {name} of "
             f"{len(e['groups'])} group{'s' if len(e['groups']) != 1 else ''}" for name, e in overrides.items()]
    if forward:
        names = [l.path for l in forward]
        notes.append(f"skipped {counted(len(forward), 'forward-only group')}, holding no upstream gradient "
                     f"({_upstream(forward)}; the model's first quantizer, whose input needs none, or a capture "
                     f"with keep='forward'): {', '.join(names[:10])}"
                     + (f" and {len(names) - 10} more" if len(names) > 10 else ""))
    return json_safe({
        "command": job.command,
        "run_file": where,
        "groups": len(layers),
        "ran": len(ran),
        "skipped_other_kind": len(other),
        "skipped_invalid": len(skipped),
        "skipped_forward_only": len(forward),
        "forward_only": [{"path": l.path, "op": l.op} for l in forward],
        "other_kind": [{"path": l.path, "op": l.op} for l in other],
        "invalid": [{"path": l.path, "op": l.op, "reason": l.error} for l in skipped],
        "overrides": overrides,
        "layers": [{"path": r["path"], "op": r["job_op"], "group_op": r["op"], "family": r["family"],
                    "overrides": r["overrides"], **{k: v for k, v in r["summary"].items() if k not in ("command", "output")}}
                   for r in ran],
        "output": job.output.destination,
        "notes": notes + _group_notes(ran),
    })


def render_run(console, s):
    """The rich rendering of a run-file summary (stderr)."""
    text = _markup()
    print_items(console, f"[bold]{s['command']}[/] over {text(s['run_file'])}: {s['ran']} of {s['groups']} groups "
                f"ran; {s['skipped_other_kind']} of the other kind skipped, {s['skipped_invalid']} invalid skipped"
                + (f", {s['skipped_forward_only']} forward-only skipped" if s.get("skipped_forward_only") else ""))
    batch_norm = s["command"] == "bn-grad"
    cols = (Col("group", "left", priority=0, shorten=True), Col("op", "left", priority=2), Col("shape", priority=2))
    cols += ((Col("|x_backprop|", priority=0), Col("|scale_backprop|", priority=1)) if batch_norm else
             (Col("clip<", priority=1), Col("clip>", priority=1), Col("clipped", priority=1),
              Col("blocked", priority=0), Col("SQNR dB", priority=1), Col("flushed", priority=2)))
    rows = []
    for layer in s["layers"][:TABLE_ROWS]:
        inputs = layer.get("inputs", {})
        shape = (inputs.get("x") or inputs.get("inputs") or {}).get("shape")
        row = [printable(layer["path"]), printable(layer["op"] or ""), "x".join(str(d) for d in shape) if shape else "-"]
        if batch_norm:
            n = layer.get("norms", {})
            row += [_num(n.get("x_backprop")), _num(n.get("scale_backprop"))]
        else:
            st = layer.get("statistics") or {}
            # TensorFlow's clipped shares below / above; a block format's clipped share, SQNR and flushed share
            row += [_share(st.get("clipped_below"), percent), _share(st.get("clipped_above"), percent),
                    _share(st.get("clipped"), percent), _share(st.get("gradient_blocked"), percent),
                    "-" if st.get("sqnr_db") is None else f"{st['sqnr_db']:.1f}", _share(st.get("flushed"), percent)]
        rows.append(row)
    # A column no group of this run has a value for is left out (a block format's in a TensorFlow run, and
    # TensorFlow's in a run of block formats), so that the ones with values fit.
    keep = [0] + [i for i in range(1, len(cols)) if any(r[i] != "-" for r in rows)]
    print_table(console, [cols[i] for i in keep], [[r[i] for i in keep] for r in rows], legend=False,
                hint="--json for all", whole="--json")
    if len(s["layers"]) > TABLE_ROWS:
        console.print(f"... {counted(len(s['layers']) - TABLE_ROWS, 'more group')} (--json for all)")
    for item in s["invalid"]:
        console.print(f"[yellow]skipped[/] {text(item['path'])}: {text(item['reason'])}", soft_wrap=True)
    for note in s["notes"]:
        console.print(f"[yellow]note:[/] {text(note)}", soft_wrap=True)
    if s["output"] and s["output"] != "-":
        console.print(f"wrote {counted(s['ran'], 'group')} to {text(s['output'])}", soft_wrap=True)


def _markup():
    try:
        from qgcli.report.text import markup
    except ImportError:  # the shared text helper is newer than this module
        from rich.markup import escape as markup
    return markup


def _share(v, percent):
    return "-" if v is None else percent(v)


def _num(v):
    return "-" if v is None else f"{v:.4g}"


#: Groups' own notes repeated in a run file's summary (all are in --json's layers[].notes).
GROUP_NOTES = 5


def _group_notes(ran):
    """The groups' own notes (a range without 0, NaN inputs ...), each naming its group: the first
    :data:`GROUP_NOTES`, then how many more --json holds."""
    found = [f"{r['path']}: {note}" for r in ran for note in (r["summary"].get("notes") or [])]
    more = len(found) - GROUP_NOTES
    return found[:GROUP_NOTES] + ([f"{counted(more, 'more group note')} in --json (layers[].notes)"] if more > 0 else [])
