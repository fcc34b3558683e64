"""Quantized layers: QuantLinear (emulated low-precision GEMMs with backward overrides and fused
main_grad accumulation), fake_quant with straight-through estimators, and model conversion.

GEMMs are emulated by default: operands are quantize→dequantized (``qlab.kernels.qdq``: the bits of
the reference ``qlab.quantize.qdq`` through the C kernel on the CPU, Triton on CUDA) and
multiplied in float32 (float64 for unquantized float64 layers; the quantizers take float32/bf16/fp16)
at "highest" matmul precision, so the only rounding besides the recipe's is the float32 GEMM's:
16-bit operands are dequantized straight to float32. Under autocast the operands are cast to the
autocast dtype first, as nn.Linear's are. With delayed scaling the backward re-quantizes x and W with
the scales the forward used; each forward and each backward rolls its amax history once (so once
per micro-batch under gradient accumulation).

FP8 tensor cores (``gemm=``): "auto" (the default) runs a GEMM whose two operands are E4M3/E5M2
TensorwiseSpec (fp8_tensorwise, fp8_delayed, row-wise FP8) through ``torch._scaled_mm``
(qlab.kernels.fp8_gemm) when the layer is on a CUDA GPU whose kernels take it; "scaled_mm" insists
(also on the CPU: PyTorch's CPU implementation, for tests); "emulated" never. With per-tensor RNE
current scaling on tensor cores the backward takes the forward's codes of x and W, and wgrad dgrad's
codes of dy (``keeps_forward_codes``: the codes do not depend on the axis), so each tensor is quantized
once a step and x is kept in FP8. The two agree within
float32 accumulation order on the CPU (the GPU's FP8 accumulator keeps fewer bits), see
tests/test_fp8_gemm.py; with stochastic rounding along axis 0 they draw the same noise but may give
it to different elements (see ``qlab.quantize.qdq``).

torch.compile: with current scaling (and without fused or delayed wgrad) a QuantLinear traces whole,
forward and backward, and compiled code gives the eager bits on the CPU (tests/test_compile.py).
Stochastic-rounding noise comes from the layer's generator through the ``qlab::stochastic_noise`` op
(``qlab.kernels.noise.drawn_noise``), so the stream is the same compiled or not; the bias gradient goes
through ``qlab::bias_grad`` (ATen's summation order). Delayed scaling, fused and delayed wgrad change
state from inside backward: such a layer runs as an eager island (``QuantLinear.compiles``).

Weight-gradient delivery (docs/reference.md §4), for QuantLinear with any recipe (bf16 = plain precision):

| fuse_wgrad_accumulation | delay_wgrad | grad_added_to_main_grad¹ | wgrad goes to | returned | .grad after |
|---|---|---|---|---|---|
| False | False | – | a new tensor | wgrad | autograd accumulates |
| False | True  | – | param.grad at ``backward_dw()`` | None | set/accumulated by backward_dw |
| True  | False | no  | fp32 param.main_grad (+=, or = on the first micro-batch) | None | untouched |
| True  | False | yes | main_grad; flag set True | a zero dummy | dummy |
| True  | True  | no  | main_grad at ``backward_dw()`` | None | untouched |
| True  | True  | yes | main_grad at ``backward_dw()``; flag set True then | a zero dummy | dummy |

¹ whether the weight has the attribute; "returned": what backward returns to autograd.
The last row is where the reference system's modules disagreed (Linear returned the dummy,
GroupedLinear None); qlab returns the dummy, like the reference Linear module and like the
non-delayed row above it, so the presence of the flag alone decides None vs dummy.
"""

from __future__ import annotations

import inspect
import math
import weakref
from contextlib import contextmanager
from pathlib import Path

import torch
from torch import nn

from qlab import checks, kernels, ops
from qlab import quantize as Q
from qlab.kernels import fp8_gemm
from qlab.kernels.noise import drawn_noise, register_noise_source
from qlab.recipe import BACKWARD_OVERRIDES, ROLES, Recipe, get_recipe
from qlab.scaling import DelayedScaling, hadamard_matrix

STES = ("identity", "clipped")
GEMMS = ("auto", "emulated", "scaled_mm")
# Each GEMM's two operands as (role, axis). An operand is quantized along its GEMM's reduction axis
# (qlab.recipe's table) and the GEMM contracts it over that axis: axis -1 is dim 1 of the 2-D operand.
GEMM_OPERANDS = {
    "fprop": (("input", -1), ("weight", -1)),  # y  = x·Wᵀ   (N, K)·(M, K)ᵀ, reduced over K
    "dgrad": (("dgrad_grad_output", -1), ("dgrad_weight", 0)),  # dx = dy·W   (N, M)·(M, K), over M
    "wgrad": (("wgrad_grad_output", 0), ("wgrad_input", 0)),  # dW = dyᵀ·x  (N, M)ᵀ·(N, K), over N
}
_SCALER_OF_ROLE = {
    "input": "input",
    "wgrad_input": "input",
    "weight": "weight",
    "dgrad_weight": "weight",
    "grad_output": "grad_output",
    "dgrad_grad_output": "grad_output",
    "wgrad_grad_output": "grad_output",
}


@contextmanager
def highest_matmul_precision():
    """float32 matmuls without TF32 or bf16 shortcuts for the duration (restored afterwards)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)


def _compute_dtype(*tensors) -> torch.dtype:
    """float64 if any operand is float64, else float32 (16-bit operands are multiplied in float32)."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b in the compute dtype at "highest" float32 precision. Compiled code cannot switch the
    precision: it runs at the process's setting, PyTorch's default "highest" (TrainConfig(compile=True)
    checks)."""
    dtype = _compute_dtype(a, b)
    if torch.compiler.is_compiling():
        return a.to(dtype) @ b.to(dtype)
    with highest_matmul_precision():
        return a.to(dtype) @ b.to(dtype)


def _matmul(gemm: str, a, b) -> torch.Tensor:
    """The GEMM named ``gemm`` of its operands as ``QuantLinear.gemm_operands`` returns them: two
    tensors, each contracted over the axis GEMM_OPERANDS gives it, or two QTensors (tensor cores)."""
    if isinstance(a, Q.QTensor):
        return fp8_gemm.fp8_matmul(a, b)
    (_, axis_a), (_, axis_b) = GEMM_OPERANDS[gemm]
    return _gemm(a if axis_a == -1 else a.T, b.T if axis_b == -1 else b)


def _wgrad_into(out: torch.Tensor, dy, x, accumulate: bool) -> torch.Tensor:
    """out = dyᵀ·x or out += dyᵀ·x (the emulated GEMM writes into ``out``, no temporary)."""
    if isinstance(dy, Q.QTensor):
        product = fp8_gemm.fp8_matmul(dy, x)
        return out.add_(product) if accumulate else out.copy_(product)
    dtype = out.dtype
    with highest_matmul_precision():
        if accumulate:
            return out.addmm_(dy.T.to(dtype), x.to(dtype))
        return torch.mm(dy.T.to(dtype), x.to(dtype), out=out)


def _bias_grad_kernel(dy: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Σ over tokens of dy (N, M) in the compute dtype, as ``dtype``: ATen's summation order, kept
    opaque to torch.compile (whose own reduction order would change the last bits)."""
    return dy.to(_compute_dtype(dy)).sum(0).to(dtype)


_bias_grad = ops.define(
    "bias_grad",
    "(Tensor dy, ScalarType dtype) -> Tensor",
    _bias_grad_kernel,
    lambda dy, dtype: dy.new_empty(dy.shape[1], dtype=dtype),
)


def _as_tensor(operand, like: torch.Tensor) -> torch.Tensor:
    """A GEMM operand as a tensor in the compute dtype (a QTensor dequantized)."""
    return Q.dequantize(operand, _compute_dtype(like)) if isinstance(operand, Q.QTensor) else operand


def _distributed() -> bool:
    return (
        torch.distributed.is_available()
        and torch.distributed.is_initialized()
        and torch.distributed.get_world_size() > 1
    )


def check_linear_arguments(in_features, out_features, bias, dtype=None) -> None:
    """What nn.Linear's constructor takes, checked before torch sees it (a float in_features would
    fail inside torch.empty)."""
    checks.integer("in_features", in_features, low=1)
    checks.integer("out_features", out_features, low=1)
    checks.boolean("bias", bias)
    checks.floating_dtype("dtype", dtype)
    checks.allocatable("in_features × out_features", (out_features, in_features))


def check_gemm(gemm: str, recipe: Recipe) -> str:
    """``gemm`` if QuantLinear can run ``recipe`` with it; ValueError otherwise ("scaled_mm" needs a
    GEMM whose two operands are E4M3/E5M2 TensorwiseSpec)."""
    if gemm not in GEMMS:
        raise ValueError(f"unknown gemm {gemm!r}; expected one of: {', '.join(GEMMS)}")
    if gemm == "scaled_mm" and not any(
        fp8_gemm.is_fp8_spec(recipe.spec(a)) and fp8_gemm.is_fp8_spec(recipe.spec(b))
        for (a, _), (b, _) in GEMM_OPERANDS.values()
    ):
        raise ValueError(
            f"gemm='scaled_mm' needs a GEMM with two E4M3/E5M2 TensorwiseSpec operands; recipe "
            f"{recipe.name!r} has none (use gemm='auto' or 'emulated')"
        )
    return gemm


# --- fake quantization with a straight-through estimator -------------------------------------------


class _FakeQuant(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, spec, axis, ste, generator):
        if ste == "identity":
            return kernels.qdq(x, spec, axis, generator=generator)
        out, inside = Q.qdq_with_mask(x, spec, axis, generator=generator)
        ctx.save_for_backward(inside)
        return out

    @staticmethod
    def backward(ctx, grad):
        if ctx.saved_tensors:
            (inside,) = ctx.saved_tensors
            grad = grad * inside
        return grad, None, None, None, None


def fake_quant(
    x: torch.Tensor, spec, axis: int = -1, *, ste: str = "identity", generator: torch.Generator | None = None
) -> torch.Tensor:
    """qdq(x, spec, axis) whose gradient is the straight-through estimator.

    ste="identity": dL/dx = dL/dy everywhere; ste="clipped": zero where x was outside the
    representable range (clipped), as torch.ao.quantization.FakeQuantize does.
    """
    checks.choice("ste", ste, STES)
    checks.tensor("x", x, floating=True)
    return _FakeQuant.apply(x, Q.get_spec(spec), axis, ste, generator)


# --- QuantLinear ----------------------------------------------------------------------------------


class _LinearFunction(torch.autograd.Function):
    """y = x·Wᵀ + b, each GEMM's operands prepared by ``layer.gemm_operands`` (the layer's public
    interface: forward_scales, gemm_operands, record_amaxes, deliver_wgrad)."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer, is_first_microbatch):
        scales, rolls = layer.forward_scales(ctx)
        x_op, w_op = layer.gemm_operands("fprop", x, weight, scales)
        y = _matmul("fprop", x_op, w_op)
        if bias is not None:
            y = y + bias.to(y.dtype)
        if rolls:
            layer.record_amaxes({"input": x, "weight": weight})
        need_x, need_w = ctx.needs_input_grad[:2]
        # the forward ran on tensor cores where its operands are QTensors
        kept = layer.keeps_forward_codes(x, weight, y, need_x=need_x, need_w=need_w)
        ctx.kept = kept and isinstance(x_op, Q.QTensor)
        if layer.saves_dequantized:  # the forward's operands, dequantized
            ctx.save_for_backward(_as_tensor(x_op, x), _as_tensor(w_op, weight))
        elif ctx.kept:  # their FP8 codes, which the backward's GEMMs take along the other axis: x's for
            # wgrad, W's for dgrad, each only where that GEMM runs
            x_kept, w_kept = (x_op if need_w else None), (w_op if need_x else None)
            ctx.save_for_backward(*_parts(x_kept), *_parts(w_kept))
            ctx.codes_of = tuple(None if q is None else (q.spec, q.shape, q.dtype) for q in (x_kept, w_kept))
        else:  # None re-quantizes from high precision along the backward GEMMs' axes
            ctx.save_for_backward(x, weight)
        ctx.layer, ctx.scales, ctx.is_first_microbatch = layer, scales, is_first_microbatch
        ctx.training = layer.training
        ctx.dtypes = (x.dtype, weight.dtype, None if bias is None else bias.dtype)
        if torch.compiler.is_compiling() and y.dtype == x.dtype:
            # torch 2.11's Dynamo hands this backward dy = 0 when the output is `y.to(x.dtype)` that
            # returns y itself (measured on CPU and on an H100: compiled dx all zeros, dW and db wrong);
            # a fresh tensor avoids it, and inductor fuses the copy into the kernel that wrote y
            return y.clone()
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, dy):
        if ctx.kept:  # the forward's codes, to be contracted along axis 0 (W for dgrad, x for wgrad)
            x_codes, x_scales, w_codes, w_scales = ctx.saved_tensors
            x_saved = None if x_codes is None else _along_axis_0(x_codes, x_scales, *ctx.codes_of[0])
            w_saved = None if w_codes is None else _along_axis_0(w_codes, w_scales, *ctx.codes_of[1])
        else:
            x_saved, w_saved = ctx.saved_tensors
        layer, scales = ctx.layer, ctx.scales
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        quantized = ctx.kept or layer.quantized_backward  # kept codes: the forward decided
        dx = dw = db = None
        dy_wgrad = dy
        if need_x:
            dy_op, w_op = layer.gemm_operands("dgrad", dy, w_saved, scales, quantized=quantized)
            dx = _matmul("dgrad", dy_op, w_op).to(ctx.dtypes[0])
            if ctx.kept and need_w:  # the same codes serve wgrad, along the tokens
                dy_wgrad = _along_axis_0(dy_op.codes, dy_op.scales, dy_op.spec, dy_op.shape, dy_op.dtype)
        if need_w:  # drawn after dgrad's noise, as eager code draws it
            dy_op, x_op = layer.gemm_operands(
                "wgrad", dy_wgrad, x_saved, scales, quantized=quantized, after=dx
            )
            dw = layer.deliver_wgrad(dy_op, x_op, ctx.is_first_microbatch)
        if need_b:
            db = _bias_grad(dy, ctx.dtypes[2])
        if quantized:  # all-reduced only after a training-mode forward, as the forward's are
            layer.record_amaxes({"grad_output": dy}, reduce=ctx.training)
        layer.backward_done(ctx)
        return dx, dw, db, None, None


def _parts(q: Q.QTensor | None) -> tuple:
    """A kept QTensor's two tensors for save_for_backward (None, None when nothing is kept)."""
    return (None, None) if q is None else (q.codes, q.scales)


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)


def _codes_serve_both_axes(recipe: Recipe) -> bool:
    """Whether one quantization of x, of W and of dy serves both GEMMs that take each: current scaling,
    and each tensor's two roles one spec with one scale for the whole tensor and round to nearest (no
    draws), so quantizing along either axis gives the same codes, as TE's FP8 tensor and its transpose
    share their bytes. Decided once per layer, not while torch.compile traces (with dynamic shapes
    Dynamo cannot compare specs)."""
    if recipe.delayed:
        return False
    for first, second in (("input", "wgrad_input"), ("weight", "dgrad_weight")) + (
        ("dgrad_grad_output", "wgrad_grad_output"),
    ):
        spec = recipe.spec(first)
        if not (
            isinstance(spec, Q.TensorwiseSpec) and spec.granularity == "tensor" and spec.rounding == "rne"
        ):
            return False
        if spec != recipe.spec(second):
            return False
    return True


def _along_axis_0(codes, scales, spec, shape, dtype) -> Q.QTensor:
    """A per-tensor quantized tensor (codes in the tensor's own layout, one scale) as a QTensor to be
    contracted along axis 0: what ``quantize`` along axis 0 gives for the same codes and scale."""
    return Q.QTensor(codes=codes, scales=scales, spec=spec, axis=0, shape=shape, dtype=dtype)


_MOST_PENDING_FORWARDS = 64  # the training forwards without grad (no node) a layer remembers


def _same_scales(first: dict, second: dict) -> bool:
    """Whether two forwards' delayed-scaling scales are the same tensors or the same values."""
    return all(first[role] is second[role] or torch.equal(first[role], second[role]) for role in first)


def _recomputing() -> bool:
    """Whether a forward runs inside a backward pass: activation checkpointing recomputing it."""
    current_task = getattr(torch._C, "_current_graph_task_id", None)
    return current_task is not None and current_task() != -1


_EAGER_REASON = (
    "QuantLinear with delayed scaling, fuse_wgrad_accumulation or delay_wgrad runs eagerly: its "
    "backward updates amax histories, main_grad or deferred GEMMs, side effects torch.compile cannot trace"
)
_eager_linear = None  # _LinearFunction.apply hidden from torch.compile; made by the first layer needing it


def _eager_island():
    """``_LinearFunction.apply`` behind torch.compiler.disable, made once, eagerly (at a layer's
    construction: a traced forward only reads it; making it imports Dynamo, so not at import)."""
    global _eager_linear
    if _eager_linear is None:
        _eager_linear = torch.compiler.disable(_LinearFunction.apply, reason=_EAGER_REASON)
    return _eager_linear


class QlabLinear(nn.Linear):
    """What QuantLinear and TopKLinear share: nn.Linear's constructor with its arguments checked first,
    ``from_linear`` (a layer sharing another Linear's Parameters, buffers and hooks), and the markers
    model conversion reads. A subclass sets itself up in ``_configure(**options)``."""

    qlab_layer = True
    weight_layout = "out_in"

    def __init__(
        self, in_features: int, out_features: int, bias: bool = True, *, device=None, dtype=None, **options
    ):
        check_linear_arguments(in_features, out_features, bias, dtype)
        super().__init__(in_features, out_features, bias=bias, device=device, dtype=dtype)
        self._configure(**options)

    def _configure(self, **options):
        raise NotImplementedError

    @classmethod
    def from_linear(cls, linear: nn.Linear, **options):
        """A layer of this class sharing ``linear``'s weight and bias Parameters (no copy), buffers and
        hooks, configured by ``options`` (the constructor's keyword options)."""
        if not (isinstance(linear, nn.Linear) or is_conv1d(linear)):
            raise TypeError(
                f"linear must be an nn.Linear or a transformers Conv1D, got {checks.shown(linear)}"
            )
        known = inspect.signature(cls._configure).parameters
        unexpected = sorted(set(options) - set(known))
        if unexpected:
            raise TypeError(f"unexpected {cls.__name__} options: {unexpected}")
        layer = linear_sharing_parameters(cls, linear)
        layer._configure(**options)
        return layer


class QuantLinear(QlabLinear):
    """Drop-in nn.Linear whose three GEMMs follow a ``Recipe`` (see qlab.recipe); inputs (..., in_features).

    fuse_wgrad_accumulation: write wgrad into fp32 ``weight.main_grad`` (created as zeros if
    missing) instead of returning it; after ``forward(x, is_first_microbatch=True)`` the step's first
    wgrad into that weight's main_grad overwrites it and every later one accumulates (a module called
    twice, or layers sharing the weight, deliver all their parts; an empty micro-batch writes its zero
    sum). delay_wgrad: defer the wgrad GEMM until ``backward_dw()``. seed: the
    generator for stochastic rounding. gemm: "auto", "emulated" or "scaled_mm" (module docstring).
    See the module docstring for the None/dummy contract and for torch.compile.

    A QuantLinear made from transformers' Conv1D (``from_linear``, ``quantize_model``) keeps that
    layer's (in, out) weight Parameter as it is (``weight_layout == "in_out"``) and multiplies by its
    transpose; fused and delayed wgrad are for (out, in) weights only.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        recipe="bf16",
        fuse_wgrad_accumulation: bool = False,
        delay_wgrad: bool = False,
        seed: int = 0,
        gemm: str = "auto",
        device=None,
        dtype=None,
    ):
        options = dict(fuse_wgrad_accumulation=fuse_wgrad_accumulation, delay_wgrad=delay_wgrad, seed=seed)
        super().__init__(
            in_features, out_features, bias, device=device, dtype=dtype, recipe=recipe, gemm=gemm, **options
        )

    def _configure(
        self, recipe="bf16", fuse_wgrad_accumulation=False, delay_wgrad=False, seed=0, gemm="auto"
    ):
        recipe = get_recipe(recipe)
        self.gemm = check_gemm(gemm, recipe)
        self._recipe: Recipe = recipe
        self.fuse_wgrad_accumulation = checks.boolean("fuse_wgrad_accumulation", fuse_wgrad_accumulation)
        self.delay_wgrad = checks.boolean("delay_wgrad", delay_wgrad)
        if self.weight_layout == "in_out" and (self.fuse_wgrad_accumulation or self.delay_wgrad):
            raise ValueError(
                "fuse_wgrad_accumulation and delay_wgrad need an (out, in) weight; this layer keeps a "
                "transformers Conv1D's (in, out) weight"
            )
        self.seed = checks.seed("seed", seed)
        self.exact_backward = False  # True: the exact gradient of this forward, whatever the recipe says
        self._generators: dict = {}
        self._noise_source = register_noise_source(self._generator)
        self._deferred: list = []
        self._dummy: torch.Tensor | None = None
        # delayed scaling: (a weak reference to its autograd node, or None, and its scales) of each
        # training forward whose backward is still to come
        self._pending_scales: list = []
        self._grad_enabled = True
        self.scalers: dict[str, DelayedScaling] = {}
        self._codes_serve_both_axes = _codes_serve_both_axes(self.recipe)
        for role in ROLES:  # Hadamard matrices built now, not while torch.compile traces
            spec = self.recipe.spec(role)
            if spec is not None and spec.hadamard:
                hadamard_matrix(16, spec.hadamard_seed)
        if not self.compiles:
            _eager_island()
        if self.recipe.delayed:
            for role in ("input", "weight", "grad_output"):
                spec = self.recipe.spec(role)
                if spec is not None:
                    self.scalers[role] = DelayedScaling(
                        spec.element,
                        self.recipe.amax_history_len,
                        self.recipe.amax_algorithm,
                        self.recipe.margin,
                    )

    @property
    def recipe(self) -> Recipe:
        """The layer's recipe. Assigning one configures the layer afresh for it (its scalers, generators
        and deferred GEMMs start over; seed, gemm and the wgrad options are kept), as a new layer would."""
        return self._recipe

    @recipe.setter
    def recipe(self, recipe) -> None:
        self._configure(recipe, self.fuse_wgrad_accumulation, self.delay_wgrad, self.seed, self.gemm)

    def __getstate__(self):
        state = super().__getstate__() if hasattr(super(), "__getstate__") else self.__dict__
        return {**state, "_pending_scales": []}  # weak references to autograd nodes do not pickle

    def __setstate__(self, state):
        if "recipe" in state:  # pickled before the recipe became a property
            state["_recipe"] = state.pop("recipe")
        if "_forward_scales" in state:  # pickled before forwards awaiting backward were listed
            del state["_forward_scales"]
            state["_pending_scales"], state["_grad_enabled"] = [], True
        super().__setstate__(state)
        self._noise_source = register_noise_source(self._generator)  # a copy draws from its own generators
        self._codes_serve_both_axes = _codes_serve_both_axes(self.recipe)  # also for layers pickled before it

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe="bf16", **options) -> QuantLinear:
        """A QuantLinear sharing ``linear``'s weight and bias Parameters (no copy), buffers and hooks;
        ``options`` as the constructor's (fuse_wgrad_accumulation, delay_wgrad, seed, gemm)."""
        return super().from_linear(linear, recipe=recipe, **options)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, recipe={self.recipe.name}, "
            f"backward_override={self.recipe.backward_override}, gemm={self.gemm}"
        )

    def saved_operand_bytes(self, input_shape, backward_mode, high_precision_bytes: int = 2) -> int:
        """Bytes a low-precision implementation keeps from forward for this layer's backward (weight
        included), for an input of ``input_shape`` (..., in_features), by ``backward_mode`` (as a Recipe's
        backward_override; "none" is None):
        "high_precision" — x and W as they came (``high_precision_bytes`` each: 2 for bf16);
        "dequantized" — the forward's quantized x and W (``QTensor.storage_bytes``);
        None — the recipe's own backward: x quantized for wgrad (along the tokens) and W for dgrad
        (along the outputs), the column-wise copies TE keeps. qlab's emulation keeps float tensors in
        every mode; this counts what low-precision storage would hold."""
        if isinstance(backward_mode, str) and backward_mode.strip().lower() == "none":
            backward_mode = None  # as Recipe reads it (YAML's `none`)
        checks.choice("backward_mode", backward_mode, BACKWARD_OVERRIDES)
        checks.integer("high_precision_bytes", high_precision_bytes, low=1)
        shape = tuple(input_shape)
        if not shape or shape[-1] != self.in_features:
            raise ValueError(f"input_shape must end in in_features={self.in_features}, got {shape}")
        tokens = math.prod(shape[:-1])
        if backward_mode == "high_precision":
            return (tokens + self.out_features) * self.in_features * high_precision_bytes
        x = torch.ones(tokens, self.in_features)
        w = torch.ones(self.out_features, self.in_features)
        if backward_mode == "dequantized":
            operands = [(x, "input", -1), (w, "weight", -1)]
        else:
            operands = [(x, "wgrad_input", 0), (w, "dgrad_weight", 0)]
        total = 0
        for tensor, role, axis in operands:
            spec = self.recipe.spec(role)
            if spec is None:
                total += tensor.numel() * high_precision_bytes
            else:
                generator = torch.Generator().manual_seed(0) if spec.rounding == "stochastic" else None
                quantized = kernels.quantize(tensor, spec, axis, generator=generator)
                total += quantized.storage_bytes()
        return total

    @property
    def saves_dequantized(self) -> bool:
        """Whether backward multiplies by the forward's own (dequantized) operands."""
        return self.exact_backward or self.recipe.backward_override == "dequantized"

    @property
    def quantized_backward(self) -> bool:
        """Whether backward quantizes dy and re-quantizes its operands (the recipe's own backward)."""
        return self.recipe.backward_override is None and not self.exact_backward

    @property
    def compiles(self) -> bool:
        """Whether torch.compile traces this layer whole (False: it runs as an eager island, see
        the module docstring): current scaling without fused or delayed wgrad."""
        return not (self.recipe.delayed or self.fuse_wgrad_accumulation or self.delay_wgrad)

    def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
        checks.tensor("input x", x, floating=True)
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"input x must have shape (..., {self.in_features}) like nn.Linear's, got {tuple(x.shape)}"
            )
        if is_first_microbatch is not None:
            checks.boolean("is_first_microbatch", is_first_microbatch)
        weight, bias = oriented_weight(self), self.bias
        checks.same_device("input x", x, "the weight", weight)
        resets = bool(is_first_microbatch) and self.fuse_wgrad_accumulation and torch.is_grad_enabled()
        if resets and not _recomputing():  # the step's first wgrad into main_grad overwrites it, whichever
            self.weight._qlab_main_grad_resets = True  # use of the weight (or layer sharing it) comes first
        if x.numel() == 0:  # no values to quantize: nn.Linear's empty result, still in the graph
            if self.fuse_wgrad_accumulation or self.delay_wgrad:  # no wgrad, and .grad left alone
                if resets:
                    self._write_main_grad(None, None)  # this micro-batch's (empty) sum
                weight = weight.detach()
            return torch.nn.functional.linear(x, weight, bias)
        if torch.is_autocast_enabled(x.device.type):  # like nn.Linear: operands in the autocast dtype
            dtype = torch.get_autocast_dtype(x.device.type)
            x, weight = x.to(dtype), weight.to(dtype)
            bias = None if bias is None else bias.to(dtype)
        if x.dtype != weight.dtype:
            raise TypeError(
                f"input dtype {x.dtype} does not match the weight's {weight.dtype}; "
                f"cast one of them (QuantLinear does not mix dtypes silently)"
            )
        if self.recipe.delayed:  # (an eager island) inside the autograd Function grad mode is always off
            self._grad_enabled = torch.is_grad_enabled()
        linear = _LinearFunction.apply if self.compiles else _eager_island()
        with torch.autocast(x.device.type, enabled=False):
            y = linear(x.reshape(-1, self.in_features), weight, bias, self, is_first_microbatch)
        return y.reshape(*x.shape[:-1], self.out_features)

    def quant_state(self) -> dict:
        """What a checkpoint needs besides the Parameters for an exact resume: the stochastic-rounding
        generators' states and the delayed-scaling histories (plain tensors: ``weights_only`` loadable)."""
        return {
            "generators": {
                str(device): generator.get_state() for device, generator in self._generators.items()
            },
            "scalers": {  # CPU copies (the live ones stay on the layer's device): one read per checkpoint
                role: {"history": _cpu_copy(scaler.history), "scale": _cpu_copy(scaler.scale)}
                for role, scaler in self.scalers.items()
            },
        }

    def load_quant_state(self, state: dict) -> None:
        """Restore ``quant_state()``'s output (same recipe); generators are recreated on their devices."""
        if not isinstance(state, dict):
            raise TypeError(f"state must be the dict quant_state() returns, got {checks.shown(state)}")
        unknown = set(state.get("scalers", {})) - set(self.scalers)
        if unknown:
            raise ValueError(
                f"checkpoint has delayed-scaling state for {sorted(unknown)}, "
                f"but this layer's recipe {self.recipe.name!r} scales {sorted(self.scalers) or 'nothing'}"
            )
        extra = set(state) - {"generators", "scalers"}
        if extra:
            raise ValueError(f"state has keys {sorted(extra)}; quant_state() gives generators and scalers")
        generators, scalers = state.get("generators", {}), state.get("scalers", {})
        for name, part in (("generators", generators), ("scalers", scalers)):
            if not isinstance(part, dict):
                raise TypeError(f"state[{name!r}] must be a dict, got {checks.shown(part)}")
        restored = {}
        for device, generator_state in generators.items():
            checks.tensor(f"state['generators'][{device!r}]", generator_state, dtypes=(torch.uint8,))
            try:
                restored[torch.device(device)] = torch.Generator(device=device).set_state(generator_state)
            except RuntimeError as err:
                raise ValueError(f"state['generators'][{device!r}] is not a generator state: {err}") from None
        for role, saved in scalers.items():
            current = self.scalers[role]
            if not isinstance(saved, dict) or set(saved) != {"history", "scale"}:
                raise TypeError(
                    f"state['scalers'][{role!r}] must be a dict of history and scale tensors, "
                    f"got {checks.shown(saved)}"
                )
            for key in ("history", "scale"):
                value = checks.tensor(f"state['scalers'][{role!r}][{key!r}]", saved[key], floating=True)
                if value.shape != getattr(current, key).shape:
                    raise ValueError(
                        f"state['scalers'][{role!r}][{key!r}] has shape {tuple(value.shape)}, this layer's "
                        f"{tuple(getattr(current, key).shape)}"
                    )
            scale = saved["scale"].float()
            normal = torch.isfinite(scale) & (scale >= torch.finfo(torch.float32).tiny)
            if not normal.all():  # the forward trusts it unread, and divides by it
                raise ValueError(
                    f"state['scalers'][{role!r}]['scale'] must be finite and positive (a normal float32), "
                    f"got {scale.tolist()}"
                )
        self._generators = restored  # every part checked first; a device it lacks starts from the seed
        for role, saved in scalers.items():  # float32, as DelayedScaling keeps them
            self.scalers[role].history = saved["history"].float().clone()
            self.scalers[role].scale = saved["scale"].float().clone()

    # --- what _LinearFunction calls ---

    def forward_scales(self, node=None) -> tuple[dict | None, bool]:
        """(delayed scaling's scales for this forward — None for current scaling —, whether this forward
        records amaxes). A recomputation inside backward (activation checkpointing) reuses the original
        forward's scales and records nothing; ``model.eval()`` reads the scales without rolling them.
        ``node``: the forward's autograd context (``backward_done`` is told when its backward ran). A
        recomputation that cannot tell which forward it repeats — this layer ran several training
        forwards with different scales whose backward is still to come — raises RuntimeError."""
        if not self.recipe.delayed:
            return None, self.training
        if _recomputing():
            pending = self._pending()
            distinct = [scales for i, scales in enumerate(pending) if all(
                not _same_scales(scales, other) for other in pending[:i])]  # fmt: skip
            if len(distinct) > 1:
                raise RuntimeError(
                    f"delayed scaling under activation checkpointing: this layer ran {len(pending)} "
                    f"training forwards with {len(distinct)} different scales before this backward, and "
                    "a recomputation cannot tell which one it repeats; give each use its own layer, or "
                    "use current scaling"
                )
            if distinct:
                return distinct[0], False
        scales = {role: scaler.scale for role, scaler in self.scalers.items()}
        if self.training:
            # a forward in the graph is known by its node, which dies with a graph dropped unused; one
            # run without grad (the forward reentrant checkpointing recomputes later) only by its scales
            in_graph = self._grad_enabled and node is not None
            self._pending_scales.append((weakref.ref(node) if in_graph else None, scales))
            del self._pending_scales[:-_MOST_PENDING_FORWARDS]
        return scales, self.training

    def _pending(self) -> list[dict]:
        """The scales of the training forwards whose backward is still to come."""
        self._pending_scales = [(ref, kept) for ref, kept in self._pending_scales if ref is None or ref()]
        return [scales for _, scales in self._pending_scales]

    def backward_done(self, node) -> None:
        """The backward of the forward whose autograd context is ``node`` ran: its scales (or the
        recomputed forward's, the same) are no longer ones a recomputation could repeat."""
        for i, (_, scales) in enumerate(self._pending_scales):
            if scales is node.scales:
                del self._pending_scales[i]
                return

    def gemm_operands(
        self,
        gemm: str,
        a: torch.Tensor,
        b: torch.Tensor,
        scales: dict | None = None,
        *,
        quantized: bool = True,
        after: torch.Tensor | None = None,
    ):
        """The two operands of ``gemm`` ("fprop", "dgrad" or "wgrad"; GEMM_OPERANDS gives their roles
        and axes) as that GEMM takes them: QTensors where it runs on FP8 tensor cores, else
        quantize→dequantized tensors in the compute dtype; ``a`` and ``b`` as they are when not
        ``quantized`` (a backward override). ``scales``: delayed scaling's forward scales. Stochastic
        rounding draws both operands' noise from the layer's generator in one call, after ``after``
        (default ``a``) is computed, so compiled code draws in eager order."""
        if not quantized:
            return a, b
        operands = [(a, *GEMM_OPERANDS[gemm][0]), (b, *GEMM_OPERANDS[gemm][1])]
        kept = isinstance(a, Q.QTensor) or isinstance(b, Q.QTensor)  # codes kept only for tensor cores
        tensor_cores = kept or self._runs_on_tensor_cores(gemm, a, b)
        noises = self._draw_noise(operands, tensor_cores, a if after is None else after)
        return tuple(
            self._operand(tensor, role, axis, scales, noise, tensor_cores)
            for (tensor, role, axis), noise in zip(operands, noises)
        )

    def keeps_forward_codes(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        y: torch.Tensor,
        *,
        need_x: bool = True,
        need_w: bool = True,
    ) -> bool:
        """Whether, after a forward on tensor cores, backward takes that forward's FP8 codes of x (for
        wgrad) and W (for dgrad), and wgrad dgrad's codes of dy, instead of quantizing each again along
        its other axis: a backward will run (``need_x``/``need_w``: which gradients it computes), its
        GEMMs run on tensor cores (``y`` stands for dy's shape), and the recipe gives each tensor's roles
        one current-scaling spec whose codes do not depend on the axis (per tensor, RNE). The codes are
        the ones quantizing again would give (tests/test_fp8_gemm.py). Delayed scaling quantizes again:
        a forward recomputed under activation checkpointing would take the latest forward's scales."""
        if not (need_x or need_w) or not self.quantized_backward or not self._codes_serve_both_axes:
            return False
        gemms = [("dgrad", y, weight)] * need_x + [("wgrad", y, x)] * need_w
        return all(self._runs_on_tensor_cores(gemm, a, b, strict=False) for gemm, a, b in gemms)

    def record_amaxes(self, tensors: dict[str, torch.Tensor], *, reduce: bool = True) -> None:
        """Delayed scaling: record each role's amax and roll its history (once per forward/backward).
        With reduce_amax under torch.distributed each amax is one blocking all-reduce (TE fuses a step's
        amaxes into one); ``reduce=False`` skips it (a backward after an eval-mode forward)."""
        for role, tensor in tensors.items():
            if role in self.scalers:
                amax = tensor.detach().abs().amax().float()
                if reduce and self.recipe.reduce_amax and _distributed():  # every rank the same scales
                    torch.distributed.all_reduce(amax, op=torch.distributed.ReduceOp.MAX)
                self.scalers[role].observe(amax)  # stays on the device: no host synchronisation
                self.scalers[role].step()

    def deliver_wgrad(self, dy, x, is_first_microbatch):
        """The wgrad GEMM dyᵀ·x delivered by the table in the module docstring; returns what backward
        gives autograd for the weight (the wgrad, None or a zero dummy)."""
        flagged = hasattr(self.weight, "grad_added_to_main_grad")
        if self.delay_wgrad:
            self._deferred.append((dy, x))
            return self._dummy_wgrad() if self.fuse_wgrad_accumulation and flagged else None
        if self.fuse_wgrad_accumulation:
            self._write_main_grad(dy, x)
            return self._dummy_wgrad() if flagged else None
        return _matmul("wgrad", dy, x).to(self.weight.dtype)

    def backward_dw(self) -> None:
        """Run the wgrad GEMMs deferred by ``delay_wgrad`` (in backward order), delivered per the table."""
        deferred, self._deferred = self._deferred, []
        for dy, x in deferred:
            if self.fuse_wgrad_accumulation:
                self._write_main_grad(dy, x)
                continue
            wgrad = _matmul("wgrad", dy, x).to(self.weight.dtype)
            if self.weight.grad is None:
                self.weight.grad = wgrad
            else:
                self.weight.grad.add_(wgrad)

    # --- helpers ---

    def _generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    def _draw_noise(self, operands, blocked: bool, after: torch.Tensor) -> list:
        """Per operand, the stochastic-rounding noise it consumes (None without stochastic rounding or
        for a spec that draws float64 noise from the generator itself, an eager-only case)."""
        wanted = []
        for tensor, role, axis in operands:
            spec = self.recipe.spec(role)
            draws = spec is not None and spec.rounding == "stochastic" and Q.draws_float32_noise(spec)
            wanted.append(Q.noise_shape(tensor, spec, axis, blocked=blocked) if draws else None)
        shapes = [shape for shape in wanted if shape is not None]
        if not shapes:
            return [None] * len(operands)
        drawn = iter(drawn_noise(self._noise_source, shapes, after))
        return [None if shape is None else next(drawn) for shape in wanted]

    def _operand(self, t, role: str, axis: int, scales, noise, tensor_cores: bool):
        """One GEMM operand: ``t`` quantized by the role's spec along ``axis`` (see gemm_operands)."""
        spec = self.recipe.spec(role)
        if spec is None or isinstance(t, Q.QTensor):  # a QTensor: codes kept for this GEMM already
            return t
        scale = self._delayed_scale(role, scales)
        if scale is not None:  # the scaler's device may differ from t's (a model moved after training)
            scale = scale.to(t.device)
        generator = self._generator(t.device) if spec.rounding == "stochastic" and noise is None else None
        if scale is not None and t.is_cuda and kernels.covers(spec, fixed_scale=True):
            # the scaler's scale is a normal positive float32 by construction (DelayedScaling.step keeps
            # the previous one otherwise): no check that would read it back from the device every call
            compute = None if tensor_cores else _compute_dtype(t)
            return kernels.fp8_with_scale(t, spec, axis, scale, codes=tensor_cores, dtype=compute)
        if tensor_cores:
            return kernels.quantize(t, spec, axis, scale=scale, generator=generator, noise=noise)
        compute = _compute_dtype(t)  # dequantized values stay in the GEMM's dtype, not rounded to 16 bits
        return kernels.qdq(t, spec, axis, generator=generator, noise=noise, scale=scale, dtype=compute)

    def _delayed_scale(self, role: str, scales: dict | None) -> torch.Tensor | None:
        """Delayed scaling: the role's scale from ``scales`` (the forward's) or the live scaler; else None."""
        if not self.recipe.delayed:
            return None
        scaler = _SCALER_OF_ROLE[role]
        return scales[scaler] if scales and scaler in scales else self.scalers[scaler].scale

    def _runs_on_tensor_cores(self, gemm: str, a: torch.Tensor, b: torch.Tensor, strict: bool = True) -> bool:
        """Whether ``gemm`` runs through torch._scaled_mm (see ``gemm`` in the module docstring);
        ``strict``: with gemm="scaled_mm", a GEMM its kernels refuse raises."""
        if self.gemm == "emulated" or (self.gemm == "auto" and a.device.type != "cuda"):
            return False
        (role_a, axis_a), (role_b, axis_b) = GEMM_OPERANDS[gemm]
        spec_a, spec_b = self.recipe.spec(role_a), self.recipe.spec(role_b)
        if not (fp8_gemm.is_fp8_spec(spec_a) and fp8_gemm.is_fp8_spec(spec_b)):
            return False
        k, n = a.shape[axis_a], b.shape[0 if axis_b == -1 else 1]  # reduction length, output width
        reason = fp8_gemm.unsupported_reason(spec_a, spec_b, k, n, a.device)
        if reason is not None and self.gemm == "scaled_mm" and strict:
            raise ValueError(f"gemm='scaled_mm' cannot run this layer's {gemm} GEMM: {reason}")
        return reason is None

    def _dummy_wgrad(self) -> torch.Tensor:
        dummy = self._dummy
        if dummy is None or (dummy.shape, dummy.dtype, dummy.device) != (
            self.weight.shape,
            self.weight.dtype,
            self.weight.device,
        ):
            self._dummy = torch.zeros_like(self.weight, memory_format=torch.contiguous_format)
        return self._dummy.zero_()  # autograd may have stolen it as .grad; it is meaningless there

    def _write_main_grad(self, dy, x) -> None:
        """main_grad = dyᵀ·x where a forward with is_first_microbatch=True asked for the step's first
        write (the weight's flag, consumed here), else main_grad += dyᵀ·x (emulated: one GEMM into
        main_grad, no temporary). dy None: an empty micro-batch's zero sum."""
        weight = self.weight
        overwrite = getattr(weight, "_qlab_main_grad_resets", False)
        weight._qlab_main_grad_resets = False
        if getattr(weight, "main_grad", None) is None:
            weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        elif dy is None:
            if overwrite:
                weight.main_grad.zero_()
        if dy is not None:
            _wgrad_into(weight.main_grad, dy, x, accumulate=not overwrite)
        if hasattr(weight, "grad_added_to_main_grad"):
            weight.grad_added_to_main_grad = True


# --- model conversion ---------------------------------------------------------------------------

# the hook tables a module keeps; a converted layer shares them with the module it replaces, so hooks
# registered on it (accelerate, PEFT, a user's probes) keep firing and their handles keep working
_HOOK_TABLES = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_is_full_backward_hook",
    "_state_dict_hooks",
    "_state_dict_pre_hooks",
    "_load_state_dict_pre_hooks",
    "_load_state_dict_post_hooks",
)


def is_conv1d(module: nn.Module) -> bool:
    """transformers' ``Conv1D`` (GPT-2's projections): y = x·W + b with W stored (in, out)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers") and _has_matrix(module)


def _has_matrix(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return isinstance(weight, torch.Tensor) and weight.dim() == 2


def oriented_weight(layer: nn.Linear) -> torch.Tensor:
    """The layer's weight as (out, in), as nn.Linear stores it; a view for a converted Conv1D."""
    return layer.weight.t() if getattr(layer, "weight_layout", "out_in") == "in_out" else layer.weight


def why_not_converted(module: nn.Module, parent: nn.Module | None) -> str | None:
    """None if ``module`` is a Linear-like layer that can be converted (nn.Linear; a subclass holding
    no parameter or child module besides weight and bias whose forward is nn.Linear's or computes the
    same on probes; transformers' Conv1D); otherwise the reason it is left as it is."""
    cls = type(module)
    if getattr(cls, "qlab_layer", False):  # QuantLinear, TopKLinear
        return f"already converted ({cls.__name__})"
    if hasattr(module, "_hf_hook"):
        return "accelerate replaced its forward (device_map/offloading hook): convert before dispatching"
    if isinstance(parent, nn.MultiheadAttention):
        return "nn.MultiheadAttention reads this projection's weight directly and never calls it"
    if is_conv1d(module):
        return None
    if isinstance(module, nn.Linear):
        # a converted layer keeps only weight, bias and buffers; other state may feed an overridden
        # forward while a probe cannot see it (a scale that is 1.0 at initialisation)
        extra = [n for n, p in module._parameters.items() if p is not None and n not in ("weight", "bias")]
        if extra or module._modules:
            held = ", ".join(extra + list(module._modules))
            return f"{cls.__name__} holds {held} besides weight and bias: a converted layer would drop them"
        if cls.forward is not nn.Linear.forward:
            return _forward_differs(module)
        return None
    return f"{cls.__name__} is not an nn.Linear: qlab cannot tell how it uses its weight"


def _forward_differs(module: nn.Linear) -> str | None:
    """None if the subclass's own ``forward`` computes a Linear: on probe inputs of the layer's width,
    dtype and device (a 2-D and a 3-D batch, fixed seeds, in training and in eval mode, the global
    random state restored after), its output equals x·Wᵀ + b bit for bit, as
    ``F.linear`` computes it or as the product plus the bias written out by hand (what some
    architectures do); hooks are not run. Otherwise why the layer is left as it is."""
    cls = type(module)
    weight, bias = module.weight, module.bias
    prefix = f"{cls.__name__} overrides nn.Linear.forward"
    if weight.device.type == "meta" or weight.dim() != 2:
        return f"{prefix}, and its weight has no values to check it against F.linear with"
    generator = torch.Generator().manual_seed(0)
    devices = [weight.device] if weight.device.type == "cuda" else []
    was_training = module.training
    try:  # in both modes (a dropout shows in training only); the global RNG left as it was
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            for training in (was_training, not was_training):
                module.train(training)
                for shape in ((3, weight.shape[1]), (2, 3, weight.shape[1])):
                    x = torch.randn(shape, generator=generator).to(weight.dtype).to(weight.device)
                    got = cls.forward(module, x)
                    fused = torch.nn.functional.linear(x, weight, bias)
                    written = x @ weight.T if bias is None else (x @ weight.T) + bias
                    if not isinstance(got, torch.Tensor) or not (
                        _same_bits(got, fused) or _same_bits(got, written)
                    ):
                        return f"{prefix} with another computation than x·Wᵀ + b (checked on probe inputs)"
    except Exception as err:  # noqa: BLE001 — a forward that cannot run on a probe is not converted
        return f"{prefix}, and it failed on a probe input ({type(err).__name__}: {err})"
    finally:
        module.train(was_training)
    return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and bool(((a == b) | (a.isnan() & b.isnan())).all())


def linear_layers(model: nn.Module) -> list[tuple[str, nn.Module, str | None]]:
    """Every Linear-like module of ``model`` (nn.Linear and subclasses, transformers' Conv1D, any
    module whose class name has "Linear" and a 2-D weight), in registration order, as (name, module,
    None if it can be converted, else why not). A module registered under several names appears once
    per name."""
    checks.module("model", model)
    modules = dict(model.named_modules(remove_duplicate=False))
    found = []
    for name, module in modules.items():
        linear_like = isinstance(module, nn.Linear) or is_conv1d(module)
        if not linear_like and not ("Linear" in type(module).__name__ and _has_matrix(module)):
            continue
        parent = modules.get(name.rpartition(".")[0]) if name else None
        found.append((name, module, why_not_converted(module, parent)))
    return found


_MODULE_INTERNALS = ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set", *_HOOK_TABLES)


def _share_internals(layer: nn.Module, source: nn.Module) -> None:
    """Give ``layer`` ``source``'s buffers (same tensors, same persistence) and its hook tables."""
    for name, buffer in source._buffers.items():
        layer.register_buffer(name, buffer, persistent=name not in source._non_persistent_buffers_set)
    for table in _HOOK_TABLES:
        if hasattr(source, table):
            object.__setattr__(layer, table, getattr(source, table))


def linear_sharing_parameters(cls: type, linear: nn.Module) -> nn.Linear:
    """A ``cls`` (nn.Linear or a subclass) holding ``linear``'s weight and bias Parameters (no copy:
    the optimizer's, tied weights stay tied), its buffers and its hook tables, in the same train/eval
    mode. ``linear`` is an nn.Linear (or subclass) or transformers' Conv1D, whose (in, out) weight the
    new layer keeps as it is (``weight_layout = "in_out"``). The replaced module's class and plain
    attributes are remembered — not the module, whose Parameters FSDP would otherwise keep alive —
    so ``unquantize_model`` can rebuild it. Subclass set-up is the caller's."""
    layer = cls.__new__(cls)
    nn.Module.__init__(layer)
    conv1d = is_conv1d(linear)
    layer.weight_layout = "in_out" if conv1d else "out_in"
    rows, columns = linear.weight.shape
    layer.in_features, layer.out_features = (rows, columns) if conv1d else (columns, rows)
    layer.weight, layer.bias = linear.weight, linear.bias
    _share_internals(layer, linear)
    attributes = {k: v for k, v in vars(linear).items() if k not in _MODULE_INTERNALS}
    object.__setattr__(layer, "source_class", type(linear))  # not submodules: no state_dict entries
    object.__setattr__(layer, "source_attributes", attributes)
    layer.train(linear.training)
    return layer


def rebuild_source(layer: nn.Module) -> nn.Module:
    """The module a converted layer replaced, rebuilt around the layer's current Parameters, buffers
    and hook tables (an nn.Linear for a layer that replaced nothing)."""
    source_class = getattr(layer, "source_class", None)
    if source_class is None:
        return linear_sharing_parameters(nn.Linear, layer)
    module = source_class.__new__(source_class)
    nn.Module.__init__(module)
    module.__dict__.update(layer.source_attributes)
    module.weight, module.bias = layer.weight, layer.bias
    _share_internals(module, layer)
    module.train(layer.training)
    return module


def replace_linears(model: nn.Module, make, *, keep=(), candidates=None, keep_name: str = "keep") -> list:
    """Swap (in place) every candidate module by ``make(module, index)``, except names matching the
    patterns in ``keep`` (``qlab.checks.matches``; a bare string is one pattern; ``keep_name`` names
    the argument in errors). Candidates default to the convertible layers of ``linear_layers``.
    Every pattern must match a candidate, else ValueError naming the closest names. A module
    registered under several names gets one shared replacement; all replacements are built before
    any swap, so a refusal leaves the model as it was.
    Returns (name, module, replaced) for every candidate, kept ones included."""
    checks.module("model", model)
    checks.function("make", make, "a function (module, index) → replacement module")
    keep = checks.patterns(keep_name, keep)
    if candidates is None:
        candidates = [(name, module) for name, module, why in linear_layers(model) if why is None]
    if keep and not candidates:
        raise ValueError(f"{keep_name} patterns {keep} name layers to keep, but the model has no such layer")
    checks.patterns_match(keep_name, keep, [name for name, _ in candidates], what="Linear layer")
    chosen, replacements = [], {}
    for name, module in candidates:
        replaced = not any(checks.matches(name, pattern) for pattern in keep)
        if replaced and id(module) not in replacements:
            replacements[id(module)] = make(module, len(replacements))
        chosen.append((name, module, replaced))
    for name, module, replaced in chosen:
        if replaced:
            set_submodule(model, name, replacements[id(module)])
    return chosen


def conversion_report(model_layers, chosen, action: str, **columns) -> list[dict]:
    """One dict per Linear-like module: name, class, action (``action`` if it was converted, "kept"
    if a keep pattern matched it, "skipped" if it cannot be converted), reason, in/out features."""
    replaced = {name: done for name, _, done in chosen}
    rows = []
    for name, module, why in model_layers:
        if why is not None:
            done, reason = "skipped", why
        elif replaced.get(name):
            done, reason = action, ""
        else:
            done, reason = "kept", "matches a keep pattern"
        weight = module.weight
        in_features, out_features = (
            (weight.shape if is_conv1d(module) else weight.shape[::-1]) if weight.dim() == 2 else (None, None)
        )
        rows.append(
            {
                "name": name,
                "class": type(module).__name__,
                "action": done,
                "reason": reason,
                "in_features": in_features,
                "out_features": out_features,
                **columns,
            }
        )
    return rows


def quantize_model(model: nn.Module, recipe="bf16", *, keep_high_precision=(), **options) -> list[dict]:
    """Replace (in place) every Linear-like layer of ``model`` — nn.Linear, its subclasses that keep
    nn.Linear's forward, transformers' Conv1D — by a QuantLinear sharing its Parameters and hooks.

    keep_high_precision: module-name patterns left in high precision (``qlab.checks.matches``: fnmatch,
    or ``re:`` for a regular expression; e.g. ["lm_head", "model.layers.11.*"]; a bare string is one
    pattern; each must match a convertible layer, else ValueError naming the closest names). options
    go to QuantLinear (fuse_wgrad_accumulation, ...).
    A model quantized before is quantized again: each QuantLinear is rebuilt around the same Parameters
    with this recipe and these options (action "requantized", reason naming the recipe it had), or,
    where a keep pattern matches it, restored to the layer it replaced ("kept").
    Returns a report, one dict per Linear-like module: name, class, action ("quantized", "requantized",
    "kept" or "skipped"), reason (why a layer was kept, skipped or requantized), in/out features, recipe.

    recipe may be a ``qlab.plan.Plan`` (or the path of a saved one): each layer gets its planned format,
    a layer planned in high precision is kept; the plan must name exactly the model's convertible layers
    (those quantized before among them, rebuilt or restored as above).
    """
    from qlab import plan as plans

    if isinstance(recipe, Path) or (isinstance(recipe, str) and recipe.endswith(".json")):
        recipe = plans.Plan.load(recipe)
    if isinstance(recipe, plans.Plan):
        return _quantize_by_plan(model, recipe, keep_high_precision, options)
    recipe = get_recipe(recipe)
    base_seed = checks.seed("seed", options.pop("seed", 0))  # layer i gets seed base + i: no shared SR noise
    layers = [
        (name, module, None if isinstance(module, QuantLinear) else why)
        for name, module, why in linear_layers(model)
    ]
    before = {name: module.recipe.name for name, module, _ in layers if isinstance(module, QuantLinear)}

    def make(layer, index):
        source = rebuild_source(layer) if isinstance(layer, QuantLinear) else layer
        return QuantLinear.from_linear(source, recipe, seed=base_seed + index, **options)

    chosen = replace_linears(
        model,
        make,
        keep=keep_high_precision,
        keep_name="keep_high_precision",
        candidates=[(name, module) for name, module, why in layers if why is None],
    )
    for name, module, replaced in chosen:  # a kept layer quantized before goes back to high precision
        if not replaced and isinstance(module, QuantLinear):
            set_submodule(model, name, rebuild_source(module))
    return _requantized(conversion_report(layers, chosen, "quantized", recipe=recipe.name), before)


def _requantized(report: list[dict], before: dict[str, str]) -> list[dict]:
    """``report`` with the layers quantized before (``before``: name → the recipe they had) marked:
    "requantized" where quantized again, a kept one's reason saying its quantization was removed."""
    for row in report:
        if row["name"] in before and row["action"] == "quantized":
            row["action"], row["reason"] = "requantized", f"was quantized with {before[row['name']]}"
        elif row["name"] in before and row["action"] == "kept":
            row["reason"] += f"; its {before[row['name']]} quantization removed"
    return report


def _quantize_by_plan(model: nn.Module, plan, keep_high_precision, options) -> list[dict]:
    """quantize_model for a Plan: every convertible layer rebuilt in its planned format (or restored to
    the layer it replaced where the plan keeps it high), all replacements built before any swap."""
    from qlab import plan as plans

    if checks.patterns("keep_high_precision", keep_high_precision):
        raise ValueError(
            "keep_high_precision must be empty with a plan: the plan says which layers stay high"
        )
    layers = [  # a layer quantized before is rebuilt from the layer it replaced, as without a plan
        (name, module, None if isinstance(module, QuantLinear) else why)
        for name, module, why in linear_layers(model)
    ]
    sources = {
        name: rebuild_source(module) if isinstance(module, QuantLinear) else module
        for name, module, why in layers
        if why is None
    }
    plan.check_layers({name: oriented_weight(source).numel() for name, source in sources.items()})
    before = {name: module.recipe.name for name, module, _ in layers if isinstance(module, QuantLinear)}
    base_seed = checks.seed("seed", options.pop("seed", 0))
    replacements, chosen = {}, []
    for index, (name, module, _) in enumerate(layer for layer in layers if layer[2] is None):
        source = sources[name]
        planned = plan.layers[name]
        high = planned == plans.HIGH_PRECISION
        recipe = get_recipe(planned)
        replacements[name] = (
            source if high else QuantLinear.from_linear(source, recipe, seed=base_seed + index, **options)
        )
        chosen.append((name, module, not high))
    for name, replacement in replacements.items():
        set_submodule(model, name, replacement)
    report = conversion_report(layers, chosen, "quantized")
    for row in report:
        if row["name"] in plan.layers:
            row["recipe"] = plan.layers[row["name"]]
            if row["action"] == "kept":
                row["reason"] = "the plan keeps it in high precision"
    return _requantized(report, before)


def unquantize_model(model: nn.Module) -> list[str]:
    """The inverse of quantize_model: every QuantLinear back to the class it replaced (or an
    nn.Linear), rebuilt around the same Parameters, buffers and hooks; returns the names restored."""
    return plain_linears(model, QuantLinear)


def plain_linears(model: nn.Module, kind: type = nn.Linear) -> list[str]:
    """Replace (in place) every module that is an instance of ``kind`` but not exactly nn.Linear (a
    QuantLinear, a TopKLinear, ...) by the module it replaced, rebuilt around the same Parameters
    (``rebuild_source``; an nn.Linear if it replaced nothing); return the names replaced."""

    checks.module("model", model)
    candidates = [
        (name, m)
        for name, m in model.named_modules(remove_duplicate=False)
        if isinstance(m, kind) and isinstance(m, nn.Linear) and type(m) is not nn.Linear
    ]
    chosen = replace_linears(model, lambda module, index: rebuild_source(module), candidates=candidates)
    return [name for name, _, _ in chosen]


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at the qualified ``name`` of ``model`` (its parent's attribute)."""
    if not name:
        raise ValueError(
            "model is itself a Linear; wrap it in a container (nn.Sequential(model)) to convert it"
        )
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)
