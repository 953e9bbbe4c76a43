"""qgcli.report.json_out writes what json.dump(indent=2, allow_nan=False, default=...) writes, byte for byte."""
import io
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qgcli.report import json_out
from qgcli.report.summaries import _json_default


def stdlib(doc):
    return json.dumps(doc, indent=2, allow_nan=False, default=_json_default)


def mine(doc):
    buf = io.StringIO()
    json_out.write(doc, buf, default=_json_default)
    return buf.getvalue()


leaves = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
keys = st.text() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.booleans() | st.none()
documents = st.recursive(leaves, lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner)
                         | st.dictionaries(keys, inner, max_size=5), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(documents)
def test_same_text_as_the_standard_library(doc):
    assert mine(doc) == stdlib(doc)


def test_numpy_values_subclasses_and_long_documents():
    class Name(str):
        pass

    doc = {"f32": np.float32(0.1), "i64": np.int64(-3), "f64": np.float64(1e-300), "arr": np.arange(3.0),
           "b": np.bool_(True), Name("sub"): [Name("x"), True, 2**70, -0.0, 1e16], "ctrl": "tab\t\x00é\u2028😀",
           "deep": [[[[{}]], []], {"k": ()}], 1: "int key", 2.5: "float key", None: "none", False: "false",
           "many": [{"path": f"g{i}", "v": i / 7} for i in range(20_000)]}  # several blocks
    assert mine(doc) == stdlib(doc)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"k": [1.0, -float("inf")]}, {float("nan"): 1}])
def test_out_of_range_floats_refused_as_json_does(bad):
    with pytest.raises(ValueError) as theirs:
        stdlib(bad)
    with pytest.raises(ValueError) as ours:
        mine(bad)
    assert str(ours.value) == str(theirs.value)


def test_unserialisable_values_raise_the_default_s_error():
    with pytest.raises(TypeError, match="not JSON serialisable: object"):
        mine({"x": object()})
    with pytest.raises(TypeError, match="keys must be"):
        mine({(1, 2): 1})


nan_leaves = leaves | st.floats()  # NaN and infinities too
nan_documents = st.recursive(nan_leaves, lambda inner: st.lists(inner, max_size=5) | st.tuples(inner, inner)
                             | st.dictionaries(keys, inner, max_size=5), max_leaves=40)


@settings(max_examples=300, deadline=None)
@given(nan_documents)
def test_nan_as_null_writes_what_json_safe_then_write_writes(doc):
    from qgcli.report.summaries import json_safe

    buf = io.StringIO()
    json_out.write(doc, buf, default=_json_default, nan_as_null=True)
    assert buf.getvalue() == stdlib(json_safe(doc))
