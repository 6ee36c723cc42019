"""The errors a checkpoint raises: :class:`CheckpointError` (a directory or checkpoint that
cannot be used as asked) and :class:`SpecError` (a stored tree that cannot be rebuilt from
its description), with the message naming a damaged description's key path.

Both are defined here, below the writer (:mod:`._treespec`) and the reader
(:mod:`._decode`) of a tree's description, which raise them.
"""

from __future__ import annotations

__all__ = ["MALFORMED", "CheckpointError", "SpecError", "text_literal"]

# The module these classes were defined in until the reader moved out of it: the name a
# traceback shows (``functree.train.checkpoint._treespec.CheckpointError: ...``, as in
# ft.train.migrate's example) and pickle looks them up by (_treespec imports them).
_SHOWN_IN = "functree.train.checkpoint._treespec"

MALFORMED = """\
The checkpoint's type description is damaged at {path!r}: {why}.
The checkpoint cannot be rebuilt from it; restore another step, or load with a template
to read the arrays alone:  ft.train.load(path, template=model)"""


class CheckpointError(ValueError):
    """A checkpoint directory or checkpoint that cannot be used as asked.

    Example:
      >>> import functree as ft, tempfile
      >>> try:
      ...     ft.train.load(tempfile.mkdtemp() + "/missing")
      ... except ft.train.CheckpointError as e:
      ...     print(str(e).splitlines()[0])
      No checkpoint at ...missing: there is no such file or directory ...
    """

    __module__ = _SHOWN_IN


class UnsavableKeyError(CheckpointError):
    """A dict key no file can hold (a tuple, a float, a KeyPath, a lone surrogate), with what
    is wrong (``why``), the key and a text for it (``key_text``: no other key of its dict,
    an ``np.str_``'s trailing NULs kept) and the key as the message shows it (``shown``:
    its repr, an ``np.str_``'s with its NULs): ``ft.export`` words its fix for a function's
    results from them (:func:`text_literal`), a checkpoint's for a save."""

    def __init__(self, message: str, why: str, key: object, key_text: str, shown: str | None = None):
        super().__init__(message)
        self.why, self.key, self.key_text = why, key, key_text
        self.shown = repr(key) if shown is None else shown


def text_literal(text: str) -> str:
    """``text`` as the Python literal a fix shows: double-quoted where ``repr`` would print it
    in single quotes with no double quote inside, ``repr`` otherwise; a NUL or another control
    character escaped (``"a\\x00"``), never printed raw, where it would hide in the message.

    Example:
      >>> print(text_literal("1_2"), text_literal("a\\x00"), text_literal("it's"))
      "1_2" "a\\x00" "it's"
    """
    shown = repr(text)
    return f'"{shown[1:-1]}"' if shown.startswith("'") and '"' not in text else shown


class SpecError(CheckpointError):
    """A stored tree cannot be rebuilt from its description alone."""

    __module__ = _SHOWN_IN
