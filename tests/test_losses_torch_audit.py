"""ft.losses against torch.nn.functional in float64 where tests/test_losses_torch.py does not
look: non-default options together, K-dimensional and unbatched inputs, weights that
broadcast, saturated logits, clamps, kinks (|e| = delta, a margin met exactly), and
torch's recipes for the losses named otherwise here (kl_div's batchmean, log_target)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional

# float64 on both sides: the measured spread over CASES is 2.2e-16 of the values' scale
# (1 ulp; 1.3e-16 for the gradients); RTOL is the suite's torch tolerance (~500 times that).
RTOL = 1e-13
ALL = ("none", "sum", "mean")

rng = np.random.default_rng(40)
N, C, D1, D2 = 3, 4, 2, 5
W = rng.uniform(0.2, 2.0, C)
X4 = rng.normal(size=(N, D1, D2, C))
LABELS4 = rng.integers(0, C, (N, D1, D2))
LABELS4[0, 0, :3] = -100
LABELS4[1, 1, 1] = -100
PROBS4 = np.exp(X4[::-1]) / np.exp(X4[::-1]).sum(-1, keepdims=True)
P01, Y01 = rng.uniform(0.01, 0.99, (N, C)), rng.uniform(0, 1, (N, C))
LOG_Q = np.log(np.exp(X4[:, 0, 0]) / np.exp(X4[:, 0, 0]).sum(-1, keepdims=True))
P = np.exp(X4[:, 1, 0]) / np.exp(X4[:, 1, 0]).sum(-1, keepdims=True)
P[0, 1] = 0.0  # a zero term: 0, as torch's xlogy
KINKS = np.array([0.0, 0.5, -0.5, 2.0, -2.0, 1.5, -1.5, 3.0])  # |e| = delta / beta, and e = 0
RATES = np.array([[0.0, 1e-9, 0.5, 2.0], [3.0, 0.1, 1.0, 7.0]])
COUNTS = np.array([[0.0, 1.0, 2.0, 0.0], [1.0, 0.0, 5.0, 3.0]])
M3, T3 = rng.normal(size=(2, N, D1, C))
A, POS, NEG = rng.normal(size=(3, N, C))


def _t(x):
    return torch.tensor(x)


def _variance(shape):
    v = rng.uniform(0, 2, shape)
    v.flat[0], v.flat[-1] = 0.0, 1e-9  # below eps=1e-3: clamped, the gradient passing through (torch's)
    return v


def _moved(x):
    """torch's layout: the classes on axis 1 (contiguous: torch's nll2d backward needs it)."""
    return x.movedim(-1, 1).contiguous()


# (id, ours(*arrays, reduction), torch's(*tensors, reduction), arrays, arrays with a gradient, reductions)
CASES = [
    *[(f"cross_entropy-kdim-smoothing{ls}-weight{w is not None}",
       lambda x, y, r, ls=ls, w=w: ft.losses.softmax_cross_entropy(x, y, weight=w, label_smoothing=ls, reduction=r),
       lambda x, y, r, ls=ls, w=w: F.cross_entropy(_moved(x), y, weight=None if w is None else _t(w),
                                                   label_smoothing=ls, reduction=r),
       (X4, LABELS4), (0,), ALL) for ls in (0.0, 0.25) for w in (None, W)],
    ("cross_entropy-ignore_index2-weight-smoothing",
     lambda x, y, r: ft.losses.softmax_cross_entropy(x, y, weight=W, label_smoothing=0.1, ignore_index=2, reduction=r),
     lambda x, y, r: F.cross_entropy(_moved(x), y, weight=_t(W), label_smoothing=0.1, ignore_index=2, reduction=r),
     (X4, np.where(LABELS4 == -100, 2, LABELS4)), (0,), ALL),
    *[(f"cross_entropy-probabilities-kdim-smoothing-weight{w is not None}",
       lambda x, y, r, w=w: ft.losses.softmax_cross_entropy(x, y, weight=w, label_smoothing=0.15, reduction=r),
       lambda x, y, r, w=w: F.cross_entropy(_moved(x), _moved(y), weight=None if w is None else _t(w),
                                            label_smoothing=0.15, reduction=r),
       (X4, PROBS4), (0, 1), ALL) for w in (None, W)],
    ("cross_entropy-unbatched",
     lambda x, y, r: ft.losses.softmax_cross_entropy(x, y, weight=W, label_smoothing=0.2, reduction=r),
     lambda x, y, r: F.cross_entropy(x, y, weight=_t(W), label_smoothing=0.2, reduction=r),
     (X4[0, 0, 0], np.array(2)), (0,), ALL),
    ("nll-kdim-weight-ignore", lambda x, y, r: ft.losses.nll(x, y, weight=W, reduction=r),
     lambda x, y, r: F.nll_loss(_moved(x), y, weight=_t(W), reduction=r),
     (X4 - np.log(np.exp(X4).sum(-1, keepdims=True)), LABELS4), (0,), ALL),
    *[(f"bce-weight{list(shape)}", lambda p, y, r, w=w: ft.losses.binary_cross_entropy(p, y, weight=w, reduction=r),
       lambda p, y, r, w=w: F.binary_cross_entropy(p, y, weight=_t(w), reduction=r), (P01, Y01), (0, 1), ALL)
      for shape in ((N, 1), ()) for w in (rng.uniform(0.2, 2, shape),)],
    ("bce_with_logits-weight[1,C]-pos_weight[N,1]",
     lambda x, y, r: ft.losses.sigmoid_cross_entropy(x, y, weight=W[None], pos_weight=np.arange(1.0, N + 1)[:, None],
                                                     reduction=r),
     lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, weight=_t(W[None]),
                                                        pos_weight=_t(np.arange(1.0, N + 1)[:, None]), reduction=r),
     (3 * X4[:, 0, 0], Y01), (0, 1), ALL),
    ("bce_with_logits-saturated-pos_weight",
     lambda x, y, r: ft.losses.sigmoid_cross_entropy(x, y, pos_weight=W, reduction=r),
     lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, pos_weight=_t(W), reduction=r),
     (np.array([[-800.0, 800.0, -30.0, 30.0]]), np.array([[1.0, 0.0, 0.5, 0.5]])), (0, 1), ALL),
    # the recipes that ft.losses.kl_div's error names (OTHER_CALLS)
    ("kl_div-batchmean", lambda lq, p, r: ft.losses.kl_divergence(jnp.exp(lq), p, reduction="sum") / lq.shape[0],
     # (torch's gradient in p is NaN at p = 0, ours 0: tests/test_losses.py)
     lambda lq, p, r: F.kl_div(lq, p, reduction="batchmean"), (LOG_Q, P), (0,), ("mean",)),
    ("kl_div-log_target", lambda lq, lp, r: ft.losses.kl_divergence(jnp.exp(lq), jnp.exp(lp), reduction="sum"),
     lambda lq, lp, r: F.kl_div(lq, lp, reduction="sum", log_target=True), (LOG_Q, np.log(P + (P == 0))), (0, 1),
     ("mean",)),
    *[(f"huber-delta{d}-kinks", lambda a, b, r, d=d: ft.losses.huber(a, b, delta=d, reduction=r),
       lambda a, b, r, d=d: F.huber_loss(a, b, delta=d, reduction=r), (KINKS, np.zeros(8)), (0, 1), ALL)
      for d in (0.5, 2.0)],
    *[(f"smooth_l1-beta{b}-kinks", lambda a, e, r, b=b: ft.losses.smooth_l1(a, e, beta=b, reduction=r),
       lambda a, e, r, b=b: F.smooth_l1_loss(a, e, beta=b, reduction=r), (KINKS, np.zeros(8)), (0, 1), ALL)
      for b in (0.5, 1.5)],
    ("poisson_nll-rates-full-eps", lambda x, y, r: ft.losses.poisson_nll(x, y, log_input=False, full=True, eps=0.5,
                                                                         reduction=r),
     lambda x, y, r: F.poisson_nll_loss(x, y, log_input=False, full=True, eps=0.5, reduction=r), (RATES, COUNTS), (0,),
     ALL),
    *[(f"gaussian_nll-3d-variance{list(shape)}-full",
       lambda m, t, v, r: ft.losses.gaussian_nll(m, t, v, full=True, eps=1e-3, reduction=r),
       lambda m, t, v, r: F.gaussian_nll_loss(m, t, v, full=True, eps=1e-3, reduction=r),
       (M3, T3, _variance(shape)), (0, 1, 2), ALL) for shape in ((N, D1, C), (N, D1), (N, 1, C), (1, D1, C))],
    ("multi_margin-unbatched-p2-weight", lambda x, y, r: ft.losses.multi_margin(x, y, p=2, margin=0.3, weight=W,
                                                                                reduction=r),
     lambda x, y, r: F.multi_margin_loss(x, y, p=2, margin=0.3, weight=_t(W), reduction=r), (A[0], np.array(1)), (0,),
     ALL),
    ("multi_margin-at-the-margin", lambda x, y, r: ft.losses.multi_margin(x, y, reduction=r),  # torch's 0 there
     lambda x, y, r: F.multi_margin_loss(x, y, reduction=r), (np.array([[0.0, 1.0, 0.0, -1.0]]), np.array([1])), (0,),
     ALL),
    ("multi_margin-negative-margin", lambda x, y, r: ft.losses.multi_margin(x, y, margin=-0.5, reduction=r),
     lambda x, y, r: F.multi_margin_loss(x, y, margin=-0.5, reduction=r), (A, np.array([0, 3, 1])), (0,), ALL),
    ("multilabel_margin-unbatched", lambda x, y, r: ft.losses.multilabel_margin(x, y, reduction=r),
     lambda x, y, r: F.multilabel_margin_loss(x, y, reduction=r), (A[1], np.array([2, 0, -1, 3])), (0,), ALL),
    ("multilabel_margin-at-the-margin-and-every-class",
     lambda x, y, r: ft.losses.multilabel_margin(x, y, reduction=r),
     lambda x, y, r: F.multilabel_margin_loss(x, y, reduction=r),
     (np.array([[1.0, 0.0, 0.5, 2.0], [0.3, 0.1, -2.0, 1.0]]), np.array([[0, -1, 1, 1], [0, 1, 2, 3]])), (0,), ALL),
    ("multilabel_soft_margin-unbatched-weight",
     lambda x, y, r: ft.losses.multilabel_soft_margin(x, y, weight=W, reduction=r),
     lambda x, y, r: F.multilabel_soft_margin_loss(x, y, weight=_t(W), reduction=r), (A[2], Y01[0]), (0, 1), ALL),
    ("cosine_embedding-unbatched-negative-margin",
     lambda a, b, y, r: ft.losses.cosine_embedding(a, b, y, margin=-0.2, reduction=r),
     lambda a, b, y, r: F.cosine_embedding_loss(a, b, y, margin=-0.2, reduction=r),
     (A[0], A[0][::-1].copy(), np.array(-1.0)), (0, 1), ALL),
    ("cosine_embedding-zero-vectors",
     lambda a, b, y, r: ft.losses.cosine_embedding(a, b, y, reduction=r),
     lambda a, b, y, r: F.cosine_embedding_loss(a, b, y, reduction=r),
     (np.zeros((2, C)), np.array([[1.0, 2, 3, 4], [0, 0, 0, 0]]), np.array([1.0, -1.0])), (0, 1), ALL),
    *[(f"triplet_margin-p{p}-swap-eps", lambda a, b, c, r, p=p: ft.losses.triplet_margin(
        a, b, c, p=p, swap=True, margin=0.5, eps=1e-3, reduction=r),
       lambda a, b, c, r, p=p: F.triplet_margin_loss(a, b, c, p=p, swap=True, margin=0.5, eps=1e-3, reduction=r),
       (A, POS, NEG), (0, 1, 2), ALL) for p in (0.5, np.inf)],
    ("triplet_margin-unbatched", lambda a, b, c, r: ft.losses.triplet_margin(a, b, c, reduction=r),
     lambda a, b, c, r: F.triplet_margin_loss(a, b, c, reduction=r), (A[0], POS[0], NEG[0]), (0, 1, 2), ALL),
    ("margin_ranking-scalars", lambda a, b, y, r: ft.losses.margin_ranking(a, b, y, margin=0.1, reduction=r),
     lambda a, b, y, r: F.margin_ranking_loss(a, b, y, margin=0.1, reduction=r),
     (np.array(0.3), np.array(0.5), np.array(-1.0)), (0, 1), ALL),
    ("hinge_embedding-negative-margin", lambda x, y, r: ft.losses.hinge_embedding(x, y, margin=-0.5, reduction=r),
     lambda x, y, r: F.hinge_embedding_loss(x, y, margin=-0.5, reduction=r),
     (A, np.where(POS > 0, 1.0, -1.0)), (0,), ALL),
]


@functools.cache
def _ours():
    """Every case's reductions and gradient of the mean, as one compiled program (one
    compilation for the file, where each case's own was ~0.2 s)."""

    @jax.jit
    def run(arrays):
        out = {}
        for name, ours, _, _, graded, reductions in CASES:
            xs = arrays[name]
            out[name] = ({r: ours(*xs, r) for r in reductions},
                         jax.grad(lambda *ys, ours=ours: ours(*ys, "mean"), argnums=graded)(*xs))
        return out

    with jax.enable_x64(True):
        return jax.tree.map(np.asarray, run({c[0]: tuple(jnp.asarray(a) for a in c[3]) for c in CASES}))


def _scale(x):
    finite = np.abs(x[np.isfinite(x)])
    return max(1.0, finite.max(initial=0.0))


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torchs_numbers_and_gradients_beyond_the_defaults(case):
    name, _, theirs, arrays, graded, reductions = case
    values, grads = _ours()[name]
    for reduction in reductions:
        want = theirs(*(_t(a) for a in arrays), reduction).detach().numpy()
        assert values[reduction].shape == want.shape, reduction
        np.testing.assert_allclose(values[reduction], want, rtol=RTOL, atol=RTOL * _scale(want), err_msg=reduction)
    tensors = [_t(a).requires_grad_(i in graded) for i, a in enumerate(arrays)]
    theirs(*tensors, "mean").backward()
    for i, got in zip(graded, grads, strict=True):
        want = tensors[i].grad.numpy()
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * _scale(want), err_msg=f"gradient {i}")


def test_ctc_of_empty_sequences_is_torchs():
    """An input of 0 frames: loss 0 for an empty label (torch's), inf for a label it cannot emit."""
    log_probs = np.log(rng.dirichlet(np.ones(3), (2, 4)))
    labels, frames = np.array([[1], [2]]), np.array([0, 4])
    for lengths in (np.array([0, 1]), np.array([1, 1])):
        got = ft.losses.ctc(log_probs, labels, frames, lengths, reduction="none")
        want = F.ctc_loss(_t(log_probs).transpose(0, 1), _t(labels), _t(frames), _t(lengths), reduction="none")
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-6)


@pytest.mark.parametrize("weight", [None, W], ids=["unweighted", "weighted"])
def test_every_position_ignored_is_a_zero_mean_where_torchs_is_nan(weight):
    """Documented difference: torch's mean over no kept position (or kept weights summing to 0)
    is 0/0 = NaN; here it is 0 with a zero gradient (a minibatch of padding alone does not stop
    training). "sum" and "none" are torch's."""
    x, y = X4[:, 0, 0], np.full(N, -100)
    kw = {} if weight is None else {"weight": weight}
    tk = {} if weight is None else {"weight": _t(weight)}
    log_probs = x - np.log(np.exp(x).sum(-1, keepdims=True))

    @jax.jit
    def run(x, log_probs):
        out = {}
        for name, loss, s in (("ce", ft.losses.softmax_cross_entropy, x), ("nll", ft.losses.nll, log_probs)):
            out[name] = ({r: loss(s, y, reduction=r, **kw) for r in ALL},
                         jax.grad(lambda z, loss=loss: loss(z, y, **kw))(s))
        return out

    with jax.enable_x64(True):
        got = run(jnp.asarray(x), jnp.asarray(log_probs))
    for name, theirs, scores in (("ce", F.cross_entropy, x), ("nll", F.nll_loss, log_probs)):
        values, grad = got[name]
        assert np.isnan(theirs(_t(scores), _t(y), **tk).item())
        assert float(values["mean"]) == 0.0
        assert not np.asarray(grad).any()
        for r in ("sum", "none"):
            np.testing.assert_array_equal(values[r], theirs(_t(scores), _t(y), reduction=r, **tk).numpy())
