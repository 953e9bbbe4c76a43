"""Fuzzing the SPEC parser and every loader with hypothesis.

The contract: whatever the text or the bytes, qgcli answers with a result or a ``QgcliError`` (the
CLI's one-line "Error: ..." with exit code 2), never another exception, a warning, a hang or a huge
allocation.  Loaders are fed random bytes, mutations of valid files (bytes set, flipped, cut, inserted,
duplicated, mostly in the header/metadata) and valid containers with hostile contents (hand-written
.npy headers, odd zip members, HDF5 files with random links, dtypes and shapes).

CI runs 150 examples per parser strategy and 30 per loader strategy (derandomized: the same ones each run).  ``QGCLI_LONG=1`` runs the campaign
(``QGCLI_FUZZ_EXAMPLES``, default 20000 per loader): ``QGCLI_LONG=1 pytest -m slow tests/test_fuzz.py``.
Hostile names (control sequences, markup, ``..``, long names in dataset, group, link and attribute names and
values) must never crash ``inspect``/``report`` nor reach their text output raw.
"""
import contextlib
import faulthandler
import io
import math
import os
import warnings
import zipfile

import h5py
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hostile import npy_bytes, npy_with_header
from qgcli.storage import formats
from qgcli.storage import io as qio
from qgcli.errors import QgcliError

LONG = os.environ.get("QGCLI_LONG", "") not in ("", "0")
CI = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)
CI_LOADERS = settings(CI, max_examples=30)  # files on disk, h5py, inspect: ~10 ms an example
CAMPAIGN = settings(max_examples=int(os.environ.get("QGCLI_FUZZ_EXAMPLES", 20000)), deadline=None,
                    suppress_health_check=list(HealthCheck))
campaign = [pytest.mark.slow, pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")]


# --- the SPEC parser ----------------------------------------------------------------------------------

@pytest.fixture(scope="module", autouse=True)
def empty_cwd(tmp_path_factory):
    """Run in an empty directory: parse_spec looks for a file of a literal's name before reading it."""
    old = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(old)


def check_spec(text, allow_literal):
    try:
        spec = qio.parse_spec(text, allow_literal=allow_literal)
    except QgcliError:
        return None
    assert spec.text == text
    assert (spec.literal is not None) + (spec.path is not None) + spec.is_stdin == 1
    if spec.literal is not None:
        assert allow_literal and spec.literal.dtype == np.float64 and spec.literal.ndim <= 1
    return spec


@CI
@given(st.text(), st.booleans())
def test_spec_parser_never_fails_unexpectedly(text, allow_literal):
    check_spec(text, allow_literal)


@CI
@given(st.text(st.sampled_from("0123456789.,-+eEinfaINFAxX_():[]' \t/\\"), max_size=30))
def test_literal_like_text_never_evaluates(text):
    spec = check_spec(text, True)
    if spec is not None and spec.literal is None:  # not a literal: a clean, named error when loaded
        with pytest.raises(QgcliError):
            qio.load_spec(spec, qio.Stdin(io.BytesIO(b"")))


finite_or_not = st.floats(allow_nan=True, allow_infinity=True)


@CI
@given(st.lists(finite_or_not, min_size=1, max_size=8), st.sampled_from([",", ", ", " ,"]), st.booleans())
def test_literal_lists_round_trip(values, sep, trailing):
    text = sep.join(repr(v) for v in values) + ("," if trailing and len(values) == 1 else "")
    spec = check_spec(text, True)
    assert spec is not None and spec.literal is not None, text
    want = np.array(values) if len(values) > 1 or trailing else np.array(values[0])
    assert spec.literal.shape == want.shape
    np.testing.assert_array_equal(spec.literal, want)


key_text = st.text(st.characters(blacklist_characters=":", blacklist_categories=("Cs",)), max_size=12)


@CI
@given(st.text(max_size=12), st.sampled_from([".h5", ".hdf5", ".npz", ".H5", ".NPZ"]), key_text)
def test_container_key_split_at_the_last_colon(stem, suffix, key):
    if key.lower().endswith(formats.KNOWN_SUFFIXES):
        key += "x"  # 'a.h5:b.npy' names the file 'a.h5:b.npy' (the suffix wins), tested below
    spec = check_spec(f"{stem}{suffix}:{key}", False)
    if (stem + suffix) in ("-",) or (stem + suffix).startswith("-:"):
        return
    assert spec.path == stem + suffix and spec.key == (key or None)


def test_known_suffix_wins_over_a_key():
    assert qio.parse_spec("a.h5:b.npy").path == "a.h5:b.npy"
    assert qio.parse_spec("x:y.h5:grp/ds").path == "x:y.h5" and qio.parse_spec("x:y.h5:grp/ds").key == "grp/ds"


# --- the loaders ----------------------------------------------------------------------------------------

def load_everything(path=None, data=None):
    """Open like the CLI does and read every tensor (and the usual operand names); result or QgcliError."""
    from qgcli.cli.commands.inspect import inspect_source

    stdin = qio.Stdin(io.BytesIO(data)) if path is None else None
    arrays = []
    try:
        with qio.Container.open(path, stdin) as c:
            names = c.names()
            for name in names[:16] or [None]:
                arrays.append(c.read(name))
            for name in ("inputs", "x", "min"):
                if c.has(name):
                    arrays.append(c.read(name))
            if c.kind != "npy" and len(names) == 1:
                arrays.append(c.read(None))
    except QgcliError:
        pass
    for a in arrays:
        assert isinstance(a, np.ndarray)
    # Campaign knob: after an HDF5 read that never returns (qgcli.storage.hdf5.guard), HDF5 stays busy in this process.
    if os.environ.get("QGCLI_FUZZ_SKIP_INSPECT"):
        return
    text = "-" if path is None else path
    stdin = qio.Stdin(io.BytesIO(data)) if path is None else None
    try:
        entry = inspect_source(text, stdin)
        assert entry["format"] in ("npy", "npz", "h5")
    except QgcliError:
        pass


@st.composite
def mutated(draw, seeds):
    """A valid file with 1-8 mutations, most of them in the first 4 KiB (headers, HDF5 metadata)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(1, 8))):
        if not data:
            break
        end = len(data) if draw(st.integers(0, 3)) == 0 else min(len(data), 4096)
        i = draw(st.integers(0, end - 1))
        op = draw(st.sampled_from(["set", "flip", "truncate", "insert", "delete", "duplicate", "int"]))
        if op == "set":
            data[i] = draw(st.integers(0, 255))
        elif op == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif op == "truncate":
            del data[i:]
        elif op == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=16))
        elif op == "delete":
            del data[i:i + draw(st.integers(1, 16))]
        elif op == "duplicate":
            n = draw(st.integers(1, 64))
            data[i:i] = data[i:i + n]
        else:  # an extreme integer where sizes and offsets live
            value = draw(st.sampled_from([0, 1, 0x7F, 0xFF, 0x7FFF, 0xFFFF, 0x7FFFFFFF, 0xFFFFFFFF, 2**63 - 1, 2**64 - 1]))
            width = draw(st.sampled_from([1, 2, 4, 8]))
            data[i:i + width] = (value & ((1 << (8 * width)) - 1)).to_bytes(width, "little")
    return bytes(data)


def _seeds_npy():
    rng = np.random.default_rng(1)
    arrays = [rng.standard_normal((3, 4)).astype(np.float32), np.arange(6, dtype=">i2"), np.float64(2.5),
              np.zeros((0, 3), np.float16), np.asfortranarray(rng.standard_normal((2, 3))),
              np.zeros(2, [("a", "<f4"), ("b", "S3")]), np.array(["ab", "c"])]
    return [npy_bytes(a) for a in arrays]


def _seeds_npz():
    out = []
    for arrays in ({"inputs": np.arange(12, dtype=np.float32).reshape(3, 4), "min": np.float32(-1)},
                   {"x": np.zeros((2, 2, 2, 3), np.float32), "scale": np.ones(3, np.float32)}):
        for fn in (np.savez, np.savez_compressed):
            buf = io.BytesIO()
            fn(buf, **arrays)
            out.append(buf.getvalue())
    return out


def _seeds_h5(d):
    def one(name, build):
        path = os.path.join(d, name)
        with h5py.File(path, "w") as f:
            build(f)
        with open(path, "rb") as fh:
            return fh.read()

    def plain(f):
        f["inputs"], f["min"], f["max"] = np.arange(24, dtype=np.float32).reshape(2, 3, 4), -1.0, 1.0
        f.attrs["op"] = "FakeQuantWithMinMaxVars"

    def nested(f):
        g = f.create_group("a/b")
        g["x"] = np.ones((2, 2, 2, 3), np.float32)
        g["soft"] = h5py.SoftLink("/a/b/x")
        f["ext"] = h5py.ExternalLink("other.h5", "/data")
        f.create_dataset("chunked", data=np.arange(100.0), chunks=(10,), compression="gzip")

    def odd(f):
        f["s"] = "text"
        f.create_dataset("empty", data=h5py.Empty("f4"))
        f["compound"] = np.zeros(2, [("a", "<f4"), ("b", "<i8")])
        f.create_dataset("lzf", data=np.arange(50, dtype=np.int16), compression="lzf", shuffle=True)

    return [one("plain.h5", plain), one("nested.h5", nested), one("odd.h5", odd)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    d = tmp_path_factory.mktemp("fuzz")
    with h5py.File(d / "other.h5", "w") as f:
        f["data"] = np.arange(4.0)
    return str(d)


SEEDS = {}


def seeds(kind, workdir):
    if kind not in SEEDS:
        SEEDS[kind] = {"npy": _seeds_npy, "npz": _seeds_npz, "h5": lambda: _seeds_h5(workdir)}[kind]()
    return SEEDS[kind]


def feed(workdir, kind, data, via_stdin=False):
    if via_stdin:
        load_everything(data=data)
        return
    path = os.path.join(workdir, "fuzzed." + kind)
    with open(path, "wb") as fh:
        fh.write(data)
    load_everything(path)


LOADERS = ["npy", "npz", "h5", "stdin"]


def _fuzz_bytes(workdir, kind, data):
    via_stdin = kind == "stdin"
    choice = data.draw(st.integers(0, 3), label="strategy")
    if choice == 0:
        blob = data.draw(st.binary(max_size=2048), label="random bytes")
        magic = {"npy": b"\x93NUMPY", "npz": b"PK\x03\x04", "h5": b"\x89HDF\r\n\x1a\n", "stdin": b"\x93NUMPY"}[kind]
        if data.draw(st.booleans(), label="with magic"):
            blob = magic + blob
    else:
        base = "npy" if kind == "stdin" and choice == 1 else ("npz" if kind == "stdin" else kind)
        blob = data.draw(mutated(seeds(base, workdir)), label="mutated")
    feed(workdir, kind if not via_stdin else "npy", blob, via_stdin)


@CI_LOADERS
@pytest.mark.parametrize("kind", LOADERS)
@given(data=st.data())
def test_loaders_on_random_and_mutated_bytes(workdir, kind, data):
    _fuzz_bytes(workdir, kind, data)


@CAMPAIGN
@pytest.mark.parametrize("kind", LOADERS)
@given(data=st.data())
@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_loaders_campaign(workdir, kind, data):
    with watchdog():
        _fuzz_bytes(workdir, kind, data)


@contextlib.contextmanager
def watchdog(seconds=120):
    """A hang in a C library (HDF5) ends the campaign with a stack dump instead of stalling it; the input
    is still in ``workdir`` (fuzzed.*) for the post-mortem."""
    faulthandler.dump_traceback_later(seconds, exit=True)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()


# --- valid containers, hostile contents ------------------------------------------------------------------

descr = st.one_of(st.sampled_from(["<f4", ">f4", "<f2", "<f8", "|b1", "<i8", "|O", "<U3", "|V8", "<M8[s]", "<c8",
                                   "|S0", "<U0", "V0", "bfloat16", "<f16"]),
                  st.lists(st.tuples(st.sampled_from(["a", "b", ""]), st.sampled_from(["<f4", "|O", "<i2"])),
                           max_size=3),
                  st.text(max_size=8))
shape = st.one_of(st.lists(st.integers(-3, 2**40), max_size=5).map(tuple), st.integers(), st.text(max_size=4))


@st.composite
def npy_headers(draw):
    d = {"descr": draw(descr), "fortran_order": draw(st.one_of(st.booleans(), st.integers(0, 2))),
         "shape": draw(shape)}
    if draw(st.integers(0, 9)) == 0:
        d[draw(st.text(max_size=5))] = 1
    header = repr(d) if draw(st.integers(0, 9)) else draw(st.text(max_size=80))
    payload = draw(st.binary(max_size=256))
    return npy_with_header(header.encode("latin1", "replace"), payload, draw(st.sampled_from([(1, 0), (2, 0)])))


def _fuzz_structures(workdir, kind, data):
    if kind == "npy":
        feed(workdir, "npy", data.draw(npy_headers(), label="npy"))
    elif kind == "npz":
        buf = io.BytesIO()
        with zipfile.ZipFile(buf, "w", data.draw(st.sampled_from([zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED]))) as z:
            for _ in range(data.draw(st.integers(0, 4))):
                name = data.draw(st.sampled_from(["inputs.npy", "x.npy", "min", "../../etc/passwd.npy", "a/b.npy",
                                                  "inputs.npy"]))
                member = data.draw(st.one_of(npy_headers(), st.binary(max_size=64),
                                             st.sampled_from(_seeds_npy())), label="member")
                with warnings.catch_warnings():  # a duplicate member name is part of the test
                    warnings.simplefilter("ignore")
                    z.writestr(name, member)
        feed(workdir, "npz", buf.getvalue(), via_stdin=data.draw(st.booleans()))
    else:
        path = os.path.join(workdir, "built.h5")
        with h5py.File(path, "w") as f:
            for i in range(data.draw(st.integers(1, 5))):
                name = data.draw(st.sampled_from(["inputs", "x", "min", "g/inputs", f"n{i}", "g/h/x"]))
                what = data.draw(st.sampled_from(["data", "soft", "external", "group", "hard", "empty", "vlen"]))
                if name in f:
                    continue
                if what == "data":
                    dtype = data.draw(st.sampled_from(["f4", ">f4", "f2", "i1", "u8", "c8", "b1", "S4"]))
                    dims = data.draw(st.lists(st.integers(0, 5), max_size=4))
                    f.create_dataset(name, shape=tuple(dims), dtype=dtype)
                elif what == "soft":
                    f[name] = h5py.SoftLink(data.draw(st.sampled_from(["/inputs", "/g", "/g/inputs", "/nowhere",
                                                                       "/" + name, "inputs", ".."])))
                elif what == "external":
                    f[name] = h5py.ExternalLink(data.draw(st.sampled_from(["other.h5", "/dev/zero", "missing.h5"])),
                                                "/data")
                elif what == "group":
                    f.create_group(name)
                elif what == "hard" and "inputs" in f and not isinstance(f.get("inputs", getlink=True),
                                                                            (h5py.SoftLink, h5py.ExternalLink)):
                    f[name] = f["inputs"]
                elif what == "empty":
                    f.create_dataset(name, data=h5py.Empty("f4"))
                elif what == "vlen":
                    f.create_dataset(name, (2,), dtype=h5py.vlen_dtype(np.float32))
        load_everything(path)


@CI_LOADERS
@pytest.mark.parametrize("kind", ["npy", "npz", "h5"])
@given(data=st.data())
def test_loaders_on_valid_containers_with_hostile_contents(workdir, kind, data):
    _fuzz_structures(workdir, kind, data)


@CAMPAIGN
@pytest.mark.parametrize("kind", ["npy", "npz", "h5"])
@given(data=st.data())
@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_structures_campaign(workdir, kind, data):
    with watchdog():
        _fuzz_structures(workdir, kind, data)


# --- hostile names: control characters and markup in names and strings (issue 26) --------------------------

# Any character HDF5 takes in a link name (no "/", no NUL, no lone surrogates: Cs), weighted towards controls.
_name_chars = st.one_of(st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00"),
                        st.sampled_from(["\x1b", "\x07", "\x9b", "\x7f", "\r", "\n", "\t", "\x85", "\u202e",
                                         "[", "]", ":", "\\", "."]))
hostile_name = st.one_of(st.text(_name_chars, min_size=1, max_size=12),
                         st.sampled_from(["\x1b]0;pwned\x07", "\x1b[2J", "\x1b[31m", "[red]x", "[link=http://a]y",
                                          ":smile:", "..", "con", "\x9b6n", "n" * 300]),
                         st.builds(lambda a, b: a + b, st.sampled_from(["\x1b]8;;http://a\x1b\\", "\x1b[?1049h", "[bold]"]),
                                   st.text(_name_chars, max_size=6)))
hostile_value = st.one_of(hostile_name, st.lists(hostile_name, min_size=1, max_size=3),
                          hostile_name.map(lambda t: np.bytes_(t.encode()[:64])))
_CONTROL_BYTES = {*range(0x20), 0x7f} - {0x0a}


def _assert_terminal_text(text):
    """Text as it reaches a terminal: every ESC starts an SGR colour of rich's own; no other C0/C1 control."""
    import re

    rest = re.sub("\x1b\\[[0-9;]*m", "", text)
    assert not [c for c in rest if ord(c) in _CONTROL_BYTES or 0x80 <= ord(c) <= 0x9f], repr(text)


def _fuzz_names(workdir, data):
    from click.testing import CliRunner
    from rich.console import Console

    from qgcli.cli import main
    from qgcli.cli.commands.inspect import inspect_source, render_inspect

    path = os.path.join(workdir, "names.h5")
    with h5py.File(path, "w") as f:
        f["inputs"], f["min"], f["max"] = np.linspace(-2, 2, 8, dtype=np.float32), np.float32(-1), np.float32(1)
        for _ in range(data.draw(st.integers(1, 4), label="objects")):
            name = data.draw(hostile_name, label="name")
            where = f
            if data.draw(st.booleans()):
                try:
                    where = f.require_group(data.draw(hostile_name, label="group"))
                except (TypeError, ValueError, KeyError, RuntimeError):
                    continue  # a dataset or (looping) link of that name was made first: h5py refuses the group
            if name in where or name == ".":
                continue
            kind = data.draw(st.sampled_from(["data", "group", "soft", "external"]), label="kind")
            if kind == "data":
                obj = where.create_dataset(name, data=np.arange(3, dtype=np.float32))
            elif kind == "group":
                obj = where.create_group(name)
            else:
                target = "/" + data.draw(hostile_name, label="target")
                where[name] = h5py.SoftLink(target) if kind == "soft" else h5py.ExternalLink(name + ".h5", target)
                obj = f
            for _ in range(data.draw(st.integers(0, 2), label="attributes")):
                obj.attrs[data.draw(hostile_name, label="attribute")] = data.draw(hostile_value, label="value")
        key = data.draw(hostile_name, label="key")
    entry = inspect_source(path, None)  # never crashes: the hostile names are valid HDF5
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, color_system="standard", width=120, highlight=False, emoji=False)
    render_inspect(console, {"files": [entry]})
    _assert_terminal_text(buf.getvalue())
    runner = CliRunner()
    for args in (["inspect", path], ["inspect", f"{path}:{key}"], ["report", "--inputs", f"{path}:{key}",
                                                                   "--min", "-1", "--max", "1"], ["report", path]):
        r = runner.invoke(main, args, color=True)  # color: click strips no escape sequence on its own
        assert r.exit_code in (0, 2), (args, r.output, r.exception)
        assert "Traceback" not in r.output and "internal error" not in r.output, r.output
        _assert_terminal_text(r.output)


@CI_LOADERS
@given(data=st.data())
def test_hostile_names_never_crash_inspect_or_report_nor_reach_the_terminal(workdir, data):
    _fuzz_names(workdir, data)


@CAMPAIGN
@given(data=st.data())
@pytest.mark.slow
@pytest.mark.skipif(not LONG, reason="long campaign: set QGCLI_LONG=1")
def test_hostile_names_campaign(workdir, data):
    with watchdog():
        _fuzz_names(workdir, data)


def test_literal_parser_is_float_only():
    """The literal grammar is numbers and commas; float() parses them (no eval, no int('0x10'))."""
    for text in ("0x10", "1_000", "1e5e5", "(1,2)", "[1]", "1;2", "1 2", "os.system", "--1", "1,,2", "True"):
        assert qio.parse_literal(text) is None, text
    for text, want in (("1e5", 1e5), ("-inf", -math.inf), (".5", 0.5), ("+3.", 3.0)):
        assert qio.parse_literal(text) == want


REGRESSIONS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_regressions")


@pytest.mark.parametrize("name", sorted(os.listdir(REGRESSIONS)))
def test_fuzz_findings_stay_fixed(name, tmp_path):
    """Inputs the fuzzer found: a clean answer now, within a minute (in a subprocess, so a hang fails the
    test instead of stalling CI).

    - ``h5_link_visit_systemerror.h5`` (long campaign): h5py leaked an HDF5 error raised inside a
      link-visit callback as SystemError; ``inspect`` failed with an internal error.
    - ``h5_vlen_string_read_hangs.h5`` (long campaign): reading its variable-length string dataset from a
      damaged global heap never returned; qgcli no longer reads object-typed datasets.
    - ``h5_non_utf8_dataset_name.h5`` (long campaign): h5py names such a dataset with bytes; reading it
      by that name raised TypeError.  It is read now.
    - ``npy_header_tokenize_error.npy`` (CI fuzzing): NumPy re-tokenizes an unparsable header and
      raised tokenize.TokenError.
    """
    import json
    import subprocess
    import sys

    path = os.path.join(REGRESSIONS, name)

    def qgcli(*args):
        return subprocess.run([sys.executable, "-m", "qgcli", *args], capture_output=True, text=True, timeout=60,
                              cwd=os.path.dirname(REGRESSIONS))

    r = qgcli("inspect", path, "--json")
    if r.returncode == 0:  # inspect lists what it can and records why a tensor could not be read
        (entry,) = json.loads(r.stdout)["files"]
        assert any(t["error"] for t in entry["tensors"]), entry
    else:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("Error: FILE: "), r.stderr
    r = qgcli("fakequant", "--inputs", path, "--min", "-1", "--max", "1", "-o", str(tmp_path / "o.npz"), "-q")
    if r.returncode:
        assert r.returncode == 2 and r.stderr.count("\n") == 1 and r.stderr.startswith("Error: inputs: "), r.stderr
