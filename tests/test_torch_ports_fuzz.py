"""The twenty-eighth session's torch ports fuzzed against torch 2.13 in float64, as a user
migrating from torch would call them: random shapes (batch-less, size-1 axes, odd sizes),
inputs drawn from a small grid so that ties, zeros and the margin boundary come up, every
reduction, masks of every kind torch's Transformer takes, pads, folds and pools at their
edges. Values and gradients against torch's (autograd). Derandomized (conftest's "ci"
profile); ``--hypothesis-profile=explore`` draws ten times as many.

Found here (each with a regression test in its module's file): the margin losses' gradient
at the margin (torch's ``clamp_min`` passes it, relu's was 0), L1's at a zero error (torch's
0, was 1), cosine_embedding's eps (torch's is the float 1e-12), triplet_margin's margin <= 0
(torch refuses it), ``pairwise_distance(p=0)`` (a bare ZeroDivisionError) and its gradient
for ``p < 1`` at a zero component (NaN, torch's 0), a float16 and a float32 Transformer mask
summed in float16, PReLU's one slope turning a scalar input into ``[1]``. Added after the
next audit (each would have been caught here): EmbeddingBag's short last offset with
include_last_offset=True (refused; torch reads the last bag to the end) and zero pads
cropping past the axis ([0, 0] here; torch refuses).
"""

import functools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hypothesis import examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional

# float64 on both sides: the measured spread over these examples is 3.9e-16 of the values'
# scale (losses and gradients, the encoder layer; pads, pools and folds exact) and 3.1e-15
# for the distances (powers 0.5 and 3 and their gradients); RTOL is ~30x the largest (other
# XLA CPU instruction sets reorder the sums; checked under SSE4_2 to AVX512).
RTOL = 1e-13

GRID = [-1.0, -0.5, 0.0, 0.5, 1.0]  # ties, zeros and margins of 0, 0.5, 1 meet exactly


def _grid(draw, shape):
    return np.array(draw(st.lists(st.sampled_from(GRID), min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape)))), np.float64).reshape(shape)


def _signs(draw, shape):
    return np.array(draw(st.lists(st.sampled_from([-1.0, 1.0]), min_size=int(np.prod(shape)),
                                  max_size=int(np.prod(shape)))), np.float64).reshape(shape)


def _close(ours, theirs, rtol=RTOL):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    assert ours.shape == theirs.shape
    scale = max(1.0, float(np.max(np.abs(theirs), initial=0.0)))
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=rtol * scale)


def _torch_grads(loss, arrays, grads):
    tensors = [torch.tensor(a, requires_grad=i in grads) if a.dtype.kind == "f" else torch.tensor(a)
               for i, a in enumerate(arrays)]
    value = loss(*tensors)
    if grads:
        value.sum().backward()
    return value.detach().numpy(), [tensors[i].grad.numpy() for i in grads]


@st.composite
def _margin_case(draw):
    """(key, ours, torch's, arrays, indices of the arrays differentiated); ``key``: the name
    and every setting ``ours`` closes over (examples with one key compute one function)."""
    batch = draw(st.sampled_from([(), (1,), (3,), (2, 3)]))
    red = draw(st.sampled_from(["none", "sum", "mean"]))
    margin = draw(st.sampled_from([0.0, 0.5, 1.0]))
    name = draw(st.sampled_from(["margin_ranking", "hinge_embedding", "soft_margin", "l1", "mean_absolute_error",
                                 "smooth_l1", "huber", "triplet_margin", "cosine_embedding", "multi_margin",
                                 "multilabel_margin"]))
    x, x2 = (_grid(draw, batch) for _ in range(2))
    y = _signs(draw, batch)
    key = (name, red, margin)
    if name == "margin_ranking":
        return (key, lambda a, b, s: ft.losses.margin_ranking(a, b, s, margin=margin, reduction=red),
                lambda a, b, s: F.margin_ranking_loss(a, b, s, margin=margin, reduction=red), (x, x2, y), (0, 1))
    if name == "hinge_embedding":
        return (key, lambda a, s: ft.losses.hinge_embedding(a, s, margin=margin, reduction=red),
                lambda a, s: F.hinge_embedding_loss(a, s, margin=margin, reduction=red), (x, y), (0,))
    if name == "soft_margin":
        return (key, lambda a, s: ft.losses.soft_margin(a, s, reduction=red),
                lambda a, s: F.soft_margin_loss(a, s, reduction=red), (x, y), (0,))
    if name in ("l1", "mean_absolute_error"):
        ours = getattr(ft.losses, name)
        return (key, lambda a, b: ours(a, b, reduction=red), lambda a, b: F.l1_loss(a, b, reduction=red),
                (x, x2), (0, 1))
    if name == "smooth_l1":
        return (key, lambda a, b: ft.losses.smooth_l1(a, b, beta=margin, reduction=red),
                lambda a, b: F.smooth_l1_loss(a, b, beta=margin, reduction=red), (x, x2), (0, 1))
    if name == "huber":
        delta = margin or 1.0
        return (key, lambda a, b: ft.losses.huber(a, b, delta=delta, reduction=red),
                lambda a, b: F.huber_loss(a, b, delta=delta, reduction=red), (x, x2), (0, 1))
    vectors = batch[:1] + (draw(st.sampled_from([1, 2, 3])),)  # torch's: one vector or a batch of them
    a, p, n = (_grid(draw, vectors) for _ in range(3))
    if name == "triplet_margin":
        order, swap = draw(st.sampled_from([1.0, 2.0])), draw(st.booleans())
        margin = margin or 1.0  # torch's rule: > 0
        return (key + (order, swap), lambda u, v, w: ft.losses.triplet_margin(u, v, w, margin=margin, p=order, eps=0.0, swap=swap,
                                                               reduction=red),
                lambda u, v, w: F.triplet_margin_loss(u, v, w, margin=margin, p=order, eps=0.0, swap=swap,
                                                      reduction=red), (a, p, n), (0, 1, 2))
    if name == "cosine_embedding":
        labels = _signs(draw, vectors[:-1])
        return (key, lambda u, v, s: ft.losses.cosine_embedding(u, v, s, margin=margin, reduction=red),
                lambda u, v, s: F.cosine_embedding_loss(u, v, s, margin=margin, reduction=red), (a, p, labels), (0, 1))
    classes = vectors[-1]
    if name == "multi_margin":
        labels = np.array(draw(st.lists(st.integers(0, classes - 1), min_size=int(np.prod(vectors[:-1])),
                                        max_size=int(np.prod(vectors[:-1])))), np.int64).reshape(vectors[:-1])
        order = draw(st.sampled_from([1, 2]))
        return (key + (order,), lambda u, t: ft.losses.multi_margin(u, t, p=order, margin=margin or 1.0, reduction=red),
                lambda u, t: F.multi_margin_loss(u, t, p=order, margin=margin or 1.0, reduction=red), (a, labels), (0,))
    labels = np.array(draw(st.lists(st.integers(-1, classes - 1), min_size=int(np.prod(vectors)),
                                    max_size=int(np.prod(vectors)))), np.int64).reshape(vectors)
    return (key, lambda u, t: ft.losses.multilabel_margin(u, t, reduction=red),
            lambda u, t: F.multilabel_margin_loss(u, t, reduction=red), (a, labels), (0,))


_LOSS_PROGRAMS: dict = {}


def _loss_program(key, ours, grads):
    """The jitted value and gradient of ``ours`` (every array an argument, the differentiated
    ones first), one per key: the 100 examples hold ~32 distinct programs, traced once each."""
    if (key, grads) not in _LOSS_PROGRAMS:
        def loss(diff, arrays):
            value = ours(*[diff[grads.index(i)] if i in grads else a for i, a in enumerate(arrays)])
            return jnp.sum(value), value

        _LOSS_PROGRAMS[key, grads] = jax.jit(jax.value_and_grad(loss, has_aux=True))
    return _LOSS_PROGRAMS[key, grads]


@settings(max_examples=examples(100), deadline=None)
@given(_margin_case())
def test_margin_and_distance_losses_and_their_gradients_are_torchs_at_ties_and_margins(case):
    """Inputs on a grid of halves: tied scores, zero errors and distances exactly at the
    margin come up often, where a kink's derivative is a choice; torch's is taken."""
    key, ours, theirs, arrays, grads = case
    expected, expected_grads = _torch_grads(theirs, arrays, grads)
    with jax.enable_x64(True):
        # the value and the gradient as one program (op by op: its forward, its transpose and
        # their glue apart, each operation compiled on its own), one per key and shapes
        (_, value), got_grads = _loss_program(key, ours, grads)(tuple(arrays[i] for i in grads), arrays)
    _close(value, expected)
    for got, want in zip(got_grads, expected_grads, strict=True):
        _close(got, want)


@functools.partial(jax.jit, static_argnames=("p", "eps", "keep"))
def _distances(a, b, *, p, eps, keep):
    """The values and the gradient as one program (op by op: each operation compiled on its
    own), one function: examples of one p, eps, keep and shapes share it."""
    got = jax.grad(lambda a, b: jnp.sum(ft.nn.pairwise_distance(a, b, p=p, eps=eps)), argnums=(0, 1))(a, b)
    return ft.nn.pairwise_distance(a, b, p=p, eps=eps, keepdims=keep), got, ft.nn.cosine_similarity(a, b)


@settings(max_examples=examples(25), deadline=None)
@given(st.data())
def test_pairwise_distance_and_cosine_similarity_are_torchs(data):
    """Broadcast shapes, p from 0 (torch counts the nonzero components) to inf, eps 0 or
    torch's; values and gradients (p > 0; zero components and ties of the max included)."""
    s1, s2 = data.draw(st.sampled_from([((3,), (3,)), ((2, 3), (2, 3)), ((2, 3), (1, 3)), ((4, 1, 2), (3, 2)),
                                        ((1, 1), (2, 1))]))
    x1, x2 = _grid(data.draw, s1), _grid(data.draw, s2)
    p = data.draw(st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.0, float("inf")]))
    eps, keep = data.draw(st.sampled_from([0.0, 1e-6])), data.draw(st.booleans())
    grads = (0, 1) if p > 0 else ()  # (p = 0: torch's has none)
    expected, expected_grads = _torch_grads(lambda a, b: F.pairwise_distance(a, b, p=p, eps=eps, keepdim=keep),
                                            (x1, x2), grads)
    with jax.enable_x64(True):
        value, got, cosine = _distances(x1, x2, p=p, eps=eps, keep=keep)
        _close(value, expected)
        for i in grads:
            _close(got[i], expected_grads[i])
        _close(cosine, F.cosine_similarity(torch.tensor(x1), torch.tensor(x2), dim=-1))


E, HEADS, FF = 4, 2, 6


@functools.cache
def _encoder_layers(norm_first, batch_first, activation):
    torch.manual_seed(0)
    module = torch.nn.TransformerEncoderLayer(E, HEADS, FF, activation=F.silu if activation == "callable" else activation,
                                              batch_first=batch_first, norm_first=norm_first, dtype=torch.float64)
    module.train(False)
    with jax.enable_x64(True):
        # a template (jax.eval_shape: shapes, no values; every leaf filled from torch's state
        # dict) instead of initialised op by op (measured: the test's compiles 42 -> 23)
        ours = jax.eval_shape(lambda: ft.nn.TransformerEncoderLayer(
            E, HEADS, FF, activation=jax.nn.silu if activation == "callable" else activation, batch_first=batch_first,
            norm_first=norm_first, key=jax.random.key(0), dtype=jnp.float64))
        ours = ft.nn.load_torch_state_dict(ours, module.state_dict())
    assert all(isinstance(leaf, jax.Array) for leaf in jax.tree.leaves(ours))  # filled whole
    return module, ours


@st.composite
def _masks(draw, n, s, batched):
    """torch's masks for self-attention over ``s`` keys; key 0 is never masked by a boolean
    mask (a query with every key masked: torch's NaN, ft's even attention, by design)."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    masks = {}
    kind = draw(st.sampled_from(["none", "bool", "bool3", "float", "float3", "causal"]))
    shape = (n * HEADS, s, s) if kind.endswith("3") else (s, s)
    if kind.startswith("bool"):
        m = rng.random(shape) < 0.4
        m[..., 0] = False
        masks["src_mask"] = m if batched or kind == "bool" else m[:HEADS]
    elif kind.startswith("float"):
        m = np.where(rng.random(shape) < 0.3, -np.inf, 0.0) + rng.standard_normal(shape)
        m[..., 0] = 0.0
        masks["src_mask"] = m if batched or kind == "float" else m[:HEADS]
    elif kind == "causal":
        masks.update(src_mask=np.triu(np.ones((s, s), bool), 1), is_causal=True)
    padding = draw(st.sampled_from(["none", "bool", "float"]))
    if padding != "none":
        pad = rng.random((n, s)) < 0.4
        pad[:, 0] = False
        pad = pad if padding == "bool" else np.where(pad, -np.inf, 0.0) + rng.standard_normal((n, s))
        masks["src_key_padding_mask"] = pad if batched else pad[0]
    return masks


@functools.partial(jax.jit, static_argnames="is_causal")
def _encoded(m, x, arrays, **flags):
    return m(x, **arrays, **flags)


@settings(max_examples=examples(30), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_encoder_layer_with_every_kind_of_mask_is_torchs(data):
    """torch's weights loaded; norm_first x batch_first x activation (a function too); a
    batch of 1 to 2 or one unbatched sequence of 1 to 3 tokens; attn masks [L, S] or
    [N * nhead, L, S], bool or float, causal with is_causal; key padding bool or float."""
    norm_first, batch_first = data.draw(st.booleans()), data.draw(st.booleans())
    activation = data.draw(st.sampled_from(["relu", "gelu", "callable"]))
    n, s, batched = data.draw(st.sampled_from([1, 2])), data.draw(st.sampled_from([1, 3])), data.draw(st.booleans())
    n = n if batched else 1
    module, ours = _encoder_layers(norm_first, batch_first, activation)
    x = np.random.default_rng(data.draw(st.integers(0, 2**16))).standard_normal((n, s, E) if batch_first else (s, n, E))
    x = x if batched else x[:, 0] if not batch_first else x[0]
    masks = data.draw(_masks(n, s, batched))
    with warnings.catch_warnings():  # torch's notes on mask dtypes it converts
        warnings.simplefilter("ignore")
        expected = module(torch.tensor(x), **{k: torch.tensor(v) if isinstance(v, np.ndarray) else v
                                               for k, v in masks.items()}).detach().numpy()
    arrays = {k: v for k, v in masks.items() if isinstance(v, np.ndarray)}
    with jax.enable_x64(True):  # one program a layer, shapes and is_causal (op by op: a compile per operation)
        got = _encoded(ours, x, arrays, **{k: v for k, v in masks.items() if k not in arrays})
        _close(got, expected)


def _channels_last(x, batched):
    return np.moveaxis(x, 1 if batched else 0, -1)


@st.composite
def _image_layer(draw):
    """(ours, its channels-last input, torch's output in our layout)."""
    batched = draw(st.booleans())
    kind = draw(st.sampled_from(["reflect", "replicate", "circular", "zero", "lp", "unfold", "fold"]))
    rank = 2 if kind in ("unfold", "fold") else draw(st.sampled_from([1, 2]))
    sizes = [draw(st.integers(1, 5)) for _ in range(rank)]
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    ours_layout = functools.partial(_channels_last, batched=batched)

    def image(spatial):
        return rng.standard_normal(((2,) if batched else ()) + (2, *spatial))

    if kind in ("reflect", "replicate", "circular", "zero"):
        cap = {"reflect": lambda n: n - 1, "circular": lambda n: n, "replicate": lambda n: 3, "zero": lambda n: 3}[kind]
        low = (lambda n: -n - 1) if kind == "zero" else (lambda n: 0)  # zero: crops up to one past the axis
        pads = tuple((draw(st.integers(low(n), cap(n))), draw(st.integers(low(n), cap(n)))) for n in sizes)
        name = {"reflect": "ReflectionPad", "replicate": "ReplicationPad", "circular": "CircularPad", "zero": "ZeroPad"}
        ours = getattr(ft.nn, f"{name[kind]}{rank}D")(pads if rank > 1 else pads[0])
        theirs = getattr(torch.nn, f"{name[kind]}{rank}d")(tuple(v for pair in reversed(pads) for v in pair))
        x = image(sizes)
        try:
            return ours, ours_layout(x), ours_layout(theirs(torch.tensor(x)).numpy())
        except RuntimeError as e:  # an over-crop (torch's narrow): ours must refuse it too
            assert "narrow(): length must be non-negative" in str(e)
            return ours, ours_layout(x), None
    if kind == "lp":
        p = draw(st.sampled_from([1.0, 2.0, 3.0, float("inf")]))
        k, stride, ceil = draw(st.integers(1, 3)), draw(st.integers(1, 3)), draw(st.booleans())
        x = image([max(n, k) for n in sizes])  # (a window wider than the input: both refuse)
        theirs = getattr(torch.nn, f"LPPool{rank}d")(p, k, stride, ceil)
        return getattr(ft.nn, f"LPPool{rank}D")(p, k, stride, ceil), ours_layout(x), ours_layout(
            theirs(torch.tensor(x)).numpy())
    k, d, pad, stride = ((draw(st.integers(lo, hi)), draw(st.integers(lo, hi))) for lo, hi in
                         ((1, 3), (1, 2), (0, 2), (1, 3)))
    sizes = [max(n, di * (ki - 1) + 1 - 2 * p) for n, ki, di, p in zip(sizes, k, d, pad, strict=True)]
    x = image(sizes)
    blocks = torch.nn.Unfold(k, d, pad, stride)(torch.tensor(x))  # [..., C kh kw, L]
    if kind == "unfold":
        return ft.nn.Unfold(k, d, pad, stride), ours_layout(x), np.swapaxes(blocks.numpy(), -1, -2)
    folded = torch.nn.Fold(tuple(sizes), k, d, pad, stride)(blocks)
    return ft.nn.Fold(tuple(sizes), k, d, pad, stride), np.swapaxes(blocks.numpy(), -1, -2), ours_layout(
        folded.numpy())


_called = jax.jit(lambda m, x: m(x))  # one function: examples of one layer (its settings) and shape share a program


@settings(max_examples=examples(80), deadline=None)
@given(_image_layer())
def test_pads_pools_and_folds_are_torchs_at_their_edges(case):
    """Pads up to the largest each mode takes (reflection: the axis less one; circular: the
    axis; negative zero pads crop, past the axis refused as torch refuses), LP pools with partial ceil_mode windows, Unfold/Fold
    with dilations, paddings and strides at size-1 and odd axes, batch-less inputs too."""
    ours, x, expected = case
    with jax.enable_x64(True):
        if expected is None:  # torch refused (a crop past the axis)
            with pytest.raises(ft.nn.LayerInputError, match="a crop cannot remove more than the axis holds"):
                ours(x)
            return
        got = _called(ours, x)  # one program a layer and shape (op by op: a compile per operation)
    _close(got, expected)


@settings(max_examples=examples(12), deadline=None)
@given(st.data())
def test_embedding_bag_offsets_are_torchs(data):
    """1-D indices with offsets, include_last_offset either way (its last entry anywhere from
    the previous one to len(indices): torch reads the last bag to the end), empty bags, every
    mode, per_sample_weights with "sum": the output and the gradients of the table and the
    weights. Rows drawn apart (no tie for "max", where torch's and ours would pick apart)."""
    mode = data.draw(st.sampled_from(["sum", "mean", "max"]))
    last = data.draw(st.booleans())
    n = data.draw(st.integers(0 if not last else 1, 7))
    indices = np.array(data.draw(st.lists(st.integers(0, 5), min_size=n, max_size=n)), np.int64)
    starts = sorted(data.draw(st.lists(st.integers(0, n), min_size=1, max_size=4)))
    offsets = np.array([0, *starts[1:]] + ([data.draw(st.integers(starts[-1], n))] if last else []), np.int64)
    weights = _grid(data.draw, (n,)) if mode == "sum" and data.draw(st.booleans()) else None
    table = np.random.default_rng(n).standard_normal((6, 3))
    module = torch.nn.EmbeddingBag(6, 3, mode=mode, include_last_offset=last, dtype=torch.float64)
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(table))
    tweights = None if weights is None else torch.tensor(weights, requires_grad=True)
    out = module(torch.from_numpy(indices), torch.from_numpy(offsets), tweights)
    out.sum().backward()
    with jax.enable_x64(True):
        layer = ft.nn.EmbeddingBag(6, 3, mode, key=jax.random.key(0), dtype=jnp.float64, include_last_offset=last)
        layer = layer.replace(embeddings=jnp.asarray(table))
        def run(m, w):  # one program an example (op by op: a compile per operation)
            out = m(indices, offsets, w)
            return out.sum(), out

        (_, ours), (grad, grad_weights) = jax.jit(jax.value_and_grad(run, argnums=(0, 1), has_aux=True))(layer, weights)
    _close(ours, out.detach().numpy())
    _close(grad.embeddings, module.weight.grad.numpy())
    if tweights is not None:
        _close(grad_weights, tweights.grad.numpy())
