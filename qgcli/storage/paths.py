"""File-system paths from names found inside files: every per-name output lands inside its directory.

HDF5 names may be almost anything: ``..``, ``a\\..\\b``, ``con``, 300-character names, terminal escape
sequences.  Whenever qgcli writes one file (or folder) per name, ``-o DIR/`` today, one file or sub-folder
per group of a run file next, the relative paths come from :func:`group_file_paths`, never from the names
themselves, and the mapping back to the exact names is written beside the outputs (:data:`INDEX_NAME`):
:func:`qgcli.storage.io.save_outputs` does all of it for ``-o DIR/`` (names with ``/`` become sub-folders), and
:func:`qgcli.storage.directory.write_index` writes an index for outputs written another way.
Output HDF5 files keep the exact names; only file-system paths are sanitised.

The rules, the same on every platform so that a layout made on Linux opens on Windows and macOS:

- each ``/``-separated part of a name becomes one path component (empty parts, from ``a//b`` or a leading
  ``/``, are dropped as HDF5 drops them; a name with no part at all becomes ``_``);
- in a component, control and other non-printable characters, ``\\`` and the characters Windows forbids
  (``<>:"|?*``) become ``_``; so do trailing dots and spaces (``.`` and ``..`` become ``_`` and ``__``), and a
  leading dot gets a ``_`` before it (no hidden outputs, no clash with qgcli's ``.qgcli-*`` temporary files);
- Windows device names (``con``, ``nul``, ``com1``, ``lpt9.txt`` ...) get a ``_`` before them;
- a component is at most :data:`MAX_COMPONENT_BYTES` bytes of UTF-8, suffix included: a longer one keeps its
  start and ends in ``~`` and 16 hex digits of the SHA-256 of the exact name part (stable across runs);
- a relative path longer than :data:`MAX_PATH_BYTES` keeps as many of its leading folders as leave room for a
  full-length file name, and its last component ends in ``~`` and 16 hex digits of the SHA-256 of the whole
  exact name (the index maps it back);
- paths that then clash, compared as a case-insensitive file system compares them (Unicode NFC, casefold),
  with each other, with a folder of another path or with :data:`INDEX_NAME`, are told apart by ``~`` and 8
  hex digits of the SHA-256 of the whole exact name, added to the last component; which name keeps the plain
  path does not depend on the input order (an unchanged name first, then the smallest name).

>>> layout = group_file_paths(["outputs", "..", "../../x", "a:b", "a_b"], suffix=".npy")
>>> layout["outputs"], layout[".."], layout["../../x"]
('outputs.npy', '__.npy', '__/__/x.npy')
>>> layout["a_b"], layout["a:b"]
('a_b.npy', 'a_b~6783a31e.npy')
>>> layout.changed
True
"""
import hashlib
import json
import os
import unicodedata
from collections.abc import Mapping

from qgcli import __version__

MAX_COMPONENT_BYTES = 255
#: Longest relative path, in bytes of UTF-8: deep group paths of long names would pass Linux's 4096-byte PATH_MAX
#: (and macOS's 1024) once joined; this leaves DIR itself 256 bytes on macOS.
MAX_PATH_BYTES = 768
INDEX_NAME = "index.json"
INDEX_SCHEMA = 1
_FORBIDDEN = set('\\/<>:"|?*')
_DEVICES = {"con", "prn", "aux", "nul", "conin$", "conout$", "clock$"} | {
    f"{dev}{n}" for dev in ("com", "lpt") for n in list("0123456789") + ["\u00b9", "\u00b2", "\u00b3"]}
_LONG_TAG = 16  # hex digits naming a shortened component
_CLASH_TAG = 8  # hex digits telling clashing paths apart


def _digest(text):
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()


def safe_component(name, *, suffix="", tag="", max_bytes=MAX_COMPONENT_BYTES):
    """One path component for ``name`` (one part of a group path), ending in ``tag`` + ``suffix``.

    ``suffix`` (``".npy"``, ``".png"``, or ``""`` for a folder) and ``tag`` (``"~" + hex``) must be safe
    themselves; they count towards ``max_bytes``.

    >>> safe_component("\\x1b]0;pwned\\x07x", suffix=".npy")
    '_]0;pwned_x.npy'
    >>> safe_component("con"), safe_component("a\\\\..\\\\b"), safe_component(""), safe_component(".x")
    ('_con', 'a_.._b', '_', '_.x')
    >>> len(safe_component("n" * 300, suffix=".npy").encode())
    255
    """
    if isinstance(name, bytes):
        name = name.decode("utf-8", "surrogateescape")
    text = "".join("_" if c in _FORBIDDEN or not c.isprintable() else c for c in str(name))
    stripped = text.rstrip(". ")
    text = stripped + "_" * (len(text) - len(stripped))
    if not text:
        text = "_"
    if text.startswith("."):
        text = "_" + text
    if text.split(".", 1)[0].rstrip(" ").casefold() in _DEVICES:
        text = "_" + text
    budget = max_bytes - len((tag + suffix).encode("utf-8"))
    if len(text.encode("utf-8")) > budget:
        keep = budget - 1 - _LONG_TAG
        if keep < 1:
            raise ValueError(f"max_bytes={max_bytes} leaves no room for a name with suffix {suffix!r}")
        text = text.encode("utf-8")[:keep].decode("utf-8", "ignore") + "~" + _digest(str(name))[:_LONG_TAG]
    return text + tag + suffix


def _key(relpath):
    """How a case-insensitive, normalising file system (macOS, Windows) compares two paths."""
    return unicodedata.normalize("NFC", relpath).casefold()


def _parts(path):
    if isinstance(path, bytes):
        path = path.decode("utf-8", "surrogateescape")
    return [p for p in str(path).split("/") if p] or [""]


def _shortened(name, folders, suffix, max_bytes):
    """``(folders, path)`` for a name whose path is over :data:`MAX_PATH_BYTES`: the leading folders that leave
    room for a file name of ``max_bytes``, then the last part tagged with the digest of the whole name."""
    kept, size = [], max_bytes
    for folder in folders.split("/") if folders else []:
        size += len(folder.encode("utf-8")) + 1
        if size > MAX_PATH_BYTES:
            break
        kept.append(folder)
    leaf = safe_component(_parts(name)[-1], suffix=suffix, tag="~" + _digest(str(name))[:_LONG_TAG],
                          max_bytes=max_bytes)
    kept = "/".join(kept)
    return kept, f"{kept}/{leaf}" if kept else leaf


class FileLayout(Mapping):
    """Exact name -> relative path (``/``-separated, inside the output directory), from :func:`group_file_paths`.

    Attributes
    ----------
    suffix : str
        What every file name ends in (``""``: the paths are folders).
    changed : bool
        Some path is not simply the name + suffix (then the index must be kept beside the outputs).
    collisions : list of dict
        ``{"name", "path", "clashes_with"}`` for each name moved aside because its sanitised path clashed
        with the one ``clashes_with`` kept (None: with a folder of another name, or a reserved file name).
    """

    def __init__(self, paths, suffix, collisions):
        self._paths = paths
        self.suffix = suffix
        self.collisions = collisions
        self.changed = bool(collisions) or any(p != n.strip("/") + suffix for n, p in paths.items())

    def __getitem__(self, name):
        return self._paths[name]

    def __iter__(self):
        return iter(self._paths)

    def __len__(self):
        return len(self._paths)

    def target(self, directory, name):
        """The file-system path of ``name`` inside ``directory`` (checked to be inside it)."""
        target = os.path.join(directory, *self._paths[name].split("/"))
        root = os.path.abspath(directory)
        if os.path.commonpath([root, os.path.abspath(target)]) != root:  # cannot happen; a last guard
            raise ValueError(f"{self._paths[name]!r} would leave {directory!r}")
        return target

    def notes(self):
        """One line per collision, for stderr (pass it through :func:`qgcli.report.text.printable`)."""
        return [f"{c['name']!r} would take the file name of "
                + (repr(c["clashes_with"]) if c["clashes_with"] is not None else "a folder or index.json")
                + f"; it is written as {c['path']}" for c in self.collisions]

    def index(self):
        """The index document: every exact name with its relative path, and the collisions."""
        return {"schema": INDEX_SCHEMA, "qgcli_version": __version__, "suffix": self.suffix,
                "files": [{"name": n, "path": p} for n, p in self._paths.items()], "collisions": self.collisions}

    def index_json(self):
        """:meth:`index` as JSON text (ASCII, so any name survives any file system encoding)."""
        return json.dumps(self.index(), indent=2, ensure_ascii=True) + "\n"


def group_file_paths(group_paths, *, suffix="", reserved=(INDEX_NAME,), max_bytes=MAX_COMPONENT_BYTES):
    """Relative output paths for names inside a file: the one place such paths are made.

    Parameters
    ----------
    group_paths : iterable of str
        Exact names or ``/``-separated group paths, as HDF5 (or a run file) spells them, e.g. ``"outputs"``
        or ``"model/dense_1/backprops_wrt_input"``.  Duplicates are listed once.
    suffix : str
        Added to the last component: ``".npy"`` for one file per name, ``""`` for one folder per group.
    reserved : iterable of str
        File names the caller writes itself in the same directory (by default :data:`INDEX_NAME`); no path
        takes them.
    max_bytes : int
        Longest component, in bytes of UTF-8.

    Returns
    -------
    FileLayout
        A mapping from each exact name to its relative path (``/``-separated; join it with
        :meth:`FileLayout.target`).  ``layout.changed`` says whether the index must be written beside the
        outputs (:func:`qgcli.storage.directory.write_index` writes ``layout.index_json()`` as :data:`INDEX_NAME`), and
        ``layout.collisions`` / ``layout.notes()`` report names moved aside.

    Examples
    --------
    One sub-folder per group of a run file, one ``.npy`` per output in it:

    >>> layout = group_file_paths(["dense/outputs", "../evil/outputs", "CON/outputs"], suffix=".npy")
    >>> [layout[n] for n in layout]
    ['dense/outputs.npy', '__/evil/outputs.npy', '_CON/outputs.npy']
    """
    names = list(dict.fromkeys(group_paths))
    plain = {n: "/".join(safe_component(p, max_bytes=max_bytes) for p in _parts(n)[:-1])
             for n in names}
    leaf = {n: safe_component(_parts(n)[-1], suffix=suffix, max_bytes=max_bytes) for n in names}
    paths = {n: f"{plain[n]}/{leaf[n]}" if plain[n] else leaf[n] for n in names}
    for n in names:
        if len(paths[n].encode("utf-8")) > MAX_PATH_BYTES:
            plain[n], paths[n] = _shortened(n, plain[n], suffix, max_bytes)
    # Folders are never renamed (renaming one would move other names' files), so they are taken first.
    taken = {_key(r): None for r in reserved}
    for n in names:
        parts = paths[n].split("/")[:-1]
        for i in range(1, len(parts) + 1):
            taken.setdefault(_key("/".join(parts[:i])), None)
    # Which name keeps a clashing path: an unchanged name first, then the smallest (independent of the order given).
    order = sorted(names, key=lambda n: (paths[n] != n.strip("/") + suffix, n))
    owner, collisions = {}, []
    for n in order:
        key = _key(paths[n])
        if key in taken or key in owner:
            digest = _digest(n)
            for width in (_CLASH_TAG, 16, 64):
                tagged = safe_component(_parts(n)[-1], suffix=suffix, tag="~" + digest[:width], max_bytes=max_bytes)
                candidate = f"{plain[n]}/{tagged}" if plain[n] else tagged
                if _key(candidate) not in taken and _key(candidate) not in owner:
                    break
            else:  # three SHA-256 prefixes taken: only a name built to collide gets here
                raise ValueError(f"cannot find a free file name for {n!r}")
            collisions.append({"name": n, "path": candidate, "clashes_with": owner.get(key)})
            paths[n] = candidate
            key = _key(candidate)
        owner[key] = n
    return FileLayout({n: paths[n] for n in names}, suffix, collisions)
