"""The provenance attributes every qgcli output carries: the qgcli version, the op and its attributes.

Built here only, so that an .h5 file, a Zarr store, a run file's groups and a safetensors header say the
same thing in the same order.
"""

from qgcli import __version__


def attributes(op_attrs):
    """``{"qgcli_version": ..., **op_attrs}`` without the attributes whose value is None (not applicable)."""
    return {"qgcli_version": __version__, **{k: v for k, v in op_attrs.items() if v is not None}}
