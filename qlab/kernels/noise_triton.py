"""Triton kernel: stochastic rounding's draws from a generator's random integers, in one launch.

``qlab.formats.torch_stochastic_noise`` (the definition) turns h = ceil(n/2) random int32 into n float32
draws with six torch ops (two masks, a shift, a concatenation, a conversion, a scaling). On a GPU each
op is a kernel and a host launch, and an nvfp4 model draws 40 times a step. ``noise_from_bits`` writes
the same floats in one kernel: draw i < h is integer i's low 15 bits, draw h + j integer j's next 15,
each times 2^-15 (exact).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from qlab.formats import NOISE_BITS

BLOCK = 1024


@triton.jit
def _noise_kernel(bits_ptr, out_ptr, count, half, NOISE_BITS: tl.constexpr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # 64-bit: 2^31 draws and more
    inside = offsets < count
    high = offsets >= half  # the second half of the draws reads the integers' upper bits
    bits = tl.load(bits_ptr + tl.where(high, offsets - half, offsets), mask=inside, other=0)
    draws = (bits >> tl.where(high, NOISE_BITS, 0)) & ((1 << NOISE_BITS) - 1)  # the mask drops the sign fill
    tl.store(out_ptr + offsets, draws.to(tl.float32) * (1.0 / (1 << NOISE_BITS)), mask=inside)


def noise_from_bits(bits: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` float32 draws ``torch_stochastic_noise`` makes from its ceil(count/2) random int32
    ``bits`` (1-D, contiguous), as a new 1-D tensor on their device."""
    half = (count + 1) // 2
    if bits.dtype != torch.int32 or bits.dim() != 1 or bits.numel() != half or not bits.is_contiguous():
        raise ValueError(
            f"bits must be a contiguous 1-D int32 tensor of ceil(count/2) = {half} integers, got "
            f"{bits.dtype} {tuple(bits.shape)}{'' if bits.is_contiguous() else ' (not contiguous)'}"
        )
    out = torch.empty(count, dtype=torch.float32, device=bits.device)
    if count:
        # Triton launches on the current device: make it the bits' (a layer on cuda:1 under cuda:0)
        on_device = torch.cuda.device(bits.device) if bits.is_cuda else contextlib.nullcontext()
        with on_device:
            grid = (triton.cdiv(count, BLOCK),)
            _noise_kernel[grid](bits, out, count, half, NOISE_BITS=NOISE_BITS, BLOCK=BLOCK)
    return out
