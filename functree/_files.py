"""Paths a user gives a call that reads or writes files: one reading of them for all.

A path under ``~`` is the user's home, as a shell reads it: taken literally it was a folder
named ``~`` in the working directory (``CSVLogger("~/runs/log.csv")``, ``save_hf(model,
"~/models/m")``), which no read from another directory found and which is commonly removed
with ``rm -rf ~`` (the home itself). A relative path is made absolute at the call: a logger
made before a notebook's ``os.chdir`` writes where it was told, not under the new working
directory. ``"./~/m"`` stays the folder named ``~`` here, as in a shell; a read of ``"~/m"``
that only such a folder holds is refused with that path (:func:`read_path`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

__all__ = ["LITERAL_TILDE", "local_if_path", "local_path", "read_path"]

LITERAL_TILDE = """\
{call}: {given!r} is {expanded} ("~" is your home directory, as a shell reads it), which \
does not exist. {literal} does: a folder named "~" in the working directory, where a writer \
that takes "~" literally puts it (transformers' save_pretrained({given!r}) does). Give that folder with "./":

    wrong:  {call}(... {given!r} ...)
    right:  {call}(... {fixed!r} ...)

(To delete that folder, name it so too: rm -r ./~   while rm -r ~ deletes your home.)"""


def local_path(path: str | os.PathLike[str]) -> Path:
    """``path`` as every call reads or writes it: a leading ``~`` expanded as a shell does
    (``os.path.expanduser`` on the text: pathlib would drop the ``./`` of ``"./~/m"`` first,
    and raise for an unknown ``~user``, which a shell leaves as it is), then absolute at the
    call (a later ``chdir`` moves nothing)."""
    return Path(os.path.expanduser(os.fspath(path))).absolute()


def read_path(path: str | os.PathLike[str], call: str) -> Path:
    """:func:`local_path` of a path ``call`` reads, refused (:data:`LITERAL_TILDE`) where a
    ``~`` path names nothing in the home but a folder named ``~`` here holds it: the one a
    tool that takes ``~`` literally wrote (Hugging Face's ``save_pretrained`` does), which
    its ``from_pretrained`` reads from this directory. Neither read silently: the fix is named."""
    local = local_path(path)
    given = os.fspath(path)
    if given.startswith("~") and not local.exists():
        literal = Path(given).absolute()
        if literal.exists():
            raise FileNotFoundError(LITERAL_TILDE.format(call=call, given=given, expanded=local, literal=literal,
                                                         fixed=os.path.join(".", given)))
    return local


def local_if_path(value: Any, call: str) -> Any:
    """``value`` as a ``str`` (messages quote it) through :func:`read_path` where it is a path
    ``call`` reads; anything else (a state dict, a config, a model) as given. For the calls
    that take either (``from_hf(source, weights)``, ``with_head(model_or_directory, ...)``)."""
    return os.fspath(read_path(value, call)) if isinstance(value, (str, os.PathLike)) else value
