"""The suite's XLA flags (conftest.py): each appended only for the jaxlib releases that know it.

XLA aborts every process whose XLA_FLAGS name a flag it does not know ("Unknown flag in
XLA_FLAGS"): one flag too many and not a test starts. conftest.py decides from a table of
jaxlib versions, with no trial start at session start; these tests start XLA in a fresh
process under the installed jaxlib and check the table against it (CI runs them under the
oldest, the test extra's and the newest jaxlib).
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
from _devices import ROOT

import conftest

UNKNOWN = "Unknown flag in XLA_FLAGS"


def _start_xla(extra: str) -> subprocess.CompletedProcess:
    """A fresh process that starts XLA's CPU backend with ``extra`` appended to the inherited
    XLA_FLAGS (this process's: the inherited ones plus conftest's). A flag those hold already
    (conftest appended it: the jaxlib knows it, or no process of the suite starts) appends
    nothing: the process of the inherited flags, started once for the tests that ask."""
    inherited = os.environ.get("XLA_FLAGS", "")
    return _started_with(inherited if extra in inherited.split() else f"{inherited} {extra}".strip())


@functools.cache
def _started_with(flags: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=flags)
    return subprocess.run([sys.executable, "-c", "import jax; print(jax.devices())"], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_the_suite_flags_start_xla_in_a_fresh_process():
    """What every subprocess and notebook kernel of the suite inherits."""
    done = _start_xla("")
    assert done.returncode == 0 and UNKNOWN not in done.stderr, (os.environ["XLA_FLAGS"], done.stderr[-3000:])


@pytest.mark.parametrize(("flag", "removed"), conftest.SUITE_FLAGS, ids=[f for f, _ in conftest.SUITE_FLAGS])
def test_the_table_says_which_jaxlib_knows_each_flag(flag, removed):
    """The installed jaxlib knows the flag exactly where the table says it does."""
    from importlib.metadata import version

    installed = conftest.release(version("jaxlib"))
    known = removed is None or installed < removed
    done = _start_xla(flag)
    if known:
        assert done.returncode == 0 and UNKNOWN not in done.stderr, (installed, flag, done.stderr[-3000:])
    else:
        assert done.returncode != 0 and UNKNOWN in done.stderr, (installed, flag, done.returncode)
        assert flag.split("=")[0] not in os.environ["XLA_FLAGS"]  # conftest left it out


SPLIT = "--xla_cpu_parallel_codegen_split_count=1"


def test_flags_are_chosen_by_the_jaxlib_version():
    all_three = f"--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false {SPLIT}"
    assert conftest.suite_flags("", (0, 9, 2)) == all_three
    assert conftest.suite_flags("", (0, 11, 0)) == all_three
    for newer in ((0, 11, 1), (0, 11, 2), (0, 12, 0, 1), (1, 0)):
        assert conftest.suite_flags("", newer) == f"--xla_backend_optimization_level=0 {SPLIT}"


def test_an_inherited_setting_stays_and_is_appended_to():
    inherited = "--xla_cpu_max_isa=AVX --xla_backend_optimization_level=2"
    assert conftest.suite_flags(inherited, (0, 10, 2)) == f"{inherited} --xla_cpu_use_fusion_emitters=false {SPLIT}"
    assert conftest.suite_flags(inherited, (0, 11, 2)) == f"{inherited} {SPLIT}"
    split_set = f"{inherited} --xla_cpu_parallel_codegen_split_count=4"
    assert conftest.suite_flags(split_set, (0, 11, 2)) == split_set  # the developer's value kept


def test_release_reads_the_numbers_of_a_version():
    assert conftest.release("0.11.2") == (0, 11, 2)
    assert conftest.release("0.12.0.1") == (0, 12, 0, 1)
    assert conftest.release("0.11.2.dev20261101") == (0, 11, 2)
    assert conftest.release("0.11.2rc1") == (0, 11, 2)


def test_a_jaxlib_without_metadata_is_read_from_its_version_module(monkeypatch):
    import importlib.metadata

    from jaxlib.version import __version__

    def no_metadata(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", no_metadata)
    assert conftest._installed_jaxlib() == conftest.release(__version__) != ()


def test_the_suite_s_processes_take_the_gpu_memory_they_use():
    """pytest's workers share one GPU: none reserves most of it (conftest's default)."""
    assert "XLA_PYTHON_CLIENT_PREALLOCATE" in os.environ  # "false" unless the user set it


# A program only this test compiles, run the same way here and in a fresh process.
_CACHED_PROGRAM = """
import jax, jax.numpy as jnp
events = []
jax.monitoring.register_event_listener(lambda event, **kwargs: events.append(event))
y = jax.jit(lambda x: jnp.cumsum(x * 3.25 + 1.5))(jnp.arange(7.0, dtype=jnp.float32))
loaded = events.count("/jax/compilation_cache/cache_hits")
compiled = events.count("/jax/compilation_cache/cache_misses")
"""


def test_the_runs_processes_share_one_compilation_cache():
    """conftest.py gives the run one persistent compilation cache, which subprocesses and
    notebook kernels inherit: a program this process compiled loads in a fresh process, with
    the same numbers: every program the fresh process runs is loaded, none compiled."""
    import jax

    directory = os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert jax.config.jax_compilation_cache_dir == directory and os.path.isdir(directory)
    here: dict = {}
    exec(_CACHED_PROGRAM, here)
    done = subprocess.run([sys.executable, "-c", _CACHED_PROGRAM + "print(loaded, compiled, y.tolist())"],
                          env=dict(os.environ, JAX_PLATFORMS="cpu"), cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded, compiled, numbers = done.stdout.split(maxsplit=2)
    assert int(loaded) >= 1 and compiled == "0" and numbers == f"{here['y'].tolist()}\n", done.stdout


def _programs_lowered() -> list[str]:
    """The text of twelve programs lowered one after another (more than one context's ten):
    eager operations, a model's gradient through a scan, a LAPACK custom call; with their
    source locations."""
    import jax
    import jax.numpy as jnp

    import functree as ft

    stack = ft.nn.Stack(lambda k: ft.nn.Dense(3, 3, jnp.tanh, key=k), 2, key=jax.random.key(0))
    x = jnp.arange(6.0, dtype=jnp.float32).reshape(2, 3)
    programs = [(lambda x, i=i: jnp.sin(x) * (i + 0.5)) for i in range(9)] + [
        lambda x: ft.gradient(lambda m: jnp.sum(m(x) ** 2), at=stack).layers.weight,
        lambda x: jnp.linalg.eigh(x.T @ x)[0],
        lambda x: jax.lax.cumsum(x, axis=1),
    ]
    return [jax.jit(f).lower(x).as_text(debug_info=True) for f in programs]


def test_a_reused_mlir_context_lowers_the_text_a_fresh_one_does(monkeypatch):
    """conftest.py lowers ten programs per MLIR context where JAX made one per program (before
    0.11; JAX reuses them itself from there on): the programs' text is the same as each
    lowered in a context of its own."""
    from jax._src.interpreters import mlir

    assert not conftest.reuse_mlir_contexts()  # patched once, or JAX's own reuse
    fresh = getattr(mlir.make_ir_context, "fresh", None) or mlir._create_ir_context
    texts = []
    for make in (mlir.make_ir_context, fresh):  # (one call site: the same source locations)
        monkeypatch.setattr(mlir, "make_ir_context", make)
        texts.append(_programs_lowered())
    assert texts[0] == texts[1]
