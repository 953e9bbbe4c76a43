"""The run-file executor: a job over every group of its kind in a run file (:mod:`qgcli.storage.runfile`).

Every group is checked first (from shapes and attributes, nothing read): a bad group refuses the whole run
before anything is computed, unless ``--skip-invalid``.  Each group then runs through the runner of its
family exactly as a single bundle would (same runner, same job fields), so its outputs are bit for bit the
single-bundle outputs; they are written at the same group paths: ``-o out.h5`` one HDF5 group per layer
(streamed under ``--memory-limit`` where the runner streams), ``.npz`` keys ``group/name``, ``DIR/`` one
folder per group, ``-`` an npz on stdout.  Nothing is written unless every group that runs succeeds.
"""
import os

from qgcli.errors import OptionError, QgcliError, UsageProblem
from qgcli.report.text import counted


def execute_run(job, *, runner_for, memory_plan, remote=None):
    """Run a :class:`qgcli.jobs.RunFileJob`; returns its summary (a JSON-safe dict): one ``layers`` entry
    per group that ran, whole with ``job.output.as_json`` and for the table's first :data:`TABLE_ROWS`,
    path, op, family and overrides only for the others (see :func:`_record`).

    ``runner_for`` is :mod:`qgcli.execution.dispatch`' own (handed over, so that the import runs one way),
    ``memory_plan`` :func:`qgcli.execution.memory.plan` (or none, on a cluster).  ``remote``
    (:mod:`qgcli.execution.cluster`) computes the groups elsewhere: ``remote.start(job, path, layers)`` before
    any is written, then ``remote.result(layer)`` gives each group's Result in place of ``runner.compute``;
    everything else (checks, writing) stays here."""
    from qgcli.families import groups, registry
    from qgcli.storage import runfile

    _TOOLS.update(runner_for=runner_for, memory_plan=memory_plan, remote=remote)
    from qgcli.errors import QgcliError

    path, group, container = runfile.open_target(job.target, operand="BUNDLE",
                                                 not_a_run_file=f"{job.target} is not an HDF5 run file")
    try:
        layers = groups.discover(container._opened(), group, label=path)
        kind = registry.KIND_OF_COMMAND[job.command]
        mine, other, bad = [], [], []
        for layer in layers:
            if layer.kind is not None and layer.kind != kind:
                other.append(layer)
            elif groups.validate(layer, job.command) is not None:
                bad.append(layer)
            else:
                mine.append(layer)
        where = f"{path}:{group}" if group else path
        if bad and not job.skip_invalid:
            raise QgcliError(refusal(where, bad, len(mine) + len(bad)))
        if not mine:
            what = "FakeQuant/QuantizeV2/PyTorch fake-quant" if kind == registry.FAKE_QUANT else "FusedBatchNorm"
            skipped = f" ({len(bad)} invalid, skipped)" if bad else ""
            raise QgcliError(f"{where}: no group holds a {what} op to run{skipped}; "
                             f"{counted(len(other), 'group')} of the other kind ({', '.join(sorted({l.label for l in other})) or 'none'})")
        if remote is not None:
            remote.start(job, path, mine)
        ran, skipped = _run_and_write(job, container, path, mine)
    finally:
        container.close()
    return _summary(job, where, layers, ran, other, bad + skipped)


def refusal(where, bad, total):
    """One message listing every bad group with its reason."""
    items = "; ".join(f"{l.path}: {l.error}" for l in bad)
    return (f"{len(bad)} of {total} groups of {where} cannot run, so nothing was computed or written "
            f"(--skip-invalid runs the others): {items}")


# --- running the groups ---------------------------------------------------------------------------------

def _prepared(job, container, path, layer):
    """``(group job, runner, operands, overrides)`` of one layer."""
    from qgcli.storage.operands import Operands
    from qgcli.families import groups

    specs = groups.operand_specs(layer)  # literal operands a group carries as attributes
    group_job, overrides = groups.job_from_group(job, layer, specs, job.output)
    runner = _TOOLS["runner_for"](group_job)
    operands = Operands.in_group(container, path, layer.path, specs.as_dict(), literal_ok=runner.LITERAL_OK,
                                 known=layer.datasets)
    return group_job, runner, operands, overrides


def _failure(layer, exc):
    if isinstance(exc, OptionError) and exc.param_hint:
        return str(exc).replace("Invalid value for ", "")
    return str(exc)


_TOOLS = {}


def _errors():
    return (QgcliError, UsageProblem)


def _each(job, container, path, layers, skipped):
    """Yield ``(layer, group job, runner, operands, overrides)``; a layer that fails to build goes to
    ``skipped`` with --skip-invalid, else stops the run."""
    from qgcli.errors import QgcliError

    for layer in layers:
        try:
            yield (layer, *_prepared(job, container, path, layer))
        except _errors() as exc:
            layer.error = _failure(layer, exc)
            if not job.skip_invalid:
                raise QgcliError(f"{layer.path}: {layer.error}") from None
            skipped.append(layer)


def _compute(job, layer, group_job, runner, operands, skipped):
    """The runner's Result for one group, or None when it failed and --skip-invalid lets the run go on."""
    from qgcli.errors import QgcliError

    remote = _TOOLS.get("remote")
    try:
        return runner.compute(group_job, operands) if remote is None else remote.result(layer)
    except _errors() as exc:
        layer.error = _failure(layer, exc)
        if not job.skip_invalid:
            raise QgcliError(f"{layer.path}: {layer.error}; nothing was written") from None
        skipped.append(layer)
        return None


def _run_and_write(job, container, path, layers):
    """Compute every layer and write its outputs; returns (ran: list of dicts, skipped layers)."""
    from qgcli.storage import io

    out = job.output
    dest = out.destination
    kind = _check_destination(dest, path, out.force)
    ran, skipped = [], []
    if kind == "h5":
        io.atomic_write(dest, lambda tmp: _write_h5(job, container, path, layers, tmp, ran, skipped))
    elif kind in ("npz", "stdout"):
        _write_npz(job, container, path, layers, dest, kind, ran, skipped)
    elif kind == "safetensors":  # one flat file, keys <group>/<name> as in .npz
        arrays = {f"{layer.path}/{name}": a for layer, outs, _ in _in_memory(job, container, path, layers, ran, skipped)
                  for name, a in outs.items()}
        io.atomic_write(dest, lambda tmp: io._write_safetensors(tmp, arrays))
    elif kind == "zarr":  # one Zarr group per run-file group, with its attributes, as in .h5
        from qgcli.storage import zarr_store

        zarr_store.write_groups(dest, ((layer.path, outs, _provenance(attrs)) for layer, outs, attrs in
                                       _in_memory(job, container, path, layers, ran, skipped)),
                                compression=out.compression)
    else:
        _write_dir(job, container, path, layers, dest, ran, skipped)
    return ran, skipped


def _check_destination(dest, source, force):
    from qgcli.storage import io
    from qgcli.errors import OutputError

    kind = io.check_output(dest, inputs=[source], force=force)
    if kind == "npy":
        raise OutputError("a run file gives several outputs per group; use .h5, .npz, DIR/ or -", operand="--output")
    if kind == "dir":
        directory = dest.rstrip("/") or "/"
        if os.path.isdir(directory) and os.listdir(directory) and not force:
            raise OutputError(f"{directory} exists and is not empty; use --force to write into it", operand="--output")
    return kind


def _provenance(attrs):
    from qgcli import __version__

    return {"qgcli_version": __version__, **{k: v for k, v in attrs.items() if v is not None}}


#: Groups the rendered table shows (the rest are counted).
TABLE_ROWS = 40


def _record(job, ran, layer, group_job, summary, overrides):
    """One ran group.  Its whole summary is kept only where it will be shown (``--json``, or a row of the
    table): 20,000 groups' summaries are 100 MB, and memory must not grow with the groups beyond the
    listing.  Past the table, without --json, a group keeps its path, op, family and overrides."""
    keep = job.output.as_json or len(ran) < TABLE_ROWS
    ran.append({"path": layer.path, "op": layer.op, "job_op": summary.get("op"), "family": group_job.family,
                "overrides": overrides, "summary": summary if keep else {}})


def _write_h5(job, container, path, layers, tmp, ran, skipped):
    import h5py
    import numpy as np

    from qgcli.storage import io
    from qgcli.backend import to_numpy
    from qgcli.execution import blocks
    from qgcli.storage.hdf5.small import SmallWriter
    memory_plan = _TOOLS["memory_plan"]
    from qgcli.signals import raise_pending

    compression = job.output.compression
    budgets = {}
    with io.open_h5_for_writing(tmp) as f:
        writer = SmallWriter(f)  # thousands of small groups: HDF5's low-level calls, same objects
        for layer, group_job, runner, operands, overrides in _each(job, container, path, layers, skipped):
            raise_pending()
            try:
                streams = hasattr(runner, "block_setup") and group_job.output.device == "cpu"
                plan = None if _fits(layer, group_job, budgets) else \
                    memory_plan(group_job, operands, streams=streams, mode=runner.mode(group_job))
                grp = h5py.Group(writer.group(layer.path))
                if plan is not None:
                    streamed = blocks.stream(runner, group_job, operands, *plan)
                    attrs = _provenance(streamed.attrs)
                    small = streamed.compute(grp, lambda n: None)
                    _put(writer, grp, small, compression, np)
                    summary = streamed.summarise(small)
                else:
                    result = _compute(job, layer, group_job, runner, operands, skipped)
                    if result is None:
                        del f[layer.path]
                        continue
                    attrs = _provenance(result.attrs)
                    _put(writer, grp, {k: to_numpy(v) for k, v in result.outputs.items()}, compression, np)
                    summary = result.summary
                writer.attributes(grp.id, attrs)
            finally:
                operands.close()
            _record(job, ran, layer, group_job, summary, overrides)


def _fits(layer, group_job, budgets):
    """Whether the group's large operands, by the shapes discovery found, fit the memory budget
    (:func:`qgcli.execution.memory.shapes_fit`): then the memory plan is None without opening a dataset.
    False means "ask the memory plan" (which decides, and checks, as for a single bundle)."""
    from qgcli.execution import memory

    limit = group_job.output.memory_limit
    if limit not in budgets:
        budgets[limit] = memory.parse_memory_limit(limit)
    return bool(memory.shapes_fit(layer.datasets, group_job.large_operands, budgets[limit]))


def _put(writer, grp, arrays, compression, np):
    for name, array in arrays.items():
        array = np.asarray(array)
        options = {"compression": compression, "chunks": True} if compression and array.ndim and array.size else {}
        if array.dtype.name == "bfloat16":
            ds = grp.create_dataset(name, data=array.view(np.uint16), **options)
            ds.attrs["dtype"] = "bfloat16"
        elif options or not writer.dataset(grp.id, name, array):
            grp.create_dataset(name, data=array, **options)  # the op's attributes live on the group


def _in_memory(job, container, path, layers, ran, skipped):
    """Yield ``(layer, outputs as NumPy arrays, the op's attributes)`` group by group (outputs that are not .h5
    do not stream)."""
    from qgcli.backend import to_numpy
    memory_plan = _TOOLS["memory_plan"]

    for layer, group_job, runner, operands, overrides in _each(job, container, path, layers, skipped):
        try:
            memory_plan(group_job, operands, streams=False, mode=f"{runner.mode(group_job)} writing {job.output.destination}")
            result = _compute(job, layer, group_job, runner, operands, skipped)
        finally:
            operands.close()
        if result is None:
            continue
        _record(job, ran, layer, group_job, result.summary, overrides)
        yield layer, {k: to_numpy(v) for k, v in result.outputs.items()}, result.attrs


def _write_npz(job, container, path, layers, dest, kind, ran, skipped):
    import io as _io
    import sys
    import zipfile

    import numpy as np

    from qgcli.storage import io

    def write(fh):
        with zipfile.ZipFile(fh, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for layer, arrays, _ in _in_memory(job, container, path, layers, ran, skipped):
                for name, array in arrays.items():
                    with zf.open(f"{layer.path}/{name}.npy", "w", force_zip64=True) as member:
                        np.lib.format.write_array(member, np.asarray(array), allow_pickle=False)

    if kind == "stdout":
        buf = _io.BytesIO()
        write(buf)
        sys.stdout.buffer.write(buf.getvalue())
        sys.stdout.buffer.flush()
        return

    def staged(tmp):
        with open(tmp, "wb") as fh:
            write(fh)

    io.atomic_write(dest, staged)


def group_folder(path):
    """The folder (relative to ``-o DIR/``) of a group's outputs: its path, one folder per component, with
    components that a file system would read otherwise (empty, ``.``, ``..``) made literal.  One function, so
    that a shared path-sanitising rule can replace it."""
    parts = []
    for part in path.strip("/").split("/"):
        parts.append(part if part not in ("", ".", "..") else "%" + part.replace(".", "%2E"))
    return os.path.join(*parts) if parts else "_root"


def _write_dir(job, container, path, layers, dest, ran, skipped):
    """Every group's .npy files written into a hidden staging folder beside DIR, then moved into place."""
    import shutil

    from qgcli.storage import io

    directory = os.path.abspath(dest.rstrip("/") or dest)
    parent = os.path.dirname(directory)
    staging = os.path.join(parent, f".qgcli-{io.temp_token()}.tmpdir")
    os.mkdir(staging, 0o700)
    try:
        moves = []
        for layer, arrays, _ in _in_memory(job, container, path, layers, ran, skipped):
            folder = group_folder(layer.path)
            os.makedirs(os.path.join(staging, folder), exist_ok=True)
            for name, array in arrays.items():
                io._write_npy(os.path.join(staging, folder, name + ".npy"), array)
                moves.append(os.path.join(folder, name + ".npy"))
        if not os.path.exists(directory):
            os.chmod(staging, 0o777 & ~io._umask())
            os.rename(staging, directory)
            staging = None
            return
        for rel in moves:  # an existing DIR (empty, or --force): file by file
            target = os.path.join(directory, rel)
            if os.path.isdir(target):
                from qgcli.errors import OutputError

                raise OutputError(f"{target} is a directory", operand="--output")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(os.path.join(staging, rel), target)
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


# --- the summary ---------------------------------------------------------------------------------------

def _summary(job, where, layers, ran, other, skipped):
    from qgcli.families.groups import OVERRIDABLE
    from qgcli.report.summaries import json_safe

    overrides = {}
    for r in ran:
        for name, change in r["overrides"].items():
            entry = overrides.setdefault(name, {"option": OVERRIDABLE.get(name, name), "value": change["option"],
                                                "groups": []})
            entry["groups"].append({"path": r["path"], "group_value": change["group"]})
    notes = [f"{e['option']} {e['value']} given on the command line overrides the attribute {name} of "
             f"{len(e['groups'])} group{'s' if len(e['groups']) != 1 else ''}" for name, e in overrides.items()]
    return json_safe({
        "command": job.command,
        "run_file": where,
        "groups": len(layers),
        "ran": len(ran),
        "skipped_other_kind": len(other),
        "skipped_invalid": len(skipped),
        "other_kind": [{"path": l.path, "op": l.op} for l in other],
        "invalid": [{"path": l.path, "op": l.op, "reason": l.error} for l in skipped],
        "overrides": overrides,
        "layers": [{"path": r["path"], "op": r["job_op"], "group_op": r["op"], "family": r["family"],
                    "overrides": r["overrides"], **{k: v for k, v in r["summary"].items() if k not in ("command", "output")}}
                   for r in ran],
        "output": job.output.destination,
        "notes": notes,
    })


def render_run(console, s):
    """The rich rendering of a run-file summary (stderr)."""
    from rich.table import Table

    from qgcli.report.summaries import percent

    text = _markup()
    console.print(f"[bold]{s['command']}[/] over {text(s['run_file'])}: {s['ran']} of {s['groups']} groups ran; "
                  f"{s['skipped_other_kind']} of the other kind skipped, {s['skipped_invalid']} invalid skipped",
                  soft_wrap=True)
    table = Table(show_edge=False, box=None, pad_edge=False, header_style="bold")
    batch_norm = s["command"] == "bn-grad"
    columns = ("group", "op", "shape") + (("|x_backprop|", "|scale_backprop|") if batch_norm else
                                          ("clip<", "clip>", "blocked"))
    for col in columns:
        table.add_column(col, justify="left" if col in ("group", "op") else "right")
    for layer in s["layers"][:TABLE_ROWS]:
        inputs = layer.get("inputs", {})
        shape = (inputs.get("x") or inputs.get("inputs") or {}).get("shape")
        row = [text(layer["path"]), text(layer["op"] or ""), "x".join(str(d) for d in shape) if shape else "-"]
        if batch_norm:
            n = layer.get("norms", {})
            row += [_num(n.get("x_backprop")), _num(n.get("scale_backprop"))]
        else:
            st = layer.get("statistics") or {}
            row += [_share(st.get("clipped_below"), percent), _share(st.get("clipped_above"), percent),
                    _share(st.get("gradient_blocked"), percent)]
        table.add_row(*row)
    console.print(table)
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
