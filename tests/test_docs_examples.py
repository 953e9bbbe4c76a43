"""Every example of README.md and docs/*.md runs, and its output is what the page says it is.

The convention (docs/writing-docs.md has it for writers):

- a fenced ``sh`` (or ``bash``) block is a script: run with bash (``set -eo pipefail``), it must exit 0;
- a fenced ``text`` block whose lines start with ``$ `` is a transcript: each command after ``$ `` runs and
  its output (stdout and stderr together) must match the lines that follow it, compared line by line with
  runs of whitespace collapsed and the page's temporary directory removed from paths; a line ``...``
  stands for any number of lines, and a line ending in `` ...`` for any line that starts with the rest;
- a fenced ``python``/``pycon`` block starting with ``>>> `` is a doctest (one namespace per page);
- the HTML comment ``<!-- example: ... -->`` on the line before a fence changes that: ``exit=N`` (the
  block's last command exits N, the others 0), ``skip="reason"``, ``no-run`` (not an example at all),
  ``requires="mod,tool"`` (skipped where a module does not import and no such program is on PATH).

Each page's examples run in the order written, in one fresh temporary directory holding a copy of samples/,
with ``qgcli`` and ``python`` on PATH meaning this interpreter.  A fence without a language is an error: say
what it is (``text`` for a listing, ``sh`` for commands).  The docstring examples of the Python API pages
(every module named by an ``automodule`` in docs/api.md) run here too.  The counts run and skipped, with
every reason, are printed at the end of the pytest run.
"""
import doctest
import importlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
COMMAND_TIMEOUT = 120  # seconds; examples are meant to take seconds
DOCTEST_FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

_FENCE = re.compile(r"^(?P<indent> *)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
_MARKER = re.compile(r"^\s*<!--\s*example:(?P<body>.*?)-->\s*$")
_OPTION = re.compile(r'(?P<key>[a-z-]+)(?:=(?:"(?P<quoted>[^"]*)"|(?P<bare>\S+)))?')


@dataclass
class Example:
    page: Path
    line: int  # 1-based line of the opening fence
    kind: str  # "sh", "transcript" or "doctest"
    body: str
    exit: int = 0
    skip: str = ""
    requires: list = field(default_factory=list)

    def where(self):
        return f"{_shown(self.page)}:{self.line}"


def _shown(page):
    return str(page.relative_to(ROOT)) if page.is_relative_to(ROOT) else str(page)


def _options(body, where):
    opts = {}
    for m in _OPTION.finditer(body):
        value = m.group("quoted") if m.group("quoted") is not None else m.group("bare")
        opts[m.group("key")] = value
    unknown = set(opts) - {"exit", "skip", "no-run", "requires"}
    if unknown:
        raise AssertionError(f"{where}: unknown example option(s) {sorted(unknown)}")
    return opts


def parse_examples(page):
    """The examples of a Markdown page, in order; fences that are not examples are left out."""
    lines = page.read_text(encoding="utf-8").splitlines()
    examples, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        fence, indent, info = m.group("fence"), len(m.group("indent")), m.group("info").strip()
        start, body = i, []
        i += 1
        while i < len(lines) and not (lines[i].strip().startswith(fence[0] * len(fence))
                                      and set(lines[i].strip()) == {fence[0]}):
            body.append(lines[i][indent:] if lines[i][:indent].strip() == "" else lines[i].lstrip())
            i += 1
        i += 1
        where = f"{_shown(page)}:{start + 1}"
        prev = next((lines[j] for j in range(start - 1, -1, -1) if lines[j].strip()), "")
        marker = _MARKER.match(prev)
        opts = _options(marker.group("body"), where) if marker else {}
        if "no-run" in opts:
            continue
        language = info.split()[0].lower() if info else ""
        text = "\n".join(body)
        if not language:
            raise AssertionError(f"{where}: a fence without a language; write ```text for a listing, ```sh for "
                                 "commands (or mark it <!-- example: no-run -->)")
        if language in ("sh", "bash"):
            kind = "sh"
        elif language == "text" and any(line.startswith("$ ") for line in body):
            kind = "transcript"
        elif language in ("python", "pycon") and text.lstrip().startswith(">>> "):
            kind = "doctest"
        else:
            continue
        examples.append(Example(page, start + 1, kind, text, exit=int(opts.get("exit", 0)),
                                skip=opts.get("skip", ""),
                                requires=[r.strip() for r in opts.get("requires", "").split(",") if r.strip()]))
    return examples


def _available(name):
    if shutil.which(name):
        return True
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def skip_reason(example):
    if example.skip:
        return example.skip
    missing = [r for r in example.requires if not _available(r)]
    return f"needs {', '.join(missing)}" if missing else ""


# --- running ---------------------------------------------------------------------------------------------

def _page_dir(tmp_path, pycache=None):
    """A fresh directory with samples/ and a bin/ whose ``qgcli`` and ``python`` are this interpreter."""
    work = tmp_path / "work"
    shutil.copytree(ROOT / "samples", work / "samples", ignore=shutil.ignore_patterns("__pycache__"))
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, args in (("qgcli", '-m qgcli "$@"'), ("python", '"$@"'), ("python3", '"$@"')):
        shim = bin_dir / name
        shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" {args}\n')
        shim.chmod(0o755)
    import qgcli

    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    # The qgcli this test imports, whether installed or run from the checkout.
    package_parent = str(Path(qgcli.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_parent, env.get("PYTHONPATH")) if p)
    env["QGCLI_NO_PROGRESS"] = "1"
    env["PYTHONUNBUFFERED"] = "1"  # stdout and stderr interleave in the order written, as on a terminal
    if pycache:
        # Bytecode cached across the examples (outside the source tree): a third off every command's start.
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = str(pycache)
    for key in ("COLUMNS", "LINES", "FORCE_COLOR", "CLICOLOR_FORCE"):
        env.pop(key, None)
    return work, env


def _run(script, work, env):
    proc = subprocess.run(["bash", "-c", "set -eo pipefail\n" + script], cwd=work, env=env, stdin=subprocess.DEVNULL,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=COMMAND_TIMEOUT)
    return proc.returncode, proc.stdout.decode("utf-8", "replace")


def transcript_steps(body):
    """``(command, expected_lines)`` pairs of a transcript; a command ending in ``\\`` goes on to the next line."""
    steps, lines = [], body.splitlines()
    i = 0
    while i < len(lines):
        if not lines[i].startswith("$ "):
            if lines[i].strip():
                raise AssertionError(f"transcript output before the first command: {lines[i]!r}")
            i += 1
            continue
        command = lines[i][2:]
        while command.endswith("\\") and i + 1 < len(lines):
            i += 1
            command += "\n" + lines[i]
        i += 1
        expected = []
        while i < len(lines) and not lines[i].startswith("$ "):
            expected.append(lines[i])
            i += 1
        steps.append((command, expected))
    return steps


def normalise(text, work):
    """Lines of ``text`` with the temporary directory gone, runs of whitespace collapsed, no blank tail."""
    for d in {str(work), os.path.realpath(work)}:
        text = text.replace(d + os.sep, "").replace(d, ".")
    lines = [" ".join(line.split()) for line in text.splitlines()]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_matches(expected, actual):
    return expected == actual or (expected.endswith(" ...") and actual.startswith(expected[:-3]))


def lines_match(expected, actual):
    """``expected`` (with ``...`` lines eliding any number of lines) matches ``actual``."""
    memo = {}

    def match(i, j):
        if (i, j) not in memo:
            if i == len(expected):
                result = j == len(actual)
            elif expected[i] == "...":
                result = any(match(i + 1, k) for k in range(j, len(actual) + 1))
            else:
                result = j < len(actual) and _line_matches(expected[i], actual[j]) and match(i + 1, j + 1)
            memo[i, j] = result
        return memo[i, j]

    return match(0, 0)


def run_example(example, work, env, globs):
    """Run one example; an AssertionError says what differed."""
    if example.kind == "sh":
        script = "trap 'echo \"example failed: $BASH_COMMAND (exit $?)\" >&2' ERR\n" + example.body
        code, output = _run(script, work, env)
        assert code == example.exit, (f"{example.where()}: exit {code}, expected {example.exit}\n"
                                      f"{example.body}\n--- output ---\n{output}")
        return
    if example.kind == "doctest":
        _run_doctest(example, work, globs)
        return
    steps = transcript_steps(example.body)
    for n, (command, expected) in enumerate(steps):
        code, output = _run(command, work, env)
        want_exit = example.exit if n == len(steps) - 1 else 0
        assert code == want_exit, f"{example.where()}: `{command}` exited {code}, expected {want_exit}\n{output}"
        want, got = normalise("\n".join(expected), work), normalise(output, work)
        assert lines_match(want, got), (f"{example.where()}: the output of `{command}` differs from the page\n"
                                        "--- page ---\n" + "\n".join(want) + "\n--- actual ---\n" + "\n".join(got))


def _run_doctest(example, work, globs):
    test = doctest.DocTestParser().get_doctest(example.body, globs, example.where(), str(example.page), example.line)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    out = []
    cwd = os.getcwd()
    os.chdir(work)
    try:
        # A framework's deprecation warnings (torch.ao ...) are the reader's to see, not this page's to check.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            runner.run(test, out=out.append, clear_globs=False)
    finally:
        os.chdir(cwd)
    assert runner.failures == 0, f"{example.where()}: doctest failed\n" + "".join(out)


# --- the summary -----------------------------------------------------------------------------------------

class _Summary:
    """Counts run and skipped examples and prints them (and every skip's reason) after the test run."""

    def __init__(self):
        self.run, self.skipped, self.seconds = 0, [], {}

    def pytest_terminal_summary(self, terminalreporter):
        if not (self.run or self.skipped):
            return
        tr = terminalreporter
        tr.section("documentation examples")
        tr.write_line(f"{self.run} examples run, {len(self.skipped)} skipped")
        if self.seconds:
            pages = ", ".join(f"{page} {t:.1f}" for page, t in sorted(self.seconds.items(), key=lambda kv: -kv[1]))
            tr.write_line(f"seconds per page (side by side): {pages}")
        for where, reason in self.skipped:
            tr.write_line(f"  skipped {where}: {reason}")


def run_page(page, tmp_path, pycache=None):
    """Run every example of one page, in order, in one fresh directory holding samples/: a dict with the
    count run, the skipped ones (where, why) and the first failure (None when all passed)."""
    start = time.monotonic()
    work, env = _page_dir(tmp_path, pycache)
    globs = {"__name__": "__docs__"}
    result = {"run": 0, "skipped": [], "failure": None, "seconds": 0.0}
    try:
        for example in parse_examples(page):
            reason = skip_reason(example)
            if reason:
                result["skipped"].append((example.where(), reason))
                continue
            run_example(example, work, env, globs)
            result["run"] += 1
    except (AssertionError, subprocess.TimeoutExpired) as exc:
        result["failure"] = str(exc)
    result["seconds"] = time.monotonic() - start
    return result


def _run_page_in_process(page, pycache):
    """``run_page`` in a child process (its own working directory and warnings), so pages run side by side."""
    import qgcli

    # The child runs this file as a script: it imports the qgcli this test imports (the checkout's, not an
    # installed one), as the examples' commands do (see _page_dir).
    package_parent = str(Path(qgcli.__file__).resolve().parent.parent)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (package_parent, os.environ.get("PYTHONPATH")) if p))
    proc = subprocess.run([sys.executable, __file__, str(page), str(pycache)], capture_output=True, text=True,
                          timeout=20 * COMMAND_TIMEOUT, env=env)
    if proc.returncode != 0:
        return {"run": 0, "skipped": [], "failure": f"the page runner failed:\n{proc.stdout}{proc.stderr}",
                "seconds": 0.0}
    return json.loads(proc.stdout)


@pytest.fixture(scope="session")
def pycache(tmp_path_factory):
    return tmp_path_factory.mktemp("pycache")


@pytest.fixture(scope="session")
def summary(request):
    plugin = request.config.pluginmanager.get_plugin("qgcli-docs-examples")
    if plugin is None:
        plugin = _Summary()
        request.config.pluginmanager.register(plugin, "qgcli-docs-examples")
    return plugin


@pytest.fixture(scope="session")
def page_results(request, pycache):
    """Every selected page starts at once, a few side by side (the examples wait on subprocesses), and each
    page's test waits for its own result: the wall time is the longest page's, not the sum."""
    pages = [item.callspec.params["page"] for item in request.session.items
             if getattr(item, "originalname", "") == "test_page_examples"]
    pool = ThreadPoolExecutor(max_workers=max(1, min(4, os.cpu_count() or 1)))
    # The pages with the most commands first, so that no long page starts last.
    pages.sort(key=lambda page: -page.read_text(encoding="utf-8").count("qgcli "))
    futures = {page: pool.submit(_run_page_in_process, page, pycache) for page in pages}
    yield futures
    pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_page_examples(page, summary, page_results):
    """Every example of one page runs, in order, and shows what the page says."""
    result = page_results[page].result()
    summary.run += result["run"]
    summary.skipped += [tuple(s) for s in result["skipped"]]
    summary.seconds[page.name] = result["seconds"]
    assert result["failure"] is None, result["failure"]


# --- the API pages' docstring examples -------------------------------------------------------------------

def api_modules():
    """The modules docs/api.md renders (``automodule`` directives), in page order."""
    text = (ROOT / "docs" / "api.md").read_text(encoding="utf-8")
    return re.findall(r"^\.\. automodule:: (\S+)", text, flags=re.M)


# Modules whose examples need a framework that the 3.10/3.13 CI runs do not install.
_API_REQUIRES = {"qgcli.capture.torch": "torch", "qgcli.capture.tensorflow": "tensorflow"}


@pytest.mark.parametrize("module", api_modules())
def test_api_docstring_examples(module, tmp_path, monkeypatch, summary):
    """The ``>>>`` examples in the docstrings of every module the API page documents (and of what its
    ``__all__`` imports from elsewhere) pass."""
    needed = _API_REQUIRES.get(module)
    if needed and not _available(needed):
        summary.skipped.append((f"docstrings of {module}", f"needs {needed}"))
        pytest.skip(f"needs {needed}")
    mod = importlib.import_module(module)
    finder = doctest.DocTestFinder()
    tests = finder.find(mod, module)
    for name in getattr(mod, "__all__", []):
        obj = getattr(mod, name)
        if getattr(obj, "__module__", module) != module:
            tests += finder.find(obj, f"{module}.{name}", globs=vars(sys.modules[obj.__module__]))
    tests = [t for t in tests if t.examples]
    monkeypatch.chdir(tmp_path)
    runner = doctest.DocTestRunner(optionflags=DOCTEST_FLAGS)
    out = []
    for test in tests:
        runner.run(test, out=out.append)
    summary.run += len(tests)
    assert runner.failures == 0, "".join(out)


def test_parse_examples_reads_the_markers(tmp_path):
    """Fence languages and markers decide what runs and how; a fence without a language is refused."""
    page = tmp_path / "page.md"
    page.write_text("""# T

```sh
qgcli --version
```

<!-- example: exit=2 requires="numpy" -->
```text
$ qgcli nudge --min 1 --max 0
Error: ...
```

```text
a listing, not a transcript
```

<!-- example: skip="needs a GPU" -->
```sh
qgcli fakequant-grad samples/per_channel.h5 -o g.h5 --device gpu
```

<!-- example: no-run -->
```
a layout
```

```pycon
>>> 1 + 1
2
```
""")
    examples = parse_examples(page)
    assert [(e.kind, e.exit, e.skip, e.requires) for e in examples] == [
        ("sh", 0, "", []), ("transcript", 2, "", ["numpy"]), ("sh", 0, "needs a GPU", []), ("doctest", 0, "", [])]
    page.write_text("```\nqgcli --version\n```\n")
    with pytest.raises(AssertionError, match="without a language"):
        parse_examples(page)


def test_convention_helpers():
    """The matcher elides with ``...`` and nothing else: a changed number or word fails."""
    assert lines_match(["a 1", "...", "z"], ["a 1", "b", "c", "z"])
    assert lines_match(["a 1", "...", "z"], ["a 1", "z"])
    assert not lines_match(["a 1", "z"], ["a 2", "z"])
    assert not lines_match(["a 1"], ["a 1", "extra"])
    assert lines_match(["head ..."], ["head and the rest"])
    assert not lines_match(["head ..."], ["other"])
    assert transcript_steps("$ a \\\n  b\nout\n$ c") == [("a \\\n  b", ["out"]), ("c", [])]


if __name__ == "__main__":
    # python tests/test_docs_examples.py PAGE [PYCACHE]: one page's examples, the result as JSON on stdout
    # (what test_page_examples runs in a child process).
    import tempfile

    with tempfile.TemporaryDirectory(prefix="qgcli-docs-") as tmp:
        outcome = run_page(Path(sys.argv[1]).resolve(), Path(tmp), Path(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(json.dumps(outcome))
