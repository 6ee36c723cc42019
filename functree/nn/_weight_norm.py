"""Weight reparametrizations of a Dense or convolution: torch's ``weight_norm`` and
``spectral_norm`` (``torch.nn.utils.parametrizations``).

Each wrapper holds the wrapped layer with its ``weight`` taken out (None: everything else,
the bias and the static settings, stays there) and the tensors the weight is computed from;
a call computes the weight and calls the layer with it. ``dim`` is torch's: an axis of
torch's weight layout (``Linear`` ``[out, in]``, ``Conv`` ``[out, in / groups, *k]``,
``ConvTranspose`` ``[in, out / groups, *k]``), mapped onto ft's (``Dense`` ``[in, out]``,
``Conv`` ``[*k, in / groups, out]``, ``ConvTranspose`` ``[*k, in, out / groups]``): torch's
``dim=0`` of a Linear or Conv is ft's last axis, the output units.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp

from functree._module import field
from functree._random import one_key
from functree.nn._check import check_unbatched
from functree.nn._conv import ConvTranspose, torch_weight_axes
from functree.nn._linear import Dense
from functree.nn._mode import Layer
from functree.nn._precision import statistics_dtype
from functree.nn._similarity import normalize
from functree.nn._state import record_state
from functree.nn._window import is_int

__all__ = ["WeightNorm", "SpectralNorm"]

NOT_WRAPPABLE = """\
ft.nn.{cls} wraps a Dense or a convolution (Conv1D/2D/3D and their transposes), whose weight \
layout it maps torch's dim= onto; got {given}.

    wrong:  ft.nn.{cls}({given_name}(...))
    right:  ft.nn.{cls}(ft.nn.Dense(in_features, out_features, key=key){key})"""

BAD_DIM = """\
ft.nn.{cls}: dim={dim!r} is not an axis of torch's {ndim}-axis weight of a {layer} \
({layout}): {allowed}.

    wrong:  ft.nn.{cls}(layer, dim={dim!r})
    right:  ft.nn.{cls}(layer, dim={right!r})     # torch's dim: an axis of torch's layout"""

DIM_MINUS_ONE = """\
ft.nn.WeightNorm: dim=-1 is torch weight_norm's dim=None (one norm over the whole weight, g \
a scalar: torch._weight_norm reads -1 so), not the last axis of torch's layout. Say which:

    wrong:  ft.nn.WeightNorm(layer, dim=-1)
    right:  ft.nn.WeightNorm(layer, dim=None)     # torch's numbers for dim=-1
       or:  ft.nn.WeightNorm(layer, dim={last})     # a norm per index of torch's last axis"""

BAD_ITERATIONS = """\
ft.nn.SpectralNorm: n_power_iterations={given!r}; it takes a positive int (torch: "Expected \
n_power_iterations to be positive").

    wrong:  ft.nn.SpectralNorm(layer, n_power_iterations={given!r}, key=key)
    right:  ft.nn.SpectralNorm(layer, n_power_iterations=1, key=key)"""

WEIGHT_NOT_NONE = """\
ft.nn.{cls}.layer holds a weight: the wrapper computes the layer's weight from {tensors} and \
calls the layer with it, so the layer's own must be None (a layer put back by replace?).

    wrong:  wrapped.replace(layer=layer)
    right:  wrapped.replace(layer=layer.replace(weight=None))"""

_INIT_ITERATIONS = 15  # torch's power iterations when spectral_norm is applied


def _torch_axes(layer: Any, cls: str, key_arg: str) -> tuple[int, ...]:
    """``perm`` with ft's weight axis ``j`` holding torch's axis ``perm[j]``, or :data:`NOT_WRAPPABLE`."""
    perm = torch_weight_axes(layer)
    if perm is None:
        given = type(layer).__name__
        raise TypeError(NOT_WRAPPABLE.format(cls=cls, given=given, given_name=given, key=key_arg))
    return perm


def _torch_layout(layer: Any) -> str:
    if isinstance(layer, Dense):
        return "Linear [out, in]"
    if isinstance(layer, ConvTranspose):
        return "ConvTranspose [in, out / groups, *kernel]"
    return "Conv [out, in / groups, *kernel]"


def _dim(cls: str, layer: Any, dim: Any, ndim: int, right: int) -> int:
    """torch's ``dim`` wrapped into ``[0, ndim)``, or :data:`BAD_DIM`."""
    if not is_int(dim) or not -ndim <= dim < ndim:
        raise ValueError(BAD_DIM.format(cls=cls, dim=dim, ndim=ndim, layer=type(layer).__name__,
                                        layout=_torch_layout(layer), right=right,
                                        allowed=f"an int in [-{ndim}, {ndim - 1}]" + (
                                            " or None" if cls == "WeightNorm" else "")))
    return int(dim) % ndim


def _check_taken(cls: str, layer: Any, tensors: str) -> None:
    if layer.weight is not None:
        raise ValueError(WEIGHT_NOT_NONE.format(cls=cls, tensors=tensors))


def _norm(weight: jax.Array, perm: tuple[int, ...], dim: int | None) -> jax.Array:
    """The 2-norm of ``weight`` over every ft axis but the one holding torch's ``dim`` (kept,
    of size one), or over all of it (a scalar) for None (torch's ``norm_except_dim``)."""
    axes = None if dim is None else tuple(i for i in range(weight.ndim) if i != perm.index(dim))
    return jnp.sqrt(jnp.sum(jnp.square(weight), axis=axes, keepdims=dim is not None))


class WeightNorm(Layer):
    """torch's ``weight_norm`` (``torch.nn.utils.parametrizations``) of a Dense or a
    convolution: its weight is ``g * v / ||v||``, the norm over every axis but ``dim``'s (each
    output unit's vector for ``dim=0``), or over the whole weight for ``dim=None``.

    ``v`` (the direction, the layer's weight at the start) and ``g`` (the magnitude,
    ``||weight||`` at the start, so the layer computes what it did) are parameters:
    gradients reach both. ``dim`` is torch's, an axis of torch's weight layout (module
    docstring); ``g`` has ft's weight layout with size one on every other axis (``[1, out]``
    for a Dense, ``dim=0``; a scalar for ``dim=None``). torch's ``dim=-1`` means ``None``
    there, not the last axis, and is refused (:data:`DIM_MINUS_ONE`). No epsilon, as torch's:
    ``v`` with a zero vector gives NaN. The wrapped layer (``layer``, its weight None) keeps
    its bias and settings. Errors: :data:`NOT_WRAPPABLE`, :data:`BAD_DIM`,
    :data:`DIM_MINUS_ONE`, :data:`WEIGHT_NOT_NONE`.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> dense = ft.nn.Dense(3, 2, key=jax.random.key(0))
      >>> wn = ft.nn.WeightNorm(dense)
      >>> wn.g.shape, wn.v.shape
      ((1, 2), (3, 2))
      >>> x = jnp.ones((4, 3))
      >>> bool(jnp.allclose(wn(x), dense(x)))
      True
      >>> [round(float(n), 4) for n in jnp.linalg.norm(wn.weight, axis=0) / wn.g[0]]
      [1.0, 1.0]
    """

    g: jax.Array
    v: jax.Array
    layer: Any
    dim: int | None = field(static=True, default=0)

    def __init__(self, layer: Any, dim: int | None = 0):
        perm = _torch_axes(layer, "WeightNorm", "")
        ndim = len(perm)
        if dim is not None:
            if is_int(dim) and dim == -1:
                raise ValueError(DIM_MINUS_ONE.format(last=ndim - 1))
            dim = _dim("WeightNorm", layer, dim, ndim, 0)
        self.dim = dim
        self.v = layer.weight
        weight = layer.weight
        self.g = _norm(weight.astype(statistics_dtype(weight.dtype)), perm, dim).astype(weight.dtype)
        self.layer = layer.replace(weight=None)

    @property
    def weight(self) -> jax.Array:
        """``g * v / ||v||``: the weight the layer is called with (in float32 for bfloat16 and
        float16 ``v``, as torch accumulates the norm, then cast back)."""
        wide = statistics_dtype(self.v.dtype)
        v, g = self.v.astype(wide), self.g.astype(wide)
        return (v * (g / _norm(v, _torch_axes(self.layer, "WeightNorm", ""), self.dim))).astype(self.v.dtype)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_taken("WeightNorm", self.layer, "g and v")
        rank = len(_torch_axes(self.layer, "WeightNorm", ""))  # an ensemble's layer outside jax.vmap
        check_unbatched(self, v=rank, g=0 if self.dim is None else rank)
        return self.layer.replace(weight=self.weight)(x)


def _power(matrix: jax.Array, u: jax.Array, v: jax.Array, steps: int, eps: float,
           legacy: bool = False) -> tuple[jax.Array, jax.Array]:
    """``steps`` power iterations ``u = normalize(W v), v = normalize(W^T u)``, not differentiated;
    ``legacy``: ``v`` first, then ``u`` (the deprecated ``torch.nn.utils.spectral_norm``'s
    order, which leaves other ``u``, ``v``, so another sigma, after each step)."""
    matrix = jax.lax.stop_gradient(matrix)
    for _ in range(steps):
        if legacy:
            v = normalize(matrix.T @ u, eps=eps)
            u = normalize(matrix @ v, eps=eps)
        else:
            u = normalize(matrix @ v, eps=eps)
            v = normalize(matrix.T @ u, eps=eps)
    return u, v


@functools.partial(jax.jit, static_argnums=(2, 3))
def _start(matrix: jax.Array, key: jax.Array, eps: float, legacy: bool) -> tuple[jax.Array, jax.Array]:
    """torch's starting ``u``, ``v``: normal draws normalized, then 15 power iterations (one
    compiled program, not 60 operations run one by one); ``legacy``: none, as the deprecated
    ``torch.nn.utils.spectral_norm`` starts."""
    u = normalize(jax.random.normal(key, matrix.shape[:1], matrix.dtype), eps=eps)
    v = normalize(jax.random.normal(jax.random.fold_in(key, 1), matrix.shape[1:], matrix.dtype), eps=eps)
    return (u, v) if legacy else _power(matrix, u, v, _INIT_ITERATIONS, eps)


class SpectralNorm(Layer):
    """torch's ``spectral_norm`` (``torch.nn.utils.parametrizations``) of a Dense or a
    convolution: its weight is ``weight / sigma``, ``sigma = u . (W v)`` the largest singular
    value of ``W`` as power iteration estimates it.

    ``W`` is torch's matrix of the weight: torch's layout with ``dim`` moved first and the
    rest flattened, ``[h, w]`` (``[out, in * prod(kernel)]`` for a Conv, in torch's order, so
    torch's ``_u`` ``[h]`` and ``_v`` ``[w]`` port as they are). ``dim=None`` is torch's
    default: 0, 1 for a transposed convolution (its output channels). In training mode
    (``ft.nn.training``) each call runs ``n_power_iterations`` steps
    ``u = normalize(W v), v = normalize(W^T u)`` (:func:`~functree.nn.normalize`: ``a / max(||a||, eps)``) and
    records the new ``u``, ``v`` for ``ft.nn.collect_state`` (no-derivative state, as
    BatchNorm's statistics); inference uses the stored ones. Gradients reach ``weight`` through
    ``W`` in ``sigma`` and the division, not through ``u`` and ``v`` (torch's ``no_grad``).
    ``key`` draws the starting ``u`` and ``v``, then 15 steps run, as torch's on applying it.

    ``legacy=True`` is the deprecated ``torch.nn.utils.spectral_norm`` (a forward hook; buffers
    ``weight_orig``, ``weight_u``, ``weight_v``): each step updates ``v = normalize(W^T u)``
    first, then ``u = normalize(W v)``, so training reaches other numbers than the current
    form's from the same tensors (inference, with the stored ``u``, ``v``, is the same), and
    no steps run at the start (torch's hook starts from the normalized draws). ``ft.nn.
    load_torch_state_dict`` sets it to the form the state dict holds (``weight_orig`` ...: the
    deprecated one), and ``ft.nn.torch_state_dict`` writes that form's names back.
    Errors: :data:`NOT_WRAPPABLE`, :data:`BAD_DIM`, :data:`BAD_ITERATIONS`, :data:`WEIGHT_NOT_NONE`.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> dense = ft.nn.Dense(4, 3, key=jax.random.key(0))
      >>> sn = ft.nn.SpectralNorm(dense, key=jax.random.key(1))
      >>> sn.u.shape, sn.v.shape     # torch's matrix: [out, in]
      ((3,), (4,))
      >>> round(float(jnp.linalg.norm(sn.normalized_weight, ord=2)), 3)
      1.0
      >>> y, state = ft.nn.collect_state(lambda m: m(jnp.ones((2, 4))), ft.nn.training(sn))
      >>> sorted(str(path) for path in state)
      ['.u', '.v']
    """

    weight: jax.Array
    u: jax.Array = field(no_derivative=True)
    v: jax.Array = field(no_derivative=True)
    layer: Any
    n_power_iterations: int = field(static=True, default=1)
    eps: float = field(static=True, default=1e-12)
    dim: int = field(static=True, default=0)
    training: bool = field(static=True, default=False)
    legacy: bool = field(static=True, default=False)

    def __init__(self, layer: Any, n_power_iterations: int = 1, eps: float = 1e-12, dim: int | None = None, *,
                 key: jax.Array, training: bool = False, legacy: bool = False):
        perm = _torch_axes(layer, "SpectralNorm", ", key=key")
        default = 1 if isinstance(layer, ConvTranspose) else 0
        self.dim = _dim("SpectralNorm", layer, default if dim is None else dim, len(perm), default)
        if not is_int(n_power_iterations) or n_power_iterations <= 0:
            raise ValueError(BAD_ITERATIONS.format(given=n_power_iterations))
        self.n_power_iterations, self.eps, self.training = int(n_power_iterations), float(eps), training
        self.legacy = bool(legacy)
        self.weight = layer.weight
        self.layer = layer.replace(weight=None)
        self.u, self.v = _start(self._matrix(self.weight), one_key(key), self.eps, self.legacy)

    def _matrix(self, weight: jax.Array) -> jax.Array:
        """torch's ``[h, w]`` matrix of ft's ``weight``: torch's layout, ``dim`` first, flattened."""
        perm = _torch_axes(self.layer, "SpectralNorm", ", key=key")
        torch_weight = jnp.transpose(weight, tuple(perm.index(i) for i in range(len(perm))))
        return jnp.moveaxis(torch_weight, self.dim, 0).reshape(weight.shape[perm.index(self.dim)], -1)

    def _sigma(self, weight: jax.Array) -> jax.Array:
        matrix = self._matrix(weight)
        u, v = self.u, self.v
        if self.training:
            u, v = _power(matrix, u, v, self.n_power_iterations, self.eps, self.legacy)
            record_state(self, u=u, v=v)
        u, v = jax.lax.stop_gradient(u), jax.lax.stop_gradient(v)
        return jnp.dot(u, matrix @ v)

    @property
    def normalized_weight(self) -> jax.Array:
        """``weight / sigma`` with the stored ``u`` and ``v`` (inference's weight)."""
        return self.weight / jnp.dot(self.u, self._matrix(self.weight) @ self.v)

    def __call__(self, x: jax.Array) -> jax.Array:
        _check_taken("SpectralNorm", self.layer, "weight, u and v")
        rank = len(_torch_axes(self.layer, "SpectralNorm", ", key=key"))  # an ensemble's layer outside jax.vmap
        check_unbatched(self, weight=rank, u=1, v=1)  # (the transpose to torch's layout failed in JAX)
        return self.layer.replace(weight=self.weight / self._sigma(self.weight))(x)
