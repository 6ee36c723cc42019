"""Every ```python block of README.md and docs/ runs as a reader pastes it: page by page, in
order, cumulatively, in a fresh Python process (forked from one that imported NumPy, JAX and
functree: see SERVER).

A page's blocks run one after the other in one namespace (the ``>>>`` blocks too, as the
source a reader types). Each block is compiled under the page's name and line numbers, so a
failure's traceback points at the page's own line.

Every example runs once, and every doctest's output is checked once, by one of two runners:

* pytest's doctest of the page (``--doctest-glob='*.md'``) runs all of a page's ``>>>``
  examples in order in one namespace and checks their outputs; it cannot run a plain block;
* this module runs the plain blocks, and the ``>>>`` blocks a plain block may need: those
  before the last plain block of their session (only as source, pytest's doctest checks
  their outputs, running them a second time). A session's doctests after its last plain
  block are only compiled here, so a page whose main session is doctests alone (its other
  sessions, a migration guide's other library, plain blocks) is not run twice, and a page
  of doctests alone is not run here at all (no fresh process).

So a page keeps its examples cheap to test by not mixing: a functree example after a
doctest is itself a doctest (``>>> class ...`` with ``...`` lines), unless it is a whole
program (a first block that a reader runs as a script, an example for another library).

Two kinds of block are compiled but not run, and say so on the page, visibly, in the fence's
title (mkdocs-material shows it above the code):

* ```` ```python title="Needs: <what>" ````: an example that needs what the suite has not (the
  Hugging Face Hub, several hosts, a GPU);
* ```` ```python title="Fragment: <what>" ````: a piece shown in the middle of the reader's
  own program (names it does not define). A piece that is not Python (a signature) is a
  ```` ```text ```` block.

Any other title names the program a block belongs to: the migration guides' side-by-side
columns (```` ```python title="Equinox" ````) are the other library's program, pasted into
its own session. Blocks of one title run cumulatively in one namespace of their own; the
untitled blocks (functree's) in the page's main one.

The blocks' process gets functree from this checkout (PYTHONPATH: no install needed); a page
whose run blocks import a package this environment lacks is skipped, naming it. A page that
moves arrays between devices and meshes says ``<!-- blocks run with 8 CPU devices -->`` (in
its text, with a sentence telling the reader how to do the same): its blocks then run with
XLA's host device count appended to the inherited XLA_FLAGS, on the CPU.
"""

import ast
import doctest
import importlib.util
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# a fence's opening line, its info string, and its body up to the closing fence at the same indent
FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<ticks>`{3,})(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=ticks)[ \t]*$",
                   re.MULTILINE | re.DOTALL)
TITLE = re.compile(r'title="(?P<title>[^"]*)"')
NOT_RUN = ("Needs:", "Fragment:")
DEVICES = re.compile(r"<!-- blocks run with (?P<n>\d+) CPU devices -->")
PYTHON = {"python", "py", "pycon", "python3"}


def blocks(page):
    """(line, chunks, title) of each Python block of a page; line is the block's first line,
    chunks its statements as (line, source, raises) (see ``python_source``)."""
    text = page.read_text()
    found = []
    for match in FENCE.finditer(text):
        info = match.group("info").strip()
        language = info.split()[0].lstrip(".").lower() if info else ""
        if language not in PYTHON:
            continue
        title = TITLE.search(info)
        body = textwrap.dedent(match.group("body"))
        line = text.count("\n", 0, match.start("body")) + 1
        chunks = [(line + offset, source, raises) for offset, source, raises in python_source(body)]
        found.append((line, chunks, title.group("title") if title else ""))
    return found


def python_source(body):
    """The Python a reader types for a block, as (line offset, source, raises): the block
    itself, or each of a doctest's statements (``raises``: its expected output is a
    traceback, the error the example shows)."""
    if not re.search(r"^>>> ", body, re.MULTILINE):
        return [(0, body, False)]
    return [(example.lineno, example.source, example.exc_msg is not None)
            for example in doctest.DocTestParser().get_examples(body)
            if not example.options.get(doctest.SKIP)]


RUNNER = """\
import sys
page, blocks = sys.argv[1], __import__("json").loads(open(sys.argv[2]).read())
namespaces = {}
for session, run, chunks in blocks:
    namespace = namespaces.setdefault(session, {"__name__": "__main__"})
    for line, source, raises in chunks:
        code = compile("\\n" * (line - 1) + source, page, "exec")
        if not run:
            continue
        if raises:  # a doctest that shows an error: the reader sees it raised
            try:
                exec(code, namespace)
            except Exception:
                continue
            raise AssertionError(f"{page}, line {line}: the example shows an error, but none was raised")
        exec(code, namespace)
"""


def page_id(page):
    return str(page.relative_to(ROOT))


def is_doctest(page, chunks):
    return bool(chunks) and re.match(r"\s*>>> ", page_text_at(page, chunks[0][0])) is not None


def plain_blocks_run(page):
    """Whether a page has a block to run that is not a doctest (a page of doctests alone
    is run cumulatively already, by pytest's doctest of the page)."""
    return any(not title.startswith(NOT_RUN) and not is_doctest(page, chunks) for _, chunks, title in blocks(page))


def run_spec(page):
    """(session, run, chunks) of each block: a doctest after its session's last plain block
    is only compiled (pytest's doctest of the page runs it; no plain block needs its names)."""
    found = blocks(page)
    last = {}
    for i, (_, chunks, title) in enumerate(found):
        if not title.startswith(NOT_RUN) and not is_doctest(page, chunks):
            last[title] = i
    return [(title, not title.startswith(NOT_RUN) and i <= last.get(title, -1), chunks)
            for i, (_, chunks, title) in enumerate(found)]


def imported_packages(spec):
    """The top-level packages the run blocks of ``run_spec``'s ``spec`` import (absolute
    imports: ``import keras, numpy as np`` -> keras, numpy)."""
    names = set()
    for _, run, chunks in spec:
        for _, source, _ in chunks if run else ():
            try:
                tree = ast.parse(source)
            except SyntaxError:  # test_every_python_block_compiles reports it
                continue
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    names.update(alias.name.split(".")[0] for alias in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names.add(node.module.split(".")[0])
    return names


def missing_packages(spec):
    """The imported packages this environment lacks (the page's test skips, naming them)."""
    return sorted(name for name in imported_packages(spec) if importlib.util.find_spec(name) is None)


def page_devices(page):
    """The CPU devices a page's blocks run with: N where the page says
    ``<!-- blocks run with N CPU devices -->`` (a page that moves arrays between devices and
    meshes, as a laptop simulating them does), else None (the inherited backend)."""
    found = DEVICES.search(page.read_text())
    return int(found.group("n")) if found else None


def block_environment(devices=None):
    """The blocks' process environment: functree from this checkout (first on PYTHONPATH:
    no install needed, and not another installed copy), a plotting backend without a display,
    and ``devices`` CPU devices if given (XLA's host device count appended to the inherited
    XLA_FLAGS, on the CPU whatever the machine's accelerator)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("MPLBACKEND", "Agg")
    if devices is not None:
        inherited = [f for f in env.get("XLA_FLAGS", "").split()
                     if not f.startswith("--xla_force_host_platform_device_count")]
        env["XLA_FLAGS"] = " ".join([*inherited, f"--xla_force_host_platform_device_count={devices}"])
        env["JAX_PLATFORMS"] = "cpu"
    return env


def page_text_at(page, line):
    return page.read_text().splitlines()[line - 1]


@pytest.mark.parametrize("page", PAGES, ids=page_id)
def test_every_python_block_compiles(page):
    for _, chunks, _title in blocks(page):
        for line, source, _ in chunks:
            try:
                compile("\n" * (line - 1) + source, str(page), "exec")
            except SyntaxError as e:
                raise AssertionError(f"{page_id(page)}, line {e.lineno}: a ```python block is not Python "
                                     f"({e.msg}); a fragment that is not Python is a ```text block") from None


# Each page's process is forked from a server process that has imported what every page
# imports first (NumPy, JAX and functree's packages; JAX's backend is not started there), one
# server per environment (a page's simulated devices are read as JAX starts, so pages of 8
# devices have a server of their own). A forked process is a fresh interpreter for the page:
# its namespace is empty, its backend starts with the page's XLA_FLAGS, its working
# directory and environment are the page's; only the imports are paid once, not per page
# (~1.5 CPU-s each: 11 pages). The server's environment is the page's (block_environment),
# so JAX's configuration read at import (JAX_PLATFORMS, the compilation cache) is the page's.
SERVER = """\
import json, os, sys, traceback
import numpy, jax, jax.numpy, functree, functree.nn, functree.optim, functree.train
runner = compile(open(sys.argv[1]).read(), sys.argv[1], "exec")
for request in sys.stdin:
    page, blocks, cwd, errors = json.loads(request)
    pid = os.fork()
    if pid == 0:  # the page's process
        code = 1
        try:
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the requests are the server's
            os.chdir(cwd)
            sys.path[0] = cwd  # a script's directory: the page's run.py was there
            log = os.open(errors, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(log, 1)
            os.dup2(log, 2)
            sys.argv = [os.path.join(cwd, "run.py"), page, blocks]
            exec(runner, {"__name__": "__main__"})
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(json.dumps(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])), flush=True)
"""


class PageServer:
    """A :data:`SERVER` process of one environment; :meth:`run` runs one page's blocks."""

    def __init__(self, directory, devices):
        (directory / "run.py").write_text(RUNNER)
        (directory / "server.py").write_text(SERVER)
        self.runner = directory / "run.py"
        self.process = subprocess.Popen([sys.executable, str(directory / "server.py"), str(self.runner)],
                                        cwd=directory, env=block_environment(devices), stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def run(self, page, blocks, cwd, timeout=600):
        """(exit code, what the page's process printed)."""
        import json
        import select

        errors = cwd / "output.txt"
        self.process.stdin.write(json.dumps([str(page), str(blocks), str(cwd), str(errors)]) + "\n")
        self.process.stdin.flush()
        ready, _, _ = select.select([self.process.stdout], [], [], timeout)
        line = self.process.stdout.readline() if ready else ""
        if not line:  # timed out, or the server itself failed
            self.process.kill()
            _, err = self.process.communicate()
            raise AssertionError(f"the page server stopped: {err[-3000:]}")
        return json.loads(line), errors.read_text() if errors.exists() else ""

    def close(self):
        self.process.communicate(timeout=60)  # end of input: the server returns


@pytest.fixture(scope="module")
def page_servers(tmp_path_factory):
    """{devices: PageServer}, each started when a page of its environment first asks."""
    servers = {}

    def server(devices):
        if devices not in servers or servers[devices].process.poll() is not None:
            servers[devices] = PageServer(tmp_path_factory.mktemp("server"), devices)
        return servers[devices]

    yield server
    for each in servers.values():
        each.close()


@pytest.mark.parametrize("page", [p for p in PAGES if plain_blocks_run(p)], ids=page_id)
def test_every_python_block_runs(page, tmp_path, page_servers):
    import json

    spec = run_spec(page)
    missing = missing_packages(spec)
    if missing:
        pytest.skip(f"{page_id(page)}'s blocks import {', '.join(missing)}, not installed here")
    (tmp_path / "blocks.json").write_text(json.dumps(spec))
    code, output = page_servers(page_devices(page)).run(page, tmp_path / "blocks.json", tmp_path)
    assert code == 0, f"{page_id(page)}: a block fails as pasted\n{output[-6000:]}"


@pytest.fixture(scope="module")
def blocks_process(tmp_path_factory, page_servers):
    """(functree's file, the device count) in a page's process of 8 CPU devices: a block
    run as the pages' are (the server of the 8-device pages, which serves both tests below
    and those pages: the PYTHONPATH, functree from the checkout, and the device count being
    one environment's), not a process of its own (python + jax + functree, ~2 CPU-s)."""
    import json

    directory = tmp_path_factory.mktemp("blocks")
    page = directory / "page.md"
    page.write_text("```python\nimport functree, jax\nprint(functree.__file__)\nprint(jax.device_count())\n```\n")
    (directory / "blocks.json").write_text(json.dumps(run_spec(page)))
    code, output = page_servers(8).run(page, directory / "blocks.json", directory)
    assert code == 0, output[-3000:]
    functree_file, device_count = output.splitlines()
    return functree_file, device_count


def test_blocks_are_found_and_titles_are_read(tmp_path):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent('''\
        Text.

        ```python
        x = 1
        ```

        ```python title="Needs: the Hugging Face Hub"
        y = x + 1
        ```

        ```text
        not python
        ```

        ```python
        >>> z = x + 2
        >>> z
        3

        ```
        '''))
    found = blocks(page)
    assert [(line, title) for line, _, title in found] == [(4, ""), (8, "Needs: the Hugging Face Hub"), (16, "")]
    assert found[0][1] == [(4, "x = 1\n", False)]
    # each doctest statement at its own line of the page
    assert found[2][1] == [(16, "z = x + 2\n", False), (17, "z\n", False)]
    # the doctest after the last plain block is left to pytest's doctest of the page
    assert [(session, run) for session, run, _ in run_spec(page)] == [
        ("", True), ("Needs: the Hugging Face Hub", False), ("", False)]


def test_pages_that_import_a_missing_package_are_skipped_and_functree_comes_from_the_checkout(tmp_path, blocks_process):
    page = tmp_path / "page.md"
    page.write_text(textwrap.dedent('''\
        ```python
        import functree as ft, numpy as np
        from no_such_package_here.sub import thing
        import os.path
        ```

        ```python title="Needs: a GPU"
        import another_missing_package
        ```
        '''))
    spec = run_spec(page)
    assert imported_packages(spec) == {"functree", "numpy", "no_such_package_here", "os"}
    assert missing_packages(spec) == ["no_such_package_here"]  # a block not run needs nothing
    env = block_environment()
    assert env["PYTHONPATH"].split(os.pathsep)[0] == str(ROOT)
    assert block_environment(8)["PYTHONPATH"] == env["PYTHONPATH"]  # blocks_process ran in it
    functree_file, _ = blocks_process
    assert pathlib.Path(functree_file).resolve().parent == ROOT / "functree"


def test_a_page_asks_for_simulated_devices(tmp_path, blocks_process):
    page = tmp_path / "page.md"
    page.write_text("Text.\n<!-- blocks run with 8 CPU devices -->\n")
    assert page_devices(page) == 8
    env = block_environment(8)
    assert env["XLA_FLAGS"].startswith(os.environ.get("XLA_FLAGS", "").strip())  # appended
    _, device_count = blocks_process
    assert device_count == "8"
    page.write_text("Text.\n")
    assert page_devices(page) is None and "JAX_PLATFORMS" not in block_environment(None).keys() - os.environ.keys()
