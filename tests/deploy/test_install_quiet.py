"""A clean install prints no warning a user would have to investigate: both pyproject files are
read by setuptools without deprecation warnings (the SDK wheel build shows none), and numpy is
installed before the extension build imports torch (torch warns "Failed to initialize NumPy"
otherwise)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
import tomllib
import warnings
from pathlib import Path

import pytest
from setuptools.config.pyprojecttoml import apply_configuration
from setuptools.dist import Distribution

ROOT = Path(__file__).resolve().parents[2]
PYPROJECTS = [ROOT / "pyproject.toml", ROOT / "clients" / "python" / "pyproject.toml"]


@pytest.mark.parametrize("pyproject", PYPROJECTS, ids=["shardlm", "shardlm-client"])
def test_pyproject_is_read_without_warnings(pyproject):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        dist = apply_configuration(Distribution(), pyproject)
    assert dist.metadata.license_expression == "Apache-2.0"
    requires = tomllib.loads(pyproject.read_text(encoding="utf-8"))["build-system"]["requires"]
    floor = next(r for r in requires if r.startswith("setuptools"))
    assert floor.startswith("setuptools>=") and int(floor.split(">=")[1].split()[0]) >= 77


def test_sdk_wheel_builds_quietly(tmp_path):
    source = tmp_path / "sdk"  # a copy: the build leaves build/ and *.egg-info beside its input
    shutil.copytree(ROOT / "clients" / "python", source,
                    ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(tmp_path / "dist"), str(source)],
        capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    assert not re.search(r"warning|deprecat", output, re.IGNORECASE), output
    assert list((tmp_path / "dist").glob("shardlm_client-*.whl"))


def _pip_installs(script: Path) -> list[list[str]]:
    """The argument lists of the script's `$PIP install` lines, in order, after any leading
    `NAME=value` environment assignments."""
    installs = []
    for line in script.read_text(encoding="utf-8").splitlines():
        words = shlex.split(line, comments=True)
        while words and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", words[0]):
            words = words[1:]
        if words[:2] == ["$PIP", "install"]:
            installs.append(words[1:])
    return installs


def test_numpy_is_installed_before_the_extension_build():
    installs = _pip_installs(ROOT / "scripts" / "install.sh")
    build = next(i for i, args in enumerate(installs) if "--no-build-isolation" in args)
    assert any("numpy" in args for args in installs[:build])
    root = tomllib.loads(PYPROJECTS[0].read_text(encoding="utf-8"))
    assert "numpy" in root["build-system"]["requires"]  # isolated builds get it too
