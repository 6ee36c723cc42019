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
  ``functree.train`` and set here by ``functree/__init__.py`` once both are imported (this
  package never imports ``functree.train``).

Nothing here communicates by itself: meshes and ``NamedSharding`` place the arrays,
``jax.shard_map`` collectives aggregate gradients, ``jax.distributed`` spans processes.
"""

from collections.abc import Callable
from typing import Any

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

# Set by functree/__init__.py (see the module docstring); declared here for type checkers.
DataParallelStep: Callable[..., Any]
DataParallelEvalStep: Callable[..., Any]
