"""The optional compiled CPU kernels (``qgcli/ops/_kernels.c``), loaded with ctypes.

:func:`library` returns the loaded kernels, or None when they were not built (no C compiler at install
time) or ``QGCLI_NATIVE=0`` is set; callers then run the NumPy kernels, which give the same bits.  The
AVX2 build is used where the CPU has AVX2, unless ``QGCLI_NATIVE=baseline``.  ctypes releases the GIL
during each call, so blocks still run on both cores.
"""
import ctypes
import importlib.machinery
import os
import threading

import numpy as np

_P, _I64, _INT, _F = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
ABI_VERSION = 25  # qg_abi_version() of the C file these signatures describe
# Arrays are passed as raw addresses (see address()): ctypes' own array checks cost more than a small op.
_SIGNATURES = {
    "qg_nudge": (None, [_P, _P, _I64, _F, _F, _P]),
    "qg_quantize": (None, [_P, _P, _I64, _I64, _P, _INT, _INT]),
    "qg_backprop": (None, [_P, _P, _P, _I64, _I64, _P]),
    "qg_backprop_leaves": (_INT, [_P, _P, _P, _I64, _I64, _P, _P, _P]),
    "qg_fused": (_INT, [_P, _P, _P, _P, _I64, _I64, _P, _P, _INT, _INT]),
    "qg_fused_leaves": (_INT, [_P, _P, _P, _P, _I64, _I64, _P, _P, _P, _P, _INT, _INT]),
    "qg_clip_stats": (None, [_P, _P, _I64, _I64, _P, _P, _P]),
    "qg_combine": (None, [_P, _I64, _P, _I64]),
    "qg_bn_sums": (None, [_P, _P, _I64, _I64, _I64, _P, _P]),
    "qg_bn_dx": (None, [_P, _P, _P, _I64, _I64, _I64, _P, _INT]),
    "qg_bn_grad": (_INT, [_P, _P, _P, _I64, _I64, _I64, _P, _P, _P, ctypes.c_double, _INT, _INT, _P, _P]),
    "qg_lzf_compress": (_I64, [_P, _I64, _P, _I64, _I64]),
    "qg_mx_blocks": (_INT, [_P, _P, _P, _P, _I64, _I64, _INT, _INT]),
    "qg_nvfp4_blocks": (_INT, [_P, _P, _P, _P, _I64, _INT, _F, _F]),
    "qg_amax_bits": (ctypes.c_uint32, [_P, _I64]),
    "qg_onnx_q": (_INT, [_P, _P, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _I64, _I64, _I64, _INT, _F, _F, _INT]),
    "qg_oscillation": (None, [_P, _I64, _I64, _P, _P, _F, _F, _P, _P, _P, _F, _INT]),
    "qg_oscillation_sample": (None, [_P, _P, _P, _I64, _F, _F, _P]),
    "qg_monitor_forward": (None, [_P, _P, _I64, _I64, _P, _P, _F, _F, _INT, _P, _P]),
    "qg_monitor_upstream": (None, [_P, _P, _I64, _P]),
    "qg_monitor_downstream": (None, [_P, _P, _P, _I64, _INT, _P]),
    "qg_tf_monitor_forward": (None, [_P, _P, _I64, _I64, _P, _P, _P, _P]),
    "qg_tf_monitor_upstream": (None, [_P, _P, _I64, _P]),
    "qg_tf_monitor_downstream": (None, [_P, _P, _P, _I64, _P]),
    "qg_tf_oscillation": (None, [_P, _I64, _I64, _P, _P, _P, _P, _P, _P, _F, _F, _INT]),
    "qg_cpu_has_avx2": (_INT, []),
    "qg_abi_version": (_INT, []),
}
_lock = threading.Lock()
_loaded = {}  # build name -> CDLL, or None where it is missing or does not load


def library():
    """The compiled kernels, or None (not built, or disabled with ``QGCLI_NATIVE=0``).

    A None that nobody chose (no ``QGCLI_NATIVE=0``) is remembered: :func:`take_fallback_note` then says so."""
    global _fell_back
    lib = _selected()
    if lib is None and os.environ.get("QGCLI_NATIVE", "") != "0":
        _fell_back = True
    return lib


def _selected():
    choice = os.environ.get("QGCLI_NATIVE", "")
    if choice not in _chosen:
        _chosen[choice] = _choose(choice)
    return _chosen[choice]


_chosen = {}  # QGCLI_NATIVE value -> the library it selects
_fell_back = False  # an op asked for the kernels, and ran on NumPy because they were not there


def take_fallback_note():
    """One sentence for the user when an op ran on the NumPy kernels because the compiled ones are missing (not
    when ``QGCLI_NATIVE=0`` chose them) since the last call, else None. The CLI prints it once per command, on
    stderr."""
    global _fell_back
    if not _fell_back:
        return None
    _fell_back = False
    return (f"the compiled kernels are {_why_missing()}, so the ops ran on qgcli's NumPy kernels: the same bits, "
            "only slower. Build them with 'python setup.py build_ext --inplace' in a source checkout, or reinstall "
            "qgcli where a C compiler is present (QGCLI_NATIVE=0 chooses the NumPy kernels and silences this)")


def _why_missing():
    here = os.path.dirname(__file__)
    if not any(os.path.exists(os.path.join(here, "_kernels" + suffix))
               for suffix in importlib.machinery.EXTENSION_SUFFIXES):
        return f"not built (no _kernels{importlib.machinery.EXTENSION_SUFFIXES[0]} in {here})"
    return "built from another version of _kernels.c or not loadable"


def kind():
    """What runs the ops, for ``qgcli --version``: the kernels in use and, without them, why."""
    name = variant()
    if name != "numpy":
        return f"compiled C ({name})"
    if os.environ.get("QGCLI_NATIVE", "") == "0":
        return "NumPy (QGCLI_NATIVE=0)"
    return f"NumPy (the compiled kernels are {_why_missing()})"


def _choose(choice):
    if choice == "0":
        return None
    baseline = _build("_kernels")
    if baseline is None or choice == "baseline" or not baseline.qg_cpu_has_avx2():
        return baseline
    return _build("_kernels_avx2") or baseline


def for_arrays(xp, *arrays):
    """:func:`library` when the kernels apply to these arrays: NumPy, float32, C order (None entries skipped)."""
    if xp is not np or not all(a is None or (a.dtype == np.float32 and a.flags.c_contiguous) for a in arrays):
        return None
    return library()


def address(a, dtype):
    """The address of ``a``'s data, after checking what the C code assumes: its dtype and C order."""
    if a.dtype != dtype or not a.flags.c_contiguous:
        raise TypeError(f"the compiled kernels need a C-contiguous {np.dtype(dtype)} array, got {a.dtype}")
    return addresses(a)[0]


_addressof, _char_at = ctypes.addressof, ctypes.c_char.from_buffer


def addresses(*arrays):
    """The data addresses of NumPy arrays the caller has checked are C-contiguous and of the kernel's dtype (a
    small call's operands: :func:`address`'s checks cost a microsecond each)."""
    try:  # through the buffer protocol: a quarter of __array_interface__'s cost, which builds a dict
        return [_addressof(_char_at(a)) for a in arrays]
    except (TypeError, ValueError, BufferError):  # a read-only or empty one among them
        return [a.__array_interface__["data"][0] for a in arrays]


def variant():
    """Which kernels :func:`library` runs: "avx2", "baseline" or "numpy" (for benchmarks and reports)."""
    lib = _selected()  # asking is no fallback: take_fallback_note() stays as it was
    return "numpy" if lib is None else ("avx2" if lib is _loaded.get("_kernels_avx2") else "baseline")


def _build(name):
    if name not in _loaded:
        with _lock:
            if name not in _loaded:
                _loaded[name] = _load(name)
    return _loaded[name]


def _load(name):
    here = os.path.dirname(__file__)
    paths = [os.path.join(here, name + suffix) for suffix in importlib.machinery.EXTENSION_SUFFIXES]
    path = next((p for p in paths if os.path.exists(p)), None)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        for fn_name, (restype, argtypes) in _SIGNATURES.items():
            fn = getattr(lib, fn_name)
            fn.restype, fn.argtypes = restype, argtypes
    except (OSError, AttributeError):  # not loadable, or built from an older C file
        return None
    return lib if lib.qg_abi_version() == ABI_VERSION else None
