"""qgcli's imports run one way: no module imports itself through others, and no command module imports another.

The import graph is read with ``ast`` from every module of the package, imports inside functions included
(absolute and relative), so a cycle that only bites at run time is caught too.
"""
import ast
import functools
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "qgcli")
# The one module of qgcli.cli.commands that the command modules share (click option decorators).
SHARED_COMMAND_MODULE = "qgcli.cli.options"
# Cycles that predate this test, each with its way out; the last test fails once one is gone, so that it is
# struck from here and the cycle cannot come back.


def _modules():
    """Module name -> path, for every .py file of the package."""
    mods = {}
    for folder, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                dotted = os.path.relpath(path[:-3], ROOT).replace(os.sep, ".")
                mods[dotted[: -len(".__init__")] if dotted.endswith(".__init__") else dotted] = path
    return mods


def _imports(module, path, mods):
    """The qgcli modules that ``module`` imports (anywhere in the file), with the line of each import."""
    package = module if path.endswith("__init__.py") else module.rpartition(".")[0]
    with open(path, encoding="utf-8") as fh:
        tree = ast.parse(fh.read(), filename=path)
    found = {}
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            # `from qgcli.x import y`: y is a module (qgcli.x.y) or a name in qgcli.x
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in mods else base for alias in node.names]
        for name in names:
            # `import qgcli.a.b` imports qgcli.a.b; a name that is no module counts for its nearest module
            while name and name not in mods:
                name = name.rpartition(".")[0]
            # importing one's own package (its __init__) from inside is no edge of a cycle
            if name and name != module and not module.startswith(name + "."):
                found.setdefault(name, node.lineno)
    return found


@functools.lru_cache(maxsize=1)
def _graph():
    mods = _modules()
    return {m: _imports(m, p, mods) for m, p in mods.items()}


def _cycles(graph):
    """Every strongly connected group of two or more modules (Tarjan), each as one
    cycle path."""
    return [_path_through(graph, group) for group in _groups(graph)]


def _groups(graph):
    """The strongly connected groups of two or more modules, each sorted."""
    index, low, stack, on_stack, groups = {}, {}, [], set(), []

    def visit(m):
        index[m] = low[m] = len(index)
        stack.append(m)
        on_stack.add(m)
        for d in sorted(graph.get(m, ())):
            if d not in index:
                visit(d)
                low[m] = min(low[m], low[d])
            elif d in on_stack:
                low[m] = min(low[m], index[d])
        if low[m] == index[m]:
            group = []
            while True:
                d = stack.pop()
                on_stack.discard(d)
                group.append(d)
                if d == m:
                    break
            if len(group) > 1:
                groups.append(sorted(group))

    for m in sorted(graph):
        if m not in index:
            visit(m)
    return groups


def _path_through(graph, group):
    """One closed path inside ``group``, from its first module back to it, as 'a:LINE -> b ...'."""
    start, members = group[0], set(group)
    seen, trail = {start}, [start]

    def walk(m):
        for d in sorted(graph[m]):
            if d == start and len(trail) > 1:
                return trail + [start]
            if d in members and d not in seen:
                seen.add(d)
                trail.append(d)
                found = walk(d)
                if found:
                    return found
                trail.pop()
        return None

    path = walk(start) or group
    return " -> ".join(f"{a} (line {graph[a][b]})" for a, b in zip(path, path[1:])) + f" -> {path[-1]}"


def test_the_graph_sees_the_package():
    graph = _graph()
    assert "qgcli.cli" in graph and "qgcli.cli.commands.fakequant" in graph and "qgcli.ops.fake_quant" in graph
    assert "qgcli.execution.dispatch" in graph["qgcli.cli.commands.fakequant"]  # an import inside a function counts
    assert "qgcli.cli.commands.fakequant" in graph["qgcli.cli.app"]


def test_no_import_cycle_in_qgcli():
    cycles = _cycles(_graph())
    assert not cycles, "import cycles in qgcli:\n" + "\n".join(cycles)


def test_the_cycle_finder_names_a_cycle():
    graph = {"a": {"b": 3}, "b": {"c": 5}, "c": {"a": 7}, "d": {"a": 1}}
    assert _cycles(graph) == ["a (line 3) -> b (line 5) -> c (line 7) -> a"]
    assert _cycles({"a": {"b": 1}, "b": {}}) == []


def test_command_modules_import_no_other_command_module():
    graph = _graph()
    commands = [m for m in graph if m.startswith("qgcli.cli.commands.")]
    assert SHARED_COMMAND_MODULE in graph and commands
    crossings = [f"{m} imports {d} (line {line})" for m in sorted(commands) for d, line in sorted(graph[m].items())
                 if d.startswith("qgcli.cli.commands.") and d != SHARED_COMMAND_MODULE]
    assert not crossings, "\n".join(crossings)
    # the shared module itself stands on no command module
    assert not [d for d in graph[SHARED_COMMAND_MODULE] if d.startswith("qgcli.cli.commands")]


#: The layers, top to bottom: a module may import its own layer and the layers below it, never one above.
#: A layer is a list of module prefixes (a prefix names a module and everything under it).
LAYERS = [
    ("cli", ["qgcli.cli", "qgcli.__main__"]),
    ("capture", ["qgcli.capture"]),
    ("monitor", ["qgcli.monitor"]),
    ("whole-model reports", ["qgcli.report.verify", "qgcli.report.layers", "qgcli.report.layer_figures",
                             "qgcli.report.layer_details", "qgcli.report.ranges_out"]),
    ("execution", ["qgcli.execution"]),
    ("families", ["qgcli.families"]),
    ("presentation", ["qgcli.report"]),
    ("storage", ["qgcli.storage"]),
    ("ops", ["qgcli.ops"]),
    ("base", ["qgcli.errors", "qgcli.backend", "qgcli.signals", "qgcli.jobs", "qgcli.collector"]),
]
#: Imports that climb today, each to be moved down (struck from here when it is gone; the last test checks).
KNOWN_CLIMBS = {
}


def _layer(module):
    """The index in LAYERS of the layer holding ``module`` (its longest matching prefix), None for the top."""
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[0]:
                    best = (len(prefix), index)
    return None if best is None else best[1]


def _climbs():
    graph = _graph()
    found = set()
    for m, deps in graph.items():
        low = _layer(m)
        for d in deps:
            high = _layer(d)
            if low is not None and high is not None and high < low:
                found.add((m, d))
    return found


def test_every_module_has_a_layer():
    assert [m for m in _graph() if m != "qgcli" and _layer(m) is None] == []


def test_imports_run_down_the_layers():
    """cli -> capture -> monitor -> whole-model reports -> execution -> families -> presentation -> storage -> ops -> base."""
    graph = _graph()
    wrong = [f"{m} ({LAYERS[_layer(m)][0]}) imports {d} ({LAYERS[_layer(d)][0]}) at line {graph[m][d]}"
             for m, d in sorted(_climbs() - set(KNOWN_CLIMBS))]
    assert not wrong, "\n".join(wrong)


def test_known_climbs_are_still_there():
    gone = sorted(set(KNOWN_CLIMBS) - _climbs())
    assert not gone, f"strike these from KNOWN_CLIMBS: {gone}"


def test_the_base_imports_no_qgcli_module_above_it():
    graph = _graph()
    assert not [d for d in graph["qgcli.jobs"]], "jobs imports the standard library only"


#: The family names (qgcli.families.registry.FAMILIES), as they were spelled before the registry.
FAMILY_NAMES = {"tf", "estimator", "torch", "quantize-dequantize", "batch-norm", "torchao", "quantize-and-dequantize",
                "mx", "nvfp4", "onnx"}
FAMILY_CONSTANTS = {"TF", "ESTIMATOR", "TORCH", "QUANTIZE_DEQUANTIZE", "QUANTIZE_AND_DEQUANTIZE", "BATCH_NORM",
                    "TORCHAO"}


def _family_comparisons(tree):
    """Lines where a family is told apart by name: a comparison with a ``family`` value (``job.family == ...``,
    ``family in (...)``) or with one of the old family constants, and a subscript keyed by ``family``."""
    def is_family(node):
        return (isinstance(node, ast.Attribute) and node.attr == "family") or \
            (isinstance(node, ast.Name) and (node.id in ("family", "fam") or node.id in FAMILY_CONSTANTS))

    def is_none_check(node):  # `layer.family is None`: whether a group has a family at all
        return all(isinstance(op, (ast.Is, ast.IsNot)) for op in node.ops) and \
            all(isinstance(c, ast.Constant) and c.value is None for c in node.comparators)

    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare) and any(is_family(n) for n in [node.left, *node.comparators]) \
                and not is_none_check(node):
            found.append(node.lineno)
        elif isinstance(node, ast.Subscript) and is_family(node.slice):
            found.append(node.lineno)
    return found


def test_only_the_families_tell_families_apart():
    """Commands, run files, executors and reports ask the registry (qgcli.families.registry) what a family does."""
    wrong = []
    for module, path in sorted(_modules().items()):
        if module == "qgcli.families" or module.startswith("qgcli.families."):
            continue
        with open(path, encoding="utf-8") as fh:
            tree = ast.parse(fh.read(), filename=path)
        wrong += [f"{module}:{line}" for line in _family_comparisons(tree)]
    assert not wrong, "compare family names outside qgcli.families (ask the registry):\n" + "\n".join(wrong)


def test_the_family_check_sees_a_comparison():
    tree = ast.parse("if job.family == 'tf':\n    pass\nx = {}[layer.family]\nok = kind == 'tf'\n"
                     "ok = layer.family is None\nif family in (TF, TORCH):\n    pass\n")
    assert _family_comparisons(tree) == [1, 3, 6]


def test_the_registry_lists_every_family_module():
    from qgcli.families import registry

    assert set(registry.FAMILIES) == FAMILY_NAMES
    for name in registry.FAMILIES:
        mod = registry.family(name)
        assert mod.NAME == name and mod.KIND in (registry.FAKE_QUANT, registry.BATCH_NORM)
        assert callable(mod.compute) and callable(mod.render) and callable(mod.mode)
        if hasattr(mod, "RUN_FILE_OPS"):
            assert None in mod.GROUP_OPERANDS and callable(mod.job_from_group)
