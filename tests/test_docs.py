"""The documentation's structure, checked without building the site (`mkdocs build --strict`,
run by CI, checks the rest: every page renders, every docs link and anchor resolves).

* Every public name of functree and its packages has an API reference entry.
* Every entry names a public object (no stale entries after a rename).
* Every relative link in README.md points at an existing file, and its anchor at a heading.
* README stays a front page (at most 300 lines); every page is in the site's navigation.
"""

import importlib
import inspect
import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).parents[1]
DOCS = ROOT / "docs"
REFERENCE = DOCS / "reference"
PACKAGES = ["functree", "functree.nn", "functree.optim", "functree.train", "functree.losses",
            "functree.parallel", "functree.hf", "functree.generation", "functree.interop"]
# A page's mkdocstrings entry (`::: functree.nn.Dense`), or a table row naming the function
# (the activations that are JAX's own functions, documented by JAX: `| `ft.nn.relu` |`).
ENTRY = re.compile(r"^::: (functree(?:\.\w+)+)\s*$", re.MULTILINE)
TABLE_ENTRY = re.compile(r"^\| `ft\.((?:\w+\.)*\w+)` \|", re.MULTILINE)
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def reference_entries():
    entries = set()
    for page in REFERENCE.glob("*.md"):
        text = page.read_text()
        entries.update(ENTRY.findall(text))
        entries.update(f"functree.{name}" for name in TABLE_ENTRY.findall(text))
    return entries


@pytest.mark.parametrize("package", PACKAGES)
def test_every_public_name_has_a_reference_entry(package):
    module = importlib.import_module(package)
    entries = reference_entries()
    public = [name for name in module.__all__ if not inspect.ismodule(getattr(module, name))]
    missing = [f"{package}.{name}" for name in public if f"{package}.{name}" not in entries]
    assert not missing, (
        f"public names without an API reference entry: {missing}\n"
        f"    right: a line `::: <name>` in the docs/reference page of {package}")
    # its subpackages have their own pages
    for name in module.__all__:
        if inspect.ismodule(getattr(module, name)) and name != "initializers":
            assert (REFERENCE / f"{name}.md").exists(), name


def test_every_reference_entry_names_a_public_object():
    for entry in sorted(reference_entries()):
        package, _, name = entry.rpartition(".")
        module = importlib.import_module(package)
        assert name in getattr(module, "__all__", ()), f"{entry}: not in {package}.__all__"


def slug(heading):
    """GitHub's (and mkdocs' default) anchor of a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def anchors(path):
    text = FENCE.sub("", path.read_text())
    return {slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.MULTILINE)}


def test_readme_links_resolve():
    readme = ROOT / "README.md"
    links = LINK.findall(FENCE.sub("", readme.read_text()))
    assert len(links) >= 20
    for link in links:
        if re.match(r"[a-z]+://", link):
            continue
        target, _, anchor = link.partition("#")
        path = (ROOT / target) if target else readme
        assert path.exists(), f"README.md links to {link!r}: no file {path.relative_to(ROOT)}"
        if anchor:
            assert anchor in anchors(path), f"README.md links to {link!r}: no heading with that anchor"


def test_readme_is_a_front_page_and_the_site_lists_every_page():
    assert len((ROOT / "README.md").read_text().splitlines()) <= 300
    nav = set(re.findall(r"([\w\-/]+\.(?:md|ipynb))\s*$", (ROOT / "mkdocs.yml").read_text(), re.MULTILINE))
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    notebooks = {f"notebooks/{p.name}" for p in (ROOT / "notebooks").glob("*.ipynb")}
    assert pages | notebooks == nav


def test_slug_matches_github():
    assert slug("Coming from another library") == "coming-from-another-library"
    assert slug("L-BFGS through `Optimizer`") == "l-bfgs-through-optimizer"


# `ft.losses.softmax_cross_entropy`, `ft.nn.training(model)`, `ft.optim.Optimizer.init`: a
# dotted name after `ft.` in an error message (a module-level string constant), outside its
# `wrong:` lines (the reader's code, which may name what does not exist)
SUGGESTED = re.compile(r"(?<![\w.])ft\.((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*)")


def error_constants():
    import pkgutil

    import functree

    for info in pkgutil.walk_packages(functree.__path__, "functree."):
        module = importlib.import_module(info.name)
        for name, value in vars(module).items():
            if name.isupper() and isinstance(value, str):
                yield f"{info.name}.{name}", value


def test_every_name_an_error_suggests_exists():
    import functree

    wrong = []
    for where, text in error_constants():
        told = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("wrong:"))
        for dotted in SUGGESTED.findall(told):
            obj = functree
            for part in dotted.split("."):
                if not hasattr(obj, part):
                    wrong.append(f"{where}: ft.{dotted}")
                    break
                obj = getattr(obj, part)
    assert not wrong, "error messages suggest names that do not exist:\n" + "\n".join(wrong)


def hook_functions():
    """mkdocs_hooks.py's docstring rewriting (its title pattern and plain-text functions),
    without importing the file: it imports mkdocs and griffe, which only the docs extra has."""
    import ast

    tree = ast.parse((ROOT / "mkdocs_hooks.py").read_text())
    kept = [node for node in tree.body
            if (isinstance(node, ast.FunctionDef) and node.name in {"examples_titled", "_examples_title", "_indent"})
            or (isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "EXAMPLE_TITLE" for t in node.targets))]
    assert len(kept) == 4, "mkdocs_hooks.py: EXAMPLE_TITLE, examples_titled, _examples_title, _indent"
    namespace = {"re": re}
    exec(compile(ast.Module(body=kept, type_ignores=[]), str(ROOT / "mkdocs_hooks.py"), "exec"), namespace)
    return namespace


def public_docstrings(own=False):
    """(name, docstring) of every public object and its public methods and properties
    (``own``: functree's objects only, not JAX's functions it re-exports, ``ft.nn.relu``)."""
    for package in PACKAGES:
        module = importlib.import_module(package)
        for name in module.__all__:
            obj = getattr(module, name)
            if not (inspect.isclass(obj) or callable(obj)):
                continue  # a constant: getdoc would give its type's docstring
            if own and not getattr(obj, "__module__", "functree").startswith("functree"):
                continue
            yield f"{package}.{name}", inspect.getdoc(obj) or ""
            if isinstance(obj, type):
                for attr, member in vars(obj).items():
                    if not attr.startswith("_") and (inspect.isfunction(member) or isinstance(member, property)):
                        yield f"{package}.{name}.{attr}", inspect.getdoc(member) or ""


def test_every_docstring_example_is_titled_for_the_site():
    """The site renders a docstring's example as code only under griffe's `Examples:`
    title; mkdocs_hooks.py renames functree's titles. A title it does not recognise (the
    example would render as a blockquote of prose) fails here."""
    examples_titled = hook_functions()["examples_titled"]
    untitled = []
    for name, doc in public_docstrings():
        lines = examples_titled(doc).splitlines()
        for i, line in enumerate(lines[:-1]):
            if line.lstrip().startswith(">>>"):
                # the title above this example's first line: the nearest less-indented line
                indent = len(line) - len(line.lstrip())
                above = next((t for t in reversed(lines[:i]) if t.strip() and len(t) - len(t.lstrip()) < indent), "")
                if above.strip() != "Examples:":
                    untitled.append(f"{name}: {above.strip()!r}")
    assert not untitled, "examples under a title the site does not render as code:\n" + "\n".join(untitled)


def test_example_titles_are_renamed():
    examples_titled = hook_functions()["examples_titled"]
    doc = "Text.\n\nExample (seed 002's ``f(of: g)``):\n  >>> 1\n  1\n\nExample: a note\n  >>> 2\n  2\n"
    assert examples_titled(doc) == ("Text.\n\nExamples:\n  Seed 002's ``f(of: g)``:\n  >>> 1\n  1\n\n"
                                    "Examples:\n  A note:\n  >>> 2\n  2\n")
    assert examples_titled("Example:\n  >>> 1\n") == "Examples:\n  >>> 1\n"
    # a doctest after a paragraph of prose gets a title of its own
    assert examples_titled("Example:\n  >>> 1\n\nMore:\n\n  >>> 2\n") == "Examples:\n  >>> 1\n\nMore:\n\nExamples:\n  >>> 2\n"
    assert examples_titled("Example: not a title, no example below.\n") == "Example: not a title, no example below.\n"


def constant_docstrings():
    """(name, module, docstring) of every public constant (not a class, function or module):
    the string after its assignment in the package's modules, which griffe shows and Python
    does not keep (None when there is none)."""
    import ast
    import itertools
    import pkgutil

    for package in PACKAGES:
        module = importlib.import_module(package)
        homes = [package] + [info.name for info in pkgutil.iter_modules(module.__path__, package + ".")
                             if info.name.rpartition(".")[2].startswith("_")]
        for name in module.__all__:
            obj = getattr(module, name)
            if inspect.ismodule(obj) or inspect.isclass(obj) or callable(obj):
                continue
            found = None
            for home in homes:
                body = ast.parse(inspect.getsource(importlib.import_module(home))).body
                for node, after in itertools.pairwise([*body, None]):
                    if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
                        doc = after.value.value if (isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                                                    and isinstance(after.value.value, str)) else None
                        found = (home, doc)
            assert found is not None, f"{package}.{name}: its assignment was not found"
            yield f"{package}.{name}", *found


def test_every_public_constant_has_a_docstring_with_a_running_example():
    import doctest

    constants = list(constant_docstrings())
    assert len(constants) >= 5
    for name, home, doc in constants:
        assert doc, f"{name}: no docstring (a string right after its assignment in {home})"
        test = doctest.DocTestParser().get_doctest(doc, {}, name, home, 0)
        assert test.examples, f"{name}: its docstring has no `Example:` with >>> lines"
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
        runner.run(test)
        assert runner.failures == 0, f"{name}: its example fails (output above)"


def undefined_names(source):
    """The global names ``source`` reads and never binds (imports, assignments, defs,
    loop and ``with`` targets), less the builtins: what a fresh session lacks."""
    import builtins
    import symtable

    table = symtable.symtable(source, "<example>", "exec")
    bound = {s.get_name() for s in table.get_symbols() if s.is_assigned() or s.is_imported()}
    read = set()

    def visit(t):
        for s in t.get_symbols():
            if s.is_referenced() and (t is table or s.is_global()):
                read.add(s.get_name())
        for child in t.get_children():
            visit(child)

    visit(table)
    return sorted(read - bound - set(dir(builtins)))


def test_docstring_examples_run_in_a_fresh_session():
    """The suite runs a docstring's examples in its module's namespace, where the module's
    own imports (`Callable`, `jnp`) are defined; a reader pastes them into a fresh session.
    Every name an example reads is one it binds (or a builtin)."""
    import doctest

    parser = doctest.DocTestParser()
    missing = []
    for name, doc in public_docstrings(own=True):
        examples = parser.get_examples(doc)
        if examples:
            source = "".join(example.source for example in examples)
            names = undefined_names(source)
            if names:
                missing.append(f"{name}: {names}")
    assert not missing, "docstring examples that read names they never define:\n" + "\n".join(missing)


def test_undefined_names_finds_what_a_fresh_session_lacks():
    assert undefined_names("import jax\nx: Callable = jax.nn.relu\ndef f(y):\n    return y + z + x\n") == ["Callable", "z"]
    assert undefined_names("for i in range(2):\n    print(i)\nwith open('f') as g:\n    g\n") == []
