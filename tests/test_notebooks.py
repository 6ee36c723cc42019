"""Every notebook in ``notebooks/`` runs top to bottom in a fresh kernel, without errors.

Each notebook is executed from a copy in a temporary directory (the committed notebook and
its outputs are never rewritten), with matplotlib's non-interactive backend. The kernel is
ipykernel's native ``python3`` kernel, which runs on this interpreter.
"""

from __future__ import annotations

import importlib.util
import json
import os
import pathlib
import shutil
import sys

import jax
import pytest
from _devices import COLLECTIVE_TIMEOUT

NOTEBOOKS = sorted((pathlib.Path(__file__).parent.parent / "notebooks").glob("*.ipynb"))
_spec = importlib.util.spec_from_file_location("sync_repository", NOTEBOOKS[0].parent / "sync_repository.py")
sync_repository = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sync_repository)
REPO = sync_repository.repository()  # pyproject.toml's [project.urls] Repository: OWNER/REPO
COLAB = f"https://colab.research.google.com/github/{REPO}/blob/main/notebooks/{{name}}"
# functree from the badge's repository (no package of that name is published); skipped
# where functree imports (here: PYTHONPATH or the installed package)
INSTALL = ("import functree", "except ImportError", f"%pip install -q git+https://github.com/{REPO}\n")
DEVICE_PINS = ("jax_platform", "JAX_PLATFORM", "CUDA_VISIBLE_DEVICES", 'jax.devices("cpu")')
# Executed cells must not print warnings (tqdm bars also write to stderr, so only these).
WARNING_MARKERS = ("Warning:", "WARNING:")


def _cells(nb: dict, kind: str) -> list[str]:
    return ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == kind]


def _read(path: pathlib.Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8"))


def test_notebooks_exist():
    names = {p.stem[:2] for p in NOTEBOOKS}
    assert {"01", "02", "03", "04", "05", "06", "07", "08"} <= names, sorted(p.name for p in NOTEBOOKS)


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_has_colab_badge_and_install_cell(path):
    nb = _read(path)
    markdown = _cells(nb, "markdown")
    assert markdown and COLAB.format(name=path.name) in markdown[0], "first cell: Colab badge"
    code = _cells(nb, "code")
    assert code and all(s in code[0] + "\n" for s in INSTALL), "first code cell: install functree"
    assert not sync_repository.sync(path, REPO, write=False), "run: python notebooks/sync_repository.py"
    pinned = [s for s in code if any(p in s for p in DEVICE_PINS)]
    assert not pinned, f"the same notebook must run on CPU, GPU and TPU runtimes: {pinned}"


def test_sync_repository_rewrites_badge_and_install_cell_for_another_repository(tmp_path):
    copy = tmp_path / NOTEBOOKS[0].name
    shutil.copy(NOTEBOOKS[0], copy)
    assert sync_repository.sync(copy, "someone/fork")
    nb = _read(copy)
    assert f"colab.research.google.com/github/someone/fork/blob/main/notebooks/{copy.name}" in _cells(nb, "markdown")[0]
    assert _cells(nb, "code")[0].endswith("%pip install -q git+https://github.com/someone/fork")
    assert not sync_repository.sync(copy, "someone/fork")  # idempotent
    assert _cells(nb, "code")[1:] == _cells(_read(NOTEBOOKS[0]), "code")[1:]  # nothing else changed


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_is_committed_with_outputs(path):
    nb = _read(path)
    code = [c for c in nb["cells"] if c["cell_type"] == "code"]
    assert all(c["execution_count"] is not None for c in code[1:]), "run it before committing"
    errors = [o for c in code for o in c["outputs"] if o["output_type"] == "error"]
    assert not errors, errors
    assert path.stat().st_size < 200_000, "keep figures small (figsize=(5, 3))"


@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_executes(path, tmp_path, monkeypatch):
    nbclient = pytest.importorskip("nbclient")  # the test extra's: a kernel runs each notebook
    nbformat = pytest.importorskip("nbformat")
    pytest.importorskip("ipykernel")
    monkeypatch.setenv("MPLBACKEND", "Agg")
    # The kernel sees the devices a user's would: no device count from here (notebooks 07
    # and 08 ask for their own). Only XLA's collective timeout is raised, for this loaded
    # machine (see tests/_devices.py), after the inherited flags.
    monkeypatch.setenv("XLA_FLAGS", f"{os.environ.get('XLA_FLAGS', '')} {COLLECTIVE_TIMEOUT}".strip())
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.insert(1, nbformat.v4.new_code_cell("import sys; print(sys.executable)"))
    client = nbclient.NotebookClient(
        nb,
        timeout=600,
        kernel_name="python3",
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
    assert nb.cells[1].outputs[0]["text"].strip() == sys.executable
    if path.stem[:2] in ("07", "08") and jax.default_backend() == "cpu":  # the notebook's own 8
        assert nb.cells[3].outputs[0]["text"].startswith("8 devices: cpu"), nb.cells[3].outputs
    stderr = [
        line
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.outputs
        if o.get("name") == "stderr"
        for line in o["text"].splitlines()
        if any(m in line for m in WARNING_MARKERS)
    ]
    assert not stderr, "\n".join(stderr)
