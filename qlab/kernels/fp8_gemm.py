"""FP8 GEMMs on tensor cores: A·Bᵀ from two FP8-quantized operands through ``torch._scaled_mm``.

Both operands are 2-D QTensors of a TensorwiseSpec with E4M3 or E5M2 elements whose scales are
shared along the reduction axis (per tensor, or per row: granularity "axis" along that axis). Every
GEMM of a Linear layer has this shape (qlab.recipe's table: each operand is quantized along its own
GEMM's reduction axis), so with rows_A (M, K) and rows_B (N, K) the operands with that axis last,

    fp8_matmul(A, B)[i, j] = Σ_k codes_A[i, k] · codes_B[j, k] / (scale_A[i] · scale_B[j])

(qlab's scales are TransformerEngine's multipliers, stored = cast(x · scale); ``_scaled_mm`` takes
their reciprocals). The emulated GEMM (qlab.nn) divides every element by its scale and multiplies in
float32; the two differ only in rounding (tests/test_fp8_gemm.py bounds the difference).

Constraints of ``torch._scaled_mm`` on CUDA (PyTorch's aten/src/ATen/native/cuda/ScaledBlas.cpp):
compute capability ≥ 8.9; A row-major and B column-major; K and N multiples of 16; E5M2 × E5M2
refused; scales on the operands' device; row-wise scales (float32, (M, 1) and (1, N), contiguous)
need B in E4M3, and a float32 result only on cuBLAS's row-wise path (compute capability 9.0 with
CUDA ≥ 12.9; elsewhere CUTLASS's kernel gives bf16/fp16 only). ``unsupported_reason`` checks them.
PyTorch's CPU build runs ``_scaled_mm`` too (float32 accumulation), which is where CI tests this
module; on a CPU it is slower than a float32 GEMM, so QuantLinear's ``gemm="auto"`` takes it only on CUDA.
"""

from __future__ import annotations

import torch

from qlab import quantize as Q
from qlab.formats import TORCH_FLOAT8


def is_fp8_spec(spec) -> bool:
    """Whether ``_scaled_mm`` can take operands of this spec: a TensorwiseSpec with E4M3/E5M2 elements."""
    return isinstance(spec, Q.TensorwiseSpec) and spec.element in TORCH_FLOAT8


def unsupported_reason(
    spec_a, spec_b, k: int, n: int, device: torch.device, out_dtype: torch.dtype = torch.float32
) -> str | None:
    """Why ``fp8_matmul`` cannot run a (M, K)·(N, K)ᵀ GEMM with these specs and output dtype on
    ``device``; None if it can."""
    for which, spec in (("A", spec_a), ("B", spec_b)):
        if not is_fp8_spec(spec):
            return f"operand {which} is not an E4M3/E5M2 TensorwiseSpec ({spec!r})"
    if device.type == "cpu":
        return None  # PyTorch's CPU _scaled_mm takes every combination
    if device.type != "cuda":
        return f"torch._scaled_mm runs on CUDA or the CPU, not {device.type}"
    capability = _capability(device)
    if capability < (8, 9):
        return f"FP8 tensor cores need compute capability 8.9 or newer, this GPU has {capability}"
    if k % 16 or n % 16:
        return f"the reduction length K={k} and output width N={n} must be multiples of 16"
    if spec_a.element == spec_b.element == "e5m2":
        return "cuBLAS refuses E5M2 × E5M2"
    if "axis" in (spec_a.granularity, spec_b.granularity):
        if spec_b.element != "e4m3":
            return "row-wise scaled GEMMs need operand B in E4M3"
        cublas_rowwise = capability == (9, 0) and _cuda_version() >= (12, 9)
        if out_dtype == torch.float32 and not cublas_rowwise:
            return (
                "row-wise scaled GEMMs with a float32 result need cuBLAS's row-wise path (compute capability "
                "9.0, CUDA ≥ 12.9); CUTLASS's gives only bf16/fp16"
            )
    return None


def _capability(device: torch.device) -> tuple[int, int]:
    """The GPU's compute capability; a constant to torch.compile (CUDA's lazy initialisation, which
    querying it may run, cannot be traced)."""
    return torch.cuda.get_device_capability(device)


if torch.cuda.is_available():  # marking it imports Dynamo: only where a GPU can ask
    _capability = torch.compiler.assume_constant_result(_capability)


def _cuda_version() -> tuple[int, ...]:
    return tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])


def _rows_and_inverse_scales(q: Q.QTensor, which: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8 codes (rows, K) contiguous, reduction axis last; float32 1/scale: shape () or (rows,))."""
    if not isinstance(q, Q.QTensor):
        raise TypeError(f"fp8_matmul expects QTensors, got {type(q).__name__} for operand {which}")
    if not is_fp8_spec(q.spec):
        raise TypeError(
            f"fp8_matmul needs E4M3/E5M2 TensorwiseSpec operands, got {q.spec!r} for operand {which}"
        )
    if len(q.shape) != 2:
        raise ValueError(f"fp8_matmul takes 2-D operands, got shape {tuple(q.shape)} for operand {which}")
    codes = q.codes.view(TORCH_FLOAT8[q.spec.element])
    inverse = torch.reciprocal(q.scales.float()).to(codes.device)  # a fixed scale may be a CPU number
    if q.spec.granularity == "tensor":
        return (codes if q.axis == 1 else codes.T).contiguous(), inverse.reshape(())
    return codes.contiguous(), inverse.reshape(-1)  # per row: quantize already moved the axis last


def fp8_matmul(a: Q.QTensor, b: Q.QTensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A·Bᵀ (M, N) in ``out_dtype`` by ``torch._scaled_mm``, A and B quantized along their reduction
    axis (``a.axis`` and ``b.axis`` name it: A's logical shape is (M, K) with axis 1, or (K, M) with
    axis 0)."""
    a_rows, a_inverse = _rows_and_inverse_scales(a, "A")
    b_rows, b_inverse = _rows_and_inverse_scales(b, "B")
    if a_rows.shape[1] != b_rows.shape[1]:
        raise ValueError(f"reduction lengths differ: A has {a_rows.shape[1]}, B has {b_rows.shape[1]}")
    if a_inverse.dim() or b_inverse.dim():  # row-wise: both scales as (M, 1) and (1, N)
        a_inverse = a_inverse.expand(a_rows.shape[0]).reshape(-1, 1).contiguous()
        b_inverse = b_inverse.expand(b_rows.shape[0]).reshape(1, -1).contiguous()
    return torch._scaled_mm(a_rows, b_rows.T, scale_a=a_inverse, scale_b=b_inverse, out_dtype=out_dtype)
