"""qlab.kernels against the eager reference (qlab.quantize), bit for bit.

Without a GPU the Triton kernels run under Triton's interpreter (TRITON_INTERPRET=1, set here
before the kernel module is imported): small shapes that still exercise masking (rows not a
multiple of the 16-row tile, a partial last block), both axes and the special values of a block
(NaN, inf, all zero, float32 subnormals, values that saturate). With CUDA the same tests run on GPU.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter (numpy) on NaN blocks

from qlab import quantize as Q  # noqa: E402
from qlab.kernels import mx_qdq  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ELEMENTS = ["e4m3", "e5m2", "e3m2", "e2m3", "e2m1"]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.float().view(torch.int32)  # NaN payloads included: exact means the same bits


def _special_blocks(rows: int = 19, cols: int = 72) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(rows, cols, generator=generator) * torch.logspace(-4, 4, cols)
    x[0, :32] = float("nan")            # a NaN block: byte 0xFF, every value NaN
    x[1, 40] = float("inf")             # an inf in the second block
    x[2, 32:64] = 0.0                   # an all-zero block: byte 0
    x[3, :32] = 1e-40                   # float32 subnormals: the smallest scales
    x[4, :32] = torch.linspace(-3e38, 3e38, 32)  # near float32's max: the largest scales
    x[5, 64:] = 480.0                   # saturates under FLOOR for E4M3 (480 → 448)
    return x


@pytest.mark.parametrize("mode", ["floor", "rceil"])
@pytest.mark.parametrize("element", ELEMENTS)
def test_mx_kernel_matches_the_reference_bit_for_bit(element, mode):
    x = _special_blocks().to(DEVICE)
    spec = Q.MXSpec(element, mode=mode)
    values, codes = mx_qdq(x, spec, backend="triton")
    ref_values, ref_codes = mx_qdq(x.cpu(), spec, backend="reference")
    assert torch.equal(codes.cpu(), ref_codes)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_mx_kernel_both_axes_and_16_bit_inputs(axis, dtype):
    generator = torch.Generator().manual_seed(1)
    x = (torch.randn(40, 33, generator=generator) * 10).to(dtype).to(DEVICE)  # 33: a partial block
    values, codes = mx_qdq(x, "mxfp8", axis=axis, backend="triton")
    ref_values, ref_codes = mx_qdq(x.cpu(), "mxfp8", axis=axis, backend="reference")
    assert values.dtype == dtype and values.shape == x.shape
    assert torch.equal(codes.cpu(), ref_codes)
    assert torch.equal(_bits(values.cpu()), _bits(ref_values))


@pytest.mark.parametrize("mode, value, expected", [
    ("floor", 480.0, 448.0),   # REFERENCE §2: FLOOR scale 2^0, 480 saturates to E4M3's 448
    ("floor", 957.0, 896.0),   # scale 2^1: 478.5 saturates to 448, times 2
    ("rceil", 480.0, 480.0),   # RCEIL scale 2^1: 240 is on the grid, nothing saturates
])
def test_published_floor_clipping_examples(mode, value, expected):
    values, _ = mx_qdq(torch.full((1, 32), value, device=DEVICE), Q.MXSpec("e4m3", mode=mode), backend="triton")
    assert values[0, 0].item() == expected


def test_dispatch_backends_agree_and_bad_input_is_refused():
    x = _special_blocks(8, 64)
    cpu_values, cpu_codes = mx_qdq(x, "mxfp8", backend="cpu")
    ref_values, ref_codes = mx_qdq(x, "mxfp8", backend="reference")
    assert torch.equal(cpu_codes, ref_codes) and torch.equal(_bits(cpu_values), _bits(ref_values))
    with pytest.raises(ValueError, match="unknown backend"):
        mx_qdq(x, "mxfp8", backend="gpu")
    with pytest.raises(TypeError, match="MXSpec"):
        mx_qdq(x, "fp8_e4m3", backend="reference")
    with pytest.raises(ValueError, match="block_size 32"):
        mx_qdq(x, Q.MXSpec("e4m3", mode="ceil"), backend="triton")
