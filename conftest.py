"""Test configuration: strict dtype promotion, and every warning is an error (pyproject).

Float tolerances (the rule for every test). Two computations of the same numbers in another
order (another batch split or device count, another CPU's instruction set) differ by rounding
*relative to the magnitude of the values*, not of each element. So:

* compare with ``np.testing.assert_allclose(actual, expected, rtol=0, atol=...)`` with the atol
  scaled to each leaf's magnitude; for trained results ``tests/_tolerance.py``'s
  ``assert_close_trained(actual, expected, spread=s)`` does it per leaf;
* never divide by an element (an error over ``1e-6 + |y|`` turns rounding at a near-zero
  parameter into a large "relative" error), never a tolerance read off one machine's run;
* ``s`` is the largest ``scaled_error`` measured between the two computations under every XLA
  CPU instruction set (``XLA_FLAGS=--xla_cpu_max_isa=SSE4_2``, ``AVX``, ``AVX2``, ``AVX512``; each
  sums in another order; ``FUNCTREE_SPREAD_LOG=file`` records them), and the assertion allows
  ``MARGIN`` (10) times it. Subprocess tests append to the inherited ``XLA_FLAGS``.
"""

import atexit
import gc
import os
import re
import shutil
import sys
import tempfile

# XLA compiles the suite's programs for compile speed: the suite's arrays are tiny, so
# compiling is most of its time. Three flags, each appended to XLA_FLAGS unless set there:
# LLVM's optimisations off (level 0: XLA:CPU's compile time halved), and XLA:CPU's elemental
# emitters instead of its MLIR fusion emitters, whose compile is most of the rest (measured:
# 113 -> 71 CPU-s on four compile-bound test files). The programs (HLO: fusion, layout) are
# the same; their machine code is less optimised and may sum in another order, like another
# CPU's instruction set: tolerances hold under all (isa-sweep). Appended before JAX starts its
# backend, so subprocesses and notebook kernels inherit them; run the suite as users compile
# with `XLA_FLAGS="--xla_backend_optimization_level=2 --xla_cpu_use_fusion_emitters=true"`
# (the second flag only before jaxlib 0.11.1, see below).
#
# XLA aborts a process whose XLA_FLAGS name a flag it does not know ("Unknown flag in
# XLA_FLAGS"), so each flag is appended only for the jaxlib releases that know it. A table of
# versions, not a trial start of XLA in a subprocess (seconds at every session start):
# tests/test_conftest_flags.py starts one with these flags under the installed jaxlib, and
# CI's newest-jaxlib leg runs it there.
SUITE_FLAGS = (
    # (flag, first jaxlib without it, or None)
    ("--xla_backend_optimization_level=0", None),
    # XLA:CPU's elemental emitters were removed in jaxlib 0.11.1: from there on its XLA has
    # only the fusion emitters and the flag's DebugOptions field is reserved (read in the
    # wheels' libjax_common.so: 0.11.0 still has set_xla_cpu_use_fusion_emitters, 0.11.1 not).
    ("--xla_cpu_use_fusion_emitters=false", (0, 11, 1)),
    # One LLVM module per program, not split for codegen on a thread pool (XLA's default cuts
    # a module into up to 32 parts): the suite's two workers keep both cores busy, so the
    # split only adds work. Measured on 2 cores, CPU-s of one file, two runs each:
    # test_train_step 29.2, 31.0 -> 26.6, 26.1; test_nn_attention 26.4, 27.4 -> 24.9, 24.2;
    # test_generation_controls 40.1, 38.6 -> 38.0, 37.3. The same machine code (known to
    # every jaxlib from 0.9.2 to 0.12.0.1).
    ("--xla_cpu_parallel_codegen_split_count=1", None),
)


def release(version: str) -> tuple[int, ...]:
    """``"0.12.0.1"`` -> ``(0, 12, 0, 1)``; a suffix is cut (``"0.11.2rc1"``, ``"0.11.2.dev1"``)."""
    numbers = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(n) for n in numbers.group().split(".")) if numbers else ()


def suite_flags(inherited: str, jaxlib: tuple[int, ...]) -> str:
    """``inherited`` XLA_FLAGS with each of :data:`SUITE_FLAGS` that ``jaxlib`` knows appended
    (unless the flag's name is set there already)."""
    flags = inherited
    for flag, removed in SUITE_FLAGS:
        name = flag.split("=")[0].lstrip("-")
        if name not in flags and (removed is None or jaxlib < removed):
            flags = f"{flags} {flag}".strip()
    return flags


def _installed_jaxlib() -> tuple[int, ...]:
    """The installed jaxlib's release, read without starting JAX (its metadata, else its
    version module: a jaxlib built from source has no distribution metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return release(version("jaxlib"))
    except PackageNotFoundError:
        from jaxlib.version import __version__

        return release(__version__)


os.environ["XLA_FLAGS"] = suite_flags(os.environ.get("XLA_FLAGS", ""), _installed_jaxlib())
# On a GPU, JAX reserves 75% of its memory in every process: the workers of `pytest -n N`
# (and their subprocesses) would each ask for it and all but the first fail to allocate.
# Each process takes what it uses instead (unless set otherwise); nothing changes on a CPU.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# torch (the references: Hugging Face, torch.optim, torch layers) on one thread per process,
# unless set otherwise: `pytest -n 2` runs two workers on the cores already, and each
# worker's torch spun a second OpenMP thread that took ~20x the CPU of a tiny model's call
# (a Hugging Face generate: 2.4 -> 0.12 CPU-s; test_hf_peft + test_interop_torch 65 -> 60
# CPU-s). XLA's own thread pool does not read it. Read when torch starts; inherited.
os.environ.setdefault("OMP_NUM_THREADS", "1")

# One persistent compilation cache (JAX's, on disk) for the whole run: its xdist workers, and
# their subprocesses and notebook kernels, which inherit the environment, compile many of the
# same programs (an eager operation's, a model built from the same config in another file, a
# step compiled again after `jax.clear_caches()`) and load them instead. Measured on 2 cores:
# the suite's summed test time 2448 -> 1944 s, its wall 21:17 -> 17:00. The cache is keyed by
# the program, the XLA flags and the jaxlib, so a loaded program is the one XLA would compile:
# same machine code, same numbers. A fresh directory per run, removed when the run ends; a
# directory the developer set (JAX_COMPILATION_CACHE_DIR) is used as it is and kept.
def _shared_compilation_cache() -> str | None:
    """The run's cache directory if this process made it (its workers inherit it), else None."""
    if "JAX_COMPILATION_CACHE_DIR" in os.environ:
        return None
    directory = tempfile.mkdtemp(prefix="functree-suite-jax-cache-")
    os.environ.update({
        "JAX_COMPILATION_CACHE_DIR": directory,
        # every program, however small or quick to compile (JAX's defaults: 1 s and up)
        "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0", "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "-1",
    })
    return directory


_OWN_CACHE = _shared_compilation_cache()

# Python's bytecode written and read (its default, in the gitignored __pycache__ folders)
# where the environment turned it off (PYTHONDONTWRITEBYTECODE, as on these CI machines):
# every xdist worker, subprocess and notebook kernel compiled functree's ~200 modules and the
# tests' from source again. Measured on 2 cores: a subprocess importing functree's packages
# 2.3 -> 1.7 CPU-s, the collection of the suite in each worker 31 -> 20 CPU-s. (Not
# PYTHONPYCACHEPREFIX: it also moves the installed packages' bytecode, compiled again there.)
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# Python's cyclic garbage collector, run less often in the suite's processes: its full
# collections walk every object alive, and a worker holds torch's, transformers', JAX's and
# the collected suite's (millions); a run of 700 allocations (the default) started one
# collection after another. The first generation collects after 50,000 net allocations, and
# what collection made (modules, functions, the tests' items) is frozen when collection ends:
# never walked again (garbage then is collected before). Collection only frees memory later:
# no test's result depends on when (a test that counts collections sets its own thresholds,
# tests/test_flat.py). Measured on 2 cores, two runs each: collecting the suite 16.7, 16.5 ->
# 10.2, 9.6 CPU-s (each worker collects it); on five compile-bound files (-n 0) the collector's
# time 4.1, 4.3 -> 1.2, 1.2 s and the run's 52.7, 55.4 -> 47.6, 50.2 CPU-s; on twelve other
# files (-n 2) 173.0, 156.7 -> 170.5, 154.5 CPU-s; peak memory the same (to 1%).
gc.set_threshold(50_000, 20, 20)

import jax  # noqa: E402 (after XLA_FLAGS: JAX reads them when it starts its backend)
import pytest  # noqa: E402
from _pytest.doctest import DoctestItem  # noqa: E402
from hypothesis import settings  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
# The suite's tests are users who set JAX's rank promotion to "raise" (a vector added to a
# matrix must be broadcast by hand): a library path that broadcasts implicitly fails there,
# as it would for such a user (tests/test_rank_promotion.py says why). Two exceptions, each
# run under "allow": the examples of the docs and docstrings (a user's own code may
# broadcast; the library's part is run under "raise" by the tests) and keras, which
# broadcasts itself.
jax.config.update("jax_numpy_rank_promotion", "raise")

# The suite tests functree's numerics, so float32 matmuls and convolutions run at full float32
# precision on every backend. It changes nothing on a CPU (XLA:CPU computes float32 dots in
# float32 anyway); on an NVIDIA GPU the default is TF32 (10-bit mantissa inputs, ~1e-3
# relative), on a TPU bf16 passes, and comparisons with torch, Hugging Face or a hand-written
# float32 reference would then test the backend's default, not functree. A user gets the same
# parity with the same line (docs/guides/accelerators.md says what it costs).
jax.config.update("jax_default_matmul_precision", "highest")


# One MLIR context lowers ten programs in a row, as JAX does itself from jaxlib 0.11 on
# (jax._src.interpreters.mlir.make_ir_context: "Reuse each context at most 10 times per
# thread"); before, each program made a context of its own and loaded every dialect into it,
# 4 ms of the 6 ms a small program's lowering took. The suite lowers ~25,000 programs (each
# eager operation, each step: 419 of its 1718 test-seconds were lowering); the context only
# holds the types and attributes the programs name, so the lowered text is the same
# (tests/test_conftest_flags.py compares it, source locations included) and so are the
# programs. Measured on 2 cores, jax 0.10.2: a one-operation program's lowering 6.3 -> 2.0
# ms; two files' lowering 10.8, 12.7 -> 6.2, 5.3 s; the suite's summed test time 1718 ->
# 1466 s, its wall 910 -> 767 s. The suite's subprocesses do the same (tests/_devices.py).
def reuse_mlir_contexts() -> bool:
    """Where this JAX makes a fresh MLIR context per lowering, make one per ten (per thread,
    as JAX 0.11's own ``make_ir_context``). True if patched."""
    import threading

    from jax._src.interpreters import mlir

    if hasattr(mlir, "_thread_local_context") or getattr(mlir.make_ir_context, "reused", False):
        return False  # JAX reuses its contexts itself (0.11 on), or patched already
    fresh, local = mlir.make_ir_context, threading.local()

    def make_ir_context():
        context, count = getattr(local, "value", (None, 0))
        if context is not None and count < 10:
            local.value = (context, count + 1)
            return context
        local.value = (context := fresh(), 0)
        return context

    make_ir_context.reused, make_ir_context.fresh = True, fresh
    mlir.make_ir_context = make_ir_context
    return True


reuse_mlir_contexts()

# Property tests draw the same examples on every machine: "ci" derives each test's draws
# from the test itself and keeps no example database (a failure found on one machine is not
# replayed there alone). `--hypothesis-profile=explore` draws fresh random examples, ten
# times as many (tests/_hypothesis.py), for finding new failures; each becomes an @example.
settings.register_profile("ci", derandomize=True, database=None, deadline=None)
settings.register_profile("explore", derandomize=False, deadline=None)
settings.load_profile("ci")


@pytest.fixture
def key():
    return jax.random.key(0)


@pytest.fixture
def home_and_work(tmp_path, monkeypatch):
    """``(home, work)``, two empty folders under ``tmp_path``: ``~`` expands to ``home``
    (``HOME`` set) and ``work`` is the working directory, for the tests of paths a user
    writes with ``~`` (one must never land in a folder named ``~`` in ``work``)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir(), work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    return home, work


@pytest.fixture(autouse=True)
def _own_compiled_steps():
    """Each test starts with no shared compiled training steps (functree/train/_programs.py):
    its TrainSteps' cache sizes count its own compilations."""
    from functree.train._programs import forget_programs

    forget_programs()


@pytest.fixture(autouse=True)
def _torch_seeded():
    """Each test starts from torch's generator at seed 0 where torch is loaded: a Hugging Face
    model built from a config draws its initial weights there, and without a seed each test
    order (xdist's workers) drew others, so a tolerance held or not by the order (a float16
    port's test failed one draw in twelve)."""
    torch = sys.modules.get("torch")
    if torch is not None:
        torch.manual_seed(0)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    """Examples (the docs pages' and the docstrings' doctests) run under JAX's default rank
    promotion: they are a user's own code, written as most users write it (``x @ w + b``),
    which may broadcast implicitly; functree's own code must not, and
    tests/test_rank_promotion.py runs the library's modules' examples under "raise"."""
    if isinstance(item, DoctestItem):
        with jax.numpy_rank_promotion("allow"):
            return (yield)
    return (yield)


def pytest_collection_finish(session):
    """What collection made lives to the end: frozen, never walked by a collection again."""
    gc.collect()
    gc.freeze()


def pytest_unconfigure(config):
    if _OWN_CACHE is not None:  # the process that made the run's cache (xdist's controller)
        shutil.rmtree(_OWN_CACHE, ignore_errors=True)
    if hasattr(config, "workerinput") and "coverage" not in sys.modules:  # an xdist worker
        atexit.register(_exit_without_teardown)  # registered last: runs first


# An xdist worker that has sent its last report ends without tearing its interpreter down.
# Its results are with the controller (xdist's "workerfinished", sent before this), and the
# controller waits for each worker's process to end: JAX's exit handler freed the worker's
# ~9,000 compiled programs one by one and Python then freed its ~2 million objects, ~10 s at
# the end of every run (measured on 2 cores, the whole suite: the last test to the end of the
# controller's session 10.6 -> 2.0 s, to its exit 17.9 -> 5.2 s). Not where coverage is
# measured (it saves its data at exit).
def _exit_without_teardown() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
