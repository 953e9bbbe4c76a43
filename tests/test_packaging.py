"""pyproject.toml in the form today's setuptools builds without deprecation warnings."""
import os

import pytest

from conftest import ROOT

tomllib = pytest.importorskip("tomllib", reason="tomllib is new in Python 3.11")


def test_license_is_an_spdx_string_and_setuptools_new_enough_to_read_it():
    # setuptools warns (and from 2027 fails) on the TOML-table form; the string form needs setuptools 77.
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
        meta = tomllib.load(fh)
    assert isinstance(meta["project"]["license"], str)
    assert "setuptools>=77" in meta["build-system"]["requires"]
