"""The fast entry point of every qlab quantizer, on every device: each call gives the bits of its
reference in ``qlab.quantize`` (the eager torch definition) by the fastest path that covers it.

    qdq(x, spec, axis, ...)        qlab.quantize.qdq's result: Triton on a GPU, the C kernel or the
                                   compiled path on the CPU, else the reference
    quantize(x, spec, axis, ...)   qlab.quantize.quantize's QTensor: Triton kernels for MX, FP8 current
                                   scaling and FP8 per-tensor delayed scaling (a fixed ``scale``) on a
                                   GPU, else the reference
    fp8_with_scale(x, spec, axis, scale, codes=...)   FP8 delayed scaling by a scale kept on the device:
                                   quantize's QTensor or qdq's values, the scale's value unread
    stochastic_noise(shape, generator, device)   qlab.formats.stochastic_noise's draws, fast
    mx_qdq(x, spec, axis)          MX block quantize-dequantize → (values, E8M0 bytes)
    fp8_qdq(x, spec, axis)         FP8 current scaling per tensor, row or 1×128 tile → (values, scales)
    nvfp4_qdq(x, spec, axis, seed, offset)   NVFP4 1×16 / 16×16 → (values, block scales, global)
    layer_norm(x, shape, w, b, eps, stats=...)   LayerNorm with welford/two_pass/textbook stats

Each takes ``backend="auto"`` too: "auto" — Triton for CUDA tensors where a kernel covers the call,
the fused CPU path (the C kernel ``cpu_qdq``, or ``compiled`` for large inputs) on the CPU; "triton" —
force the kernel (on a CPU tensor only under TRITON_INTERPRET=1); "cpu" — the fused CPU path at any
size; "reference" — ``qlab.quantize``'s eager ops. Every backend gives the same bits;
tests/test_kernels.py and tests/test_cpu_qdq.py check each against the reference. FP8 GEMMs on tensor
cores (``torch._scaled_mm``) are in qlab.kernels.fp8_gemm; stochastic rounding's draws and the op
compiled code draws them through are in qlab.kernels.noise.
"""

from __future__ import annotations

import math
import os

import torch

from qlab import checks, scaling
from qlab import quantize as Q
from qlab.formats import get_format
from qlab.kernels import compiled, cpu_qdq
from qlab.kernels.noise import stochastic_noise

BACKENDS = ("auto", "triton", "cpu", "reference")


def triton_available(device: torch.device) -> bool:
    """Whether Triton kernels can run for tensors on ``device`` (CUDA, or the CPU interpreter)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def mx_qdq(
    x: torch.Tensor, spec="mxfp8", axis: int = -1, *, dtype: torch.dtype | None = None, backend: str = "auto"
):
    """MX qdq of x along ``axis`` with RNE elements: (values in ``dtype`` (default x's) and x's shape,
    E8M0 bytes with the blocked axis last, shape (..., ceil(K/block))). Every scale mode; block size 32."""
    spec = Q.get_spec(spec)
    if not isinstance(spec, Q.MXSpec):
        raise TypeError(
            f"spec must be an MXSpec (or an MX preset name) for mx_qdq, got {type(spec).__name__}"
        )
    _check_mx_kernel_spec(spec)
    Q.check_input(x, spec, axis)
    checks.floating_dtype("dtype", dtype)
    backend = _resolve(x, backend)
    if backend == "reference":
        q = Q.quantize(x, spec, axis, keep_source=False)
        return Q.dequantize(q, dtype or x.dtype), q.scale_codes
    if backend == "cpu":  # the compiled qdq, and the E8M0 bytes from the block amaxes (one more read of x)
        blocks = Q.to_layout(x, spec, axis % x.dim())
        scale_codes = scaling.mx_scale_codes(blocks.abs().amax(-1), get_format(spec.element), spec.mode)
        return _fused_cpu_qdq(x, spec, axis, dtype), scale_codes
    from qlab.kernels.mx_triton import mx_qdq_last_axis

    moved = x.movedim(axis, -1)
    values, codes = mx_qdq_last_axis(moved, get_format(spec.element), spec.mode, out_dtype=dtype)
    return values.movedim(-1, axis), codes


def quantize_covers(spec, *, fixed_scale: bool = False) -> bool:
    """Whether ``quantize`` has a Triton kernel for ``spec`` (see there); ``fixed_scale``: for a call
    given a fixed scale (delayed scaling), which the kernel takes for per-tensor TensorwiseSpec, RNE."""
    if checks.boolean("fixed_scale", fixed_scale):
        return _fixed_scale_spec(spec)
    if isinstance(spec, Q.MXSpec):
        return spec.block_size == 32 and spec.rounding == "rne" and not spec.block_2d and not spec.hadamard
    blockwise = isinstance(spec, Q.BlockwiseSpec) and not spec.block_2d
    return (isinstance(spec, Q.TensorwiseSpec) or blockwise) and spec.rounding == "rne"


def _fixed_scale_spec(spec) -> bool:
    """Whether the FP8 kernel takes a fixed (delayed-scaling) scale for ``spec``: per tensor, RNE."""
    return isinstance(spec, Q.TensorwiseSpec) and spec.granularity == "tensor" and spec.rounding == "rne"


def _fixed_scale_fits(x: torch.Tensor, scale) -> bool:
    """Whether the per-tensor kernel gives the reference's shapes for this fixed scale: no more
    dimensions than x (the reference's x · scale broadcasts to the scale's dimensions). Its number of
    values is the reference's to check (one, per tensor)."""
    return not isinstance(scale, torch.Tensor) or scale.dim() <= x.dim()


def _fixed_scale_kernel(x: torch.Tensor, spec, axis: int, scale: torch.Tensor, *, codes: bool, dtype=None):
    """The FP8 kernel with a fixed per-tensor scale (checked as the caller's contract says):
    quantize's QTensor (``codes``) or qdq's values in ``dtype``. The codes keep x's shape whatever the
    axis, as the reference's per-tensor layout does; the QTensor holds ``scale`` itself, as the
    reference's does."""
    from qlab.kernels.fp8_triton import fp8_fixed_scale

    out, _ = fp8_fixed_scale(
        x,
        get_format(spec.element),
        scale.to(device=x.device, dtype=torch.float32),
        emit_codes=codes,
        out_dtype=None if codes else dtype,
        convention=spec.convention,
    )
    if not codes:
        return out
    return Q.QTensor(
        codes=out, scales=scale, spec=spec, axis=axis, shape=x.shape, dtype=x.dtype, fixed_scale=scale
    )


def fp8_with_scale(
    x: torch.Tensor,
    spec,
    axis: int,
    scale: torch.Tensor,
    *,
    codes: bool,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
):
    """FP8 delayed scaling by a scale the caller keeps on the device: ``quantize(x, spec, axis,
    scale=scale)``'s QTensor (``codes=True``) or ``qdq(x, spec, axis, scale=scale, dtype=dtype)``'s
    values (``codes=False``), bit for bit, without reading the scale on the host.

    ``spec``: a TensorwiseSpec (or preset name) of granularity "tensor" with rne rounding; ``scale``: a
    float32 tensor holding one value, on x's device, with at most x's dimensions. Its shape, dtype and
    device are checked; its value is NOT: the caller guarantees it finite and positive (``quantize``
    and ``qdq`` check it, which for a CUDA scale waits for the device every call); any other value
    gives unspecified results. x is checked as ``quantize`` checks it. ``dtype`` (qdq values only):
    the result's dtype, default x's.

    The Triton kernel runs for a CUDA x eagerly ("auto"), or wherever "triton" forces it; the CPU,
    traced code and the "cpu" and "reference" backends run the reference's eager ops."""
    spec = Q.get_spec(spec)
    if not _fixed_scale_spec(spec):
        raise TypeError(
            f"spec must be a TensorwiseSpec of granularity 'tensor' with rne rounding for fp8_with_scale, "
            f"got {spec!r}"
        )
    axis = Q.check_input(x, spec, axis)  # x's dtype, the axis, and NaN for a format without NaN
    checks.boolean("codes", codes)
    checks.floating_dtype("dtype", dtype)
    checks.tensor("scale", scale, dtypes=(torch.float32,))
    if scale.numel() != 1 or scale.dim() > x.dim():
        raise ValueError(
            f"scale must hold one value, with at most x's {x.dim()} dimensions, "
            f"got shape {tuple(scale.shape)}"
        )
    checks.same_device("scale", scale, "x", x)
    if codes and dtype is not None:
        raise ValueError("dtype is the dtype of qdq values: give it with codes=False only")
    if codes and x.numel() == 0:
        raise ValueError(f"quantize needs a non-empty tensor x, got shape {tuple(x.shape)}")
    checks.choice("backend", backend, BACKENDS)
    dtype = dtype or x.dtype
    if x.numel() == 0:
        return x.to(dtype).clone()
    eager = not torch.compiler.is_compiling()
    if eager and _resolve(x, backend) == "triton":
        return _fixed_scale_kernel(x, spec, axis, scale, codes=codes, dtype=dtype)
    if not codes:
        return Q.qdq_unchecked(x, spec, axis, None, scale, dtype)
    return Q.quantize_unchecked(x, spec, axis, None, scale, keep_source=False)


def _check_mx_kernel_spec(spec: Q.MXSpec) -> None:
    if spec.block_size != 32 or spec.rounding != "rne" or spec.block_2d or spec.hadamard:
        raise ValueError(
            f"spec: the MX kernel covers 1-D blocks of 32 with rne rounding and no Hadamard transform; "
            f"got {spec}"
        )


def _auto_backend(x: torch.Tensor) -> str:
    return "triton" if x.is_cuda and triton_available(x.device) else "cpu"


def _resolve(x: torch.Tensor, backend: str) -> str:
    """The backend to run: "auto" resolved; "triton" checked for a usable device and dtype."""
    checks.choice("backend", backend, BACKENDS)
    if backend == "auto":
        return _auto_backend(x)
    if backend == "triton":
        if not triton_available(x.device):
            raise ValueError(
                f"backend 'triton' needs a CUDA tensor or TRITON_INTERPRET=1, got a {x.device.type} tensor"
            )
        if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise TypeError(f"the Triton kernels take float32, bfloat16 or float16, got {x.dtype}")
    return backend


def fp8_qdq(
    x: torch.Tensor,
    spec="fp8_e4m3",
    axis: int = -1,
    *,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
):
    """FP8 current scaling (TensorwiseSpec, or BlockwiseSpec with 1×128 tiles; RNE): (qdq values in
    ``dtype`` (default x's) and x's shape, float32 scales as ``qlab.quantize.quantize`` gives them:
    shape () per tensor, x's shape with ``axis`` moved last and of size 1 per row/channel, or
    (..., n_tiles) per tile)."""
    spec = Q.get_spec(spec)
    _check_fp8_kernel_spec(spec, "fp8_qdq")
    axis = Q.check_input(x, spec, axis)  # the reference's refusals (dtype, axis, NaN without a NaN encoding)
    checks.floating_dtype("dtype", dtype)
    backend = _resolve(x, backend)
    if backend == "reference":
        q = Q.quantize(x, spec, axis, keep_source=False)
        return Q.dequantize(q, dtype or x.dtype), q.scales
    if backend == "cpu":  # the compiled qdq, and the scales from the amaxes (one more read of x)
        layout = Q.to_layout(x, spec, axis)  # per tile: (..., n_tiles, 128)
        amaxes = layout.abs().amax(-1) if isinstance(spec, Q.BlockwiseSpec) else Q.amax(layout, spec, -1)
        scales = scaling.fp8_current_scale(amaxes, spec.element, eps=spec.eps, pow2=spec.pow2)
        return _fused_cpu_qdq(x, spec, axis, dtype), scales
    values, scales = _fp8_kernel(x, spec, axis, emit_codes=False, out_dtype=dtype)
    if isinstance(spec, Q.BlockwiseSpec):
        values = Q.from_layout(values.float(), spec, axis, x.shape, dtype or x.dtype)
    elif spec.granularity == "axis":
        values = values.movedim(-1, axis)
    return values, scales


def _check_fp8_kernel_spec(spec, caller: str) -> None:
    blockwise = isinstance(spec, Q.BlockwiseSpec) and not spec.block_2d
    if not (isinstance(spec, Q.TensorwiseSpec) or blockwise) or spec.rounding != "rne":
        raise TypeError(
            f"spec must be a TensorwiseSpec or a 1-D BlockwiseSpec with rne rounding for {caller}, "
            f"got {spec!r}"
        )


def _fp8_kernel(x, spec, axis: int, *, emit_codes: bool, out_dtype=None):
    """The FP8 current-scaling kernel on x: per tensor, per row along ``axis``, or per 1×128 tile (each
    tile of quantize's blocked layout (..., n_tiles, 128) is one row). Returns the kernel's output in
    the layout it ran on and the scales as quantize stores them."""
    from qlab.kernels.fp8_triton import fp8_current_scaling

    if isinstance(spec, Q.BlockwiseSpec):
        source = Q.to_layout(x, spec, axis)  # float32 (exact), zero-padded, (..., n_tiles, 128)
        out_dtype = None if emit_codes else torch.float32  # from_layout casts, as the reference does
    else:
        source = x.movedim(axis, -1) if spec.granularity == "axis" else x
    out, scales = fp8_current_scaling(
        source,
        get_format(spec.element),
        per_row=spec.granularity != "tensor",
        eps=spec.eps,
        pow2=spec.pow2,
        emit_codes=emit_codes,
        out_dtype=None if emit_codes else out_dtype,
        convention=getattr(spec, "convention", "nvidia"),
    )
    if isinstance(spec, Q.BlockwiseSpec):
        scales = scales.squeeze(-1)
    return out, scales


def quantize(
    x: torch.Tensor,
    spec,
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
    noise: torch.Tensor | None = None,
    backend: str = "auto",
) -> Q.QTensor:
    """``qlab.quantize.quantize(x, spec, axis, ..., keep_source=False)``: the same QTensor (codes in
    the blocked layout, scales, E8M0 bytes), bit for bit. The Triton kernels cover MXSpec (block 32,
    1-D, RNE, every scale mode), TensorwiseSpec current scaling (RNE, per tensor or per row), a
    TensorwiseSpec per tensor with a fixed ``scale`` (delayed scaling; RNE; one value, with at most x's
    dimensions, checked finite and positive as the reference checks it) and 1-D BlockwiseSpec (RNE) on
    a GPU, eagerly; every other call (another fixed scale, stochastic rounding, another spec, the CPU,
    traced code) runs the reference. The result keeps no high-precision source (``QTensor.along``
    needs the original tensor)."""
    spec = Q.get_spec(spec)
    checks.choice("backend", backend, BACKENDS)
    fixed = scale is not None
    covered = quantize_covers(spec, fixed_scale=fixed) and noise is None and generator is None
    eager = not torch.compiler.is_compiling()  # traced code fuses the reference's ops itself
    if covered and eager:
        Q.check_input(x, spec, axis, values=False)
        covered = _fixed_scale_fits(x, scale)
    if backend == "triton" and not covered:
        raise ValueError(
            f"backend 'triton': the quantize kernels cover MX (block 32, 1-D, RNE), FP8 current scaling, "
            f"FP8 per-tensor scaling by a fixed scale of one value and 1-D blockwise specs with rne "
            f"rounding and no noise; got {spec}"
        )
    if not (covered and eager) or x.numel() == 0 or _resolve(x, backend) in ("cpu", "reference"):
        return Q.quantize(x, spec, axis, generator=generator, scale=scale, noise=noise, keep_source=False)
    axis = Q.check_input(x, spec, axis)  # the reference's refusals (NaN without a NaN encoding, ...)
    if fixed:  # the reference's refusals of the scale (its value too: finite and positive)
        scale = Q.check_qdq_arguments(x, spec, axis, None, None, scale, None, None, values=False)[3]
        return _fixed_scale_kernel(x, spec, axis, scale, codes=True)
    if isinstance(spec, Q.MXSpec):
        from qlab.kernels.mx_triton import mx_quantize_last_axis

        element = get_format(spec.element)
        codes, scale_codes, scales = mx_quantize_last_axis(x.movedim(axis, -1), element, spec.mode)
        return Q.QTensor(
            codes=codes,
            scales=scales,
            spec=spec,
            axis=axis,
            shape=x.shape,
            dtype=x.dtype,
            scale_codes=scale_codes,
        )
    codes, scales = _fp8_kernel(x, spec, axis, emit_codes=True)
    return Q.QTensor(codes=codes, scales=scales, spec=spec, axis=axis, shape=x.shape, dtype=x.dtype)


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, n, eps, stats):
        from qlab.kernels import layernorm_triton as K

        rows = x.reshape(-1, n).contiguous()
        # the kernel reads weight and bias as n contiguous values (a strided or expanded one would be misread)
        weight = None if weight is None else weight.contiguous()
        y, mean, rstd = K.forward(rows, weight, None if bias is None else bias.contiguous(), eps, stats)
        ctx.save_for_backward(rows, weight, mean, rstd)
        ctx.shape = x.shape
        ctx.bias_dtype, ctx.bias_shape = (None, None) if bias is None else (bias.dtype, bias.shape)
        return y.reshape(x.shape)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dy):
        from qlab.kernels import layernorm_triton as K

        rows, weight, mean, rstd = ctx.saved_tensors
        dx, dw, db = K.backward(rows, weight, dy.reshape(rows.shape).contiguous(), mean, rstd)
        dw = None if weight is None else dw.to(weight.dtype).reshape(weight.shape)
        db = None if ctx.bias_dtype is None else db.to(ctx.bias_dtype).reshape(ctx.bias_shape)
        return dx.reshape(ctx.shape), dw, db, None, None, None


LAYER_NORM_MAX_WIDTH = 2**20  # Triton's largest block (elements): a row's width, rounded up to a power of 2


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5, *, stats="welford", backend="auto"):
    """LayerNorm over the trailing ``normalized_shape`` (F.layer_norm's arguments and semantics) with
    the statistics ``stats`` ("welford", "two_pass", "textbook"), float32 accumulation, output in x's
    dtype.

    backend "triton" runs qlab.kernels.layernorm_triton (forward and backward); "cpu"/"reference" run
    ``qlab.numerics.layer_norm``. The two agree within float32 accumulation-order tolerances
    (tests/test_kernels.py states them), not bit for bit: their reductions sum in different orders.
    """
    from qlab import numerics

    shape, _ = numerics.check_layer_norm_args(x, normalized_shape, weight, bias, eps, stats, None)
    n = math.prod(shape)
    if backend == "auto" and (x.dtype == torch.float64 or n > LAYER_NORM_MAX_WIDTH):
        backend = "cpu"  # the kernel accumulates in float32 and holds a row in one block: the reference
    if backend == "triton" and n > LAYER_NORM_MAX_WIDTH:
        raise ValueError(
            f"backend 'triton': the LayerNorm kernel holds a row in one block of at most "
            f"{LAYER_NORM_MAX_WIDTH} elements, got rows of {n} (backend 'auto' runs the reference)"
        )
    if _resolve(x, backend) in ("cpu", "reference"):
        return numerics.layer_norm(x, normalized_shape, weight, bias, eps, stats=stats)
    return _TritonLayerNorm.apply(x, weight, bias, n, float(eps), stats)


def nvfp4_qdq(
    x: torch.Tensor,
    spec="nvfp4",
    axis: int = -1,
    *,
    seed: int = 0,
    offset: int = 0,
    generator: torch.Generator | None = None,
    dtype: torch.dtype | None = None,
    backend: str = "auto",
):
    """NVFP4 qdq (NVFP4Spec without Hadamard, with the global scale): (values in ``dtype`` (default
    x's) and x's shape, float32 E4M3 block scales, float32 global scale). 16×16 tiles need a 2-D x.

    Stochastic rounding: the Triton kernel draws from Philox keyed by (seed, offset + element index),
    reproducible across launches; the CPU/reference backends draw from ``generator``.
    """
    spec = Q.get_spec(spec)
    if not isinstance(spec, Q.NVFP4Spec):
        raise TypeError(
            f"spec must be an NVFP4Spec (or an NVFP4 preset name) for nvfp4_qdq, got {type(spec).__name__}"
        )
    if spec.hadamard or not spec.global_scale:
        raise ValueError(
            f"spec: the NVFP4 kernel covers global-scaled specs without the Hadamard transform; got {spec}"
        )
    Q.check_input(x, spec, axis)
    checks.seed("seed", seed)
    checks.integer("offset", offset, low=0)
    checks.floating_dtype("dtype", dtype)
    backend = _resolve(x, backend)
    if backend in ("cpu", "reference"):
        q = Q.quantize(x, spec, axis, generator=generator, keep_source=False)
        return Q.dequantize(q, dtype or x.dtype), q.scales, q.global_scale
    if spec.block_2d and x.dim() != 2:
        raise ValueError(f"the kernel's 16×16 tiles need a 2-D tensor, got shape {tuple(x.shape)}")
    from qlab.kernels.nvfp4_triton import nvfp4_qdq_last_axis

    moved = x.movedim(axis, -1)
    values, scales, global_scale = nvfp4_qdq_last_axis(
        moved,
        block_2d=spec.block_2d,
        stochastic=spec.rounding == "stochastic",
        convention=spec.convention,
        seed=seed,
        offset=offset,
        out_dtype=dtype,
    )
    if not spec.block_2d:
        scales = scales.reshape(*moved.shape[:-1], -1)
    return values.movedim(-1, axis), scales, global_scale


def covers(spec, *, fixed_scale: bool = False) -> bool:
    """Whether ``qdq`` has a Triton kernel for ``spec``: MX (1-D blocks of 32), TensorwiseSpec, 1-D
    BlockwiseSpec, NVFP4 with its global scale — all with RNE and without the Hadamard transform
    (stochastic rounding keeps its generator semantics in ``qlab.quantize``). ``fixed_scale``: for a
    call given a fixed scale (delayed scaling), which the kernel takes for per-tensor TensorwiseSpec."""
    spec = Q.get_spec(spec)
    if checks.boolean("fixed_scale", fixed_scale):
        return _fixed_scale_spec(spec)
    if spec.rounding != "rne" or spec.hadamard:
        return False
    if isinstance(spec, Q.MXSpec):
        return spec.block_size == 32 and not spec.block_2d
    if isinstance(spec, Q.NVFP4Spec):
        return spec.global_scale
    if isinstance(spec, Q.BlockwiseSpec):
        return not spec.block_2d
    return isinstance(spec, Q.TensorwiseSpec)


def qdq(
    x: torch.Tensor,
    spec,
    axis: int = -1,
    *,
    generator: torch.Generator | None = None,
    scale: torch.Tensor | float | None = None,
    dtype: torch.dtype | None = None,
    noise: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """``qlab.quantize.qdq`` with the same arguments: the same bits, in the same (contiguous) layout,
    by the fastest path that covers the call —

    - a CUDA tensor: the Triton kernel where ``covers(spec)`` (RNE), eagerly; with a fixed ``scale``
      where ``covers(spec, fixed_scale=True)`` (per-tensor TensorwiseSpec; a scale of one value with
      at most x's dimensions);
    - a CPU tensor: the C kernel ``cpu_qdq`` where it covers the spec, at any size, eagerly and inside
      torch.compile (stochastic rounding takes its draws from ``stochastic_noise`` up front), else
      ``compiled``'s fused qdq for inputs of at least ``compiled.COMPILE_MIN_NUMEL`` elements (any
      size with backend="cpu");
    - otherwise, inside other traced code, and with backend="reference": the eager reference.
    """
    spec = Q.get_spec(spec)
    checks.choice("backend", backend, BACKENDS)
    # shapes and dtypes only: whichever path runs reads the values once
    spec, axis, randomness, scale, dtype = Q.check_qdq_arguments(
        x, spec, axis, generator, noise, scale, dtype, out, values=False
    )
    eager = not torch.compiler.is_compiling()
    if backend != "reference" and x.numel() and eager and _triton_covers(x, spec, backend, scale):
        if scale is None:
            values = _KERNEL_QDQ[type(spec)](x, spec, axis, dtype=dtype, backend=backend)[0]
        else:
            Q.check_input(x, spec, axis)  # the values, once (NaN without a NaN encoding)
            values = _fixed_scale_kernel(x, spec, axis, scale, codes=False, dtype=dtype)
        # Along a non-last axis the kernels hand back a transposed view. A GEMM given that view may run
        # another cuBLAS algorithm than for the reference's contiguous result (1-4 ulp in every element
        # of a QuantLinear's output on an H100), so the copy keeps the two paths' GEMMs identical too.
        return values.contiguous() if out is None else out.copy_(values)
    Q.check_input(x, spec, axis)  # the values, once (NaN without a NaN encoding, ...)
    if backend == "reference" or x.numel() == 0:
        return Q.qdq_unchecked(x, spec, axis, randomness, scale, dtype, out)
    in_c = scale is None and _cpu_kernel_covers(x, spec, axis, dtype)
    drawn = randomness if isinstance(randomness, torch.Tensor) else None
    if in_c and spec.rounding == "stochastic" and drawn is None:
        if not eager:
            in_c = False  # traced code draws from a generator inside the reference's own ops
        else:
            drawn = stochastic_noise(Q.noise_shape(x, spec, axis), generator, x.device)  # the same draws
    if in_c:  # the same bits in one pass, eagerly and inside torch.compile
        return cpu_qdq.qdq(x, spec, axis, out, drawn, dtype)
    if not eager:
        return Q.qdq_unchecked(x, spec, axis, randomness, scale, dtype, out)
    large = x.numel() >= compiled.COMPILE_MIN_NUMEL and x.device.type == "cpu"
    if (backend == "cpu" or large) and compiled.compilable(spec):
        return _compiled_qdq(x, spec, axis, randomness, generator, scale, dtype, out)
    return Q.qdq_unchecked(x, spec, axis, randomness, scale, dtype, out)


def _fused_cpu_qdq(x: torch.Tensor, spec, axis: int, dtype) -> torch.Tensor:
    """The "cpu" backend's values: the C kernel or the compiled path (a CUDA tensor: the reference)."""
    return qdq(x, spec, axis, dtype=dtype, backend="reference" if x.is_cuda else "auto")


def _triton_covers(x: torch.Tensor, spec, backend: str, scale: torch.Tensor | None = None) -> bool:
    """Whether ``qdq`` runs a Triton kernel for x, with the fixed ``scale`` if given (``backend``
    "auto" or "triton"; a call no kernel covers runs the other paths, whatever the backend)."""
    tiles_need_2d = isinstance(spec, Q.NVFP4Spec) and spec.block_2d and x.dim() != 2
    fixed = scale is not None
    fits = not fixed or _fixed_scale_fits(x, scale)
    return covers(spec, fixed_scale=fixed) and fits and not tiles_need_2d and _resolve(x, backend) == "triton"


def _cpu_kernel_covers(x: torch.Tensor, spec, axis: int, dtype: torch.dtype) -> bool:
    """Whether the C kernel takes this qdq (a length that pad=False refuses is left to the reference,
    which raises)."""
    blocked = [axis] if spec.tile_rows == 1 else [-2, -1]
    whole_blocks = (
        spec.block_size is None or spec.pad or all(x.shape[d] % spec.block_size == 0 for d in blocked)
    )
    return whole_blocks and cpu_qdq.covers(x, spec, dtype)


def _compiled_qdq(x, spec, axis, randomness, generator, scale, dtype, out) -> torch.Tensor:
    """The compiled path, its noise drawn up front; the reference where compiling fails (no compiler,
    an unsupported op, ...), with the draws already spent, so the stream stays the same."""
    # inductor's C++ loop that writes a 16-bit result leaves a partial last block's elements unwritten
    # (garbage, under COMPILE_OPTIONS' realize_opcount_threshold): on the CPU the compiled result is
    # float32, cast eagerly, which is the reference's one rounding to the 16-bit dtype
    narrow = x.device.type == "cpu" and dtype in (torch.float16, torch.bfloat16)
    compiled_dtype = torch.float32 if narrow else dtype
    function = compiled.compiled_qdq(spec, axis, compiled_dtype)
    if function is None:
        return Q.qdq_unchecked(x, spec, axis, randomness, scale, dtype, out)
    noise = randomness if isinstance(randomness, torch.Tensor) else None
    if spec.rounding == "stochastic" and noise is None:
        noise = stochastic_noise(Q.noise_shape(x, spec, axis), generator, x.device)
    try:
        if narrow:
            wide = function(x, scale, noise, None)
            return wide.to(dtype) if out is None else out.copy_(wide)
        result = function(x, scale, noise, out)
        return result if out is None else out
    except Exception:
        compiled.give_up(spec, axis, compiled_dtype)
        return Q.qdq_unchecked(x, spec, axis, noise if noise is not None else randomness, scale, dtype, out)


# the kernel entry point of each spec class that has one (``covers`` says which of its specs)
_KERNEL_QDQ = {Q.MXSpec: mx_qdq, Q.NVFP4Spec: nvfp4_qdq, Q.TensorwiseSpec: fp8_qdq, Q.BlockwiseSpec: fp8_qdq}
