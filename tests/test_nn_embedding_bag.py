"""ft.nn.EmbeddingBag against torch's nn.EmbeddingBag in float64: sum, mean and max over 2-D
bags and 1-D indices with offsets (include_last_offset, an empty bag), per_sample_weights,
padding_idx; outputs and the weight's gradient; the refusals."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")

VOCAB, DIM = 7, 3
INDICES = np.array([1, 2, 4, 5, 4, 3, 2, 6, 0, 1])
OFFSETS = np.array([0, 2, 2, 5])  # bag 1 empty


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("layout", ["2d", "offsets", "last_offset"])
@pytest.mark.parametrize("padding", [None, 2])
def test_embedding_bag_matches_torchs_in_float64(mode, layout, padding):
    torch.manual_seed(0)
    last = layout == "last_offset"
    module = torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode, include_last_offset=last, padding_idx=padding,
                                   dtype=torch.float64)
    if layout == "2d":
        indices, offsets = INDICES.reshape(2, 5), None
    else:
        indices, offsets = INDICES, (np.append(OFFSETS, INDICES.size) if last else OFFSETS)
    weights = np.linspace(-1.0, 2.0, INDICES.size).reshape(indices.shape) if mode == "sum" else None
    tensors = [torch.from_numpy(a) if a is not None else None for a in (indices, offsets, weights)]
    out = module(*tensors)
    out.backward(torch.from_numpy(np.cos(out.detach().numpy())))
    with jax.enable_x64(True):
        layer = ft.nn.EmbeddingBag(VOCAB, DIM, mode, key=jax.random.key(0), dtype=jnp.float64, padding_index=padding,
                                   include_last_offset=last)
        np.testing.assert_array_equal(layer.embeddings[padding or 0] == 0, padding is not None)
        layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
        ours, pull = jax.vjp(lambda m: m(indices, offsets, weights), layer)
        (grad,) = pull(jnp.cos(ours))
    np.testing.assert_allclose(ours, out.detach().numpy(), rtol=0, atol=1e-15)
    np.testing.assert_allclose(grad.embeddings, module.weight.grad.numpy(), rtol=0, atol=1e-14)
    assert set(ft.nn.torch_state_dict(layer, numpy=True)) == {"weight"}


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("last", [5, 8])
def test_include_last_offset_below_the_end_is_torchs(mode, last):
    """include_last_offset=True with a last offset below len(indices): torch 2.13 ignores that
    entry, its last bag runs to the end (indices 5.. here, with [0, 2, 2, 5, 8] too); output and
    the gradients of the weight and of per_sample_weights as torch's, in float64."""
    torch.manual_seed(0)
    module = torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode, include_last_offset=True, dtype=torch.float64)
    offsets = np.append(OFFSETS, last)
    weights = np.linspace(-1.0, 2.0, INDICES.size) if mode == "sum" else None
    tweights = None if weights is None else torch.tensor(weights, requires_grad=True)
    out = module(torch.from_numpy(INDICES), torch.from_numpy(offsets), tweights)
    out.backward(torch.from_numpy(np.cos(out.detach().numpy())))
    with jax.enable_x64(True):
        layer = ft.nn.EmbeddingBag(VOCAB, DIM, mode, key=jax.random.key(0), dtype=jnp.float64,
                                   include_last_offset=True)
        layer = ft.nn.load_torch_state_dict(layer, module.state_dict())
        ours, pull = jax.vjp(lambda m, w: m(INDICES, offsets, w), layer, weights)
        grad, grad_weights = pull(jnp.cos(ours))
    np.testing.assert_allclose(ours, out.detach().numpy(), rtol=0, atol=1e-15)
    np.testing.assert_allclose(grad.embeddings, module.weight.grad.numpy(), rtol=0, atol=1e-14)
    if tweights is not None:
        np.testing.assert_allclose(grad_weights, tweights.grad.numpy(), rtol=0, atol=1e-14)


def test_embedding_bag_refusals():
    bag = ft.nn.EmbeddingBag(VOCAB, DIM, key=jax.random.key(0))
    with pytest.raises(ValueError, match=r"mode must be \"sum\", \"mean\" or \"max\", got 'avg'"):
        ft.nn.EmbeddingBag(VOCAB, DIM, "avg", key=jax.random.key(0))
    with pytest.raises(ValueError, match="1-D indices need offsets="):
        bag(jnp.array([1, 2]))
    with pytest.raises(ft.nn.LayerInputError, match=r"indices \[B, N\] or \[n\] with offsets \(int\), got i32\[1,1,2\]"):
        bag(jnp.array([[[1, 2]]]))
    with pytest.raises(ValueError, match="offsets= is for 1-D indices"):
        bag(jnp.array([[1, 2]]), jnp.array([0]))
    with pytest.raises(ValueError, match=r"starting at 0, nondecreasing, at most len\(indices\) = 3 .*, got \[1, 2\]"):
        bag(jnp.array([1, 2, 3]), jnp.array([1, 2]))
    closed = ft.nn.EmbeddingBag(VOCAB, DIM, key=jax.random.key(0), include_last_offset=True)
    with pytest.raises(ValueError, match=r"at least two, B \+ 1 for B bags\), got \[0\]"):
        closed(jnp.array([1, 2, 3]), jnp.array([0]))  # torch 2.13: a segmentation fault
    with pytest.raises(ValueError, match=r"at most len\(indices\) = 3 .*, got \[0, 4\]"):
        closed(jnp.array([1, 2, 3]), jnp.array([0, 4]))  # torch: "offsets[-1] can not be greater than"
    with pytest.raises(ValueError, match=r"mode='mean' takes none"):
        bag(jnp.array([[1, 2]]), per_sample_weights=jnp.ones((1, 2)))
    summed = ft.nn.EmbeddingBag(VOCAB, DIM, "sum", key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=r"per_sample_weights \[1, 2\] \(float\), got f32\[2\]"):
        summed(jnp.array([[1, 2]]), per_sample_weights=jnp.ones(2))
    with pytest.raises(ValueError, match="padding_index=9 is outside the vocabulary of 7 rows"):
        ft.nn.EmbeddingBag(VOCAB, DIM, key=jax.random.key(0), padding_index=9)


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
@pytest.mark.parametrize("norm_type", [2.0, 1.0])
def test_renormalized_is_torchs_max_norm(mode, norm_type):
    """torch's EmbeddingBag(max_norm=m) rescales the rows its indices look up inside its weight
    at each forward; bag.renormalized(indices, m) is that weight, and its forward and gradient
    (passed through the rescaling, as torch's no_grad) torch's, in float64."""
    torch.manual_seed(0)
    module = torch.nn.EmbeddingBag(VOCAB, DIM, mode=mode, max_norm=1.5, norm_type=norm_type, padding_idx=2,
                                   dtype=torch.float64)
    with torch.no_grad():  # row 2-norms 0.77 to 3.1 (1-norms to 4.9): some over 1.5, some under
        module.weight.mul_(torch.linspace(0.3, 2.0, VOCAB, dtype=torch.float64)[:, None])
    before = {k: v.clone() for k, v in module.state_dict().items()}
    indices, offsets = INDICES[:6], np.array([0, 2, 2])  # rows 1 2 4 5 3 looked up; 0 and 6 not
    out = module(torch.from_numpy(indices), torch.from_numpy(offsets))
    out.backward(torch.from_numpy(np.cos(out.detach().numpy())))
    after = module.weight.detach().numpy()
    changed = np.any(after != before["weight"].numpy(), axis=1)
    assert changed.any() and not changed[[0, 6]].any() and not changed[[1, 2, 3, 4, 5]].all()
    with jax.enable_x64(True):
        layer = ft.nn.EmbeddingBag(VOCAB, DIM, mode, key=jax.random.key(0), dtype=jnp.float64, padding_index=2)
        layer = ft.nn.load_torch_state_dict(layer, before)
        # measured: bit for bit (table, output, gradient); a rounding's room where XLA sums in another order
        np.testing.assert_allclose(layer.renormalized(indices, 1.5, norm_type).embeddings, after, rtol=0, atol=1e-15)
        ours, pull = jax.vjp(lambda m: m.renormalized(indices, 1.5, norm_type)(indices, offsets), layer)
        (grad,) = pull(jnp.cos(ours))
    np.testing.assert_allclose(ours, out.detach().numpy(), rtol=0, atol=2e-15)
    np.testing.assert_allclose(grad.embeddings, module.weight.grad.numpy(), rtol=0, atol=2e-15)


def test_max_norm_is_refused_with_the_functional_step():
    with pytest.raises(ValueError, match=r"(?s)max_norm=1.0 is torch's in-place side effect.*right:  bag = "
                       r"ft.nn.EmbeddingBag\(n, d, key=key\)\n\s+bag = bag.renormalized\(indices, 1.0\)"):
        ft.nn.EmbeddingBag(VOCAB, DIM, key=jax.random.key(0), max_norm=1.0)  # pyright: ignore[reportArgumentType]


@jax.jit
def _bagged_and_vjp(bag, indices, offsets, weights, cotangent):  # one program (op by op: 0.7 s)
    y, vjp = jax.vjp(lambda b: b(indices, offsets, weights), bag)
    return y, vjp(cotangent)[0]


@pytest.mark.parametrize(("mode", "padding", "weighted"), [("sum", None, True), ("mean", 2, False)])
def test_scale_grad_by_freq_divides_each_rows_gradient_by_its_count(mode, padding, weighted):
    """torch's documented gradient (nn.Embedding's with scale_grad_by_freq, reduced per bag:
    the reference here, float64, measured 5.6e-17). torch 2.13's CPU EmbeddingBag divides row 3
    (once, after the repeated 1 and 2) by 3 (pytorch#190063): its gradient is not the reference."""
    from functree.nn._embedding_bag import MAX_FREQUENCY

    indices, offsets = np.array([1, 2, 1, 0, 3, 1, 2, 2, 4, 5, 5]), np.array([0, 3, 3, 6])
    bags = np.searchsorted(offsets, np.arange(len(indices)), side="right") - 1
    rng = np.random.default_rng(0)
    weights = rng.normal(size=indices.shape) if weighted else np.ones(indices.shape)
    cotangent = rng.normal(size=(4, DIM))
    table = torch.nn.Embedding(VOCAB, DIM, padding_idx=padding, scale_grad_by_freq=True, dtype=torch.float64)
    kept = torch.tensor(indices != padding, dtype=torch.float64)[:, None]
    rows = table(torch.tensor(indices)) * torch.tensor(weights)[:, None] * kept
    out = torch.zeros(4, DIM, dtype=torch.float64).index_add(0, torch.tensor(bags), rows)
    if mode == "mean":
        out = out / torch.zeros(4, 1, dtype=torch.float64).index_add(0, torch.tensor(bags), kept).clamp(min=1)
    out.backward(torch.tensor(cotangent))
    with jax.enable_x64(True):
        bag = ft.nn.EmbeddingBag(VOCAB, DIM, mode, padding_index=padding, scale_grad_by_freq=True,
                                 key=jax.random.key(0), dtype=jnp.float64).replace(embeddings=jnp.asarray(
                                     table.weight.detach().numpy()))
        y, grad = _bagged_and_vjp(bag, jnp.asarray(indices), jnp.asarray(offsets),
                                  jnp.asarray(weights) if weighted else None, jnp.asarray(cotangent))
        np.testing.assert_allclose(y, out.detach().numpy(), rtol=0, atol=1e-14)
        np.testing.assert_allclose(grad.embeddings, table.weight.grad.numpy(), rtol=0, atol=1e-14)
    with pytest.raises(ValueError) as e:  # torch's forward refuses it: one entry per feature gets the gradient
        ft.nn.EmbeddingBag(VOCAB, DIM, "max", scale_grad_by_freq=True, key=jax.random.key(0))
    assert str(e.value) == MAX_FREQUENCY


@pytest.mark.parametrize("mode", ["sum", "mean", "max"])
def test_an_index_outside_the_table_is_refused_or_reads_nan_never_another_row(mode):
    """torch raises for an index outside the table; JAX's gather clamped it onto the last row.
    Concrete indices: refused, naming it; traced: the bag holding it is NaN, the others exact."""
    bag = ft.nn.EmbeddingBag(5, 3, mode, key=jax.random.key(0))
    with pytest.raises(ft.nn.LayerInputError, match=r"(?s)EmbeddingBag expects inputs indices in \[0, 5\) \(int\), "
                       r"got 6 at indices\[2\].*right:  ft\.nn\.EmbeddingBag\(7, 3, key=key\)\(indices\)"):
        bag(jnp.array([1, 2, 6, 0]), jnp.array([0, 2]))
    with pytest.raises(ft.nn.LayerInputError, match=r"got -1 at indices\[0, 1\]"):
        bag.renormalized(jnp.array([[1, -1]]), 1.0)
    out = jax.jit(lambda b, i, o: b(i, o))(bag, jnp.array([1, 2, 6, 0]), jnp.array([0, 2]))
    assert np.isnan(np.asarray(out[1])).all()
    np.testing.assert_array_equal(out[0], bag(jnp.array([1, 2, 6, 0])[:2], jnp.array([0]))[0])


def test_narrow_offsets_bag_every_index():
    """uint8 offsets: the positions 0..n-1 were jnp.arange(n, uint8), which wraps at 256, so
    indices 256 and up were summed into bag 0 (5.6 off), silently."""
    bag = ft.nn.EmbeddingBag(50, 3, mode="sum", key=jax.random.key(0))
    indices = jnp.asarray(np.random.default_rng(1).integers(0, 50, 300), jnp.int32)
    w, idx = np.asarray(bag.embeddings, np.float64), np.asarray(indices)
    expected = np.stack([w[idx[:100]].sum(0), w[idx[100:]].sum(0)])
    for dtype in (jnp.int32, jnp.uint8, jnp.int16):
        out = np.asarray(bag(indices, offsets=jnp.array([0, 100], dtype)))
        np.testing.assert_allclose(out, expected, rtol=0, atol=2e-5, err_msg=str(dtype))  # 200 float32 terms of ~1


@pytest.mark.parametrize("include_last_offset", [False, True])
def test_traced_offsets_that_are_not_bags_read_nan(include_last_offset):
    """torch raises for offsets not starting at 0 or past len(indices); eagerly they were refused,
    but under jax.jit the entries before offsets[0] were dropped from every bag ([1, 2] summed
    indices[1:2] and indices[2:]: finite, wrong) and an offset past the end left an empty bag.
    Traced offsets that are not bags now make the output NaN; good ones are unchanged."""
    bag = ft.nn.EmbeddingBag(10, 3, "sum", key=jax.random.key(0), include_last_offset=include_last_offset)
    indices, end = jnp.array([1, 2, 3, 4]), [4] if include_last_offset else []
    run = jax.jit(lambda b, i, o: b(i, o))
    good = np.asarray(run(bag, indices, jnp.array([0, 2, *end])))
    np.testing.assert_allclose(good, np.asarray(bag(indices, jnp.array([0, 2, *end]))), rtol=0, atol=1e-6)
    for bad in ([1, 2, *end], [0, 9, *end], [0, 3, 1, *end]):
        with pytest.raises(ValueError, match=r"offsets must be 1-D integers starting at 0"):
            bag(indices, jnp.array(bad))
        assert np.isnan(np.asarray(run(bag, indices, jnp.array(bad)))).all(), bad


def test_an_ensembles_embedding_bag_called_outside_vmap_is_refused(key):
    bags = jax.vmap(lambda k: ft.nn.EmbeddingBag(VOCAB, DIM, "sum", key=k))(jax.random.split(key, 2))
    match = (r"EmbeddingBag holds embeddings f32\[2,7,3\], but one EmbeddingBag's embeddings has 2 "
             r"axes(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)")
    for call in (lambda m: m(INDICES.reshape(2, 5)), lambda m: m(INDICES, OFFSETS),
                 lambda m: m.renormalized(INDICES, max_norm=1.0)):
        with pytest.raises(ft.nn.LayerInputError, match=match):   # was "too many values to unpack"
            call(bags)
    right = jax.vmap(lambda m: m(INDICES, OFFSETS))(bags)     # the fix
    np.testing.assert_allclose(right[1, 3], bags.embeddings[1, INDICES[5:]].sum(0), rtol=1e-5)

