"""qlab.sparse (meProp top-k sparse back-propagation) and its training integration.

References, never the code under test: plain nn.Linear autograd (dense gradients), float64
arithmetic written out here (dy masked by hand → dx = dy·W, dW = dyᵀ·x, db = Σ dy), index sets
chosen here in Python from column sums / row magnitudes of hand-made tensors, torch.topk on
hand-made tensors, masks typed in by hand, and fractions worked out by hand (fractions.Fraction).

Exact comparisons (torch.equal) wherever the same ops run in the same order (k = all, which must be
the dense layer bit for bit; max_child, whose winner is the dense gradient). Tolerances only where
GEMM shapes differ (a gathered (N × k)·(k × I) GEMM vs a full (N × M)·(M × I) one over a masked dy
sums in a different order, sparse GEMMs in another): rtol 1e-5, atol 1e-6 in fp32, stated where used.

Regression tests for two bugs found while writing these: topk under bf16 autocast (which
TrainConfig allows) crashed in backward, and sparsify_model left a Linear registered under a second
name dense (quantize_model converts every name).
"""

from __future__ import annotations

import copy
import math
from fractions import Fraction

import pytest
import torch
from torch import nn

from qlab import sparse
from qlab.probes import ProbeSet
from qlab.sparse import GradientMask, TopKLinear, mask_gradients, resolve_k, sparsify_model, topk_mask
from qlab.train import TrainConfig, build_model, train
from qlab.train.models import MLP, CharGPT

FP32 = dict(rtol=1e-5, atol=1e-6)  # fp32 GEMMs of different shapes sum in different orders


# --- helpers ---------------------------------------------------------------------------------------------


def _linear(in_features, out_features, bias=True, seed=0):
    torch.manual_seed(seed)
    return nn.Linear(in_features, out_features, bias=bias)


def _topk_copy(reference: nn.Linear, k, mode="shared", variant="topk") -> TopKLinear:
    """A TopKLinear with the reference's values (copied through the state dict, not shared)."""
    layer = TopKLinear(
        reference.in_features,
        reference.out_features,
        bias=reference.bias is not None,
        k=k,
        mode=mode,
        variant=variant,
    )
    layer.load_state_dict(reference.state_dict())
    return layer


def _grads(module: nn.Module, x: torch.Tensor, dy: torch.Tensor):
    """(dx, dW, db) of ``module`` (a Linear, or a container whose only parameters are one Linear's)
    for output gradient ``dy``; db is None without a bias."""
    module.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_(True)
    module(x).backward(dy)
    linear = (
        module
        if isinstance(module, nn.Linear)
        else next(m for m in module.modules() if isinstance(m, nn.Linear))
    )
    return x.grad, linear.weight.grad, None if linear.bias is None else linear.bias.grad


def _distinct_columns_dy(shape, seed=0):
    """dy whose column sums of |dy| are far apart: column m's magnitudes are (base[m] + [0, 0.1)) / M,
    base a random permutation of 1..M, random signs. Any float summation order ranks them alike;
    magnitudes ≤ 1.1 keep fp32 rounding of cancelling sums well inside atol 1e-6."""
    generator = torch.Generator().manual_seed(seed)
    features = shape[-1]
    base = torch.randperm(features, generator=generator).float() + 1
    magnitude = (base + 0.1 * torch.rand(shape, generator=generator)) / features
    sign = torch.where(torch.rand(shape, generator=generator) < 0.5, -1.0, 1.0)
    return sign * magnitude


def _shared_idx(dy: torch.Tensor, k: int) -> list[int]:
    """The k features with the largest Σ|dy| (over all leading dims), by a Python sort in float64."""
    rows = dy.double().reshape(-1, dy.shape[-1])
    sums = [sum(abs(v) for v in rows[:, m].tolist()) for m in range(rows.shape[1])]
    return sorted(sorted(range(len(sums)), key=lambda m: -sums[m])[:k])


def _row_mask(dy: torch.Tensor, k: int) -> torch.Tensor:
    """Each row's own k largest |dy|, picked by a Python sort (random dy: no ties)."""
    rows = dy.reshape(-1, dy.shape[-1]).tolist()
    mask = torch.zeros(len(rows), dy.shape[-1], dtype=torch.bool)
    for n, row in enumerate(rows):
        for m in sorted(range(len(row)), key=lambda m: -abs(row[m]))[:k]:
            mask[n, m] = True
    return mask


def _reference64(x, weight, bias, dy_masked):
    """float64 gradients of y = x·Wᵀ + b for a given (masked) output gradient, from first principles."""
    x2 = x.double().reshape(-1, x.shape[-1])
    d2 = dy_masked.double().reshape(-1, dy_masked.shape[-1])
    dx = (d2 @ weight.detach().double()).reshape(x.shape)
    dw = d2.T @ x2
    db = d2.sum(0) if bias is not None else None
    return dx, dw, db


def _assert_close64(actual, expected):
    if expected is None:
        assert actual is None
        return
    torch.testing.assert_close(actual.double(), expected, **FP32)


# --- 1. k resolution and the errors -------------------------------------------------------------------


@pytest.mark.parametrize(
    "k, features, count",
    [
        (0.05, 500, 25),  # 0.05·500 = 25.000000000000004 in binary: rounds to 25
        (0.16, 500, 80),
        (0.25, 8, 2),
        (0.99, 10, 10),  # 9.9 rounds up to all
        (1e-6, 500, 1),  # a tiny fraction still keeps one feature
        (0.01, 3, 1),
        (1.0, 500, 500),  # 1.0 = all
        (1.0, 1, 1),
        (1, 500, 1),  # counts pass through
        (25, 500, 25),
        (500, 500, 500),
        (7, 7, 7),
    ],
)
def test_resolve_k(k, features, count):
    assert resolve_k(k, features) == count


@pytest.mark.parametrize(
    "k, features, expected_words",
    [
        (0, 500, ("at least 1", "got 0")),
        (-3, 500, ("at least 1", "got -3")),
        (501, 500, ("larger than the feature count", "501", "500")),
        (0.0, 500, ("(0, 1]", "got 0.0")),
        (1.5, 500, ("(0, 1]", "got 1.5")),
        (-0.1, 500, ("(0, 1]", "got -0.1")),
        (float("nan"), 500, ("(0, 1]", "nan")),
    ],
)
def test_resolve_k_value_errors(k, features, expected_words):
    with pytest.raises(ValueError) as error:
        resolve_k(k, features)
    for words in expected_words:
        assert words in str(error.value)


@pytest.mark.parametrize("k", [True, False, "3", None, [2]])
def test_resolve_k_type_errors(k):
    with pytest.raises(TypeError, match="int count or a float fraction") as error:
        resolve_k(k, 10)
    assert repr(k) in str(error.value)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: TopKLinear(8, 4, k=0), "at least 1"),
        (lambda: TopKLinear(8, 4, k=5), "larger than the feature count 4"),
        (lambda: TopKLinear(8, 4, k=1.5), r"\(0, 1\]"),
        (lambda: TopKLinear(8, 4, k=2, mode="columns"), "unknown mode"),
        (lambda: TopKLinear(8, 4, k=2, variant="max"), "unknown variant"),
        (lambda: mask_gradients(nn.Sequential(nn.Linear(8, 4)), 0), "at least 1"),
        (lambda: mask_gradients(nn.Sequential(nn.Linear(8, 4)), 2, mode="columns"), "unknown mode"),
        (lambda: topk_mask(torch.ones(2, 4), 0), "at least 1"),
        (lambda: topk_mask(torch.ones(2, 4), 2, mode="columns"), "unknown mode"),
        (lambda: TrainConfig(task="digits", topk=0), "at least 1"),
        (lambda: TrainConfig(task="digits", topk=1.5), r"\(0, 1\]"),
        (lambda: TrainConfig(task="digits", topk=4, topk_mode="bogus"), "unknown topk_mode 'bogus'"),
        (lambda: TrainConfig(task="digits", topk=4, recipe="mxfp8"), "unquantized.*'mxfp8'"),
        (lambda: TrainConfig(task="digits", optimizer="lion"), "unknown optimizer"),
    ],
)
def test_constructors_refuse_bad_k_and_modes(make, match):
    with pytest.raises(ValueError, match=match):
        make()


@pytest.mark.parametrize("changes", [dict(topk=True), dict(topk="4"), dict(topk_keep=3)])
def test_train_config_type_errors(changes):
    with pytest.raises(TypeError):
        TrainConfig(task="digits", **changes)


# --- 2. topk_mask on hand-made tensors ----------------------------------------------------------------

# distinct magnitudes; column sums of |g|: 3.6, 5.8, 9.4, 7.8, 6.55
G = torch.tensor([[0.1, -5.0, 2.0, -0.3, 4.0], [-3.0, 0.2, -0.4, 1.0, -2.5], [0.5, 0.6, -7.0, 6.5, -0.05]])
T, F_ = True, False


@pytest.mark.parametrize(
    "k, mode, expected",
    [
        # row: each row's own largest |g|: row 0 → cols 1, 4; row 1 → 0, 4; row 2 → 2, 3
        (2, "row", [[F_, T, F_, F_, T], [T, F_, F_, F_, T], [F_, F_, T, T, F_]]),
        (1, "row", [[F_, T, F_, F_, F_], [T, F_, F_, F_, F_], [F_, F_, T, F_, F_]]),
        (3, "row", [[F_, T, T, F_, T], [T, F_, F_, T, T], [F_, T, T, T, F_]]),
        # shared: columns 2 (9.4) and 3 (7.8) in every row, though rows 0 and 1 would pick others
        (2, "shared", [[F_, F_, T, T, F_]] * 3),
        (1, "shared", [[F_, F_, T, F_, F_]] * 3),
        (3, "shared", [[F_, F_, T, T, T]] * 3),  # + column 4 (6.55) over column 1 (5.8)
        (0.4, "shared", [[F_, F_, T, T, F_]] * 3),  # 0.4·5 = 2
        (5, "row", [[T] * 5] * 3),
        (1.0, "shared", [[T] * 5] * 3),
    ],
)
def test_topk_mask_by_hand(k, mode, expected):
    expected = torch.tensor(expected)
    assert torch.equal(topk_mask(G, k, mode), expected)
    # leading dims are flattened into rows: (3, 1, 5) gives the same mask, shaped like the input
    assert torch.equal(topk_mask(G.reshape(3, 1, 5), k, mode), expected.reshape(3, 1, 5))
    # the mask depends on magnitudes only
    assert torch.equal(topk_mask(-G, k, mode), expected)


def test_topk_mask_row_mode_matches_torch_topk_per_row():
    generator = torch.Generator().manual_seed(3)
    g = torch.randn(6, 10, generator=generator)
    expected = torch.zeros(6, 10, dtype=torch.bool)
    for n in range(6):
        expected[n, torch.topk(g[n].abs(), 4).indices] = True
    assert torch.equal(topk_mask(g, 4, "row"), expected)
    assert (topk_mask(g, 4, "row").sum(1) == 4).all()


def test_topk_mask_shared_mode_sums_over_batch_and_tokens():
    # (2 batches, 2 tokens, 4 features): per token the winner is always a different column,
    # but the sums over all four rows are 1.0+0.1+0.1+0.1 = 1.3 (col 0) < 0.9·2 = 1.8 (col 3)
    g = torch.tensor(
        [[[1.0, 0.0, 0.0, 0.9], [0.1, 0.0, 0.0, 0.9]], [[0.1, 0.0, 0.0, 0.0], [0.1, 0.5, 0.0, 0.0]]]
    )
    assert torch.equal(topk_mask(g, 1, "shared"), torch.tensor([F_, F_, F_, T]).expand(2, 2, 4))


# --- 3. k = all is the dense layer, bit for bit -----------------------------------------------------


@pytest.mark.parametrize("how", ["topk_shared", "topk_row", "hook_shared", "hook_row"])
@pytest.mark.parametrize("shape", [(5, 8), (2, 3, 8)])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("k", [1.0, 6])
def test_k_all_is_dense_bit_for_bit(how, shape, bias, k):
    reference = _linear(8, 6, bias)
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=generator)
    dy = torch.randn(*shape[:-1], 6, generator=generator)
    expected = _grads(reference, x, dy)
    kind, mode = how.split("_")
    if kind == "topk":
        actual = _grads(_topk_copy(reference, k, mode), x, dy)
    else:
        model = nn.Sequential(_linear(8, 6, bias))
        with mask_gradients(model, k, mode=mode):
            actual = _grads(model, x, dy)
    for got, want in zip(actual, expected):
        if want is None:
            assert got is None
        else:
            assert torch.equal(got, want)


# --- 4. gathered GEMMs = hook masking with the shared index set ----------------------------------------


@pytest.mark.parametrize("k", [1, 3, 0.5])
@pytest.mark.parametrize("shape", [(7, 5), (2, 4, 5)])
@pytest.mark.parametrize("bias", [True, False])
def test_shared_topk_linear_equals_hook_masking_and_float64(k, shape, bias):
    M = 8
    count = {1: 1, 3: 3, 0.5: 4}[k]  # by hand: 0.5·8 = 4
    reference = _linear(shape[-1], M, bias, seed=2)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    dy = _distinct_columns_dy((*shape[:-1], M), seed=7)
    idx = _shared_idx(dy, count)
    assert len(idx) == count

    gathered = _grads(_topk_copy(reference, k, "shared"), x, dy)
    hooked_model = nn.Sequential(_linear(shape[-1], M, bias, seed=2))
    with mask_gradients(hooked_model, k, mode="shared"):
        hooked = _grads(hooked_model, x, dy)

    # gathered vs hook-masked: fp32 tolerance (GEMMs of different shapes, see FP32)
    for a, b in zip(gathered, hooked):
        if b is None:
            assert a is None
        else:
            torch.testing.assert_close(a, b, **FP32)

    # only rows idx of dW (entries idx of db) are non-zero; x has no zeros, so those are all non-zero
    rows = torch.zeros(M, dtype=torch.bool)
    rows[idx] = True
    for _, dw, db in (gathered, hooked):
        assert (dw[~rows] == 0).all() and (dw[rows] != 0).all()
        if bias:
            assert (db[~rows] == 0).all() and (db[rows] != 0).all()

    # float64 from first principles: dx = dy[:, idx]·W[idx], dW[idx] = dy[:, idx]ᵀ·x, db[idx] = Σ dy[:, idx]
    d2 = dy.double().reshape(-1, M)
    x2 = x.double().reshape(-1, shape[-1])
    w = reference.weight.detach().double()
    dx64 = (d2[:, idx] @ w[idx]).reshape(shape)
    dw64 = torch.zeros(M, shape[-1], dtype=torch.float64)
    dw64[idx] = d2[:, idx].T @ x2
    db64 = None
    if bias:
        db64 = torch.zeros(M, dtype=torch.float64)
        db64[idx] = d2[:, idx].sum(0)
    for grads in (gathered, hooked):
        for got, want in zip(grads, (dx64, dw64, db64)):
            _assert_close64(got, want)  # fp32 result vs float64 reference: FP32 tolerance


# --- 5. row mode (sparse tensors) vs the float64 per-row-masked reference ----------------------------


@pytest.mark.parametrize("k", [1, 3, 0.25])
@pytest.mark.parametrize("shape", [(9, 6), (3, 4, 6)])
@pytest.mark.parametrize("bias", [True, False])
def test_row_mode_equals_float64_reference_and_hook_masking(k, shape, bias):
    M = 12
    count = k if isinstance(k, int) else 3  # 0.25·12 = 3, by hand
    reference = _linear(shape[-1], M, bias, seed=4)
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=generator)
    dy = torch.randn(*shape[:-1], M, generator=generator)
    mask = _row_mask(dy, count).reshape(dy.shape)
    expected = _reference64(x, reference.weight, reference.bias, dy * mask)

    sparse = _grads(_topk_copy(reference, k, "row"), x, dy)
    hooked_model = nn.Sequential(_linear(shape[-1], M, bias, seed=4))
    with mask_gradients(hooked_model, k, mode="row"):
        hooked = _grads(hooked_model, x, dy)

    for grads in (sparse, hooked):
        for got, want in zip(grads, expected):
            _assert_close64(got, want)  # fp32 vs float64: FP32 tolerance
    for a, b in zip(sparse, hooked):
        if b is not None:
            torch.testing.assert_close(a, b, **FP32)  # sparse vs dense-masked GEMMs: different sum order
    # dW rows (db entries) of features no row kept are exactly zero; the others are not
    hit = mask.reshape(-1, M).any(0)
    assert (sparse[1][~hit] == 0).all() and (sparse[1][hit] != 0).all()
    if bias:
        assert (sparse[2][~hit] == 0).all() and (sparse[2][hit] != 0).all()


# --- 6. max_child: only the largest-L1 gradient goes on ----------------------------------------------


@pytest.mark.parametrize(
    "winner, x_scale, w_scale, bias",
    [
        # N = 4, I = 3, O = 5, dy = 1 + [0, 1): L1(dx) ~ N·I·O·w, L1(dW) ~ N·I·O·x, L1(db) ~ N·O
        ("x", 1e-3, 10.0, True),
        ("w", 10.0, 1e-3, True),
        ("b", 1e-3, 1e-3, True),
        ("x", 1e-3, 10.0, False),
        ("w", 10.0, 1e-3, False),
    ],
)
def test_max_child_keeps_exactly_the_largest_gradient(winner, x_scale, w_scale, bias):
    generator = torch.Generator().manual_seed(13)
    reference = nn.Linear(3, 5, bias=bias)
    with torch.no_grad():
        reference.weight.copy_(w_scale * (1 + torch.rand(5, 3, generator=generator)))
        if bias:
            reference.bias.copy_(torch.rand(5, generator=generator))
    x = x_scale * (1 + torch.rand(4, 3, generator=generator))
    dy = 1 + torch.rand(4, 5, generator=generator)
    dense = _grads(reference, x, dy)
    norms = {
        "x": dense[0].double().abs().sum(),
        "w": dense[1].double().abs().sum(),
        "b": dense[2].double().abs().sum() if bias else -1.0,
    }
    assert max(norms, key=norms.get) == winner  # the hand-crafted scales do pick this winner

    got = _grads(_topk_copy(reference, 1.0, variant="max_child"), x, dy)
    for name, g, d in zip("xwb", got, dense):
        if d is None:
            assert g is None
        elif name == winner:
            assert torch.equal(g, d)  # same mm / sum as nn.Linear's backward: bit for bit
        else:
            assert torch.equal(g, torch.zeros_like(d))


# --- 7. sparsify_model -----------------------------------------------------------------------------------


def _check_sparsified(model, k, keep, expected_names, inputs):
    before = model(inputs).detach()
    linears = {name: m for name, m in model.named_modules() if type(m) is nn.Linear}
    params = {name: (id(m.weight), None if m.bias is None else id(m.bias)) for name, m in linears.items()}
    names = sparsify_model(model, k, keep=keep)
    assert names == expected_names
    for name in linears:
        module = model.get_submodule(name)
        if name in expected_names:
            assert isinstance(module, TopKLinear)
            # the Parameter objects themselves, not copies
            assert (id(module.weight), None if module.bias is None else id(module.bias)) == params[name]
        else:
            assert type(module) is nn.Linear
    assert torch.equal(model(inputs), before)  # forward unchanged


def test_sparsify_mlp_keeps_patterns():
    torch.manual_seed(0)
    model = MLP(8, (16, 12), 4)
    inputs = torch.randn(5, 8)
    _check_sparsified(model, 0.25, ["layers.2"], ["layers.0", "layers.1"], inputs)
    model.zero_grad()
    model(inputs).sum().backward()  # layers.0: 16 outputs, k = 0.25 → 4 rows of dW
    assert int(model.layers[0].weight.grad.abs().sum(1).ne(0).sum()) == 4


@pytest.mark.parametrize(
    "keep, expected",
    [
        (
            ["head"],
            [
                f"blocks.{i}.{leaf}"
                for i in (0, 1)
                for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
            ],
        ),
        (
            ["head", "blocks.0.*"],
            [f"blocks.1.{leaf}" for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")],
        ),
        (
            "head",
            [
                f"blocks.{i}.{leaf}"
                for i in (0, 1)
                for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")
            ],
        ),
        (
            (),
            [f"blocks.{i}.{leaf}" for i in (0, 1) for leaf in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]
            + ["head"],
        ),
    ],
)
def test_sparsify_chargpt(keep, expected):
    torch.manual_seed(0)
    model = CharGPT(11, context=8, layers=2, width=16, heads=2, tied_head=False)
    ids = torch.randint(0, 11, (2, 8), generator=torch.Generator().manual_seed(1))
    _check_sparsified(model, 0.25, keep, expected, ids)


def test_sparsify_replaces_a_shared_linear_under_every_name():
    shared = nn.Linear(4, 4)
    model = nn.Module()
    model.a, model.b = shared, shared
    assert sorted(sparsify_model(model, 2)) == ["a", "b"]
    assert isinstance(model.b, TopKLinear) and model.a is model.b


# --- 8. GradientMask ------------------------------------------------------------------------------------


def _setup_one_layer(M=8, seed=0):
    model = nn.Sequential(_linear(5, M, seed=seed))
    reference = _linear(5, M, seed=seed)
    generator = torch.Generator().manual_seed(seed + 100)
    return model, reference, torch.randn(6, 5, generator=generator), torch.randn(6, M, generator=generator)


def _nonzero_rows(weight_grad):
    return int(weight_grad.ne(0).any(1).sum())


def test_gradient_mask_remove_restores_dense():
    model, reference, x, dy = _setup_one_layer()
    dense = _grads(reference, x, dy)
    mask = mask_gradients(model, 2)
    masked = _grads(model, x, dy)
    assert _nonzero_rows(masked[1]) == 2
    mask.remove()
    for got, want in zip(_grads(model, x, dy), dense):
        assert torch.equal(got, want)


def test_gradient_mask_context_manager():
    model, reference, x, dy = _setup_one_layer()
    dense = _grads(reference, x, dy)
    with GradientMask(model, 3) as mask:
        assert isinstance(mask, GradientMask)
        assert _nonzero_rows(_grads(model, x, dy)[1]) == 3
    for got, want in zip(_grads(model, x, dy), dense):
        assert torch.equal(got, want)


@pytest.mark.parametrize(
    "k, M, mode, fraction",
    [
        (2, 8, "shared", Fraction(2, 8)),
        (0.25, 8, "shared", Fraction(2, 8)),
        (3, 6, "shared", Fraction(3, 6)),
        (2, 8, "row", Fraction(2, 8)),
        (8, 8, "shared", Fraction(1)),  # k = all passes dy untouched, fraction 1
    ],
)
def test_gradient_mask_fractions(k, M, mode, fraction):
    model, _, x, dy = _setup_one_layer(M)
    with mask_gradients(model, k, mode=mode) as mask:
        _grads(model, x, dy)
        _grads(model, x, dy)
    assert mask.fractions == [float(fraction)] * 2  # dyadic fractions: exact in float32 too


def test_gradient_mask_fraction_of_a_non_dyadic_share():
    model, _, x, dy = _setup_one_layer(6)
    with mask_gradients(model, 2) as mask:
        _grads(model, x, dy)
    # recorded as a float32 mean of the mask: 1/3 to float32 precision (rel 1e-7), not the float64 1/3
    assert mask.fractions == [pytest.approx(1 / 3, rel=1e-7)]


def test_gradient_mask_patterns_select_modules():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 8))
    x = torch.randn(6, 5, requires_grad=True)
    with pytest.raises(ValueError, match="match no module"):
        mask_gradients(model, 2, modules=["blocks.*"])
    with mask_gradients(model, 2, modules="2") as mask:
        model(x).sum().backward()
    assert list(mask.selected) == ["2"]
    assert _nonzero_rows(model[2].weight.grad) == 2
    assert _nonzero_rows(model[0].weight.grad) == 8  # dy of layer 0 = W2ᵀ·(masked dy): dense again


@pytest.mark.parametrize("probes_first", [False, True])
def test_gradient_mask_composes_with_probes(probes_first):
    model, _, x, dy = _setup_one_layer(8)
    k = 2
    if probes_first:
        probes = ProbeSet(model, roles=("grad_output",)).attach()
        mask = mask_gradients(model, k)
    else:
        mask = mask_gradients(model, k)
        probes = ProbeSet(model, roles=("grad_output",)).attach()
    try:
        _grads(model, x, dy)
    finally:
        probes.detach()
        mask.remove()
    frame = probes.to_frame()
    stats = frame[frame.module == "0"].set_index("stat")["value"]
    assert stats["zero_fraction"] == 1 - k / 8  # 0.75, exact
    idx = _shared_idx(dy, k)
    l1 = sum(abs(v) for v in dy.double()[:, idx].flatten().tolist())
    assert stats["l1"] == pytest.approx(l1, rel=1e-12)  # float64 sums in different orders
    # the Sequential around it sees the gradient before the inner layer's mask: dense
    outer = frame[frame.module == "model"].set_index("stat")["value"]
    assert outer["zero_fraction"] == 0.0


# --- 9. training integration -----------------------------------------------------------------------------

RUN = dict(
    task="digits",
    hidden=[64],
    steps=20,
    batch_size=32,
    optimizer="sgd",
    track_updates=True,
    progress=False,
    eval_every=10,
    weight_decay=0.0,
    lr=0.1,
)
# hidden layer: 4 of 64 output rows × 64 inputs; last layer (kept dense by "last_layer"): 10 × 64
BOUND = Fraction(4 * 64 + 10 * 64, 64 * 64 + 10 * 64)


@pytest.fixture(scope="module")
def sparse_run():
    return train(TrainConfig(**RUN, topk=4))


def test_train_topk_update_footprint(sparse_run):
    model = sparse_run.model
    assert type(model.layers[0]) is TopKLinear and model.layers[0].count == 4
    assert type(model.layers[1]) is nn.Linear
    metrics = sparse_run.metrics
    assert len(metrics) == 20
    for row in metrics.itertuples():
        assert 0 < row.grad_nonzero_fraction <= float(BOUND)
        # plain SGD without decay moves only entries with a gradient (1e-12: float rounding of the ratio)
        assert row.updated_fraction <= row.grad_nonzero_fraction + 1e-12
        assert row.updated_fraction > 0
    assert metrics.train_loss.map(math.isfinite).all()


def test_train_dense_footprint_is_far_above_the_sparse_bound():
    dense = train(TrainConfig(**RUN))
    assert type(dense.model.layers[0]) is nn.Linear
    assert (dense.metrics.grad_nonzero_fraction > 2 * float(BOUND)).all()


def test_build_model_topk_keep():
    config = TrainConfig(task="digits", hidden=[64], topk=4, progress=False)
    model = build_model(config)
    assert [type(layer) for layer in model.layers] == [TopKLinear, nn.Linear]
    model = build_model(config.replace(topk_keep=[]))
    assert [type(layer) for layer in model.layers] == [TopKLinear, TopKLinear]
    model = build_model(config.replace(topk_keep=["layers.0"]))  # a plain pattern; "last_layer" not named
    assert [type(layer) for layer in model.layers] == [nn.Linear, TopKLinear]


# topk under autocast: the backward GEMMs run in dy's (autocast) dtype; TrainConfig allows bf16 with topk


@pytest.mark.parametrize("mode", ["shared", "row"])
def test_topk_linear_backward_under_bf16_autocast(mode):
    reference = _linear(8, 6)
    layer = _topk_copy(reference, 2, mode)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and layer.weight.grad.dtype == torch.float32


@pytest.mark.parametrize("changes", [dict(recipe="bf16"), dict(autocast="bf16")])
def test_train_topk_with_bf16(changes):
    result = train(TrainConfig(**{**RUN, "steps": 1}, topk=4, **changes))
    assert math.isfinite(result.metrics.train_loss.iloc[0])


def test_fidelity_of_a_topk_model_is_measured_against_the_dense_gradient():
    # the reference must be plain nn.Linear layers; top-k layers in both copies would report perfection
    from qlab.train import TrainConfig, build_model, gradient_fidelity

    model = build_model(TrainConfig(task="digits", hidden=[32, 32], topk=0.1, progress=False))
    torch.manual_seed(0)
    x, y = torch.rand(16, 64), torch.randint(0, 10, (16,))
    rows = {row["layer"]: row for row in gradient_fidelity(model, x, y)}
    dense = copy.deepcopy(model)
    for name in ("layers.0", "layers.1"):
        layer = dense.get_submodule(name)
        plain = nn.Linear(layer.in_features, layer.out_features)
        plain.weight, plain.bias = layer.weight, layer.bias
        dense.layers[int(name[-1])] = plain
    nn.functional.cross_entropy(dense(x), y).backward()
    model.zero_grad()
    nn.functional.cross_entropy(model(x), y).backward()
    for name in ("layers.0", "layers.1"):
        g, g_ref = (
            model.get_submodule(name).weight.grad.double(),
            dense.get_submodule(name).weight.grad.double(),
        )
        assert rows[name]["quantized"] is True  # "not a plain nn.Linear"
        assert rows[name]["relative_error"] > 0.1
        assert rows[name]["relative_error"] == pytest.approx(
            ((g - g_ref).norm() / g_ref.norm()).item(), rel=1e-9
        )


def test_max_child_only_lets_needed_gradients_compete():
    # a first layer: x needs no gradient, so dx (here by far the largest) must not win and zero dW, db
    layer = TopKLinear(4, 3, variant="max_child")
    with torch.no_grad():
        layer.weight.mul_(100.0)
    x = 1e-3 * torch.randn(5, 4)
    layer(x).backward(torch.ones(5, 3))
    dense_w = torch.ones(5, 3).T @ x
    dense_b = torch.ones(5, 3).sum(0)
    winner_is_bias = dense_b.abs().sum() > dense_w.abs().sum()
    assert winner_is_bias
    assert torch.equal(layer.bias.grad, dense_b) and not layer.weight.grad.any()


@pytest.mark.parametrize("timed", ["backward", "step"])
def test_pass_seconds_leave_the_model_as_it_was(timed):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    before = [p.detach().clone() for p in model.parameters()]
    x, dy = torch.randn(6, 8, requires_grad=True), torch.randn(6, 4)
    for variant in sparse.BACKWARDS:
        seconds = sparse.pass_seconds(model, x, dy, variant, 0.5, keep=["2"], repeats=3, timed=timed)
        assert len(seconds) == 3 and all(s > 0 for s in seconds)
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))  # a "step" ran on a copy
    assert all(not m._backward_pre_hooks and not m._backward_hooks for m in model.modules())
    assert isinstance(model[0], nn.Linear) and type(model[0]) is nn.Linear
    layer = nn.Linear(8, 8)  # a bare layer is wrapped, not swapped: its weights must not move either
    weight = layer.weight.detach().clone()
    for variant in sparse.BACKWARDS:
        sparse.pass_seconds(layer, x, torch.randn(6, 8), variant, 0.5, repeats=2, timed=timed)
    assert torch.equal(layer.weight, weight)


def test_time_ratios_are_the_quantiles_of_every_pair_of_repeats():
    # times 2, 4 over reference 1, 2: ratios 2, 1, 4, 2 -> sorted 1, 2, 2, 4; linear quantiles at
    # positions 3q: q25 = 1 + 0.75·(2 − 1), median = 2, q75 = 2 + 0.25·(4 − 2)
    assert sparse.time_ratios([2.0, 4.0], [1.0, 2.0]) == {"ratio": 2.0, "q25": 1.75, "q75": 2.5}
    assert sparse.time_ratios([3.0], [4.0]) == {"ratio": 0.75, "q25": 0.75, "q75": 0.75}
    for bad in ([], [0.0], [1.0, math.nan]):
        with pytest.raises(ValueError, match="times must be"):
            sparse.time_ratios(bad, [1.0])
    with pytest.raises(TypeError, match="reference must be a sequence"):
        sparse.time_ratios([1.0], 2.0)


def _digits_split_by_hand(seed: int):
    """scikit-learn's digits, pixels / 16, the first 359 (20 %) of a permutation seeded with ``seed``
    held out: the split qlab.train.data.digits documents, built here from sklearn's arrays."""
    from sklearn.datasets import load_digits

    images, labels = load_digits(return_X_y=True)
    order = torch.randperm(len(labels), generator=torch.Generator().manual_seed(seed))
    held_out = order[: round(0.2 * len(labels))]
    return torch.tensor(images, dtype=torch.float32)[held_out] / 16, torch.tensor(labels)[held_out]


def test_train_digits_validates_on_the_chosen_split_and_leaves_train_on_split_0():
    from qlab.train import data

    config = TrainConfig(task="digits", hidden=[8], steps=2, batch_size=8, warmup_steps=1, eval_every=2,
                         progress=False, device="cpu")  # fmt: skip
    original = data.digits
    result = sparse.train_digits(config, 3)
    assert data.digits is original  # the split is bound for the run only
    x, y = _digits_split_by_hand(3)
    with torch.no_grad():
        logits = result.model(x)
    last = result.metrics.iloc[-1]
    assert last.val_loss == pytest.approx(nn.functional.cross_entropy(logits, y).item(), rel=1e-6)
    assert last.val_accuracy == pytest.approx((logits.argmax(-1) == y).double().mean().item(), abs=1e-12)
    x0, y0 = _digits_split_by_hand(0)
    with torch.no_grad():
        other = nn.functional.cross_entropy(result.model(x0), y0).item()
    assert abs(other - last.val_loss) > 1e-4  # the split matters: split 0 would read differently
    # split 0 is the one train uses by itself: the same run, the same numbers
    plain = train(config).metrics.drop(columns="time_s")
    assert plain.equals(sparse.train_digits(config, 0).metrics.drop(columns="time_s"))
    with pytest.raises(ValueError, match="digits task"):
        sparse.train_digits(TrainConfig(progress=False), 0)


def test_a_gradient_mask_that_keeps_every_module_says_so_not_that_nothing_matched():
    from qlab.sparse import GradientMask

    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
    with pytest.raises(
        ValueError, match=r"keep \['\*'\] keeps every one of the 2 modules .* nothing is left"
    ):
        GradientMask(model, 0.5, keep=["*"])
    with pytest.raises(ValueError, match="match no module of the model"):
        GradientMask(model, 0.5, modules=[torch.nn.Conv1d])


# --- 10. 16-bit row mode, infinite gradient entries, argument errors ----------------------------------------


@pytest.mark.parametrize("dtype, unit", [(torch.bfloat16, 2**-8), (torch.float16, 2**-11)])
def test_row_mode_in_16_bits_over_4096_tokens_is_as_accurate_as_hook_masking(dtype, unit):
    """Each dx, dW, db entry sums up to 4096 products: float32 accumulation rounded once to ``dtype``
    puts every entry within the unit roundoff ``unit`` (2⁻⁸ bf16, 2⁻¹¹ fp16) of the float64 value, so
    the norm-wise relative error is at most ``unit`` (float32's own rounding, ~1e-7·√4096 relative, is
    far below it). The hook path's dense 16-bit GEMMs meet the same bound; sums kept in 16 bits do not
    (4096 ones summed in bf16 stop at 256)."""
    N, inputs, M, k = 4096, 16, 12, 3
    generator = torch.Generator().manual_seed(21)
    # each row's magnitudes are 1 + j/16 for a permutation j of 0..11: exact in 16 bits, no ties, and
    # the row's k largest are where j ≥ M − k
    ranks = torch.rand(N, M, generator=generator).argsort(dim=1)
    sign = torch.where(torch.rand(N, M, generator=generator) < 0.5, -1.0, 1.0)
    dy = (sign * (1 + ranks / 16)).to(dtype)
    mask = ranks >= M - k
    x = torch.randn(N, inputs, generator=generator).to(dtype)
    reference = _linear(inputs, M, seed=5).to(dtype)
    expected = _reference64(x, reference.weight, reference.bias, torch.where(mask, dy.double(), 0.0))

    sparse_grads = _grads(_topk_copy(reference, k, "row").to(dtype), x, dy)
    hooked_model = nn.Sequential(copy.deepcopy(reference))
    with mask_gradients(hooked_model, k, mode="row"):
        hooked = _grads(hooked_model, x, dy)
    for grads in (sparse_grads, hooked):
        for got, want in zip(grads, expected):
            assert got.dtype == dtype
            assert ((got.double() - want).norm() / want.norm()).item() <= unit


@pytest.mark.parametrize("mode", ["shared", "row"])
def test_a_dropped_infinite_gradient_entry_becomes_zero_not_nan(mode):
    # one token, k = 2: three infinite entries compete for two places, so one of them is dropped
    dy = torch.tensor([[math.inf, 0.5, -math.inf, 2.0, math.inf, -1.0]])
    x = torch.tensor([[1.0, -2.0, 3.0]])
    reference = _linear(3, 6, seed=7)
    hooked_model = nn.Sequential(copy.deepcopy(reference))
    with mask_gradients(hooked_model, 2, mode=mode):
        hooked = _grads(hooked_model, x, dy)
    gathered = _grads(_topk_copy(reference, 2, mode), x, dy)
    for _, dw, db in (hooked, gathered):
        # one token: db is the masked dy itself, two of its three infinities (signs kept) and zeros
        kept = db.isinf()
        assert not db.isnan().any() and int(kept.sum()) == 2
        assert (kept <= dy[0].isinf()).all() and torch.equal(db[kept], dy[0][kept])
        assert (db[~kept] == 0).all()
        # dW row m is db[m]·x: ±inf where kept (x has no zero), zero where dropped
        assert not dw.isnan().any() and dw[kept].isinf().all() and (dw[~kept] == 0).all()
    assert torch.equal(hooked[2], gathered[2]) and torch.equal(hooked[1], gathered[1])


@pytest.mark.parametrize("k", [2, 4])  # a top-k layer and k = all (exactly the dense layer)
def test_topk_linear_refuses_an_input_dtype_other_than_the_weights(k):
    layer = TopKLinear(8, 4, k=k)
    with pytest.raises(
        TypeError, match=r"input dtype torch\.float64 does not match the weight's torch\.float32"
    ):
        layer(torch.randn(3, 8, dtype=torch.float64))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast mixes dtypes on purpose
        y = layer(torch.randn(3, 8, dtype=torch.bfloat16))
    assert y.dtype == torch.bfloat16


@pytest.mark.parametrize(
    "modules, error, words",
    [
        ([5], TypeError, r"each entry of modules must be .* got 5 \(int\)"),
        (None, TypeError, r"modules must be .* got None \(NoneType\)"),
        (5, TypeError, r"modules must be .* got 5 \(int\)"),
        ([nn.Linear(2, 2)], TypeError, r"nn\.Module subclass, got Linear.*give its class"),
        ([nn.Linear, 3.0], TypeError, r"got 3\.0 \(float\)"),
        ([int], TypeError, r"nn\.Module subclass, got <class 'int'>"),
        (["re:("], ValueError, r"modules pattern 're:\(' is not a regular expression"),
    ],
)
def test_gradient_mask_refuses_module_selectors_that_are_neither_patterns_nor_classes(modules, error, words):
    model = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(error, match=words):
        GradientMask(model, 2, modules=modules)
    assert not model[0]._backward_pre_hooks


def test_sparsify_model_refuses_a_model_already_sparsified_and_changes_nothing():
    from qlab.nn import plain_linears

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    assert sparsify_model(model, 2) == ["0", "2"]
    layers = list(model)
    for keep in ([], ["2"]):
        with pytest.raises(ValueError, match=r"already sparsified \(TopKLinear: '0', '2'\).*plain_linears"):
            sparsify_model(model, 3, keep=keep)
    assert list(model) == layers and [model[0].count, model[2].count] == [2, 2]
    # what the message says to do: back to the dense layers (the same Parameters), then another k
    weight = model[0].weight
    assert plain_linears(model, TopKLinear) == ["0", "2"] and type(model[0]) is nn.Linear
    assert sparsify_model(model, 3) == ["0", "2"]
    assert [model[0].count, model[2].count] == [3, 3] and model[0].weight is weight
    with pytest.raises(ValueError, match="already sparsified .TopKLinear: the model itself"):
        sparsify_model(TopKLinear(4, 4, k=2), 1)
