"""The layering holds: package direction, no import circle, derivatives above first order.

The direction torchside -> bridge, flaxside is checked in fresh interpreters; import
circles (function-level imports included) and the first-order pipeline's independence
from the layers above it are read from the source.
"""

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest


@pytest.mark.parametrize(
    ("package", "forbidden"),
    [("flaxside", "torch"), ("bridge", "flax")],
    ids=["flaxside-without-torch", "bridge-without-flax"],
)
def test_package_does_not_import(package, forbidden):
    code = f"import sys, {package}; print({forbidden!r} in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr



_LAZY = """
import sys, torch, jax.numpy as jnp, torchside
layer = ("torchside.edges._higher", "torchside.edges._given", "torchside.edges._derived")
loaded = lambda: [m for m in layer if m in sys.modules]
before = loaded()
f = torchside.jax_function(lambda x: jnp.sum(jnp.sin(x) ** 3))
x = torch.linspace(0.1, 1.0, 5, requires_grad=True)
f(x).backward()
first = loaded()
(g,) = torch.autograd.grad(f(x), x, create_graph=True)
print(before, first, loaded())
"""


def test_the_derivative_layer_loads_when_a_derivative_is_asked_for():
    """``import torchside`` and first-order training leave the layer of derivatives
    unloaded; a backward with ``create_graph=True`` loads it (docs/design.md "Layers").
    Mutation: ``edges/_edges.py`` importing ``_higher`` at its top again."""
    out = subprocess.run([sys.executable, "-c", _LAZY], capture_output=True, text=True,
                         check=True)
    layer = "['torchside.edges._higher', 'torchside.edges._given', 'torchside.edges._derived']"
    assert out.stdout.strip() == f"[] [] {layer}", out.stdout + out.stderr

# -- import circles and the layer of derivatives ------------------------------------------------
ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("bridge", "flaxside", "torchside")
# The first-order pipeline (NOTE [Call path] in torchside/call/_call.py) and what sits above it:
# the torch.compile edge and the layer of derivatives, reached only through the Edges an
# owner hands its Caller.
FIRST_ORDER = ("torchside.call._resolve", "torchside.call._call", "torchside.call._eager",
               "torchside.call._entry", "torchside.call._build", "torchside.call._values",
               "torchside.call._routes")
ABOVE = ("torchside.edges._compile", "torchside.edges._higher", "torchside.edges._derived",
         "torchside.edges._given", "torchside.edges._edges")


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, known: set) -> set:
    """The library modules ``path`` imports, at any level (function bodies included).

    ``from package import name`` counts as importing the submodule ``package.name`` where
    one exists; a top-level package itself is left out (its ``__init__`` only re-exports).
    """
    me = _module(path)
    package = me if path.name == "__init__.py" else me.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(filter(None, [package.rsplit(".", node.level - 1)[0], base]))
            names = [base, *(f"{base}.{a.name}" for a in node.names)]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != me and "." in name:
                found.add(name)
    return found


def _graph() -> dict:
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    known = {_module(p) for p in files}
    return {_module(p): _imports(p, known) for p in files}


def _reach(graph: dict, start: str) -> set:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


def test_no_import_circle_among_the_packages():
    graph = _graph()
    circles = sorted(m for m in graph if m in _reach(graph, m))
    assert not circles, f"modules that import themselves through others: {circles}"


def test_the_first_order_pipeline_does_not_import_what_sits_above_it():
    graph = _graph()
    for module in FIRST_ORDER:
        above = _reach(graph, module) & set(ABOVE)
        assert not above, f"{module} imports {sorted(above)}"


def test_the_checks_above_can_fail():
    """The two checks above, on made-up graphs: a circle and an upward import are found."""
    graph = {"a.x": {"a.y"}, "a.y": {"a.z"}, "a.z": {"a.x"}, "a.w": set()}
    assert sorted(m for m in graph if m in _reach(graph, m)) == ["a.x", "a.y", "a.z"]
    assert "a.z" in _reach(graph, "a.x") and not _reach(graph, "a.w")


# -- folders are layers -------------------------------------------------------------------------
# Each package's folders, lowest first: a module imports only from its own folder and the
# folders below it. A module outside every folder (``torchside._errors``, the wording of
# every error) is below them all; the package's own front files (``__init__``,
# ``internal``, ``parity``) re-export and may import any folder.
LAYERS = {"flaxside": ("jaxprs", "program", "mesh", "adapters", "stacks", "derivatives"),
          "torchside": ("call", "edges", "owners", "integrations")}
FRONT = {"flaxside", "flaxside.internal", "torchside"}


def _rank(module: str):
    """``(package, position of the module's folder)``, -1 for a module below every folder."""
    package, _, rest = module.partition(".")
    folder = rest.partition(".")[0]
    layers = LAYERS.get(package, ())
    return package, layers.index(folder) if folder in layers else -1


def _upward(graph: dict) -> list:
    """Every import of a module from a folder above its own, as ``(module, imported)``."""
    found = []
    for module, imported in graph.items():
        if module in FRONT or module.startswith("torchside.parity"):
            continue
        package, mine = _rank(module)
        for other in imported:
            theirs_package, theirs = _rank(other)
            if theirs_package == package and theirs > mine:
                found.append((module, other))
    return sorted(found)


def test_each_folder_imports_only_the_folders_below_it():
    """flaxside: jaxprs < program < mesh < adapters < stacks < derivatives, so a ``Program``
    never loads the mesh code; torchside: call < edges < owners < integrations, so the
    first-order call never loads the derivative layer or Opacus."""
    assert not _upward(_graph())


def test_an_upward_import_is_found():
    """The check above on made-up graphs: program importing mesh (OnMesh put back into
    ``program/_placement.py``), and ``_errors`` importing a folder, are each found."""
    assert _upward({"flaxside.program._placement": {"flaxside.mesh._on_mesh"}}) == [
        ("flaxside.program._placement", "flaxside.mesh._on_mesh")]
    assert _upward({"torchside._errors": {"torchside.call._values"}})
    assert not _upward({"flaxside.mesh._on_mesh": {"flaxside.program._placement"}})



def _private_imports(files) -> list:
    """``(module, name)`` for each private name a library file imports from another module
    (a private module itself, ``from torchside import _errors``, is not one)."""
    known = {_module(p) for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (isinstance(node, ast.ImportFrom) and node.module
                    and node.module.split(".")[0] in PACKAGES):
                found += [(node.module, a.name) for a in node.names
                          if a.name.startswith("_") and f"{node.module}.{a.name}" not in known]
    return found


def test_no_private_name_crosses_a_module():
    """What another module uses is public in the module that defines it (``executes``,
    ``Program.pull``...). Mutation: ``from torchside.edges._derived import _executes``."""
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")]
    assert not _private_imports(files)
    made_up = ROOT / "tests" / "support" / "private_import_case.py"
    assert _private_imports([made_up]) == [("torchside.edges._derived", "_executes")]

# -- one interpreter (NOTE [One interpreter] in flaxside/jaxprs/_interpret.py) -------------------
INTERPRETER = {"flaxside/jaxprs/_interpret.py", "flaxside/jaxprs/_walk.py"}


def _reading(pattern: str) -> set:
    """The library files (as paths from the root) whose code matches ``pattern``."""
    found = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            if re.search(pattern, path.read_text()):
                found.add(path.relative_to(ROOT).as_posix())
    return found


def test_only_the_interpreter_reads_and_binds_equations():
    """Equations are read (``.eqns``) and bound (``primitive.bind``) in ``flaxside/jaxprs``
    alone: every other walk goes through ``walk``, every evaluation through ``evaluate``
    with a meaning's rules. Mutation: ``flaxside/derivatives/_given.py``'s own ``_evaluate``
    loop put back."""
    assert _reading(r"\.eqns\b") <= INTERPRETER, _reading(r"\.eqns\b") - INTERPRETER
    assert _reading(r"primitive\.bind\(") == {"flaxside/jaxprs/_interpret.py"}
    assert len(_reading(r"\.eqns\b")) <= 2


# -- one definition per NOTE, each in docs/design.md's index ---------------------------------------
def _note_definitions() -> dict:
    """``{name: [files]}`` of every ``NOTE [name].`` that opens a paragraph in the library."""
    found = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            for m in re.finditer(r"^\s*(?:# )?NOTE \[([^\]]+)\]\. ", path.read_text(), re.M):
                found.setdefault(m.group(1), []).append(path.relative_to(ROOT).as_posix())
    return found


def test_each_note_is_defined_once_and_indexed_where_it_is():
    """A NOTE defined twice drifts apart (two texts of ``[Higher order]`` and ``[Given
    residuals]`` did); the index in docs/design.md names each NOTE's one file, and every
    NOTE the library cites is defined. Mutation: ``flaxside/derivatives/_given.py`` opening with
    ``NOTE [Given residuals].`` again."""
    found = _note_definitions()
    assert not {n: f for n, f in found.items() if len(f) > 1}
    index = dict(re.findall(r"^\| `NOTE \[([^\]]+)\]` \| `([^`]+)`",
                            (ROOT / "docs" / "design.md").read_text(), re.M))
    assert index == {n: f[0] for n, f in found.items()}
    cited = set()
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            cited.update(re.sub(r"\s+(?:# )?", " ", m.group(1))
                         for m in re.finditer(r"NOTE\s+\[([^\]]+)\]", path.read_text()))
    assert cited <= set(found), cited - set(found)


_DYNAMO = """
import sys, torch, flax.linen as nn, torchside
loaded = lambda: [m for m in ("torch._dynamo", "torchside.edges._traced") if m in sys.modules]
before = loaded()
m = torchside.FlaxModule(nn.Dense(3), torch.zeros(2, 4))
m(torch.randn(2, 4)).sum().backward()
first = loaded()
compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
x = torch.randn(2, 4, requires_grad=True)
torch.testing.assert_close(compiled(x), m(x), rtol=0, atol=0)
print(before, first, loaded())
"""


def test_dynamo_loads_when_a_call_is_first_compiled():
    """``import torchside`` and eager training leave Dynamo unloaded (its cost:
    docs/benchmarks.md, the call_costs block); the first compiled call loads the code
    Dynamo traces, and a fullgraph compile still gives the eager result. Mutation:
    ``edges/_edges.py`` importing ``_traced`` at its top again."""
    out = subprocess.run([sys.executable, "-c", _DYNAMO], capture_output=True, text=True,
                         check=True)
    loaded = "['torch._dynamo', 'torchside.edges._traced']"
    assert out.stdout.strip() == f"[] [] {loaded}", out.stdout + out.stderr
