"""The compiled fast path of qdq: ``qlab.quantize.qdq_unchecked`` through ``torch.compile``, one
fused loop instead of about ten memory passes, compiled lazily per (spec, axis, dtype) (up to 8 shapes
each; more run eagerly) and given up silently, per key, where compilation fails. Bit-identical to the
eager reference (tested): ``COMPILE_OPTIONS`` make inductor round as eager torch does.
``QLAB_COMPILE=0`` turns it off.
"""

from __future__ import annotations

import os

import torch

from qlab import quantize as Q

COMPILE_MIN_NUMEL = 1 << 20  # below this, compiling a qdq costs more than it saves (CPU, "auto")


# Inductor fuses a pointwise expression into its consumer only while it has at most 50 operations
# on the CPU (30 on a GPU); past that it writes the intermediate tensor out and reads it back. A
# block format's element loop (the block's scale recomputed per vector, then the cast) is just past
# it, and its qdq then reads and writes the tensor twice more. qlab's own torch.compile calls
# pass these options; pass them to yours: torch.compile(model, options=COMPILE_OPTIONS).
# max_pointwise_cat_inputs: the Hadamard transform stacks its 16 columns; inductor fuses a stack of
# at most 8 inputs into one loop by default, and writes each of 16 out separately.
def _eager_numerics() -> dict:
    """inductor's options that make its Triton code round as eager torch does (those this torch has):
    IEEE division, not ``div.full``'s 2 ulp; no fused multiply-add (``emulate_precision_casts`` also
    turns Triton's fp fusion off); subnormals kept, not flushed to zero. Without them compiled qdq on a
    GPU parted from the CPU's bits at ties, near-ties and inexact scale divisions."""
    import torch._inductor.config as inductor

    known = inductor.get_config_copy()
    wanted = {
        "emulate_precision_casts": True,
        "eager_numerics.division_rounding": True,
        "eager_numerics.disable_ftz": True,
    }
    return {name: value for name, value in wanted.items() if name in known}


COMPILE_OPTIONS = {"realize_opcount_threshold": 256, "max_pointwise_cat_inputs": 16, **_eager_numerics()}
_compiled: dict = {}
_compile_failed: set = set()


def compile_enabled() -> bool:
    """Whether qlab may use torch.compile for its fast paths (QLAB_COMPILE=0 turns them off)."""
    return os.environ.get("QLAB_COMPILE", "1") != "0"


def compilable(spec: Q.Spec) -> bool:
    """RNE always; stochastic rounding when its float32 noise can be drawn up front (eagerly)."""
    return spec.rounding == "rne" or (spec.rounding == "stochastic" and Q.draws_float32_noise(spec))


def compiled_qdq(spec: Q.Spec, axis: int, dtype: torch.dtype):
    """The compiled ``fn(x, scale, noise, out)`` for (spec, axis, dtype), or None where compilation is
    off or failed before for this key. Layout changes (transpose to the blocked axis, padding,
    Hadamard) are compiled too, so inductor reads x in place instead of copying it first."""
    key = (spec, axis, dtype)
    if key in _compile_failed or not compile_enabled():
        return None
    if key not in _compiled:

        def qdq_full(x, scale, noise, out):
            return Q.qdq_unchecked(x, spec, axis, noise, scale, dtype, out)

        # dynamo counts its recompile limit (8 shapes) per code object: give every (spec, axis) its own
        qdq_full.__code__ = qdq_full.__code__.replace(co_name=f"qdq_{len(_compiled)}")
        _compiled[key] = torch.compile(qdq_full, dynamic=False, fullgraph=True, options=COMPILE_OPTIONS)
    return _compiled[key]


def give_up(spec: Q.Spec, axis: int, dtype: torch.dtype) -> None:
    """Run (spec, axis, dtype) eagerly from now on (its compilation failed)."""
    _compile_failed.add((spec, axis, dtype))
