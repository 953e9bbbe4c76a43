"""PyTorch's .pt / .pth files (``torch.save`` of a tensor, a state dict or a checkpoint), read only, through
``torch.load(weights_only=True)``: PyTorch's restricted unpickler, which builds tensors and plain containers and
refuses everything else, so reading a file never runs code from it (``pip install 'qgcli[torch]'``).

The tensors are named by their keys: a state dict's own (``backbone.conv1.weight``), nested dicts and lists
joined with ``/`` (a checkpoint's ``model/backbone.conv1.weight``, ``0``, ``1`` for a list), ``tensor`` for a
file of one tensor; other values (an epoch number, a string) are no tensors and are left out.  A SPEC names one
with ``model.pt:backbone.conv1.weight``; a key that is not there is answered with the closest keys.  qgcli does
not write .pt files (``torch.save`` pickles): write .safetensors, .h5 or .npz instead.
"""
import difflib

import numpy as np

from qgcli.errors import FileFormatError, OutputError

_ZIP, _PICKLE = b"PK\x03\x04", b"\x80"  # torch.save's zip file; the legacy format starts with a pickle


def _torch():
    try:
        import torch
    except ImportError:
        raise FileFormatError(".pt files need PyTorch: pip install 'qgcli[torch]'") from None
    return torch


def flatten(obj, prefix=""):
    """``{key: tensor}`` of the tensors in what ``torch.load`` returned (see the module's docstring)."""
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        return {prefix or "tensor": obj}
    out = {}
    if isinstance(obj, dict):
        items = ((str(k), v) for k, v in obj.items())
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return out
    for key, value in items:
        out.update(flatten(value, f"{prefix}/{key}" if prefix else key))
    return out


def to_array(tensor, label, key):
    """A tensor as a NumPy array (bfloat16 and the float8 types as ml_dtypes' types); refused where NumPy has
    no such values (quantized, sparse, complex32 tensors)."""
    torch = _torch()
    t = tensor.detach()
    if t.is_quantized or t.layout != torch.strided:
        raise FileFormatError(f"{label}: {key!r} is a {'quantized' if t.is_quantized else str(t.layout)} tensor "
                              "(dequantize or densify it and save again)")
    t = t.cpu()
    name = str(t.dtype).rpartition(".")[2]
    if name in ("bfloat16", "float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz"):
        import ml_dtypes

        bits = {1: torch.uint8, 2: torch.int16}[t.element_size()]
        return t.contiguous().view(bits).numpy().view(getattr(ml_dtypes, name))
    try:
        return t.numpy()
    except (TypeError, RuntimeError) as exc:
        raise FileFormatError(f"{label}: {key!r} has dtype {t.dtype}, which NumPy cannot hold ({exc})") from None


def _why(exc):
    """The line of ``torch.load``'s error that says what it refused (not its advice to load unsafely)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if "weights only load failed" in str(exc).lower():
        said = [line for line in lines[1:] if not line.startswith("Check the documentation")]
        return ((said[0].rstrip(".") if said else "it holds objects other than tensors and plain containers")
                + "; qgcli never unpickles code (torch.load with weights_only=False would)")
    return lines[0] if lines else type(exc).__name__


class PtFormat:
    name, title, suffixes, magic = "pt", "PyTorch .pt", (".pt", ".pth"), None
    holds_many, hierarchical = True, False
    #: torch.save writes a zip file, as .npz is one (npz.MAGIC): a file named .pt is read as .pt.
    shared_magic = (b"PK",)

    def head_fits(self, head):
        return head.startswith(_ZIP) or head.startswith(_PICKLE)

    def open(self, source):
        """``{key: tensor}`` of the file, loaded by ``torch.load(weights_only=True)`` on the CPU."""
        torch = _torch()
        if not isinstance(source, str):
            raise FileFormatError("a .pt stream on stdin is not supported; give the file")
        try:
            try:
                obj = torch.load(source, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as exc:
                if "mmap" not in str(exc):
                    raise
                obj = torch.load(source, map_location="cpu", weights_only=True)  # the legacy format cannot map
        except Exception as exc:  # noqa: BLE001 - UnpicklingError (code it would not run), damaged zip, EOF
            raise FileFormatError(f"{source}: torch.load(weights_only=True) cannot read it: {_why(exc)}") from None
        return flatten(obj)

    def names(self, handle, label):
        return list(handle)

    def has(self, handle, key, label):
        return key in handle

    def read(self, handle, key, label):
        if key not in handle:
            close = difflib.get_close_matches(key, list(handle), n=5, cutoff=0.5)
            shown = close or list(handle)[:8]
            raise FileFormatError(f"{label}: has no tensor {key!r} ("
                                  + (f"closest: {', '.join(shown)}" if close else
                                     f"keys: {', '.join(shown) or 'none'}{' ...' if len(handle) > 8 else ''}") + ")")
        return np.asarray(to_array(handle[key], label, key))

    def header(self, handle, key):
        t = handle.get(key)
        return (None, None) if t is None else (tuple(t.shape), str(t.dtype).rpartition(".")[2])

    def check_output(self, dest, *, inputs=(), force=False, names=()):
        raise OutputError(f"qgcli reads .pt files but does not write them (torch.save pickles): write {dest!r} as "
                          "FILE.safetensors, FILE.h5 or FILE.npz", operand="--output")


FORMAT = PtFormat()
