"""Run a Python snippet in a fresh process with N simulated CPU devices; return its JSON.

``XLA_FLAGS=--xla_force_host_platform_device_count=N`` must be set before JAX starts, and
the test process has started it with one device, so multi-device tests run their code in a
subprocess. The snippet calls ``report(obj)`` to hand back a JSON-serialisable object.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import conftest

ROOT = Path(__file__).resolve().parents[1]
MARK = "@@REPORT@@"

# The suite's settings (conftest.py): strict promotion, and an MLIR context per ten lowerings.
PRELUDE = f"""\
import json, jax
jax.config.update("jax_numpy_dtype_promotion", "strict")
def report(obj):
    print({MARK!r} + json.dumps(obj), flush=True)
{inspect.getsource(conftest.reuse_mlir_contexts)}
reuse_mlir_contexts()
"""


def xla_flags(devices: int) -> str:
    """XLA_FLAGS for ``devices`` simulated CPU devices.

    Their collectives meet in a rendezvous that XLA abandons (killing the process) after
    40 s; on a 2-core machine running other tests, one device's thread can be starved that
    long, so the tests give it 10 minutes.
    """
    return f"--xla_force_host_platform_device_count={devices} {COLLECTIVE_TIMEOUT}"


COLLECTIVE_TIMEOUT = "--xla_cpu_collective_call_terminate_timeout_seconds=600"


def env_with_devices(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    # Appended to the inherited flags (an instruction-set sweep's --xla_cpu_max_isa stays);
    # an inherited device count gives way to this one.
    inherited = [f for f in env.get("XLA_FLAGS", "").split() if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join([*inherited, xla_flags(devices)])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}"
    return env


# A subprocess's warnings are errors, as the suite's (pyproject's filterwarnings), but for a
# read of the shared compilation cache racing another process's write: JAX compiles instead.
WARNINGS = ("-W", "error", "-W", "ignore:Error reading persistent compilation cache entry:UserWarning")


def start(code: str, devices: int = 8, args: tuple[str, ...] = ()) -> subprocess.Popen:
    """Start ``code`` (with ``report``) in a new Python process with ``devices`` CPU devices."""
    source = PRELUDE + textwrap.dedent(code)
    return subprocess.Popen(
        [sys.executable, *WARNINGS, "-c", source, *args], env=env_with_devices(devices), cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def result(proc: subprocess.Popen, timeout: float = 300) -> Any:
    """The reported object of a process started by :func:`start` (raises with its stderr)."""
    out, err = proc.communicate(timeout=timeout)
    proc.stderr_text = err  # type: ignore[attr-defined]  # for tests that read what it printed
    lines = [line for line in out.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        raise AssertionError(f"subprocess failed (exit {proc.returncode}):\n{out[-3000:]}\n{err[-6000:]}")
    return json.loads(lines[-1][len(MARK):])


def run(code: str, devices: int = 8, timeout: float = 300) -> Any:
    """Run ``code`` with ``devices`` simulated CPU devices and return what it reported."""
    return result(start(code, devices), timeout)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def results(procs: list[subprocess.Popen], timeout: float = 300) -> list[Any]:
    """:func:`result` of several processes read together (none blocks on a full pipe)."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(procs)) as pool:
        return list(pool.map(lambda p: result(p, timeout), procs))


def scenarios(common: str, sources: dict[str, str], devices: int = 8, timeout: float | None = None) -> dict[str, Any]:
    """Run several independent snippets in one process (one start-up, shared compiled programs).

    Each snippet in ``sources`` runs after ``common`` in its own copy of ``common``'s globals
    and calls ``report``; the result maps each name to ``{"result": ...}`` or, where the
    snippet raised, ``{"error": traceback}`` (so each test that reads its part fails alone).
    """
    code = common + f"""
import traceback as _traceback
_base, _out = dict(globals()), {{}}
for _name, _source in {dict(sources)!r}.items():
    _got = []
    _scope = dict(_base, report=_got.append)
    try:
        exec(_source, _scope)
        _out[_name] = {{"result": _got[-1]}}
    except BaseException:
        _out[_name] = {{"error": _traceback.format_exc()}}
report(_out)
"""
    return run(code, devices, 300 * len(sources) if timeout is None else timeout)  # run()'s 300 s each


def selected_scenarios(request: Any, common: str, sources: dict[str, str], devices: int = 8) -> dict[str, Any]:
    """:func:`scenarios` for the tests of ``request``'s module that this run selected (a test
    ``test_<name>`` reads scenario ``<name>``): a module fixture's body, so ``-k`` runs only
    what it picks, and ``--dist loadfile`` starts the subprocess once per module."""
    here = {item.originalname[5:] for item in request.session.items if getattr(item, "module", None) is request.module}
    return scenarios(common, {name: src for name, src in sources.items() if name in here}, devices=devices)


def part(results: dict[str, Any], name: str) -> Any:
    """The result of scenario ``name`` of :func:`scenarios` (raises with its traceback)."""
    got = results[name]
    if "error" in got:
        raise AssertionError(f"scenario {name!r} failed in the subprocess:\n{got['error']}")
    return got["result"]
