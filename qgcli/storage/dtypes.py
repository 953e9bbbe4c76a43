"""Dtype names, as the summaries and a run file's listing print them."""

_DTYPE_NAMES = {}


def dtype_name(dtype):
    """``str(dtype)``, looked up once per dtype (NumPy builds the text anew at ~5 us a call, and a run file's
    summary names thousands of dtypes)."""
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        name = _DTYPE_NAMES[dtype] = str(dtype)
        return name
    except TypeError:  # an unhashable stand-in for a dtype
        return str(dtype)
