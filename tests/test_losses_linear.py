"""``ft.losses.linear_cross_entropy`` (the cross entropy of a head's logits, a chunk of
positions at a time) against torch's ``F.linear_cross_entropy`` in float64, against
``softmax_cross_entropy`` of the whole logits, the gradient's program holding no whole logits,
its errors; and the causal LMs' ``lm_loss`` / ``last_hidden_state`` / ``lm_logits`` against
Hugging Face's ``model(ids, labels=labels).loss`` and base model.

float64 comparisons with torch: the largest difference measured over every case below was
2.8e-14 of the values' magnitude (1e-12 allowed). HF's float32 losses: 9.5e-7 over 21
families (4.8e-7 typical) for losses near 4 (1e-5 allowed)."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _errors import raises_named

import functree as ft
from functree.losses import _linear_cross_entropy as lce

os.environ.setdefault("HF_HUB_OFFLINE", "1")
torch = pytest.importorskip("torch")

N, D, C = 37, 16, 50


def data(seed=0):
    rng = np.random.default_rng(seed)
    x, w, b = rng.normal(size=(N, D)), rng.normal(size=(C, D)) * 0.3, rng.normal(size=C)
    y = rng.integers(0, C, N)
    y[[3, 7, 20]] = -100
    return x, w, b, y, rng.uniform(0.5, 2.0, C)


def torch_loss(x, w, b, y, reduction, **options):
    tensors = [torch.tensor(a, requires_grad=True) for a in (x, w, b)]
    options = {k: torch.tensor(v) if k == "weight" else v for k, v in options.items()}
    loss = torch.nn.functional.linear_cross_entropy(tensors[0], tensors[1], torch.tensor(y), linear_bias=tensors[2],
                                                    reduction=reduction, ignore_index=-100, **options)
    loss.sum().backward()
    return float(loss.detach().sum()), [t.grad.numpy() for t in tensors], loss.detach().numpy()


def options(class_weights):
    return {}, {"label_smoothing": 0.1}, {"weight": class_weights}, {"weight": class_weights, "label_smoothing": 0.2}


CHUNKS = (5, 37, 100, "auto")


def ours(reduction):
    """Every (options, chunk) case of ``reduction``: the loss summed, each position's loss (from
    the same call as the gradients, not a second forward) and the gradients of hidden, weight
    and bias, in one program (op by op, each case's scan and its transpose compiled apart).
    One a reduction, not one for all three: xdist may run the three on two workers."""
    x, w, b, y, class_weights = data()

    def cases(x, w, b, class_weights):
        results = []
        for case in options(class_weights):
            for chunk in CHUNKS:
                def total(x, w, b, chunk=chunk, case=case):
                    value = ft.losses.linear_cross_entropy(x, w.T, jnp.asarray(y), bias=b, chunk_size=chunk,
                                                           reduction=reduction, **case)
                    return jnp.sum(value), value

                results.append(jax.value_and_grad(total, (0, 1, 2), has_aux=True)(x, w, b))
        return results

    with jax.enable_x64(True):
        return jax.device_get(jax.jit(cases)(x, w, b, class_weights))  # (NumPy in: jnp.asarray compiles a program a shape)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_values_and_gradients_are_torchs(reduction):
    """Every option (smoothing, class weights, both, none) at chunk sizes that divide the 37
    positions or not, and "auto" (one chunk): values and the gradients of hidden, weight and
    bias equal torch's F.linear_cross_entropy, three labels ignored."""
    x, w, b, y, class_weights = data()
    results = iter(ours(reduction))
    for case in options(class_weights):
        expected, grads, per_position = torch_loss(x, w, b, y, reduction, **case)
        scale = max(1.0, abs(expected))
        for _ in CHUNKS:
            (value, values), gradients = next(results)
            np.testing.assert_allclose(float(value), expected, rtol=0, atol=1e-12 * scale)
            for got, want in zip(gradients, grads):
                np.testing.assert_allclose(np.asarray(got), want, rtol=0, atol=1e-12 * max(1.0, np.abs(want).max()))
            if reduction == "none":
                np.testing.assert_allclose(np.asarray(values), per_position, rtol=0, atol=1e-12 * scale)
    assert next(results, None) is None


def test_a_layer_or_function_head_equals_the_whole_logits_loss():
    """A Dense head and a tied-embedding function, [batch, T, width] hidden states, chunks of
    4 over 18 positions: the loss and its "weighted" parts are softmax_cross_entropy's of the
    whole logits, and so are the gradients of the head's parameters."""
    # the data in one program (op by op: a compile per draw and per update)
    head, table, hidden, labels = jax.jit(lambda: (
        ft.nn.Dense(8, 30, key=jax.random.key(0)), jax.random.normal(jax.random.key(1), (30, 8)),
        jax.random.normal(jax.random.key(2), (3, 6, 8)),
        jax.random.randint(jax.random.key(3), (3, 6), 0, 30).at[0, :2].set(-100)))()
    heads = ((lambda p, h: p(h), head), (lambda p, h: h @ p.T, table))

    @jax.jit  # both heads' losses, gradients and parts as one program (op by op: a compile per operation)
    def results(params):
        out = []
        for (fn, _), p in zip(heads, params):
            def chunked(p, fn=fn):
                return ft.losses.linear_cross_entropy(hidden, lambda h: fn(p, h), labels, chunk_size=4)

            def whole(p, fn=fn):
                return ft.losses.softmax_cross_entropy(fn(p, hidden), labels)

            parts = ft.losses.linear_cross_entropy(hidden, lambda h, fn=fn, p=p: fn(p, h), labels, chunk_size=4,
                                                   reduction="weighted")
            out.append((jax.value_and_grad(chunked)(p), jax.value_and_grad(whole)(p), parts))
        return out

    for (a, ga), (b, gb), parts in results([params for _, params in heads]):
        np.testing.assert_allclose(a, b, rtol=0, atol=4e-6 * abs(float(b)))
        for x, z in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
            np.testing.assert_allclose(x, z, rtol=0, atol=1e-5 * float(np.abs(z).max()))
        assert float(parts.count) == 16.0
        np.testing.assert_allclose(parts.value, b, rtol=0, atol=4e-6 * abs(float(b)))


def _shapes(jaxpr):
    """Every shape an equation of ``jaxpr`` (and its inner programs: scan, checkpoint, pjit) makes."""
    for eqn in jaxpr.eqns:
        for var in eqn.outvars:
            yield tuple(getattr(var.aval, "shape", ()))
        for param in eqn.params.values():
            inner = getattr(param, "jaxpr", param)
            if hasattr(inner, "eqns"):
                yield from _shapes(inner)


def test_the_gradient_never_holds_the_whole_logits():
    """The value-and-gradient program of 64 positions in chunks of 8 makes no array of 64 x
    100 logits (the whole loss's does: the test can fail), only chunks of 8 x 100."""
    # made in one program (op by op: a compile per operation of the layer's initialization)
    head, hidden, labels = jax.jit(lambda: (ft.nn.Dense(16, 100, key=jax.random.key(0)), jnp.ones((64, 16)),
                                            jnp.zeros((64,), jnp.int32)))()

    def program(loss):
        return jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(head, hidden).jaxpr

    whole = set(_shapes(program(lambda h, x: ft.losses.softmax_cross_entropy(h(x), labels))))
    chunked = set(_shapes(program(lambda h, x: ft.losses.linear_cross_entropy(x, h, labels, chunk_size=8))))
    assert (64, 100) in whole
    assert (64, 100) not in chunked and (8, 100) in chunked


def test_auto_cuts_equal_chunks_within_the_limit():
    assert lce.chunk_positions("auto", 32000, 8192) == 1024  # 8 chunks, not 7 of 1048 and one of 856
    assert lce.chunk_positions("auto", 32000, 500) == 500  # one chunk
    assert lce.chunk_positions("auto", 2**26, 10) == 1  # a chunk holds one position at least
    assert lce.chunk_positions(7, 10, 100) == 7


def test_errors_name_the_fix():
    x = jnp.ones((4, 8))
    w = jnp.ones((8, 5))
    y = jnp.zeros((4,), jnp.int32)
    f = ft.losses.linear_cross_entropy
    raises_named(lambda: f(x, w.T, y), ValueError, lce.TORCH_LAYOUT_WEIGHT, "linear_weight.T")
    raises_named(lambda: f(x, jnp.ones((3, 5)), y), ValueError, lce.WEIGHT_SHAPE, "[8, classes]")
    raises_named(lambda: f(x, w, y, bias=jnp.ones(4)), ValueError, lce.BIAS_SHAPE, "must be [5]")
    dense = ft.nn.Dense(8, 5, key=jax.random.key(0))
    raises_named(lambda: f(x, dense, y, bias=dense.bias), TypeError, lce.BIAS_WITH_A_LAYER, "(hidden, dense, labels)")
    # (cast by NumPy: XLA:CPU's SSE4_2 JIT links no float16 conversion, and the error is the claim)
    raises_named(lambda: f(x, jnp.asarray(np.asarray(w, np.float16)), y), TypeError, lce.HEAD_DTYPE, "weight.astype(hidden.dtype)")
    raises_named(lambda: f(x, "lm_head", y), TypeError, lce.HEAD_NOT_A_HEAD, "model.lm_head")
    raises_named(lambda: f(x, lambda h: h.sum(-1), y), ValueError, lce.HEAD_OUTPUT, "[positions, classes]")
    raises_named(lambda: f(x, w, jnp.zeros((4, 5))), ValueError, lce.LABELS_NOT_INDICES, "softmax_cross_entropy(head(hidden)")
    raises_named(lambda: f(x, w, jnp.zeros((4,))), TypeError, "softmax_cross_entropy: labels", "labels.astype(jnp.int32)")
    raises_named(lambda: f(x, w, y, chunk_size=0), ValueError, lce.BAD_CHUNK, "chunk_size=1024")
    raises_named(lambda: f(x, w, y, chunk_size=True), ValueError, lce.BAD_CHUNK, "chunk_size=1024")
    with pytest.raises(ValueError, match="label 5"):  # softmax_cross_entropy's range check, read on the host
        f(x, w, np.array([0, 1, 5, 2]))


# -- causal language models -----------------------------------------------------------------

transformers = pytest.importorskip("transformers")
from test_hf_load import DECODER, FAMILIES, VOCAB, hf_model  # noqa: E402


def lm_batch(seed=1, length=12):
    rng = np.random.default_rng(seed)
    ids = rng.integers(2, VOCAB, size=(2, length)).astype(np.int32)
    labels = ids.copy()
    labels[0, :4] = -100  # a prompt
    labels[1, 9:] = -100  # padding
    return ids, labels


def hf_loss(hf, ids, labels):
    return hf(torch.from_numpy(ids).long(), labels=torch.from_numpy(labels).long()).loss


@pytest.mark.parametrize("family", ["llama", "gemma2", "granite", "gpt2", "opt", "phi"])
def test_lm_loss_is_hugging_faces(family):
    """``lm_loss(ids, labels)`` is HF's ``model(ids, labels=labels).loss`` (labels shifted,
    -100 left out) at chunk sizes 3, 5 and "auto", for a Llama, Gemma 2 (its final logits
    soft-capped), Granite (logits_scaling), GPT-2 and Phi (tied heads, Phi's with a bias) and
    OPT (project_out); the logits of lm_logits(last_hidden_state) are the call's."""
    configs = {**FAMILIES, "llama": lambda: transformers.LlamaConfig(**DECODER),
               "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                                                       bos_token_id=0, eos_token_id=0)}
    hf = hf_model(configs[family]())
    model = ft.nn.from_hf(hf)
    ids, labels = lm_batch()
    with torch.no_grad():
        expected = float(hf_loss(hf, ids, labels))
    for chunk in (3, 5, "auto"):
        np.testing.assert_allclose(float(model.lm_loss(ids, labels, chunk_size=chunk)), expected, rtol=0,
                                   atol=1e-5 * abs(expected))
    logits = model(ids)
    np.testing.assert_array_equal(np.asarray(model.lm_logits(model.last_hidden_state(ids))), np.asarray(logits))


def test_lm_loss_gradients_and_hidden_state_are_hugging_faces():
    """A Llama's last_hidden_state is LlamaModel's; lm_loss's gradient is torch's backward of
    HF's loss at every parameter, chunked in 5s; under jax.jit and in a train_step, the loss
    is the same number. Both in float64, but HF computes its rotary angles in float32 in a
    float64 model: measured 2.6e-7 (hidden), 3.2e-7 (loss), 6.0e-7 (gradients) of their
    magnitudes, 6e-6 allowed."""
    hf = hf_model(transformers.LlamaConfig(**DECODER)).double()
    ids, labels = lm_batch()
    hf_ids = torch.from_numpy(ids).long()
    with jax.enable_x64(True):
        model = ft.nn.from_hf(hf, dtype=jnp.float64)
        with torch.no_grad():
            hidden = hf.model(hf_ids).last_hidden_state.numpy()
        loss = hf_loss(hf, ids, labels)
        loss.backward()
        # one program (op by op: the forward, its transpose and their glue each compiled apart)
        ours_hidden, (value, grads) = jax.jit(lambda model: (model.last_hidden_state(ids), ft.value_with_gradient(
            lambda m: m.lm_loss(ids, labels, chunk_size=5), model)))(model)
        np.testing.assert_allclose(np.asarray(ours_hidden), hidden, rtol=0, atol=6e-6 * np.abs(hidden).max())
        np.testing.assert_allclose(float(value), float(loss.detach()), rtol=0, atol=6e-6 * float(loss.detach()))
        theirs = dict(hf.named_parameters())
        ours = ft.nn.to_hf_state_dict(grads)
        assert set(ours) >= {k for k in theirs}
        for name, p in theirs.items():
            want = p.grad.numpy()
            np.testing.assert_allclose(np.asarray(ours[name]), want, rtol=0, atol=6e-6 * np.abs(want).max(),
                                       err_msg=name)
        jitted = jax.jit(lambda m: m.lm_loss(ids, labels, chunk_size=5))(model)
        np.testing.assert_allclose(float(jitted), float(value), rtol=0, atol=1e-12 * float(value))
        optimizer = ft.optim.Optimizer(ft.optim.sgd(0.1))
        step = ft.train.train_step(lambda m, batch: m.lm_loss(*batch, chunk_size=5), optimizer)
        _, _, metrics = step(model, optimizer.init(model), (ids, labels))
        np.testing.assert_allclose(float(metrics["loss"]), float(value), rtol=0, atol=1e-12 * float(value))


def test_lm_loss_labels_must_be_the_ids_shape():
    from functree.hf import _causal

    model = ft.nn.from_hf({"model_type": "llama", "vocab_size": 11, "hidden_size": 8, "intermediate_size": 16,
                           "num_hidden_layers": 1, "num_attention_heads": 2}, key=jax.random.key(0))
    ids = np.ones((2, 5), np.int32)
    raises_named(lambda: model.lm_loss(ids, ids[:, 1:]), ValueError, _causal.LM_LABELS, "model.lm_loss(ids, ids)")
