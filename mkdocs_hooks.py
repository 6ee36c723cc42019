"""The documentation site's two build-time helpers (mkdocs.yml names both).

``on_files``, an mkdocs hook: the notebooks in ``notebooks/`` become pages at ``notebooks/``.
They stay where the test suite runs them; mkdocs-jupyter renders them with their stored
outputs (no kernel runs at build time).

``ExampleSections``, a griffe extension: functree's docstrings title their doctests
``Example:`` (also ``Example (a note):`` and ``Example: a note``); griffe's Google parser
knows only ``Examples:`` as a section of code (others become prose, where ``[1.0, 0.5]``
reads as a Markdown link, and a doctest a blockquote). It renames the title before parsing,
the note becoming the example's first line, so every example renders as code. A class whose
docstring is built at import (``__doc__ = _DOC.format(...)``: the convolutions and pools),
which griffe's static reading leaves empty, gets the docstring Python sees.
"""

import importlib
import inspect
import pathlib
import re

import griffe
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).parent
# "Example:", "Example (a note):" (parentheses inside the note too), "Example: a note"; the
# line after it is indented deeper (the example itself)
EXAMPLE_TITLE = re.compile(
    r"^(?P<indent>[ \t]*)Example(?: \((?P<note>[^\n]*)\):|:(?P<after>[^\n]*))[ \t]*\n"
    r"(?=(?P=indent)[ \t]+\S)", re.MULTILINE)


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        # src_dir is the repository root, so the page's source is the notebook itself
        files.append(File(f"notebooks/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


class ExampleSections(griffe.Extension):
    # on_instance and on_class_members: events of griffe 1.x and 2.x alike (on_object is 2.x's)
    def on_instance(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = examples_titled(obj.docstring.value)

    def on_class_members(self, *, cls, **kwargs):
        if cls.docstring is None and "__doc__" in cls.members:
            doc = runtime_docstring(cls.path)
            if doc:
                cls.docstring = griffe.Docstring(examples_titled(doc), parent=cls)


def examples_titled(docstring):
    """``docstring`` with each example's title ``Examples:`` (griffe's section of code),
    and an ``Examples:`` title above each doctest that follows a paragraph of prose (in
    prose, Markdown reads ``>>>`` as a nested blockquote)."""
    lines = EXAMPLE_TITLE.sub(_examples_title, docstring).split("\n")
    out = []
    for i, line in enumerate(lines):
        if line.lstrip().startswith(">>>") and (i == 0 or not lines[i - 1].strip()):
            indent = _indent(line)
            above = next((t for t in reversed(lines[:i]) if t.strip() and _indent(t) < indent), None)
            if above is not None and above.strip() != "Examples:":
                out.append(" " * _indent(above) + "Examples:")
        out.append(line)
    return "\n".join(out)


def _indent(line):
    return len(line) - len(line.lstrip())


def _examples_title(match):
    indent = match.group("indent")
    note = (match.group("note") or match.group("after") or "").strip().rstrip(":")
    return f"{indent}Examples:\n" + (f"{indent}  {note[:1].upper()}{note[1:]}:\n" if note else "")


def runtime_docstring(path):
    """The docstring Python gives the object at ``path`` (``functree.nn.Conv2D``), or None."""
    module, _, name = path.rpartition(".")
    try:
        obj = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None
    doc = obj.__dict__.get("__doc__") if isinstance(obj, type) else None
    return inspect.cleandoc(doc) if isinstance(doc, str) else None
