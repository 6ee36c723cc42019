"""A tiny training job for tests/test_train_job.py, and what its subprocess runs.

``job(config)`` builds the data (in four kinds) and a fresh Trainer; the TrainSteps are
shared between Trainers of one process (one compilation per configuration). ``_sigkill``
(train with checkpoints until killed) and ``_sigint`` (Ctrl-C at random moments, a JSON
report) run in the test's child process.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

import functree as ft

X = np.random.default_rng(0).normal(size=(40, 3)).astype(np.float32)
Y = (X @ np.array([[1.0], [-2.0], [0.5]], np.float32)).astype(np.float32)


def loss_fn(model, batch, *, key):
    x, y = batch
    return jnp.mean((model(x, key=key) - y) ** 2)


def model():
    k1, k2 = jax.random.split(jax.random.key(0))
    return ft.nn.Sequential(ft.nn.Dense(3, 4, key=k1), ft.nn.Dropout(0.25), ft.nn.Dense(4, 1, key=k2))


_STEPS: dict[tuple[int, int], ft.train.TrainStep] = {}


def trainer(accumulate: int = 1, steps_per_call: int = 1) -> ft.train.Trainer:
    """A fresh Trainer; its TrainStep (and so its compiled programs) is shared."""
    opt = ft.optim.Optimizer(ft.optim.adam(0.05), accumulate=accumulate)
    step = _STEPS.get((accumulate, steps_per_call))
    if step is None:
        step = _STEPS[accumulate, steps_per_call] = ft.train.TrainStep(loss_fn, opt, steps_per_call=steps_per_call)
    return ft.train.Trainer(model(), step.optimizer, loss_fn, key=jax.random.key(7), train_step=step)


class Bomb:
    """Raises after ``after`` minibatches were taken (across epochs): a killed job."""

    def __init__(self, after: int | None):
        self.after, self.taken = after, 0

    def tick(self) -> None:
        if self.after is not None and self.taken >= self.after:
            raise RuntimeError("killed")
        self.taken += 1


def _list(n_batches: int) -> list:
    size = len(X) // n_batches
    return [(X[i * size:(i + 1) * size], Y[i * size:(i + 1) * size]) for i in range(n_batches)]


class KilledBatches(ft.train.Batches):
    def __init__(self, bomb, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.bomb = bomb

    def iterate(self, epoch, start=0):
        for batch in super().iterate(epoch, start):
            self.bomb.tick()
            yield batch


class KilledList(list):
    def __init__(self, items, bomb):
        super().__init__(items)
        self.bomb = bomb

    def __iter__(self):
        for batch in super().__iter__():
            self.bomb.tick()
            yield batch


class Reiterable:
    """Re-iterable without len() or position: iter() starts an epoch from its first batch."""

    def __init__(self, items, bomb):
        self.items, self.bomb = items, bomb

    def __iter__(self):
        for batch in self.items:
            self.bomb.tick()
            yield batch


class PositionedIterator:
    """An epoch iterator that reports its position (the get_state/set_state protocol)."""

    def __init__(self, items, bomb):
        self.items, self.bomb, self.index = items, bomb, 0

    def __iter__(self):
        return self

    def __next__(self):
        if self.index >= len(self.items):
            raise StopIteration
        self.bomb.tick()
        self.index += 1
        return self.items[self.index - 1]

    def get_state(self):
        return {"index": self.index}

    def set_state(self, state):
        self.index = state["index"]


class Positioned:
    def __init__(self, items, bomb):
        self.items, self.bomb = items, bomb

    def __len__(self):
        return len(self.items)

    def __iter__(self):
        return PositionedIterator(self.items, self.bomb)


def data(kind: str, n_batches: int, kill_after: int | None = None):
    bomb = Bomb(kill_after)
    if kind == "batches":
        return KilledBatches(bomb, (X, Y), len(X) // n_batches, shuffle=True, key=jax.random.key(3),
                             drop_last=True)
    items = _list(n_batches)
    return {"list": KilledList, "reiterable": Reiterable, "positioned": Positioned}[kind](items, bomb)


def fit(t: ft.train.Trainer, config: dict, directory, kill_after: int | None = None, extra=()):
    """The job: ``config["epochs"]`` epochs with a ModelCheckpoint, EarlyStopping and a
    HistoryLogger (each callback's state matters for the result)."""
    callbacks = [
        ft.train.ModelCheckpoint(directory, every_steps=config["every_steps"], max_to_keep=None),
        ft.train.EarlyStopping(monitor="loss", patience=1, min_delta=config.get("min_delta", 0.05)),
        ft.train.HistoryLogger(os.path.join(str(directory) + "-log.jsonl")),
        *extra,
    ]
    t.fit(data(config["kind"], config["n_batches"], kill_after), epochs=config["epochs"],
          log_every=config["log_every"], steps_per_call=config["steps_per_call"], progress=False,
          callbacks=callbacks)
    return callbacks


NUMERICS = ("jax_default_matmul_precision", "jax_numpy_dtype_promotion", "jax_enable_x64")
"""The JAX settings that change a step's program (a float32 dot's precision: on a GPU the
default is TF32, on a CPU float32 either way): a job resumed under other values computes
otherwise."""


def child_env(*paths: str) -> dict[str, str]:
    """This process's environment for a child that runs jobs, with its JAX settings
    (:data:`NUMERICS`, which the conftest sets after the start) as the child's environment
    variables, and ``paths`` before the inherited ``PYTHONPATH``: the child's programs are
    this process's (issue 44 item 3: a child at the default matmul precision wrote the
    checkpoints a test compared, bit for bit, with jobs at "highest")."""
    env = dict(os.environ)
    for name in NUMERICS:
        value = getattr(jax.config, name)
        if value is not None:
            env[name.upper()] = str(value).lower() if isinstance(value, bool) else str(value)
    env["PYTHONPATH"] = os.pathsep.join([*paths, env.get("PYTHONPATH", "")])
    return env


def signature(tree) -> list:
    """What ``jax.jit`` keys a program on, leaf by leaf: dtype, shape, weak type, sharding,
    committed, and the memory layout (a key's: that of its data)."""
    def layout(x) -> str:
        x = jax.random.key_data(x) if jnp.issubdtype(x.dtype, jax.dtypes.prng_key) else x
        return str(x.format.layout)

    return [[str(x.dtype), list(x.shape), bool(getattr(x, "weak_type", False)), str(x.sharding), bool(x.committed),
             layout(x)] for x in jax.tree.leaves(tree)]


def step_program(t: ft.train.Trainer, batch) -> list[str]:
    """Digests of the lowered and the compiled text of the very program a step of ``t``
    runs on ``batch`` (the flat program, with the trainer's log buffer)."""
    program = t.train_step._program(t.model)
    flat, donated, others = program._program((t.model, t.opt_state, batch, t.key, t._reader.log.buffer))
    lowered = flat.jitted.lower(tuple(donated), others)  # as a call passes them (a tuple)
    texts = [lowered.as_text(), lowered.compile().as_text()]
    if os.environ.get("FT_DUMP_PROGRAM"):
        for i, text in enumerate(texts):
            with open(f"{os.environ['FT_DUMP_PROGRAM']}.{os.getpid()}.{i}", "w") as f:
                f.write(text)
    return [hashlib.sha256(_program_only(text).encode()).hexdigest() for text in texts]


def _program_only(text: str) -> str:
    r"""A program's text without what names where it was traced from: the compiled module's
    source tables and ``metadata={...}``, private functions' numbers (they count the
    functions traced before in the process), and the names of values and computations.

    XLA names an instruction after its op's name stack, and JAX traces an inner ``jit``
    once per process and keeps its jaxpr with the name stack of that first trace: after
    an epoch's shuffle (``train/_data.py``'s ``_permutation``) ran ``jit(_threefry_fold_in)``
    first, the step's fold-in is named ``%_permutation.28``, else ``%TrainStep_step.28``.
    The program is the same; each ``%name`` becomes its order of first appearance, which
    keeps what feeds what (and every op, shape, layout and fusion) in the comparison.

    >>> _program_only("%a.1 = f32[] add(%x, %x)\n%b = f32[] neg(%a.1)")
    '%0 = f32[] add(%1, %1)\n%2 = f32[] neg(%0)'
    """
    text = re.sub(r"\nFileNames\n.*?\n(?=[%A-Z][A-Za-z_.%]* ?[^\n]*\{\n)", "\n", text, flags=re.S)
    text = re.sub(r", metadata=\{[^{}]*\}", "", text)
    text = re.sub(r"(@[\w.]+?)_\d+\b", r"\1", text)
    order: dict[str, int] = {}
    return re.sub(r"%[\w.\-]+", lambda m: f"%{order.setdefault(m.group(), len(order))}", text)


def _program(config: dict, directory: str, out: str | None = None) -> None:
    """The job of ``config`` straight through, then the digests of its step program (in a
    fresh process: the program must not depend on the process), printed or written whole
    to the file ``out`` (a rename: a reader never sees part of it)."""
    t = trainer(config["accumulate"], config["steps_per_call"])
    fit(t, config, directory)
    digests = json.dumps(step_program(t, (X[:10], Y[:10])))
    if out is None:
        print(digests, flush=True)
        return
    with open(out + ".part", "w") as f:
        f.write(digests)
    os.replace(out + ".part", out)


def _sigkill(directory: str, config: dict) -> None:
    t = trainer(config["accumulate"], config["steps_per_call"])

    class Slow(ft.train.Callback):
        reads_model = False

        def on_log(self, trainer, context):
            time.sleep(0.02)  # room for a kill between checkpoints

    print("ready", flush=True)
    fit(t, config, directory, extra=[Slow()])
    print("done", flush=True)


def _sigint(trials: int, seed: int) -> None:
    """Ctrl-C at random moments of a dispatch-bound fit; each interrupted trainer goes on
    to the end. Reports lost models, stuck trainers and bit-for-bit equality."""
    # Python's Ctrl-C handler: a shell's background job starts its children with SIGINT ignored
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = np.random.default_rng(seed)
    batches = ft.train.batches((X, Y), 4, key=jax.random.key(3))  # 10 steps per epoch
    steps = 60
    reference = trainer()
    reference.fit(batches, steps=steps, progress=False, log_every=7)
    expect = [np.asarray(x) for x in jax.tree.leaves((reference.model, reference.opt_state))]
    start = time.perf_counter()
    trainer().fit(batches, steps=steps, progress=False, log_every=7)
    duration = time.perf_counter() - start
    report = {"trials": 0, "interrupted": 0, "lost": 0, "stuck": 0, "equal": 0}
    main = os.getpid()
    for _ in range(trials):
        t = trainer()
        timer = threading.Timer(float(rng.uniform(0, 0.8 * duration)), lambda: os.kill(main, signal.SIGINT))
        try:
            timer.start()
            t.fit(batches, steps=steps, progress=False, log_every=7)
            timer.join()  # the Ctrl-C may come after fit
            time.sleep(0.02)
        except KeyboardInterrupt:
            report["interrupted"] += 1 if t.steps_run < steps else 0
        if t.steps_run == steps:  # the Ctrl-C came after fit: fits run faster now (less load)
            duration *= 0.7
        try:
            timer.join()  # it has fired: the Ctrl-C came from it
            time.sleep(0.02)
        except KeyboardInterrupt:
            pass
        try:
            for x in jax.tree.leaves((t.model, t.opt_state)):
                np.asarray(x)  # a deleted (donated) buffer raises here
        except Exception:
            report["lost"] += 1
            continue
        try:
            for _ in range(3):  # a late Ctrl-C may still land in the first retry
                try:
                    t.fit(batches, steps=steps, progress=False, log_every=7)
                    break
                except KeyboardInterrupt:
                    pass
        except Exception as e:
            report["stuck"] += 1
            print("stuck:", type(e).__name__, str(e)[:300], file=sys.stderr)
            continue
        got = [np.asarray(x) for x in jax.tree.leaves((t.model, t.opt_state))]
        same = t.steps_run == steps and all(np.array_equal(a, b) for a, b in zip(got, expect))
        if not same:
            print("differs:", t.steps_run, t.epoch, t.batch_in_epoch, file=sys.stderr)
        report["equal"] += int(same)
        report["trials"] += 1
    print(json.dumps(report), flush=True)

