"""qlab.kernels.cpu_qdq: the C qdq kernel gives the eager reference's bits (qlab.quantize.qdq with
fast=False, itself pinned to torchao and TransformerEngine's formulas in test_quantize.py) for every
MX element format and scale mode and for NVFP4 with and without its global scale, with RNE or
stochastic rounding, 2-D tiles, and the Hadamard transform, and torchao's own bits for MX; for FP8
current scaling per tensor and symmetric integers; along any axis, with partial blocks and special
values. qdq dispatches to it only where
it covers the spec; a failed build leaves qdq working."""

import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_quantize import mixed_magnitudes, torchao_mx_reference

from qlab import formats, kernels, paths
from qlab import quantize as Q
from qlab.kernels import cpu_qdq
from qlab.quantize import IntSpec, MXSpec, NVFP4Spec, TensorwiseSpec

pytestmark = pytest.mark.skipif(not cpu_qdq.available(), reason="no C compiler to build the kernel")

ELEMENTS = ("e4m3", "e5m2", "e3m2", "e2m3", "e2m1")
MODES = tuple(cpu_qdq.MODES)
FLOAT32_MAX = torch.finfo(torch.float32).max
SPECS = [MXSpec(element, mode=mode) for element in ELEMENTS for mode in MODES] + [
    NVFP4Spec(),
    NVFP4Spec(global_scale=False),
    MXSpec("e2m1", rounding="stochastic"),
    MXSpec("e4m3", mode="rceil", rounding="stochastic"),
    MXSpec("e3m2", mode="even", rounding="stochastic"),
    NVFP4Spec(rounding="stochastic"),
    MXSpec("e4m3", mode="rceil", block_2d=True),
    MXSpec("e2m1", block_2d=True),
    NVFP4Spec(block_2d=True),
    NVFP4Spec(block_2d=True, global_scale=False),
    NVFP4Spec(hadamard=True),
    NVFP4Spec(hadamard=True, rounding="stochastic", hadamard_seed=5),
    MXSpec("e2m1", hadamard=True, rounding="stochastic"),
    MXSpec("e4m3", mode="rceil", hadamard=True),
    MXSpec("e2m3", block_size=128, hadamard=True, rounding="stochastic"),  # fewer lanes per work item
]


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int32)  # NaN payloads and signed zeros compared too


def assert_same_bits(got, expected):
    assert got.shape == expected.shape and got.dtype == expected.dtype
    differing = (bits(got) != bits(expected)).nonzero()
    assert len(differing) == 0, (
        f"{len(differing)} elements differ; first at {differing[0].tolist()}: "
        f"{got[tuple(differing[0])].item()!r} vs {expected[tuple(differing[0])].item()!r}"
    )


def reference(x, spec, axis, noise=None):
    return Q.qdq(x, spec, axis, noise=noise)


def assert_kernel_matches(x, spec, axis, seed=0):
    """The kernel against the eager reference on ``x``, both given the same draws if ``spec`` rounds
    stochastically."""
    spec = Q.get_spec(spec)
    noise = None
    if spec.rounding == "stochastic":
        noise = kernels.stochastic_noise(Q.noise_shape(x, spec, axis), torch.Generator().manual_seed(seed))
    assert_same_bits(cpu_qdq.qdq(x, spec, axis, noise=noise), reference(x, spec, axis, noise))


# Special values, each row one MX block (the rest of the row is small normal numbers): what every
# element format and scale mode must get bit for bit.
SPECIAL_BLOCKS = {
    "zeros and signed zeros": [0.0, -0.0],
    "float32 subnormals only": [2.0**-149, -(2.0**-140), 2.0**-127],
    "float32 max": [FLOAT32_MAX, -FLOAT32_MAX, 1.0],
    "a NaN poisons its block": [math.nan, 1.0, -2.0],
    "an inf poisons its block": [math.inf, 1.0],
    "a -inf poisons its block": [-math.inf, 3.0],
    "e4m3 max and beyond": [448.0, 449.0, 464.0, 480.0, -479.0],
    "ties between neighbours": [1.0625, 1.1875, 2.5, 3.5, -5.0, 0.75, 0.25],
    "element subnormals": [6.0, 2.0**-7, 3 * 2.0**-8, 2.0**-10, -(2.0**-9), 2.0**-16, 2.0**-18],
    "amax just below a power of two": [float.fromhex("0x1.fffffep3"), 1.0],
    "amax a power of two": [16.0, -0.5],
}


def spread_tensor(shape, exponent_spread, seed):
    """Normal numbers times 2^k, k uniform in ±exponent_spread per element."""
    g = torch.Generator().manual_seed(seed)
    spread = torch.randint(-exponent_spread, exponent_spread + 1, shape, generator=g).float()
    return torch.randn(shape, generator=g) * torch.exp2(spread)


def special_tensor(width=40):
    """One row per special block: the values first, then small numbers, padded to ``width``."""
    rows = []
    for values in SPECIAL_BLOCKS.values():
        row = torch.linspace(-0.01, 0.01, width)
        row[: len(values)] = torch.tensor(values, dtype=torch.float32)
        rows.append(row)
    return torch.stack(rows)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_special_values_along_either_axis(spec):
    x = special_tensor()  # 40 columns: one whole block of 32 and a partial one of 8
    for axis, operand in ((1, x), (0, x.T.contiguous())):
        assert_kernel_matches(operand, spec, axis)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("element", ELEMENTS)
def test_matches_torchao_reference(element, mode):
    """torchao's to_mx + to_dtype (finite data: torchao gives inf a finite scale, docs/reference.md §2)."""
    x = mixed_magnitudes((16, 128), 32, -20, 20, seed=3)
    expected = torchao_mx_reference(x, element, mode)[2]
    assert_same_bits(cpu_qdq.qdq(x, MXSpec(element, mode=mode), 1), expected)


def test_tensor_stats_are_whole_when_openmp_gives_fewer_threads_than_asked(tmp_path):
    """OMP_THREAD_LIMIT=1 (or a call from inside another parallel region) gives the kernel one thread
    when it asks for four: the blocks must be split among the threads it got, not the ones it asked
    for, or a part of the tensor goes unread and unset parts get merged. Run in a fresh process, as
    the limit is read when OpenMP starts."""
    import subprocess
    import sys

    script = (
        "import torch\n"
        "from qlab.kernels import cpu_qdq\n"
        "from qlab.probes import _stats_rows\n"
        "x = torch.randn(512, 256, generator=torch.Generator().manual_seed(0))\n"
        "out = torch.empty(11, dtype=torch.float64)\n"
        "cpu_qdq._library().qlab_tensor_stats(x.data_ptr(), 512, 256, 1, out.data_ptr(), 4)\n"
        "want = _stats_rows(x[None], True)[0]\n"
        "exact = [0, 1, 6, 7, 8, 9, 10]\n"
        "assert torch.equal(out[exact], want[exact]), (out, want)\n"
        "torch.testing.assert_close(out, want, rtol=1e-12, atol=0)\n"
        "print('whole')\n"
    )
    environment = {**os.environ, "OMP_THREAD_LIMIT": "1"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=environment, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0 and "whole" in done.stdout, done.stderr[-2000:]


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 70), min_size=1, max_size=3),
    axis_pick=st.integers(0, 2),
    spec=st.sampled_from(SPECS),
    exponent_spread=st.integers(0, 60),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_tensors_match_the_reference(shape, axis_pick, spec, exponent_spread, seed):
    x = spread_tensor(shape, exponent_spread, seed)
    if spec.block_2d:  # 2-D tiles: the kernel covers matrices (weights)
        x = x.reshape(shape[0], -1)
    assert_kernel_matches(x, spec, axis_pick % x.dim(), seed)


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_special_values_in_whole_blocks_along_either_axis(spec):
    """Rows of 128: whole blocks for every spec, which the kernel's vector paths take (16 blocks reduced
    at once, the Hadamard transform in registers along a row, and down 16 columns at a time)."""
    x = special_tensor(width=128)
    for axis, operand in ((1, x), (0, torch.cat([x, -x]).T.contiguous()[:, :16])):
        assert_kernel_matches(operand, spec, axis)


HADAMARD_SPECS = [spec for spec in SPECS if spec.hadamard]


@pytest.mark.parametrize("spec", HADAMARD_SPECS, ids=repr)
@pytest.mark.parametrize(
    "shape, axis",
    [
        ((3, 16 * 300), 1),  # two work items per row, the second of 44 blocks: partial groups of 16
        ((5, 16 * 21 + 16), 1),  # 22 blocks of 16 (and 11 of 32): a group of 16 plus the rest
        ((48, 96), 0),  # six groups of 16 columns, whole blocks down the axis
        ((40, 37), 0),  # 37 columns: not whole groups of 16, the loops over lanes instead
        ((2, 64, 80), 1),  # columns of a 3-D tensor, blocks down its middle axis
    ],
)
def test_hadamard_vector_paths_and_their_edges(spec, shape, axis):
    assert_kernel_matches(spread_tensor(shape, 30, seed=12), spec, axis, seed=3)


@pytest.mark.parametrize("threads", [1, 2, 16])
@pytest.mark.parametrize(
    "spec", ["mxfp8", "nvfp4", NVFP4Spec(rounding="stochastic"), NVFP4Spec(hadamard=True)], ids=str
)
def test_wide_non_last_axis_spans_several_column_tiles(spec, threads):
    """Blocks down axis 1 of (2, 40, 4200): more columns than the kernel's widest work item (4096), so
    at least two items whatever the threads (more, narrower ones for more threads), and a partial
    block (whose stochastic draws sit in the reference's zero-padded layout)."""
    x = torch.randn(2, 40, 4200, generator=torch.Generator().manual_seed(5)) * 1e3
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        assert_kernel_matches(x, spec, 1)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("threads", [1, 2, 16])
@pytest.mark.parametrize("block_size", [7, 16, 24, 32, 48, 256])
@pytest.mark.parametrize("shape", [(100, 600), (40, 5000), (600, 100), (16, 4096)])
def test_2d_tiles_of_any_block_size_never_straddle_two_work_items(shape, block_size, threads):
    """The kernel cuts the columns into work items about 256 to 4096 wide (wider where there are
    enough items for the threads); an item must hold whole tiles. With plain 256-column items, tiles of
    7, 24 and 48 columns would straddle two items, and each half would take its own scale (wrong bits)."""
    x = spread_tensor(shape, 20, seed=block_size)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for axis in (0, 1):
            assert_kernel_matches(x, MXSpec("e4m3", block_size=block_size, block_2d=True), axis)
        if block_size == 16:
            assert_kernel_matches(x, NVFP4Spec(block_2d=True), 0)
    finally:
        torch.set_num_threads(before)


def test_2d_tiles_wider_than_the_kernel_takes_are_left_to_the_reference_or_refused():
    x = torch.randn(8, 600)
    assert cpu_qdq.covers(x, MXSpec("e4m3", block_size=cpu_qdq.SQUARE_BLOCK_LIMIT, block_2d=True), x.dtype)
    too_wide = MXSpec("e4m3", block_size=cpu_qdq.SQUARE_BLOCK_LIMIT + 1, block_2d=True)
    assert not cpu_qdq.covers(x, too_wide, x.dtype)
    with pytest.raises(ValueError, match=r"at most 256 × 256, got 257 × 257"):
        cpu_qdq.qdq(x, too_wide, 1)  # a caller that skips covers() gets an error, not a crash


def test_qdq_with_a_generator_consumes_the_same_stream_as_eager():
    x = torch.randn(48, 40) * 30
    for spec in (MXSpec("e2m1", rounding="stochastic"), NVFP4Spec(rounding="stochastic")):
        for axis in (0, 1):
            kernel = kernels.qdq(x, spec, axis, generator=torch.Generator().manual_seed(9))
            eager = Q.qdq(x, spec, axis, generator=torch.Generator().manual_seed(9))
            assert_same_bits(kernel, eager)


# FP8 current scaling per tensor: one scale for the whole tensor, so each special case is a tensor
FP8_SPECS = [
    TensorwiseSpec("e4m3"),
    TensorwiseSpec("e5m2"),
    TensorwiseSpec("e4m3", convention="torchao"),
    TensorwiseSpec("e5m2", convention="torchao"),
    TensorwiseSpec("e4m3", pow2=True),
    TensorwiseSpec("e5m2", eps=1e-3),
    TensorwiseSpec("e4m3", eps=1e30),  # eps above every amax: the scale is fmt_max / eps
]
FP8_TENSORS = {
    **{name: special_tensor()[i : i + 1] for i, name in enumerate(SPECIAL_BLOCKS)},
    "all zeros (scale 1)": torch.zeros(3, 40),
    "amax a float32 subnormal (the scale overflows)": torch.tensor([[2.0**-149, -(2.0**-149)]]),
    "amax 1e-37": torch.tensor([[1e-37, -3e-38, 0.0, 5e-45]]),
    "amax near the float32 max": torch.tensor([[FLOAT32_MAX, -1e38, 1.0, 2.0**-100]]),
    "inf and NaN together": torch.tensor([[math.inf, math.nan, -2.0, 0.5]]),
    "-NaN only": torch.tensor([[-math.nan, 1.0]]),
    "mixed magnitudes": mixed_magnitudes((16, 64), 16, -30, 30, seed=4),
}


@pytest.mark.parametrize("case", FP8_TENSORS)
@pytest.mark.parametrize("spec", FP8_SPECS, ids=repr)
def test_fp8_per_tensor_matches_the_reference_bit_for_bit(spec, case):
    """The eager reference casts through torch's own float8 dtypes: NaN comes back with their bits."""
    x = FP8_TENSORS[case]
    for axis, operand in ((1, x), (0, x.T.contiguous())):
        assert_kernel_matches(operand, spec, axis)


# Symmetric integers, per tensor or per line along the axis (per token / per output channel). Inf and
# NaN are refused by the spec before any kernel runs.
INT_SPECS = [IntSpec(8), IntSpec(8, granularity="axis"), IntSpec(4, granularity="axis"), IntSpec(16)]
INT_TENSORS = {
    "zeros and signed zeros (scale 1)": torch.tensor([[0.0, -0.0, 0.0]]),
    "amax a float32 subnormal (scale 1)": torch.tensor([[2.0**-149, 0.0, -(2.0**-149)]]),
    "ties at scale 1: 127, then halves": torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, -126.5]]),
    "float32 max": torch.tensor([[FLOAT32_MAX, -FLOAT32_MAX, 1e38, 1.0]]),
    "small values round to zero (and to +0)": torch.tensor([[1000.0, -1.0, 1e-3, -1e-3, 3.9]]),
    "mixed magnitudes": mixed_magnitudes((16, 64), 16, -30, 30, seed=5),
    "rows of different magnitudes": torch.randn(6, 50, generator=torch.Generator().manual_seed(6))
    * torch.tensor([[1e-30], [1e-5], [1.0], [1e5], [1e30], [0.0]]),
}


@pytest.mark.parametrize("case", INT_TENSORS)
@pytest.mark.parametrize("spec", INT_SPECS, ids=repr)
def test_symmetric_int_matches_the_reference_bit_for_bit(spec, case):
    x = INT_TENSORS[case]
    for axis, operand in (
        (1, x),
        (0, x.T.contiguous()),
        (1, x.reshape(1, *x.shape).transpose(0, 1).contiguous()),
    ):
        assert_kernel_matches(operand, spec, axis)


@pytest.mark.parametrize("spec", INT_SPECS, ids=repr)
def test_symmetric_int_takes_inf_and_nan_as_the_traced_reference_does(spec):
    """Eagerly the spec refuses them; compiled code does not check, so the kernel must give what the
    reference's own ops give there (scale 1 for a non-finite amax, ±inf clamped, NaN kept)."""
    x = torch.tensor([[math.inf, -2.0, 0.5, 3.0], [-math.inf, 1.0, 0.25, -7.0], [math.nan, 1.0, 2.0, 3.0]])
    for axis, operand in ((1, x), (0, x.T.contiguous())):
        expected = Q._qdq_any_layout(operand, spec, axis, None, None, torch.float32)
        assert_same_bits(cpu_qdq.qdq(operand, spec, axis), expected)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(1, 300), min_size=1, max_size=3),
    axis_pick=st.integers(0, 2),
    spec=st.sampled_from(FP8_SPECS + INT_SPECS),
    exponent_spread=st.integers(0, 60),
    seed=st.integers(0, 2**31 - 1),
)
def test_fp8_and_int_random_tensors_match_the_reference(shape, axis_pick, spec, exponent_spread, seed):
    x = spread_tensor(shape, exponent_spread, seed)
    assert_kernel_matches(x, spec, axis_pick % len(shape))


# stochastic_noise's draws come from MT19937 run in C on the generator's state; the reference is
# torch's own Tensor.random_ (formats.torch_stochastic_noise). Counts cross the engine's 624-word state
# regenerations (a count of 2n draws takes n words) from several starting offsets in the state.
NOISE_COUNTS = (1, 2, 3, 623, 1246, 1247, 1248, 1249, 1250, 2497, 100_001, 0, 5)


@pytest.mark.parametrize("offset", [0, 1, 311, 622, 623, 624, 625])
def test_noise_drawn_in_c_equals_torch_random_and_leaves_the_same_generator_state(offset):
    assert cpu_qdq.draws_like_torch()  # else kernels.stochastic_noise would quietly take torch's path
    ours, theirs = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    for generator in (ours, theirs):
        torch.empty(offset, dtype=torch.int32).random_(generator=generator)
    for count in NOISE_COUNTS:
        assert torch.equal(
            cpu_qdq.stochastic_noise(count, ours), formats.torch_stochastic_noise((count,), theirs)
        )
        assert torch.equal(ours.get_state(), theirs.get_state())
    assert torch.equal(torch.rand(7, generator=ours), torch.rand(7, generator=theirs))


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 2**63 - 1), counts=st.lists(st.integers(0, 3000), min_size=1, max_size=6))
def test_noise_streams_match_torch_for_any_seed_and_sequence_of_counts(seed, counts):
    ours, theirs = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    for count in counts:
        assert torch.equal(
            kernels.stochastic_noise((count,), ours), formats.torch_stochastic_noise((count,), theirs)
        )


def test_noise_keeps_the_default_generator_and_its_cached_normal_sample():
    ours, theirs = [], []
    for draws, draw in ((ours, kernels.stochastic_noise), (theirs, formats.torch_stochastic_noise)):
        torch.manual_seed(11)
        torch.randn(3, dtype=torch.float64)  # leaves a cached second Box-Muller sample in the generator
        draws += [draw((2, 999), None), torch.randn(3, dtype=torch.float64), torch.rand(4)]
    for got, expected in zip(ours, theirs):
        assert torch.equal(got, expected)


def test_noise_falls_back_to_torch_where_the_c_generator_does_not_match(monkeypatch):
    def refuse(count, generator):
        raise AssertionError("the C generator ran though draws_like_torch said no")

    monkeypatch.setattr(cpu_qdq, "draws_like_torch", lambda: False)
    monkeypatch.setattr(cpu_qdq, "stochastic_noise", refuse)
    got = kernels.stochastic_noise((33,), torch.Generator().manual_seed(2))
    assert torch.equal(got, formats.torch_stochastic_noise((33,), torch.Generator().manual_seed(2)))


# NVFP4's global scale comes from the whole tensor's amax: the cases where TE's formula is clamped
NVFP4_TENSORS = {
    "all zeros": torch.zeros(4, 32),
    "amax below 2688/FLT_MAX (encode clamped)": torch.full((4, 32), 1e-37) * torch.arange(1, 33),
    "a NaN in one block, the others finite": torch.randn(4, 32).index_put_(
        (torch.tensor([1]),), torch.tensor(math.nan)
    ),
    "an inf in one block": torch.randn(4, 32).index_put_(
        (torch.tensor([2]), torch.tensor([5])), torch.tensor(math.inf)
    ),
    "amax near FLT_MAX": torch.randn(4, 32) * 1e37,
    "E4M3-subnormal block scales": torch.cat([torch.full((1, 32), 1e4), torch.randn(3, 32) * 1e-3]),
}


@pytest.mark.parametrize("case", NVFP4_TENSORS)
def test_nvfp4_global_scale_edge_cases(case):
    x = NVFP4_TENSORS[case]
    for axis in (0, 1):
        assert_kernel_matches(x, NVFP4Spec(), axis)


def test_qdq_dispatches_to_the_kernel_only_where_it_covers_the_spec(monkeypatch):
    calls = []
    for runner in ("_run", "_run_fp8", "_run_int"):  # every entry into the C library's qdq functions
        run = getattr(cpu_qdq, runner)
        monkeypatch.setattr(cpu_qdq, runner, lambda *args, run=run: calls.append(1) or run(*args))
    x = torch.randn(8, 64)
    seeded = {"generator": torch.Generator().manual_seed(4)}
    for spec, kwargs in (
        ("mxfp8", {}),
        ("mxfp4", {}),
        ("fp8_e4m3", {}),
        ("fp8_e5m2", {"dtype": torch.bfloat16}),
        ("int8", {}),
        ("int8_rowwise", {}),
        (MXSpec("e4m3", mode="rceil"), {"dtype": torch.float32}),
        ("nvfp4", {}),
        (MXSpec("e2m1", rounding="stochastic"), seeded),
        (NVFP4Spec(rounding="stochastic"), seeded),
        (NVFP4Spec(block_2d=True), {}),
        ("mxfp8_2d", {}),
        ("mxfp8", {"dtype": torch.bfloat16}),
        ("nvfp4_rht", {}),
        (MXSpec("e2m1", hadamard=True, rounding="stochastic"), seeded),
    ):
        calls.clear()
        seeded["generator"].manual_seed(4)
        got = kernels.qdq(x, spec, 0, **kwargs)
        assert calls, f"{spec} did not use the kernel"
        seeded["generator"].manual_seed(4)
        assert_same_bits(got, Q.qdq(x, spec, 0, **kwargs))
    covered = {
        "a fixed scale": (x, "fp8_e4m3", {"scale": 2.0}),
        "FP8 per row": (x, "fp8_e4m3_rowwise", {}),
        "asymmetric integers": (x, "uint8_asymmetric", {}),
        "FP8 1×128 tiles": (x, "fp8_blockwise", {}),
        "2-D blocks with Hadamard": (x, NVFP4Spec(block_2d=True, hadamard=True), {}),
        "2-D blocks of a 3-D tensor": (x.reshape(2, 4, 64), MXSpec("e4m3", block_2d=True), {}),
        "2-D blocks, stochastic": (x, NVFP4Spec(block_2d=True, rounding="stochastic"), {}),
        "NVFP4 16×16 tiles, torchao's convention": (x, NVFP4Spec(block_2d=True, convention="torchao"), {}),
        "NVFP4, torchao's convention": (x, NVFP4Spec(convention="torchao"), {}),
        "the reference backend": (x, "mxfp8", {"backend": "reference"}),
        "needs grad": (x.clone().requires_grad_(), "mxfp8", {}),
    }
    for case, (tensor, spec, kwargs) in covered.items():
        calls.clear()
        kernels.qdq(tensor, spec, -1, **kwargs)
        assert not calls, f"{case}: the kernel does not cover it and must not run"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "spec", ["mxfp8", "mxfp4", "nvfp4", "nvfp4_2d", "fp8_e4m3", "fp8_e5m2", "int8_rowwise"]
)
def test_16_bit_inputs_and_results_match_the_reference(spec, dtype):
    x = (torch.randn(48, 64, generator=torch.Generator().manual_seed(2)) * 50).to(dtype)
    for axis in (0, 1):
        for result_dtype in (dtype, torch.float32):
            got = kernels.qdq(x, spec, axis, dtype=result_dtype)
            assert_same_bits(got.float(), Q.qdq(x, spec, axis, dtype=result_dtype).float())
            assert got.dtype == result_dtype


def test_pad_false_still_refuses_a_partial_block_or_tile():
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        kernels.qdq(torch.randn(4, 40), MXSpec("e4m3", pad=False))
    with pytest.raises(ValueError, match="not a multiple of the block size"):
        kernels.qdq(torch.randn(20, 32), NVFP4Spec(block_2d=True, pad=False))


def test_out_receives_the_result_and_non_contiguous_tensors_are_read_and_written_correctly():
    x = torch.randn(64, 96).T  # a transposed view
    for out in (torch.full((96, 64), 7.0), torch.full((64, 96), 7.0).T):
        result = kernels.qdq(x, "mxfp8", 1, out=out)
        assert result is out
        assert_same_bits(out, reference(x.contiguous(), "mxfp8", 1))


def test_inside_torch_compile_it_is_one_opaque_op_with_the_same_bits():
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    x = torch.randn(64, 128) * 100

    def both_axes(t):
        activated = torch.nn.functional.gelu(t)
        return kernels.qdq(activated, "mxfp8", 1) + kernels.qdq(t * 3, "mxfp4", 0), activated

    compiled = torch.compile(both_axes, fullgraph=True, backend="inductor")
    result, activated = compiled(x)
    # the reference reads the compiled graph's own gelu: inductor's gelu may give −0.0 where eager's gives
    # +0.0 (seen on some CPUs), which is the activation's arithmetic, not the quantizer's
    assert_same_bits(result, reference(activated, "mxfp8", 1) + reference(x * 3, "mxfp4", 0))
    assert sum(counters["graph_break"].values()) == 0


def test_compiled_kernel_writes_into_out_whether_contiguous_or_not():
    torch._dynamo.reset()
    x = torch.randn(64, 96) * 100
    expected = reference(x, "mxfp8", 1)
    spec = Q.get_spec("mxfp8")
    write = torch.compile(lambda t, o: cpu_qdq.qdq(t, spec, 1, out=o), fullgraph=True, backend="inductor")
    for out in (torch.full((64, 96), 7.0), torch.full((96, 64), 7.0).T):
        write(x, out)
        assert_same_bits(out, expected)


def test_a_failed_build_leaves_qdq_on_its_other_paths(monkeypatch, tmp_path):
    broken = tmp_path / "broken.c"
    broken.write_text("this is not C\n")
    monkeypatch.setattr(cpu_qdq, "SOURCES", (broken,))
    monkeypatch.setattr(paths, "KERNEL_CACHE_DIR", tmp_path / "cache")
    cpu_qdq._library.cache_clear()
    try:
        assert not cpu_qdq.available()
        x = torch.randn(4, 64)
        assert_same_bits(kernels.qdq(x, "mxfp8"), reference(x, "mxfp8", -1))
    finally:
        cpu_qdq._library.cache_clear()  # the next test rebuilds from the real source (cached on disk)


def test_the_library_is_built_once_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setattr(paths, "KERNEL_CACHE_DIR", tmp_path)
    compiler = cpu_qdq.shutil.which("cc") or cpu_qdq.shutil.which("gcc")
    first = cpu_qdq._build(compiler)
    stamp = first.stat().st_mtime_ns
    assert cpu_qdq._build(compiler) == first and first.stat().st_mtime_ns == stamp
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no staging directory left behind


# tensor_stats: a probe's statistics of a float32 CPU tensor in C, against qlab.probes._stats_rows in
# float64 torch ops. The selections (min, max, amax, smallest non-zero |x|, zero count, channel top and
# lower median) must match exactly; the four float64 sums (mean, variance, Σx², Σ|x|) are accumulated in
# another order, so they agree to float64 rounding: relative 1e-12 of Σ|x|-sized quantities.
def _stats_table():
    generator = torch.Generator().manual_seed(3)
    wide = torch.randn(300, 257, generator=generator) * torch.logspace(-3, 3, 257)  # 2 threads, odd channels
    return {
        "gaussian 64x64": torch.randn(64, 64, generator=generator),
        "wide and skewed, 77k elements": wide + 5.0,
        "even channel count (lower median)": torch.rand(33, 8, generator=generator) * torch.arange(8.0),
        "one element": torch.tensor([[-2.5]]),
        "all zeros": torch.zeros(8, 4),
        "signed zeros and subnormals": torch.tensor([[0.0, -0.0, 1e-45, -1e-40], [3e-39, 0.0, -1.0, 2.0]]),
        "an inf": torch.tensor([[1.0, math.inf], [-3.0, 0.5]]),
        "a minus inf": torch.tensor([[1.0, -math.inf], [-3.0, 0.0]]),
        "a NaN": torch.tensor([[1.0, math.nan, 0.0], [-3.0, 0.5, 0.0]]),
        "float32 max": torch.tensor([[FLOAT32_MAX, -FLOAT32_MAX], [1.0, 0.0]]),
        "+inf and -inf (sum NaN, squares inf)": torch.tensor([[math.inf, 1.0], [-math.inf, 2.0]]),
        "inf beside NaN": torch.tensor([[math.nan, math.inf, -1.0]]),
        "inf as the only non-zero": torch.tensor([[0.0, -math.inf, 0.0]]),
        "negative zero alone": torch.tensor([[-0.0]]),
        # the kernel reads blocks of 2048: an inf in the middle block of three, a partial last block
        "an inf in one block of three": torch.randn(97, 64, generator=generator).index_put_(
            (torch.tensor(40), torch.tensor(3)), torch.tensor(math.inf)
        ),
        "many equal channel maxima (median ties)": torch.randint(-3, 4, (50, 31), generator=generator) * 1.0,
        # two threads × 5008 channel slots: the channel maxima go to the heap, not the stack
        "5000 channels, 40k elements": torch.randn(8, 5000, generator=generator)
        * torch.logspace(-2, 2, 5000),
    }


STATS_TABLE = _stats_table()


@pytest.mark.parametrize("outliers", [True, False])
@pytest.mark.parametrize("case", STATS_TABLE)
def test_tensor_stats_match_the_float64_torch_reference(case, outliers, two_torch_threads):
    from qlab.probes import _stats_rows

    x = STATS_TABLE[case]
    got, expected = cpu_qdq.tensor_stats(x, outliers), _stats_rows(x[None], outliers)[0]
    exact = [0, 1, 6, 7, 8, 9, 10]  # min, max, amax, smallest non-zero |x|, zeros, channel top, median
    torch.testing.assert_close(got[exact], expected[exact], rtol=0, atol=0, equal_nan=True)
    finite = x.double().nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    l1, squares, n = finite.abs().sum().item(), (finite * finite).sum().item(), x.numel()
    bounds = {2: l1 / n, 3: squares / n, 4: squares, 5: l1}  # mean, variance, Σx², Σ|x|
    for index, size in bounds.items():
        want, have = expected[index].item(), got[index].item()
        if math.isfinite(want):
            assert abs(have - want) <= 1e-12 * size, (index, have, want)
        else:  # inf or NaN: the same
            assert (math.isnan(have) and math.isnan(want)) or have == want, (index, have, want)


def _float64_variance(x: torch.Tensor) -> float:
    wide = x.double()
    return ((wide - wide.mean()) ** 2).mean().item()


@pytest.fixture
def two_torch_threads():
    """tensor_stats asks OpenMP for torch.get_num_threads() threads: two, whatever the machine's default."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.mark.parametrize("threads_from", [1, 2**30], ids=["two threads", "one thread"])
@pytest.mark.parametrize("numel", [2048, 2049, 3 * 2048 + 5, 70001])
def test_tensor_stats_variance_is_two_pass_exact_across_blocks_and_threads(
    numel, threads_from, monkeypatch, two_torch_threads
):
    """The kernel merges blocks of 2048 (and the threads' parts) by Chan et al.'s formula. On data far
    off zero — mean 10⁴, spread 10⁻² (κ = mean²/variance ≈ 10¹²), the case where E[x²] − E[x]² loses
    every digit even in float64 — the variance must still match a float64 two-pass variance to 1e-9 of
    itself (a float64 sum of n terms drifts by ≈ n·2⁻⁵³ relative; the bound leaves room for that)."""
    monkeypatch.setattr(cpu_qdq, "STATS_THREADS_MIN_NUMEL", threads_from)
    generator = torch.Generator().manual_seed(numel)
    drift = torch.linspace(-1.0, 1.0, numel) * 0.05  # the block means differ: the merge term matters
    x = (1e4 + drift + 0.01 * torch.randn(numel, generator=generator)).reshape(1, numel)
    got = cpu_qdq.tensor_stats(x, outliers=False)
    want = _float64_variance(x)
    assert abs(got[3].item() - want) <= 1e-9 * want, (got[3].item(), want)
    squares = (x.double() ** 2).sum().item()  # Σx², a float64 sum of non-negative terms
    assert abs(got[4].item() - squares) <= 1e-13 * squares
    assert got[2].item() == pytest.approx(x.double().mean().item(), rel=1e-14)


@pytest.mark.parametrize("offset", [0.0, 0.99, 1.01, 3.0, 100.0], ids=lambda o: f"mean {o} sd")
def test_tensor_stats_variance_is_exact_on_either_side_of_the_one_pass_switch(offset, two_torch_threads):
    """A block whose |mean| is at most its standard deviation takes M2 = Σx² − mean·Σx (one bit lost to
    cancellation at most); any other block sweeps it again for Σ(x − mean)². On both sides of that switch,
    and for a tensor whose blocks take different paths, the variance must match float64's two-pass one
    to 1e-12 of itself (the one-pass error is about 2⁻⁴⁴ of M2)."""
    generator = torch.Generator().manual_seed(7)
    x = offset + torch.randn(40, 1024, generator=generator)  # 20 blocks of 2048
    mixed = torch.cat([x[:20], 3.0 + 1e-3 * x[20:]])  # the last 10 blocks sit 3000 sd off zero
    for tensor in (x, mixed):
        got = cpu_qdq.tensor_stats(tensor, outliers=False)[3].item()
        want = _float64_variance(tensor)
        assert abs(got - want) <= 1e-12 * want, (got, want)


@pytest.mark.parametrize("channels", [37, 48], ids=["37 channels", "48 channels (kept in the main loop)"])
@pytest.mark.parametrize("threads_from", [1, 2**30], ids=["two threads", "one thread"])
def test_tensor_stats_selections_are_exact_when_threads_split_the_tensor(
    threads_from, channels, monkeypatch, two_torch_threads
):
    """With two threads each takes half the blocks: their minima, maxima, counts and channel maxima are
    merged; all must equal the reference exactly, an element of the second half carrying each extreme.
    A channel count that is a multiple of 16 has its channel maxima taken in the statistics' own loop."""
    from qlab.probes import _stats_rows

    monkeypatch.setattr(cpu_qdq, "STATS_THREADS_MIN_NUMEL", threads_from)
    x = torch.randn(300, channels, generator=torch.Generator().manual_seed(5))
    x[290, 3], x[280, 4], x[295, 5], x[299, 36] = -50.0, 60.0, 1e-30, 0.0
    x[:, 20] *= 1e-3  # the lower median channel's amax is another channel's than the top's
    got, want = cpu_qdq.tensor_stats(x, True), _stats_rows(x[None], True)[0]
    exact = [0, 1, 6, 7, 8, 9, 10]
    torch.testing.assert_close(got[exact], want[exact], rtol=0, atol=0)


@settings(max_examples=60, deadline=None)
@given(
    channels=st.integers(1, 200),
    rows=st.integers(1, 5),
    levels=st.integers(1, 6),
    seed=st.integers(0, 2**31 - 1),
)
def test_tensor_stats_lower_median_of_channel_maxima_is_torchs(channels, rows, levels, seed):
    """The channel maxima's lower median comes from a quickselect, not a sort: against torch.median on
    channel counts from 1 to 200 with few distinct values (ties everywhere, the partition's hard case)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, channels), generator=generator).float() * 0.5
    channel_amax = x.abs().amax(0)
    assert cpu_qdq.tensor_stats(x, True)[10].item() == channel_amax.median().item()


def test_tensor_stats_reads_non_contiguous_tensors_and_refuses_other_dtypes():
    from qlab.probes import _stats_rows

    x = torch.randn(40, 30).t()  # a transposed view
    torch.testing.assert_close(
        cpu_qdq.tensor_stats(x, True), _stats_rows(x[None], True)[0], rtol=1e-12, atol=1e-12
    )
    with pytest.raises(ValueError, match="float32"):
        cpu_qdq.tensor_stats(x.double(), True)


def test_the_generator_state_layout_the_c_draws_read_is_this_torchs():
    size = torch.Generator().get_state().numel()
    assert size == cpu_qdq.GENERATOR_STATE_BYTES, (
        f"torch's CPU generator state is now {size} bytes, not the {cpu_qdq.GENERATOR_STATE_BYTES} "
        "qlab/kernels/cpu_qdq.c reads: check at::CPUGeneratorImplState's layout for this torch and update "
        "GENERATOR_STATE_BYTES and the C struct; until then stochastic rounding takes torch's path"
    )


def test_another_state_layout_falls_back_to_torchs_draws(monkeypatch):
    """A torch whose generator state has another size: the C draws refuse to read it, and
    kernels.stochastic_noise gives torch's own numbers (the same bits, only slower)."""
    monkeypatch.setattr(cpu_qdq, "GENERATOR_STATE_BYTES", cpu_qdq.GENERATOR_STATE_BYTES + 8)
    cpu_qdq._draws_match_torch.cache_clear()
    try:
        assert not cpu_qdq.draws_like_torch()
        with pytest.raises(ValueError, match="generator state"):
            cpu_qdq.stochastic_noise(16, torch.Generator().manual_seed(1))
        ours = kernels.stochastic_noise((4096,), torch.Generator().manual_seed(2))
        theirs = formats.torch_stochastic_noise((4096,), torch.Generator().manual_seed(2))
        assert torch.equal(ours, theirs)
    finally:
        cpu_qdq._draws_match_torch.cache_clear()
