"""torch's losses in ft.losses (nll, binary_cross_entropy, smooth_l1, gaussian_nll,
poisson_nll, ctc, the margin and embedding losses; softmax_cross_entropy's weight= and
label_smoothing=, sigmoid_cross_entropy's pos_weight=) against torch.nn.functional in
float64 over a grid of settings: values for each reduction, gradients against torch's
autograd, and each input error."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import functree as ft

torch = pytest.importorskip("torch")
F = torch.nn.functional

# float64 on both sides: the measured spread over CASES is 4.4e-16 of the values' scale (2 ulps)
# and 1.9e-16 for the gradients; RTOL is that times ~200 (other XLA CPU instruction sets).
RTOL = 1e-13

rng = np.random.default_rng(28)
N, C = 5, 4


def _normal(*shape):
    return rng.normal(size=shape)


def _log_probs(*shape):
    x = _normal(*shape)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _signs(*shape):
    return rng.choice([-1.0, 1.0], size=shape)


LABELS = rng.integers(0, C, N)
IGNORED = np.where(np.arange(N) % 3 == 1, -100, LABELS)
SEQ_LABELS = rng.integers(0, C, (N, 3))
WEIGHT = rng.uniform(0.2, 2.0, C)
PROBS = np.concatenate([rng.uniform(0.01, 0.99, (N - 1, C)), [[0.0, 1.0, 0.5, 1e-50]]])  # saturated: torch's -100
TARGETS01 = np.concatenate([rng.uniform(0, 1, (N - 1, C)), [[1.0, 0.0, 1.0, 1.0]]])
COUNTS = rng.integers(0, 6, (N, C)).astype(float)
MULTILABEL = np.array([[3, 0, -1, 1], [1, 1, 2, -1], [-1, 0, 0, 0], [0, 1, 2, 3], [2, -1, 3, 3]])


def _t(x):
    return torch.tensor(x)


# (id, ours(*arrays, reduction), torch's(*tensors, reduction), arrays, which arrays get a gradient)
CASES = [
    ("nll", lambda x, y, r: ft.losses.nll(x, y, reduction=r), lambda x, y, r: F.nll_loss(x, y, reduction=r),
     (_log_probs(N, C), LABELS), (0,)),
    ("nll-weight-ignore", lambda x, y, r: ft.losses.nll(x, y, weight=WEIGHT, reduction=r),
     lambda x, y, r: F.nll_loss(x, y, weight=_t(WEIGHT), reduction=r), (_log_probs(N, C), IGNORED), (0,)),
    ("nll-nd", lambda x, y, r: ft.losses.nll(x, y, weight=WEIGHT, reduction=r),
     lambda x, y, r: F.nll_loss(x.movedim(-1, 1), y, weight=_t(WEIGHT), reduction=r),
     (_log_probs(N, 3, C), np.where(SEQ_LABELS == 2, -100, SEQ_LABELS)), (0,)),
    ("nll-unnormalized", lambda x, y, r: ft.losses.nll(x, y, ignore_index=None, reduction=r),
     lambda x, y, r: F.nll_loss(x, y, reduction=r), (-np.abs(_normal(N, C)), LABELS), (0,)),
    ("cross_entropy-weight-smoothing-ignore",
     lambda x, y, r: ft.losses.softmax_cross_entropy(x, y, weight=WEIGHT, label_smoothing=0.2, reduction=r),
     lambda x, y, r: F.cross_entropy(x, y, weight=_t(WEIGHT), label_smoothing=0.2, reduction=r),
     (_normal(N, C), IGNORED), (0,)),
    ("cross_entropy-smoothing-ignore",
     lambda x, y, r: ft.losses.softmax_cross_entropy(x, y, label_smoothing=0.1, reduction=r),
     lambda x, y, r: F.cross_entropy(x, y, label_smoothing=0.1, reduction=r), (_normal(N, C), IGNORED), (0,)),
    ("cross_entropy-probabilities-weight-smoothing",
     lambda x, y, r: ft.losses.softmax_cross_entropy(x, y, weight=WEIGHT, label_smoothing=0.3, reduction=r),
     lambda x, y, r: F.cross_entropy(x, y, weight=_t(WEIGHT), label_smoothing=0.3, reduction=r),
     (_normal(N, C), np.exp(_log_probs(N, C))), (0, 1)),
    ("bce", lambda p, y, r: ft.losses.binary_cross_entropy(p, y, reduction=r),
     lambda p, y, r: F.binary_cross_entropy(p, y, reduction=r), (PROBS, TARGETS01), (0, 1)),
    ("bce-weight", lambda p, y, r: ft.losses.binary_cross_entropy(p, y, weight=WEIGHT, reduction=r),
     lambda p, y, r: F.binary_cross_entropy(p, y, weight=_t(WEIGHT), reduction=r), (PROBS, TARGETS01), (0, 1)),
    ("bce_with_logits-pos_weight", lambda x, y, r: ft.losses.sigmoid_cross_entropy(x, y, pos_weight=WEIGHT, reduction=r),
     lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, pos_weight=_t(WEIGHT), reduction=r),
     (_normal(N, C) * 3, TARGETS01), (0, 1)),
    ("bce_with_logits-weight-pos_weight",
     lambda x, y, r: ft.losses.sigmoid_cross_entropy(x, y, weight=WEIGHT, pos_weight=2 * WEIGHT, reduction=r),
     lambda x, y, r: F.binary_cross_entropy_with_logits(x, y, weight=_t(WEIGHT), pos_weight=_t(2 * WEIGHT), reduction=r),
     (_normal(N, C) * 3, TARGETS01), (0, 1)),
    *[(f"smooth_l1-beta{beta}", lambda p, e, r, beta=beta: ft.losses.smooth_l1(p, e, beta=beta, reduction=r),
       lambda p, e, r, beta=beta: F.smooth_l1_loss(p, e, beta=beta, reduction=r),
       (np.concatenate([_normal(N, C) * 2, np.zeros((1, C))]), np.concatenate([_normal(N, C), np.zeros((1, C))])),
       (0, 1)) for beta in (0.0, 0.5, 1.0, 2.0)],
    *[(f"gaussian_nll-{name}-full{full}",
       lambda m, t, v, r, full=full: ft.losses.gaussian_nll(m, t, v, full=full, reduction=r),
       lambda m, t, v, r, full=full: F.gaussian_nll_loss(m, t, v, full=full, reduction=r),
       (_normal(N, C), _normal(N, C), np.abs(_normal(*shape)) + np.where(rng.uniform(size=shape) < 0.3, 0, 0.1)),
       (0, 1, 2)) for name, shape in (("same", (N, C)), ("rows", (N,)), ("shared", (1, C)), ("col", (N, 1)))
      for full in (False, True)],
    ("gaussian_nll-number", lambda m, t, r: ft.losses.gaussian_nll(m, t, 0.7, reduction=r),
     lambda m, t, r: F.gaussian_nll_loss(m, t, 0.7, reduction=r), (_normal(N, C), _normal(N, C)), (0, 1)),
    *[(f"poisson_nll-log{log}-full{full}",
       lambda x, y, r, log=log, full=full: ft.losses.poisson_nll(x, y, log_input=log, full=full, reduction=r),
       lambda x, y, r, log=log, full=full: F.poisson_nll_loss(x, y, log_input=log, full=full, reduction=r),
       # (full: torch's target gradient is NaN at a 0 count, test_poisson_nll_target_gradient)
       (_normal(N, C) if log else np.abs(_normal(N, C)), COUNTS), (0,) if full else (0, 1))
      for log in (True, False) for full in (False, True)],
    *[(f"cosine_embedding-margin{m}", lambda a, b, y, r, m=m: ft.losses.cosine_embedding(a, b, y, margin=m, reduction=r),
       lambda a, b, y, r, m=m: F.cosine_embedding_loss(a, b, y, margin=m, reduction=r),
       (_normal(N, C), _normal(N, C), _signs(N)), (0, 1)) for m in (0.0, 0.3)],
    *[(f"margin_ranking-margin{m}", lambda a, b, y, r, m=m: ft.losses.margin_ranking(a, b, y, margin=m, reduction=r),
       lambda a, b, y, r, m=m: F.margin_ranking_loss(a, b, y, margin=m, reduction=r),
       (_normal(N), _normal(N), _signs(N)), (0, 1)) for m in (0.0, 0.5)],
    *[(f"triplet_margin-p{p}-swap{swap}",
       lambda a, b, c, r, p=p, swap=swap: ft.losses.triplet_margin(a, b, c, p=p, swap=swap, margin=2.0, reduction=r),
       lambda a, b, c, r, p=p, swap=swap: F.triplet_margin_loss(a, b, c, p=p, swap=swap, margin=2.0, reduction=r),
       (_normal(N, C), _normal(N, C), _normal(N, C)), (0, 1, 2)) for p in (1.0, 2.0, 3.0) for swap in (False, True)],
    ("triplet_margin_with_distance-default",
     lambda a, b, c, r: ft.losses.triplet_margin_with_distance(a, b, c, swap=True, reduction=r),
     lambda a, b, c, r: F.triplet_margin_with_distance_loss(a, b, c, swap=True, reduction=r),
     (_normal(N, C), _normal(N, C), _normal(N, C)), (0, 1, 2)),
    ("triplet_margin_with_distance-cosine",
     lambda a, b, c, r: ft.losses.triplet_margin_with_distance(
         a, b, c, distance=lambda x, y: 1 - jnp.sum(x * y, -1) / jnp.sqrt(jnp.sum(x * x, -1) * jnp.sum(y * y, -1)),
         margin=0.5, swap=True, reduction=r),
     lambda a, b, c, r: F.triplet_margin_with_distance_loss(
         a, b, c, distance_function=lambda x, y: 1 - F.cosine_similarity(x, y, eps=0), margin=0.5, swap=True,
         reduction=r), (_normal(N, C), _normal(N, C), _normal(N, C)), (0, 1, 2)),
    *[(f"hinge_embedding-margin{m}", lambda x, y, r, m=m: ft.losses.hinge_embedding(x, y, margin=m, reduction=r),
       lambda x, y, r, m=m: F.hinge_embedding_loss(x, y, margin=m, reduction=r), (_normal(N, C), _signs(N, C)), (0,))
      for m in (1.0, 0.5)],
    ("soft_margin", lambda x, y, r: ft.losses.soft_margin(x, y, reduction=r),
     lambda x, y, r: F.soft_margin_loss(x, y, reduction=r), (_normal(N, C) * 3, _signs(N, C)), (0,)),
    *[(f"multilabel_soft_margin-{w is not None}",
       lambda x, y, r, w=w: ft.losses.multilabel_soft_margin(x, y, weight=w, reduction=r),
       lambda x, y, r, w=w: F.multilabel_soft_margin_loss(x, y, weight=None if w is None else _t(w), reduction=r),
       (_normal(N, C) * 3, TARGETS01), (0, 1)) for w in (None, WEIGHT)],
    *[(f"multi_margin-p{p}-{w is not None}",
       lambda x, y, r, p=p, w=w: ft.losses.multi_margin(x, y, p=p, margin=0.7, weight=w, reduction=r),
       lambda x, y, r, p=p, w=w: F.multi_margin_loss(x, y, p=p, margin=0.7, weight=None if w is None else _t(w),
                                                     reduction=r), (_normal(N, C), LABELS), (0,))
      for p in (1, 2) for w in (None, WEIGHT)],
    ("multilabel_margin", lambda x, y, r: ft.losses.multilabel_margin(x, y, reduction=r),
     lambda x, y, r: F.multilabel_margin_loss(x, y, reduction=r), (_normal(N, C), MULTILABEL), (0,)),
]


def _scale(x):
    """The values' magnitude, at least 1 (torch's gradients are +-inf at a saturated probability)."""
    finite = np.abs(x[np.isfinite(x)])
    return max(1.0, finite.max(initial=0.0))


def _ours(case, arrays, reduction):
    return case[1](*(jnp.asarray(a) for a in arrays), reduction)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_torchs_numbers_and_gradients(case):
    """Each loss gives torch.nn.functional's number in float64 for "none", "sum" and "mean"
    ("weighted": the mean's parts), and torch's autograd gradient of the mean. (One compiled
    program per case: the reductions and the gradient traced together; the host checks,
    which read concrete inputs, are tested eagerly below.)"""
    _, ours, theirs, arrays, graded = case

    @jax.jit
    def run(*xs):
        values = {r: ours(*xs, r) for r in ("none", "sum", "mean")}
        gradient = jax.grad(lambda *ys: ours(*ys, "mean"), argnums=graded)(*xs)
        return values, ours(*xs, "weighted").value, gradient

    with jax.enable_x64(True):
        values, weighted, grads = run(*(jnp.asarray(a) for a in arrays))
    for reduction in ("none", "sum", "mean"):
        want, got = theirs(*(_t(a) for a in arrays), reduction).numpy(), np.asarray(values[reduction])
        assert got.shape == want.shape, reduction
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL * _scale(want), err_msg=reduction)
    np.testing.assert_allclose(float(weighted), float(values["mean"]), rtol=RTOL)
    tensors = [_t(a).requires_grad_(i in graded) for i, a in enumerate(arrays)]
    theirs(*tensors, "mean").backward()
    for i, g in zip(graded, grads, strict=True):
        want = tensors[i].grad.numpy()
        np.testing.assert_allclose(np.asarray(g), want, rtol=RTOL, atol=RTOL * _scale(want), err_msg=f"gradient {i}")


B, T, K, S = 4, 7, 5, 4
CTC_LOGITS = rng.normal(size=(B, T, K))
CTC_LABELS = np.array([[1, 2, 2, 3], [4, 4, 4, 1], [3, 1, 0, 0], [2, 0, 0, 0]])
# sequence 1 needs 3 labels + 2 repeats = 5 frames, and has 4: impossible (torch: inf)
CTC_INPUT_LENGTHS, CTC_LABEL_LENGTHS = np.array([7, 4, 6, 3]), np.array([4, 3, 2, 0])


@pytest.mark.parametrize("blank, zero_infinity", [(0, True), (0, False), (K - 1, True)])
def test_ctc_gives_torchs_numbers_and_gradients(blank, zero_infinity):
    """ft.losses.ctc (batch first, optax.ctc_loss) gives torch's ctc_loss (time-major log-probabilities)
    in float64 for each reduction: varying lengths, a label repeated (a blank between), an empty
    label, an impossible alignment (inf, or 0 with zero_infinity), the blank first or last; and
    torch's gradient with respect to the logits (through log_softmax) where every loss is finite."""
    labels = np.where(blank == CTC_LABELS, (blank + 1) % K, CTC_LABELS)  # no label is the blank

    def theirs(logits, reduction):
        return F.ctc_loss(F.log_softmax(logits, -1).transpose(0, 1), _t(labels), _t(CTC_INPUT_LENGTHS),
                          _t(CTC_LABEL_LENGTHS), blank=blank, zero_infinity=zero_infinity, reduction=reduction)

    def ours(logits, reduction):
        return ft.losses.ctc(logits, labels, CTC_INPUT_LENGTHS, CTC_LABEL_LENGTHS, blank=blank,
                             zero_infinity=zero_infinity, reduction=reduction)

    @jax.jit
    def run(logits):
        values = {r: ours(logits, r) for r in ("none", "sum", "mean")}
        # log-probabilities give the same number (their log_softmax is themselves)
        again = ours(jax.nn.log_softmax(logits), "none")
        return values, ours(logits, "weighted").value, again, jax.grad(lambda x: ours(x, "mean"))(logits)

    with jax.enable_x64(True):
        values, weighted, again, got = run(jnp.asarray(CTC_LOGITS))
    for reduction in ("none", "sum", "mean"):
        want = theirs(_t(CTC_LOGITS), reduction).detach().numpy()
        np.testing.assert_allclose(values[reduction], want, rtol=RTOL, atol=RTOL * _scale(want), err_msg=reduction)
    assert np.isinf(want) != zero_infinity  # the impossible alignment's inf reaches the mean
    np.testing.assert_allclose(float(weighted), float(want), rtol=RTOL)
    np.testing.assert_allclose(again, values["none"], rtol=RTOL)
    if zero_infinity:
        logits = _t(CTC_LOGITS).requires_grad_(True)
        theirs(logits, "mean").backward()
        want = logits.grad.numpy()
        np.testing.assert_allclose(np.asarray(got), want, rtol=RTOL, atol=RTOL * _scale(want))
        assert not np.asarray(got)[1].any()  # the impossible sequence: no gradient


def test_poisson_nll_target_gradient_is_finite_where_torchs_is_nan():
    """full=True: torch's gradient with respect to a 0 count is NaN (0 * log 0 behind its mask);
    ours is the masked term's derivative, finite, and torch's wherever torch's is a number."""
    x, t = np.full(4, 0.5), np.array([0.0, 1.0, 2.0, 5.0])
    tx, tt = _t(x), _t(t).requires_grad_(True)
    F.poisson_nll_loss(tx, tt, full=True, reduction="sum").backward()
    with jax.enable_x64(True):
        ours = np.asarray(jax.grad(lambda y: ft.losses.poisson_nll(jnp.asarray(x), y, full=True, reduction="sum"))(
            jnp.asarray(t)))
    want = tt.grad.numpy()
    assert np.isnan(want[0]) and np.isfinite(ours).all()
    np.testing.assert_allclose(ours[1:], want[1:], rtol=RTOL)
    np.testing.assert_allclose(ours[0], -x[0], rtol=RTOL)  # d/dt (exp(x) - t x) = -x


def test_poisson_nll_of_rates_is_poisson_and_half_precision_is_float32():
    """poisson_nll(rate, y, log_input=False, eps=0) is ft.losses.poisson(rate, y), and
    poisson_nll(log_rate, y) is poisson(exp(log_rate), y); bfloat16 inputs give a float32 loss,
    the float32 loss of the rounded inputs, for the new losses as for the others."""
    rate, y = np.abs(_normal(N, C)).astype(np.float32) + 0.1, COUNTS.astype(np.float32)
    np.testing.assert_allclose(ft.losses.poisson_nll(rate, y, log_input=False, eps=0.0), ft.losses.poisson(rate, y),
                               rtol=1e-6)
    np.testing.assert_allclose(ft.losses.poisson_nll(np.log(rate), y), ft.losses.poisson(rate, y), rtol=1e-6)
    half = [(ft.losses.nll, (_log_probs(N, C), LABELS)), (ft.losses.binary_cross_entropy, (PROBS, TARGETS01)),
            (ft.losses.triplet_margin, (_normal(N, C), _normal(N, C), _normal(N, C)))]
    for loss, arrays in half:
        rounded = [a.astype(jnp.bfloat16) if a.dtype.kind == "f" else a for a in arrays]
        got = loss(*(jnp.asarray(a) for a in rounded))
        want = loss(*(a.astype(np.float32) if a.dtype.kind == "f" else a for a in rounded))
        assert got.dtype == jnp.float32, loss.__name__
        np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=loss.__name__)


def test_traced_invalid_inputs_make_the_loss_nan():
    """Under a jax.jit of your own the host checks cannot read the inputs: a label outside the
    classes, a 0 where the sign is needed, a probability above 1, the blank as a CTC label make
    their loss NaN, never a plausible number (a training step's NaN check stops there)."""
    x = jnp.asarray(_log_probs(2, C), jnp.float32)
    checks = [
        (lambda y: ft.losses.nll(x, y, reduction="none"), jnp.array([0, C]), [False, True]),
        (lambda y: ft.losses.margin_ranking(x[:, 0], x[:, 1], y, reduction="none"), jnp.array([1.0, 0.0]),
         [False, True]),
        (lambda p: ft.losses.binary_cross_entropy(p, jnp.ones(2), reduction="none"), jnp.array([0.5, 1.5]),
         [False, True]),
        (lambda y: ft.losses.ctc(jnp.zeros((2, 3, 3)), y, jnp.array([3, 3]), jnp.array([2, 2]), reduction="none"),
         jnp.array([[1, 2], [1, 0]]), [False, True]),
    ]
    for loss, bad, nan in checks:
        assert np.isnan(np.asarray(jax.jit(loss)(bad))).tolist() == nan


def test_traced_int64_labels_past_2_32_make_the_margin_losses_nan():
    """Under x64 multi_margin and multilabel_margin cast traced int64 labels to int32: class
    ``2**32 + 2`` was scored as class 2 and ``2**32 - 1`` ended a multilabel list as -1,
    plausible losses. A label outside the classes makes its loss NaN, as nll's."""
    with jax.enable_x64(True):
        x = jnp.asarray(_log_probs(2, C), jnp.float64)
        multi = jax.jit(lambda y: ft.losses.multi_margin(x, y, reduction="none"))
        assert np.isnan(np.asarray(multi(np.array([2, 2**32 + 2], np.int64)))).tolist() == [False, True]
        listed = jax.jit(lambda y: ft.losses.multilabel_margin(x, y, reduction="none"))
        labels = np.full((2, C), -1, np.int64)
        labels[:, :2] = [[0, 1], [0, 2**32 - 1]]
        assert np.isnan(np.asarray(listed(labels))).tolist() == [False, True]


def test_torch_names_name_the_new_losses():
    """ft.losses.nll_loss (torch's functional name) and ft.losses.CTCLoss (its class) name
    ft.losses' loss, and ft.nn.NLLLoss (torch.nn's spelling) names it too, with the call."""
    for name, ours in (("nll_loss", "nll"), ("NLLLoss", "nll"), ("ctc_loss", "ctc"), ("CTCLoss", "ctc"),
                       ("triplet_margin_loss", "triplet_margin"), ("MultiLabelMarginLoss", "multilabel_margin"),
                       ("gaussian_nll_loss", "gaussian_nll"), ("PoissonNLLLoss", "poisson_nll")):
        with pytest.raises(AttributeError, match=f"its equivalent here is ft.losses.{ours} "):
            getattr(ft.losses, name)
    with pytest.raises(AttributeError, match=r"jnp.swapaxes\(log_probs, 0, 1\)"):
        ft.losses.ctc_loss  # noqa: B018
    for name in ("cosine_similarity", "pairwise_distance"):  # not losses: ft.nn's functions
        with pytest.raises(AttributeError, match=rf"(?s)torch's F.{name} is not a loss; it is ft.nn.{name} here.*"
                                                 rf"right:  ft.nn.{name}\(x1, x2\)"):
            getattr(ft.losses, name)
        assert callable(getattr(ft.nn, name))
    for cls, call in (("NLLLoss", "ft.losses.nll(log_probs, labels)"), ("BCELoss", "ft.losses.binary_cross_entropy("),
                      ("CTCLoss", "ft.losses.ctc(logits, labels, input_lengths, label_lengths)"),
                      ("MultiMarginLoss", "ft.losses.multi_margin(scores, labels)")):
        with pytest.raises(AttributeError, match=rf"(?s)has no attribute '{cls}': torch's nn.{cls} is the function "
                                                 rf"ft.losses.\w+ here.*right:  loss = {re.escape(call)}"):
            getattr(ft.nn, cls)


X, Y = _normal(N, C).astype(np.float32), _signs(N, C).astype(np.float32)
ERRORS = [
    # SIGNED_LABELS: 0/1 labels where torch reads a 0 as neither side
    (lambda: ft.losses.margin_ranking(X[:, 0], X[:, 1], np.array([1.0, 0, 1, 1, 0])),
     r"margin_ranking: y must be -1 or 1.*y\[1\] is 0.*a 0 adds max\(0, margin\).*right:  ft.losses.margin_ranking"
     r"\(x1, x2, 2 \* y - 1\)"),
    (lambda: ft.losses.hinge_embedding(X, (Y > 0).astype(np.float32)),
     r"hinge_embedding: expected must be -1 or 1.*right:  ft.losses.hinge_embedding\(predicted, 2 \* expected - 1\)"),
    (lambda: ft.losses.soft_margin(X, (Y > 0).astype(np.float32)), r"soft_margin: expected must be -1 or 1.*log 2"),
    (lambda: ft.losses.cosine_embedding(X, X, np.array([1.0, 1, 1, 1, 0])), r"cosine_embedding: y must be -1 or 1"),
    # INDEX_LABELS, INDEX_OUT_OF_RANGE
    (lambda: ft.losses.nll(X - 10, LABELS.astype(np.float32)),
     r"nll: labels must be integer class indices \[5\], got f32\[5\].*labels.astype\(jnp.int32\)"),
    (lambda: ft.losses.nll(X - 10, np.array([0, 1, 4, 2, -100])),
     r"nll: label 4 at labels\[2\] is not a class of .*classes 0 to 3, or ignore_index -100.*or -100 \(ignore_index\)"),
    (lambda: ft.losses.multilabel_margin(X, np.array([[0, -2, 1, 1]] * N)),
     r"multilabel_margin: label -2 at labels\[0, 1\].*-1 ends the list"),
    (lambda: ft.losses.multi_margin(X, LABELS.astype(np.float32)), r"multi_margin: labels must be integer class"),
    # BAD_CLASS_WEIGHT, BAD_ELEMENT_WEIGHT
    (lambda: ft.losses.nll(X - 10, LABELS, weight=np.ones(3, np.float32)),
     r"nll: weight must be one floating weight per class, f32\[4\].*torch's NLLLoss\(weight=\)"),
    (lambda: ft.losses.multi_margin(X, LABELS, weight=np.ones(C, np.int32)), r"multi_margin: weight must be one floating"),
    (lambda: ft.losses.binary_cross_entropy(np.full((N, C), 0.5, np.float32), TARGETS01.astype(np.float32),
                                            weight=np.ones(3, np.float32)),
     r"binary_cross_entropy: weight must be a floating array that broadcasts to \[5, 4\].*BCELoss"),
    (lambda: ft.losses.sigmoid_cross_entropy(X, TARGETS01.astype(np.float32), weight=np.ones((N, 1), np.int32)),
     r"sigmoid_cross_entropy: weight must be a floating array that broadcasts to \[5, 4\].*BCEWithLogitsLoss"),
    # SHAPES, SHAPE_MISMATCH, NO_CLASS_AXIS
    (lambda: ft.losses.margin_ranking(X[:, 0], X[:, 1], np.ones((N, 1), np.float32)),
     r"margin_ranking: y must have the shape \[5\], got f32\[5,1\].*y.reshape\(\[5\]\)"),
    (lambda: ft.losses.cosine_embedding(X, X, np.ones((N, C), np.float32)),
     r"cosine_embedding: y must have the shape \[5\].*one label per pair of vectors"),
    (lambda: ft.losses.triplet_margin(X, X, X[:, :2]), r"triplet_margin: predicted and expected must have the same shape"),
    (lambda: ft.losses.multi_margin(np.float32(1.0), np.int32(0)), r"multi_margin: scores must have a class axis"),
    # BAD_NUMBER
    (lambda: ft.losses.multi_margin(X, LABELS, p=3), r"multi_margin: p must be 1 or 2 \(torch's choices\), got 3"),
    (lambda: ft.losses.triplet_margin_with_distance(X, X, X, margin=0.0), r"margin must be a positive number"),
    (lambda: ft.losses.triplet_margin(X, X, X, p=0), r"triplet_margin: p must be a positive norm order"),
    (lambda: ft.losses.gaussian_nll(X, X, 1.0, eps=0.0), r"gaussian_nll: eps must be a positive number"),
    (lambda: ft.losses.cosine_embedding(X, X, np.ones(N, np.float32), margin=2.0), r"margin must be a number in \[-1, 1\]"),
    # the likelihoods
    (lambda: ft.losses.nll(np.exp(X), LABELS),
     r"nll: log_probs must be log-probabilities.*right:  ft.losses.nll\(jnp.log\(probs\), labels\)"),
    (lambda: ft.losses.nll(np.zeros((N, C, 3), np.float32) - 1, np.zeros((N, 3), np.int32)),
     r"nll: for log_probs .* expected integer labels of shape \[5, 4\].*torch's layout.*jnp.moveaxis\(log_probs, 1, -1\)"),
    (lambda: ft.losses.nll(X - 10, np.zeros((N, 1), np.int32)), r"labels.reshape\(\[5\]\)"),
    (lambda: ft.losses.binary_cross_entropy(X, TARGETS01.astype(np.float32)),
     r"binary_cross_entropy: probs must be probabilities in \[0, 1\].*These are logits.*sigmoid_cross_entropy\(logits"),
    (lambda: ft.losses.binary_cross_entropy(np.full((N, C), 0.5, np.float32), Y),
     r"binary_cross_entropy: labels must be targets in \[0, 1\].*\(labels \+ 1\) / 2"),
    (lambda: ft.losses.gaussian_nll(X, X, np.ones((N, 2), np.float32)),
     r"gaussian_nll: variance f32\[5,2\] does not fit predicted f32\[5,4\].*variance.reshape\(\[5, 4\]\)"),
    (lambda: ft.losses.gaussian_nll(X, X, -np.ones(N, np.float32)),
     r"gaussian_nll: variance must be non-negative.*variance\[0\] is -1.*softplus"),
    (lambda: ft.losses.poisson_nll(X, -COUNTS.astype(np.float32) - 1), r"poisson_nll: expected must be counts"),
    (lambda: ft.losses.poisson_nll(X, COUNTS.astype(np.float32), log_input=False),
     r"poisson_nll: predicted must be rates.*These are log-rates.*log_input=True"),
    (lambda: ft.losses.smooth_l1(X, X, beta=-1.0), r"smooth_l1: beta must be a non-negative Python number.*beta=1.0"),
    (lambda: ft.losses.multilabel_soft_margin(X, Y),
     r"multilabel_soft_margin: labels must be targets in \[0, 1\].*\(labels \+ 1\) / 2"),
    (lambda: ft.losses.triplet_margin_with_distance(X, X, X, distance=lambda a, b: jnp.abs(a - b)),
     r"distance\(anchor, positive\) must return one distance per triplet, shape \[5\], got f32\[5,4\]"),
    (lambda: ft.losses.nll(X - 10, LABELS, reduction="batchmean"), r"nll: reduction must be one of"),
    (lambda: ft.losses.triplet_margin(X, X, X, margin=0.0),  # torch refuses margin <= 0 (it was taken here)
     r"triplet_margin: margin must be a positive number \(torch's rule\), got 0.0"),
    # ctc
    (lambda: ft.losses.ctc(np.zeros((3, 5), np.float32), np.ones((1, 2), np.int32), [3], [2]),
     r"ctc: logits must be \[batch, time, classes\], got f32\[3,5\].*logits\[None\]"),
    (lambda: ft.losses.ctc(np.zeros((6, 2, 5), np.float32), np.ones((2, 2), np.int32), np.array([6, 6]), np.array([2, 2])),
     r"ctc: input_lengths must be one length per sequence, \[6\].*time-major.*jnp.swapaxes\(log_probs, 0, 1\)"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.ones(4, np.int32), np.array([6, 6]), np.array([2, 2])),
     r"ctc: labels must be padded integer labels.*concatenated 1-D targets.*np.split"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.ones((2, 2), np.int32), np.array([6, 6]), np.array([2])),
     r"ctc: label_lengths must be one length per sequence, \[2\]"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.ones((2, 2)), np.array([6, 6]), np.array([2, 2])),
     r"ctc: labels must be integers.*labels.astype\(jnp.int32\)"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.ones((2, 2), np.int32), np.array([6, 7]), np.array([2, 2])),
     r"ctc: input_lengths\[1\] is 7, outside 0 .. 6 \(the logits' time axis\)"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.array([[1, 2], [3, 0]]), np.array([6, 6]), np.array([2, 2])),
     r"ctc: labels\[\[1, 1\]\] is 0, within label_lengths but the blank"),
    (lambda: ft.losses.ctc(np.zeros((2, 6, 5), np.float32), np.ones((2, 2), np.int32), np.array([6, 6]), np.array([2, 2]),
                           blank=5), r"ctc: blank must be a class, 0 .. 4, got 5"),
]


@pytest.mark.parametrize("call, message", ERRORS, ids=[f"error{i}" for i in range(len(ERRORS))])
def test_each_error_names_the_problem_and_the_fix(call, message):
    """Every input error of the new losses: what is wrong (the key values, shapes and dtypes)
    and the call that fixes it."""
    with pytest.raises((ValueError, TypeError), match=f"(?s){message}"):
        call()


# (ours, torch's, arrays, which get a gradient): each input sits exactly on its loss's kink
AT_THE_KINK = [
    ("margin_ranking-tie", lambda a, b, y: ft.losses.margin_ranking(a, b, y, margin=0.0, reduction="sum"),
     lambda a, b, y: F.margin_ranking_loss(a, b, y, margin=0.0, reduction="sum"),
     (np.array([1.0, 2.0]), np.array([1.0, 2.0]), np.array([1.0, -1.0])), (0, 1)),
    ("hinge_embedding-at-margin", lambda a, y: ft.losses.hinge_embedding(a, y, margin=1.0, reduction="sum"),
     lambda a, y: F.hinge_embedding_loss(a, y, margin=1.0, reduction="sum"),
     (np.array([1.0, 0.5]), np.array([-1.0, -1.0])), (0,)),
    ("triplet_margin-at-margin", lambda a, b, c: ft.losses.triplet_margin(a, b, c, margin=1.0, eps=0.0, reduction="sum"),
     lambda a, b, c: F.triplet_margin_loss(a, b, c, margin=1.0, eps=0.0, reduction="sum"),
     (np.array([[0.0, 0.0]]), np.array([[1.0, 0.0]]), np.array([[2.0, 0.0]])), (0, 1, 2)),
    ("triplet_margin_with_distance-at-margin",
     lambda a, b, c: ft.losses.triplet_margin_with_distance(
         a, b, c, distance=lambda u, v: jnp.sum(jnp.square(u - v), -1), margin=3.0, reduction="sum"),
     lambda a, b, c: F.triplet_margin_with_distance_loss(
         a, b, c, distance_function=lambda u, v: (u - v).square().sum(-1), margin=3.0, reduction="sum"),
     (np.array([[0.0, 0.0]]), np.array([[1.0, 0.0]]), np.array([[2.0, 0.0]])), (0, 1, 2)),
    ("cosine_embedding-at-margin", lambda a, b, y: ft.losses.cosine_embedding(a, b, y, margin=0.0, reduction="sum"),
     lambda a, b, y: F.cosine_embedding_loss(a, b, y, margin=0.0, reduction="sum"),
     (np.array([[1.0, 0.0]]), np.array([[0.0, 1.0]]), np.array([-1.0])), (0, 1)),
    ("cosine_embedding-zero-vector", lambda a, b, y: ft.losses.cosine_embedding(a, b, y, reduction="sum"),
     lambda a, b, y: F.cosine_embedding_loss(a, b, y, reduction="sum"),
     (np.array([[0.0, 0.0]]), np.array([[0.0, 1.0]]), np.array([1.0])), (0, 1)),
    ("l1-zero-error", lambda a, b: ft.losses.l1(a, b, reduction="sum"), lambda a, b: F.l1_loss(a, b, reduction="sum"),
     (np.array([1.0, 2.0]), np.array([1.0, 3.0])), (0, 1)),
    ("mean_absolute_error-zero-error", lambda a, b: ft.losses.mean_absolute_error(a, b),
     lambda a, b: F.l1_loss(a, b), (np.array([0.0, 2.0]), np.array([0.0, 3.0])), (0, 1)),
]


@pytest.mark.parametrize("ours, theirs, arrays, grads", [c[1:] for c in AT_THE_KINK], ids=[c[0] for c in AT_THE_KINK])
def test_gradients_at_the_kink_are_torchs(ours, theirs, arrays, grads):
    """torch's clamp_min passes the gradient at the margin (relu's was 0: tied scores with
    margin 0 never learned), its |x| has the derivative 0 at 0 (jnp.abs's was 1), and its
    cosine adds the float 1e-12 (9.99999996e-13) to each squared norm (a zero vector's
    gradient, ~1e6, differed by 2e-9 of it)."""
    tensors = [torch.tensor(a, requires_grad=i in grads) for i, a in enumerate(arrays)]
    theirs(*tensors).backward()
    with jax.enable_x64(True):
        got = jax.grad(lambda *d: ours(*[d[grads.index(i)] if i in grads else a for i, a in enumerate(arrays)]),
                       argnums=tuple(range(len(grads))))(*[arrays[i] for i in grads])
    for i, g in zip(grads, got, strict=True):
        want = tensors[i].grad.numpy()
        np.testing.assert_allclose(np.asarray(g), want, rtol=0, atol=RTOL * max(1.0, np.abs(want).max()))
