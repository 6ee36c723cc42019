"""A pretrained body with a fresh task head: :func:`with_head`, transformers'
``AutoModelFor<Task>.from_pretrained(causal_lm_dir, num_labels=3)``.

transformers loads the checkpoint's body into the task class, leaves the checkpoint's own
head out (``lm_head.weight``: unexpected) and initializes the task head with the class's
``_init_weights`` (every ``Linear`` ``normal(0, initializer_range)``, OPT's ``init_std``,
biases zero, a LayerNorm the identity), warning that it is new; its config takes
``num_labels`` (``id2label = {i: "LABEL_i"}``, ``label2id`` its inverse) or the ``id2label``
given, and ``save_pretrained`` writes ``architectures`` as the task class. :func:`with_head`
does the same to a loaded functree model: the task model's ``body`` holds the given model's
own arrays (no copy, nothing read again), its head drawn as HF draws it
(:func:`functree.hf._load._hf_initialized`, the initialization ``from_hf(config, key=)``
gives a whole model).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._activations import tanh
from functree._files import local_if_path
from functree._module import from_fields
from functree._random import one_key
from functree._where import placed_like
from functree.hf._bert import BertModel
from functree.hf._causal import CausalLM
from functree.hf._config import HFConfig
from functree.hf._dropout import dropout_attention
from functree.hf._family import FAMILIES, TASKS, HFModel, family_of
from functree.hf._files import read_config
from functree.hf._heads import (
    _BODY_PREFIX,
    HEADS,
    MaskedLM,
    QuestionAnswering,
    TaskModel,
    _blocks,
    _tokens,
    with_head_dropout,
)
from functree.hf._heads import num_labels as _count
from functree.hf._load import _check_pad_token, _hf_initialized, from_hf, to_hf_state_dict
from functree.hf._roberta_heads import LMHeadMaskedLM
from functree.interop._safetensors import load_checkpoint
from functree.interop._torch import load_torch_state_dict
from functree.nn._linear import Dense

__all__ = ["with_head"]

NOT_A_BODY = """\
ft.hf.with_head takes a model of ft.nn.from_hf (a covered family's causal LM, BertModel, or \
a task model of one: {covered}), got {given}.

    wrong:  ft.hf.with_head({wrong}, "ForSequenceClassification", num_labels=3, key=key)
    right:  ft.hf.with_head(ft.nn.from_hf({source}), "ForSequenceClassification", num_labels=3, key=key)
"""

NO_CONFIG = """\
ft.hf.with_head: the {cls} given carries no hf_config (built by its constructor, not by \
ft.nn.from_hf), so the head's size, initializer_range and the config save_hf writes are unknown.

    wrong:  ft.hf.with_head({cls}(...), "{head}", key=key)
    right:  ft.hf.with_head(ft.nn.from_hf(path_or_hf_model), "{head}", key=key)
"""

NO_SUCH_HEAD = """\
ft.hf.with_head: {family} has no {given!r} head in transformers 5.24 (functree.hf._heads.HEADS, \
as transformers: {model_type!r} has {heads}).

    wrong:  ft.hf.with_head(model, {given!r}, key=key)
    right:  ft.hf.with_head(model, {first!r}, key=key)     # one of {heads}
"""

NEEDS_KEY = """\
ft.hf.with_head draws the new head's weights (Hugging Face's normal(0, initializer_range)) \
and needs a PRNG key for them.

    wrong:  ft.hf.with_head(model, {head!r}{labels})
    right:  ft.hf.with_head(model, {head!r}{labels}, key=jax.random.key(0))
"""

LABELS_CONFLICT = """\
ft.hf.with_head: {what}; the head's size would be ambiguous (Hugging Face keeps id2label's \
{count} and a label2id of another length, warning).

    wrong:  ft.hf.with_head(model, head, {wrong}, key=key)
    right:  ft.hf.with_head(model, head, id2label={{0: "negative", 1: "positive"}}, key=key)   # its size and names
       or:  ft.hf.with_head(model, head, num_labels=2, key=key)                              # LABEL_0, LABEL_1
"""

ID2LABEL_NOT_MAPPING = """\
ft.hf.with_head: id2label maps each label id to its name, a dict (Hugging Face's config \
attribute), got a {kind} {given!r}.

    wrong:  ft.hf.with_head(model, head, id2label={given!r}, key=key)
    right:  ft.hf.with_head(model, head, id2label=dict(enumerate({given!r})), key=key)
"""

BAD_NUM_LABELS = """\
ft.hf.with_head: num_labels is the head's number of outputs, a positive int, got {given!r}.

    wrong:  ft.hf.with_head(model, head, num_labels={given!r}, key=key)
    right:  ft.hf.with_head(model, head, num_labels=3, key=key)
"""

NO_LABELS_HERE = """\
ft.hf.with_head: {hf_class}'s head has {outputs}, whatever the labels; {given} would be \
recorded in its config and read by nothing (or break Hugging Face's forward).

    wrong:  ft.hf.with_head(model, {head!r}, {given}, key=key)
    right:  ft.hf.with_head(model, {head!r}, key=key)
"""

HEAD_SIZE = """\
ft.hf.with_head: the directory's file holds {name!r} {shape}, a tensor of the {hf_class} \
head under its own name, which is {want} here; Hugging Face's \
AutoModelFor<head>.from_pretrained(directory) reads the head tensors a file holds and refuses \
this one (a size mismatch), where a fresh head would silently drop the file's.

    wrong:  ft.hf.with_head(directory, {head!r}{labels}, key=key)
    right:  ft.hf.with_head(ft.nn.from_hf(directory), {head!r}{labels}, key=key)   # every head tensor drawn \
(HF's ignore_mismatched_sizes=True)
"""

# The heads whose size no label count sets: (class, its outputs, the label counts allowed).
_FIXED = {MaskedLM: ("one logit per vocabulary entry", ()), LMHeadMaskedLM: ("one logit per vocabulary entry", ()),
          QuestionAnswering: ("two outputs (start, end)", (2,))}


def with_head(model: Any, head: str, *, key: jax.Array | None = None, num_labels: int | None = None,
              id2label: Mapping[Any, str] | None = None, label2id: Mapping[str, int] | None = None,
              problem_type: str | None = None, pad_token_id: int | None = None) -> Any:
    """``model``'s body with a fresh task head: Hugging Face's
    ``AutoModelFor<head>.from_pretrained(checkpoint, num_labels=...)`` for a loaded model.

    ``model`` is a :func:`ft.nn.from_hf` model: a decoder family's causal LM (its ``lm_head``
    dropped, as HF leaves ``lm_head.weight`` unread), a ``BertModel``, or a task model of the
    same family (its head dropped: another head, or the same class with other labels); or a
    ``save_pretrained`` directory, read by ``from_hf`` and, for a head over BERT's pooler
    (``BertForSequenceClassification``, the multiple-choice classes), with the pooler its
    file holds where the class it names has none: bert-base-uncased's and roberta-base's
    masked-LM files carry one, which ``from_hf`` leaves unread as their class does and HF's
    ``AutoModelFor<head>.from_pretrained(directory)`` reads (given the loaded masked LM
    instead, the pooler is drawn); from a directory, the head tensors its file holds under the
    head's own names are read as HF reads them (a masked LM's own head for ``"ForMaskedLM"``,
    a classifier's ``classifier`` of the same shape), one of another shape refused as HF
    refuses it (:data:`HEAD_SIZE`; the loaded model given instead draws every one). ``head``
    is HF's class suffix (``"ForSequenceClassification"``, ``"ForTokenClassification"``,
    ``"ForQuestionAnswering"``, ``"ForMaskedLM"``) or the class's name
    (``"LlamaForSequenceClassification"``); the family's heads are
    :data:`functree.hf._heads.HEADS`' row. The result's ``body`` holds ``model``'s own arrays
    (not copied); its head is drawn as HF's ``_init_weights`` draws it for the missing
    tensors: every weight ``normal(0, initializer_range)`` (OPT: ``init_std``), biases zero,
    a LayerNorm the identity; BERT's pooler is the body's where it has one, else drawn the
    same way (``BertForSequenceClassification`` from a ``BertModel`` saved without one), and
    dropped for the heads that have none (HF's ``add_pooling_layer=False``). New arrays are
    put where the body lives (a body on device 2 gets its head there, not on the default
    device, where a checkpoint restored onto the task model would split it in two).

    ``hf_config`` is ``model``'s with ``architectures`` the task class (as ``save_pretrained``
    writes it) and the labels as HF's config derives them: ``num_labels=n`` gives ``id2label
    = {i: "LABEL_i"}``; ``id2label`` gives its own (``label2id`` its inverse unless given);
    neither keeps the config's (2 labels where it has none). ``problem_type`` and
    ``pad_token_id`` are set where given, as ``from_pretrained``'s keyword arguments set them
    (the pad id is the decoder classifier's end-of-row marker and the embedding's padding
    row). A body built with ``dropout=True`` gets HF's classifier dropout too. The
    generation config is left out, as HF's task classes have none.

    Refused by name: a head the family has not, a model that is not a ``from_hf`` model, no
    ``key``, ``num_labels`` beside an ``id2label`` of another length (HF keeps the latter,
    warning), labels for ``ForMaskedLM`` or other than 2 for ``ForQuestionAnswering``.

    Where HF differs: the Llama, Qwen2, Ministral and Qwen3 question-answering classes keep
    their body as ``transformer.*``, so HF's ``from_pretrained`` of a causal LM's checkpoint
    (``model.*``) reads none of it and the body stays random; here the body is the model's.

    Example:
      >>> import functree as ft, jax, numpy as np
      >>> config = {"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
      ...           "num_hidden_layers": 1, "num_attention_heads": 2, "pad_token_id": 0}
      >>> lm = ft.nn.from_hf(config, key=jax.random.key(0))      # or ft.nn.from_hf("path/to/causal-lm")
      >>> clf = ft.hf.with_head(lm, "ForSequenceClassification", num_labels=3, key=jax.random.key(1))
      >>> type(clf).__name__, clf.score.weight.shape, clf.body.model is lm.model
      ('LlamaForSequenceClassification', (8, 3), True)
      >>> clf.hf_config["architectures"], clf.hf_config["id2label"]["2"]
      (('LlamaForSequenceClassification',), 'LABEL_2')
      >>> clf(np.array([[5, 6, 7, 0]], np.int32)).shape
      (1, 3)
    """
    directory: Any = None
    if isinstance(model, (str, os.PathLike)):
        directory = local_if_path(model, "ft.hf.with_head")  # "~/models/m": the home's
        model = _from_directory(directory, head)
    family, body = _body_of(model, head)
    task = _task(family, head)
    labels = (num_labels, id2label, label2id)
    if key is None:
        shown = "".join(f", {n}={v!r}" for n, v in zip(("num_labels", "id2label", "label2id"), labels) if v is not None)
        raise ValueError(NEEDS_KEY.format(head=head, labels=shown))
    values = _values(model.hf_config, task, head, labels, problem_type, pad_token_id)
    config = read_config(values)
    _count(config)  # the labels' and problem_type's checks from_hf makes
    _check_pad_token(task, config)
    k_build, k_init, k_pool = jax.random.split(one_key(key), 3)
    body = _fitted(task, body, config, k_pool)
    width = int(_tokens(body).embeddings.shape[1])  # OPT: word_embed_proj_dim
    built = task.build(body, width, config, _tokens(body).embeddings.dtype, k_build)
    own = {n: getattr(built, n) for n in type(built).__ft_fields__
           if n != "body" and n not in type(built).__ft_static__}
    fresh = placed_like(_hf_initialized(task, own, config, k_init), body)  # where the body lives (device 2, a mesh)
    out = built.replace(**fresh, hf_config=HFConfig(values))
    out = with_head_dropout(out, config, dropout_attention(_blocks(body).layers) is not None)
    return out if directory is None else _file_head(out, directory, head, labels)


def _file_head(model: TaskModel, path: str | os.PathLike[str], head: str, labels: tuple[Any, Any, Any]) -> Any:
    """``model`` (its head fresh) with the head's tensors that the directory's file holds under
    their Hugging Face names, as ``AutoModelFor<head>.from_pretrained(directory)`` reads them:
    a masked LM's own head for ``"ForMaskedLM"``, a classifier's for the same class or one of
    the same module names and shapes (BERT's sequence and token classifiers' ``classifier``,
    DistilBERT's ``pre_classifier``); one of another shape is :data:`HEAD_SIZE`, as HF's size
    mismatch. The others stay drawn (HF's missing tensors)."""
    roots = type(model).head_roots
    # the head's tensors alone (the body left out: None leaves, no copy of a large body to the host)
    head_only = model.replace(body=jax.tree.map(lambda _: None, model.body))  # type: ignore[attr-defined]  # each task class's field
    wanted = {n: v for n, v in to_hf_state_dict(head_only, numpy=True).items() if n.split(".")[0] in roots}
    held = load_checkpoint(path, "ft.hf.with_head")
    found = {n: held[n] for n in wanted if n in held}
    if not found:
        return model
    for name, value in found.items():
        if tuple(value.shape) != tuple(wanted[name].shape):
            shown = "".join(f", {n}={v!r}" for n, v in zip(("num_labels", "id2label", "label2id"), labels)
                            if v is not None)
            raise ValueError(HEAD_SIZE.format(name=name, shape=list(value.shape), hf_class=type(model).hf_class,
                                              want=list(wanted[name].shape), head=head, labels=shown))
    loaded, _ = load_torch_state_dict(model, found, strict=False)
    return loaded


def _from_directory(path: str | os.PathLike[str], head: str) -> Any:
    """The model of a ``save_pretrained`` directory as ``ft.nn.from_hf`` reads it, with the
    checkpoint's pooler where ``head`` is one over BERT's pooler and the class the file names
    has none (bert-base-uncased's ``BertForMaskedLM``, roberta-base's ``RobertaForMaskedLM``:
    their files hold the pooler their class leaves unread), as HF's
    ``AutoModelFor<head>.from_pretrained(directory)`` reads it."""
    model = from_hf(path)
    family = family_of(model)
    body = getattr(model, "body", model) if isinstance(model, TaskModel) else model
    if family is None or not isinstance(body, BertModel) or body.pooler is not None:
        return model
    base = family.body_class if issubclass(family, TaskModel) else family
    if not _task(base, head).pooled:
        return model
    weights = load_checkpoint(path, "ft.hf.with_head")
    prefix = _BODY_PREFIX.get(str(base.model_type), "")
    weight, bias = (weights.get(f"{prefix}pooler.dense.{n}") for n in ("weight", "bias"))
    width = int(_tokens(body).embeddings.shape[1])
    if weight is None or bias is None or weight.shape != (width, width) or bias.shape != (width,):
        return model  # no pooler of this body's width in the file: drawn, as HF initializes a missing one
    dtype = _tokens(body).embeddings.dtype
    pooler = from_fields(Dense, {"weight": jnp.asarray(np.asarray(weight).T, dtype),
                                 "bias": jnp.asarray(np.asarray(bias), dtype), "activation": tanh})
    body = body.replace(pooler=pooler)
    return model.replace(body=body) if isinstance(model, TaskModel) else body


def _body_of(model: Any, head: str) -> tuple[type[HFModel], Any]:
    """``model``'s family and its body as a task model holds it (a causal LM without its
    ``lm_head``; a task model's ``body``); :data:`NOT_A_BODY` or :data:`NO_CONFIG` otherwise."""
    family = family_of(model)
    if family is None:
        covered = ", ".join(f.__name__ for f in FAMILIES.values())
        hf = hasattr(model, "state_dict") and hasattr(model, "config")  # a transformers model
        raise TypeError(NOT_A_BODY.format(covered=covered, given=type(model).__name__,
                                          wrong="hf_model" if hf else "model",
                                          source="hf_model" if hf else "path"))
    if getattr(model, "hf_config", None) is None:
        raise ValueError(NO_CONFIG.format(cls=type(model).__name__, head=head))
    if issubclass(family, TaskModel):
        return family.body_class, model.body.replace(hf_config=None)
    body = model.replace(lm_head=None) if isinstance(model, CausalLM) else model
    return family, body.replace(hf_config=None)  # (a task model's body carries none: its own is read)


def _task(family: type[HFModel], head: str) -> type[TaskModel]:
    """The task class of ``head`` (a suffix, or the class's name) on ``family``; :data:`NO_SUCH_HEAD`."""
    heads = HEADS.get(str(family.model_type), {})
    named = {str(getattr(TASKS[n], "suffix", "")): n for n in TASKS
             if getattr(TASKS[n], "body_class", None) is family and getattr(TASKS[n], "suffix", None) in heads}
    for suffix, name in named.items():
        if head in (suffix, name):
            return TASKS[name]  # type: ignore[return-value]
    listed = sorted(named) or ["none"]
    raise ValueError(NO_SUCH_HEAD.format(family=family.__name__, given=head, model_type=family.model_type,
                                         heads=", ".join(listed), first=listed[0]))


def _values(carried: HFConfig, task: type[TaskModel], head: str, labels: tuple[Any, Any, Any],
            problem_type: str | None, pad_token_id: int | None) -> dict[str, Any]:
    """The task model's config.json: ``carried``'s with the task class as ``architectures``
    and the labels as HF's config derives them (module docstring)."""
    values = carried.to_dict()
    values["architectures"] = [task.hf_class]
    count, id2label, label2id = labels
    fixed = next((v for k, v in _FIXED.items() if issubclass(task, k)), None)
    given = [f"{n}={v!r}" for n, v in zip(("num_labels", "id2label", "label2id"), labels) if v is not None]
    size = count if count is not None else (len(id2label) if id2label is not None else None)
    if fixed is not None and given and size not in fixed[1]:
        raise ValueError(NO_LABELS_HERE.format(hf_class=task.hf_class, outputs=fixed[0], given=", ".join(given),
                                               head=head))
    if isinstance(count, np.integer):
        count = int(count)  # (a count computed with NumPy: np.int64(3))
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(BAD_NUM_LABELS.format(given=count))
    if id2label is not None and not isinstance(id2label, Mapping):  # (a list of names: HF's config fails on .items)
        raise TypeError(ID2LABEL_NOT_MAPPING.format(kind=type(id2label).__name__, given=id2label))
    if id2label is not None and count is not None and len(id2label) != count:
        raise ValueError(LABELS_CONFLICT.format(what=f"num_labels={count} beside an id2label of {len(id2label)}",
                                                count=len(id2label), wrong=", ".join(given)))
    if label2id is not None and id2label is None and count is None:
        raise ValueError(LABELS_CONFLICT.format(what="label2id alone does not say the labels' order (id2label does)",
                                                count="labels", wrong=", ".join(given)))
    if id2label is not None:
        names = {str(k): str(v) for k, v in id2label.items()}  # config.json's keys are strings
        inverse = {v: int(k) for k, v in names.items()} if all(_int(k) for k in names) else None
        values["id2label"], values["label2id"] = names, dict(label2id) if label2id is not None else inverse
    elif count is not None:
        values["id2label"] = {str(i): f"LABEL_{i}" for i in range(count)}
        values["label2id"] = dict(label2id) if label2id is not None else {f"LABEL_{i}": i for i in range(count)}
    elif values.get("id2label") is None:  # a dict config's num_labels, else HF's default: 2 labels
        count = int(values.get("num_labels") or 2)
        values["id2label"] = {str(i): f"LABEL_{i}" for i in range(count)}
        if values.get("label2id") is None:
            values["label2id"] = {f"LABEL_{i}": i for i in range(count)}
    values.pop("num_labels", None)  # (HF derives it from id2label; the source's own may contradict the new one)
    if problem_type is not None:
        values["problem_type"] = problem_type
    if pad_token_id is not None:
        values["pad_token_id"] = pad_token_id
    return values


def _int(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def _fitted(task: type[TaskModel], body: Any, config: Any, key: jax.Array) -> Any:
    """BERT's body as ``task`` holds it: its pooler for the pooled classifier (drawn as HF
    draws a missing one where the body has none), none for the other heads."""
    if not isinstance(body, BertModel):
        return body
    if not task.pooled:
        return body.replace(pooler=None)
    if body.pooler is not None:
        return body
    width = int(_tokens(body).embeddings.shape[1])
    pooler = Dense(width, width, tanh, key=key, dtype=_tokens(body).embeddings.dtype)
    return body.replace(pooler=placed_like(_hf_initialized(task, {"pooler": pooler}, config, key)["pooler"], body))
