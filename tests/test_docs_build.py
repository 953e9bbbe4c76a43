"""The manual builds, its links resolve, and docs/cli.md is what docs/gen_cli.py writes from the commands."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md"] + sorted(DOCS.glob("*.md"))
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE = re.compile(r"^\s*(```|~~~)")


def _gen_cli():
    spec = importlib.util.spec_from_file_location("gen_cli", DOCS / "gen_cli.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cli_reference_is_up_to_date():
    """docs/cli.md is exactly what docs/gen_cli.py writes: help text and reference cannot drift apart."""
    text = _gen_cli().render()
    assert (DOCS / "cli.md").read_text(encoding="utf-8") == text, "docs/cli.md is out of date: python docs/gen_cli.py"
    for command in ("fakequant", "fakequant-grad", "bn-grad", "inspect", "report", "plot", "plot ste", "nudge"):
        assert f"`qgcli {command}`" in text


def github_anchor(heading):
    """The anchor GitHub (and MyST's myst_heading_anchors) gives a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _headings(path):
    anchors, in_fence = set(), False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and line.startswith("#"):
            anchors.add(github_anchor(line.lstrip("#")))
    return anchors


def _links(path):
    in_fence = False
    for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence:
            for target in _LINK.findall(line):
                yield n, target


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_relative_links_resolve(page):
    """Every relative link points at a file that exists, and at a heading of it where it names one (as
    GitHub renders the pages; the Sphinx build checks the same on the site)."""
    broken = []
    for n, target in _links(page):
        if re.match(r"^[a-z]+:", target):
            continue  # https:, mailto: ...
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{page.name}:{n}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _headings(dest):
            broken.append(f"{page.name}:{n}: {target}: no such heading")
    assert not broken, "\n".join(broken)


def test_github_anchor():
    assert github_anchor(" `qgcli bn-grad`") == "qgcli-bn-grad"
    assert github_anchor("JSON output of `inspect` and `report`") == "json-output-of-inspect-and-report"
    assert github_anchor("torchao QAT: `--semantics torchao`") == "torchao-qat---semantics-torchao"
    assert github_anchor("`qgcli.ops.torch_semantics`: PyTorch's") == "qgcliopstorch_semantics-pytorchs"


def test_manual_builds(tmp_path):
    """``python -m sphinx -W`` builds docs/ without a warning: no broken link, no page left out, every
    docstring readable."""
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install '.[docs]')")
    proc = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
                           "-d", str(tmp_path / "doctrees"), str(DOCS), str(tmp_path / "html")],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "html" / "cli.html").exists()
    assert (tmp_path / "html" / "api.html").exists()
