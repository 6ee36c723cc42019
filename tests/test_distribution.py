"""The package as distributed: one version, a changelog entry for it, CI's wheel check."""

import pathlib
import re
import tomllib

import functree as ft

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def test_version_is_one_pep440_string_that_pyproject_reads():
    assert re.fullmatch(r"\d+\.\d+\.\d+((a|b|rc)\d+)?(\.dev\d+)?", ft.__version__), ft.__version__
    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "functree.__version__"}


def test_changelog_has_unreleased_and_the_current_version():
    headings = re.findall(r"^## (\S+)", (ROOT / "CHANGELOG.md").read_text(encoding="utf-8"), re.M)
    assert headings[0] == "Unreleased" and ft.__version__ in headings, headings


def test_ci_builds_the_wheel_and_runs_the_demo_outside_the_checkout():
    run, wheel = (ROOT / ".ci" / name for name in ("run", "wheel"))
    assert ".ci/wheel" in run.read_text(encoding="utf-8").splitlines()
    script = wheel.read_text(encoding="utf-8")
    assert "pip wheel" in script and "cd \"$work\"" in script and "-m functree" in script
    assert wheel.stat().st_mode & 0o111, "chmod +x .ci/wheel"
