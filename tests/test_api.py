"""Every public name has a docstring example, and every ``>>>`` example runs (docs/api.md).

The public names are the classes and functions in the ``__all__`` of ``torchside``,
``torchside.parity``, ``bridge`` and ``flaxside``. Each docstring needs an ``Example:``
section with a ``>>>`` line; a name whose example needs a launcher (torchrun) or is a whole
file is listed in ``LITERAL_EXAMPLES`` with the reason, and may show it as an indented
literal block instead. Constants cannot carry a docstring: ``CONSTANTS`` names the module
whose docstring documents each one with an example.

The examples run under ``doctest`` (``NORMALIZE_WHITESPACE | ELLIPSIS``) with ``torch``,
``jax``, ``jnp``, ``np``, ``nn`` (``flax.linen``) and ``nnx`` in scope, besides the namespace
of the module that defines the name; methods' examples run with their class's. The
examples in docs/api.md run too.
"""

import doctest
import importlib
import inspect
import pathlib
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

PACKAGES = ("torchside", "torchside.parity", "bridge", "flaxside")
API_MD = pathlib.Path(__file__).resolve().parent.parent / "docs" / "api.md"

# Names whose example is an indented literal block rather than ``>>>`` lines, and why.
LITERAL_EXAMPLES = {
    "torchside.shard": "runs in every process of a torchrun launch; a doctest has one process",
    "torchside.parity.assert_matches": "a whole test file, run as such in "
    "tests/parity/test_assert_matches.py",
}

# Constants (no docstring of their own) -> the module whose docstring shows them in use.
CONSTANTS = {
    "torchside.parity.TOLERANCES": "torchside.parity",
    "bridge.EXCHANGE_MODES": "bridge",
}

# Names whose docstring has no example yet, with why (strict xfail: delete the entry once
# it has one). Empty: every public name has one.
MISSING_EXAMPLES: dict[str, str] = {}

# Examples that fail under doctest, with why; same rule as above.
BROKEN_EXAMPLES: dict[str, str] = {}

FLAGS = doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS
GLOBALS = {"torch": torch, "jax": jax, "jnp": jnp, "np": np, "nn": nn, "nnx": nnx}


def _public():
    """``{"package.name": object}`` for every name in the packages' ``__all__``."""
    out = {}
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            out[f"{package}.{name}"] = getattr(module, name)
    return out


PUBLIC = _public()
DOCUMENTED = {k: v for k, v in PUBLIC.items() if inspect.isclass(v) or callable(v)}
OTHER = {k: v for k, v in PUBLIC.items() if k not in DOCUMENTED}


def _params(names, marked):
    return [pytest.param(n, id=n, marks=pytest.mark.xfail(strict=True, reason=marked[n]))
            if n in marked else pytest.param(n, id=n) for n in sorted(names)]


def _example_section(doc: str) -> str | None:
    """The text of the ``Example:`` (or ``Examples:``) section, up to the next section."""
    match = re.search(r"^( *)Examples?:[ \t]*\n(.*?)(?=^\1\S|\Z)", doc, re.M | re.S)
    return match.group(2) if match else None


def _doctests(obj, name: str) -> list[doctest.DocTest]:
    """The ``>>>`` examples of ``obj`` and, for a class, of its methods, those it inherits
    from a base class of these packages (a mixin such as ``FlaxVariables``) included."""
    target = inspect.unwrap(obj) if not inspect.isclass(obj) else obj
    module = inspect.getmodule(target)
    globs = {**GLOBALS, **vars(module)}
    finder = doctest.DocTestFinder(recurse=inspect.isclass(obj))
    tests = finder.find(obj, name, module=module, globs=globs)
    if inspect.isclass(obj):
        for base in obj.__mro__[1:]:
            if base.__module__.split(".")[0] in {p.split(".")[0] for p in PACKAGES}:
                base_module = inspect.getmodule(base)
                tests += finder.find(base, f"{name}({base.__name__})", module=base_module,
                                     globs={**GLOBALS, **vars(base_module), **vars(module)})
    return [t for t in tests if t.examples]


def _run(tests: list[doctest.DocTest], name: str) -> None:
    report: list[str] = []
    runner = doctest.DocTestRunner(optionflags=FLAGS)
    for test in tests:
        runner.run(test, out=report.append)
    if runner.failures:
        pytest.fail(f"{name}: {runner.failures} example(s) failed\n" + "".join(report),
                    pytrace=False)


def test_every_public_name_is_known():
    """A new constant in ``__all__`` goes into ``CONSTANTS``, a new subpackage into PACKAGES."""
    unknown = sorted(name for name, value in OTHER.items() if name not in CONSTANTS
                     and not (inspect.ismodule(value) and value.__name__ in PACKAGES))
    assert not unknown, (f"public names that are neither classes, functions, documented "
                         f"constants nor checked subpackages: {unknown}")
    listed = set(LITERAL_EXAMPLES) | set(MISSING_EXAMPLES) | set(BROKEN_EXAMPLES)
    stale = sorted(listed - set(DOCUMENTED))
    assert not stale, f"listed here but not public: {stale}"


@pytest.mark.parametrize("name", _params(DOCUMENTED, MISSING_EXAMPLES))
def test_docstring_has_example(name):
    doc = inspect.getdoc(DOCUMENTED[name]) or ""
    section = _example_section(doc)
    assert section is not None, f"{name}: the docstring has no 'Example:' section"
    if name in LITERAL_EXAMPLES:
        assert re.search(r"::[ \t]*\n(?:[ \t]*\n)*[ \t]+\S", section), (
            f"{name}: its Example section shows no indented literal block ('::')")
    else:
        assert re.search(r"^\s*>>> ", section, re.M), (
            f"{name}: its Example section has no '>>>' line; runnable examples are the rule "
            f"(LITERAL_EXAMPLES lists the exceptions with their reasons)")


@pytest.mark.parametrize("name", _params(CONSTANTS, {}))
def test_constant_is_documented(name):
    module = importlib.import_module(CONSTANTS[name])
    doc = inspect.getdoc(module) or ""
    section = _example_section(doc)
    short = name.rpartition(".")[2]
    assert section is not None and short in section and ">>> " in section, (
        f"{name}: the docstring of {CONSTANTS[name]} has no Example section using {short}")


@pytest.mark.parametrize("name", _params(DOCUMENTED, BROKEN_EXAMPLES))
def test_examples_run(name):
    _run(_doctests(DOCUMENTED[name], name), name)


@pytest.mark.parametrize("module_name", sorted(set(CONSTANTS.values())))
def test_module_examples_run(module_name):
    module = importlib.import_module(module_name)
    _run(_doctests(module, module_name), module_name)


def test_api_md_examples_run():
    text = re.sub(r"^```.*$", "", API_MD.read_text(), flags=re.M)  # fences are not output
    test = doctest.DocTestParser().get_doctest(text, dict(GLOBALS), "docs/api.md",
                                               str(API_MD), 0)
    assert test.examples, "docs/api.md shows no '>>>' example"
    _run([test], "docs/api.md")

