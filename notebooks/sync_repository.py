"""Write pyproject.toml's repository into every notebook's Colab badge and install cell.

    python notebooks/sync_repository.py      # after changing [project.urls] Repository

No package named functree is published, so each notebook's first code cell installs it
from the repository its Colab badge opens (``%pip install -q git+https://github.com/OWNER/REPO``).
pyproject.toml's ``Repository`` URL is the one place naming it; tests/test_notebooks.py
checks that every notebook agrees with it.
"""

from __future__ import annotations

import json
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("*.ipynb"))
BADGE = "https://colab.research.google.com/github/{repo}/blob/main/notebooks/{name}"
BADGE_PATTERN = re.compile(r"https://colab\.research\.google\.com/github/[^)\s]+")
INSTALL = """\
try:
    import functree  # noqa: F401
except ImportError:  # Colab or a fresh environment: functree from its repository
    %pip install -q git+https://github.com/{repo}"""


def repository() -> str:
    """``OWNER/REPO`` from pyproject.toml's ``[project.urls] Repository``."""
    urls = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]["urls"]
    return urls["Repository"].removeprefix("https://github.com/").strip("/")


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def sync(path: pathlib.Path, repo: str, *, write: bool = True) -> bool:
    """Whether ``path``'s badge or install cell differed from ``repo``'s (rewritten if ``write``)."""
    text = path.read_text(encoding="utf-8")
    nb = json.loads(text)
    markdown = next(c for c in nb["cells"] if c["cell_type"] == "markdown")
    code = next(c for c in nb["cells"] if c["cell_type"] == "code")
    badge = BADGE_PATTERN.sub(BADGE.format(repo=repo, name=path.name), "".join(markdown["source"]))
    markdown["source"], code["source"] = _lines(badge), _lines(INSTALL.format(repo=repo))
    new = json.dumps(nb, indent=1, ensure_ascii=False) + "\n"
    if write and new != text:
        path.write_text(new, encoding="utf-8")
    return new != text


if __name__ == "__main__":
    repo = repository()
    changed = [p.name for p in NOTEBOOKS if sync(p, repo)]
    print(f"{repo}: rewrote {changed}" if changed else f"{repo}: every notebook already uses it")
    sys.exit(0)
