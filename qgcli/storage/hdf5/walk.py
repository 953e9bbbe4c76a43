"""One walk over an HDF5 file's links, in HDF5's own visiting order, with bounds on what a file may cost.

:func:`walk` lists every link below a group exactly as ``H5Lvisit`` would (depth first, each group's links
in name order, each group entered once, so that hard-link cycles end), but group by group: each link is
looked up relative to its parent group (``H5Lvisit``'s full path names cost one lookup per level, which
made a file of 2,000 nested groups quadratic) and its path is built from its parent's.

A hostile file must not cost minutes before anything is said: nesting deeper than :data:`MAX_DEPTH` or more
groups than :data:`MAX_GROUPS` is refused with a one-line error as soon as the walk meets it, before any
data is read.  ``--max-depth`` / ``--max-groups`` (or ``QGCLI_MAX_DEPTH`` / ``QGCLI_MAX_GROUPS``) raise them.
"""
from dataclasses import dataclass
from typing import Any, Optional

MAX_DEPTH = 512
MAX_GROUPS = 10_000_000

#: The bounds in force: the command's --max-depth / --max-groups (set by their option callbacks), else the defaults.
LIMITS = {"depth": MAX_DEPTH, "groups": MAX_GROUPS}

#: Objects opened by walks so far (tests check that a walk opens each object once, not once per level).
OPENS = [0]


@dataclass
class Node:
    """One link met by :func:`walk`.

    ``kind``: "group" (a group entered for the first time), "dataset", "hard" (one more hard link to a group
    already listed: ``target`` is its first path), "soft", "external" (``target``: where it points, never
    followed), "datatype" (a committed datatype) or "broken" (``error``: why it could not be opened)."""

    path: Any  # str, or bytes where the name is not UTF-8 (as h5py's own names)
    kind: str
    obj: Any = None  # the open h5py Group / Dataset / Datatype
    target: Optional[str] = None
    error: Optional[str] = None
    raw: bytes = b""  # the path, as HDF5 spells it


def _decode(raw):
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw


def walk(top, *, label, operand="FILE", datasets=True, stop=None):
    """Yield a :class:`Node` for every link below the open h5py Group (or File) ``top``, in ``H5Lvisit``'s
    order.  ``datasets=False``: datasets are yielded unopened (``obj`` None), for a walk after groups only;
    ``datasets="ids"``: as their low-level DatasetID (its ``shape`` and ``dtype`` without h5py's wrapper);
    ``stop(node)`` true ends the walk after that node.  Raises a QgcliError naming ``operand`` where the file
    nests deeper than :data:`LIMITS` allow or holds more groups."""
    import h5py
    from h5py import h5i, h5l, h5o
    from h5py._hl.compat import filename_decode

    max_depth, max_groups = LIMITS["depth"], LIMITS["groups"]
    seen = {h5o.get_info(top.id).addr: top.name}
    groups = 0
    # Paths are the file's (without the leading "/"), as the walk's names are when it starts at the root.
    base = b"" if top.name == "/" else top.name.lstrip("/").encode("utf-8", "surrogateescape") + b"/"
    # The stack holds, per open group: (its GroupID, its raw path with a trailing b"/", its links as (name, type,
    # the object's address for a hard link), the next one to visit, its depth).
    stack = [(top.id, base, _links(top.id), 0, 0)]
    readonly = top.file.mode == "r"
    while stack:
        gid, prefix, names, i, depth = stack[-1]
        if i == len(names):
            stack.pop()
            continue
        stack[-1] = (gid, prefix, names, i + 1, depth)
        name, kind, addr = names[i]
        raw = prefix + name
        path = _decode(raw)
        if kind == h5l.TYPE_EXTERNAL:
            filebytes, linkbytes = gid.links.get_val(name)
            node = Node(path, "external", target=f"{filename_decode(filebytes)}:{_decode(linkbytes)}", raw=raw)
        elif kind == h5l.TYPE_SOFT:
            node = Node(path, "soft", target=_decode(gid.links.get_val(name)), raw=raw)
        elif kind != h5l.TYPE_HARD:
            raise TypeError("Unknown link type")  # as h5py's own link lookup
        else:
            node = _hard(gid, name, addr, raw, path, seen, datasets, readonly, h5py, h5i, h5o)
            if node.kind == "group":
                groups += 1
                if depth + 1 > max_depth:
                    _refuse(label, operand, f"nests groups deeper than {max_depth} levels (at {_short(path)})",
                            "--max-depth", "QGCLI_MAX_DEPTH")
                if groups > max_groups:
                    _refuse(label, operand, f"holds more than {max_groups} groups", "--max-groups", "QGCLI_MAX_GROUPS")
                stack.append((node.obj.id, raw + b"/", _links(node.obj.id), 0, depth + 1))
        yield node
        if stop is not None and stop(node):
            return


def _links(gid):
    """A group's links in name order as ``(name, type, address)``: the address of a hard link's object (what
    ``h5o.get_info(obj).addr`` gives) comes with the iteration, with no call per link."""
    out = []
    gid.links.iterate(lambda name, info: out.append((name, info.type, info.u)), info=True)
    return out


def _hard(gid, name, addr, raw, path, seen, datasets, readonly, h5py, h5i, h5o):
    """The Node of a hard link to the object at ``addr``: the object opened once (relative to its parent group)."""
    if not datasets and h5o.get_info(gid, name).type == h5o.TYPE_DATASET:
        return Node(path, "dataset", raw=raw)
    try:
        oid = h5o.open(gid, name)
        OPENS[0] += 1
        otype = h5i.get_type(oid)
    except Exception as exc:  # noqa: BLE001 - a damaged object: listed, not the end of the walk
        return Node(path, "broken", error=f"cannot open: {type(exc).__name__}: {exc}", raw=raw)
    if otype == h5i.GROUP:
        if addr in seen:
            return Node(path, "hard", target=seen[addr], raw=raw)
        seen[addr] = path
        return Node(path, "group", h5py.Group(oid), raw=raw)
    if otype == h5i.DATASET:
        return Node(path, "dataset", oid if datasets == "ids" else h5py.Dataset(oid, readonly=readonly), raw=raw)
    if otype == h5i.DATATYPE:
        return Node(path, "datatype", h5py.Datatype(oid), raw=raw)
    return Node(path, "broken", error="cannot open: TypeError: Unknown object type", raw=raw)


def _short(path, limit=60):
    text = path if isinstance(path, str) else path.decode("utf-8", "replace")
    return text if len(text) <= limit else f"...{text[-limit:]}"


def _refuse(label, operand, what, option, env):
    from qgcli.errors import QgcliError

    raise QgcliError(f"{label} {what}; refused before any work ({option} N or {env}=N raises the bound)",
                     operand=operand)
