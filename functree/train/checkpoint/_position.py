"""A data iterator's position in a checkpoint: JSON values, and bytes as tagged base64.

An iterator that reports its position (``get_state()`` / ``set_state(state)``) travels
with the job. grain's ``DataLoader`` iterator returns its position as ``bytes`` (JSON
text); ``grain``'s dataset iterators return dicts. A checkpoint's metadata is JSON, so
bytes are written as ``{"__functree__": "bytes", "base64": "..."}``: data, decoded by
``base64`` alone (nothing is imported, called or unpickled because a checkpoint names
it). A dict of the iterator's own that has the tag key is escaped
(``{"__functree__": "dict", "items": [[key, value], ...]}``), so reading gives back
exactly the value ``get_state()`` returned (tuples as lists, as JSON has no tuple).

Example:
  >>> from functree.train.checkpoint._position import decode, encode
  >>> saved = encode({"loader": b'{"index": 3}', "epoch": 2})
  >>> saved
  {'loader': {'__functree__': 'bytes', 'base64': 'eyJpbmRleCI6IDN9'}, 'epoch': 2}
  >>> decode(saved)
  {'loader': b'{"index": 3}', 'epoch': 2}
"""

from __future__ import annotations

import base64
import binascii
import json
from typing import Any

__all__ = ["encode", "decode", "storable", "DATA_STATE_NOT_STORABLE", "BAD_DATA_STATE"]

TAG = "__functree__"

DATA_STATE_NOT_STORABLE = """\
The data iterator ({kind}) reports its position with get_state(), but {given} is not \
JSON (numbers, strings, lists, dicts) or bytes, so it cannot go into the checkpoint.
Return a JSON-able or bytes position from get_state(), as grain's iterators do:

    wrong:  def get_state(self): return self            # an object
    right:  def get_state(self): return {{"epoch": 3, "index": 120}}
       or:  def get_state(self): return json.dumps(...).encode()"""

BAD_DATA_STATE = """\
The checkpoint's data position is corrupt at {where}: {why}. The checkpoint's config \
was changed or damaged after it was written (a position is written as JSON, bytes as \
{{"__functree__": "bytes", "base64": "..."}}). Restore another checkpoint, or restore \
this one and start the data from its beginning:

    right:  trainer.restore(path, step=other_step)"""


def encode(state: Any) -> Any:
    """``state`` (JSON values and bytes, nested) as JSON values (bytes tagged)."""
    if isinstance(state, (bytes, bytearray)):
        return {TAG: "bytes", "base64": base64.b64encode(bytes(state)).decode("ascii")}
    if isinstance(state, dict):
        items = {k: encode(v) for k, v in state.items()}
        if TAG in state:  # the iterator's own dict that looks like a tag: escaped
            return {TAG: "dict", "items": [[k, v] for k, v in items.items()]}
        return items
    if isinstance(state, (list, tuple)):
        return [encode(v) for v in state]
    return state


def decode(saved: Any, where: str = "data_state") -> Any:
    """The value :func:`encode` was given, from its JSON form; a malformed tag is an error
    naming where it is (``where``: its path in the position)."""
    if isinstance(saved, list):
        return [decode(v, f"{where}[{i}]") for i, v in enumerate(saved)]
    if not isinstance(saved, dict):
        return saved
    if TAG not in saved:
        return {k: decode(v, f"{where}[{k!r}]") for k, v in saved.items()}
    kind = saved[TAG]
    if kind == "bytes" and set(saved) == {TAG, "base64"} and isinstance(saved["base64"], str):
        try:
            return base64.b64decode(saved["base64"].encode("ascii"), validate=True)
        except (binascii.Error, UnicodeEncodeError) as e:
            raise ValueError(BAD_DATA_STATE.format(where=where, why=f"its bytes are not base64 ({e})")) from None
    if kind == "dict" and set(saved) == {TAG, "items"} and isinstance(saved["items"], list) and all(
            isinstance(p, list) and len(p) == 2 and isinstance(p[0], str) for p in saved["items"]):
        return {k: decode(v, f"{where}[{k!r}]") for k, v in saved["items"]}
    raise ValueError(BAD_DATA_STATE.format(where=where, why=f"an unknown or malformed tag {str(saved)[:120]}"))


def storable(state: Any) -> bool:
    """Whether a data iterator's ``get_state()`` can go into a checkpoint (JSON and bytes)."""
    try:
        json.dumps(encode(state))
    except (TypeError, ValueError):
        return False
    return True
