"""Packaging: ranges in pyproject.toml, exact versions in constraints.txt, CI = the README's command,
LICENSE, and a wheel that builds and works when installed (py.typed and the corpus included)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[1]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _constraints() -> dict[str, str]:
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"constraints.txt: {line!r} is not name==version"
            pins[name.strip().lower().replace("_", "-")] = version.strip()
    return pins


def _requirements(extra: str | None = None) -> list[Requirement]:
    project = _pyproject()["project"]
    texts = project["dependencies"] if extra is None else project["optional-dependencies"][extra]
    return [Requirement(t) for t in texts]


def test_ci_runs_the_readme_test_command_word_for_word():
    readme = (ROOT / "README.md").read_text()
    block = readme.split("Run the whole test suite", 1)[1].split("```bash\n", 1)[1].split("\n```", 1)[0]
    assert block.startswith("python3 -m venv .venv") and "-c constraints.txt" in block
    assert "ruff check" in block
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert block in ci


def test_runtime_dependencies_are_lower_bounds_torch_included():
    for req in _requirements():
        ops = {s.operator for s in req.specifier}
        assert ops and ops <= {">=", "!="}, f"{req}: a lower bound only, so copus joins other stacks"
    (torch,) = [r for r in _requirements() if r.name == "torch"]
    assert str(torch.specifier) == ">=2.13" and _constraints()["torch"] == "2.13.0"


def _fake_torch(root: Path, version: str) -> Path:
    """A folder holding only an installed-distribution record of torch VERSION (what pip reads to
    decide whether torch is already there); on PYTHONPATH it comes before site-packages."""
    info = root / f"torch-{version}" / f"torch-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
    (info / "RECORD").write_text("")
    return info.parent


@pytest.mark.parametrize("installed,kept", [("2.99.0", True), ("2.12.0", False)])
def test_pip_install_keeps_an_installed_torch_2_13_or_newer(tmp_path, installed, kept):
    """`pip install copus` into an environment whose torch is TORCH: offline (--no-index, no
    find-links, no pip config), dry run. A newer torch satisfies the range, so pip installs copus
    alone; an older one would have to be replaced (offline: pip cannot, and says so)."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PYTHONPATH=str(_fake_torch(tmp_path, installed)))
    report = tmp_path / "report.json"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--no-index",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "--quiet",
            "--report",
            str(report),
            str(tree),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if kept:
        assert out.returncode == 0, out.stderr[-2000:]
        would = [i["metadata"]["name"] for i in json.loads(report.read_text())["install"]]
        assert would == ["copus"], would
    else:
        assert out.returncode != 0 and "torch>=2.13" in out.stderr, out.stderr[-2000:]


@pytest.mark.parametrize("extra", [None, "dev", "export", "parquet"])
def test_constraints_pin_every_requirement_inside_its_range(extra):
    pins = _constraints()
    for req in _requirements(extra):
        name = req.name.lower().replace("_", "-")
        assert name in pins, f"constraints.txt lacks {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} not in {req}"


def test_license_is_the_apache_2_text():
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:4] == ["Apache", "License", "Version", "2.0,"]
    assert "TERMS AND CONDITIONS FOR USE, REPRODUCTION, AND DISTRIBUTION" in text
    assert _pyproject()["project"]["license"] == {"text": "Apache-2.0"}
    assert (ROOT / "src" / "copus" / "py.typed").is_file()


@pytest.mark.slow
def test_wheel_builds_installs_and_runs(tmp_path):
    """Build the wheel offline from a copy of the tree, install it (no deps: this environment's
    serve), and run `copus plan` from the installed copy, not from src/."""
    tree = tmp_path / "tree"
    shutil.copytree(ROOT / "src", tree / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, tree / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        pip + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "dist"), str(tree)],
        check=True,
        timeout=300,
    )
    (wheel,) = (tmp_path / "dist").glob("copus-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "copus/py.typed" in names
    assert "copus/data/shakespeare_plays.txt.gz" in names
    assert any(n.endswith(".dist-info/licenses/LICENSE") or n.endswith(".dist-info/LICENSE") for n in names)
    site = tmp_path / "site"
    subprocess.run(pip + ["install", "--no-deps", "--target", str(site), str(wheel)], check=True, timeout=300)
    env = {"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}
    code = (
        "import copus, importlib.resources as r, sys; from copus.cli import main; "
        "print(copus.__file__); assert (r.files('copus') / 'py.typed').is_file(); "
        "sys.exit(main(['plan', '--model', 'tiny', '--gpus', '2', '--top', '1']))"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0].startswith(str(site))
