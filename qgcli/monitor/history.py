"""The history file: per-layer statistics of a training run, one row per sampled step.

A history is an SQLite database (stdlib ``sqlite3``, no qgcli needed to read it) in WAL mode, written by one
process, one transaction per sample: a reader sees every completed sample while training runs, and a SIGKILL
of the training process at any moment loses at most the sample being written (a transaction that never
committed is rolled back when the file is next opened).  ``synchronous=NORMAL``: a committed sample survives
the process dying; only a power cut can lose the last ones (``durable=True`` asks for FULL).

Schema (``SCHEMA_VERSION`` 3)::

    meta(key TEXT PRIMARY KEY, value TEXT)          format = "qgcli-history", version, framework, every, ...
    layers(id INTEGER PRIMARY KEY, path TEXT UNIQUE, kind TEXT, role TEXT, module TEXT, info TEXT)
    columns(position INTEGER PRIMARY KEY, name TEXT, dtype TEXT, description TEXT)
    samples(step INTEGER PRIMARY KEY, time REAL, ranks INTEGER, layers INTEGER, stats BLOB)

``kind`` is ``fake_quant`` or ``batch_norm``; ``role`` ``weight``, ``activation`` or ``batch_norm``; ``info``
a JSON object (quant_min, quant_max, per_channel, learnable, ...).  A sample's ``stats`` is the zlib-compressed
table of its ``layers`` rows, column by column: for each entry of ``columns`` in ``position`` order, ``layers``
values of NumPy type ``dtype`` (``sampled`` ``<u1``, 0 for a layer the sample does not have, then one ``<f4``
or ``<f2`` column per name in :data:`STATS`; row ``i`` is layer id ``i + 1``; a statistic a layer does not have
is NaN).  In NumPy::

    numpy.frombuffer(zlib.decompress(stats), [(name, dtype, layers) for name, dtype in columns])[0]

Precision: float32 (``<f4``) holds the statistics as the monitors compute them (float32); the shares, flags,
SQNR and the batch norms' variance ratio (:data:`HALF`) are float16 (``<f2``: 11 significant bits, relative
error at most 2**-11 above 6.1e-5, absolute at most 3e-8 below), rounded to nearest except that a value that
is not 0 does not become 0, one that is not 1 does not become 1 (a share of 0.9999 is not "all": the next
float16 toward it) and a finite one does not become infinite (the largest finite value instead).  One
compressed row per sample instead of a row of ~30 columns per layer (schema version 2): 40 to 50 % of the
bytes.  Schema versions 1 (``stats`` a table of REAL columns) and 2 (``stats`` a view over integer codes) are
still read.

A history is recognised by its content (SQLite's magic and the ``meta`` row ``format``), whatever its name.
"""
import json
import os
import sqlite3
import time
import zlib

import numpy as np

from qgcli.errors import FileFormatError, OutputError

FORMAT = "qgcli-history"
SCHEMA_VERSION = 3
READABLE_VERSIONS = ("1", "2", "3")
_SQLITE_MAGIC = b"SQLite format 3\x00"

#: name -> what it is.  Shares are fractions in [0, 1]; norms are L2 norms; counts are element counts.
STATS = {
    "clip_low": "share of inputs whose integer code is below quant_min (clipped low)",
    "clip_high": "share of inputs whose integer code is above quant_max (clipped high)",
    "blocked": "share of the upstream gradient's mass (sum |dy|) that the STE mask blocks",
    "dy_norm": "L2 norm of the upstream gradient (into the quantizer's output)",
    "dx_norm": "L2 norm of the downstream gradient (what the framework passed to the input)",
    "dy_zero": "share of exactly-zero upstream gradient elements",
    "ste_error": "sum |dx - dy*mask| / sum |dy*mask|: the framework's input gradient against the STE's",
    "scale_min": "scale, smallest channel", "scale_median": "scale, median channel",
    "scale_max": "scale, largest channel",
    "zero_point_min": "zero point, smallest channel", "zero_point_max": "zero point, largest channel",
    "range_min": "lower end of the representable range, (quant_min - zero_point) * scale, smallest channel",
    "range_max": "upper end of the representable range, (quant_max - zero_point) * scale, largest channel",
    "scale_grad_norm": "L2 norm of the gradient of a learnable scale (TensorFlow: of a learnable min and max)",
    "zero_point_grad_norm": "L2 norm of the gradient of a learnable zero point",
    "nan_inputs": "NaN or Inf elements in the inputs", "nan_grads": "NaN or Inf elements in the upstream gradient",
    "sqnr_db": "signal-to-quantization-noise ratio of the output against the input, dB",
    "codes_changed": "weights: share of integer codes changed since the previous sample",
    "oscillating": "weights: share of weights whose oscillation frequency exceeds the threshold",
    "oscillation_max": "weights: largest oscillation frequency",
    "fake_quant_enabled": "1 when fake quant is enabled, 0 when not",
    "observer_enabled": "1 when the observer is enabled, 0 when not (NULL: no observer)",
    "in_optimizer": "learnable scale: 1 when it is in the optimizer's param groups, 0 when not",
    "needs_grad": "1 when the output takes part in autograd (an input quantizer of data does not)",
    "bn_mean_shift": "batch norm: mean over channels of |batch mean - running mean| / running std",
    "bn_var_ratio": "batch norm: mean over channels of |log(batch var / running var)|",
}
NAMES = tuple(STATS)
#: the statistics kept at float16 (their range and the precision they need allow it; module docstring)
HALF = frozenset({"clip_low", "clip_high", "blocked", "dy_zero", "codes_changed", "oscillating", "oscillation_max",
                  "sqnr_db", "bn_var_ratio", "fake_quant_enabled", "observer_enabled", "in_optimizer",
                  "needs_grad"})
#: (name, NumPy dtype) of a sample's columns, in order
COLUMNS = (("sampled", "<u1"),) + tuple((name, "<f2" if name in HALF else "<f4") for name in NAMES)
_PAGE_SIZE = 16384  # a sample's row (1 to 3 KiB for 100 layers) packs several to a page; 4 KiB pages held one
_WAL_PAGES = 256  # checkpoint the write-ahead log at 4 MiB (SQLite's default, 1000 pages, is 16 MiB here)


def narrow(values, dtype):
    """``values`` (float64) in ``dtype`` (``<f4`` or ``<f2``), rounded to nearest except that a value that is not
    0 does not become 0 (the smallest subnormal instead), one that is not +-1 does not become +-1 (the next value
    toward it), and a finite one does not become infinite (the largest finite value).

    >>> narrow(np.array([0.0, 1e-9, 0.99999, 1.0, 1.00001, 1e6, np.inf, np.nan]), "<f2").tolist()
    [0.0, 5.960464477539063e-08, 0.99951171875, 1.0, 1.0009765625, 65504.0, inf, nan]
    """
    with np.errstate(over="ignore"):  # out of range: infinite, then the largest finite value below
        out = values.astype(dtype)
    info = np.finfo(out.dtype)
    moved = (out == 0) & (values != 0)
    out[moved] = np.copysign(info.smallest_subnormal, values[moved])
    moved = (np.abs(out) == 1) & (values != out)
    out[moved] = np.nextafter(out[moved], np.where(values[moved] > out[moved], np.inf, -np.inf).astype(out.dtype))
    moved = np.isinf(out) & np.isfinite(values)
    out[moved] = np.copysign(info.max, values[moved])
    return out


def pack(rows):
    """``(layers, stats)`` of a ``samples`` row: ``rows`` maps a layer id to ``{stat name: value}`` (missing,
    None or NaN: NaN); row ``i`` of ``stats`` is layer id ``i + 1``, ``layers`` the largest id sampled."""
    count = max(rows, default=0)
    values = np.full((count, len(NAMES)), np.nan)
    sampled = np.zeros(count, "<u1")
    for lid, stats in rows.items():
        sampled[lid - 1] = 1
        values[lid - 1] = [np.nan if (v := stats.get(name)) is None else float(v) for name in NAMES]
    values = values.T  # column by column; each dtype narrowed in one call (a sample costs ~0.1 ms, not ~1)
    narrowed = {dtype: narrow(values, dtype) for dtype in {"<f4", "<f2"}}
    parts = [sampled] + [narrowed[dtype][j] for j, (_, dtype) in enumerate(COLUMNS[1:])]
    return count, zlib.compress(b"".join(p.tobytes() for p in parts))


def unpack(layers, stats, columns=COLUMNS):
    """The record of a ``samples`` row: one field per column, each an array of ``layers`` values (layer ids 1 to
    ``layers``)."""
    dtype = np.dtype([(name, dtype, (layers,)) for name, dtype in columns])
    return np.zeros((), dtype) if not layers else np.frombuffer(zlib.decompress(stats), dtype)[0]


class HistoryWriter:
    """Appends samples to history ``path`` (created, or refused when it exists unless ``overwrite``)."""

    def __init__(self, path, *, meta=None, overwrite=False, durable=False):
        path = os.fspath(path)
        if os.path.exists(path):
            if not overwrite:
                raise OutputError(f"{path} exists (pass overwrite=True to replace it)")
            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(path + suffix):
                    os.remove(path + suffix)
        self.path = path
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.execute(f"PRAGMA page_size={_PAGE_SIZE}")  # before the first table
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA wal_autocheckpoint={_WAL_PAGES}")
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        with self._transaction():
            self._db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
            self._db.execute("CREATE TABLE layers(id INTEGER PRIMARY KEY, path TEXT UNIQUE, kind TEXT, role TEXT, "
                             "module TEXT, info TEXT)")
            self._db.execute("CREATE TABLE columns(position INTEGER PRIMARY KEY, name TEXT, dtype TEXT, "
                             "description TEXT)")
            self._db.execute("CREATE TABLE samples(step INTEGER PRIMARY KEY, time REAL, ranks INTEGER, "
                             "layers INTEGER, stats BLOB)")
            rows = {"format": FORMAT, "version": str(SCHEMA_VERSION), "created": str(time.time()),
                    **{k: v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()}}
            self._db.executemany("INSERT INTO meta VALUES (?, ?)", rows.items())
            self._db.executemany("INSERT INTO columns VALUES (?, ?, ?, ?)",
                                 [(i, name, dtype, STATS.get(name, "1 when the layer was sampled, 0 when not"))
                                  for i, (name, dtype) in enumerate(COLUMNS)])
        self._layers = {}

    def _transaction(self):
        db = self._db

        class _Tx:
            def __enter__(self):
                db.execute("BEGIN")

            def __exit__(self, kind, *_):
                db.execute("COMMIT" if kind is None else "ROLLBACK")

        return _Tx()

    def layer_id(self, path, kind, role, module, info):
        """The id of layer ``path`` (added on first sight; committed with the next sample)."""
        if path not in self._layers:
            self._layers[path] = (len(self._layers) + 1, kind, role, module, json.dumps(info, sort_keys=True))
        return self._layers[path][0]

    def add_sample(self, step, rows, *, ranks=1):
        """One sample: ``rows`` maps a layer id to ``{stat name: value}`` (missing or None: NaN)."""
        known = {row[0] for row in self._db.execute("SELECT id FROM layers")}
        layers, stats = pack(rows)
        with self._transaction():
            self._db.executemany("INSERT INTO layers VALUES (?, ?, ?, ?, ?, ?)",
                                 [(i, p, k, r, m, info) for p, (i, k, r, m, info) in self._layers.items()
                                  if i not in known])
            self._db.execute("INSERT INTO samples VALUES (?, ?, ?, ?, ?)",
                             (int(step), time.time(), int(ranks), layers, stats))

    def close(self):
        """Close; a finished history is one file (back to a rollback journal: a reader then leaves no -wal)."""
        if self._db is not None:
            try:
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError:  # a reader holds it open: the WAL stays, still correct
                pass
            self._db.close()
            self._db = None


def as_stored(rows):
    """``rows`` (layer id -> {stat name: value}) as the history stores them and :func:`read_history` gives them
    back: float32 or float16, None where there is no value (what a live view of the samples should show)."""
    out = {}
    _add_sample(out, None, unpack(*pack(rows)))
    return {lid: samples[0][1] for lid, samples in out.items()}


def sample_bytes(path):
    """The bytes per sample of history ``path`` (schema version 3): the leaf and overflow pages of its ``samples``
    table (SQLite's ``dbstat``, which Python's ``sqlite3`` has; not where TensorFlow's own SQLite was loaded
    first), less the free bytes of the last leaf page, which the next samples fill, over the samples.  Interior
    pages are left out: one per thousands of leaves in a long run, but a whole page in a short one."""
    db = _connect(path)
    try:
        pages, free, count = db.execute(
            "SELECT sum(pgsize), max(CASE WHEN pagetype = 'leaf' THEN unused END), "
            "(SELECT count(*) FROM samples) FROM dbstat WHERE name = 'samples' AND pagetype != 'internal'").fetchone()
    finally:
        db.close()
    return (pages - free) / max(count, 1)


def is_history(path):
    """True when ``path`` is a qgcli history (by content, whatever its name)."""
    try:
        with open(path, "rb") as f:
            if f.read(16) != _SQLITE_MAGIC:
                return False
        db = _connect(path)
        try:
            row = db.execute("SELECT value FROM meta WHERE key = 'format'").fetchone()
        finally:
            db.close()
    except (OSError, sqlite3.Error):
        return False
    return row is not None and row[0] == FORMAT


def _connect(path):
    """Read-only where the file allows it; a writer that died leaves its uncommitted sample to be rolled back,
    which needs write access to the folder (then a normal connection)."""
    db = sqlite3.connect(f"file:{os.path.abspath(path)}?mode=ro", uri=True)
    try:
        db.execute("SELECT 1 FROM sqlite_master").fetchall()
        return db
    except sqlite3.Error:
        db.close()  # an unclosed connection is a ResourceWarning (an error under pytest on Python 3.13)
        return sqlite3.connect(path)


class History:
    """A history read back: ``meta`` (dict), ``layers`` (list of dicts in first-seen order, ``info`` parsed),
    ``steps`` (sampled steps), and :meth:`series` (layer path -> {stat: [value per step]})."""

    def __init__(self, meta, layers, steps, rows):
        self.meta, self.layers, self.steps = meta, layers, steps
        self._rows = rows  # layer id -> [(step, {stat: value})]

    def series(self, path):
        """``{"steps": [...], stat: [...]}`` of layer ``path``: the steps where it was sampled."""
        lid = next(layer["id"] for layer in self.layers if layer["path"] == path)
        rows = self._rows.get(lid, [])
        out = {"steps": [step for step, _ in rows]}
        for name in NAMES:
            out[name] = [values.get(name) for _, values in rows]
        return out


def read_history(path):
    """The :class:`History` in file ``path``; a :class:`qgcli.errors.FileFormatError` when it is not one."""
    if not is_history(path):
        raise FileFormatError(f"{path}: not a qgcli history (an SQLite file with a qgcli meta table)")
    db = _connect(path)
    try:
        meta = dict(db.execute("SELECT key, value FROM meta"))
        if meta.get("version") not in READABLE_VERSIONS:
            raise FileFormatError(f"{path}: history schema version {meta.get('version')}, this qgcli reads "
                                  f"versions {', '.join(READABLE_VERSIONS)}")
        layers = [{"id": i, "path": p, "kind": k, "role": r, "module": m, "info": json.loads(info or "{}")}
                  for i, p, k, r, m, info in db.execute("SELECT id, path, kind, role, module, info FROM layers "
                                                        "ORDER BY id")]
        steps = [s for (s,) in db.execute("SELECT step FROM samples ORDER BY step")]
        rows = {}
        if meta["version"] in ("1", "2"):  # a row per layer and sample (version 2: a view decodes the codes)
            columns = [row[1] for row in db.execute("PRAGMA table_info(stats)")][2:]
            for row in db.execute("SELECT * FROM stats ORDER BY step, layer_id"):
                rows.setdefault(row[1], []).append((row[0], dict(zip(columns, row[2:]))))
        else:
            columns = db.execute("SELECT name, dtype FROM columns ORDER BY position").fetchall()
            for step, count, stats in db.execute("SELECT step, layers, stats FROM samples ORDER BY step"):
                _add_sample(rows, step, unpack(count, stats, columns))
    finally:
        db.close()
    return History(meta, layers, steps, rows)


def _add_sample(rows, step, record):
    """Add a sample's ``record`` (:func:`unpack`) to ``rows`` (layer id -> [(step, {stat: value or None})])."""
    names = [name for name in record.dtype.names if name != "sampled"]
    values = {name: record[name].astype(np.float64).tolist() for name in names}
    for i in np.flatnonzero(record["sampled"]).tolist():
        rows.setdefault(i + 1, []).append((step, {name: None if values[name][i] != values[name][i] else
                                                  values[name][i] for name in names}))
