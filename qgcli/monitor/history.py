"""The history file: per-layer statistics of a training run, one row per layer per sampled step.

A history is an SQLite database (stdlib ``sqlite3``, no qgcli needed to read it) in WAL mode, written by one
process, one transaction per sample: a reader sees every completed sample while training runs, and a SIGKILL
of the training process at any moment loses at most the sample being written (a transaction that never
committed is rolled back when the file is next opened).  ``synchronous=NORMAL``: a committed sample survives
the process dying; only a power cut can lose the last ones (``durable=True`` asks for FULL).

Schema (``SCHEMA_VERSION`` 2)::

    meta(key TEXT PRIMARY KEY, value TEXT)          format = "qgcli-history", version, framework, every, ...
    layers(id INTEGER PRIMARY KEY, path TEXT UNIQUE, kind TEXT, role TEXT, module TEXT, info TEXT)
    samples(step INTEGER PRIMARY KEY, time REAL, ranks INTEGER)
    stat_codes(step INTEGER, layer_id INTEGER, <one column per name in STATS, no type>)
    VIEW stats(step, layer_id, <one REAL column per name in STATS>)   -- stat_codes decoded

``kind`` is ``fake_quant`` or ``batch_norm``; ``role`` ``weight``, ``activation`` or ``batch_norm``; ``info``
a JSON object (quant_min, quant_max, per_channel, learnable, ...).  A statistic a layer does not have is
NULL.  Read the ``stats`` view, never ``stat_codes``; in one line with pandas::

    pandas.read_sql("select * from stats join layers on layers.id = stats.layer_id", sqlite3.connect(path))

Statistics are kept at float32 precision (24 significant bits), which makes a row small: ``stat_codes`` holds
each value ``v = m * 2**k`` (m an integer below 2**24 without trailing zero bits, -62 <= k <= 62) as the
INTEGER ``sign(m) * ((k & 127) * 2**24 + |m|)``, which SQLite's record stores in 0 to 4 bytes (0 and 1, flags
and counts, in none), and a value out of that range (below about 1e-12, infinities) as its REAL; the view decodes it
with integer arithmetic (any SQLite).  A per-tensor quantizer's ``scale_min`` / ``scale_max`` equal to its
``scale_median``, and a ``zero_point_max`` equal to ``zero_point_min``, are stored once.  Schema version 1
(qgcli before the compact rows: ``stats`` a table of REAL columns) is still read.

A history is recognised by its content (SQLite's magic and the ``meta`` row ``format``), whatever its name.
"""
import json
import math
import os
import sqlite3
import struct
import time

from qgcli.errors import FileFormatError, OutputError

FORMAT = "qgcli-history"
SCHEMA_VERSION = 2
READABLE_VERSIONS = ("1", "2")
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
#: statistic -> the one its value is stored in when equal (a per-tensor quantizer's single scale)
_SHARED = {"scale_min": "scale_median", "scale_max": "scale_median", "zero_point_max": "zero_point_min"}
_EXPONENTS = 62  # 1 << 62 is the largest power of two SQLite's 64-bit integers hold


def encode(value):
    """``value`` as ``stat_codes`` stores it (module docstring): None for None and NaN, else an int or, out of
    the codes' range, the float.

    >>> encode(0.0), encode(1.0), encode(0.5), encode(-3.0), decode(encode(0.1)) == float(_float32(0.1))
    (0, 1, 2130706433, -3, True)
    """
    if value is None:
        return None
    value = float(value)
    if value != value:
        return None  # NaN (a statistic with nothing to measure) is NULL
    if value == 0 or value in (float("inf"), float("-inf")):
        return 0 if value == 0 else value
    mantissa, exponent = math.frexp(value)  # value = mantissa * 2**exponent, 0.5 <= |mantissa| < 1
    m, k = round(mantissa * 2 ** 24), exponent - 24  # to 24 significant bits, ties to even (float32's rounding)
    zeros = (abs(m) & -abs(m)).bit_length() - 1
    m, k = m >> zeros if m > 0 else -(-m >> zeros), k + zeros
    if not -_EXPONENTS <= k <= _EXPONENTS:
        return value
    code = (k & 127) * 2 ** 24 + abs(m)
    return code if m > 0 else -code


def decode(code):
    """The value of a ``stat_codes`` entry (what the ``stats`` view computes)."""
    if not isinstance(code, int):
        return code
    a = abs(code)
    m, low = a & 0xFFFFFF, a >> 24
    value = float(m) * (2.0 ** (low if low < 64 else low - 128))
    return -value if code < 0 else value


def _float32(value):
    return struct.unpack("f", struct.pack("f", value))[0]


def _decoded(column):
    """The view's SQL for ``stat_codes`` column ``column``: :func:`decode` in SQLite's integer arithmetic."""
    c = f'"{column}"'
    m, low = f"(abs({c}) % 16777216)", f"(abs({c}) / 16777216)"
    value = (f"CASE WHEN typeof({c}) != 'integer' THEN {c} ELSE (CASE WHEN {c} < 0 THEN -1.0 ELSE 1.0 END) * "
             f"{m} * (CASE WHEN {low} < 64 THEN (1 << {low}) ELSE 1.0 / (1 << (128 - {low})) END) END")
    return value if column not in _SHARED else f"coalesce({value}, {_decoded(_SHARED[column])})"


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
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute(f"PRAGMA synchronous={'FULL' if durable else 'NORMAL'}")
        columns = ", ".join(f'"{name}"' for name in NAMES)  # no type: an INTEGER code or a REAL stays as it is
        view = ", ".join(f'{_decoded(name)} AS "{name}"' for name in NAMES)
        with self._transaction():
            self._db.execute("CREATE TABLE meta(key TEXT PRIMARY KEY, value TEXT)")
            self._db.execute("CREATE TABLE layers(id INTEGER PRIMARY KEY, path TEXT UNIQUE, kind TEXT, role TEXT, "
                             "module TEXT, info TEXT)")
            self._db.execute("CREATE TABLE samples(step INTEGER PRIMARY KEY, time REAL, ranks INTEGER)")
            self._db.execute(f"CREATE TABLE stat_codes(step INTEGER, layer_id INTEGER, {columns})")
            self._db.execute(f"CREATE VIEW stats AS SELECT step, layer_id, {view} FROM stat_codes")
            rows = {"format": FORMAT, "version": str(SCHEMA_VERSION), "created": str(time.time()),
                    **{k: v if isinstance(v, str) else json.dumps(v) for k, v in (meta or {}).items()}}
            self._db.executemany("INSERT INTO meta VALUES (?, ?)", rows.items())
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
        """One sample: ``rows`` maps a layer id to ``{stat name: value}`` (missing or None: NULL)."""
        known = {row[0] for row in self._db.execute("SELECT id FROM layers")}
        with self._transaction():
            self._db.executemany("INSERT INTO layers VALUES (?, ?, ?, ?, ?, ?)",
                                 [(i, p, k, r, m, info) for p, (i, k, r, m, info) in self._layers.items()
                                  if i not in known])
            self._db.execute("INSERT INTO samples VALUES (?, ?, ?)", (int(step), time.time(), int(ranks)))
            marks = ", ".join("?" * (len(NAMES) + 2))
            self._db.executemany(f"INSERT INTO stat_codes VALUES ({marks})",
                                 [(int(step), lid, *_codes(stats)) for lid, stats in rows.items()])

    def close(self):
        """Close; a finished history is one file (back to a rollback journal: a reader then leaves no -wal)."""
        if self._db is not None:
            try:
                self._db.execute("PRAGMA journal_mode=DELETE")
            except sqlite3.OperationalError:  # a reader holds it open: the WAL stays, still correct
                pass
            self._db.close()
            self._db = None


def _codes(stats):
    """One ``stat_codes`` row's values (after step and layer id) of ``{stat name: value}``."""
    codes = {n: encode(stats.get(n)) for n in NAMES}
    for name, shared in _SHARED.items():
        if codes[name] is not None and codes[name] == codes[shared]:
            codes[name] = None
    return [codes[n] for n in NAMES]


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
        columns = [row[1] for row in db.execute("PRAGMA table_info(stats)")][2:]
        rows = {}
        for row in db.execute("SELECT * FROM stats ORDER BY step, layer_id"):
            rows.setdefault(row[1], []).append((row[0], dict(zip(columns, row[2:]))))
    finally:
        db.close()
    return History(meta, layers, steps, rows)
