"""Paths a user gives a call that reads or writes files: one reading of them for all.

A path under ``~`` is the user's home, as a shell reads it: taken literally it was a folder
named ``~`` in the working directory, which no read from another directory found and which
is commonly removed with ``rm -rf ~`` (the home itself). A relative path is made absolute at
the call: a later ``os.chdir`` moves nothing. ``"./~/m"`` stays the folder named ``~`` here,
as in a shell.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["local_path"]


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as every call reads or writes it: a leading ``~`` expanded as a shell does
    (``os.path.expanduser`` on the text: pathlib would drop the ``./`` of ``"./~/m"`` first,
    and raise for an unknown ``~user``, which a shell leaves as it is), then absolute at the
    call (a later ``chdir`` moves nothing)."""
    return Path(os.path.expanduser(os.fspath(path))).absolute()
