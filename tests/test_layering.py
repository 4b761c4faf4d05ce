"""The package direction torchside -> bridge, flaxside holds: checked in fresh interpreters."""

import subprocess
import sys

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
