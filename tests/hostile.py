"""Hostile and broken tensor files for the reliability tests (battery, faults, fuzzing).

``make_hostile(directory)`` writes every file once; the names say what each one is.  Nothing here is a
test: ``test_reliability_battery.py``, ``test_fuzz.py`` and ``test_faults.py`` use it.
"""
import os
import zipfile

import h5py
import numpy as np

f32 = np.float32
RNG = np.random.default_rng(20261129)
X = RNG.standard_normal((2, 3, 4)).astype(f32)  # fake-quant operands: channels last (4)
BN_X = RNG.standard_normal((2, 3, 3, 4)).astype(f32)  # batch-norm operands: NHWC, 4 channels
SECRET = b"qgcli-must-never-read-this\n" * 4


def npy_with_header(header, data=b"", version=(1, 0)):
    """An .npy byte string with a hand-written header dict (padded as NumPy pads it)."""
    header = header.encode("latin1") if isinstance(header, str) else header
    prefix = 10 if version == (1, 0) else 12
    pad = (-(prefix + len(header) + 1)) % 64
    body = header + b" " * pad + b"\n"
    size = len(body).to_bytes(2 if version == (1, 0) else 4, "little")
    return b"\x93NUMPY" + bytes(version) + size + body + data


def npy_bytes(array):
    import io

    buf = io.BytesIO()
    np.save(buf, array, allow_pickle=False)
    return buf.getvalue()


def h5_bytes_of(build, path):
    """Build an HDF5 file at ``path`` with ``build(f)``; returns its bytes."""
    with h5py.File(path, "w") as f:
        build(f)
    with open(path, "rb") as fh:
        return fh.read()


def make_hostile(d):
    """Write the hostile files into directory ``d`` (str or Path); returns ``d`` as str."""
    d = str(d)
    p = lambda name: os.path.join(d, name)  # noqa: E731

    def write(name, data):
        with open(p(name), "wb") as fh:
            fh.write(data)

    def read(name):
        with open(p(name), "rb") as fh:
            return fh.read()

    # --- good operands, for the rows that break something else
    np.save(p("x.npy"), X)
    np.save(p("g.npy"), np.ones_like(X))
    np.save(p("x5.npy"), RNG.standard_normal((2, 3, 5)).astype(f32))
    np.save(p("bn_x.npy"), BN_X)
    np.save(p("bn_x5.npy"), RNG.standard_normal((2, 3, 3, 5)).astype(f32))
    np.save(p("c4.npy"), np.ones(4, f32))
    np.save(p("c3.npy"), np.ones(3, f32))
    np.save(p("c0.npy"), np.ones(0, f32))
    np.save(p("lo4.npy"), -np.linspace(0.5, 2, 4).astype(f32))
    np.save(p("hi4.npy"), np.linspace(0.5, 2, 4).astype(f32))
    np.save(p("hi3.npy"), np.linspace(0.5, 2, 3).astype(f32))
    np.save(p("bool.npy"), X > 0)
    np.save(p("int.npy"), np.ones(4, np.int32))
    np.save(p("str.npy"), np.array(["a", "b"]))
    np.save(p("datetime.npy"), np.zeros(3, "M8[s]"))
    raw = npy_bytes(X)

    # --- .npy that is not what it says
    write("empty.npy", b"")
    write("text.npy", b"just some text, not an array\n")
    write("trunc_header.npy", raw[:20])
    write("trunc_data.npy", raw[:-7])
    np.save(p("pickled.npy"), np.array([{"os": "system"}], dtype=object), allow_pickle=True)
    write("bomb.npy", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (100000000000,), }",
                                      b"\0" * 16))
    write("negative_shape.npy", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (-5,), }",
                                                b"\0" * 16))
    write("call_in_header.npy", npy_with_header(
        "{'descr': '<f4', 'fortran_order': False, 'shape': __import__('os').getcwd(), }", b"\0" * 16))
    write("bad_version.npy", b"\x93NUMPY\x09\x00" + raw[8:])
    write("bad_descr.npy", npy_with_header("{'descr': 'not-a-dtype', 'fortran_order': False, 'shape': (2,), }",
                                           b"\0" * 16))
    with h5py.File(p("hdf5_named.npy"), "w") as f:
        f["x"] = X

    # --- .npz
    np.savez(p("ok.npz"), inputs=X, gradients=np.ones_like(X), min=f32(-1), max=f32(1))
    zraw = read("ok.npz")
    write("trunc.npz", zraw[: len(zraw) // 2])
    write("text.npz", b"PK but not really a zip file")
    np.savez(p("pickled.npz"), gradients=np.array([{"a": 1}], dtype=object), inputs=X, min=f32(-1), max=f32(1))
    with zipfile.ZipFile(p("not_npy_member.npz"), "w") as z:
        z.writestr("y_backprop.npy", b"hello world")
        z.writestr("x.npy", npy_bytes(BN_X))
    with zipfile.ZipFile(p("bomb.npz"), "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("inputs.npy", read("bomb.npy"))
        z.writestr("min.npy", npy_bytes(f32(-1)))
        z.writestr("max.npy", npy_bytes(f32(1)))
    zbytes = bytearray(zraw)
    i = zbytes.find(b"\x93NUMPY")  # corrupt the first member's data: the CRC no longer matches
    zbytes[i + 100: i + 110] = b"\xff" * 10
    write("bad_crc.npz", bytes(zbytes))

    # --- HDF5
    with h5py.File(p("other.h5"), "w") as f:
        f["data"] = X
        f["c4"] = np.ones(4, f32)
    with h5py.File(p("ok.h5"), "w") as f:
        f["inputs"], f["gradients"], f["min"], f["max"] = X, np.ones_like(X), f32(-1), f32(1)
    hraw = read("ok.h5")
    write("trunc.h5", hraw[: len(hraw) // 2])
    write("text.h5", b"\x89HDF\r\n\x1a\nbut nothing after the signature")
    with h5py.File(p("external_link.h5"), "w") as f:
        f["inputs"] = h5py.ExternalLink("other.h5", "/data")
        f["min"], f["max"] = f32(-1), f32(1)
    with h5py.File(p("soft_to_external.h5"), "w") as f:
        f["ext"] = h5py.ExternalLink("other.h5", "/")
        f["inputs"] = h5py.SoftLink("/ext/data")
        f["min"], f["max"] = f32(-1), f32(1)
    with h5py.File(p("virtual.h5"), "w") as f:
        layout = h5py.VirtualLayout(shape=X.shape, dtype=f32)
        layout[...] = h5py.VirtualSource("other.h5", "data", shape=X.shape)
        f.create_virtual_dataset("inputs", layout)
        f["gradients"], f["min"], f["max"] = np.ones_like(X), f32(-1), f32(1)
    write("secret.bin", SECRET)
    with h5py.File(p("external_storage.h5"), "w") as f:
        # The dataset's raw bytes live in secret.bin: reading it would disclose that file.
        f.create_dataset("inputs", shape=(len(SECRET),), dtype="u1", external=[("secret.bin", 0, len(SECRET))])
        f["min"], f["max"] = f32(-1), f32(1)
    with h5py.File(p("group.h5"), "w") as f:
        f.create_group("x")["data"] = BN_X
        f["y_backprop"] = BN_X
        f["scale"], f["reserve_space_1"], f["reserve_space_2"] = (np.ones(4, f32),) * 3
    with h5py.File(p("soft_cycle.h5"), "w") as f:
        f["self"] = h5py.SoftLink("/self")
        f["min"], f["max"] = f32(-1), f32(1)
    with h5py.File(p("hard_cycle.h5"), "w") as f:
        g = f.create_group("a")
        g["again"] = g  # a group that contains itself
        f["min"] = f32(-1)
    with h5py.File(p("stream.h5"), "w") as f:  # 2 MiB of operands: streamed under --memory-limit 1M
        f["inputs"] = f["gradients"] = RNG.standard_normal((256, 1024)).astype(f32)
        f["min"], f["max"] = f32(-1), f32(1)
    with h5py.File(p("odd_types.h5"), "w") as f:
        f["string"] = "hello"
        f["compound"] = np.zeros(3, dtype=[("a", "<f4"), ("b", "<i4")])
        f.create_dataset("null", data=h5py.Empty("f4"))
        f.create_dataset("huge", shape=(10**11,), dtype=f32, chunks=(1024,))  # 400 GB declared, nothing stored
    return d


# --- hostile names (issue 26): terminal control sequences and rich markup in every name and string ---

# Retitle the window (OSC ... BEL), clear the screen, turn the text red: what a name must never do to a terminal.
ESCAPES = "\x1b]0;pwned\x07\x1b[2J\x1b[31m"
MARKUP = "[red]markup[/red]"
# Other C0 and C1 controls, DEL, a bidirectional override, a line separator; :smile: for rich's emoji codes.
CONTROLS = "\x01\x08\x0b\x0c\r\x0e\x1f\x7f\x85\x9b[6n\u2028\u202e:smile:"
EVIL = ESCAPES + MARKUP + CONTROLS
# The byte strings that must never reach a terminal when a hostile file is shown.
RAW_SEQUENCES = [ESCAPES.encode(), b"\x1b]0;", b"\x1b[2J", b"\x07", b"\x9b[6n", "\x9b".encode()]


def make_hostile_names(path):
    """An HDF5 bundle whose names and strings are hostile: valid fake-quant and batch-norm operands under
    TensorFlow's names, beside datasets, groups, soft/external links and attributes (names and values)
    holding :data:`EVIL`, and qgcli provenance attributes holding it.  (A name that is not UTF-8 is left out:
    h5py cannot walk such a file, and ``inspect`` says so in one line.)"""
    c = X.shape[-1]
    with h5py.File(path, "w") as f:
        f["inputs"] = X
        f["gradients"] = np.ones_like(X)
        f["min"], f["max"] = np.float32(-1), np.float32(1)
        for name, value in (("x", BN_X), ("y_backprop", np.ones_like(BN_X)), ("scale", np.ones(c, f32)),
                            ("reserve_space_1", np.zeros(c, f32)), ("reserve_space_2", np.ones(c, f32))):
            f[name] = value
        f.attrs["qgcli_version"] = EVIL
        f.attrs["op"] = EVIL
        f.attrs[EVIL] = EVIL
        f["inputs"].attrs[EVIL] = EVIL
        f["inputs"].attrs["note"] = np.bytes_(EVIL.encode())
        ds = f.create_dataset(EVIL + "tensor", data=X)
        ds.attrs[EVIL] = [EVIL, MARKUP]
        grp = f.create_group(EVIL + "group")
        grp.attrs[EVIL] = EVIL
        grp[EVIL + "inner"] = np.arange(3, dtype=f32)
        f.create_dataset(MARKUP, data=np.arange(3.0))
        f.create_dataset(EVIL + "strings", data=np.array([EVIL.encode()], dtype="S64"))
        f.create_dataset("compound", data=np.zeros(2, dtype=[(EVIL, "f4"), ("ok", "i2")]))
        f[EVIL + "soft"] = h5py.SoftLink("/" + EVIL + "nowhere")
        f[EVIL + "external"] = h5py.ExternalLink(EVIL + ".h5", "/" + EVIL)
    return path
