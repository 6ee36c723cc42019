"""Rotary position embeddings (Su et al. 2021, RoFormer).

Position ``p`` rotates each pair of features ``(x_i, x_{i + d/2})`` (the "half" layout
of GPT-NeoX and LLaMA) by the angle ``p * theta_i`` with ``theta_i = base^(-2i / d)``::

    y_i         = x_i * cos(p theta_i) - x_{i+d/2} * sin(p theta_i)
    y_{i+d/2}   = x_{i+d/2} * cos(p theta_i) + x_i * sin(p theta_i)

so ``<rotate(q, m), rotate(k, n)>`` depends on the positions only through ``m - n``.
Angles and rotation are computed in float32 (or wider) and returned in the input dtype.
:class:`RopeScaling` replaces the frequencies ``theta_i`` by scaled ones (context
extension: Llama 3's, YaRN, linear and dynamic NTK), as Hugging Face computes them.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from functree._module import field
from functree._repr import short_array
from functree._traces import staged
from functree.nn._check import check_input, concrete, size_argument
from functree.nn._embedding import table_rows
from functree.nn._mode import Layer
from functree.nn._normalization import statistics_dtype
from functree.nn._window import is_int

__all__ = ["apply_rotary", "RotaryEmbedding", "RopeScaling"]

ODD_SIZE = """\
apply_rotary expects x [..., size] with an even size (features are rotated in pairs), \
got {given}.

    wrong:  ft.nn.apply_rotary(x, positions)            # x.shape[-1] == {size}
    right:  ft.nn.apply_rotary(x[..., :{even}], positions)   # or project to an even size
"""

ODD_LAYER_SIZE = """\
RotaryEmbedding: size must be an even int >= 2 (features are rotated in pairs), got {size}.

    wrong:  rope = ft.nn.RotaryEmbedding({size})
    right:  rope = ft.nn.RotaryEmbedding({even}); rope(x[..., :{even}])   # or project x to an even size
"""

BAD_POSITIONS = """\
apply_rotary: positions {given} must broadcast against x's leading axes {lead} (one \
position per vector x[..., :]).

    wrong:  ft.nn.apply_rotary(q, jnp.arange(T))            # q: [batch, T, heads, head_size]
    right:  ft.nn.apply_rotary(q, jnp.arange(T)[:, None])   # positions [T, 1] -> [batch, T, heads]
"""

BAD_SEQ_AXIS = """\
RotaryEmbedding: seq_axis must count from the end and precede the feature axis (-2, -3, \
...), got {axis}.

    wrong:  ft.nn.RotaryEmbedding({size}, seq_axis={axis})
    right:  ft.nn.RotaryEmbedding({size}, seq_axis=-3)     # x: [batch, T, heads, {size}]
"""

UNKNOWN_ROPE = """\
ft.nn.RopeScaling: rope type {kind!r} is not covered; covered: {known}.

    wrong:  ft.nn.RopeScaling({kind!r}, ...)
    right:  ft.nn.RopeScaling("llama3", base=500000.0, factor=8.0, original_max_positions=8192)
"""

ROPE_NEEDS = """\
ft.nn.RopeScaling({kind!r}) needs {needs}; given {given}.

    wrong:  ft.nn.RopeScaling({kind!r}, base=10000.0)
    right:  ft.nn.RopeScaling({kind!r}, base=10000.0, {example})
"""

ROPE_TYPES = ("default", "linear", "dynamic", "yarn", "llama3", "longrope")

ROPE_BASE = """\
{where}: base={given!r}; the rotary base is a positive number, at least {smallest:.3g}: the \
frequencies theta_i = base^(-2i/d) are float32 numbers (at most 1 / base), and from this base \
they are infinite or NaN, every rotated feature NaN.

    wrong:  {wrong}
    right:  {right}
"""

SMALLEST_BASE = 1 / float(np.finfo(np.float32).max)  # the smallest base whose frequencies float32 holds


def check_base(base: Any, where: str, wrong: str, right: str) -> None:
    """:data:`ROPE_BASE` for a Python or NumPy number below :data:`SMALLEST_BASE` (0, a negative
    base, 1e-300: NaNs from every layer); a traced base is the caller's."""
    if isinstance(base, (int, float, np.integer, np.floating)) and not base >= SMALLEST_BASE:
        raise ValueError(ROPE_BASE.format(where=where, given=base, smallest=SMALLEST_BASE, wrong=wrong, right=right))

ROPE_CHOICE = """\
apply_rotary: base={given} is a tuple of rotary embeddings (one per layer type: Gemma 3's local \
and global layers), so choice= must pick one ({why}); each is an ft.nn.RopeScaling, all \
rotating the same part of the head (one partial).

    wrong:  ft.nn.apply_rotary(x, positions, base=(local, scaled))
    right:  ft.nn.apply_rotary(x, positions, base=(local, scaled), choice=1)        # an int32 index
       or:  attn.replace(rotary=(local, scaled), member_rope=jnp.asarray([0, 0, 1], jnp.int32))   # a Stack's, one per member
"""

LONGROPE_FACTORS = """\
ft.nn.RopeScaling('longrope') has {given} short and long factors for a rotated size of {size}; \
it takes one per pair of features ({pairs}), as Phi-3's config.rope_parameters lists them.

    right:  ft.nn.RopeScaling("longrope", short_factor=(1.0,) * {pairs}, long_factor=(4.0,) * {pairs}, ...)
"""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Rotary frequencies ``theta_i`` scaled for a longer context (Hugging Face's ``rope_type``).

    With ``d`` the rotated size, ``theta_i = base^(-2i/d)`` (``"default"``) becomes:

    * ``"linear"``: ``theta_i / factor`` (positions interpolated: ``p / factor``).
    * ``"dynamic"`` (NTK-aware): ``base`` grows with the sequence, ``base' = base (factor L /
      L0 - (factor - 1))^(d / (d - 2))`` with ``L = max(max position + 1, L0)`` over the
      call's positions and ``L0 = original_max_positions`` (no change up to ``L0``).
    * ``"llama3"``: wavelengths ``lambda_i = 2 pi / theta_i`` above ``L0 / low_freq_factor``
      are divided by ``factor``, those below ``L0 / high_freq_factor`` kept, and in between
      ``(1 - s) theta_i / factor + s theta_i`` with ``s = (L0 / lambda_i - low) / (high - low)``.
    * ``"yarn"`` (Peng et al. 2023): ``theta_i`` blends ``theta_i`` (dimensions rotating
      more than ``beta_fast`` times over ``L0``) and ``theta_i / factor`` (fewer than
      ``beta_slow``) along a linear ramp, and cos/sin are scaled by ``attention_factor``
      (default ``0.1 ln(factor) + 1``, or its ``mscale`` / ``mscale_all_dim`` ratio).

    * ``"longrope"`` (Phi-3): ``theta_i / short_factor[i]``, or ``theta_i / long_factor[i]``
      where the call's longest position passes ``L0`` (read from the positions, as
      ``"dynamic"``); cos/sin scaled by ``attention_factor`` (default
      ``sqrt(1 + ln(factor) / ln(L0))``).

    ``partial=f`` (any kind; Hugging Face's ``partial_rotary_factor``, GPT-NeoX's
    ``rotary_pct``) rotates only the first ``d' = int(f size)`` features of each vector,
    with the frequencies of size ``d'``; the rest pass unchanged.

    Pass it where a rotary base goes: ``ft.nn.MultiheadAttention(..., rotary=scaling)``,
    ``ft.nn.apply_rotary(x, positions, base=scaling)``. Hashable (a static field).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> linear = ft.nn.RopeScaling("linear", factor=2.0)
      >>> linear.inverse_frequencies(4)       # theta = (1, 1/100) halved
      Array([0.5  , 0.005], dtype=float32)
      >>> x = jnp.array([[1.0, 0.0, 1.0, 0.0]])
      >>> bool(jnp.allclose(ft.nn.apply_rotary(x, jnp.array([2]), base=linear), ft.nn.apply_rotary(x, jnp.array([1]))))
      True
    """

    kind: str = "default"
    base: float = 10000.0
    factor: float = 1.0
    original_max_positions: int | None = None
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    partial: float = 1.0
    short_factor: tuple[float, ...] | None = None
    long_factor: tuple[float, ...] | None = None

    def __post_init__(self) -> None:
        for name in ("short_factor", "long_factor"):  # a list (as config.json holds them): a tuple, so
            value = getattr(self, name)                # the scaling is hashable (static, a compile's key)
            if isinstance(value, list):
                object.__setattr__(self, name, tuple(value))
        if not (isinstance(self.partial, (int, float)) and 0 < self.partial <= 1):
            raise ValueError(ROPE_NEEDS.format(kind=self.kind, needs="0 < partial <= 1", given=f"partial={self.partial!r}",
                                               example="partial=0.25"))
        if self.kind not in ROPE_TYPES:
            raise ValueError(UNKNOWN_ROPE.format(kind=self.kind, known=", ".join(ROPE_TYPES)))
        check_base(self.base, "ft.nn.RopeScaling", f"ft.nn.RopeScaling({self.kind!r}, base={self.base!r}, ...)",
                   f"ft.nn.RopeScaling({self.kind!r}, base=10000.0, ...)   # the checkpoint's own (Llama 3: 500000.0)")
        if self.kind == "longrope" and (self.short_factor is None or self.long_factor is None):
            raise ValueError(ROPE_NEEDS.format(kind=self.kind, needs="short_factor and long_factor (one per pair)",
                                               given=f"short_factor={self.short_factor!r}, long_factor={self.long_factor!r}",
                                               example="short_factor=(1.0, 1.0), long_factor=(4.0, 4.0), "
                                                       "original_max_positions=4096"))
        if self.kind in ("dynamic", "yarn", "llama3", "longrope") and self.original_max_positions is None:
            raise ValueError(ROPE_NEEDS.format(kind=self.kind, needs="original_max_positions (the pretrained context)",
                                               given="none", example="factor=4.0, original_max_positions=2048"))
        if self.kind not in ("default", "longrope") and not (isinstance(self.factor, (int, float)) and self.factor >= 1):
            raise ValueError(ROPE_NEEDS.format(kind=self.kind, needs="factor >= 1", given=f"factor={self.factor!r}",
                                               example="factor=4.0, original_max_positions=2048"))

    @property
    def scale(self) -> float:
        """The factor on cos and sin (YaRN's attention factor; 1 otherwise)."""
        if self.kind not in ("yarn", "longrope"):
            return 1.0
        if self.attention_factor is not None:
            return float(self.attention_factor)
        if self.kind == "longrope":
            return 1.0 if self.factor <= 1 else math.sqrt(1 + math.log(self.factor) / math.log(self.original_max_positions or 2))

        def mscale(m: float) -> float:
            return 1.0 if self.factor <= 1 else 0.1 * m * math.log(self.factor) + 1.0

        if self.mscale and self.mscale_all_dim:
            return mscale(self.mscale) / mscale(self.mscale_all_dim)
        return mscale(1.0)

    def inverse_frequencies(self, size: int, positions: Any = None) -> jax.Array:
        """``theta_i`` for ``i < size / 2`` (float32); ``"dynamic"`` reads the largest of
        ``positions``."""
        exponents = np.arange(0, size, 2, dtype=np.float64) / size
        theta = 1.0 / self.base ** exponents
        if self.kind == "linear":
            theta = theta / self.factor
        elif self.kind == "llama3":
            theta = self._llama3(theta)
        elif self.kind == "yarn":
            theta = self._yarn(theta, size)
        elif self.kind == "longrope":
            short, long = (np.asarray(f, np.float64) for f in (self.short_factor, self.long_factor))
            if not short.shape == long.shape == theta.shape:
                raise ValueError(LONGROPE_FACTORS.format(given=f"{short.size} and {long.size}", size=size,
                                                         pairs=theta.size))
            if positions is None:
                return jnp.asarray(theta / short, jnp.float32)
            longest = jnp.max(jnp.asarray(positions)) + 1
            return jnp.where(longest > (self.original_max_positions or 0), jnp.asarray(theta / long, jnp.float32),
                             jnp.asarray(theta / short, jnp.float32))
        elif self.kind == "dynamic" and positions is not None:
            original = float(self.original_max_positions or 0)
            longest = jnp.maximum(jnp.max(jnp.asarray(positions)).astype(jnp.float32) + 1, original)
            base = self.base * (self.factor * longest / original - (self.factor - 1)) ** (size / (size - 2))
            return 1.0 / base ** jnp.asarray(exponents, jnp.float32)
        return jnp.asarray(theta, jnp.float32)

    def _llama3(self, theta: np.ndarray) -> np.ndarray:
        old = float(self.original_max_positions or 0)
        low, high = self.low_freq_factor, self.high_freq_factor
        wavelength = 2 * math.pi / theta
        scaled = np.where(wavelength > old / low, theta / self.factor, theta)
        smooth = (old / wavelength - low) / (high - low)
        smoothed = (1 - smooth) * scaled / self.factor + smooth * scaled
        medium = (wavelength >= old / high) & (wavelength <= old / low)
        return np.where(medium, smoothed, scaled)

    def _yarn(self, theta: np.ndarray, size: int) -> np.ndarray:
        old = float(self.original_max_positions or 0)

        def dimension(rotations: float) -> float:  # the dimension turning `rotations` times over `old`
            return size * math.log(old / (rotations * 2 * math.pi)) / (2 * math.log(self.base))

        low, high = dimension(self.beta_fast), dimension(self.beta_slow)
        if self.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, size - 1)
        high = high + 0.001 if low == high else high
        ramp = np.clip((np.arange(size // 2, dtype=np.float32) - low) / (high - low), 0, 1)
        keep = 1 - ramp  # 1: extrapolate (theta as is), 0: interpolate (theta / factor)
        return theta / self.factor * (1 - keep) + theta * keep


def apply_rotary(x: Any, positions: Any, *, base: float | RopeScaling | tuple[RopeScaling, ...] = 10000.0,
                 choice: Any = None) -> jax.Array:
    """Rotate ``x [..., size]`` by the rotary embedding of ``positions`` (see the module).

    ``positions`` (integers or floats) broadcast against ``x.shape[:-1]``: one position per
    feature vector. For per-head queries ``[batch, T, heads, head_size]`` pass
    ``jnp.arange(T)[:, None]``. ``base`` is the base of ``theta_i``, or a
    :class:`RopeScaling` (scaled frequencies), or a tuple of RopeScalings of which the
    integer (array) ``choice`` picks one, ``theta = stack(theta^(0), theta^(1), ...)[choice]``
    (a traced index: each member of an ``ft.nn.Stack`` its own rope, Gemma 3's local and
    global layers; :data:`ROPE_CHOICE` where it is missing).

    Example:
      >>> import functree as ft, jax.numpy as jnp
      >>> x = jnp.array([[1.0, 0.0], [1.0, 0.0]])       # two tokens, size 2: theta = 1
      >>> ft.nn.apply_rotary(x, jnp.array([0, 1])).round(3)   # (cos p, sin p)
      Array([[1.   , 0.   ],
             [0.54 , 0.841]], dtype=float32)
    """
    x = jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"apply_rotary expects a floating x, got {short_array(x)}; pass x.astype(jnp.float32).")
    size = x.shape[-1] if x.ndim else 0
    if x.ndim == 0 or size % 2:
        raise ValueError(ODD_SIZE.format(given=short_array(x), size=size, even=max(size - 1, 0)))
    positions = jnp.asarray(positions)
    try:
        jnp.broadcast_shapes(positions.shape, x.shape[:-1])
    except ValueError:
        raise ValueError(BAD_POSITIONS.format(given=short_array(positions), lead=list(x.shape[:-1]))) from None
    if isinstance(base, (tuple, list)):
        base = _choices(base, choice)
    check_base(base, "apply_rotary", f"ft.nn.apply_rotary(x, positions, base={base!r})",
               "ft.nn.apply_rotary(x, positions, base=10000.0)")
    partial = base[0].partial if isinstance(base, tuple) else base.partial if isinstance(base, RopeScaling) else 1.0
    if int(size * partial) < size:  # the first features only
        rotated = int(size * partial)
        if rotated % 2:
            raise ValueError(ODD_SIZE.format(given=f"{short_array(x)} (partial={partial}: {rotated} rotated)",
                                             size=rotated, even=max(rotated - 1, 0)))
        whole = tuple(dataclasses.replace(b, partial=1.0) for b in base) if isinstance(base, tuple) else \
            dataclasses.replace(base, partial=1.0)  # type: ignore[type-var]  # a RopeScaling (partial < 1)
        head = apply_rotary(x[..., :rotated], positions, base=whole, choice=choice)
        return jnp.concatenate([head, x[..., rotated:]], axis=-1)
    picked = None if not isinstance(base, tuple) else jnp.asarray(choice)
    if not staged() and (isinstance(base, (RopeScaling, tuple)) or is_int(base) or isinstance(base, float)):
        return _rotated_compiled(x, positions, picked, base=base)
    return _rotated(x, positions, base, picked)


def _choices(base: Any, choice: Any) -> tuple[RopeScaling, ...]:
    """``base`` as a tuple of RopeScalings of one ``partial`` with a ``choice``, else :data:`ROPE_CHOICE`."""
    why = "none was given" if choice is None else ""
    if not base or not all(isinstance(b, RopeScaling) for b in base):
        why = "an empty tuple" if not base else "not every entry is a RopeScaling"
    elif len({b.partial for b in base}) > 1:
        why = f"partials {[b.partial for b in base]} differ"
    elif choice is not None and not jnp.issubdtype(jnp.asarray(choice).dtype, jnp.integer):
        why = f"choice {short_array(jnp.asarray(choice))} is not an integer"
    elif choice is not None:
        given = concrete(choice)  # traced: _rotated makes an entry outside NaN
        if given is not None and ((given < 0) | (given >= len(base))).any():
            # (indexing would clamp it onto the last entry, or count a negative one from the end)
            why = f"choice {given.tolist()} is no entry of it: 0 to {len(base) - 1}"
    if why:
        raise ValueError(ROPE_CHOICE.format(given=f"a tuple of {len(base)}", why=why))
    return tuple(base)


@functools.partial(jax.jit, static_argnames=("base",))
def _rotated_compiled(x: jax.Array, positions: jax.Array, choice: Any, *,
                      base: float | RopeScaling | tuple[RopeScaling, ...]) -> jax.Array:
    """:func:`_rotated` as one program per shapes and ``base``: called eagerly, its ~15
    operations were as many programs, each compiled again at every new length."""
    return _rotated(x, positions, base, choice)


def _rotated(x: jax.Array, positions: jax.Array, base: Any, choice: Any = None) -> jax.Array:
    """The rotation of checked inputs, traced (or run) where it is called (``choice``: the
    entry of a tuple ``base``, an integer array)."""
    size = x.shape[-1]
    dtype = statistics_dtype(x.dtype)
    half = size // 2
    scale = None
    if isinstance(base, tuple):  # one rope per Stack member: every entry's theta, the member's picked
        # a traced choice outside the tuple: NaN (indexing would clamp it, or wrap a negative one)
        theta = table_rows(jnp.stack([b.inverse_frequencies(size, positions).astype(dtype) for b in base]), choice)
        if any(b.scale != 1.0 for b in base):
            scale = table_rows(jnp.asarray([b.scale for b in base], dtype), choice)
    elif isinstance(base, RopeScaling):
        theta = base.inverse_frequencies(size, positions).astype(dtype)
        scale = None if base.scale == 1.0 else jnp.asarray(base.scale, dtype)
    else:
        theta = jnp.asarray(base, dtype) ** (-jnp.arange(half, dtype=dtype) * 2 / size)
    angle = positions.astype(dtype)[..., None] * jax.lax.broadcast_to_rank(theta, positions.ndim + 1)
    cos, sin = jnp.cos(angle), jnp.sin(angle)
    if scale is not None:
        cos, sin = cos * scale, sin * scale
    xs = x.astype(dtype)
    first, second = xs[..., :half], xs[..., half:]
    cos, sin = (jax.lax.broadcast_to_rank(a, first.ndim) for a in (cos, sin))  # (by hand: rank promotion may raise)
    y = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return y.astype(x.dtype)


class RotaryEmbedding(Layer):
    """Rotary position embedding of inputs ``[..., T, size]`` or ``[..., T, heads, size]``.

    ``layer(x)`` applies :func:`apply_rotary` with positions ``0 .. T-1`` along
    ``seq_axis`` (``-2`` for ``[..., T, size]``, ``-3`` for per-head ``[..., T, heads,
    size]``), or with the given ``positions`` (e.g. an offset when decoding with a cache).
    It has no parameters; apply it to the queries and keys of attention, not the values.

    Example:
      >>> import functree as ft, jax, jax.numpy as jnp
      >>> rope = ft.nn.RotaryEmbedding(4)
      >>> q = jax.random.normal(jax.random.key(0), (2, 6, 4))   # batch 2, 6 tokens
      >>> rope(q).shape
      (2, 6, 4)
      >>> bool(jnp.allclose(rope(q)[:, 0], q[:, 0]))            # position 0: no rotation
      True
    """

    size: int = field(static=True, default=2)
    base: float = field(static=True, default=10000.0)
    seq_axis: int = field(static=True, default=-2)

    def __init__(self, size: int, base: float = 10000.0, *, seq_axis: int = -2):
        if not is_int(size):  # a float (d / 2), array or tuple: no int at all
            size_argument("RotaryEmbedding", "size", size)
        size = int(size)
        if size % 2 or size < 2:
            raise ValueError(ODD_LAYER_SIZE.format(size=size, even=max(size - 1, 2)))
        if seq_axis > -2:
            raise ValueError(BAD_SEQ_AXIS.format(axis=seq_axis, size=size))
        check_base(base, "ft.nn.RotaryEmbedding", f"ft.nn.RotaryEmbedding({size}, base={base!r})",
                   f"ft.nn.RotaryEmbedding({size}, base=10000.0)")
        self.size, self.base, self.seq_axis = size, float(base), seq_axis

    def __call__(self, x: jax.Array, positions: Any = None) -> jax.Array:
        need = -self.seq_axis
        check_input(self, x, ("T",) + (None,) * (need - 2) + (self.size,), min_rank=need)
        if positions is None:
            length = x.shape[self.seq_axis]
            positions = jnp.arange(length).reshape((length,) + (1,) * (need - 2))
        return apply_rotary(x, positions, base=self.base)
