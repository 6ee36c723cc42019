"""functree.parallel: beyond one device, on JAX's own SPMD engine. It places arrays;
the steps that run over a mesh are ``ft.train.TrainStep(..., mesh=mesh)`` and
``ft.train.EvalStep(..., mesh=mesh)`` (``functree.train`` imports this package, never the
reverse).

* :func:`partition_specs` / :func:`shard`: sharding rules by key path (``None``,
  ``"fsdp"`` or ``{pattern: PartitionSpec or "fsdp"}``) for models, parameter views and optimizer
  states; ``shard`` also builds a model directly in its shards.
* :func:`cast`: floating parameters in a compute dtype (mixed precision).
* :func:`shard_batch`: the global batch from each process's share.
* :func:`sharded_target` / :func:`mesh_shape`: where a checkpoint's arrays go on a mesh
  (``ft.train.load(path, template, mesh=mesh, sharding=rules)`` restores onto any mesh,
  each device reading its own shards).
* ``DataParallelStep`` / ``DataParallelEvalStep``: the older names of
  ``ft.train.TrainStep(..., mesh=)`` / ``ft.train.EvalStep(..., mesh=)``, defined in
  ``functree.train`` and looked up there on first use (:data:`ELSEWHERE`): this package
  cannot import the package that imports it.

Nothing here communicates by itself: meshes and ``NamedSharding`` place the arrays,
``jax.shard_map`` collectives aggregate gradients, ``jax.distributed`` spans processes.
"""

from typing import TYPE_CHECKING

from functree._lazy import lazy_names
from functree.parallel._cast import cast
from functree.parallel._mesh import auto_mesh
from functree.parallel._placement import shard_batch
from functree.parallel._rules import FSDP_MIN_SIZE, partition_specs
from functree.parallel._shard import shard
from functree.parallel._targets import mesh_shape, sharded_target

__all__ = [
    "shard",
    "partition_specs",
    "cast",
    "FSDP_MIN_SIZE",
    "shard_batch",
    "auto_mesh",
    "sharded_target",
    "mesh_shape",
]

if TYPE_CHECKING:  # what ELSEWHERE's names are, for type checkers and editors
    from functree.train._step_factories import DataParallelEvalStep as DataParallelEvalStep
    from functree.train._step_factories import DataParallelStep as DataParallelStep

# The older names of the mesh steps, where they were first documented: name -> the module
# above this package that defines them.
ELSEWHERE = {
    "DataParallelStep": "functree.train._step_factories",
    "DataParallelEvalStep": "functree.train._step_factories",
}


# ``ft.parallel.DataParallelStep`` and the other names of ELSEWHERE: the object itself, from
# ``functree.train`` (imported on this first read).
__getattr__, __dir__ = lazy_names(__name__, ELSEWHERE)
del lazy_names
