"""functree/_tree.py: the records functree registers (optimizer states, the learning context,
generation controls) have tree definitions that name their class.

From jaxlib 0.10 on, ``jax.tree_util.register_dataclass`` gives two dataclasses of the same
arity and static values equal tree definitions (different hashes), and ``jax.jit``'s C++
cache then ran one class's program for the other now and then: ``generate(eta_cutoff=...)``
ran the ``epsilon_cutoff`` loop (a CI failure about one process in twenty).
"""

import dataclasses
import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from functree import _tree
from functree.generation import _controls
from functree.optim import _average, _context, _hyper, _lookahead, _state

RECORDS = [_state.OptimizerState, _context.LearningContext, _lookahead.SlowState, _average.AverageState,
           _hyper.HyperState, *_controls.CONTROLS]


def bare(cls, value=0.0):
    """An instance of record ``cls``: every data field ``value``, every static field None."""
    data, meta = cls.__ft_record__
    x = object.__new__(cls)
    for name in data:
        object.__setattr__(x, name, value)
    for name in meta:
        object.__setattr__(x, name, None)
    return x


def test_every_record_is_registered_as_a_record():
    assert all(hasattr(cls, "__ft_record__") for cls in RECORDS)
    assert len(_controls.CONTROLS) >= 19  # the controls are here too


def test_two_records_never_share_a_tree_definition():
    """Pairs of the same arity and static values: equal definitions before (jaxlib 0.10+)."""
    structures = {cls: jax.tree.structure(bare(cls)) for cls in RECORDS}
    same_arity = [(a, b) for a, b in itertools.combinations(RECORDS, 2)
                  if structures[a].num_leaves == structures[b].num_leaves]
    assert len(same_arity) > 20
    for a, b in same_arity:
        assert structures[a] != structures[b], (a.__name__, b.__name__)
    assert structures[_controls.TopP] == jax.tree.structure(bare(_controls.TopP, 1.0))  # one class: equal


def test_jit_runs_each_records_own_program():
    """A jitted function of 80 one-field records of 80 classes, each class its own result:
    jit's cache found another class's program for about 1 in 12 of these calls before (all
    80 right by chance: (11/12)**80, about 1e-3; each call is a compile)."""
    f = jax.jit(lambda r: r.v * r.__class__.factor)
    wrong = []
    for i in range(80):
        cls = dataclasses.make_dataclass(f"R{i}", [("v", jax.Array)], frozen=True)
        cls.factor = float(i)
        _tree.register_record(cls, ["v"])
        if float(f(cls(jnp.float32(1.0)))) != i:
            wrong.append(i)
    assert wrong == []


def test_record_keys_rebuild_and_static_fields():
    @dataclasses.dataclass(frozen=True)
    class Count:
        n: jax.Array
        name: str = "steps"

    _tree.register_record(Count, ["n"], ["name"])
    paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(Count(np.int32(1)))[0]]
    assert paths == [".n"]
    assert jax.tree.map(lambda n: n + 1, Count(1, "x")) == Count(2, "x")
    assert jax.tree.structure(Count(1, "x")) != jax.tree.structure(Count(1, "y"))


def test_record_fields_must_split_the_dataclass():
    @dataclasses.dataclass(frozen=True)
    class Count:
        n: jax.Array
        name: str = "steps"

    with pytest.raises(ValueError, match=r"register_record\(Count\).*\('n', 'name'\)") as e:
        _tree.register_record(Count, ["n"])
    assert "right:  register_record(Count, [\"n\"], [\"name\"])" in str(e.value)
    with pytest.raises(ValueError, match="each field once"):
        _tree.register_record(Count, ["n", "name"], ["name"])
