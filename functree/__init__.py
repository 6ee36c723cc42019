"""functree: Swift's differentiable-programming design for JAX.

Models are immutable pytrees whose leaves are their parameters; key paths read and write
nested parameters; differential operators carry the Swift proposal's names.

    >>> import functree as ft
"""

from typing import TYPE_CHECKING

from functree._alias import AliasWarning
from functree._config import config
from functree._derivative import (
    DifferentiableFunction,
    derivative,
    differentiable,
    with_recomputation_in_pullbacks,
    without_derivative,
)
from functree._diagnostics import (
    DiagnosticReport,
    NonDifferentiableWarning,
    UncoveredDerivativeError,
    UnusedParameterWarning,
    ZeroDerivativeWarning,
    diagnose,
)
from functree._display import Summary, summary
from functree._fields import field
from functree._jit import ControlFlowError, jit
from functree._key_path_names import (
    get,
    key_path,
    set,  # noqa: A004 - Swift's name; ft.set never shadows the builtin at call sites
)
from functree._lazy import lazy_names
from functree._module import (
    DifferentiationWarning,
    FrozenModuleError,
    Module,
    NonDifferentiableFieldWarning,
)
from functree._nan import NaNReport
from functree._operators import (
    differential,
    gradient,
    hessian,
    jacobian,
    pullback,
    value_with_differential,
    value_with_gradient,
    value_with_pullback,
)
from functree._parameters import mask, parameters, select, tree_map, update, with_parameters
from functree._paths import (
    KeyPath,
    all_key_paths,
    all_writable_key_paths,
    recursively_all_key_paths,
    recursively_all_writable_key_paths,
)
from functree._state_dict import FlatDictReport, from_flat_dict, to_flat_dict
from functree._tangent import (
    inner_product,
    move,
    tangent_add,
    tangent_norm,
    tangent_scale,
    tangent_subtract,
    zero_tangent_vector,
    zero_tangent_vector_initializer,
)

if TYPE_CHECKING:  # the lazy names below, for type checkers, editors and the API reference
    from functree import generation, hf, interop, losses, nn, optim, parallel, train
    from functree.parallel import cast, partition_specs, shard
    from functree.train._export import Exported, ExportError, export

# ``import functree`` runs the core (the modules above: the differential operators, key
# paths, Module); each subpackage is imported when it is first read (``ft.nn``, or ``import
# functree.nn``), so a process that never trains or ports a model never pays for it (PEP
# 562). Name -> the module it is read from; a subpackage is the module itself.
_SUBPACKAGES = ("nn", "optim", "train", "losses", "parallel", "hf", "generation", "interop")
_LAZY = {
    **{name: f"functree.{name}" for name in _SUBPACKAGES},
    "shard": "functree.parallel",
    "partition_specs": "functree.parallel",
    "cast": "functree.parallel",
    "export": "functree.train._export",
    "Exported": "functree.train._export",
    "ExportError": "functree.train._export",
}


__getattr__, __dir__ = lazy_names(__name__, _LAZY)  # ``ft.nn``, ``ft.shard``: imported on their first read
del lazy_names


__version__ = "0.1.0"  # the one place: pyproject.toml reads it; CHANGELOG.md names each release

__all__ = [
    # models
    "Module",
    "field",
    "FrozenModuleError",
    "summary",
    "Summary",
    # key paths
    "KeyPath",
    "key_path",
    "get",
    "set",
    "all_key_paths",
    "all_writable_key_paths",
    "recursively_all_key_paths",
    "recursively_all_writable_key_paths",
    "to_flat_dict",
    "from_flat_dict",
    "FlatDictReport",
    # parameter view
    "parameters",
    "with_parameters",
    "update",
    "tree_map",
    "select",
    "mask",
    # the Differentiable protocol
    "move",
    "zero_tangent_vector",
    "zero_tangent_vector_initializer",
    "tangent_add",
    "tangent_subtract",
    "tangent_scale",
    "inner_product",
    "tangent_norm",
    # differential operators
    "gradient",
    "value_with_gradient",
    "value_with_pullback",
    "pullback",
    "value_with_differential",
    "differential",
    "derivative",
    "jacobian",
    "hessian",
    "differentiable",
    "DifferentiableFunction",
    "without_derivative",
    "with_recomputation_in_pullbacks",
    # beyond one device
    "shard",
    "partition_specs",
    "cast",
    # compilation and diagnostics
    "jit",
    "export",
    "Exported",
    "ExportError",
    "ControlFlowError",
    "DifferentiationWarning",
    "NonDifferentiableFieldWarning",
    "ZeroDerivativeWarning",
    "UncoveredDerivativeError",
    "NonDifferentiableWarning",
    "UnusedParameterWarning",
    "AliasWarning",
    "diagnose",
    "DiagnosticReport",
    "NaNReport",
    "config",
    # subpackages
    "nn",
    "optim",
    "train",
    "losses",
    "parallel",
    "hf",
    "generation",
    "interop",
]
