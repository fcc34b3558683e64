"""Stochastic rounding's draws, fast, and the op that gives compiled code the same draws.

``stochastic_noise`` returns ``qlab.formats.stochastic_noise``'s numbers (its definition in torch
ops): on the CPU the C kernel runs the generator's MT19937 itself, giving the same numbers and
leaving the same generator state about 16× faster (``qlab.kernels.cpu_qdq.stochastic_noise``), since
the draws dominate stochastic rounding's cost; on a GPU one Triton kernel splits the integers
(``qlab.kernels.noise_triton``) in place of torch's six ops; elsewhere, and inside torch.compile, the
definition.

``register_noise_source`` and ``drawn_noise`` let a layer draw from its own generator through the
``qlab::stochastic_noise`` op, so eager and compiled code consume the same stream.
"""

from __future__ import annotations

import importlib.util
import itertools
import math
import weakref
from collections.abc import Callable
from functools import cache

import torch

from qlab import checks, ops
from qlab.formats import check_noise_arguments, random_bits, torch_stochastic_noise


def stochastic_noise(shape, generator: torch.Generator | None, device=None) -> torch.Tensor:
    """``qlab.formats.stochastic_noise(shape, generator, device)``: the same numbers, and the same
    generator state after, by the fastest path for ``device`` (module docstring)."""
    check_noise_arguments(shape, generator)
    if not torch.compiler.is_compiling() and _noise_kernel_runs_on(device):
        from qlab.kernels.noise_triton import noise_from_bits  # it needs Triton

        count = math.prod(shape)
        return noise_from_bits(random_bits(count, generator, device), count).reshape(shape)
    on_cpu = torch.device(device or "cpu").type == "cpu" and (
        generator is None or generator.device.type == "cpu"
    )
    if on_cpu and not torch.compiler.is_compiling():
        from qlab.kernels import cpu_qdq

        if cpu_qdq.draws_like_torch():  # the same numbers, several times faster
            return cpu_qdq.stochastic_noise(math.prod(shape), generator).reshape(shape)
    return torch_stochastic_noise(shape, generator, device)


def _noise_kernel_runs_on(device) -> bool:
    """Whether ``stochastic_noise`` splits the integers with the Triton kernel: on CUDA, with Triton."""
    return torch.device(device or "cpu").type == "cuda" and _triton_installed()


@cache
def _triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


# --- noise from a registered source, the same bits eager and under torch.compile -------------------

_NOISE_SOURCES: dict[int, weakref.WeakMethod] = {}
_NOISE_KEYS = itertools.count()


def register_noise_source(generator_for: Callable[[torch.device], torch.Generator]) -> torch.Tensor:
    """A key under which ``drawn_noise`` finds the generator ``generator_for(device)`` returns.
    ``generator_for`` is a bound method (e.g. a layer's per-device generators), held weakly: the
    entry goes when its object is garbage-collected.

    The key is a 0-d int64 CPU tensor, not an int: torch.compile specializes on a module's integer
    attributes, so with int keys each layer of a model's repeated blocks would compile its own copy of
    the block; a tensor is a graph input, and the blocks share one compiled graph."""
    if not callable(generator_for) or not hasattr(generator_for, "__self__"):
        raise TypeError(
            "generator_for must be a bound method (device → torch.Generator), "
            f"got {checks.shown(generator_for)}"
        )
    key = next(_NOISE_KEYS)
    _NOISE_SOURCES[key] = weakref.WeakMethod(generator_for)
    weakref.finalize(generator_for.__self__, _NOISE_SOURCES.pop, key, None)
    return torch.tensor(key, dtype=torch.int64, device="cpu")  # whatever the default device is


def _noise_kernel(after: torch.Tensor, counts: list[int], source: torch.Tensor) -> list[torch.Tensor]:
    method = _NOISE_SOURCES.get(int(source))
    generator_for = None if method is None else method()  # None: its object was garbage-collected
    if generator_for is None:
        raise ValueError(
            f"source {int(source)} is not a registered noise source: give the key register_noise_source "
            "returned, while the object whose generators it names is alive"
        )
    generator = generator_for(after.device)
    return [stochastic_noise((count,), generator, after.device) for count in counts]


def _noise_fake(after, counts, source):
    return [after.new_empty(count, dtype=torch.float32) for count in counts]


# CUDA graphs replay what they recorded: a draw inside one would repeat its numbers at every replay.
# Tagged cudagraph_unsafe (where this torch has the tag), it runs between inductor's graph partitions.
NOISE_STAYS_OUT_OF_CUDA_GRAPHS = hasattr(torch.Tag, "cudagraph_unsafe")
_noise_op = ops.define(
    "stochastic_noise",
    "(Tensor after, int[] counts, Tensor source) -> Tensor[]",
    _noise_kernel,
    _noise_fake,
    tags=(torch.Tag.nondeterministic_seeded,)
    + ((torch.Tag.cudagraph_unsafe,) if NOISE_STAYS_OUT_OF_CUDA_GRAPHS else ()),
)


def drawn_noise(source: torch.Tensor, shapes: list, after: torch.Tensor) -> list[torch.Tensor]:
    """``stochastic_noise`` for each shape, in order, from the generator registered under ``source``
    (the key ``register_noise_source`` returned), on ``after``'s device and after ``after`` is computed.

    Eager code draws exactly these numbers from the generator; compiled code calls the same op,
    which PyTorch neither deduplicates nor reorders against its input (it is tagged
    nondeterministic_seeded), so a compiled model consumes the same stream and gives the same bits.
    """
    if not isinstance(shapes, (list, tuple)):
        raise TypeError(f"shapes must be a list of shapes (tuples of ints), got {checks.shown(shapes)}")
    for shape in shapes:  # a traced shape holds SymInts: checked as ints, with no value to compare
        if not isinstance(shape, (tuple, list, torch.Size)) or not all(
            isinstance(n, (int, torch.SymInt)) and not isinstance(n, bool) for n in shape
        ):
            raise TypeError(f"each shape must be a tuple of ints, got {checks.shown(shape)}")
    flat = _noise_op(after, [math.prod(shape) for shape in shapes], source)
    return [noise.reshape(tuple(shape)) for noise, shape in zip(flat, shapes)]
