"""A Trainer's configuration, checked once at construction: the step it runs (built from
the loss and optimizer, a ``TrainStep`` subclass, or an instance) and whether its loss takes
the PRNG key the Trainer has."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from functree import nn
from functree._module import Module
from functree._tree import dotted_name
from functree._where import committed_sharding, default_device, put, shown_devices
from functree.optim._optimizer import with_wrt
from functree.optim._skip import DEFAULT_ON_NAN, check_on_nan
from functree.optim._subset import trained_view
from functree.train._evaluation import key_parameter, signature
from functree.train._modes import (
    SHOWN,
    STEP_IN_INFERENCE,
    TrainingModeWarning,
    mode_layers,
    named_layers,
    warn_step_in_inference,
)
from functree.train._step import TrainStep
from functree.train._step_factories import train_step as make_train_step

__all__ = ["make_step", "check_key", "job_field", "check_same_model", "carried_state", "MODEL_CHANGED", "check_arguments", "MISSING", "in_training_mode",
           "warn_frozen_state", "FrozenStateWarning", "warn_step_in_inference", "STEP_IN_INFERENCE",
           "TrainingModeWarning"]

TRAINER_ELSEWHERE = """\
trainer.{name} = ...: its array {path} is committed to {devices}, and this trainer's job (its \
model, optimizer state and key) lives on {here}. The trainer trains where its model was when it \
was built; it would have moved the array back there without a word.
    wrong:  trainer.{name} = jax.device_put(trainer.{name}, jax.devices()[{other_id}])    # the job stays on {here}
    right:  trainer.{name} = jax.device_put(new_{name}, {fix})    # the trainer's devices (or NumPy arrays)
       or:  trainer.{name} = ft.train.load(path, trainer.{name})    # a checkpoint read onto the trainer's devices
       or:  trainer.save(path); trainer = ft.train.Trainer(jax.device_put(model, jax.devices()[{other_id}]), optimizer, loss_fn).restore(path)"""


MODEL_CHANGED = """\
trainer.model = ...: the new model's arrays are not the job's: {detail}. A Trainer's job is one \
model's: its optimizer state (the moments of each parameter) was made for the job's model, so \
the next step would fail against it. Set a model with the same arrays (key \
paths and shapes: an average of the weights, the best model so far), or start a job for the new \
model:

    wrong:  trainer.model = {given}(...)    # another model
    right:  trainer = ft.train.Trainer(new_model, optimizer, loss_fn)    # a new job: its optimizer state starts anew
       or:  trainer.model = jax.tree.map(f, trainer.model)               # the job's model, its values changed"""


WRT_WITH_STEP = """\
Trainer(wrt=...) cannot change a TrainStep instance's optimizer: the step was built with its own.
Give the patterns to the optimizer the step is built with:

    wrong:  ft.train.Trainer(model, opt, loss_fn, train_step=ft.train.TrainStep(loss_fn, opt), wrt={wrt!r})
    right:  opt = ft.optim.Optimizer(ft.optim.adam(1e-3), wrt={wrt!r})
            ft.train.Trainer(model, opt, loss_fn, train_step=ft.train.TrainStep(loss_fn, opt))"""

STEP_IGNORES = """\
Trainer(..., train_step=step) trains with the step's own {what}, but the Trainer was given \
another: {effect}. Give the Trainer the step's own {what}:

    wrong:  step = ft.train.train_step(loss_fn, opt{step_arg})
            ft.train.Trainer(model, {wrong}, train_step=step)
    right:  step = ft.train.train_step(loss_fn, opt{right_arg})
            ft.train.Trainer(model, {right}, train_step=step)"""

BAD_TRAIN_STEP = """\
train_step= takes a ft.train.TrainStep subclass or instance, got {given}.

    right:  class MyStep(ft.train.TrainStep):
                def compute_loss(self, model, batch, key=None): ...
            ft.train.Trainer(model, optimizer, loss_fn, train_step=MyStep)"""

LOSS_NEEDS_KEY = """\
The loss function {name}{signature} requires a PRNG key, but the Trainer has none: \
every training step calls loss_fn(model, batch, key=...) with a fresh key derived from \
the Trainer's.

    wrong:  ft.train.Trainer(model, optimizer, loss_fn)
    right:  ft.train.Trainer(model, optimizer, loss_fn, key=jax.random.key(0))"""

LOSS_TAKES_NO_KEY = """\
The Trainer has a PRNG key, so every training step calls loss_fn(model, batch, key=...) \
with a fresh key derived from it, but the loss function {name}{signature} takes no key. \
Pass the key on to the model's random layers (Dropout), or give the Trainer none (arrays \
are shuffled either way):

    wrong:  ft.train.Trainer(model, optimizer, lambda m, b: mse(m(b[0]), b[1]), key=jax.random.key(0))
    right:  ft.train.Trainer(model, optimizer, lambda m, b, key=None: mse(m(b[0], key=key), b[1]),
                             key=jax.random.key(0))
       or:  ft.train.Trainer(model, optimizer, lambda m, b: mse(m(b[0]), b[1]))"""


KERAS_LOSS = """\
ft.train.Trainer takes the loss function as its third argument, loss_fn(model, batch) -> \
a scalar loss (or (loss, aux)); loss= is Keras's compile() keyword. Got loss={given}.

    wrong:  ft.train.Trainer(model, optimizer, loss={given})
    right:  ft.train.Trainer(model, optimizer, {right})    # or loss_fn={right}{note}"""

KERAS_NAMED_LOSS = """
            (a Keras loss name is no function here: write it, e.g.
             lambda model, batch: optax.softmax_cross_entropy_with_integer_labels(model(batch[0]), batch[1]).mean())"""

HF_ARGS = """\
ft.train.Trainer's second argument is the optimizer, and {given} is Hugging Face's training \
arguments: functree's Trainer takes the optimizer (its learning rate, schedule, weight decay, \
clipping and accumulation inside it) and a loss function; epochs, batch size and evaluation \
are fit()'s. Your arguments as functree code:

    wrong:  ft.train.Trainer(model, args)          # args = TrainingArguments(...)
    right:  import optax
{recipe}{left}"""

# HF's update steps: ceil(epochs x ceil(examples / batch) / accumulation), or max_steps;
# with accumulation, the whole minibatches the recipe runs (HF_REMAINDER).
HF_STEPS = """\
            steps = {steps}   # optimizer steps{counted}"""

HF_SCHEDULES = {  # lr_scheduler_type -> the schedule, warmup W over `steps` (HF's own formulas)
    "linear": "ft.optim.schedule(optax.join_schedules([optax.linear_schedule(0.0, {lr}, {warm}), "
              "optax.linear_schedule({lr}, 0.0, steps - {warm})], [{warm}]))",
    "cosine": "ft.optim.warmup_cosine_decay(0.0, {lr}, {warm}, steps)",
    "constant": "{lr}",
    "constant_with_warmup": "ft.optim.linear_warmup({lr}, {warm})",
}

HF_OPTIMIZER = """\
            lr = {schedule}
            opt = ft.optim.Optimizer({transform}, accumulate={accumulate})
            trainer = ft.train.Trainer(model, opt, loss_fn)   # loss_fn(model, batch) -> loss
            trainer.fit(ft.train.batches(train_arrays, {batch}{drop}), {length}, validation_data=eval_data){remainder}"""

# accumulate=k splits every minibatch into k: a last one of N % batch rows (not a multiple of
# k for most N) cannot be split, so the recipe drops it, where HF's Trainer runs it as a
# shorter step.
HF_REMAINDER = """
            # drop_last: accumulate={k} splits each minibatch into {k}; the last N % {batch} examples of \
each shuffled epoch are left out, where Hugging Face's Trainer runs them as a shorter last step \
(so its count is ceil(N / {batch}) per epoch)"""

HF_LEFT = """

    not carried (set them yourself): {fields}"""


MISSING_ARGUMENT = """\
ft.train.Trainer needs the model, the optimizer and the loss function; the {what} was not given.

    wrong:  ft.train.Trainer({wrong})
    right:  ft.train.Trainer(model, ft.optim.adam(1e-3), loss_fn)    # loss_fn(model, batch) -> loss"""


class _Missing:
    """The default of Trainer's optimizer and loss_fn: none given (so that Keras's
    ``loss=`` and Hugging Face's ``Trainer(model, args)`` reach the errors naming the fix
    instead of Python's "missing 1 required positional argument")."""

    def __repr__(self) -> str:
        return "<required>"


MISSING: Any = _Missing()


def _is_training_arguments(x: Any) -> bool:
    """Hugging Face's ``TrainingArguments`` (or a subclass: ``Seq2SeqTrainingArguments``,
    TRL's ``SFTConfig``), or an object with its fields, without importing transformers."""
    named = any(c.__name__ == "TrainingArguments" for c in type(x).__mro__)
    return named or (hasattr(x, "output_dir") and hasattr(x, "per_device_train_batch_size"))


def _hf_recipe(args: Any) -> dict[str, str]:
    """Hugging Face's ``TrainingArguments`` as functree code (:data:`HF_ARGS`): AdamW after
    global-norm clipping, the learning-rate schedule over HF's step count, ``accumulate=``
    over a batch of ``per_device_train_batch_size × gradient_accumulation_steps`` (the
    same optimizer steps: ``⌈⌈N/b⌉/k⌉ = ⌈N/(b·k)⌉``), and the fields it leaves out."""
    accumulate = int(_hf(args, "gradient_accumulation_steps", 1))
    batch = int(_hf(args, "per_device_train_batch_size", 8)) * accumulate
    steps, length = _hf_steps(args, batch, whole=accumulate > 1)
    schedule, warm, left = _hf_schedule(args, steps)
    transform, more = _hf_transform(args)
    left += more + [f"{name}={_hf(args, name, None)!r}" for name in HF_NOT_CARRIED if _hf(args, name, None)]
    imports = "            import math\n" if "math." in steps + warm else ""
    counted = ", whole minibatches" if accumulate > 1 else ", as Hugging Face's Trainer counts them"
    recipe = imports + HF_STEPS.format(steps=steps, counted=counted) + "\n" + HF_OPTIMIZER.format(
        schedule=schedule, transform=transform, accumulate=accumulate, batch=batch, length=length,
        drop=", drop_last=True" if accumulate > 1 else "",
        remainder=HF_REMAINDER.format(k=accumulate, batch=batch) if accumulate > 1 else "")
    return {"recipe": recipe, "left": HF_LEFT.format(fields=", ".join(left)) if left else ""}


def _hf(args: Any, name: str, default: Any) -> Any:
    """A field of ``args`` (an object with some of TrainingArguments' fields), an enum's value."""
    value = getattr(args, name, default)
    return getattr(value, "value", value)


def _hf_steps(args: Any, batch: int, whole: bool) -> tuple[str, str]:
    """HF's optimizer steps ``T`` as code (``max_steps``, else ``⌈epochs · ⌈N/(b·k)⌉⌉``;
    ``whole``: ``⌊N/(b·k)⌋`` per epoch, the minibatches ``drop_last`` keeps), and fit()'s
    length argument."""
    epochs, max_steps = _hf(args, "num_train_epochs", 3.0), int(_hf(args, "max_steps", -1))
    if max_steps > 0:
        return str(max_steps), f"steps={max_steps}"
    per_epoch = f"(len(train_arrays[0]) // {batch})" if whole else f"-(-len(train_arrays[0]) // {batch})"
    if float(epochs).is_integer():
        return f"{int(epochs)} * {per_epoch}", f"epochs={int(epochs)}"
    return f"math.ceil({epochs} * {per_epoch})", "steps=steps"  # a fractional epoch count stops on HF's step


def _hf_schedule(args: Any, steps: str) -> tuple[str, str, list[str]]:
    """The learning rate as code (:data:`HF_SCHEDULES`), the warmup steps ``W`` (HF's:
    ``warmup_steps`` ≥ 1 is a count, below 1 a ratio of ``T``), and what it leaves out."""
    lr, kind = _hf(args, "learning_rate", 5e-5), str(_hf(args, "lr_scheduler_type", "linear"))
    ratio = float(_hf(args, "warmup_steps", 0) or 0) or float(_hf(args, "warmup_ratio", 0) or 0)  # < 5: a field
    warm = str(int(ratio)) if ratio >= 1 else (f"math.ceil(steps * {ratio})" if ratio else "0")
    left = [] if kind in HF_SCHEDULES else [f"lr_scheduler_type={kind!r} (a constant rate here)"]
    schedule = HF_SCHEDULES.get(kind, "{lr}")
    if kind == "linear" and warm == "0":  # (optax's linear_schedule takes no 0-step warmup)
        schedule = "ft.optim.schedule(optax.linear_schedule({lr}, 0.0, steps))"
    return schedule.format(lr=lr, warm=warm), warm, left


def _hf_transform(args: Any) -> tuple[str, list[str]]:
    """AdamW with HF's betas, epsilon and ``weight_decay`` (functree's default is 0.01, HF's
    0.0; both leave biases and normalization scales undecayed), after clipping at
    ``max_grad_norm``; other optimizers are named as left out."""
    adamw = (f"ft.optim.adamw(lr, beta1={_hf(args, 'adam_beta1', 0.9)}, beta2={_hf(args, 'adam_beta2', 0.999)}, "
             f"epsilon={_hf(args, 'adam_epsilon', 1e-8)}, weight_decay={_hf(args, 'weight_decay', 0.0)})")
    clip = float(_hf(args, "max_grad_norm", 1.0) or 0)
    optim = str(_hf(args, "optim", "adamw_torch"))
    left = [] if optim.startswith("adamw") else [f"optim={optim!r} (AdamW here)"]
    return (f"optax.chain(ft.optim.clip_by_global_norm({clip}), {adamw})" if clip > 0 else adamw), left


# TrainingArguments fields the recipe does not translate, named when set.
HF_NOT_CARRIED = ("fp16", "bf16", "label_smoothing_factor", "lr_scheduler_kwargs", "optim_args")


def check_arguments(optimizer: Any, loss_fn: Any, unknown: dict[str, Any]) -> None:
    """Refuse, by name and with the fix, a Trainer called as another library's: Hugging
    Face's ``Trainer(model, args)``, Keras's ``loss=``, or without an optimizer or loss."""
    args = unknown.get("args", optimizer)
    if _is_training_arguments(args):
        raise TypeError(HF_ARGS.format(given=type(args).__name__, **_hf_recipe(args)))
    if loss_fn is MISSING and "loss" in unknown:
        given = unknown["loss"]
        name = getattr(given, "__name__", None) if callable(given) else None
        right = name if name and name.isidentifier() else "loss_fn"
        raise TypeError(KERAS_LOSS.format(given=right if callable(given) else repr(given)[:60], right=right,
                                          note=KERAS_NAMED_LOSS if isinstance(given, str) else ""))
    for what, value in (("optimizer", optimizer), ("loss function", loss_fn)):
        if value is MISSING:
            wrong = "model" if optimizer is MISSING else "model, optimizer"
            raise TypeError(MISSING_ARGUMENT.format(what=what, wrong=wrong))


def make_step(train_step: Any, loss_fn: Any, optimizer: Any, metrics: Any, on_nan: Any, wrt: Any,
              parallel: dict[str, Any]) -> TrainStep:
    """The Trainer's :class:`TrainStep`: built by :func:`train_step` or by a subclass
    (with ``wrt=`` given to the optimizer), or given (whose optimizer ``wrt=`` cannot change)."""
    if wrt is not None and isinstance(train_step, TrainStep):
        raise ValueError(WRT_WITH_STEP.format(wrt=wrt))
    optimizer = with_wrt(optimizer, wrt)
    if train_step is None:
        return make_train_step(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, **parallel)
    if isinstance(train_step, TrainStep):
        _check_given_step(train_step, loss_fn, optimizer, metrics, on_nan)
        return train_step
    if isinstance(train_step, type) and issubclass(train_step, TrainStep):
        return train_step(loss_fn, optimizer, metrics=metrics, on_nan=on_nan, **parallel)
    raise TypeError(BAD_TRAIN_STEP.format(given=repr(train_step)[:80]))


def _check_given_step(step: TrainStep, loss_fn: Any, optimizer: Any, metrics: dict[str, Any], on_nan: Any) -> None:
    """A given step's loss, optimizer, metrics and ``on_nan`` are what it trains with: the
    Trainer's must be the same objects (``metrics`` and ``on_nan`` may be left out), else
    training would silently use one and the Trainer (its evaluation, its loss) the other."""
    def refuse(what: str, effect: str, wrong: str, right: str = "opt, loss_fn", step_arg: str = "",
               right_arg: str = "") -> ValueError:
        return ValueError(STEP_IGNORES.format(what=what, effect=effect, wrong=wrong, right=right,
                                              step_arg=step_arg, right_arg=right_arg))

    if loss_fn is not step.loss_fn:
        raise refuse("loss function", "training would minimize the step's, evaluation and validation "
                     "would report the Trainer's", "opt, other_loss_fn")
    if optimizer is not step.optimizer and optimizer is not getattr(step.optimizer, "_raw_transform", None):
        raise refuse("optimizer", "it would be ignored (the step updates with its own)", "other_opt, loss_fn")
    # Names as a set: the history's columns follow the step's order, whatever the Trainer's.
    if metrics and (set(metrics) != set(step.metrics) or not all(
            _same_function(fn, step.metrics[name]) for name, fn in metrics.items())):
        mine = ", metrics=[...]" if step.metrics else ""
        other = [n for n, fn in metrics.items() if n in step.metrics and not _same_function(fn, step.metrics[n])]
        effect = (f"training would log the step's {sorted(step.metrics)}, not {sorted(metrics)}" if not other else
                  f"the step computes {other[0]!r} with another function than the Trainer's {other[0]!r}")
        raise refuse("metrics", effect,
                     "opt, loss_fn, metrics=[...]", step_arg=mine, right_arg=", metrics=[...]")
    if on_nan != DEFAULT_ON_NAN and check_on_nan(on_nan) != step.on_nan:  # None: "ignore"
        raise refuse("on_nan", f"the step handles a NaN step with on_nan={step.on_nan!r}, not {on_nan!r}",
                     f"opt, loss_fn, on_nan={on_nan!r}", step_arg=f", on_nan={step.on_nan!r}",
                     right_arg=f", on_nan={on_nan!r}")


def _same_function(a: Any, b: Any) -> bool:
    """``a`` is ``b``, or both made by one definition from equal captured values (the
    Trainer resolves ``metrics=["logits"]`` to a new ``mean("logits")``: equal to the step's
    ``mean("logits")``, not to its ``mean("labels")``, nor one factory's closure over 1 to
    its closure over 2). Bound methods: one function, bound to one instance or to equal
    values (``Thresh(0.4).rate`` is not ``Thresh(0.9).rate``: their code is one, their
    ``self`` not)."""
    if a is b:
        return True
    if hasattr(a, "__self__") or hasattr(b, "__self__"):  # bound methods (a builtin's too)
        if not (hasattr(a, "__self__") and hasattr(b, "__self__")) or not _same_value(a.__self__, b.__self__):
            return False
        a, b = getattr(a, "__func__", a), getattr(b, "__func__", b)
        if a is b:
            return True
    code, other = getattr(a, "__code__", None), getattr(b, "__code__", None)
    if code is None or code is not other or not _same_values(getattr(a, "__defaults__", None) or (),
                                                               getattr(b, "__defaults__", None) or ()):
        return False
    cells = zip(a.__closure__ or (), b.__closure__ or ())
    return all(_same_value(x.cell_contents, y.cell_contents) for x, y in cells)


def _same_values(a: tuple, b: tuple) -> bool:
    return len(a) == len(b) and all(_same_value(x, y) for x, y in zip(a, b))


def _same_value(x: Any, y: Any) -> bool:
    """One captured object, or equal plain values: Python scalars and strings by value, numpy
    scalars and 0-d arrays by value and dtype (``np.float32(0.4)`` twice)."""
    if x is y:
        return True
    if type(x) in (str, int, float, bool) and type(y) in (str, int, float, bool):
        return x == y
    if isinstance(x, (np.generic, np.ndarray)) and isinstance(y, (np.generic, np.ndarray)):
        return np.ndim(x) == 0 and np.ndim(y) == 0 and x.dtype == y.dtype and bool(x == y)
    return False


BAD_TRAINING = """\
Trainer(training=...) takes None (default: a model wholly in inference mode is switched to \
training, one with some layer in training mode trains as given), True (every layer in \
training mode, as torch's model.train()) or False (the modes given); got {given!r}.

    right:  ft.train.Trainer(model, opt, loss_fn, wrt="head.*", training=False)   # torch's backbone.eval()"""

# The fixes below are code the user can run as printed: their own key paths, their wrt=.
KEEP_BY_PATH = """\
            model = ft.nn.training(model)
{puts}
            ft.train.Trainer(model, opt, loss_fn{wrt_arg}, training=False)"""

PUT_ONE = """\
            model = ft.set(model, {path!r}, ft.nn.inference(ft.get(model, {path!r})))"""

PUT_MANY = """\
            for path in {paths!r}:
                model = ft.set(model, path, ft.nn.inference(ft.get(model, path)))"""

FROZEN_STATE_SWITCHED = """\
ft.train.Trainer switches a model wholly in inference mode to training mode (as it does a \
freshly built one), so the running statistics of {paths} will change at every step although \
{its} parameters are frozen (no pattern of wrt={wrt!r} selects them). Say which you mean:

    keep them: every layer in training mode but the frozen {parts} (torch's model.train(); \
{torch_eval}), a fresh head's Dropout on:
{keep}
    update them (torch's model.train()):
            ft.train.Trainer(model, opt, loss_fn{wrt_arg}, training=True)"""

LOADED_STATE_SWITCHED = """\
ft.train.Trainer switches a model wholly in inference mode to training mode (as it does a \
freshly built one), and {paths} {hold} running statistics that are not {its} initial ones \
(trained or loaded: a mean not all 0 or a variance not all 1); in training mode they will \
change at every step. A pretrained model put in inference looks like a fresh one, so say \
which you mean:

    update them (torch's model.train() on a pretrained net):
            ft.train.Trainer(model, opt, loss_fn{wrt_arg}, training=True)
    keep them: every layer in training mode but {these} (torch's model.train(); {torch_eval}):
{keep}"""

MIXED_MODES = """\
ft.train.Trainer trains a model with some layers in training mode in the modes given, and \
{paths} {are} in inference mode (Dropout off, BatchNorm's running statistics fixed). A layer \
built fresh is in inference mode too (a new head on a trained backbone), so the Trainer cannot \
tell whether you put {them} there; say which you mean:

    every layer trains (torch's model.train()):
            ft.train.Trainer(model, opt, loss_fn{wrt_arg}, training=True)
    the modes as given (torch's model.train(); then .eval() on those layers), silencing this:
            ft.train.Trainer(model, opt, loss_fn{wrt_arg}, training=False)"""

class FrozenStateWarning(TrainingModeWarning):
    """The Trainer switched a model wholly in inference mode to training, and a layer that
    records state in training mode (BatchNorm's running statistics) has no trained
    parameter: its statistics change although the layer is frozen (:data:`FROZEN_STATE_SWITCHED`)."""


def in_training_mode(model: Any, training: bool | None = None) -> Any:
    """The model the Trainer trains. ``training=None``: ``ft.nn.training(model)`` where no
    layer is in training mode (a model built, or wholly put, in inference), else ``model``
    as given, each submodule in the mode the user chose (torch's ``model.train();
    model.backbone.eval()``: a frozen backbone's BatchNorm keeps its running statistics).
    functree's layers decide where the model has any (a fresh Equinox Dropout beside them
    is in training mode by its own default, not by the user's choice); else Equinox-style
    flags (``ft.nn.is_training``). ``True``: every layer in training mode; ``False``: the
    modes given, whatever they are (a model wholly in inference trains so)."""
    if training is not None and not isinstance(training, bool):
        raise TypeError(BAD_TRAINING.format(given=training))
    if training is not None:
        return nn.training(model) if training else model
    flags = [layer.training for _, layer in mode_layers(model)]
    chosen = any(flags) if flags else nn.is_training(model)
    return model if chosen else nn.training(model)


def warn_frozen_state(given: Any, trained: Any, wrt: tuple[str, ...] | None, training: bool | None = None) -> None:
    """Warn where the default rule (``training=None``) may have chosen modes the user did
    not mean, naming the layers and both fixes as code for their key paths:

    * kept as given, and some functree layer is in inference mode
      (:data:`MIXED_MODES`, :class:`TrainingModeWarning`): a fresh head on a trained
      backbone, or torch's ``backbone.eval()``;
    * switched to training, and a layer recording state (a BatchNorm) has no parameter
      selected by ``wrt`` (:data:`FROZEN_STATE_SWITCHED`, :class:`FrozenStateWarning`);
    * switched to training, and another BatchNorm holds statistics other than its initial
      ``μ = 0, σ² = 1`` (:data:`LOADED_STATE_SWITCHED`, :class:`TrainingModeWarning`): a
      pretrained model put in inference, which a fresh one cannot be told from otherwise."""
    if training is not None:  # said explicitly
        return
    wrt_arg = "" if wrt is None else f", wrt={wrt[0] if len(wrt) == 1 else list(wrt)!r}"
    if trained is given:  # kept as given: some layer in training mode
        left = [(path, layer) for path, layer in mode_layers(given) if not layer.training]
        if left:
            warnings.warn(MIXED_MODES.format(paths=named_layers(left), are="are" if len(left) > 1 else "is",
                                             them="them" if len(left) > 1 else "it", wrt_arg=wrt_arg),
                          TrainingModeWarning, stacklevel=3)
        return
    frozen = _frozen_stateful(given, wrt) if wrt is not None else []
    if frozen and wrt is not None:
        parts = _frozen_parts(given, wrt, [path for path, _ in frozen])
        warnings.warn(FROZEN_STATE_SWITCHED.format(
            paths=named_layers(frozen), its="their" if len(frozen) > 1 else "its", wrt=wrt[0] if len(wrt) == 1 else list(wrt),
            parts=", ".join(parts), torch_eval=_torch_eval(parts), keep=_keep(parts, wrt_arg), wrt_arg=wrt_arg),
            FrozenStateWarning, stacklevel=3)
    said = {path for path, _ in frozen}  # a frozen layer's loaded statistics: named above
    loaded = [(path, layer) for path, layer in mode_layers(given) if path not in said and _holds_statistics(layer)]
    if loaded:
        paths, many = [dotted_name(path) for path, _ in loaded], len(loaded) > 1
        warnings.warn(LOADED_STATE_SWITCHED.format(
            paths=named_layers(loaded), hold="hold" if many else "holds", its="their" if many else "its",
            these="those layers" if many else paths[0], torch_eval=_torch_eval(paths), keep=_keep(paths, wrt_arg),
            wrt_arg=wrt_arg), TrainingModeWarning, stacklevel=3)


def _keep(paths: list[str], wrt_arg: str) -> str:
    """The code putting ``paths`` in inference in an otherwise training-mode model,
    trained with ``training=False`` (:data:`KEEP_BY_PATH`)."""
    puts = PUT_ONE.format(path=paths[0]) if len(paths) == 1 else PUT_MANY.format(paths=paths)
    return KEEP_BY_PATH.format(puts=puts, wrt_arg=wrt_arg)


def _torch_eval(paths: list[str]) -> str:
    """torch's calls for ``paths``: ``model.backbone.eval()``, ``model.layers[1].eval()``."""
    def attribute(path: str) -> str:
        return "model" + "".join(f"[{p}]" if p.isdigit() else f".{p}" for p in path.split("."))

    shown = "; ".join(f"{attribute(p)}.eval()" for p in paths[:SHOWN])
    return shown + ("; ..." if len(paths) > SHOWN else "")


def _holds_statistics(layer: Any) -> bool:
    """A BatchNorm-like layer (``running_mean``, ``running_variance``) whose statistics
    are not the initial ``μ = 0, σ² = 1``: trained, or loaded from a pretrained model."""
    mean, variance = getattr(layer, "running_mean", None), getattr(layer, "running_variance", None)
    if mean is None or variance is None:
        return False
    return bool(np.any(np.asarray(mean) != 0) or np.any(np.asarray(variance) != 1))


def _frozen_parts(model: Any, wrt: tuple[str, ...], paths: list[Any]) -> list[str]:
    """For each frozen layer's key path, the largest part of ``model`` holding it that
    ``wrt`` leaves wholly frozen (``backbone`` for ``backbone.layers.1`` under
    ``wrt="head.*"``): what torch's ``backbone.eval()`` puts in inference. The model itself
    never (its trained part keeps training mode); the layer's own path at least."""
    selected = [path for path, _ in jax.tree_util.tree_flatten_with_path(trained_view(model, wrt))[0]]
    parts: list[str] = []
    for path in paths:
        length = next((n for n in range(1, len(path)) if not any(s[:n] == path[:n] for s in selected)), len(path))
        name = dotted_name(path[:length])
        if name not in parts:
            parts.append(name)
    return parts


def _records_state(x: Any) -> bool:
    """A functree layer with a static ``training`` flag and carried (``no_derivative``)
    state: in training mode it records new values of that state (BatchNorm). A class whose
    ``no_derivative`` fields are configuration it declares so, ``records_no_state = True``
    (``ft.nn.MultiheadAttention``'s per-layer logit scale and window: every frozen attention
    was named as having running statistics that training would change)."""
    if not isinstance(x, Module):
        return False
    cls = type(x)
    if getattr(cls, "records_no_state", False):
        return False
    return "training" in cls.__ft_static__ and bool(cls.__ft_no_derivative__)  # type: ignore[attr-defined]


def _frozen_stateful(model: Any, wrt: tuple[str, ...]) -> list[tuple[Any, Any]]:
    """The key paths and layers of ``model``'s state-recording layers none of whose
    parameters ``wrt`` selects: read off the optimizer's own trained view
    (:func:`trained_view`, the model's structure with ``None`` at the parameters it leaves
    frozen), layer by layer."""
    stop = lambda x: _records_state(x) or x is None  # noqa: E731  (same nodes in both views)
    every = jax.tree_util.tree_flatten_with_path(trained_view(model, None), is_leaf=stop)[0]
    chosen = jax.tree.leaves(trained_view(model, wrt), is_leaf=stop)
    return [(path, layer) for (path, layer), selected in zip(every, chosen)
            if _records_state(layer) and jax.tree.leaves(layer) and not jax.tree.leaves(selected)]


def check_key(loss_fn: Callable[..., Any], key: Any, train_step: Any) -> None:
    """A loss that requires ``key=`` needs a Trainer key; a Trainer key needs a loss that
    takes one (each step passes it). A given ``train_step`` calls the loss its own way."""
    if train_step is not None:
        return
    takes = key_parameter(loss_fn)
    name = getattr(loss_fn, "__name__", "loss_fn")
    if takes == "required" and key is None:
        raise ValueError(LOSS_NEEDS_KEY.format(name=name, signature=signature(loss_fn)))
    if takes is None and key is not None and signature(loss_fn):
        raise ValueError(LOSS_TAKES_NO_KEY.format(name=name, signature=signature(loss_fn)))


def check_placed(value: Any, name: str, where: Any) -> None:
    """:data:`TRAINER_ELSEWHERE` when an array of ``value`` (set as ``trainer.<name>``) is
    committed to other devices than the trainer's (``where``: its placement, None for the
    default device): uncommitted arrays, NumPy and arrays on the default device alone (where
    ``ft.train.load`` without a template puts them: ``functree._where.placement_of``'s "no placement")
    go where the job is."""
    default = {default_device()}
    here = default if where is None else where.device_set
    for path, leaf in jax.tree_util.tree_flatten_with_path(value)[0]:
        sharding = committed_sharding(leaf)
        if sharding is None or sharding.device_set in (here, default):
            continue
        fix = (f"jax.devices()[{next(iter(here)).id}]" if len(here) == 1
               else f"jax.tree.map(lambda x: x.sharding, trainer.{name})")
        raise ValueError(TRAINER_ELSEWHERE.format(
            name=name, path=f"{name}{jax.tree_util.keystr(path)}", devices=shown_devices(sharding.device_set), here=shown_devices(here),
            other_id=min(d.id for d in sharding.device_set), fix=fix))


def _array_shapes(model: Any) -> dict[str, tuple[int, ...]]:
    """The shape of each array of ``model`` by its key path (``model.layers[0].weight``)."""
    leaves = jax.tree_util.tree_flatten_with_path(model)[0]
    return {f"model{jax.tree_util.keystr(path)}": tuple(np.shape(x)) for path, x in leaves if hasattr(x, "dtype")}


def check_same_model(value: Any, current: Any) -> None:
    """:data:`MODEL_CHANGED` when ``trainer.model = value`` has other arrays (key paths or
    shapes) than the job's model ``current``: the optimizer state is the old model's, and
    the step refused it only at the next minibatch, as that minibatch's failure (or said
    "the model did not change"). A static value changed (an activation) is the optimizer's
    to name (its moments fit: STATE_STATIC_CHANGED carries them over), or restore's."""
    old, new = _array_shapes(current), _array_shapes(value)
    if old == new:
        return
    gone, added = [p for p in old if p not in new], [p for p in new if p not in old]
    reshaped = [f"{p} has shape {new[p]}, the job's {old[p]}" for p in old if p in new and old[p] != new[p]]
    parts = ([f"the job's {', '.join(gone[:3])}{' ...' if len(gone) > 3 else ''} missing"] if gone else []) + \
        ([f"{', '.join(added[:3])}{' ...' if len(added) > 3 else ''} added"] if added else []) + reshaped[:3]
    raise ValueError(MODEL_CHANGED.format(detail="; ".join(parts), given=type(value).__name__))


def carried_state(optimizer: Any, opt_state: Any, current: Any, value: Any) -> Any:
    """``opt_state`` for ``trainer.model = value``, a model with the job's arrays
    (:func:`check_same_model`) whose structure differs: a static value changed (an
    activation), or its class defined again (a notebook cell re-run). Its leaves (the
    moments, the learning context) under the structure ``optimizer.init(value)`` has (traced
    abstractly: no arrays made), as STATE_STATIC_CHANGED tells a hand loop to do: the step
    would otherwise refuse the state at the next minibatch. Unchanged where the leaves do
    not fit that structure one for one (the step then names what differs)."""
    if jax.tree.structure(current) == jax.tree.structure(value):
        return opt_state  # (the common case: new values, the same tree)
    with warnings.catch_warnings():  # (init's warnings on these arrays were given as the job started)
        warnings.simplefilter("ignore")
        shaped = jax.eval_shape(optimizer.init, value)
    leaves, wanted = jax.tree.leaves(opt_state), jax.tree.leaves(shaped)
    if len(leaves) != len(wanted) or any(np.shape(a) != b.shape for a, b in zip(leaves, wanted)):
        return opt_state
    return jax.tree.unflatten(jax.tree.structure(shaped), leaves)


def job_field(name: str, doc: str, settable: bool = False, check: Callable[[Any, Any], None] | None = None,
              arrays: bool = False, also: Callable[[Any, Any], dict[str, Any]] | None = None) -> Any:
    """A property reading ``name`` of the current :class:`JobState` (setting it commits a
    new record: callbacks replace ``trainer.model``, set ``trainer.stop_training``).
    ``arrays``: the step's inputs, committed where the trainer's model lives (one compiled step).
    ``check(value, current)`` refuses a value before it is set; ``also(trainer, value)`` gives
    the other fields that change with it (the optimizer state's structure with the model's)."""
    def get(self: Any) -> Any:
        return getattr(self._job, name)

    def set_(self: Any, value: Any) -> None:
        if check is not None:
            check(value, getattr(self._job, name))
        if arrays:
            check_placed(value, name, self._where)
            value = put(value, self._where)
        self._job = self._job.replace(**{name: value}, **({} if also is None else also(self, value)))

    return property(get, set_ if settable else None, doc=doc)
