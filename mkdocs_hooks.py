"""The documentation site's two build-time helpers (mkdocs.yml names both).

``on_files``, an mkdocs hook: the notebooks in ``notebooks/`` become pages at ``notebooks/``.
They stay where the test suite runs them; mkdocs-jupyter renders them with their stored
outputs (no kernel runs at build time).

``ExampleSections``, a griffe extension: functree's docstrings title their doctests
``Example:``; griffe's Google parser knows only ``Examples:`` as a section of code (others
become prose, where ``[1.0, 0.5]`` reads as a Markdown link). It renames the title before
parsing, so every example renders as code.
"""

import pathlib
import re

import griffe
from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

ROOT = pathlib.Path(__file__).parent
EXAMPLE_TITLE = re.compile(r"^([ \t]*)Example(?: \(([^)\n]*)\))?:[ \t]*$", re.MULTILINE)


@event_priority(100)  # before mkdocs-jupyter's on_files, which wraps the notebooks
def on_files(files, config):
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        # src_dir is the repository root, so the page's source is the notebook itself
        files.append(File(f"notebooks/{path.name}", src_dir=str(ROOT), dest_dir=config["site_dir"],
                          use_directory_urls=config["use_directory_urls"]))
    return files


class ExampleSections(griffe.Extension):
    def on_object(self, *, obj, **kwargs):
        if obj.docstring is not None:
            obj.docstring.value = EXAMPLE_TITLE.sub(_examples_title, obj.docstring.value)


def _examples_title(match):
    indent, note = match.group(1), match.group(2)
    return f"{indent}Examples:" + (f"\n{indent}  {note[:1].upper()}{note[1:]}:" if note else "")
