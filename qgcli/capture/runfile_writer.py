"""Write a run file from NumPy arrays: one group per op, its operands as datasets, the op and its attributes
as group attributes (docs/whole-models.md), and the framework's own results in a ``reference/`` subgroup
under qgcli's output names (``outputs``, ``backprops_wrt_input``, ``x_backprop`` ...), which ``qgcli verify``
compares with qgcli's recomputation.

Framework-free: the capture helpers hand it arrays.  Groups are kept in memory until :meth:`close`, which
writes the file atomically (a temporary file renamed over the destination, as every qgcli output): an
exception inside a capture leaves the old file (or none), never half a run file.
"""
import os
import re

REFERENCE = "reference"

_STEP_GROUP = re.compile(r"^(step|epoch|iter)_\d+$")


def step_group(step):
    """The first-level group of a training step: ``step_000300`` for 300; a string is taken as given."""
    if step is None:
        return None
    if isinstance(step, str):
        name = step.strip("/")
        if not name or "/" in name:
            raise ValueError(f"step {step!r} must be one group name")
        return name
    if isinstance(step, bool) or int(step) != step or step < 0:
        raise ValueError(f"step {step!r} must be a non-negative integer or a group name")
    return f"step_{int(step):06d}"


def clean_path(name):
    """A group path from a framework's name: dots and slashes separate levels (``features.0.weight_fake_quant``
    -> ``features/0/weight_fake_quant``), ``:0`` tensor suffixes and empty parts go."""
    parts = []
    for part in re.split(r"[/.]", str(name)):
        part = part.split(":")[0].strip()
        if part:
            parts.append(part)
    return "/".join(parts) or "op"


class RunFileWriter:
    """Collects op groups and writes them as a run file on :meth:`close`.

    Parameters
    ----------
    path : str
        The run file (``.h5``).
    step : int or str, optional
        Every group goes under ``step_<N>/`` (zero-padded to 6 digits).  With a step, an existing file is
        kept and the step is added to it (refused when that step is already there); without one, an existing
        file is refused unless ``overwrite``.
    references : bool
        Store the framework's own results under ``<group>/reference/`` (default True).
    overwrite : bool
        Replace an existing file (without ``step``).

    Examples
    --------
    >>> import numpy as np, tempfile, os
    >>> w = RunFileWriter(os.path.join(tempfile.mkdtemp(), "run.h5"))
    >>> x = np.linspace(-1, 1, 8, dtype=np.float32)
    >>> w.add("layer/act_quant", "FakeQuantWithMinMaxArgs", {"inputs": x},
    ...       {"min": -0.5, "max": 0.5, "num_bits": 8, "narrow_range": False})
    'layer/act_quant'
    >>> w.close()
    """

    def __init__(self, path, *, step=None, references=True, overwrite=False, description=None):
        self.path = os.fspath(path)
        self.step = step_group(step)
        self.references = references
        self.overwrite = overwrite
        self.description = description
        self.groups = {}  # path -> (op, operands, attrs, reference)
        self._closed = False
        if not self.path.lower().endswith((".h5", ".hdf5")):
            raise ValueError(f"{self.path}: a run file is an HDF5 file (.h5)")
        if os.path.exists(self.path) and self.step is None and not overwrite:
            raise FileExistsError(f"{self.path} exists; give step=N to add a step to it, or overwrite=True")

    def unique(self, name):
        """``name`` as a group path not used yet, and neither inside nor above another group (a layer holds no
        layer): ``name``, ``name_1``, ``name_2`` ... (an op called twice)."""
        base = clean_path(name)
        path, n = base, 0
        while path in self.groups or any(p.startswith(path + "/") or path.startswith(p + "/") for p in self.groups):
            n += 1
            path = f"{base}_{n}"
        return path

    def add(self, name, op, operands, attrs=None, reference=None):
        """Add one op group (``name`` made unique); returns its path (below the step group)."""
        import numpy as np

        if self._closed:
            raise RuntimeError("the run file is already written")
        path = self.unique(name)
        arrays = {k: np.asarray(v) for k, v in operands.items() if v is not None}
        ref = {k: np.asarray(v) for k, v in (reference or {}).items() if v is not None} if self.references else {}
        clean = {"op": op}
        for key, value in (attrs or {}).items():
            if value is None:
                continue
            if isinstance(value, np.generic):
                value = value.item()
            clean[key] = value
        self.groups[path] = (arrays, clean, ref)
        return path

    def __len__(self):
        return len(self.groups)

    def close(self):
        """Write the file (atomically); nothing is written when no group was added."""
        if self._closed:
            return
        self._closed = True
        if not self.groups:
            return
        from qgcli.storage import io

        append = self.step is not None and os.path.exists(self.path)
        io.atomic_write(self.path, lambda tmp: self._write(tmp, append))

    def discard(self):
        """Forget the groups; nothing is written."""
        self._closed = True
        self.groups.clear()

    def _write(self, tmp, append):
        import shutil

        import h5py

        from qgcli import __version__
        from qgcli.signals import deferred

        if append:
            shutil.copyfile(self.path, tmp)
            opened = h5py.File(tmp, "a")
        else:
            opened = h5py.File(tmp, "w")
        with deferred(), opened as f:
            if self.step is not None and self.step in f:
                raise FileExistsError(f"{self.path} already holds the step {self.step}")
            f.attrs["qgcli_capture_version"] = __version__
            if self.description and "description" not in f.attrs:
                f.attrs["description"] = self.description
            for path, (arrays, attrs, ref) in self.groups.items():
                full = f"{self.step}/{path}" if self.step else path
                g = f.require_group(full)
                for key, value in attrs.items():
                    g.attrs[key] = value
                for key, value in arrays.items():
                    g.create_dataset(key, data=value)
                if ref:
                    r = g.create_group(REFERENCE)
                    for key, value in ref.items():
                        r.create_dataset(key, data=value)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.close()
        else:
            self.discard()
        return False
