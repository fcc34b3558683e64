"""Fused kernels with one dispatch point per operation (issue 8; in progress).

    mx_qdq(x, spec, axis, backend="auto")        MX block quantize-dequantize → (values, E8M0 bytes)
    fp8_qdq(x, spec, axis, backend="auto")       FP8 current scaling, per tensor or per row → (values, scales)

backend: "auto" — Triton for CUDA tensors, the fused CPU path (qdq's torch.compile path) otherwise;
"triton" — force the kernel (on a CPU tensor only under TRITON_INTERPRET=1); "cpu" — the fused CPU
path; "reference" — eager ``qlab.quantize.quantize`` + ``dequantize``. Every backend gives the same
bits; tests/test_kernels.py checks the kernel against the reference under Triton's interpreter.
"""

from __future__ import annotations

import os

import torch

from qlab import quantize as Q
from qlab.formats import get_format

BACKENDS = ("auto", "triton", "cpu", "reference")


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run for tensors on ``device`` (CUDA, or the CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def mx_qdq(x: torch.Tensor, spec="mxfp8", axis: int = -1, *, backend: str = "auto"):
    """MX qdq of x along ``axis`` with RNE elements: (values in x's dtype and shape, E8M0 bytes with
    the blocked axis last, shape (..., ceil(K/block))). Modes "floor" and "rceil"; block size 32."""
    spec = Q.get_spec(spec)
    if not isinstance(spec, Q.MXSpec):
        raise TypeError(f"mx_qdq needs an MXSpec (or an MX preset name), got {type(spec).__name__}")
    if spec.block_size != 32 or spec.mode not in ("floor", "rceil") or spec.rounding != "rne":
        raise ValueError(f"the MX kernel covers block_size 32, modes floor/rceil and rne rounding; got {spec}")
    backend = _backend(x, spec, axis, backend)
    if backend in ("cpu", "reference"):
        q = Q.quantize(x, spec, axis, keep_source=False)
        values = Q.qdq(x, spec, axis, fast=None if backend == "cpu" else False)
        return values, q.scale_codes
    from qlab.kernels.mx_triton import mx_qdq_last_axis

    moved = x.movedim(axis, -1)
    values, codes = mx_qdq_last_axis(moved, get_format(spec.element), spec.mode)
    return values.to(x.dtype).movedim(-1, axis), codes


def _backend(x: torch.Tensor, spec, axis: int, backend: str) -> str:
    """Validate like the reference (dtype, axis, NaN for formats without one) and resolve "auto"."""
    Q._check_input(x, spec, axis)
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of: {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if x.is_cuda and triton_available(x.device) else "cpu"
    if backend == "triton":
        if not triton_available(x.device):
            raise ValueError(f"backend 'triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a {x.device.type} tensor")
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"the Triton kernels take float32/bf16/fp16, got {x.dtype}")
    return backend


def fp8_qdq(x: torch.Tensor, spec="fp8_e4m3", axis: int = -1, *, backend: str = "auto"):
    """FP8 current scaling (TensorwiseSpec, RNE): (qdq values in x's dtype and shape, float32 scales:
    shape () per tensor, or per row/channel x's shape with ``axis`` moved last and of size 1, as
    ``qlab.quantize.quantize`` gives them)."""
    spec = Q.get_spec(spec)
    if not isinstance(spec, Q.TensorwiseSpec) or spec.rounding != "rne":
        raise TypeError(f"fp8_qdq needs a TensorwiseSpec with rne rounding, got {spec!r}")
    backend = _backend(x, spec, axis, backend)
    if backend in ("cpu", "reference"):
        q = Q.quantize(x, spec, axis, keep_source=False)
        return Q.qdq(x, spec, axis, fast=None if backend == "cpu" else False), q.scales
    from qlab.kernels.fp8_triton import fp8_qdq as kernel

    per_row = spec.granularity == "axis"
    moved = x.movedim(axis, -1) if per_row else x
    values, scales = kernel(moved, get_format(spec.element), per_row=per_row, eps=spec.eps, pow2=spec.pow2)
    if per_row:
        values = values.movedim(-1, axis)
    return values.to(x.dtype), scales
