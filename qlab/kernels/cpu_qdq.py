"""MX, NVFP4, per-tensor FP8 and symmetric INT qdq on the CPU through a small C kernel (``cpu_qdq.c``),
one pass per block (FP8 and INT: one for the amaxes, one for the elements).

What it covers: ``MXSpec`` (every element format and scale mode) and ``NVFP4Spec`` in NVIDIA's
convention (with or without the global scale), with RNE or stochastic rounding (from pre-drawn float32
noise), 1-D blocks along any axis with or without the seeded Hadamard transform, or 2-D tiles of a
matrix (RNE, up to 256 × 256); FP8 current scaling per tensor (``TensorwiseSpec``, E4M3 or E5M2, RNE,
either convention, pow2 and eps); symmetric integers per tensor or per line along the axis
(``IntSpec``, RNE); float32 (or bf16/fp16, widened first) in and out. It gives
``qlab.quantize.qdq``'s bits (tests/test_cpu_qdq.py against the eager reference) near the speed of a
memory copy, faster than inductor's code for the same loop (benchmarks/bench_quantize.py, whose
results the documentation's Benchmarks pages show).

Beside it, the same library gives stochastic rounding's draws (``stochastic_noise``: the generator's
own MT19937, the numbers ``Tensor.random_`` gives) and a probe's statistics of a float32 tensor
(``tensor_stats``, from ``cpu_stats.c``).

The C files are built with the system's C compiler on first use (under a second) into
``paths.KERNEL_CACHE_DIR``, one library per set of sources, compiler flags and CPU model, because it is built
for the machine it runs on (-march=native). Without a compiler, or with ``QLAB_COMPILE=0``, nothing
is built and qdq takes its other paths, which give the same bits.

``qlab::block_qdq_cpu``, ``qlab::fp8_tensor_qdq_cpu`` and ``qlab::int_qdq_cpu`` are torch ops
(qlab.ops): inside ``torch.compile`` each is one opaque call, so inductor writes its input out once
instead of fusing the producer into (and recomputing it for) every read.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import math
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

from qlab import ops, paths
from qlab.formats import get_format
from qlab.quantize import IntSpec, MXSpec, NVFP4Spec, TensorwiseSpec, draws_float32_noise
from qlab.scaling import hadamard_signs

SOURCES = (Path(__file__).with_name("cpu_qdq.c"), Path(__file__).with_name("cpu_stats.c"))  # one library
FLAGS = (
    "-O3",
    "-march=native",
    "-ffp-contract=off",  # no fused multiply-add: it would change the bits
    "-fno-math-errno",
    "-fno-trapping-math",  # lets floorf vectorize (stochastic rounding); no value changes
    "-fopenmp",
    "-fPIC",
    "-shared",
)
if platform.machine() in ("x86_64", "AMD64"):
    FLAGS += ("-mprefer-vector-width=512",)  # gcc's default of 256 bits halves AVX-512's work per instruction
MODES = {"floor": 0, "ceil": 1, "even": 2, "rceil": 3}  # the enum in cpu_qdq.c
FP8_ELEMENTS = ("e4m3", "e5m2")  # the formats whose NaN the kernel writes as torch's float8 cast does
SQUARE_BLOCK_LIMIT = 256  # 2-D tiles the kernel takes (tested up to here); larger: the reference path
FLOATING = (torch.float32, torch.bfloat16, torch.float16)  # 16-bit x is widened first, as the reference does


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _build(compiler: str) -> Path:
    """The shared library for these sources, these flags and this CPU; built (atomically) if missing."""
    key = hashlib.sha256(
        "\0".join([*(source.read_text() for source in SOURCES), compiler, *FLAGS, _cpu_model()]).encode()
    ).hexdigest()[:16]
    library = paths.KERNEL_CACHE_DIR / f"cpu_qdq-{key}.so"
    if library.exists():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as staging:
        built = Path(staging) / library.name
        subprocess.run(
            [compiler, *FLAGS, *map(str, SOURCES), "-o", str(built)],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, library)  # a concurrent build of the same key writes the same bytes
    return library


@functools.cache
def _library():
    """The loaded kernel library, or None where it cannot be built or loaded."""
    compiler = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if compiler is None:
        return None
    try:
        library = ctypes.CDLL(str(_build(compiler)))
    except (OSError, subprocess.SubprocessError):
        return None
    pointer, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    buffers = [pointer] * 4  # x, out, noise, Hadamard signs
    library.qlab_mx_qdq.argtypes = [*buffers, i64, i64, i64, i64, c_int, c_int, c_int, c_int, c_int,
                                    ctypes.c_float, c_int]  # fmt: skip
    library.qlab_nvfp4_qdq.argtypes = [*buffers, i64, i64, i64, c_int, c_int, c_int]
    library.qlab_int_qdq.argtypes = [pointer, pointer, i64, i64, i64, c_int, ctypes.c_float, ctypes.c_float,
                                     c_int]  # fmt: skip
    library.qlab_fp8_tensor_qdq.argtypes = [pointer, pointer, i64, c_int, c_int, ctypes.c_float,
                                            ctypes.c_float, c_int, c_int, c_int]  # fmt: skip
    library.qlab_stochastic_noise.argtypes = [pointer, pointer, i64]
    library.qlab_tensor_stats.argtypes = [pointer, i64, i64, c_int, pointer, c_int]
    functions = ("qlab_mx_qdq", "qlab_nvfp4_qdq", "qlab_fp8_tensor_qdq", "qlab_int_qdq",
                 "qlab_stochastic_noise", "qlab_tensor_stats")  # fmt: skip
    for function in functions:
        getattr(library, function).restype = None
    return library


@torch.compiler.assume_constant_result  # evaluated when traced (it builds files), a constant in the graph
def available() -> bool:
    """Whether the kernel can run here (a C compiler, and qlab's compiled paths not turned off)."""
    return os.environ.get("QLAB_COMPILE", "1") != "0" and _library() is not None


def covers(x: torch.Tensor, spec, dtype: torch.dtype) -> bool:
    """Whether ``qdq(x, spec, axis)`` gives ``qlab.quantize.qdq(x, spec, axis, dtype=dtype)`` (with
    no fixed scale: delayed scaling's is the caller's to refuse)."""
    if isinstance(spec, TensorwiseSpec):
        known_recipe = (
            spec.granularity == "tensor" and spec.element in FP8_ELEMENTS and spec.rounding == "rne"
        )
    elif isinstance(spec, IntSpec):
        known_recipe = spec.symmetric and spec.granularity in ("tensor", "axis") and spec.rounding == "rne"
    elif isinstance(spec, NVFP4Spec):
        known_recipe = spec.convention == "nvidia"
    else:
        known_recipe = isinstance(spec, MXSpec)
    return (
        known_recipe
        and (spec.rounding == "rne" or (spec.rounding == "stochastic" and draws_float32_noise(spec)))
        and (
            spec.block_size is None
            or not spec.block_2d
            or (
                x.dim() == 2
                and spec.rounding == "rne"
                and not spec.hadamard
                and spec.block_size <= SQUARE_BLOCK_LIMIT
            )
        )
        and x.device.type == "cpu"
        and x.dtype in FLOATING
        and dtype in FLOATING
        and not (x.requires_grad and torch.is_grad_enabled())
        and available()
    )


def qdq(
    x: torch.Tensor,
    spec,
    axis: int,
    out: torch.Tensor | None = None,
    noise: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """qdq of CPU ``x`` by ``spec`` (checked by ``covers``) along ``axis`` (non-negative, checked by the
    caller, as is ``spec.pad`` against the axis length), in ``dtype`` (rounded from float32, as the
    reference rounds), written into ``out`` if given (a tensor of x's shape and ``dtype`` that does not
    overlap x). Stochastic rounding takes its draws from ``noise`` (float32,
    ``qlab.quantize.noise_shape(x, spec, axis)``, checked by the caller)."""
    if (spec.rounding == "stochastic") != (noise is not None):
        raise ValueError(f"noise must be given exactly when the spec rounds stochastically, got {spec!r}")
    x = x.float()  # the reference's first step too
    if dtype != torch.float32:
        result = qdq(x, spec, axis, noise=noise)  # the float32 result, then one rounding
        return result.to(dtype) if out is None else out.copy_(result)
    if isinstance(spec, TensorwiseSpec):
        return _fp8_tensor_qdq(x, spec, out)
    if isinstance(spec, IntSpec):
        return _int_qdq(x, spec, axis, out)
    if isinstance(spec, MXSpec):
        fmt = get_format(spec.element)
        recipe = (spec.block_size, MODES[spec.mode], fmt.mantissa_bits, fmt.bias, fmt.emax, fmt.max, False)
    else:  # NVFP4: the kernel knows its formats; only the global scale varies
        recipe = (spec.block_size, -1, 0, 0, 0, 0.0, spec.global_scale)
    if spec.block_2d:
        axis = 0  # a 2-D tile is the same square of x whichever of its two axes the scales run along
    rotation = spec.hadamard_seed if spec.hadamard else -1
    return _into(x, out, _qdq_op, _run, (noise, axis, spec.block_2d, rotation, *recipe))


def _run(x, out, noise, axis, square, rotation, block, mode, mbits, bias, emax, elem_max, global_scale):
    """Call the C function: MX for mode ≥ 0, NVFP4 (NVIDIA's convention, blocks of 16) for mode −1;
    with the Hadamard transform of seed ``rotation`` around it when that is not −1."""
    if square and block > SQUARE_BLOCK_LIMIT:  # the op is public: a caller may skip covers()
        raise ValueError(
            f"the C kernel takes 2-D tiles of at most {SQUARE_BLOCK_LIMIT} × {SQUARE_BLOCK_LIMIT}, got "
            f"{block} × {block}: qlab.kernels.qdq runs larger ones on its other paths"
        )
    outer, length, inner = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :])
    noise = None if noise is None else noise.contiguous()  # held here: the C call reads its memory
    draws = None if noise is None else noise.data_ptr()
    signs = None if rotation < 0 else (ctypes.c_float * 16)(*hadamard_signs(rotation))
    pointers = (x.data_ptr(), out.data_ptr(), draws, signs, outer, length, inner)
    threads = torch.get_num_threads()
    if mode < 0:
        _library().qlab_nvfp4_qdq(*pointers, int(square), int(global_scale), threads)
    else:
        _library().qlab_mx_qdq(*pointers, block, int(square), mode, mbits, bias, emax, elem_max, threads)
    return out


def _fp8_tensor_qdq(x: torch.Tensor, spec, out: torch.Tensor | None) -> torch.Tensor:
    """FP8 current scaling per tensor (qlab_fp8_tensor_qdq) of float32 x, into ``out`` if given."""
    fmt = get_format(spec.element)
    arguments = (fmt.mantissa_bits, fmt.bias, fmt.max, spec.eps, spec.pow2, spec.convention == "torchao")
    return _into(x, out, _fp8_op, _run_fp8, arguments)


def _into(x, out, op, run, arguments):
    """``run(x, out, *arguments)`` for contiguous x and out (a new one if None); inside torch.compile
    the opaque ``op(x, *arguments)`` instead."""
    if torch.compiler.is_compiling():
        result = op(x, *arguments)
        return result if out is None else out.copy_(result)
    if out is not None and not out.is_contiguous():
        return out.copy_(_into(x, None, op, run, arguments))
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    return run(x.contiguous(), out, *arguments)


def _run_fp8(x, out, mbits, bias, fmt_max, eps, pow2, divide):
    _library().qlab_fp8_tensor_qdq(
        x.data_ptr(), out.data_ptr(), x.numel(), mbits, bias, fmt_max, eps, int(pow2), int(divide),
        torch.get_num_threads(),
    )  # fmt: skip
    return out


def _int_qdq(x: torch.Tensor, spec, axis: int, out: torch.Tensor | None) -> torch.Tensor:
    """Symmetric integer qdq (qlab_int_qdq) of float32 x, per tensor or per line along ``axis``."""
    fmt = get_format(spec.element)
    arguments = (axis, spec.granularity == "tensor", float(fmt.min), float(fmt.max))
    return _into(x, out, _int_op, _run_int, arguments)


def _run_int(x, out, axis, per_tensor, qmin, qmax):
    outer, length, inner = math.prod(x.shape[:axis]), x.shape[axis], math.prod(x.shape[axis + 1 :])
    _library().qlab_int_qdq(
        x.data_ptr(),
        out.data_ptr(),
        outer,
        length,
        inner,
        int(per_tensor),
        qmin,
        qmax,
        torch.get_num_threads(),
    )
    return out


GENERATOR_STATE_BYTES = 5056  # sizeof(at::CPUGeneratorImplState), the layout qlab_stochastic_noise reads


def stochastic_noise(count: int, generator: torch.Generator | None) -> torch.Tensor:
    """``qlab.formats.stochastic_noise``'s ``count`` draws from the CPU ``generator`` (None: torch's
    default), the same float32 numbers and the same generator state after, in one pass of MT19937 in C
    where torch's random_ plus the five ops that split its integers take six (``draws_like_torch``
    says where this holds)."""
    generator = torch.default_generator if generator is None else generator
    state = generator.get_state()
    if state.numel() != GENERATOR_STATE_BYTES:  # another torch's struct: reading it would give wrong draws
        raise ValueError(
            f"this torch's CPU generator state is {state.numel()} bytes, the C kernel reads "
            f"{GENERATOR_STATE_BYTES}; use qlab.formats.stochastic_noise (it takes the torch path here)"
        )
    out = torch.empty(count, dtype=torch.float32)
    _library().qlab_stochastic_noise(state.data_ptr(), out.data_ptr(), count)
    generator.set_state(state)
    return out


def draws_like_torch() -> bool:
    """Whether ``stochastic_noise`` can run and gives this torch's numbers (the comparison made once;
    the kernel's availability asked each time, as QLAB_COMPILE may change)."""
    return available() and _draws_match_torch()


@functools.cache
def _draws_match_torch() -> bool:
    """The C draws against random_, on counts that cross the engine's 624-word state boundaries, and
    the generator's state after."""
    from qlab.formats import torch_stochastic_noise

    ours, theirs = torch.Generator().manual_seed(20261125), torch.Generator().manual_seed(20261125)
    if ours.get_state().numel() != GENERATOR_STATE_BYTES:
        return False
    for count in (1, 2, 3, 1246, 1247, 1248, 1249, 5001, 1):
        if not torch.equal(stochastic_noise(count, ours), torch_stochastic_noise((count,), theirs)):
            return False
    return torch.equal(ours.get_state(), theirs.get_state())


STATS_THREADS_MIN_NUMEL = 16384  # below this a thread team costs more than it saves (4096 in a tight loop)


def tensor_stats(x: torch.Tensor, outliers: bool) -> torch.Tensor:
    """``qlab.probes._stats_rows`` of one non-empty float32 CPU tensor viewed as (rows, channels), as a
    float64 vector of 11, read in place in one pass (``cpu_stats.c``): min, max and the counts exact,
    the float64 sums in another order than torch's."""
    if x.dtype != torch.float32 or x.device.type != "cpu" or x.dim() != 2 or x.numel() == 0:
        raise ValueError(
            f"x must be a non-empty 2-D float32 CPU tensor, got {x.dtype} {tuple(x.shape)} on {x.device}"
        )
    x = x.contiguous()
    out = torch.empty(11, dtype=torch.float64)
    threads = torch.get_num_threads() if x.numel() >= STATS_THREADS_MIN_NUMEL else 1
    _library().qlab_tensor_stats(x.data_ptr(), x.shape[0], x.shape[1], outliers, out.data_ptr(), threads)
    return out


def tensor_stats_function():
    """The C function behind ``tensor_stats``, unchecked and with no Python around it:
    ``function(x.data_ptr(), rows, channels, outliers, address, threads)`` for a contiguous x. A probe's
    per-record path (``qlab.probes``) calls it directly, as each Python layer costs about as much as
    the statistics of a small tensor. None where the library is not built."""
    library = _library()
    return library.qlab_tensor_stats if library is not None else None


def _define_qdq_op(name: str, schema: str, run):
    """An op running ``run(x, a new contiguous tensor, *arguments)``: opaque to torch.compile."""

    def kernel(x, *arguments):
        return run(x.contiguous(), torch.empty_like(x, memory_format=torch.contiguous_format), *arguments)

    def fake(x, *arguments):
        return torch.empty_like(x, memory_format=torch.contiguous_format)

    return ops.define(name, schema, kernel, fake, dispatch_key="CPU")


_qdq_op = _define_qdq_op(
    "block_qdq_cpu",
    "(Tensor x, Tensor? noise, int axis, bool square, int rotation, int block, int mode, int mbits, "
    "int bias, int emax, float elem_max, bool global_scale) -> Tensor",
    _run,
)
_fp8_op = _define_qdq_op(
    "fp8_tensor_qdq_cpu",
    "(Tensor x, int mbits, int bias, float fmt_max, float eps, bool pow2, bool divide) -> Tensor",
    _run_fp8,
)
_int_op = _define_qdq_op(
    "int_qdq_cpu", "(Tensor x, int axis, bool per_tensor, float qmin, float qmax) -> Tensor", _run_int
)
