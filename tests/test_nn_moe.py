"""``ft.nn.SparseMoE`` and ``ft.nn.load_balancing_loss`` against transformers' Mixtral block
(``MixtralSparseMoeBlock``, its weights ours: the router ``gate.weight`` transposed, the
experts' ``[E, out, in]`` transposed) and ``load_balancing_loss_func``, in float64 with HF's
router softmax widened to float64 (HF's ``.float()``): outputs and every gradient of torch's
autograd at float64 rounding (measured 4.9e-16 of the largest, tolerance 1e-14); finite
differences (``jax.test_util.check_grads``, first order: JAX has no second derivative of
``ragged_dot`` with respect to its weights) for both implementations; the edge cases: top_k
of every expert, an expert no token chose (a zero gradient, no NaN), an exact tie (the lower
index wins; torch.topk on the CPU took the higher ones), top_k refused past num_experts.
"""

import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import functree as ft
from functree.nn import _moe

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from transformers.models.mixtral import modeling_mixtral  # noqa: E402

D, HIDDEN, E = 8, 6, 4
TOLERANCE = 1e-14  # times the largest value (gradient): measured 4.9e-16 (top_k 1, 2, 4; both implementations)


def layer(top_k=2, seed=0, **kwargs):
    """The layer, its weights of order 1, built in one compiled program (eagerly, each
    initializer and draw compiled apart: the same values, bit for bit)."""
    return jax.jit(lambda: _layer(top_k, seed, **kwargs))()


def _layer(top_k, seed, **kwargs):
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=top_k, key=jax.random.key(seed), dtype=jnp.float64,
                          **kwargs)
    flat = ft.to_flat_dict(moe)  # weights of order 1 (the init's std 0.02 makes every expert alike)
    moved = {n: jax.random.normal(jax.random.key(i + 10), v.shape, v.dtype) for i, (n, v) in enumerate(flat.items())}
    return ft.from_flat_dict(moe, moved)


def hf_block(moe, top_k):
    """HF's block with ``moe``'s weights, in float64, its router softmax in float64."""
    config = transformers.MixtralConfig(hidden_size=D, intermediate_size=HIDDEN, num_local_experts=E,
                                        num_experts_per_tok=top_k)
    config._experts_implementation = "eager"  # (a standalone block: HF's loop over the experts)
    block: Any = modeling_mixtral.MixtralSparseMoeBlock(config).to(torch.float64).eval()
    with torch.no_grad():
        block.gate.weight.copy_(torch.from_numpy(np.asarray(moe.gate.weight).T.copy()))
        block.experts.gate_up_proj.copy_(torch.from_numpy(np.asarray(moe.experts.gate_up_proj).transpose(0, 2, 1).copy()))
        block.experts.down_proj.copy_(torch.from_numpy(np.asarray(moe.experts.down_proj).transpose(0, 2, 1).copy()))
    router: Any = block.gate

    def route(h):  # HF's router with its softmax in the weights' dtype (it casts to float32)
        h = h.reshape(-1, router.hidden_dim)
        logits = torch.nn.functional.linear(h, router.weight)
        top, index = torch.topk(torch.softmax(logits, dim=-1), router.top_k, dim=-1)
        return logits, top / top.sum(dim=-1, keepdim=True), index

    router.forward = route
    return block


@pytest.mark.parametrize("implementation", ["sorted", "dense", "gathered"])
@pytest.mark.parametrize("top_k", [1, 2, E])
def test_outputs_and_gradients_are_torch_autograds_of_hfs_block(top_k, implementation):
    """float64, 2 x 5 tokens: the output and the gradients of sum(y * c) for the input, the
    router and both expert tensors, against torch's autograd of HF's block (top_k = E: every
    expert, as a dense MLP mixture)."""
    with jax.enable_x64(True):
        moe = layer(top_k, implementation=implementation)
        x = np.random.default_rng(0).normal(size=(2, 5, D))
        c = np.random.default_rng(1).normal(size=(2, 5, D))
        block = hf_block(moe, top_k)
        xt: Any = torch.from_numpy(x).requires_grad_(True)
        yt = block(xt)
        (yt * torch.from_numpy(c)).sum().backward()

        def f(m, x):
            return jnp.sum(m(x) * c)

        # one program (op by op, each of the layer's ~120 operations compiled apart)
        y, (gm, gx) = jax.jit(lambda m, x: (m(x), jax.grad(f, argnums=(0, 1))(m, x)))(moe, jnp.asarray(x))
    expected = {"x": xt.grad.numpy(), "gate": block.gate.weight.grad.numpy().T,
                "gate_up": block.experts.gate_up_proj.grad.numpy().transpose(0, 2, 1),
                "down": block.experts.down_proj.grad.numpy().transpose(0, 2, 1)}
    ours = {"x": gx, "gate": gm.gate.weight, "gate_up": gm.experts.gate_up_proj, "down": gm.experts.down_proj}
    ref = yt.detach().numpy()
    np.testing.assert_allclose(np.asarray(y), ref, rtol=0, atol=TOLERANCE * np.abs(ref).max())
    scale = max(float(np.abs(want).max()) for want in expected.values())  # top_k=1: the router's is 0 (w = 1)
    for name, want in expected.items():
        np.testing.assert_allclose(np.asarray(ours[name]), want, rtol=0, atol=TOLERANCE * scale, err_msg=name)


@pytest.mark.parametrize("implementation", ["sorted", "dense", "gathered"])
def test_gradients_are_finite_differences(implementation):
    """``check_grads`` (forward and reverse, first order) of the layer in its input and its
    weights; the sorted form's second derivative is JAX's NotImplementedError (documented)."""
    with jax.enable_x64(True):
        moe = layer(2, 1, implementation=implementation)
        x = jnp.asarray(np.random.default_rng(2).normal(size=(7, D)))
        # jitted: check_grads calls it (and its jvp, vjp) many times, each op by op otherwise
        check_grads(jax.jit(lambda m, x: moe.replace(gate=m.gate, experts=m.experts)(x)), (moe, x), order=1,
                    modes=("fwd", "rev"), atol=1e-6, rtol=1e-6)


def test_an_expert_no_token_chose_has_zero_gradients_and_no_nan():
    """Router weights that send every token to experts 0 and 1: experts 2 and 3 get no rows
    (empty groups of the grouped matmul); their gradients are exactly 0, none is NaN, and
    the two implementations agree."""
    with jax.enable_x64(True):
        moe = layer(2)
        weight = np.zeros((D, E))
        weight[:, :2] = 0.0
        weight[:, 2:] = -50.0  # experts 2, 3: probabilities ~e^-50 per unit input
        x = jnp.ones((6, D))
        moe = moe.replace(gate=moe.gate.replace(weight=jnp.asarray(weight)))
        grads = [jax.tree.map(np.asarray, jax.jit(jax.grad(lambda m: jnp.sum(m(x) ** 2)))(moe.replace(implementation=i)))
                 for i in ("sorted", "dense")]
    for g in grads:
        assert all(np.isfinite(leaf).all() for leaf in jax.tree.leaves(g))
        assert np.abs(g.experts.gate_up_proj[2:]).max() == 0.0 and np.abs(g.experts.down_proj[2:]).max() == 0.0
        assert np.abs(g.experts.gate_up_proj[:2]).max() > 0
    np.testing.assert_allclose(np.asarray(grads[0].experts.down_proj), np.asarray(grads[1].experts.down_proj),
                               rtol=0, atol=1e-12)


def test_a_tie_picks_the_lower_expert_where_torch_topk_picked_higher_ones():
    """A zero router (every probability 1/E): jax.lax.top_k's experts 0 and 1, weights 1/2
    each; torch.topk on the CPU picked experts 2 and 3 here (unspecified in torch), so the
    port's output on an exact tie is its own. Only equal float probabilities tie: a router
    row of zeros, or a zero input."""
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=2, key=jax.random.key(0))
    moe = moe.replace(gate=moe.gate.replace(weight=jnp.zeros((D, E))))
    _, weights, experts = moe.route(jnp.ones((3, D)))
    assert experts.tolist() == [[0, 1]] * 3 and weights.tolist() == [[0.5, 0.5]] * 3
    assert sorted(torch.topk(torch.full((E,), 1.0 / E), 2).indices.tolist()) != [0, 1]


def test_jitter_multiplies_the_input_in_training_only():
    """``jitter``: inference ignores it; training needs a key (JITTER_KEY) and computes the
    layer on ``x * u``, u uniform in [1 - jitter, 1 + jitter] drawn from the key (HF's
    ``router_jitter_noise``: the router and the experts both read the noisy input)."""
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=2, jitter=0.1, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (5, D))
    np.testing.assert_array_equal(moe(x, key=jax.random.key(2)), moe.replace(jitter=0.0)(x))
    train = ft.nn.training(moe)
    with pytest.raises(ValueError, match="needs a PRNG key") as error:
        train(x)
    assert str(error.value).startswith(_moe.JITTER_KEY.split("{")[0])
    y = train(x, key=jax.random.key(2))
    from functree._random import flat_key
    noise = jax.random.uniform(flat_key(jax.random.key(2)), x.shape, jnp.float32, 0.9, 1.1)
    np.testing.assert_allclose(y, moe(x * noise), rtol=0, atol=1e-6)
    assert np.abs(y - moe(x)).max() > 0.01 * np.abs(y).max()  # the noise matters


def test_auto_is_the_dense_form_on_the_cpu_and_sorted_uses_ragged_dot():
    """``implementation="auto"`` on the CPU computes every expert (no ``ragged_dot`` in its
    program: XLA's CPU lowering of it is dense and slower); "sorted" is two ``ragged_dot``."""
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=2, key=jax.random.key(0))
    x = jnp.ones((3, D))
    programs = {i: str(jax.make_jaxpr(lambda m: m(x))(moe.replace(implementation=i))) for i in ("auto", "sorted")}
    assert jax.default_backend() != "cpu" or "ragged_dot" not in programs["auto"]
    assert programs["sorted"].count("ragged_dot_general") == 2


@pytest.mark.parametrize("rows", [1, 2])
def test_auto_gathers_the_experts_of_fewer_rows_than_experts_over_top_k(rows):
    """A decoding step's rows (rows x top_k < E): "auto" gathers each row's experts' weights
    (``[rows, top_k, d, 2 * hidden]``: rows x top_k experts read, not all E) and gives the
    dense form's numbers, its gradient too; at rows x top_k >= E it is the dense form."""
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=1 if rows == 2 else 2, key=jax.random.key(0))
    x = jax.random.normal(jax.random.key(1), (rows, D))
    program = str(jax.make_jaxpr(lambda m: m(x))(moe))
    assert f"f32[{rows},{moe.top_k},{D},{2 * HIDDEN}]" in program and "ragged_dot" not in program
    dense = moe.replace(implementation="dense")
    # each form's output and gradient in one program (op by op, ~110 compiles)
    (y, g), (yd, gd) = (jax.jit(lambda m: (m(x), jax.grad(lambda m: jnp.sum(m(x) ** 2))(m)))(m) for m in (moe, dense))
    np.testing.assert_allclose(y, yd, rtol=0, atol=1e-6 * float(np.abs(yd).max()))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(gd)):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * float(np.abs(b).max()))
    many = jnp.ones((E, D))  # E rows x top_k >= E: every expert's weights are read anyway
    assert f",{moe.top_k},{D},{2 * HIDDEN}]" not in str(jax.make_jaxpr(lambda m: m(many))(moe))


@pytest.mark.parametrize(("kwargs", "match", "fix"), [
    ({"top_k": 5}, "top_k=5 of num_experts=4", "top_k=2"),
    ({"top_k": 0}, "top_k=0", "top_k=2"),
    ({"implementation": "ragged"}, "implementation='ragged'", 'implementation="sorted"'),
])
def test_a_bad_argument_is_refused_naming_it(kwargs, match, fix):
    with pytest.raises(ValueError, match=match) as error:
        ft.nn.SparseMoE(D, HIDDEN, num_experts=E, key=jax.random.key(0), **kwargs)
    assert fix in str(error.value) and "wrong:" in str(error.value)


def test_an_ensembles_moe_called_outside_vmap_is_refused():
    # 3 models (E experts each): SparseMoE said it "expects inputs [..., 3]", the models' count;
    # Experts.every and .grouped failed in einsum / dot_general, an adapted one's in matmul
    keys = jax.random.split(jax.random.key(0), 3)
    moes = jax.vmap(lambda k: ft.nn.SparseMoE(D, HIDDEN, num_experts=E, key=k))(keys)
    x = jax.random.normal(jax.random.key(1), (2, D))
    fix = r"(.|\n)*jax.vmap\(lambda m: m\(x\)\)\(models\)"
    with pytest.raises(ft.nn.LayerInputError, match=rf"Dense holds weight f32\[3,{D},{E}\], but one Dense's weight{fix}"):
        moes(x)
    experts = f"f32\\[3,{E},{D},{2 * HIDDEN}\\]"
    with pytest.raises(ft.nn.LayerInputError, match=rf"Experts holds gate_up_proj {experts}, but one Experts' "
                                                    rf"gate_up_proj has 3 axes{fix}"):
        moes.experts.every(x)
    with pytest.raises(ft.nn.LayerInputError, match=rf"Experts holds gate_up_proj {experts}"):
        moes.experts.grouped(x, jnp.array([2] + [0] * (E - 1)))
    adapted = jax.vmap(lambda m, k: ft.nn.LoraExperts(m.experts, rank=2, key=k))(moes, keys)
    with pytest.raises(ft.nn.LayerInputError, match=rf"LoraParameter holds weight {experts}"):
        adapted.every(x)
    right = jax.vmap(lambda m: m(x))(moes)     # the fix
    np.testing.assert_allclose(right[1], jax.tree.map(lambda a: a[1], moes)(x), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_and_its_gradient_are_hfs(masked):
    """Two layers' router logits over a [2, 5] batch, float64: the value of HF's
    ``load_balancing_loss_func`` (with the attention mask: padding excluded) and its gradient
    in the logits (the counts carry none). HF sums the probabilities in float32: measured
    1.5e-7 (value, relative) and 3.0e-7 of the largest gradient over 5 seeds; tolerance 1e-6."""
    rng = np.random.default_rng(3)
    logits = rng.normal(size=(2, 10, E))
    mask = np.ones((2, 5), np.int64)
    if masked:
        mask[1, :2] = 0
    lt: Any = torch.from_numpy(logits).requires_grad_(True)
    theirs: Any = modeling_mixtral.load_balancing_loss_func(tuple(lt), E, 2, torch.from_numpy(mask) if masked else None)
    theirs.backward()
    with jax.enable_x64(True):
        # one program (op by op, each operation compiled apart)
        value, grad = jax.jit(jax.value_and_grad(lambda g: ft.nn.load_balancing_loss(g, 2, mask if masked else None)))(
            jnp.asarray(logits))
    np.testing.assert_allclose(float(value), theirs.item(), rtol=1e-6)  # HF sums its counts in float32
    np.testing.assert_allclose(np.asarray(grad), lt.grad.numpy(), rtol=0, atol=1e-6 * np.abs(lt.grad.numpy()).max())


def test_load_balancing_loss_of_misshapen_logits_or_mask_is_refused_naming_the_fix():
    """One SparseMoE's ``[rows, experts]`` logits (its ``return_logits``), HF's tuple per layer and
    a top_k past the experts failed deep inside (an unpacking error, 'tuple' has no dtype, JAX's
    top_k); a mask of another batch or length than the logits' rows, inside an einsum."""
    logits = jnp.zeros((2, 10, E))
    for given, fix in [(logits[0], "logits[None]"), (tuple(logits), "jnp.stack(per_layer)")]:
        with pytest.raises(ValueError, match="router_logits are every layer's router logits stacked") as error:
            ft.nn.load_balancing_loss(given, top_k=2)
        assert fix in str(error.value) and "wrong:" in str(error.value)
    for top_k in (0, E + 1, 2.0):
        with pytest.raises(ValueError, match=rf"top_k={top_k}, where each token is routed to 1 to {E} of") as error:
            ft.nn.load_balancing_loss(logits, top_k=top_k)
        assert "top_k=model.sparse_moe().top_k" in str(error.value)
    for mask in [np.ones((2, 4)), np.ones((3, 5))]:
        with pytest.raises(ValueError, match=r"the mask f32\[\d,\d\] has \d+ entries, one per row") as error:
            ft.nn.load_balancing_loss(logits, 2, mask)
        assert "router_logits=routed)   # the mask the forward took" in str(error.value)
    assert float(ft.nn.load_balancing_loss(logits, 2, np.ones((2, 5)))) == 2.0  # the mask of the logits' rows


@pytest.mark.parametrize("implementation", ["sorted", "dense", "gathered", "auto"])
def test_no_rows_give_an_empty_output_and_zero_gradients(implementation):
    """An empty batch (``[0, d]``, ``[2, 0, d]``): the sorted form reshaped its ``0 * k`` pairs
    with an inferred size (ZeroDivisionError inside JAX)."""
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=E, top_k=2, key=jax.random.key(0), implementation=implementation)
    for shape in [(0, D), (2, 0, D)]:
        x = jnp.zeros(shape)
        y = jax.jit(lambda m, x: m(x))(moe, x)
        assert y.shape == shape
        grads = jax.jit(jax.grad(lambda m, x: jnp.sum(m(x))))(moe, x)
        assert all(not np.any(g) for g in jax.tree_util.tree_leaves(grads))


def test_the_sorted_form_under_vmap_is_refused_naming_the_forms_that_vmap():
    """jax.vmap of the sorted form failed deep in JAX (ragged_dot's batching rule: "vmap over
    any dim but 0 - NYI"); it is refused naming the call and the forms that vmap, which give
    the layer's numbers."""
    with jax.enable_x64(True):
        moe = layer(implementation="sorted")
        x = jax.random.normal(jax.random.key(1), (3, 5, D), jnp.float64)
        with pytest.raises(NotImplementedError, match=r"(?s)implementation='sorted'\) was called under jax.vmap.*"
                                                      r"right:  moe\(x\)"):
            jax.vmap(moe)(x)
        y = jax.jit(lambda m, x: m(x))(moe, x)  # (op by op, each operation compiled apart)
        for form in ("gathered", "dense"):
            np.testing.assert_allclose(jax.jit(jax.vmap(moe.replace(implementation=form)))(x), y, rtol=0,
                                       atol=TOLERANCE * float(jnp.abs(y).max()))
    assert _moe.SORTED_VMAP


def test_a_numpy_integer_top_k_is_the_int_it_is():
    """top_k=np.int64(2) was refused by TOP_K with its wrong and right lines the same call."""
    experts: Any = np.int64(E)  # (as read from an array: typed int by the signature)
    top_k: Any = np.int64(2)
    moe = ft.nn.SparseMoE(D, HIDDEN, num_experts=experts, top_k=top_k, key=jax.random.key(0))
    assert type(moe.top_k) is int and moe.top_k == 2
    x = jnp.ones((3, D))
    np.testing.assert_array_equal(moe(x), moe.replace(top_k=2)(x))


def test_bfloat16_jitter_runs_under_strict_promotion():
    """Training-mode jitter multiplied bfloat16 inputs by float32 noise: a TypePromotionError
    inside JAX under strict promotion."""
    moe = ft.nn.training(ft.nn.SparseMoE(4, 6, num_experts=3, jitter=0.1, key=jax.random.key(0), dtype=jnp.bfloat16))
    x = jnp.asarray(np.random.default_rng(1).normal(size=(2, 3, 4)), jnp.bfloat16)
    y = moe(x, key=jax.random.key(2))
    assert y.dtype == jnp.bfloat16 and bool(jnp.all(jnp.isfinite(y.astype(jnp.float32))))
    evaluated = ft.nn.inference(moe)(x)  # no jitter
    assert evaluated.shape == y.shape


def grouped_case(experts):
    """Rows sorted by their experts' order and what each row's own expert gives (the dense form)."""
    rows = jax.random.normal(jax.random.key(1), (6, D))
    chosen = jnp.array([2, 0, 3, 0, 2, 2])
    order = jnp.argsort(chosen, stable=True)
    sorted_rows = rows[order]
    want = experts.every(sorted_rows)[chosen[order], jnp.arange(6)]
    return rows, chosen, order, sorted_rows, want


@pytest.mark.parametrize("sizes", [[2, 0, 3, 0], [2, 0, 3, 3], [2, -1, 3, 2]])
def test_group_sizes_that_do_not_count_the_rows_are_refused_or_nan_under_jit(sizes):
    """The issue: Experts.grouped ran any sizes through jax.lax.ragged_dot: a sum short of the
    rows gave zero rows past it (measured: row 5 of 6 exactly 0.0), a sum past them ran, a
    negative size mixed experts (row 2: 1.34, none of the experts' -0.305, 1.228, -1.537).
    Now concrete sizes are refused naming their sum and the rows; under jax.jit every output
    row is NaN, with no gradient. The `right:` line gives each row's own expert."""
    experts = ft.nn.Experts(D, HIDDEN, E, key=jax.random.key(0), std=1.0)
    rows, chosen, order, sorted_rows, want = grouped_case(experts)
    good = experts.grouped(sorted_rows, jnp.array([2, 0, 3, 1]))
    np.testing.assert_allclose(good, want, rtol=0, atol=1e-5 * float(jnp.abs(want).max()))  # (float32)
    given = rf"got group_sizes {re.escape(str(sizes))} \(sum {sum(sizes)}\)"
    with pytest.raises(ft.nn.LayerInputError, match=rf"Experts expects inputs group_sizes \[{E}\] \(int\) counting "
                                                    rf"the rows, >= 0, summing to 6, {given}(.|\n)*wrong:(.|\n)*right:"):
        experts.grouped(sorted_rows, jnp.array(sizes))
    run = jax.jit(lambda e, r, s: e.grouped(r, s))
    out = run(experts, sorted_rows, jnp.array(sizes))
    assert out.shape == (6, D) and np.isnan(out).all()
    grads = jax.grad(lambda e, r: jnp.sum(run(e, r, jnp.array(sizes))), argnums=(0, 1))(experts, sorted_rows)
    assert all(not np.any(g) for g in jax.tree_util.tree_leaves(grads))  # no gradient (zeros, no NaN)
    right = re.search(r"right:  (.*)", _moe.GROUP_SIZES).group(1)
    fixed = eval(right, {"experts": experts, "rows": rows, "order": order, "chosen": chosen, "jnp": jnp,
                         "num_experts": E})
    np.testing.assert_array_equal(fixed, good)
    np.testing.assert_array_equal(run(experts, sorted_rows, jnp.array([2, 0, 3, 1], jnp.uint8)), good)


def test_group_sizes_of_another_shape_or_dtype_are_refused():
    experts = ft.nn.Experts(D, HIDDEN, E, key=jax.random.key(0))
    rows = jnp.ones((6, D))
    for sizes, given in [(jnp.array([3, 3]), r"i32\[2\]"), (jnp.array([2.0, 0, 3, 1]), r"f32\[4\]")]:
        with pytest.raises(ft.nn.LayerInputError, match=rf"summing to 6, got group_sizes {given} for rows f32\[6,{D}\]"):
            jax.jit(experts.grouped)(rows, sizes)
