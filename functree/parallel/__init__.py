"""functree.parallel: beyond one device, on JAX's own SPMD engine.

* :func:`partition_specs` / :func:`shard`: sharding rules by key path (``None``,
  ``"fsdp"`` or ``{pattern: PartitionSpec}``) for models, parameter views and optimizer
  states; ``shard`` also builds a model directly in its shards.
* :func:`cast`: floating parameters in a compute dtype (mixed precision).
* :class:`DataParallelStep` / :class:`DataParallelEvalStep`: the training and evaluation
  steps over a mesh's data axis (``ft.train.train_step(..., mesh=mesh)``), and
  :func:`shard_batch`, the global batch from each process's share.
* :func:`sharded_target` / :func:`mesh_shape`: where a checkpoint's arrays go on a mesh
  (``ft.train.load(path, template, mesh=mesh, sharding=rules)`` restores onto any mesh,
  each device reading its own shards).

Nothing here communicates by itself: meshes and ``NamedSharding`` place the arrays,
``jax.shard_map`` collectives aggregate gradients, ``jax.distributed`` spans processes.
"""

from functree.parallel._cast import cast
from functree.parallel._mesh import auto_mesh
from functree.parallel._placement import mesh_shape, sharded_target
from functree.parallel._rules import FSDP_MIN_SIZE, partition_specs
from functree.parallel._shard import shard
from functree.parallel._step import (
    DataParallelEvalStep,
    DataParallelOptimizer,
    DataParallelStep,
    shard_batch,
)

__all__ = [
    "shard",
    "partition_specs",
    "cast",
    "FSDP_MIN_SIZE",
    "DataParallelStep",
    "DataParallelEvalStep",
    "DataParallelOptimizer",
    "shard_batch",
    "auto_mesh",
    "sharded_target",
    "mesh_shape",
]
