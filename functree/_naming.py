"""Names and patterns: the one place where a tree's parameters get their names and a
glob pattern becomes a selection.

**Names.** Every leaf has the dotted name of its key path, as :func:`ft.to_flat_dict`
spells it: ``encoder.layers.0.weight`` (fields, indices and dict keys joined by ``.``).

* A leaf of an ``ft.nn.Stack`` (any stacked node) has its *stacked name*
  (``h.layers.weight``, shape ``(n, ...)``) and one *member name* per member
  (``h.0.weight`` ... ``h.{n-1}.weight``, shape ``(...)``): the stack's own name, the
  member's index, then the name inside the member. Stacks inside stacks give
  ``a.1.b.3.w``.
* A parameter of an ``ft.nn.Shared`` (any tied node) at ``P`` is stored once, under
  ``P.model.x`` (the name of :func:`ft.to_flat_dict` and of checkpoints), and answers
  also to the names of the resolved model, without ``model.``: ``P.x``, and
  ``P.target`` for every tie ``{target: x}`` (``embed.embeddings`` and ``head.weight``
  for an LM whose head is tied to its embedding). These are the names torch gives it.
  A Stack of tied blocks gives each member those names too (``h.1.head.weight``).
* A dict key ``""`` is a name part as any other, as JAX spells it: a Stack under it is
  ``.layers.weight``, its members ``.0.weight``.

**Patterns.** A pattern is a glob, matched case-sensitively against dotted names
(:func:`fnmatch.fnmatchcase`): ``*`` matches any characters, dots included; ``?`` one
character; ``[01]`` or ``[0-3]`` one character of a set or range; a leading ``.`` is
allowed (``.encoder.*``). A pattern *selects a leaf* when it matches one of its names
or a dotted prefix of one: ``encoder`` selects ``encoder.weight`` (everything under a
node). Inside a larger tree (an optimizer state, whose moments are named
``1.mu.encoder.weight``) a sharding rule matches a name after any dotted prefix, too
(``anywhere=True``), so the moments follow their parameter's rule.

**Member patterns.** A pattern that matches the stacked name or a prefix of it selects
the whole leaf (``h.*``, ``*.weight``, ``h``); one that matches only some member names
selects those members: ``h.2.*`` (member 2), ``h.[0-1].*`` (members 0 and 1),
``h.1[0-5].*`` (10 to 15). A selection is then, per leaf, ``True``, ``False`` or,
for a leaf partly selected, a boolean NumPy array over the stack axes (shape ``(n,)``,
``(n1, n2)`` for nested stacks) with ``True`` at the selected members.
A leaf with more leading axes than its stacks' (``[E, n, ...]``: an ensemble of models
made with ``jax.vmap``, told apart by the ranks a stack records) is refused when some of
its members are selected or indexed (:data:`ENSEMBLE_MEMBER`): such patterns work inside
``jax.vmap`` over the ensemble.

**Layer patterns.** Consumers that pick layers rather than leaves (``layouts=`` of the
torch converters) use the same globs on a layer's dotted name (``h.0.attn``): a pattern
picks a layer when it matches its name or a dotted prefix of it (``blocks.*``, ``*.attn``,
``blocks``), :func:`matches`.

**Rename patterns** (the torch converters' ``rename=``): the one second form, for
rewriting a name rather than selecting one. ``*`` matches exactly one name part (any
characters but ``.``; ``layer_*`` matches ``layer_3``), every other character only
itself (``?`` and ``[`` too); the pattern matches a name's first whole dotted parts,
and what each ``*`` matched fills the replacement's ``*`` in order: ``transformer.h.*`` →
``blocks.*`` renames ``transformer.h.3.attn.weight`` to ``blocks.3.attn.weight``
(:func:`rename_pattern`, :func:`fill_stars`).

**Errors.** A pattern that selects nothing raises naming the closest names; a member
index past a stack's end (``h.7.*`` for 4 members; ``a.1.b.7.*`` for a Stack ``b`` inside
the Stack ``a``) or counted from it (``h.-1.*``: member names count from 0) raises naming
the stack's length. A
tree whose names a pattern cannot tell apart (two leaves of one name, one leaf's name a
dotted prefix of another's: dict keys containing ``.``) is refused (:data:`functree._collisions.NAMES_COLLIDE`).

Example:
  >>> import functree as ft, jax
  >>> from functree import _naming
  >>> h = ft.nn.Stack(lambda k: ft.nn.Dense(2, 2, key=k), 4, key=jax.random.key(0))
  >>> [i.name for i in _naming.leaf_infos({"h": h})]
  ['h.layers.weight', 'h.layers.bias']
  >>> _naming.member_names(_naming.leaf_infos({"h": h})[0])
  ['h.0.weight', 'h.1.weight', 'h.2.weight', 'h.3.weight']
  >>> _naming.selection({"h": h}, ("h.[2-3].*",))
  (array([False, False,  True,  True]), array([False, False,  True,  True]))
"""

from __future__ import annotations

import dataclasses
import difflib
import fnmatch
import itertools
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from functree._collisions import refuse_collisions, str_keys_only
from functree._fields import STATIC, field_kind
from functree._tree import bounded_put, cached, dotted_name, is_none, join_names

__all__ = [
    "LeafInfo", "leaf_infos", "names", "member_names", "matches", "rename_pattern", "fill_stars", "selection",
    "closest", "suggestion", "check_patterns", "member_rule_names", "NothingSelected", "refuse_batched_members",
    "refuse_batched_selection", "is_tied", "resolve_alias", "tie_targets", "untransform", "TIE_SPLIT", "split_tie", "refuse_split_tie", "TIED_HEAD",
    "tied_head", "STATIC_FIELD", "static_field", "literal_pattern",
]

SELECTS_NOTHING = """\
{what}: the pattern {pattern!r} selects no {kind}. Closest names: {close}.
Patterns are globs over dotted names (see ft.to_flat_dict(model, unstack=True)):
    wrong:  {wrong}
    right:  {right}"""

MEMBER_OUT_OF_RANGE = """\
{what}: the pattern {pattern!r} names member {index} of {stack!r}, which holds {n} members \
(0 to {last}).
    wrong:  {pattern!r}
    right:  {right!r}"""

ENSEMBLE_MEMBER = """\
{path!r} addresses a member of the ft.nn.Stack {stack!r} ({n} members), but its leaf \
{leaf!r} has shape {shape}, with leading axes before the member axis: each model's leaf is \
{expected} ([n, ...]), so this is a batch of models (an ensemble made with jax.vmap). A \
member index or pattern cannot tell those axes apart: use it inside jax.vmap over the \
ensemble, one model at a time (patterns selecting whole leaves, "blocks.*", work on the ensemble):
    wrong:  {path!r} given with the ensemble (ft.get, ft.set, wrt=, groups, masks)
    right:  jax.vmap(lambda m: ft.get(m, {path!r}))(ensemble)        # ft.get / ft.set
       or:  jax.vmap(ft.gradient(loss, wrt={path!r}))(ensemble)      # the operators' wrt=
       or:  jax.vmap(lambda m, s: opt.minimize(loss, m, s))(ensemble, jax.vmap(opt.init)(ensemble))
                                                   # an optimizer with wrt= or groups on {path!r}"""

MASK_AXES = """\
A member selection of shape {selection} (members of an ft.nn.Stack) meets a leaf of shape \
{shape}, whose leading axes are not the Stack's: a batch of models (an ensemble made with \
jax.vmap) takes member patterns inside jax.vmap, one model at a time:
    wrong:  ft.gradient(loss, wrt="blocks.1.*")(ensemble)
    right:  jax.vmap(ft.gradient(loss, wrt="blocks.1.*"))(ensemble)"""


TIE_SPLIT = """\
{what}: the pattern {pattern!r} selects the tied parameter {stored!r} by its tie name {hit!r} \
but not by its own name {miss!r}. A tie is one tensor (torch's one Parameter): one learning \
rate, one decay, trained or frozen under both names, and torch's recipes disagree here: \
model.<module>.parameters() holds the tie, a filter over named_parameters() (which names it \
once, by its own name) does not. Say which: by its own name (or an exact name, no glob \
characters), or keep the glob off it:
    wrong:  {wrong}
    right:  {right}
       or:  {other}"""


TIED_HEAD = """\
{what}: the pattern {pattern!r} names the output head {head!r}, which holds no weight of its \
own: the model ties it to its token embedding {embedding!r} (torch's {head}.weight is that \
one Parameter), so the pattern selects no parameter{silently}. Name the embedding, which is \
the head's weight:
    wrong:  {pattern!r}
    right:  {right!r}"""


STATIC_FIELD = """\
{what}: the pattern {pattern!r} names {name!r}, the static field {field!r} of {cls} \
(ft.field(static=True): configuration kept in the tree definition, a Python value with no \
gradient, no optimizer state and no decay), so it selects no parameter. Select the layer's \
parameters, or make the field one (an array field without static=True) to train it:
    wrong:  {pattern!r}
    right:  {right!r}"""


def static_field(tree: Any, pattern: str, whole: bool = False) -> tuple[str, str, str] | None:
    """``(name, class name, field)`` of the first static field (``ft.field(static=True)``)
    of a Module in ``tree`` that ``pattern`` selects by its dotted name (a Stack's by its
    stacked and member names: ``blocks.layers.alpha``, ``blocks.1.alpha``; ``whole``: the
    whole name only), else None.
    Static fields are no leaves: read for an error only.

    Example:
      >>> import functree as ft, jax
      >>> from functree._naming import static_field
      >>> model = {"q": ft.nn.lora(ft.nn.Dense(2, 2, key=jax.random.key(0)), "*", rank=1, key=jax.random.key(1))}
      >>> static_field(model, "*.alpha")
      ('q.alpha', 'LoraDense', 'alpha')
    """
    test = _whole if whole else matches
    for name, cls, field in _static_names(tree, ""):
        if test(name, pattern):
            return name, cls, field
    return None


def _static_names(node: Any, prefix: str) -> Iterator[tuple[str, str, str]]:
    """Every static field's dotted name under ``node`` (named ``prefix``), with its class
    and field name; a stacked node's under its stacked and member names."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        for f in dataclasses.fields(node):
            name = join_names(prefix, f.name)
            if field_kind(f) == STATIC:
                yield name, type(node).__name__, f.name
            elif f.init or hasattr(node, f.name):
                inner = list(_static_names(getattr(node, f.name, None), name))
                yield from inner
                if is_stacked(node) and f.name == "layers":
                    for i in range(len(node)):  # pyright: ignore[reportArgumentType]
                        yield from ((join_names(prefix, str(i)) + n[len(name):], c, k) for n, c, k in inner)
        return
    if isinstance(node, (list, tuple, dict)):
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, child in items:
            yield from _static_names(child, join_names(prefix, str(k)))


def tied_head(tree: Any, pattern: str, picked: Sequence[Any], leaves: Sequence[Any]) -> str | None:
    """:data:`TIED_HEAD`'s fields ``(head, embedding)`` where ``pattern`` names a model's
    output head (the registered :data:`FOREIGN_NAMES` head: a ``from_hf`` LM's ``lm_head``)
    and selects no array but the head's own (``picked``: its selection per leaf of
    ``leaves``; a tied head's bias, Phi's), the head holding no ``weight`` of its own
    (tied: its slot ``None``, or a bias alone); else None."""
    infos = leaf_infos(tree)
    hits = [i.name for i, c, x in zip(infos, picked, leaves) if np.any(c) and x is not None]
    if len(hits) > 2:  # (a head holds a weight and a bias: more selects more than a head)
        return None
    try:
        head = foreign_names(tree).head
    except Exception:  # (an error message's helper: never a second error in its place)
        return None
    if head is None or not (matches(f"{head}.weight", pattern) or matches(head, pattern)):
        return None
    if any(not matches(n, head) for n in hits):
        return None  # the pattern selects more than the head
    if any(matches(n, f"{head}.weight") and x is not None for i, x in zip(infos, leaves) for n in (i.name, *i.aliases)):
        return None  # a head with a weight of its own
    tables = [(np.shape(x)[0], i.name) for i, x in zip(infos, leaves)
              if x is not None and i.name.endswith("embeddings") and np.ndim(x) == 2]
    return None if not tables else max(tables)[1]  # the vocabulary: the largest table


def _tie_names(info: LeafInfo) -> list[tuple[str, tuple[str, ...]]]:
    """``(stored name, tie names)`` of each tied parameter of a leaf (each member of a
    stacked one): the names it answers to through an ``ft.nn.Shared`` (two or more: its
    source's and each target's); ``[]`` for a leaf that no tie names twice."""
    if info.sizes:
        if len(info.member_aliases) < 2:
            return []
        return [(_member_name(info, idx), tuple(_member_name(a, idx) for a in info.member_aliases))
                for idx in itertools.product(*(range(n) for n in info.sizes))]
    return [(info.name, info.aliases)] if len(info.aliases) > 1 else []


def tie_fix(tree: Any, pattern: str, only: Sequence[bool] | None = None) -> tuple[str, ...]:
    """The names ``pattern`` selects besides the ties (a tied parameter's: :func:`split_tie`),
    by the name the pattern matches (a member's where it selects members): the glob kept off
    the ties, ``("head.bias",)`` for ``"head.*"``."""
    infos = leaf_infos(tree)
    if only is None:
        only = [x is not None for x in jax.tree.leaves(tree, is_leaf=is_none)]
    out: list[str] = []
    for info, ok in zip(infos, only):
        if not ok or _tie_names(info):  # a tie (another member's: split alike) is no name to keep
            continue
        whole = [n for n in _leaf_names(info) if matches(n, pattern)]
        if whole and not info.sizes:
            out.append(next((n for n in whole if n != info.name), whole[0]))
            continue
        forms = (info, *info.member_aliases)
        hits = [i for i, form in enumerate(forms) if whole or _member_hits(form, pattern).all()]
        if hits:  # every member: one glob over them (h.*.head.bias)
            out.append(_member_glob(forms[hits[-1] if len(hits) > 1 else hits[0]]))
            continue
        for idx in itertools.product(*(range(n) for n in info.sizes)):
            own = [_member_name(i, idx) for i in forms]
            if any(matches(n, pattern) for n in own):
                out.append(next((n for n in own[1:] if matches(n, pattern)), own[0]))
    return tuple(out)


def _member_glob(info: LeafInfo) -> str:
    """Every member name of a stacked leaf as one glob, ``*`` for each index: ``h.*.head.bias``."""
    return _member_name(info, ["*"] * len(info.sizes))  # type: ignore[list-item]


def refuse_split_tie(tree: Any, patterns: Sequence[str], what: str, code: Callable[[tuple[str, ...]], str],
                     only: Sequence[bool] | None = None) -> None:
    """:data:`TIE_SPLIT` where ``patterns`` (one choice: trained, frozen, decayed) select a
    tied parameter by a tie target's name only (:func:`split_tie`); ``code(patterns)``
    writes the call that takes them (``ft.optim.freeze('head.*')``) for the message's lines:
    the tie added by its own name, or the glob kept off it (:func:`tie_fix`)."""
    found = split_tie(tree, patterns, only)
    if found is None:
        return
    pattern, stored, hit, miss = found
    kept = tuple(p for p in patterns if p != pattern) + tie_fix(tree, pattern, only)
    raise ValueError(TIE_SPLIT.format(
        what=what, pattern=pattern, stored=stored, hit=hit, miss=miss, wrong=code(tuple(patterns)),
        right=f"{code((*patterns, miss))}   # the tie too, by its own name",
        other=(f"{code(kept)}   # the glob kept off the tie" if kept
               else f"leave {pattern!r} out (it selects the tie alone): the tie left out")))


def _torch_spellings(name: str) -> tuple[str, ...]:
    """``name`` and its spellings in torch's leaf names (an embedding's ``embeddings`` is
    torch's ``weight``): ``"*.weight"`` selects a tie by ``embed.embeddings`` too, as torch's
    ``embed.weight``."""
    head, _, leaf = name.rpartition(".")
    torch = [t for t, ours in _SYNONYMS.items() if leaf in ours and t in ("weight", "bias")]
    return (name, *(f"{head}.{t}" if head else t for t in torch))


def split_tie(tree: Any, patterns: Sequence[str],
              only: Sequence[bool] | None = None) -> tuple[str, str, str, str] | None:
    """``(pattern, stored name, a name selected, its source's name)`` for the first tied
    parameter of ``tree`` that ``patterns`` select by a tie target's name only (a glob, or
    a dotted prefix: ``"head.*"``, ``"head"`` select ``head.weight``), not by its source's
    (``embed.embeddings``), where neither its stored name nor an exact tie name is given;
    None when every tie is selected by its source's name or not at all. Torch's recipes
    disagree there: ``model.head.parameters()`` holds the tie, a filter over
    ``named_parameters()`` does not (it names the tie once, by its first module: the
    source's); selected by the source's name, both hold it.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> from functree._naming import split_tie
      >>> class LM(ft.Module):
      ...     embed: ft.nn.Embedding
      ...     head: ft.nn.Dense
      >>> lm = ft.nn.Shared(LM(ft.nn.Embedding(5, 2, key=jax.random.key(0)), ft.nn.Dense(2, 5, key=jax.random.key(1))),
      ...                   {"head.weight": ("embed.embeddings", jnp.transpose)})
      >>> split_tie(lm, ("head.*",))
      ('head.*', 'model.embed.embeddings', 'head.weight', 'embed.embeddings')
      >>> split_tie(lm, ("embed.*",)), split_tie(lm, ("head.*", "embed.*")), split_tie(lm, ("head.weight",))
      (None, None, None)
    """
    infos = leaf_infos(tree)
    for info, ok in zip(infos, only if only is not None else [True] * len(infos)):
        for stored, ties in _tie_names(info) if ok else []:
            picked = [p for p in patterns if any(matches(n, p) for n in (stored, *ties))]
            if not picked or any(p in (stored, *ties) or matches(stored, p) for p in picked):
                continue  # not selected, or by its own name: the one tensor
            source = ties[0]  # the tie's own name, torch's (its first module's) in named_parameters()
            if not any(matches(m, p) for p in picked for m in _torch_spellings(source)):
                pattern = next(p for p in picked if any(matches(n, p) for n in ties))
                own = _member_glob(info.member_aliases[0]) if info.sizes else source  # every member's
                return pattern, stored, next(n for n in ties if matches(n, pattern)), own
    return None


def refuse_batched_members(stack: Any, path: str, stack_name: str) -> None:
    """Raise :data:`ENSEMBLE_MEMBER` when the stacked node ``stack`` (at ``stack_name``) has
    a leaf with leading axes before its member axis (a jax.vmap-ed ensemble), where
    ``path`` (a key path or pattern) addresses one of its members."""
    bad = stack._batched_leaf() if hasattr(stack, "_batched_leaf") else None
    if bad is not None:
        name, shape, rank = bad
        expected = f"({len(stack)}, ...)" if rank is None else str(shape[len(shape) - 1 - rank:])
        raise ValueError(ENSEMBLE_MEMBER.format(path=path, stack=stack_name or "<root>", n=len(stack),
                                                leaf=join_names(stack_name, "layers", name), shape=shape,
                                                expected=expected))


class ForeignNames(NamedTuple):
    """A model's Dense members as the framework its weights come from names them: each
    member's module (``"layers.0.attention.query_projection"`` ->
    ``"model.layers.0.self_attn.q_proj"``) and the output head's module (PEFT's
    ``"all-linear"`` leaves it out), or None; and what else PEFT's ``"all-linear"`` reads
    there: the Dense members it leaves out because their module there is no Linear
    (``left_out``: transformers 5's sparse-MoE routers), and the stacked expert weights it
    adapts (``parameters``: ``"<Experts node>.<field>"`` -> the multiple of the rank and
    alpha it gives them, 2 for a weight fusing two of the Linears it once adapted)."""

    modules: dict[str, str]
    head: str | None
    left_out: frozenset[str] = frozenset()
    parameters: Mapping[str, int] = MappingProxyType({})


# The readers of ForeignNames, tried in order (``functree.hf`` adds Hugging Face's for a
# model of ``from_hf`` as it is imported): the naming layer sits below the packages that
# convert models and cannot import them, so they register here instead.
FOREIGN_NAMES: list[Callable[[Any], ForeignNames | None]] = []


def foreign_names(model: Any) -> ForeignNames:
    """The first registered reader's names for ``model``; none (``{}``, no head) for a model
    of ``ft.nn`` layers alone, whose patterns name its key paths."""
    for read in FOREIGN_NAMES:
        found = read(model)
        if found is not None:
            return found
    return ForeignNames({}, None)


class NothingSelected(ValueError):
    """A pattern selected nothing: ``pattern``, the ``close`` names, and ``out_of_range``
    (the message for a member index past a stack's end, else None)."""

    def __init__(self, message: str, pattern: str, close: list[str], out_of_range: str | None,
                 suggestion: str | None = None, foreign: bool = False):
        super().__init__(message)
        self.pattern, self.close, self.out_of_range = pattern, close, out_of_range
        self.suggestion = suggestion  # the pattern most likely meant (``suggestion()``), or None
        self.foreign = foreign  # the suggestion is the pattern's foreign names in ours (:func:`foreign_pattern`)


TIE_SHAPE = """\
The tied {target} takes shape {shape} (the transform of {source}); given shape {given}.
    right:  give {target} a value of shape {shape}, or {source} itself"""

NOT_INVERTIBLE = """\
Cannot write {target} (tied to a transform of {source}): the transform has no inverse \
functree can find (its linear transpose does not undo it). Give the source's value instead:
    right:  ft.set(model, "{source}", value)   # or {{"{source}": value}} in a state dict"""

BAD_PATTERN = "Patterns are strings like '*.bias' or 'h.2.*', got {given!r} ({type}).{hint}"

KEY_PATH_AS_PATTERN = " A key path is a pattern by its dotted name: path.name, here {text!r}."

REVERSED_RANGE = """\
The pattern {pattern!r} holds the character class {klass!r} with the reversed range \
{start}-{end}: a glob drops such a range (fnmatch), so the class selects other names than \
meant ('layers.[14-15].*' would select layers 1 and 5). A class matches one character, \
its ranges low to high; a number of several digits takes one class per digit:
    wrong:  {pattern!r}
    right:  {right}"""


MULTI_DIGIT_RANGE = """\
The pattern {pattern!r} holds the character class {klass!r} with the number range \
{number}: a class matches one character, so a glob (fnmatch) reads it as {reading}, not as \
the numbers {number} ('layers.[10-15].*' would select layers 0, 1 and 5). A number of \
several digits takes one class per digit:
    wrong:  {pattern!r}
    right:  {right}"""


KEY_PATH_STRING = """\
The pattern {pattern!r} is a printed key path (str(kp), as ft.get reads it): a glob reads \
{klass!r} as a character class, one character of {reading}, not as the key {key!r}, so it \
selects other names ("['qk'].weight" would select q.weight and k.weight, not qk.weight). A \
pattern is a dotted name (kp.name):
    wrong:  {pattern!r}
    right:  {right!r}"""

CARET_CLASS = """\
The pattern {pattern!r} holds the character class {klass!r}, which starts with '^': a glob \
(fnmatch) reads a '^' there as the character '^', not as "not" as a regular expression, \
PEFT's target_modules and the shell do, so the class matches one character of {reading} \
('layers.[^0].*' would select layer 0 only, not every layer but 0). A glob negates a class \
with '!' (a '^' meant as a character goes after the first place: '[0^]'):
    wrong:  {pattern!r}
    right:  {right!r}"""


def key_path_hint(given: Any) -> str:
    """:data:`KEY_PATH_AS_PATTERN` for a ``KeyPath`` given where a pattern belongs, else "".
    (By class name: ``functree._paths`` imports this module.)"""
    return KEY_PATH_AS_PATTERN.format(text=given.name) if type(given).__name__ == "KeyPath" else ""


def is_stacked(x: Any) -> bool:
    """Whether ``x`` is a stacked node (an ``ft.nn.Stack``: ``__ft_stacked__ = True``)."""
    return getattr(type(x), "__ft_stacked__", False) is True


def is_tied(x: Any) -> bool:
    """Whether ``x`` is a tied node (an ``ft.nn.Shared``: ``__ft_tied__ = True``, a ``model``
    field and ``ties``, a tuple of ``(target, source, transform)`` key paths)."""
    return getattr(type(x), "__ft_tied__", False) is True


class LeafInfo(NamedTuple):
    """The names of one leaf (JAX flatten order, ``None`` leaves included).

    ``name`` is its dotted name (a stacked leaf's stacked name); ``segments`` and
    ``sizes`` spell its member names (``segments[0].i.segments[1]``, ``i < sizes[0]``;
    no sizes: not stacked); ``aliases`` are the other names of a tied parameter;
    ``ndim`` a stacked leaf's rank, its stack axes included, when the stack recorded its
    members' ranks (None: unknown). A leaf of more axes is a batch of models.
    ``member_aliases`` spell a stacked leaf's other member names, one :class:`LeafInfo`
    (segments and sizes) per tie name: ``h.1.head.weight`` for a Stack of tied blocks.
    A stacked leaf at the dict key ``""`` has an empty ``segments[0]`` and a ``name``
    starting with ``.`` (``.layers.w``): its member names start with ``.`` (``.0.w``).
    """

    name: str
    segments: tuple[str, ...]
    sizes: tuple[int, ...]
    aliases: tuple[str, ...] = ()
    ndim: int | None = None
    member_aliases: tuple[LeafInfo, ...] = ()  # a stacked leaf's other member names (ties)


def _member(node: Any, i: int) -> Any:
    """Member ``i`` of a stacked node (its structure: a leaf without a stack axis is every
    member's, as a mask's bools and a label's strings are)."""
    return node._member(i)


def _infos(tree: Any) -> list[LeafInfo]:
    """The :class:`LeafInfo` of every leaf of ``tree`` (``None`` included), uncached."""
    if is_stacked(tree):
        return _stacked_infos(tree)
    if is_tied(tree):
        return _tied_infos(tree)

    def special(x: Any) -> bool:
        return x is not tree and (is_stacked(x) or is_tied(x))

    out: list[LeafInfo] = []
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: x is None or special(x))
    for path, x in pairs:
        name = dotted_name(path)
        if is_stacked(x):
            out.extend(_prefixed(name, _stacked_infos(x)))
        elif is_tied(x):
            out.extend(_prefixed(name, _tied_infos(x)))
        else:
            out.append(LeafInfo(name, (name,), ()))
    return out


def _under(prefix: str, name: str) -> str:
    """``name`` under the node ``prefix`` (never the root: a dict key ``""`` is a name)."""
    return f"{prefix}.{name}" if name else prefix


def _keyed(info: LeafInfo) -> bool:
    """Whether a stacked leaf's stack is the dict key ``""`` (its name, not the root)."""
    return not info.segments[0] and info.name.startswith(".")


def _prefixed(prefix: str, infos: Sequence[LeafInfo]) -> list[LeafInfo]:
    """``infos`` of a node named ``prefix`` (a key path's name, ``""`` for the dict key
    ``""``: kept, as JAX's ``.layers.w``; :func:`join_names` would drop it)."""
    return [
        LeafInfo(_under(prefix, i.name),
                 (f"{prefix}.{i.segments[0]}" if i.segments[0] or _keyed(i) else prefix, *i.segments[1:]),
                 i.sizes, tuple(_under(prefix, a) for a in i.aliases), i.ndim,
                 tuple(_prefixed(prefix, i.member_aliases)))
        for i in infos
    ]


def _alias_forms(info: LeafInfo) -> tuple[LeafInfo, ...]:
    """A leaf's other names with their segments: a stacked leaf's member aliases, a
    leaf's aliases (not stacked: one name each)."""
    return info.member_aliases if info.sizes else tuple(LeafInfo(a, (a,), ()) for a in info.aliases)


def _stacked_infos(stack: Any) -> list[LeafInfo]:
    """A stacked node's leaves: JAX's names, and member names from member 0's leaves
    (a stacked node's leaves are its member's, in the same order, with stack axes); a
    tie inside the members (a Stack of ``ft.nn.Shared`` blocks) gives member aliases
    (``1.head.weight``), never a stacked alias (its transform is a member's)."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(stack, is_leaf=is_none)
    light = jax.tree.map(lambda _: 0, stack)  # no slicing: any leaves (arrays, specs, tracers)
    inner = _infos(_member(light, 0)) if len(stack) else []
    if len(inner) != len(pairs):  # a stacked node of another layout: no member names
        return [LeafInfo(dotted_name(p), (dotted_name(p),), ()) for p, _ in pairs]
    ranks = dict(getattr(stack, "ranks", None) or ())
    own, _ = jax.tree_util.tree_flatten_with_path(getattr(stack, "layers", None), is_leaf=is_none)
    recorded = [ranks.get(dotted_name(p)) for p, _ in own] if len(own) == len(pairs) else [None] * len(pairs)
    out = []
    for (p, _), i, r in zip(pairs, inner, recorded):
        name = dotted_name(p)
        head = name[: len(name) - len(i.name)] if name.endswith(i.name) else name + "."  # "layers."
        aliases = tuple(LeafInfo(head + a.name, ("", *a.segments), (len(stack), *a.sizes)) for a in _alias_forms(i))
        out.append(LeafInfo(name, ("", *i.segments), (len(stack), *i.sizes), (),
                            1 + r if r is not None else (None if i.ndim is None else 1 + i.ndim), aliases))
    return out


def _retied(name: str, ties: Sequence[tuple[str, str]]) -> list[str]:
    """``name`` (of the resolved model) as every tie target whose source holds it."""
    return [t + name[len(s):] for t, s in ties if name == s or name.startswith(s + ".")]


def _covered(name: str, targets: Sequence[str]) -> bool:
    return any(name == t or name.startswith(t + ".") for t in targets)


def _tied_infos(shared: Any) -> list[LeafInfo]:
    """A tied node's leaves (``model.x``), each also named ``x`` and by every tie target.
    A tie target's own slot (empty: ``None``) takes no name of the tie: the value under a
    target's name is its source's, wherever the target comes in flatten order."""
    pairs, _ = jax.tree_util.tree_flatten_with_path(shared, is_leaf=is_none)
    ties = [(t.name, s.name) for t, s, _ in shared.ties]
    infos = []
    for (path, _), info in zip(pairs, _infos(shared.model)):
        stored = LeafInfo(dotted_name(path), ("model." + info.segments[0] if info.segments[0] or _keyed(info)
                                              else "model", *info.segments[1:]), info.sizes, (), info.ndim)
        if _covered(info.name, [t for t, _ in ties]):
            infos.append(stored)
            continue
        own = [info.name, *info.aliases]
        aliases = own + [_under("model", a) for a in info.aliases] + [r for n in own for r in _retied(n, ties)]
        members = [info, *info.member_aliases] if info.sizes else []
        forms = members + _prefixed("model", info.member_aliases) + [
            LeafInfo(t + f.name[len(s):], (t + f.segments[0][len(s):], *f.segments[1:]), f.sizes)
            for f in members for t, s in ties if f.segments[0] == s or f.segments[0].startswith(s + ".")]
        unique = {f.segments: f for f in forms if f.segments != stored.segments}
        infos.append(stored._replace(aliases=tuple(a for a in dict.fromkeys(aliases) if a != stored.name),
                                     member_aliases=tuple(unique.values())))
    return infos


_INFOS: dict[Any, tuple[LeafInfo, ...]] = {}


def leaf_infos(tree: Any) -> tuple[LeafInfo, ...]:
    """The names of every leaf of ``tree`` in JAX flatten order, ``None`` leaves included;
    computed once per tree definition (for trees whose dict keys are strings)."""
    treedef = jax.tree.structure(tree, is_leaf=is_none)
    key, infos = cached(_INFOS, treedef)
    if infos is None:
        infos = tuple(_infos(tree))
        if key is not None and str_keys_only(tree):
            bounded_put(_INFOS, key, infos)
    return infos


def names(tree: Any) -> list[str]:
    """The dotted name of every leaf of ``tree`` (``None`` included), JAX flatten order."""
    return [i.name for i in leaf_infos(tree)]


def member_names(info: LeafInfo) -> list[str]:
    """Every member name of a stacked leaf, in C order over its stack axes (``[]`` if not stacked)."""
    if not info.sizes:
        return []
    return [_member_name(info, idx) for idx in itertools.product(*(range(n) for n in info.sizes))]


def _member_name(info: LeafInfo, index: Sequence[int]) -> str:
    parts = [info.segments[0]]
    for i, seg in zip(index, info.segments[1:]):
        parts += [str(i), seg]
    name = join_names(*parts)
    return "." + name if _keyed(info) else name  # the dict key "": .0.w, as JAX spells it


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[: i + 1]) for i in range(len(parts))]


def _spans(name: str, anywhere: bool) -> list[tuple[str, bool]]:
    """``(candidate, direct)``: the dotted prefixes of ``name`` (of every dotted suffix with
    ``anywhere``); ``direct`` when the candidate starts where ``name`` starts."""
    parts = name.split(".")
    starts = range(len(parts)) if anywhere else range(1)
    return [(".".join(parts[s:e]), s == 0) for s in starts for e in range(s + 1, len(parts) + 1)]


def matches(name: str, pattern: str, *, anywhere: bool = False) -> bool:
    """Whether ``pattern`` selects the leaf named ``name`` (see the module docstring).

    Example:
      >>> from functree._naming import matches
      >>> matches("encoder.weight", "encoder"), matches("encoder.weight", "*.bias")
      (True, False)
      >>> matches("1.mu.encoder.weight", "encoder.*"), matches("1.mu.encoder.weight", "encoder.*", anywhere=True)
      (False, True)
    """
    return match_kind(name, pattern, anywhere=anywhere) is not None


def match_kind(name: str, pattern: str, *, anywhere: bool = False) -> str | None:
    """``"direct"`` when ``pattern`` matches ``name`` or a dotted prefix of it, ``"suffix"``
    when only after a dotted prefix of it (``anywhere``), None when not at all."""
    for candidate, direct in _spans(name, anywhere):
        if fnmatch.fnmatchcase(candidate, pattern) or fnmatch.fnmatchcase("." + candidate, pattern):
            return "direct" if direct else "suffix"
    return None


_GLOB_CHARACTER = re.compile(r"[*?\[]")


def literal_pattern(name: str) -> str:
    """``name`` as a pattern that matches it alone: each glob character in a class of its own.

    Example:
      >>> from functree._naming import literal_pattern, matches
      >>> literal_pattern("layers[0].w*"), matches("layers[0].w*", literal_pattern("layers[0].w*"))
      ('layers[[]0].w[*]', True)
    """
    return _GLOB_CHARACTER.sub(lambda m: f"[{m.group()}]", name)


def rename_pattern(pattern: str) -> Callable[[str], tuple[tuple[str, ...], str] | None]:
    """A rename pattern (module docstring: ``*`` is one name part, a match is a whole-part
    prefix) as a function of a name: what each ``*`` matched and the rest of the name
    after the matched prefix (its leading ``.`` dropped), or None where it does not match.

    Example:
      >>> from functree._naming import rename_pattern
      >>> rename_pattern("transformer.h.*")("transformer.h.3.attn.weight")
      (('3',), 'attn.weight')
      >>> rename_pattern("transformer.h.*")("transformer.head.weight") is None
      True
    """
    compiled = re.compile("^" + "([^.]*)".join(re.escape(part) for part in pattern.split("*")) + r"(?=\.|$)")

    def match(name: str) -> tuple[tuple[str, ...], str] | None:
        found = compiled.match(name)
        return None if found is None else (found.groups(), name[found.end():].lstrip("."))

    return match


def fill_stars(pattern: str, parts: Sequence[str]) -> str:
    """``pattern`` with its ``*`` replaced by ``parts`` in order (as many as it has ``*``).

    Example:
      >>> from functree._naming import fill_stars
      >>> fill_stars("blocks.*", ("3",))
      'blocks.3'
    """
    pieces = pattern.split("*")
    return "".join(p + q for p, q in zip(pieces, (*parts, ""), strict=True))


def _leaf_names(info: LeafInfo) -> tuple[str, ...]:
    return (info.name, *info.aliases)


def _whole(name: str, pattern: str) -> bool:
    """Whether ``pattern`` matches all of ``name`` (no dotted prefix: ``*.scale`` is not
    ``film.scale.weight``'s)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase("." + name, pattern)


def _member_hits(info: LeafInfo, pattern: str, whole: bool = False) -> np.ndarray:
    """Which members of a stacked leaf ``pattern`` selects (shape ``info.sizes``), by
    their stored names and their names through ties."""
    test = _whole if whole else matches
    hits = np.zeros(info.sizes, bool)
    for idx in itertools.product(*(range(n) for n in info.sizes)):
        hits[idx] = any(test(_member_name(i, idx), pattern) for i in (info, *info.member_aliases))
    return hits


def _leaf_selection(info: LeafInfo, pattern: str, whole: bool = False) -> Any:
    """True, False or a member array: what ``pattern`` selects of one leaf (``whole``:
    matching whole names only, not a dotted prefix)."""
    test = _whole if whole else matches
    if any(test(n, pattern) for n in _leaf_names(info)):
        return True
    if not info.sizes:
        return False
    hits = _member_hits(info, pattern, whole)
    return bool(hits.all()) if hits.all() or not hits.any() else hits


def _combine(a: Any, b: Any, op: Any) -> Any:
    out = op(np.asarray(a), np.asarray(b))
    if out.ndim == 0 or out.all() or not out.any():
        return bool(out.all()) if out.ndim else bool(out)
    return out


_SELECTIONS: dict[Any, tuple[Any, ...]] = {}


def selection(tree: Any, patterns: Sequence[str], exclude: Sequence[str] = (), *, what: str = "ft.select",
              kind: str = "parameter", only: Sequence[bool] | None = None, strict: bool = True,
              whole: bool = False, exclude_whole: Sequence[str] = (),
              exclude_message: str | None = None) -> tuple[Any, ...]:
    """Per leaf of ``tree`` (JAX order, ``None`` leaves included): ``True``, ``False`` or a
    boolean member array: selected by some pattern and by no ``exclude`` pattern.

    ``only`` (a bool per leaf) limits which leaves count (the parameters); with
    ``strict``, a pattern that selects none of them raises naming the closest names
    (``what`` and ``kind`` word the error). With ``whole``, ``patterns`` and ``exclude``
    match whole names only, never a dotted prefix; ``exclude_whole`` are more exclude
    patterns matched so (weight decay's default ``*.scale`` spares a leaf named ``scale``,
    not a sub-layer named ``scale``). With ``exclude_message``, an ``exclude`` pattern
    that matches no name (of any leaf) raises it, as :func:`required_selection` words it.
    A tree whose names collide (:func:`refuse_collisions`) is refused. Cached per tree
    definition and patterns.
    """
    patterns, exclude, exclude_whole = tuple(patterns), tuple(exclude), tuple(exclude_whole)
    check_patterns(patterns + exclude + exclude_whole)
    infos = leaf_infos(tree)
    if only is None:
        only = tuple(True for _ in infos)
    treedef = jax.tree.structure(tree, is_leaf=is_none)
    key, out = cached(_SELECTIONS, (treedef, patterns, exclude, tuple(only), strict, whole, exclude_whole,
                                    exclude_message))
    if out is not None:
        refuse_batched_selection(tree, out, patterns + exclude)
        return out
    refuse_collisions(tree, [all_names([i]) for i in infos], what)
    chosen: list[Any] = [False] * len(infos)
    leaves = jax.tree.leaves(tree, is_leaf=is_none)
    for pattern in patterns:
        picks = [_leaf_selection(i, pattern, whole) if ok else False for i, ok in zip(infos, only)]
        if strict:
            _refuse_tied_head(tree, pattern, picks, leaves, what)
        if strict and not any(np.any(p) for p in picks):
            _refuse_static_field(tree, pattern, infos, only, what, whole)
            raise nothing_selected(pattern, what, kind, [i for i, ok in zip(infos, only) if ok],
                                   foreign=foreign_pattern(tree, pattern, only))
        chosen = [_combine(c, p, np.logical_or) for c, p in zip(chosen, picks)]
    for pattern, exact in [(p, whole) for p in exclude] + [(p, True) for p in exclude_whole]:
        picks = [_leaf_selection(i, pattern, exact) for i in infos]
        if exclude_message is not None and not any(np.any(p) for p in picks):  # a typo: excludes nothing
            raise _required(nothing_selected(pattern, what, "name", infos), exclude_message, "*")
        chosen = [_combine(c, p, lambda a, b: a & ~b) for c, p in zip(chosen, picks)]
    out = tuple(chosen)
    if key is not None and str_keys_only(tree):
        bounded_put(_SELECTIONS, key, out)
    refuse_batched_selection(tree, out, patterns + exclude)
    return out


def _refuse_tied_head(tree: Any, pattern: str, picks: Sequence[Any], leaves: Sequence[Any], what: str) -> None:
    """:data:`TIED_HEAD` for a pattern naming a tied output head (:func:`tied_head`): it had
    selected the head's empty slot, no parameter, and in ``ft.optim.groups`` / ``freeze`` /
    ``exclude`` (whose patterns may name non-parameters) nothing was said."""
    embedding = tied_head(tree, pattern, picks, leaves)
    if embedding is None:
        return
    head = foreign_names(tree).head
    held = [i.name for i, p, x in zip(leaf_infos(tree), picks, leaves) if np.any(p) and x is not None]
    silently = (f" but the head's own {', '.join(map(repr, held))}" if held
                else "" if not any(np.any(p) for p in picks) else " (only the head's empty slot)")
    right: Any = embedding if not _GLOB.search(pattern) else embedding.rpartition(".")[0] + ".*"
    right = (pattern, right) if held else right  # the head's bias too: both
    raise ValueError(TIED_HEAD.format(what=what, pattern=pattern, head=head, embedding=embedding,
                                      silently=silently, right=right))


def _refuse_static_field(tree: Any, pattern: str, infos: Sequence[LeafInfo], only: Sequence[bool], what: str,
                         whole: bool) -> None:
    """:data:`STATIC_FIELD` for a pattern that selects nothing but a static field: its
    "closest name" had been another parameter (``*.alpha`` -> ``*.lora_a``), as if a typo.
    A pattern naming a node of leaves (``"film.scale"`` matched ``whole``) is no such case."""
    if any(matches(n, pattern) for n in all_names(infos)):
        return
    found = static_field(tree, pattern, whole)
    if found is None:
        return
    name, cls, field = found
    layer = name[: -len(field) - 1] if name != field else ""
    right = f"{layer}.*" if layer and any(matches(n, f"{layer}.*") for i, ok in zip(infos, only) if ok
                                          for n in all_names([i])) else "*"
    raise ValueError(STATIC_FIELD.format(what=what, pattern=pattern, name=name, field=field, cls=cls, right=right))


def refuse_batched_selection(tree: Any, chosen: Sequence[Any], patterns: Sequence[str]) -> None:
    """Raise :data:`ENSEMBLE_MEMBER` where ``chosen`` (a :func:`selection` of ``tree``)
    selects some members of a leaf that has more leading axes than its stacks' (a batch of
    models: the selection cannot say which axis is a member's). Shapes are not in a tree
    definition: a consumer caching a selection calls this on every tree it applies it to."""
    if not any(isinstance(c, np.ndarray) for c in chosen):
        return
    infos = leaf_infos(tree)
    leaves = jax.tree.leaves(tree, is_leaf=is_none)
    for leaf, info, c in zip(leaves, infos, chosen):
        shape = tuple(getattr(leaf, "shape", ()))
        if not isinstance(c, np.ndarray) or not shape:
            continue
        if (info.ndim is not None and len(shape) > info.ndim) or shape[: len(info.sizes)] != info.sizes:
            pattern = next((p for p in patterns if isinstance(_leaf_selection(info, p), np.ndarray)), patterns[0])
            k = len(shape) - info.ndim if info.ndim is not None and len(shape) > info.ndim else 0
            expected = str(shape[k:]) if k else f"{info.sizes + ('...',)}".replace("'", "")
            stack = info.segments[0]
            raise ValueError(ENSEMBLE_MEMBER.format(path=pattern, stack=stack or "<root>", n=info.sizes[0],
                                                    leaf=info.name, shape=shape, expected=expected))


def required_selection(tree: Any, pattern: str, what: str, message: str, fallback: str,
                       whole: bool = False) -> tuple[Any, ...]:
    """:func:`selection` of one ``pattern`` that must match some name of ``tree`` (names of
    non-parameters count: a part frozen elsewhere is no typo); else a ``ValueError`` of
    ``message`` formatted with the ``pattern``, the ``close`` names and the ``right`` one
    (``fallback`` when nothing is close). ``whole``: the pattern matches whole names only."""
    try:
        return selection(tree, (pattern,), what=what, strict=True, whole=whole)
    except NothingSelected as e:
        raise _required(e, message, fallback) from None


def _required(e: NothingSelected, message: str, fallback: str) -> ValueError:
    """``message`` for the pattern of ``e`` that must match a name: its ``pattern``, the
    ``close`` names and the ``right`` one (``fallback`` when nothing is close)."""
    right = e.suggestion or right_name(e.pattern, e.close, fallback)
    return ValueError(message.format(pattern=e.pattern, close=", ".join(map(repr, e.close)) or "none", right=right))


def right_name(pattern: str, close: Sequence[str], fallback: str) -> str:
    """The fix of a pattern no :func:`suggestion` corrects: the closest name for a plain
    name; for a glob, a glob (one leaf's name would select less than it meant) that selects
    the closest name: ``*.part`` (:func:`_glob_part`), else ``fallback`` if it selects it,
    else that name. A fixed ``*.weight`` suggested in a tree with no such leaf (Flax's
    ``layers.0.kernel.value``) was the same error again."""
    if not close:
        return fallback
    if not _GLOB.search(pattern):
        return close[0]
    return _glob_part(pattern, close[0]) or (fallback if matches(close[0], fallback) else close[0])


def _glob_part(pattern: str, name: str) -> str | None:
    """``*.part`` for the part of ``name`` most like the glob's last literal part (difflib's
    ratio at least 0.6), where it selects ``name``: ``layers.1.kernel*`` with
    ``layers.2.kernel.value`` gives ``*.kernel``; None when no part is alike."""
    stems = [_GLOB.sub("", p) for p in pattern.split(".")]
    stem = next((s for s in reversed(stems) if s and not s.isdigit()), "")
    parts = [p for p in name.split(".") if not p.isdigit()]
    if not stem or not parts:
        return None
    ratio, part = max((difflib.SequenceMatcher(None, stem, p).ratio(), p) for p in parts)
    return f"*.{part}" if ratio >= 0.6 and matches(name, f"*.{part}") else None


def check_patterns(patterns: Sequence[Any]) -> None:
    """Raise ``TypeError`` for a pattern that is not a string, ``ValueError``
    (:data:`REVERSED_RANGE`) for one whose character class holds a reversed range,
    (:data:`CARET_CLASS`) for one whose class starts with ``^`` (a regex's negation),
    (:data:`KEY_PATH_STRING`) for a printed key path (``['qk'].weight``)."""
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(BAD_PATTERN.format(given=p, type=type(p).__name__, hint=key_path_hint(p)))
        _refuse_key_path_string(p)
        _refuse_caret_class(p)
        _refuse_reversed_range(p)


# A character class as fnmatch reads one: "[", an optional "!", a "]" first is literal, up to "]".
_CLASS = re.compile(r"\[(!?\]?[^\]]*)\]")
# A number as layer names write one: no leading zero ("05" is no number: [05-9] is 0 and 5-9).
_NUMBER = r"(0|[1-9][0-9]*)"
# A class that is one number range, nothing else ([10-15], [0-15], [2-0]): the numbers meant.
_ONE_NUMBER_RANGE = re.compile(_NUMBER + "-" + _NUMBER)
_PRINTABLE = [chr(c) for c in range(33, 127)]  # the characters a message lists a class by


def _ranges(content: str) -> list[tuple[int, str, str]]:
    """The ranges ``a-b`` of a class's content (its ``!`` taken off), with their offsets,
    read left to right as fnmatch does (a ``-`` first or last is literal)."""
    out, i = [], 0
    while i < len(content):
        if i + 2 < len(content) and content[i + 1] == "-":
            out.append((i, content[i], content[i + 2]))
            i += 3
        else:
            i += 1
    return out


# A dict key as a printed key path writes it ("['encoder']", '["qk"]'): a class to fnmatch.
_QUOTED_KEY = re.compile(r"""\[(['"])(.*?)\1\]""")


def _refuse_key_path_string(pattern: str) -> None:
    """:data:`KEY_PATH_STRING` for a pattern holding a dict key as ``str(kp)`` prints it
    (``['qk'].weight``): fnmatch reads ``['qk']`` as one character of ``'``, ``q``, ``k``,
    so a one-letter key's leaf is selected silently. The fix is its dotted name."""
    for found in _CLASS.finditer(pattern):
        if _QUOTED_KEY.fullmatch(found.group(0)) is None:
            continue
        held = [c for c in _PRINTABLE if fnmatch.fnmatchcase(c, found.group(0))]
        dotted = _INDEXED.sub(_dotted_index, _QUOTED_KEY.sub(lambda m: "." + m.group(2), pattern))
        right = dotted[1:] if dotted.startswith(".") and not pattern.startswith(".") else dotted
        raise ValueError(KEY_PATH_STRING.format(pattern=pattern, klass=found.group(0), reading=", ".join(held),
                                                key=found.group(1)[1:-1], right=right))


def _refuse_caret_class(pattern: str) -> None:
    """:data:`CARET_CLASS` for a class whose first character is ``^`` (``[^0]``): fnmatch
    reads it as that character, so the class selects the names a negation leaves out.
    (``[^]``, a class of ``^`` alone, has no other reading; ``[!^0]`` is fnmatch's own.)"""
    for found in _CLASS.finditer(pattern):
        content = found.group(1)
        if content.startswith("^") and len(content) > 1:
            held = [c for c in _PRINTABLE if fnmatch.fnmatchcase(c, found.group(0))]
            right = pattern[:found.start()] + "[!" + content[1:] + "]" + pattern[found.end():]
            raise ValueError(CARET_CLASS.format(pattern=pattern, klass=found.group(0), reading=", ".join(held),
                                                right=right))


def _refuse_reversed_range(pattern: str) -> None:
    """:data:`REVERSED_RANGE` for a class with a range ``a-b``, ``a > b``: fnmatch drops it
    silently (``[14-15]`` is ``[15]``, ``[2-0]`` matches nothing); :data:`MULTI_DIGIT_RANGE`
    for one with a number range of several digits, read one character each (``[10-15]`` is
    ``{0, 1, 5}``)."""
    for found in _CLASS.finditer(pattern):
        negated = found.group(1).startswith("!")
        content = found.group(1)[negated:]
        bad = [(i, a, b) for i, a, b in _ranges(content) if a > b]
        head, tail = pattern[:found.start()], pattern[found.end():]
        if not bad:
            _refuse_multi_digit(pattern, found.group(0), content, negated, head, tail)
            continue
        _, start, end = bad[0]
        number = _ONE_NUMBER_RANGE.fullmatch(content)
        if number and not negated:  # a number range meant: [14-15], [2-0] (not [05-3]: 0, and 5-3 reversed)
            right = _numbers_right(number, head, tail)
        else:  # each reversed range turned round: [z-a] -> [a-z]
            fixed = list(content)
            for i, a, b in bad:
                fixed[i], fixed[i + 2] = b, a
            right = repr(head + "[" + "!" * negated + "".join(fixed) + "]" + tail)
        raise ValueError(REVERSED_RANGE.format(pattern=pattern, klass=found.group(0), start=start, end=end,
                                               right=right))


def _refuse_multi_digit(pattern: str, klass: str, content: str, negated: bool, head: str, tail: str) -> None:
    """:data:`MULTI_DIGIT_RANGE` for a class whose ``content`` (its ``!`` off) is one number
    range with a number of several digits (``[10-15]``, ``[0-15]``, ``[!10-15]``); the
    suggestion spells that range's numbers, the class replaced.

    Any other class is a glob's own: fnmatch reads single characters and ranges ``a-b`` one
    character each, and that is what such a class means (``[0-35-9]``: 0-3 and 5-9, every
    digit but 4; ``[05-9]``: 0 and 5-9). A digit run in it is no number range meant: the
    class holds more than the range, or a number with a leading zero, as no layer is named."""
    number = _ONE_NUMBER_RANGE.fullmatch(content)
    if number is None or max(len(number.group(1)), len(number.group(2))) < 2:
        return
    # the characters fnmatch reads the class as (those it holds: the class without its "!")
    held = [c for c in _PRINTABLE if fnmatch.fnmatchcase(c, "[" + content + "]")]
    reading = ("any one character but " if negated else "one character of ") + ", ".join(held)
    right = _numbers_right(number, head, tail)
    if negated:  # no glob excludes a number range: name the numbers, to leave out of what is selected
        right += f"   # the numbers {number.group(0)}: select the others around them"
    raise ValueError(MULTI_DIGIT_RANGE.format(pattern=pattern, klass=klass, number=number.group(0),
                                              reading=reading, right=right))


def _numbers_right(number: re.Match[str], head: str, tail: str) -> str:
    """The ``right:`` spelling of the number range ``number`` (``lo-hi`` either way round)
    between ``head`` and ``tail``: one glob, or a tuple of them."""
    lo, hi = sorted(int(x) for x in number.groups())
    globs = [head + g + tail for g in _number_globs(lo, hi)]
    return repr(globs[0]) if len(globs) == 1 else repr(tuple(globs))


def _number_globs(lo: int, hi: int) -> list[str]:
    """Globs matching the numbers ``lo`` to ``hi`` (decimal, no leading zeros) and no others:
    ``(14, 15)`` -> ``["1[4-5]"]``, ``(8, 12)`` -> ``["[8-9]", "1[0-2]"]``."""
    if lo > hi:
        return []
    if len(str(lo)) < len(str(hi)):  # one length at a time
        cut = 10 ** len(str(lo))
        return _number_globs(lo, cut - 1) + _number_globs(cut, hi)
    a, b = str(lo), str(hi)
    k = next((i for i in range(len(a)) if a[i] != b[i]), len(a))  # the common prefix
    if k == len(a):
        return [a]
    rest = len(a) - k - 1
    if a[k + 1:] == "0" * rest and b[k + 1:] == "9" * rest:  # prefix, one class, any digits after
        return [a[:k] + _digit_class(a[k], b[k]) + "[0-9]" * rest]
    step = 10 ** rest  # split at the digit k boundaries: lo.., whole blocks, ..hi
    first, last = (lo // step + 1) * step, (hi // step) * step
    return _number_globs(lo, first - 1) + _number_globs(first, last - 1) + _number_globs(last, hi)


def _digit_class(a: str, b: str) -> str:
    return a if a == b else f"[{a}-{b}]"


def all_names(infos: Sequence[LeafInfo]) -> list[str]:
    """Every name of ``infos``: stacked and member names, tie aliases."""
    out: list[str] = []
    for i in infos:
        out += [i.name, *i.aliases, *member_names(i)]
        for a in i.member_aliases:
            out += member_names(a)
    return list(dict.fromkeys(out))


def closest(pattern: str, infos: Sequence[LeafInfo], n: int = 3) -> list[str]:
    """The names of ``infos`` closest to ``pattern``, for an error: those the
    :func:`suggestion` selects first, then by difflib."""
    every = all_names(infos)
    better = suggestion(pattern, infos)
    first = [] if better is None else [m for m in every if matches(m, better)][:n]
    rest = difflib.get_close_matches(pattern, [m for m in every if m not in first], n=n, cutoff=0.0)
    return (first + rest)[:n]


# Torch's names of ft.nn leaves (a norm's weight is ft's scale, an embedding's its embeddings).
_SYNONYMS = {"weight": ("embeddings", "scale"), "bias": ("offset",), "gamma": ("scale",), "beta": ("offset",),
             "running_var": ("running_variance",)}
_GLOB = re.compile(r"[*?\[]")


def _words(part: str) -> list[str]:
    return [w for w in part.lower().split("_") if w]


def _part_score(given: str, candidate: str) -> float:
    """How well a name part fits a pattern's part: the share of their words (split at
    ``_``) that abbreviate each other in order (``q_proj``: ``query_projection`` 1.0,
    ``up_proj`` 0.5); a torch synonym (``weight``: ``scale``) 1.0; 0 when none does."""
    if candidate in _SYNONYMS.get(given, ()):
        return 1.0
    a, b = _words(given), _words(candidate)
    if not a or not b:
        return 0.0
    hits, j = 0, 0
    for w in a:
        for k in range(j, len(b)):
            if b[k].startswith(w) or w.startswith(b[k]) or _misspelt(w, b[k]):
                hits, j = hits + 1, k + 1
                break
    return hits / max(len(a), len(b))


def _misspelt(word: str, known: str) -> bool:
    """Whether ``word`` is ``known`` with a typo (``encodr``: ``encoder``): most letters alike."""
    return min(len(word), len(known)) >= 4 and difflib.SequenceMatcher(None, word, known).ratio() >= 0.8


def suggestion(pattern: str, infos: Sequence[LeafInfo]) -> str | None:
    """The pattern the user most likely meant: ``pattern`` with its literal name parts
    replaced, one at a time or all unknown ones together, by the tree's closest parts
    (:func:`_part_score`: ``*.q_proj`` → ``*.query_projection``), if that selects a name;
    failing that, one of these without literal parts below a leaf (torch's and PEFT's
    ``*.lora_B.default.weight`` → ``*.lora_b``); a name that sits deeper, as a glob over
    every place it is (``q_proj`` → ``*.q_proj``: all of a Stack's members); None when no
    part is close (never an unrelated name, nor a leaf's name for a glob: ``encodr.*`` →
    ``encoder.*``, the corrected part back in the glob). An index written as Python's
    (``layers[0].*``) is first read as the dotted name's (``layers.0.*``): its own
    correction, ``*.weight``, selected every layer's."""
    every = all_names(infos)
    known = {part for name in every for part in name.split(".")}
    indexed = _INDEXED.sub(_dotted_index, pattern)  # Python's layers[0] for the dotted layers.0
    if indexed != pattern and any(matches(name, indexed) for name in every):
        return indexed
    parts = pattern.split(".")
    trials = list(_replaced(parts, known))
    if not pattern.startswith("*"):  # a name that sits deeper than the root: a glob over its places
        trials += [["*", *parts]] + list(_replaced(["*", *parts], known))
    for trial in trials:
        if any(matches(name, ".".join(trial)) for name in every):
            return ".".join(trial)
    for trial in [parts, *trials]:
        for end in range(len(trial) - 1, 0, -1):
            if _GLOB.search(trial[end]) or _GLOB.search(trial[end - 1]):  # a leaf's own name ends it
                break
            p = ".".join(trial[:end])  # whole leaves only: a shorter prefix would select more
            if any(fnmatch.fnmatchcase(name, p) or fnmatch.fnmatchcase("." + name, p) for name in every):
                return p
    return None


def _replaced(parts: list[str], known: set[str]) -> Iterator[list[str]]:
    """``parts`` with every unknown literal part by its closest known parts, then with one
    literal part replaced at a time, best fits first."""
    def candidates(i: int) -> list[str]:
        scored = [(_part_score(parts[i], k), difflib.SequenceMatcher(None, parts[i], k).ratio(), k) for k in known]
        return [k for score, _, k in sorted(scored, reverse=True) if score > 0][:3]

    literal = [i for i, part in enumerate(parts) if part and not _GLOB.search(part)]
    unknown = [i for i in literal if parts[i] not in known]
    options = {i: candidates(i) for i in literal}
    if unknown and all(options[i] for i in unknown):
        for choice in itertools.product(*(options[i] for i in unknown)):
            trial = list(parts)
            for i, c in zip(unknown, choice):
                trial[i] = c
            yield trial
    for i in literal:
        yield from (parts[:i] + [c] + parts[i + 1:] for c in options[i] if c != parts[i])


_INDEX = re.compile(r"[0-9]+")
_SIGNED_INDEX = re.compile(r"-?[0-9]+")  # a member index in a pattern, or one counted from the end
# An index written as Python's (layers[0], h[1-2]) after a name: a character class to fnmatch,
# which matches "layers0", never the dotted name's "layers.0".
_INDEXED = re.compile(r"([^.\[\]*?])\[([0-9]+(?:-[0-9]+)?)\]")


def _dotted_index(m: re.Match[str]) -> str:
    """``layers[0]`` → ``layers.0``, ``h[1-2]`` → ``h.[1-2]`` (a range stays a class)."""
    index = m.group(2)
    return f"{m.group(1)}.{index}" if index.isdigit() else f"{m.group(1)}.[{index}]"


def _out_of_range(pattern: str, infos: Sequence[LeafInfo], what: str) -> str | None:
    """The error for a pattern naming a member past a stack's end, or None."""
    parts = pattern.lstrip(".").split(".")
    for info in infos:
        outer: list[int] = []  # where each outer stack's member index sits in the names
        for stack_name, n in zip(_stack_prefixes(info), info.sizes):
            k = len(stack_name.split(".")) if stack_name else 0
            given, own = parts[:k], stack_name.split(".")[:k]
            # an inner stack's prefix holds member 0 of each outer stack: any member the pattern
            # names there is the inner stack's too (a.1.b.4.* for a 4-member b inside a)
            fits = all((i in outer and (_INDEX.fullmatch(g) or _GLOB.search(g))) or fnmatch.fnmatchcase(g, o)
                       for i, (g, o) in enumerate(zip(given, own)))
            outer.append(k)
            if len(parts) <= k or not _SIGNED_INDEX.fullmatch(parts[k]) or not fits:
                continue
            index = int(parts[k])
            if not 0 <= index < n:  # past the end, or counted from it (h.-1.*: a key path's, no member name)
                right = ".".join(parts[:k] + [str(n - 1 if index >= n else max(n + index, 0))] + parts[k + 1:])
                stack = ".".join(given) if len(outer) > 1 else stack_name
                return MEMBER_OUT_OF_RANGE.format(what=what, pattern=pattern, index=index,
                                                  stack=stack or "<root>", n=n, last=n - 1, right=right)
    return None


def _stack_prefixes(info: LeafInfo) -> list[str]:
    """The member-name prefix of each stack of a leaf, member 0 of the outer ones."""
    out, parts = [], [info.segments[0]]
    for seg in info.segments[1:]:
        out.append(join_names(*parts))
        parts += ["0", seg]
    return out


def nothing_selected(pattern: str, what: str, kind: str, infos: Sequence[LeafInfo],
                     foreign: str | None = None) -> NothingSelected:
    """The error for a pattern that selects nothing: a member out of range, or the
    closest names; ``foreign`` (:func:`foreign_pattern`) is the fix where given. A consumer
    with its own message catches it and words its own."""
    close = closest(pattern, infos)
    out_of_range = _out_of_range(pattern, infos, what)
    if out_of_range is not None:
        return NothingSelected(out_of_range, pattern, close, out_of_range)
    better = foreign or suggestion(pattern, infos)
    right = f"{what}(..., {better or right_name(pattern, close, '*')!r})"
    message = SELECTS_NOTHING.format(what=what, pattern=pattern, kind=kind, close=", ".join(map(repr, close)) or "none",
                                     wrong=f"{what}(..., {pattern!r})", right=right)
    return NothingSelected(message, pattern, close, None, better, foreign is not None)


def foreign_pattern(tree: Any, pattern: str, only: Sequence[bool] | None = None) -> str | None:
    """Our pattern of the parameters that ``pattern`` selects by their foreign names (a model
    of ``from_hf``: Hugging Face's ``"*.attention.self.value.*"`` ->
    ``"encoder.layer.*.attention.value_projection.*"``): their common parts, ``*`` where they
    differ, checked to select exactly them; None when no foreign name matches or no one glob
    selects exactly them. Only a Dense layer's ``weight`` and ``bias`` have foreign names
    (:func:`foreign_names`, ``ft.nn.lora``'s): a norm's pattern gets no fix from them."""
    try:
        modules = foreign_names(tree).modules
    except Exception:  # (an error message's helper: never a second error in its place)
        return None
    hits = [f"{ours}.{param}" for ours, theirs in modules.items() for param in ("weight", "bias")
            if matches(f"{theirs}.{param}", pattern)]
    picked = [selection(tree, (h,), only=only, strict=False) for h in hits]
    hits = [h for h, p in zip(hits, picked) if any(np.any(c) for c in p)]  # a (selected) parameter's
    split = [h.split(".") for h in hits]
    if not hits or len({len(parts) for parts in split}) != 1:
        return None
    glob = ".".join(parts[0] if len(set(parts)) == 1 else "*" for parts in zip(*split))
    exact = selection(tree, tuple(hits), only=only, strict=False)
    got = selection(tree, (glob,), only=only, strict=False)
    return glob if all(np.array_equal(a, b) for a, b in zip(got, exact)) else None


def member_rule_names(pattern: str, infos: Sequence[LeafInfo]) -> list[str]:
    """The member names ``pattern`` matches (``anywhere``) of leaves it does not match
    whole: the members a per-leaf rule (a sharding rule) cannot address alone."""
    out = []
    for info in infos:
        if not info.sizes or any(matches(n, pattern, anywhere=True) for n in _leaf_names(info)):
            continue
        out += [m for m in member_names(info) if matches(m, pattern, anywhere=True)]
    return out


def broadcast(selected: Any, leaf: Any) -> Any:
    """A member selection (shape ``(n, ...)``) shaped to broadcast against ``leaf``, whose
    leading axes must be the stacks' (else :data:`MASK_AXES`: a batch of models)."""
    shape = tuple(jnp.shape(leaf))
    if shape[: selected.ndim] != selected.shape:
        raise ValueError(MASK_AXES.format(selection=selected.shape, shape=shape))
    return np.reshape(selected, selected.shape + (1,) * (len(shape) - selected.ndim))


def tie_targets(tree: Any) -> dict[str, tuple[str, Any, Any]]:
    """``{target name: (source name, transform, source value)}`` of every tie of the tied
    nodes of ``tree`` (the names of the resolved model, prefixed by the node's name)."""
    out: dict[str, tuple[str, Any, Any]] = {}
    pairs, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=is_tied)
    for path, node in pairs:
        if is_tied(node):
            prefix = dotted_name(path)
            for target, source, transform in node.ties:
                out[join_names(prefix, target.name)] = (join_names(prefix, source.name), transform, source.get(node.model))
    return out


def resolve_alias(tree: Any, name: str) -> str | None:
    """The stored name of the leaf (or member) that ``name`` aliases through a tie, or None."""
    for info in leaf_infos(tree):
        if name in info.aliases:
            return info.name
        for a in info.member_aliases:
            for idx in itertools.product(*(range(n) for n in info.sizes)):
                if _member_name(a, idx) == name:
                    return _member_name(info, idx)
    return None


def untransform(transform: Callable[[Any], Any], source: Any, value: Any, target: str, name: str) -> Any:
    """The source value whose ``transform`` is ``value`` (a tie written through its target):
    ``transform``'s linear transpose, checked to invert it (a transpose, a reshape)."""
    value = jnp.asarray(value)
    out = jax.eval_shape(transform, source)
    if value.shape != out.shape:
        raise ValueError(TIE_SHAPE.format(target=target, shape=out.shape, given=value.shape, source=name))
    try:
        candidate = jax.linear_transpose(transform, source)(value.astype(out.dtype))[0]
        ok = np.array_equal(np.asarray(transform(candidate)), np.asarray(value))
    except Exception:  # not linear: no inverse
        ok = False
    if not ok:
        raise ValueError(NOT_INVERTIBLE.format(target=target, source=name))
    return candidate


def kept_parts_fix(pattern: str, close: list[str]) -> str | None:
    """A close name with the parts of ``pattern`` that fit it kept: ``layers.1.kernel*`` on
    ``layers.1.weight`` is ``layers.1.weight`` and ``layers.*.kernel`` is ``layers.*.weight``,
    where a ``*.weight`` would shard every layer's weight, not the one the rule names. Parts
    pair up one by one (after a leading ``*``, with the name's last parts); the name keeping
    most parts wins, the closer on a tie; None where no part fits (``*.w``)."""
    parts, best, kept_most = pattern.split("."), None, 0
    for name in close:
        theirs = name.split(".")
        if len(theirs) == len(parts):
            head, pairs = [], list(zip(parts, theirs))
        elif parts[0] == "*" and len(theirs) >= len(parts):
            head, pairs = ["*"], list(zip(parts[1:], theirs[len(theirs) - len(parts) + 1:]))
        else:
            continue
        fits = [fnmatch.fnmatchcase(t, p) for p, t in pairs]
        if sum(fits) > kept_most:
            best, kept_most = ".".join(head + [p if fit else t for (p, t), fit in zip(pairs, fits)]), sum(fits)
    return best
