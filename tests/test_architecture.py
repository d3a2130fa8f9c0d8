"""The package's shape, measured from its source: the dependency rule, no import cycles, small
modules and classes, HTML only in the views, every instance attribute first set in __init__.

Imports are read from the AST, function-level ones included: a cycle held apart only by an import
inside a function is still a cycle, and there is none. The report's views delegate to render
(report -> render); render never imports the report.
"""

from __future__ import annotations

import ast
import pathlib
import re

import numguard_nb

PACKAGE = pathlib.Path(numguard_nb.__file__).parent
MAX_MODULE_LINES = 750
MAX_CLASS_LINES = 450

# Leaves import nothing of the package but other leaves.
LEAVES = {"errors", "_schema", "_tree", "stats", "row_sink", "numerics", "rerun", "_util", "_version"}
# What each part may import (module names relative to the package; "render" means render.*).
ALLOWED = {
    "render": LEAVES | {"render"},  # a view reads the report's objects, never imports them
    "report": LEAVES | {"report", "render"},  # its view methods delegate to render
    "explain": LEAVES | {"report", "hint_facts"},  # hints read a report, nothing of the engine
    "hint_facts": LEAVES | {"report"},
    # The tools the engine uses stand below it: none of them imports the guard.
    "ops": LEAVES | {"ops"},
    "replay": LEAVES | {"replay", "render"},
    "distributed": LEAVES | {"distributed"},
    "doctor": LEAVES | {"doctor", "render"},
}
# The notebook and integration layers sit on top: nothing below imports them.
TOP = {"magics", "magic_args", "session", "integrations", "compat", "demo"}
IPYTHON_ALLOWED = {"magics", "magic_args", "render.widget"}
_HTML = re.compile(r"<(div|span|details|summary|table|tr|td|th|pre|code|style|svg|b|p|ul|li)[\s>/]")


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts), path


MODULES = dict(_modules())


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py" if name in MODULES else False


def _resolve(module: str, node: ast.ImportFrom) -> list:
    """Package modules a `from ... import ...` statement imports."""
    if node.level == 0:
        if not (node.module or "").startswith("numguard_nb"):
            return []
        base = node.module[len("numguard_nb"):].lstrip(".")
    else:
        here = module.split(".") if module else []
        if not _is_package(module):
            here = here[:-1]
        up = node.level - 1
        here = here[: len(here) - up] if up else here
        base = ".".join(here + ([node.module] if node.module else []))
    found = []
    for alias in node.names:
        candidate = f"{base}.{alias.name}" if base else alias.name
        found.append(candidate if candidate in MODULES else base)
    return found


def imports_of(name: str) -> set:
    tree = ast.parse(MODULES[name].read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            found.update(_resolve(name, node))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("numguard_nb"):
                    found.add(alias.name[len("numguard_nb"):].lstrip("."))
    found.discard(name)
    return {m for m in found if m in MODULES}


GRAPH = {name: imports_of(name) for name in MODULES}


def _top(name: str) -> str:
    return name.split(".")[0]


def test_no_import_cycles():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for dep in GRAPH.get(node, ()):
            if dep not in index:
                visit(dep)
                low[node] = min(low[node], low[dep])
            elif dep in on_stack:
                low[node] = min(low[node], index[dep])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in GRAPH:
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


def test_dependency_rule():
    broken = []
    for name, deps in GRAPH.items():
        part = _top(name)
        for dep in deps:
            if name in LEAVES and dep not in LEAVES:
                broken.append(f"leaf {name} imports {dep}")
            allowed = ALLOWED.get(part)
            if allowed is not None and _top(dep) not in allowed and dep not in allowed:
                broken.append(f"{name} imports {dep}")
            if _top(dep) in TOP and part not in TOP and name != "":
                broken.append(f"{name} imports the top layer's {dep}")
    assert not broken, broken


def test_ipython_only_in_the_notebook_layer():
    offenders = []
    for name, path in MODULES.items():
        if name in IPYTHON_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            modules = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(m.split(".")[0] in ("IPython", "ipywidgets") for m in modules):
                offenders.append(name)
    assert not offenders, offenders


def test_modules_and_classes_stay_small():
    big = []
    for name, path in MODULES.items():
        text = path.read_text()
        lines = text.count("\n")
        if lines > MAX_MODULE_LINES:
            big.append(f"module {name}: {lines} lines")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = node.end_lineno - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    big.append(f"class {name}.{node.name}: {size} lines")
    assert not big, big


def test_html_is_written_only_in_render():
    offenders = []
    for name, path in MODULES.items():
        if _top(name) == "render":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _HTML.search(node.value):
                offenders.append(f"{name}:{node.lineno}")
            if isinstance(node, ast.Import) and any(a.name == "html" for a in node.names):
                offenders.append(f"{name}:{node.lineno} imports html")
    assert not offenders, offenders


def _self_assignments(function) -> set:
    names = set()
    for node in ast.walk(function):
        targets = []
        if isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        for target in targets:
            for sub in ast.walk(target):
                if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) \
                        and sub.value.id == "self" and isinstance(sub.ctx, ast.Store):
                    names.add(sub.attr)
    return names


def _self_calls(function) -> set:
    return {node.func.attr for node in ast.walk(function)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "self"}


def test_every_instance_attribute_is_first_set_in_init():
    late = []
    for name, path in MODULES.items():
        for cls in ast.walk(ast.parse(path.read_text())):
            if not isinstance(cls, ast.ClassDef):
                continue
            methods = {n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
            declared = set()
            for node in cls.body:  # dataclass fields, __slots__-style declarations, properties
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    declared.add(node.target.id)
                elif isinstance(node, ast.Assign):
                    declared.update(t.id for t in node.targets if isinstance(t, ast.Name))
            declared.update(n for n, f in methods.items()
                            if any(isinstance(d, (ast.Name, ast.Attribute)) and
                                   getattr(d, "id", getattr(d, "attr", "")) in ("property", "setter")
                                   for d in f.decorator_list))
            if "__init__" not in methods:
                initialised = declared
            else:
                seen, todo, initialised = set(), ["__init__"], set(declared)
                while todo:
                    method = todo.pop()
                    if method in seen or method not in methods:
                        continue
                    seen.add(method)
                    initialised |= _self_assignments(methods[method])
                    todo.extend(_self_calls(methods[method]))
            for method_name, method in methods.items():
                if method_name == "__init__":
                    continue
                for attr in sorted(_self_assignments(method) - initialised):
                    late.append(f"{name}.{cls.name}.{method_name} sets self.{attr}")
    assert not late, late


def test_each_module_imports_alone():
    """Every module imports as the first of the package to load (a fresh `numguard_nb` each
    time): no module works only because another one was imported before it."""
    import subprocess
    import sys

    def script(names: list) -> str:
        return (
            "import importlib, sys, traceback\n"
            "failed = []\n"
            f"for name in {names!r}:\n"
            "    for loaded in [m for m in sys.modules if m == 'numguard_nb' or m.startswith('numguard_nb.')]:\n"
            "        del sys.modules[loaded]\n"
            "    try:\n"
            "        importlib.import_module('numguard_nb.' + name if name else 'numguard_nb')\n"
            "    except Exception as error:\n"
            "        failed.append(f'{name}: {type(error).__name__}: {error}')\n"
            "print('\\n'.join(failed))\n")

    names = sorted(MODULES)
    # two processes, each half of the modules (each import starts from a fresh package)
    runs = [subprocess.Popen([sys.executable, "-c", script(names[half::2])], cwd=PACKAGE.parent,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for half in (0, 1)]
    for run in runs:
        stdout, stderr = run.communicate(timeout=300)
        assert run.returncode == 0, stderr[-2000:]
        assert not stdout.strip(), stdout


def test_no_object_is_made_through_type_of_another():
    """`type(x)(...)` builds an object of a class its module never imports: a dependency the
    import checks above cannot see (the sentinel's re-run gets its full guard from `Guard.twin`)."""
    found = []
    for name, path in MODULES.items():
        if name == "_tree":  # containers rebuilt as their own type (a namedtuple, a dict subclass)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Call) \
                    and isinstance(node.func.func, ast.Name) and node.func.func.id == "type" \
                    and not (isinstance(node.func.args[0], ast.Name)
                             and node.func.args[0].id == "self"):  # a class making its twin
                found.append(f"{name}:{node.lineno}")
    assert not found, found


# Host reads outside numerics: the demo prints its loss; render and guard.history work on host
# arrays (numpy); the doctor copies the user's batch and model to the host for its CPU replay.
HOST_READS_ALLOWED = {"numerics", "stats", "demo", "render.history", "guard.history",
                      "doctor.samples", "doctor.run"}
_READ_METHODS = {"item", "tolist", "cpu", "numpy"}
_REDUCTIONS = {"any", "all", "max", "min", "amax", "amin", "sum", "item"}


def test_device_values_are_read_on_the_host_only_in_numerics():
    """`.item()`, `.tolist()`, `.cpu()`, `.numpy()` and `bool/float/int(t.any() ...)` drain a
    GPU's queue: the engine reads through `numerics.read` (counted) and `DeferredRead`."""
    found = []
    for name, path in MODULES.items():
        if name in HOST_READS_ALLOWED:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr in _READ_METHODS and not node.args:
                found.append(f"{name}:{node.lineno} .{func.attr}()")
            elif isinstance(func, ast.Name) and func.id in ("bool", "float", "int") \
                    and node.args and isinstance(node.args[0], ast.Call) \
                    and isinstance(node.args[0].func, ast.Attribute) \
                    and node.args[0].func.attr in _REDUCTIONS:
                found.append(f"{name}:{node.lineno} {func.id}(.{node.args[0].func.attr}())")
    assert not found, found


# Private attributes of a class that another module reaches: the documented exceptions.
PRIVATE_REACHES_ALLOWED = {
    # guard.hooks is Guard's hook machinery: the callbacks it calls back, and the guard's
    # per-pass settings its hot path reads
    ("guard.hooks", "_on_grad"), ("guard.hooks", "_on_leaf_grad"),
    ("guard.hooks", "_on_param_grad"), ("guard.hooks", "_first_calls"),
    ("guard.hooks", "_nonzero_min"), ("guard.hooks", "_sign_hints"),
    # IPython's display and traceback protocols
    ("guard.history", "_repr_html_"), ("magics", "_render_traceback_"),
}


def _private_names_by_module() -> dict:
    """module -> the private attribute names its classes set on self or define."""
    names = {}
    for name, path in MODULES.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ClassDef):
                continue
            for item in ast.walk(node):
                if isinstance(item, ast.Attribute) and isinstance(item.ctx, ast.Store) \
                        and isinstance(item.value, ast.Name) and item.value.id == "self":
                    found.add(item.attr)
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    found.add(item.name)
        names[name] = {n for n in found if n.startswith("_") and not n.startswith("__")}
    return names


def test_no_module_reaches_into_another_module_s_private_attributes():
    """A module uses another's objects through their public names (a private name of its own
    classes, or torch's, is its own business)."""
    import torch

    by_module = _private_names_by_module()
    ours = set().union(*by_module.values())
    torch_names = set(dir(torch.nn.Module())) | set(dir(torch.Tensor)) | set(
        dir(torch.optim.SGD([torch.zeros(1, requires_grad=True)])))
    found = []
    for name, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Attribute) or node.attr not in ours \
                    or node.attr in by_module[name] or node.attr in torch_names:
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            if (name, node.attr) not in PRIVATE_REACHES_ALLOWED:
                found.append(f"{name}:{node.lineno} {ast.unparse(node)}")
    assert not found, found
