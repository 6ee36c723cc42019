"""Sequence models ported from torch as a user ports them, compared with torch in float64."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import functree as ft
from functree.nn._recurrent import TWO_BIASES_WITHOUT_BIAS
from tests._errors import raises_named

torch = pytest.importorskip("torch")

V, E, H, C, B, T = 11, 6, 5, 4, 3, 7  # vocabulary, embedding, hidden, classes, batch, steps


class _TorchTagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(V, E, padding_idx=0)
        self.lstm = torch.nn.LSTM(E, H, bidirectional=True, batch_first=True)
        self.head = torch.nn.Linear(2 * H, C)

    def forward(self, tokens):
        return self.head(self.lstm(self.embed(tokens))[0])


class _Tagger(ft.Module):
    embed: ft.nn.Embedding
    lstm: ft.nn.LSTM
    head: ft.nn.Dense

    def __init__(self, two_biases, key):
        k = jax.random.split(key, 3)
        self.embed = ft.nn.Embedding(V, E, padding_index=0, dtype=jnp.float64, key=k[0])
        self.lstm = ft.nn.LSTM(E, H, bidirectional=True, batch_first=True, two_biases=two_biases,
                               dtype=jnp.float64, key=k[1])
        self.head = ft.nn.Dense(2 * H, C, dtype=jnp.float64, key=k[2])

    def __call__(self, tokens):
        return self.head(self.lstm(self.embed(tokens)))


def _batches():
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, V, size=(5, B, T))
    labels = rng.integers(0, C, size=(5, B, T))
    tokens[:, 0, -2:], labels[:, 0, -2:] = 0, -100  # the first sequence padded: ignored positions
    return tokens, labels


def _torch_training(module, tokens, labels):
    """torch's 5 steps: AdamW, gradients clipped to global norm 1, label-smoothed CE over [N, C, T]."""
    opt = torch.optim.AdamW(module.parameters(), lr=0.05, weight_decay=0.01)
    loss_fn = torch.nn.CrossEntropyLoss(ignore_index=-100, label_smoothing=0.1)
    states = []
    for tok, lab in zip(tokens, labels):
        opt.zero_grad()
        loss_fn(module(torch.tensor(tok)).permute(0, 2, 1), torch.tensor(lab)).backward()
        torch.nn.utils.clip_grad_norm_(module.parameters(), 1.0)
        opt.step()
        states.append({k: v.detach().numpy().copy() for k, v in module.state_dict().items()})
    return states


def _training(model, tokens, labels):
    tx = optax.chain(ft.optim.clip_by_global_norm(1.0), ft.optim.adamw(0.05, weight_decay=0.01, exclude=()))

    def loss(m, tok, lab):
        return ft.losses.softmax_cross_entropy(m(tok), lab, ignore_index=-100, label_smoothing=0.1)

    @jax.jit
    def steps(m, tokens, labels):
        def step(carry, batch):
            m, s = carry
            updates, s = tx.update(jax.grad(loss)(m, *batch), s, m)
            m = optax.apply_updates(m, updates)
            return (m, s), m
        return jax.lax.scan(step, (m, tx.init(m)), (tokens, labels))[1]

    trained = steps(model, jnp.asarray(tokens), jnp.asarray(labels))
    return [ft.nn.torch_state_dict(jax.tree.map(lambda a, i=i: a[i], trained), numpy=True) for i in range(len(tokens))]


@pytest.fixture(scope="module")
def tagger_runs():
    """torch's 5 steps and ours (two_biases=True) from the same weights, the state dicts after each."""
    torch.manual_seed(0)
    module = _TorchTagger().double()
    tokens, labels = _batches()
    with jax.enable_x64(True):
        model = ft.nn.load_torch_state_dict(_Tagger(True, jax.random.key(0)), module.state_dict())
        ours = _training(model, tokens, labels)
    return _torch_training(module, tokens, labels), ours


def test_an_lstm_tagger_trains_as_torchs_with_two_biases(tagger_runs):
    """torch's LSTM holds two biases, b_ih and b_hh, and trains both: each gets the gradient g of
    their sum, so AdamW moves the sum by twice its step and clip_grad_norm_ counts g twice.
    ft.nn.LSTM held one bias b_ih + b_hh: the port of a torch tagger (Embedding with padding_idx,
    a bidirectional LSTM, Linear; AdamW, clip by norm 1, CrossEntropyLoss(ignore_index=-100,
    label_smoothing=0.1)) was 0.05 (= lr) off torch's summed bias after the first step and every
    parameter drifted from the second (0.24 off after 5 steps), with no error. two_biases=True
    trains both as torch: measured 1.1e-16 (values of about 1) after each of 5 steps."""
    theirs, ours = tagger_runs
    for step, (mine, expected) in enumerate(zip(ours, theirs)):
        assert mine.keys() == expected.keys()
        for name, value in expected.items():
            np.testing.assert_allclose(mine[name], value, rtol=0, atol=1e-12, err_msg=f"step {step}: {name}")


def test_two_biases_port_both_ways_and_give_torchs_outputs_and_gradients():
    """A 2-layer bidirectional LSTM with proj_size and two_biases loads torch's bias_ih and
    bias_hh as they are, gives torch's outputs, h_n, c_n and .grad of every parameter (the
    gradient export needs no gradient=True rule: no sum), and writes the same state dict back."""
    torch.manual_seed(1)
    module = torch.nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2).double()
    x = np.random.default_rng(1).normal(size=(5, 2, 3))
    ys_t, (h_t, c_t) = module(torch.tensor(x))
    ((ys_t ** 2).sum() + (h_t ** 3).sum() + (c_t ** 3).sum()).backward()
    with jax.enable_x64(True):
        model = ft.nn.LSTM(3, 4, num_layers=2, bidirectional=True, proj_size=2, batch_first=False,
                           two_biases=True, dtype=jnp.float64, key=jax.random.key(0))
        model = ft.nn.load_torch_state_dict(model, module)

        @jax.jit
        def run(m):
            def f(m):
                ys, final = m(jnp.asarray(x), return_state=True)
                h, c = jax.tree.map(lambda *s: jnp.stack(s), *final)
                return jnp.sum(ys ** 2) + jnp.sum(h ** 3) + jnp.sum(c ** 3), (ys, h, c)
            return jax.grad(f, has_aux=True)(m)

        grads, outputs = run(model)
    for name, mine, expected in zip(("output", "h_n", "c_n"), outputs, (ys_t, h_t, c_t)):
        np.testing.assert_allclose(np.asarray(mine), expected.detach().numpy(), rtol=0, atol=1e-13, err_msg=name)
    exported = ft.nn.torch_state_dict(grads, numpy=True)
    for name, p in module.named_parameters():
        np.testing.assert_allclose(exported[name], p.grad.numpy(), rtol=0, atol=1e-12, err_msg=name)
    written = ft.nn.torch_state_dict(model, numpy=True)
    for name, value in module.state_dict().items():
        np.testing.assert_array_equal(written[name], value.numpy(), err_msg=name)


def test_two_biases_without_a_bias_is_refused():
    raises_named(lambda: ft.nn.LSTMCell(3, 4, use_bias=False, two_biases=True, key=jax.random.key(0)),
                 ValueError, TWO_BIASES_WITHOUT_BIAS, "ft.nn.LSTMCell(n_in, n_hidden, two_biases=True, key=k)")
    raises_named(lambda: ft.nn.LSTM(3, 4, bias=False, two_biases=True, batch_first=True, key=jax.random.key(0)),
                 ValueError, TWO_BIASES_WITHOUT_BIAS, "use_bias=False, key=k)")


def test_torchs_forward_keywords_are_named_and_their_translation_is_torchs():
    """A port of torch's `attn(q, k, v, key_padding_mask=pad, attn_mask=m, need_weights=False)`
    got Python's bare "unexpected keyword argument", and torch's boolean masks are True where a
    key is NOT attended, ft's mask= where it is: passed over as they are, they invert. The error
    names each keyword with its translation, and the translation gives torch's numbers (kdim,
    vdim, add_zero_attn, a bool key padding mask and a per-head bool attn_mask, torch's
    "True: not attended"; float64, measured 2.2e-16 of outputs of about 1)."""
    from functree.nn._attention import TORCH_CALL_ARGUMENT

    n, heads, length, source = 2, 2, 3, 4
    torch.manual_seed(3)
    module = torch.nn.MultiheadAttention(8, heads, kdim=5, vdim=3, add_zero_attn=True, batch_first=True).double()
    rng = np.random.default_rng(3)
    q, k, v = rng.normal(size=(n, length, 8)), rng.normal(size=(n, source, 5)), rng.normal(size=(n, source, 3))
    pad = np.array([[False] * source, [False, False, True, True]])
    m = rng.random((n * heads, length, source)) < 0.4
    m[..., 0] = False  # key 0 open to every query: no row wholly masked (torch: NaN)
    expected = module(*map(torch.tensor, (q, k, v)), key_padding_mask=torch.tensor(pad), attn_mask=torch.tensor(m),
                      need_weights=False)[0].detach().numpy()
    with jax.enable_x64(True):
        attn = ft.nn.MultiheadAttention(8, heads, key_size=5, value_size=3, add_zero_attn=True, dtype=jnp.float64,
                                        key=jax.random.key(0))
        attn = ft.nn.load_torch_state_dict(attn, module)
        for given, fix in ((dict(key_padding_mask=pad), "mask=~pad[:, None, None, :]"),
                           (dict(attn_mask=m), "mask=~m"), (dict(is_causal=True), "causal=True"),
                           (dict(need_weights=False), "out = attn(q, k, v)"),
                           (dict(need_weights=True), "out, weights = attn(q, k, v, return_weights=True)")):
            raises_named(lambda given=given: attn(q, k, v, **given), TypeError, TORCH_CALL_ARGUMENT, fix)
        mask = ~pad[:, None, None, :] & ~m.reshape(n, heads, length, source)
        ours, weights = jax.jit(lambda a, q, k, v: a(q, k, v, mask=mask, return_weights=True))(attn, q, k, v)
    np.testing.assert_allclose(np.asarray(ours), expected, rtol=0, atol=1e-13)
    # torch's need_weights=True: per head (average_attn_weights=False), and its default average;
    # add_zero_attn's zero key is the last column of both
    _, per_head = module(*map(torch.tensor, (q, k, v)), key_padding_mask=torch.tensor(pad), attn_mask=torch.tensor(m),
                         need_weights=True, average_attn_weights=False)
    assert weights.shape == per_head.shape == (n, heads, length, source + 1)
    np.testing.assert_allclose(np.asarray(weights), per_head.detach().numpy(), rtol=0, atol=1e-13)
    np.testing.assert_allclose(np.asarray(weights).mean(-3), per_head.mean(1).detach().numpy(), rtol=0, atol=1e-13)
    from functree.nn._attention import WEIGHTS_WITH_CACHE

    causal = ft.nn.MultiheadAttention(8, heads, causal=True, key=jax.random.key(1))
    x = jnp.ones((1, 2, 8))
    raises_named(lambda: causal(x, cache=causal.init_cache(1, 4), positions=jnp.zeros((1, 2), jnp.int32),
                                return_weights=True), ValueError, WEIGHTS_WITH_CACHE, "attn(x, return_weights=True)")
