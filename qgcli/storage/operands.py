"""Operands by TensorFlow name: from ``--name SPEC`` options or else from a positional bundle file.

:class:`Operands` resolves a job's :class:`qgcli.jobs.OperandSpecs` (loading arrays, or handing out unread
HDF5 datasets for streaming); :func:`to_device` moves arrays to the job's device.  Nothing heavy is imported
at module level.
"""
import os

import numpy as np

from qgcli.backend import get_xp
from qgcli.errors import FileFormatError, OperandError, OptionError
from qgcli.signals import deferred


class Operands:
    """Operands by TensorFlow name, from ``--name SPEC`` options or else from a positional bundle file."""

    def __init__(self, bundle, specs, *, literal_ok=(), stdin=None):
        from qgcli.storage import formats, io

        self._io = io
        self.stdin = stdin if stdin is not None else io.Stdin()
        self.bundle_text = bundle
        self.bundle_path = None
        self._bundle_container = None
        if bundle is not None:
            spec = io.parse_spec(bundle)
            if spec.key is not None:
                raise OptionError("a bundle is a whole .npz/.h5 file (or -), without :KEY", param_hint="BUNDLE")
            self.bundle_path = spec.path
            from qgcli.errors import FileFormatError

            try:
                self._bundle_container = io.Container.open(spec.path, self.stdin)
            except FileFormatError as exc:
                raise self._error("BUNDLE", str(exc)) from None
            if not formats.get(self._bundle_container.kind).holds_many:
                raise self._error("BUNDLE", "a bundle must be an .npz or .h5 file with named tensors, not .npy")
        self._specs = {}
        for name, text in specs.items():
            if text is not None:
                spec = self._specs[name] = io.parse_spec(text, allow_literal=name in literal_ok)
                if spec.path and io.parse_literal(text) is not None and not os.path.exists(spec.path):
                    # A tensor's values typed as a list: say that only range operands take literals.
                    raise self._error(name, f"{text!r} is a literal, which only range operands (min, max, scale, "
                                            "...) take: give this tensor as a file (.npy, .npz:KEY, .h5:DATASET, "
                                            "...) or - (stdin)")
        self.sources = {}
        self._opened = []  # containers kept open for streamed datasets

    @classmethod
    def of(cls, specs, *, literal_ok=()):
        """The operands of a job's :class:`qgcli.jobs.OperandSpecs`."""
        return cls(specs.bundle, specs.as_dict(), literal_ok=literal_ok)

    @classmethod
    def in_group(cls, container, path, group, specs=None, *, literal_ok=(), known=None, arrays=None):
        """The operands of one group of an open run file (its datasets by TensorFlow name); ``specs``: literal
        operands given beside it (an Args group's min/max attributes).  The container stays the caller's.
        ``known``: the datasets :func:`qgcli.storage.runfile.discover` found hard-linked in the group
        (``Layer.datasets``: name -> (shape, dtype)), the small ones read in one low-level call each;
        ``arrays``: those discovery read already (``Layer.arrays``), each handed out once and dropped."""
        self = cls(None, dict(specs or {}), literal_ok=literal_ok)
        self.bundle_text = f"{path}:{group}"
        self.bundle_path = path
        self._bundle_container = GroupView(container, group, known=known, arrays=arrays)
        return self

    @staticmethod
    def _error(operand, message):
        return OperandError(message, operand=operand)

    def input_paths(self):
        paths = [self.bundle_path] + [s.path for s in self._specs.values()]
        return [p for p in paths if p]

    def dataset(self, name):
        """The unread h5py Dataset behind operand ``name``, or None when it is not in an HDF5 file."""
        from qgcli.storage import formats

        try:
            if name in self._specs:
                spec = self._specs[name]
                if spec.path is None or not hasattr(formats.for_input(spec.path), "dataset"):
                    return None  # only HDF5 datasets are read in blocks from here
                container = self._io.Container.open(spec.path, self.stdin)
                self._opened.append(container)
                key = spec.key or (name if container.has(name) else None)
                if key is None:
                    return None
                self.sources[name] = spec.text
                return container.dataset(key)
            if self._bundle_container is not None and self._bundle_container.has(name):
                self.sources[name] = f"{self.bundle_text}:{name}"
                return self._bundle_container.dataset(name)
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        return None

    def flat(self, name):
        """Operand ``name`` as plain bytes at an offset of its file (:class:`qgcli.storage.flat.FlatTensor`,
        unread, closed with the operands): an .npy file, a stored .npz member, a .safetensors tensor; None
        otherwise (HDF5: :meth:`dataset`; a compressed member, stdin, a literal: read whole)."""
        from qgcli.storage import formats

        try:
            if name in self._specs:
                spec = self._specs[name]
                if spec.path is None or not hasattr(formats.for_input(spec.path), "flat"):
                    return None  # a literal, stdin (read once, whole), HDF5, a store
                container = self._io.Container.open(spec.path, self.stdin)
                self._opened.append(container)
                key = spec.key or (name if container.format.holds_many and container.has(name) else None)
                tensor, source = container.flat(key), spec.text
            elif self._bundle_container is not None and hasattr(self._bundle_container, "flat") \
                    and self._bundle_container.has(name):
                tensor, source = self._bundle_container.flat(name), f"{self.bundle_text}:{name}"
            else:
                return None
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        except OSError as exc:
            raise self._error(name, f"cannot read: {exc.strerror or exc}") from None
        if tensor is not None:
            self._opened.append(tensor)
            self.sources[name] = source
        return tensor

    def declared(self, name):
        """``(element count, itemsize)`` of operand ``name`` from its file's header alone (no data read), or
        None where that cannot be told (a literal, a format without one, an unreadable header: reading it
        says what is wrong)."""
        try:
            if name in self._specs:
                spec = self._specs[name]
                if spec.path is None and not spec.is_stdin:
                    return None  # a literal
                container = self._io.Container.open(spec.path, self.stdin)
                self._opened.append(container)
                key = spec.key or (name if container.format.holds_many and container.has(name) else None)
                self.sources[name] = spec.text
                shape, dtype = container.header(key)
            elif self._bundle_container is not None and self._bundle_container.has(name):
                self.sources[name] = f"{self.bundle_text}:{name}"
                shape, dtype = self._bundle_container.header(name)
            else:
                return None
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        if shape is None or dtype is None:
            return None
        return int(np.prod(shape, dtype=np.int64)), _itemsize(dtype)

    def location(self, name):
        """``(path, key)`` of the file operand ``name`` comes from (``key`` None: the SPEC named none), or None
        (a literal, stdin, or absent); read nothing."""
        if name in self._specs:
            spec = self._specs[name]
            return None if spec.path is None else (spec.path, spec.key)
        if self._bundle_container is not None and self.bundle_path is not None and self._bundle_container.has(name):
            return self.bundle_path, name
        return None

    def has(self, name):
        if name in self._specs:
            return True
        return self._bundle_container is not None and self._bundle_container.has(name)

    def get(self, name, *, required=True):
        """The raw array for operand ``name`` (None when absent and not required)."""
        try:
            if name in self._specs:
                spec = self._specs[name]
                self.sources[name] = spec.text
                return self._io.load_spec(spec, self.stdin, default_key=name)
            if self._bundle_container is not None and self._bundle_container.has(name):
                self.sources[name] = f"{self.bundle_text}:{name}"
                return self._bundle_container.read(name)
        except FileFormatError as exc:
            raise self._error(name, str(exc)) from None
        if required:
            where = f" and {self.bundle_text} has no dataset {name!r}" if self.bundle_text else ""
            option = "--" + name.replace("_", "-")
            raise self._error(name, f"missing operand: give {option} SPEC{where}")
        return None

    def close(self):
        if self._bundle_container is not None:
            self._bundle_container.close()
        for container in self._opened:
            container.close()


def _itemsize(dtype):
    """Bytes per element of a dtype named as NumPy (``float32``) or safetensors (``F32``, ``F8_E4M3``) names it."""
    import re

    try:
        return np.dtype(dtype).itemsize
    except TypeError:
        bits = re.search(r"\d+", str(dtype))
        return max(1, -(-int(bits.group()) // 8)) if bits else 1


class GroupView:
    """One group of an open HDF5 container, read as a bundle: names relative to the group; closing it leaves
    the container open (a run-file executor reads hundreds of groups through one open file)."""

    kind = "h5"

    def __init__(self, container, group, *, owns=False, known=None, arrays=None):
        from qgcli.storage import h5, io

        self._io, self._h5 = io, h5
        self._container = container
        self._group = group
        self._owns = owns
        self._label = f"{container.label}:{group.strip('/')}"
        self._resolved = {}  # name -> resolved object; each operand is looked up (and checked) once
        self._checked = {}
        self._known = known or {}
        self._arrays = arrays if arrays is not None else {}  # read by discovery: popped, so held once
        self._node = None

    def _group_node(self):
        # Resolved once: each operand is then one link below it (deep run-file paths cost nothing per read).
        if self._node is None:
            top = self._container._opened()
            if not self._group.strip("/"):
                self._node = top
            elif self._known:  # found by discovery's walk, which goes down hard links only: one open by path
                self._node = self._h5.open_walked(top, self._group)
            if self._node is None:
                self._node = self._h5.resolve(top, self._group, self._container.label)
        return self._node

    def _resolve(self, name):
        node = self._resolved.get(name)
        if node is None:
            node = self._resolved[name] = self._h5.resolve(self._group_node(), name, self._label)
        return node

    def has(self, name):
        if name in self._known:
            return True
        try:
            self._resolve(name)
            return True
        except FileFormatError as exc:
            return not isinstance(exc, self._h5.NoSuchObject)

    def read(self, name):
        array = self._arrays.pop(name, None)
        if array is not None:
            return array
        with deferred():
            array = self._read_known(name) if name in self._known else None
            return array if array is not None else self._h5.read_dataset_node(self.dataset(name), name, self._label)

    def _read_known(self, name):
        """A small plain dataset that discovery found, opened below its group (:func:`h5.open_walked`: the walk
        checked its link) and read in one low-level call; None where the checked read must decide.  (Opened
        with h5g/h5d.open from the file instead, 30% faster, HDF5 kept ~11 KB more per group until the file
        closed: 220 MB at 20,000 groups; opening the group by its path and the dataset below it does not: the
        same peak RSS as before on 20,000 four-level groups.)"""
        shape, dtype = self._known[name]
        try:
            node = self._resolved.get(name)
            # A name discovery found hard-linked in this group: opened straight away, without resolve's checks
            dsid = node.id if node is not None else self._h5.open_walked(self._group_node(), name, low_level=True)
            if dsid is None:
                return None
            return self._h5.read_plain_dataset(dsid, shape, np.dtype(dtype))
        except self._io.CORRUPT_FILE_ERRORS:
            return None

    def dataset(self, name):
        ds = self._checked.get(name)
        if ds is None:
            ds = self._checked[name] = self._h5.checked_dataset(self._resolve(name), name, self._label)
        return ds

    def close(self):
        if self._owns:
            self._container.close()


def to_device(arrays, device):
    xp = get_xp(device)
    return xp, [None if a is None else xp.asarray(a) for a in arrays]
