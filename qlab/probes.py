"""Probes: record what tensors look like inside a model, per step, as a tidy DataFrame.

    with ProbeSet(model, modules=["blocks.*.attn.*"], what_if={"mxfp8": "mxfp8"}) as probes:
        for step in range(steps):
            loss = model(x).sum(); loss.backward()
            probes.record_param_grads()          # param.grad after accumulation
            optimizer.step(); probes.step()      # advance the step counter
    probes.to_frame()                            # step, rank, module, role, stat, value

Roles: ``input``/``output`` (module activations), ``grad_input``/``grad_output`` (module
gradients), ``grad_flow`` (a parameter's gradient as it flows through backward, before
accumulation), ``param_grad`` (``param.grad`` when ``record_param_grads`` is called: after
accumulation, or at optimizer-step time after unscaling), ``probe`` (anything passed to
``probe(tensor, name)``, e.g. from inside a custom autograd.Function's backward).

A ProbeSet installs hooks only while attached (``with`` or ``attach()``/``detach()``) and only
for sampled steps: between samples and after detaching the model carries no hooks at all.
``probe()`` with no active set, or on a step that is not sampled, does nothing.
"""

from __future__ import annotations

import functools
import gc
import math
import threading

import numpy as np
import pandas as pd
import torch
from torch import nn

from qlab import checks, kernels
from qlab import quantize as Q
from qlab.kernels import cpu_qdq

STATS = ("min", "max", "mean", "std", "l1", "l2", "amax", "dynamic_range", "zero_fraction", "outlier_ratio")
WHAT_IF_STATS = ("underflow_fraction", "saturation_fraction", "bulk_rel_error", "qdq_mse", "sqnr_db")
BLOCK_STATS = (
    "scale_log2_min",
    "scale_log2_max",
    "scale_log2_mean",
    "scale_log2_std",
    "clipped_block_fraction",
    "flushed_block_fraction",
    "underflow_block_fraction",
)
RECORD_COLUMNS = ["step", "rank", "module", "role", "stat", "value"]
ROLES = ("input", "output", "grad_input", "grad_output", "grad_flow", "param_grad", "probe")
_ACTIVE: list[ProbeSet] = []


def tensor_stats(tensor: torch.Tensor, stats=STATS) -> dict[str, float]:
    """Statistics of a floating-point tensor; sums in float64, min/max/amax exact. std never comes
    from E[x²] − E[x]² over data far off zero: two-pass in torch, and in the CPU kernel each block's
    Σ(x − mean)² in one pass only where at most one bit cancels (else two), blocks merged by Chan et al.

    std is the population standard deviation; dynamic_range is log2(amax) − log2(smallest non-zero
    |x|) in binades (NaN when every element is zero); zero_fraction counts exact zeros;
    outlier_ratio is the largest channel amax over the (lower) median channel amax, channels being
    the last axis (an LLM activation's features: ≫ 1 where a few channels carry massive values; inf
    when the median channel is all zeros). All reductions are stacked and moved to the host in one
    transfer.
    """
    stats = checks.names("stats", stats, STATS)
    checks.tensor("tensor", tensor, real=True)
    vector = _stats_vector(tensor, "outlier_ratio" in stats).cpu().numpy()
    return dict(zip(stats, _stats_table(vector[None], np.array([tensor.numel()]), stats)[0].tolist()))


def _stats_vector(tensor: torch.Tensor, outliers: bool) -> torch.Tensor:
    """The float64 reductions ``tensor_stats`` reads, as one vector on the tensor's device (no host
    transfer): min, max, mean, variance, Σx², Σ|x|, amax, smallest non-zero |x|, zeros, and the top and
    median channel amax (placeholders unless ``outliers``)."""
    if tensor.numel() == 0:
        return torch.full((11,), math.nan, dtype=torch.float64, device=tensor.device)
    return _stats_rows(_as_batch(tensor), outliers)[0]


def _as_batch(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` (non-empty) as a batch of one (1, rows, channels), channels being the last axis."""
    channels = tensor.shape[-1] if tensor.dim() else 1
    return tensor.detach().reshape(1, -1, channels)


def _stats_rows(batch: torch.Tensor, outliers: bool) -> torch.Tensor:
    """``_stats_vector`` of each of N equally shaped tensors at once: batch (N, rows, channels), every
    tensor non-empty, → (N, 11) float64. Two-pass variance: E[x²] − E[x]² would cancel (notebook 02)."""
    x = batch.flatten(1)
    magnitude = x.abs()
    wide = x.double()
    smallest = torch.where(magnitude > 0, magnitude, torch.inf).amin(1).double()
    if outliers:  # one more pass over the tensors: only when asked
        channels = batch.abs().amax(1)  # (N, channels)
        top_and_median = [channels.amax(1).double(), channels.median(1).values.double()]
    else:
        top_and_median = [smallest, smallest]
    mean = wide.mean(1, keepdim=True)
    centered = wide - mean
    return torch.stack(
        [
            x.amin(1).double(),
            x.amax(1).double(),
            mean[:, 0],
            (centered * centered).mean(1),
            (wide * wide).sum(1),
            magnitude.sum(1, dtype=torch.float64),
            magnitude.amax(1).double(),
            smallest,
            (x == 0).sum(1).double(),
            *top_and_median,
        ],
        dim=1,
    )


_FUSED_MIN_NUMEL = 1024  # below this a compiled call costs more than the eager reductions
_BATCH_MAX_NUMEL = 2**20  # above this one call per tensor amortizes its dispatch; below, batch
_BATCH_MAX_BYTES = 64 * 2**20  # copies queued for one batched reduction before it runs anyway
_fused_failed: set = set()


@functools.cache
def _fused_stats_rows():
    """``_stats_rows`` compiled, made on first use (torch.compile imports Dynamo: not at import)."""
    return torch.compile(_stats_rows, dynamic=True)


def _stats_rows_fast(batch: torch.Tensor, outliers: bool) -> torch.Tensor:
    """``_stats_rows`` through one compiled, fused kernel for large enough batches (the same values up
    to float64 summation order; eager if compilation is off with QLAB_COMPILE=0 or fails)."""
    key = (batch.dtype, batch.device.type)
    if batch.numel() >= _FUSED_MIN_NUMEL and key not in _fused_failed and kernels.compiled.compile_enabled():
        try:
            return _fused_stats_rows()(batch, outliers)
        except Exception:  # no compiler, an unsupported dtype, ...: the eager reductions
            _fused_failed.add(key)
    return _stats_rows(batch, outliers)


def _stats_table(vectors: np.ndarray, numels: np.ndarray, stats) -> np.ndarray:
    """The named statistics (``stats``, of STATS) of R tensors from their ``_stats_vector``s: vectors
    (R, 11) float64, numels (R,) → (R, len(stats)); a tensor of no elements gets NaN throughout. std and
    l2 are square roots, dynamic_range log2(amax) − log2(smallest non-zero |x|) (Python's log2), NaN
    where there is no non-zero element, outlier_ratio the top over the median channel amax."""
    low, high, mean, variance, squares, l1, amax, smallest, zeros, top, median = vectors.T
    with np.errstate(all="ignore"):
        named = {
            "min": low,
            "max": high,
            "mean": mean,
            "std": np.sqrt(variance),
            "l1": l1,
            "l2": np.sqrt(squares),
            "amax": amax,
            "dynamic_range": _log2_ratio(amax, smallest) if "dynamic_range" in stats else None,
            "zero_fraction": zeros / numels,
            "outlier_ratio": np.where(median > 0, top / median, np.where(top > 0, math.inf, math.nan)),
        }
    table = np.stack([named[name] for name in stats], axis=1) if stats else np.empty((len(vectors), 0))
    table[numels == 0] = math.nan
    return table


def _log2_ratio(amax: np.ndarray, smallest: np.ndarray) -> np.ndarray:
    """log2(amax) − log2(smallest) elementwise by Python's math.log2 (the platform's log2, whose bits
    NumPy's own need not give), NaN where smallest is not finite or amax not positive."""
    defined = np.isfinite(smallest) & (amax > 0)
    top = np.array(list(map(math.log2, np.where(defined, amax, 1.0).tolist())))
    bottom = np.array(list(map(math.log2, np.where(defined, smallest, 1.0).tolist())))
    return np.where(defined, top - bottom, math.nan)


def log2_histogram(tensor: torch.Tensor, low: int = -40, high: int = 20) -> dict[str, float]:
    """Counts of |x| per binade: key "hist/2^k" counts low ≤ k = floor(log2|x|) < high; values below
    2^low (and zeros) go to "hist/below", at or above 2^high (and ±inf) to "hist/above"; NaN is in no
    bin (the counts then sum to fewer than the elements). Exponents from frexp, in x's own precision
    (16-bit values read as float32, exactly)."""
    checks.tensor("tensor", tensor, real=True)
    checks.integer("low", low, low=-1100, high=1100)  # float64's binades lie within ±1075
    if checks.integer("high", high, low=-1100, high=1100) <= low:
        raise ValueError(f"high must be greater than low, got low={low}, high={high}")
    magnitude = tensor.detach().abs().flatten()
    if magnitude.dtype != torch.float64:
        magnitude = magnitude.float()  # exact for every other real dtype a probe sees
    exponent = torch.frexp(magnitude).exponent - 1  # floor(log2 |x|) read from the bits
    finite, nonzero = torch.isfinite(magnitude), magnitude > 0  # NaN is neither > 0 nor ≤ 0
    binned = finite & nonzero & (exponent >= low) & (exponent < high)
    counts = torch.bincount((exponent[binned] - low).long(), minlength=high - low).tolist()
    values = {f"hist/2^{low + i}": float(c) for i, c in enumerate(counts)}
    values["hist/below"] = float((magnitude == 0).sum() + (finite & nonzero & (exponent < low)).sum())
    values["hist/above"] = float((torch.isinf(magnitude) | (finite & (exponent >= high))).sum())
    return values


def _nonempty(tensor: torch.Tensor) -> None:
    if tensor.numel() == 0:
        raise ValueError(f"tensor must hold at least one value, got shape {tuple(tensor.shape)}")


def what_if_stats(tensor: torch.Tensor, spec, axis: int = -1) -> dict[str, float]:
    """What quantizing ``tensor`` by ``spec`` along ``axis`` would do to it.

    underflow_fraction: non-zero elements that become zero (flushed); saturation_fraction: elements
    outside the representable range (clipped); bulk_rel_error: the (lower) median over non-zero
    elements of |x̂ − x| / |x|, which a few huge values cannot hide the way they dominate SQNR's
    signal energy; qdq_mse and sqnr_db of the quantize→dequantize round trip.
    Tensors that cannot be blocked along ``axis`` (e.g. a length not divisible with pad=False) raise.
    """
    checks.tensor("tensor", tensor, real=True)
    _nonempty(tensor)
    x = tensor.detach().contiguous()  # reductions in one order whatever the strides
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    spec = Q.get_spec(spec)
    if spec.hadamard:
        x_hat, inside = kernels.qdq(x, spec, axis), torch.ones_like(x, dtype=torch.bool)
    else:
        x_hat, inside = Q.qdq_with_mask(x, spec, axis)
    nonzero = x != 0
    count = max(x.numel(), 1)
    relative = ((x_hat.double() - x.double()).abs() / x.double().abs())[nonzero & torch.isfinite(x)]
    return {
        "underflow_fraction": ((x_hat == 0) & nonzero).sum().item() / count,
        "saturation_fraction": (~inside).sum().item() / count,
        "bulk_rel_error": relative.median().item() if relative.numel() else math.nan,
        "qdq_mse": ((x_hat.double() - x.double()) ** 2).mean().item(),
        "sqnr_db": Q.sqnr_db(x, x_hat),
    }


def block_stats(tensor: torch.Tensor, spec, axis: int = -1, worst: int = 3) -> dict[str, float]:
    """What a block ``spec`` (MX, NVFP4, FP8 blockwise) does to ``tensor``'s blocks along ``axis``
    (TransformerEngine's debug tools give no per-block view; this is it):

    scale_log2_min/max/mean/std: log2 of what dequantize multiplies each block by (MX: the E8M0
      power of two; NVFP4: the global × the E4M3 block scale; blockwise FP8: 1/scale), over
      non-zero blocks with a finite scale;
    scale_code/<c>: how many blocks (2-D specs: tiles) got scale code c — the E8M0 byte or the
      E4M3 code — for the codes that occur (MX and NVFP4 only);
    clipped_block_fraction: non-zero blocks with an element beyond the element format's range;
    flushed_block_fraction: non-zero blocks with at least one non-zero element quantized to zero;
    underflow_block_fraction: non-zero blocks quantized to zero altogether;
    worst_<i>/rel_error, worst_<i>/row, worst_<i>/block: the ``worst`` blocks by relative L2 error
      ‖x̂_b − x_b‖/‖x_b‖, located by row (the other axes in row-major order, ``axis`` moved last)
      and block index along ``axis``.

    Stochastic-rounding specs draw from torch's global generator here; Hadamard specs are measured
    in the rotated domain, where their blocks live.
    """
    checks.tensor("tensor", tensor, real=True)
    spec = Q.get_spec(spec)
    if spec.block_size is None:
        raise ValueError(
            f"spec must be a block spec (MXSpec, NVFP4Spec, BlockwiseSpec), got {type(spec).__name__}"
        )
    checks.integer("worst", worst, low=0)
    _nonempty(tensor)
    x = tensor.detach().contiguous()  # reductions in one order whatever the strides
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        x = x.float()
    axis = Q.check_input(x, spec, axis)
    layout = Q.to_layout(x, spec, axis)  # (..., n_blocks, block)
    parts, out = spec.quantize_layout(layout)
    scales = spec.block_multipliers(parts)
    codes = spec.scale_codes(parts)  # None for BlockwiseSpec: float32 scales have no codes to count
    blocks_x, blocks_error = layout.double(), (out.double() - layout.double())
    nonzero_elements = blocks_x != 0
    nonzero = nonzero_elements.any(-1) & torch.isfinite(scales)
    flushed = ((out == 0) & nonzero_elements).any(-1) & nonzero
    underflow = (out == 0).all(-1) & nonzero
    clipped = ~spec.inside_range(layout, parts).all(-1) & nonzero
    log2_scales = torch.log2(scales.double()[nonzero & (scales > 0)])  # NVIDIA NVFP4 block scales may be 0
    count = max(int(nonzero.sum()), 1)
    values = {
        "scale_log2_min": log2_scales.min().item() if log2_scales.numel() else math.nan,
        "scale_log2_max": log2_scales.max().item() if log2_scales.numel() else math.nan,
        "scale_log2_mean": log2_scales.mean().item() if log2_scales.numel() else math.nan,
        "scale_log2_std": log2_scales.std(correction=0).item() if log2_scales.numel() else math.nan,
        "clipped_block_fraction": int(clipped.sum()) / count,
        "flushed_block_fraction": int(flushed.sum()) / count,
        "underflow_block_fraction": int(underflow.sum()) / count,
    }
    if codes is not None:
        found, counts = torch.unique(codes.flatten(), return_counts=True)
        values.update({f"scale_code/{int(c)}": float(n) for c, n in zip(found.tolist(), counts.tolist())})
    relative = torch.linalg.vector_norm(blocks_error, dim=-1) / torch.linalg.vector_norm(blocks_x, dim=-1)
    relative = torch.where(nonzero, relative, -math.inf).flatten()
    blocks_per_row = layout.shape[-2]
    for i, index in enumerate(relative.topk(min(worst, int(nonzero.sum()))).indices.tolist(), 1):
        values[f"worst_{i}/rel_error"] = relative[index].item()
        values[f"worst_{i}/row"] = float(index // blocks_per_row)
        values[f"worst_{i}/block"] = float(index % blocks_per_row)
    return values


def _first_tensor(values):
    return next((v for v in values if isinstance(v, torch.Tensor)), None)


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def probe(tensor: torch.Tensor, name: str) -> None:
    """Record ``tensor`` under ``name`` (role "probe") in every active ProbeSet whose roles include
    "probe"; a no-op when there is none."""
    checks.tensor("tensor", tensor)
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {checks.shown(name)}")
    for probes in _ACTIVE:
        if "probe" in probes.roles:
            probes._record(name, "probe", tensor)


class ProbeSet:
    """Hooks on selected modules and their parameters that record statistics per sampled step.

    modules: module-name patterns (``qlab.checks.matches``: fnmatch, or ``re:``) and/or module
    classes ("*" or None: every module with parameters or the model itself); roles: which of ROLES to
    record; stats: which of STATS; what_if: {label: spec} adds WHAT_IF_STATS per spec (stat names
    "<label>/<stat>"), or {label: (spec, patterns)} for the modules matching ``patterns`` only (so one
    set can ask MXFP8 of some layers and NVFP4 of others); block_stats: add ``block_stats`` rows
    ("<label>/block/<stat>") for MX and NVFP4 what-ifs; sampling: steps start ≤ s < end with
    (s − start) % every == 0; ranks: record only on these torch.distributed ranks (records carry the
    rank either way; it is read at ``attach()``, ``step()`` and ``record_param_grads()``, so make or
    attach the set after ``init_process_group``); histograms: add log2_histogram counts per tensor.
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        modules=None,
        *,
        roles=ROLES,
        stats=STATS,
        what_if=None,
        what_if_axis: int = -1,
        every: int = 1,
        start: int = 0,
        end: int | None = None,
        ranks=None,
        histograms: bool = False,
        block_stats: bool = False,
    ):
        if model is not None:
            checks.module("model", model)
        roles = checks.names("roles", roles, ROLES)
        stats = checks.names("stats", stats, STATS)
        if what_if is not None and not isinstance(what_if, dict):
            raise TypeError(f"what_if must be a dict {{label: spec}}, got {checks.shown(what_if)}")
        checks.integer("what_if_axis", what_if_axis)
        checks.integer("every", every, low=1)
        checks.integer("start", start, low=0)
        if end is not None and checks.integer("end", end) <= start:
            raise ValueError(f"end must be greater than start={start} (or None), got {end}")
        if ranks is not None:
            if not isinstance(ranks, (list, tuple, set, frozenset, range)):
                raise TypeError(
                    f"ranks must be a list of ints (or None for every rank), got {checks.shown(ranks)}"
                )
            ranks = {checks.integer("ranks", rank, low=0) for rank in ranks}
        self.model, self.roles, self.stats = model, roles, stats
        self.what_if = {}  # label -> (spec, module patterns or None for every module)
        for label, value in (what_if or {}).items():
            spec, patterns = value if isinstance(value, tuple) and len(value) == 2 else (value, None)
            try:
                self.what_if[label] = (
                    Q.get_spec(spec),
                    None if patterns is None else checks.patterns(label, patterns),
                )
            except (TypeError, ValueError) as err:
                raise type(err)(f"what_if[{label!r}]: {err}") from None
        self.block_stats = checks.boolean("block_stats", block_stats)
        self.what_if_axis = what_if_axis
        self.every, self.start, self.end = every, start, end
        self.ranks = ranks
        self.histograms = checks.boolean("histograms", histograms)
        self._step = 0
        self._read_rank_and_sampling()
        self._blocks: list[pd.DataFrame] = []  # the records read so far, in recording order
        self._pending: list[tuple] = []  # statistics still on the device: moved when records are read
        self._queue = _StatsQueue("outlier_ratio" in stats)
        self._handles: list = []
        self.selected = self._select(modules) if model is not None else {}

    # --- selection and hooks ---

    def _select(self, modules) -> dict[str, nn.Module]:
        if modules is None:
            patterns = ["*"]
        elif isinstance(modules, (str, type)):
            patterns = [modules]
        elif isinstance(modules, (list, tuple, set)) and all(isinstance(p, (str, type)) for p in modules):
            patterns = list(modules)
        else:
            raise TypeError(
                "modules must be a pattern string, a module class or a list of them, "
                f"got {checks.shown(modules)}"
            )
        chosen, hits = {}, {id(p): 0 for p in patterns}
        for name, module in self.model.named_modules():
            for pattern in patterns:
                if isinstance(pattern, type):
                    hit = isinstance(module, pattern)
                elif pattern == "*":
                    hit = any(True for _ in module.parameters(recurse=False)) or module is self.model
                else:
                    hit = checks.matches(name, pattern)
                if hit:
                    hits[id(pattern)] += 1
                    chosen.setdefault(name or "model", module)
        names = [name for name, _ in self.model.named_modules() if name]
        for pattern in patterns:
            if hits[id(pattern)] == 0:
                if isinstance(pattern, type):
                    raise ValueError(f"modules class {pattern.__name__} matches no module of the model")
                checks.patterns_match("modules", [pattern], names)
        return chosen

    def attach(self) -> ProbeSet:
        """Activate the set; hooks are installed only for sampled steps (none in between)."""
        if self not in _ACTIVE:
            _ACTIVE.append(self)
        self._sync_hooks()
        return self

    @property
    def current_step(self) -> int:
        """The step records are made for (``step()`` advances it; a resumed run may set it)."""
        return self._step

    @current_step.setter
    def current_step(self, step: int) -> None:
        self._step = checks.integer("current_step", step, low=0)
        self._sync_hooks()

    def detach(self) -> None:
        self._queue.release()
        self._remove_hooks()
        if self in _ACTIVE:
            _ACTIVE.remove(self)

    def _sync_hooks(self) -> None:
        """Install or remove the hooks for the current step (and read the rank and sampling)."""
        self._read_rank_and_sampling()
        if self.attached and self._sampled:
            if not self._handles:
                self._install_hooks()
        else:
            self._remove_hooks()
            self._queue.release()

    def _install_hooks(self) -> None:
        # Gradients are caught by tensor hooks set during forward, not by full backward hooks, which
        # wrap every input and output in a Python autograd Function (+13 % of notebook 01's step)
        for name, module in self.selected.items():
            if {"input", "output", "grad_output"} & set(self.roles):
                hook = self._forward_hook(name)
                self._handles.append(module.register_forward_hook(hook, with_kwargs=True))
            if "grad_input" in self.roles:
                tap = self._input_tap(name)
                self._handles.append(module.register_forward_pre_hook(tap, with_kwargs=True))
            if "grad_flow" in self.roles:
                for param_name, param in module.named_parameters(recurse=False):
                    if param.requires_grad:
                        self._handles.append(param.register_hook(self._grad_hook(f"{name}.{param_name}")))

    def _read_rank_and_sampling(self) -> None:
        """Note the rank and whether the current step is sampled, for the per-record path: read at
        ``attach()``, ``step()``, setting ``current_step`` and ``record_param_grads()``, not at every
        record (a record costs a few microseconds, and these added a third to it)."""
        self._rank = _rank()
        self._sampled = self.sampling()

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> ProbeSet:
        return self.attach()

    def __exit__(self, *exc) -> None:
        self.detach()

    @property
    def attached(self) -> bool:
        return self in _ACTIVE

    def _forward_hook(self, name):
        def hook(module, inputs, kwargs, output):
            if "input" in self.roles:  # the first tensor argument, positional or (Llama's) keyword
                first = _first_tensor(inputs)
                self._record_first(
                    name, "input", first if first is not None else _first_tensor(kwargs.values())
                )
            outputs = output if isinstance(output, (tuple, list)) else (output,)
            if "output" in self.roles:
                self._record_first(name, "output", outputs)
            if "grad_output" in self.roles:  # the first output that takes a gradient, as a full backward
                # hook's first non-None grad_output: from all its consumers, after the module's own
                # backward pre-hooks (they act on the wrapper torch puts around it after this hook)
                for value in outputs:
                    if isinstance(value, torch.Tensor) and value.requires_grad:
                        value.register_hook(self._gradient_recorder(name, "grad_output"))
                        break

        return hook

    def _input_tap(self, name):
        """Pass the module a view of its first positional tensor that requires a gradient (its first
        floating keyword tensor when it has no positional one: ``self_attn(hidden_states=h)``), whose
        gradient hook records ``grad_input``: the gradient into this module alone, the one a full
        backward hook gives, even where the tensor feeds other modules too (a residual stream)."""

        def pre_hook(module, inputs, kwargs):
            if not self._sampled:
                return None
            positional = _first_tensor(inputs) is not None
            for index, value in enumerate(inputs if positional else kwargs.values()):
                if isinstance(value, torch.Tensor) and value.is_floating_point() and value.requires_grad:
                    tapped = value.view_as(value)
                    self._on_tap_gradient(tapped, name)
                    if positional:
                        return (*inputs[:index], tapped, *inputs[index + 1 :]), kwargs
                    return inputs, {**kwargs, list(kwargs)[index]: tapped}
            return None

        return pre_hook

    def _on_tap_gradient(self, tapped: torch.Tensor, name: str) -> None:
        """Record the tap's gradient as ``grad_input``: a pre-hook on the tap's own view node, which runs
        whenever the gradient goes on to the module's input and costs half a tensor hook (a tensor hook
        while Dynamo traces, as it follows tensor hooks and not nodes). A module's output keeps its
        tensor hook: ``torch.autograd.grad(loss, output)`` fires that without running the node."""
        if torch.compiler.is_compiling():
            tapped.register_hook(self._gradient_recorder(name, "grad_input"))
            return
        if tapped.grad_fn is None:  # made with gradients off (no_grad, reentrant checkpointing's first
            return  # forward): no gradient will reach it, as a tensor hook on it would never fire

        def hook(grad_outputs):
            grad = grad_outputs[0]
            if grad is not None and self.attached:  # a hook left on a node of a forward before detaching
                self._record(name, "grad_input", grad)

        tapped.grad_fn.register_prehook(hook)

    def _gradient_recorder(self, name, role):
        def hook(grad):
            if self.attached:  # a hook left on a tensor of a forward that ran before detaching
                self._record(name, role, grad)

        return hook

    def _grad_hook(self, name):
        def hook(grad):
            self._record(name, "grad_flow", grad)

        return hook

    # --- recording ---

    def sampling(self) -> bool:
        """Whether the current step is recorded (and this rank is one of ``ranks``)."""
        step = self.current_step
        if (
            step < self.start
            or (self.end is not None and step >= self.end)
            or (step - self.start) % self.every
        ):
            return False
        return self.ranks is None or _rank() in self.ranks

    def _record_first(self, name, role, value):
        if isinstance(value, (tuple, list)):
            value = next((v for v in value if isinstance(v, torch.Tensor)), None)
        if isinstance(value, torch.Tensor):
            self._record(name, role, value)

    def _record(self, name: str, role: str, tensor: torch.Tensor) -> None:
        if not self._sampled or not tensor.is_floating_point():
            return
        where = (self._step, self._rank, name, role)
        if self.stats:  # fused reductions, left on the device until the records are read
            cell = self._queue.add(tensor)
            self._pending.append((where, tensor.numel(), cell))
            if type(cell) is not int and self._queue.bytes > _BATCH_MAX_BYTES:  # staged, not in C's table
                self._queue.flush()
        if not (self.what_if or self.histograms):
            return
        for label, (spec, patterns) in self.what_if.items():
            if patterns is not None and not any(checks.matches(name, p) for p in patterns):
                continue
            values = {f"{label}/{k}": v for k, v in what_if_stats(tensor, spec, self.what_if_axis).items()}
            if self.block_stats and spec.block_size is not None:
                blocks = block_stats(tensor, spec, self.what_if_axis)
                values.update({f"{label}/block/{k}": v for k, v in blocks.items()})
            self._pending.append((where, None, values))
        if self.histograms:
            self._pending.append((where, None, log2_histogram(tensor)))

    @property
    def records(self) -> list[tuple]:
        """(step, rank, module, role, stat, value) per recorded statistic, in recording order. Reading
        them moves the statistics still on a device to the host: one transfer per device."""
        return list(self.to_frame().itertuples(index=False, name=None))

    def _collect(self) -> None:
        """Turn the pending records into blocks of the frame, in recording order: statistics a table
        at a time (vectorized), what-if and histogram values a row each. The cyclic garbage collector
        is paused meanwhile: the many small containers made here would set off full collections over
        every pending record (two thirds of the time after 300 probed steps)."""
        self._queue.flush()
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        collecting = gc.isenabled()
        gc.disable()
        try:
            self._collect_pending(pending)
        finally:
            if collecting:
                gc.enable()

    def _collect_pending(self, pending: list[tuple]) -> None:
        table = self._queue.take_table()  # the C kernel's rows, for records that hold a row number
        if all(type(cell) is int for _, _, cell in pending):  # on a CPU, usually: one block from the table
            wheres, numels, rows = zip(*pending)
            self._blocks.append(self._stats_block(wheres, numels, table[list(rows)]))
            return
        on_device = [cell[0] for _, numel, cell in pending if numel is not None and not isinstance(cell, int)]
        host = iter(_to_host(on_device))
        # runs of statistics records lie between the what-if and histogram records (numel None)
        others = [index for index, (_, numel, _) in enumerate(pending) if numel is None]
        start = 0
        for index in [*others, len(pending)]:
            if index > start:
                wheres, numels, cells = zip(*pending[start:index])
                if all(type(cell) is int for cell in cells):  # every tensor read by the C kernel
                    vectors = table[list(cells)]
                else:
                    vectors = np.empty((len(cells), 11))
                    for i, cell in enumerate(cells):
                        vectors[i] = table[cell] if type(cell) is int else next(host)
                self._blocks.append(self._stats_block(wheres, numels, vectors))
            if index < len(pending):
                where, _, cell = pending[index]
                records = [(*where, stat, value) for stat, value in cell.items()]
                self._blocks.append(pd.DataFrame(records, columns=RECORD_COLUMNS))
            start = index + 1

    def _stats_block(self, wheres: tuple, numels: tuple, vectors: np.ndarray) -> pd.DataFrame:
        """The frame of a run of statistics records: their (step, rank, module, role), their element
        counts and their vectors (len(run), 11)."""
        values = _stats_table(vectors, np.array(numels), self.stats)
        count = len(self.stats)
        steps, ranks, modules, roles = zip(*wheres)
        return pd.DataFrame(
            {
                "step": np.repeat(np.array(steps, dtype=np.int64), count),
                "rank": np.repeat(np.array(ranks, dtype=np.int64), count),
                "module": _string_column(modules, count),
                "role": _string_column(roles, count),
                "stat": _string_column(self.stats, 1, len(wheres)),
                "value": values.ravel(),
            }
        )

    def record_param_grads(self, role: str = "param_grad") -> None:
        """Record ``param.grad`` of every selected module's parameters (after accumulation/unscaling)."""
        self._read_rank_and_sampling()  # torch.distributed may have started since the last step
        if not self._sampled:  # nothing would be recorded: skip walking every module's parameters
            return
        for name, module in self.selected.items():
            for param_name, param in module.named_parameters(recurse=False):
                if param.grad is not None:
                    self._record(f"{name}.{param_name}", role, param.grad)

    def step(self) -> None:
        """Advance to the next step (call once per optimizer step, after its backward)."""
        self._queue.flush()
        self._step += 1
        self._sync_hooks()

    def to_frame(self) -> pd.DataFrame:
        """Records as a tidy DataFrame with columns step, rank, module, role, stat, value (a new frame
        each call)."""
        self._collect()
        if not self._blocks:
            return pd.DataFrame([], columns=RECORD_COLUMNS)
        if len(self._blocks) > 1:  # joined once: the next read joins only what is new
            self._blocks = [pd.concat(self._blocks, ignore_index=True)]
        return self._blocks[0].copy()

    def save(self, name: str):
        """Write the records to data/<name>.csv (qlab.results.save_csv); return the path."""
        from qlab.results import save_csv

        return save_csv(self.to_frame(), name)


def _string_column(values, repeats: int, tiles: int = 1):
    """Strings as a frame column: each of ``values`` ``repeats`` times, the whole ``tiles`` times, in the
    dtype pandas gives a column of str (object; pandas 3's str). Built from the distinct values, so
    pandas checks a few strings, not every row (which took half of ``to_frame``)."""
    codes, distinct = pd.factorize(np.array(values, dtype=object))
    return pd.Series(distinct).array.take(np.tile(np.repeat(codes, repeats), tiles))


class _StatsQueue:
    """Tensors recorded in a step, waiting for one fused reduction per shape (a compiled call's
    dispatch costs more than the reduction of a small tensor). ``add`` copies the
    tensor into a staging buffer for its (rows, channels) shape, reused from step to step (no
    allocation, no page faults), so a later in-place change (``zero_grad(set_to_none=False)``, an
    inplace ReLU) cannot reach it, and returns a cell that ``flush`` fills with the tensor's
    ``_stats_vector``. Every record is copied, even a tensor recorded twice (a gradient as ``grad_flow``,
    then as ``param_grad``): autograd's version counter cannot prove it unchanged in between, as
    GradScaler's unscale_ kernel rewrites gradients in place without moving it. Empty tensors and
    tensors of 2²⁰ elements or more are reduced at once, and so is every float32 CPU tensor where the C
    kernel is built (``qlab.kernels.cpu_qdq.tensor_stats_function``: one pass over the tensor in place, no
    copy and no dispatch per statistic, the results written into a row of ``table``)."""

    def __init__(self, outliers: bool):
        self.outliers = outliers
        self._read_settings()
        self.table = torch.empty((256, 11), dtype=torch.float64)  # the C kernel's results, a row a record
        self.table_rows, self.table_capacity, self.table_address = 0, len(self.table), self.table.data_ptr()
        self.lock = threading.Lock()
        # (rows, channels, dtype, device) → a (capacity, rows, channels) buffer, and its rows unbound once
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.slots: dict[tuple, tuple] = {}
        self.cells: dict[tuple, list] = {}  # the same keys → cells of the tensors staged this step
        self.bytes = 0

    def _read_settings(self) -> None:
        """Whether the C kernel runs, and on how many threads: asked again at every flush (QLAB_COMPILE
        or torch's thread count may change between steps), not at every record."""
        self.in_c = cpu_qdq.available()
        self.stats_in_c = cpu_qdq.tensor_stats_function() if self.in_c else None
        self.threads, self.threads_from = torch.get_num_threads(), cpu_qdq.STATS_THREADS_MIN_NUMEL

    def add(self, tensor: torch.Tensor) -> list | int:
        """A cell that ``flush`` fills with the tensor's statistics vector, or the row of ``table`` the C
        kernel wrote them to."""
        numel = tensor.numel()
        if self.in_c and tensor.dtype is torch.float32 and tensor.is_cpu and numel:
            return self._add_in_c(tensor, numel)
        if numel == 0:
            return [_stats_vector(tensor, self.outliers)]
        channels = tensor.shape[-1] if tensor.dim() else 1
        x = tensor.detach().reshape(numel // channels, channels)
        if numel >= _BATCH_MAX_NUMEL:
            return [_stats_rows_fast(x[None], self.outliers)[0]]
        key = (numel // channels, channels, tensor.dtype, tensor.device)
        cells = self.cells.setdefault(key, [])
        slots = self.slots.get(key)
        if slots is None or len(slots) == len(cells):
            grown = x.new_empty((max(4, 2 * len(cells)), *x.shape))
            if cells:
                grown[: len(cells)].copy_(self.buffers[key][: len(cells)])
            self.buffers[key] = grown
            self.slots[key] = slots = grown.unbind(0)
        slots[len(cells)].copy_(x)
        cell = [None]
        cells.append(cell)
        self.bytes += numel * tensor.element_size()
        return cell

    def _add_in_c(self, tensor: torch.Tensor, numel: int) -> int:
        """Read the tensor in place, now, into the next row of the table (nothing staged); its row. The
        lock: the C call lets go of the GIL, and a second recording thread must neither take the same
        row nor move the table while the first writes into it."""
        if not tensor.is_contiguous():
            tensor = tensor.contiguous()
        shape = tensor.shape
        channels = shape[-1] if shape else 1
        threads = self.threads if numel >= self.threads_from else 1
        with self.lock:
            row = self.table_rows
            if row == self.table_capacity:
                self.table = torch.cat([self.table, torch.empty_like(self.table)])
                self.table_capacity, self.table_address = len(self.table), self.table.data_ptr()
            address = self.table_address + 88 * row  # 11 float64 a row
            self.stats_in_c(tensor.data_ptr(), numel // channels, channels, self.outliers, address, threads)
            self.table_rows = row + 1
        return row

    def flush(self) -> None:
        self._read_settings()
        for key, cells in self.cells.items():
            vectors = _stats_rows_fast(self.buffers[key][: len(cells)], self.outliers)
            for cell, vector in zip(cells, vectors):
                cell[0] = vector
        self.cells.clear()
        self.bytes = 0

    def take_table(self) -> np.ndarray:
        """A copy of the C kernel's rows so far, (rows, 11) float64 (a record's row number indexes it);
        the table is reused from row 0 on."""
        with self.lock:
            rows, self.table_rows = self.table[: self.table_rows].numpy().copy(), 0
        return rows

    def release(self) -> None:
        """Flush, then free the staging buffers (when no step is being sampled)."""
        self.flush()
        self.buffers.clear()
        self.slots.clear()


def _to_host(vectors: list[torch.Tensor]) -> list[list[float]]:
    """The vectors' values as Python floats, in order, with one stacked transfer per device."""
    by_device: dict[torch.device, list[int]] = {}
    for index, vector in enumerate(vectors):
        by_device.setdefault(vector.device, []).append(index)
    values: list = [None] * len(vectors)
    for indices in by_device.values():
        for index, row in zip(indices, torch.stack([vectors[i] for i in indices]).tolist()):
            values[index] = row
    return values


# --- the gradient audit -------------------------------------------------------------------------------


class GradientAudit:
    """Compare the gradient seen inside backward with the final ``param.grad`` the optimizer uses.

    During backward, ``GradientAudit`` sums, per parameter, the gradient flowing into it (a hook on
    the parameter), or what ``observe(name, grad)`` is given from inside a custom backward (with
    ``hook_parameters=False``: the view the seed's researcher probed). ``report`` then predicts
    the final gradient from the known factors and reports what is left unexplained:

        predicted = clip_coefficient · Σ_ranks Σ_microbatches inside / (loss_scale · world_size)

    loss_scale: the GradScaler scale during those backwards (``scaler.get_scale()``); micro-batches
    enter through the sum (a loss divided by their count is already inside the observed gradients);
    world_size: DDP averaging (under torch.distributed the inside sums are all-reduced first);
    clip_coefficient: min(1, max_norm / total_norm) as clip_grad_norm_ applied it.
    """

    def __init__(self, model: nn.Module, *, hook_parameters: bool = True):
        self.model = checks.module("model", model)
        self.hook_parameters = checks.boolean("hook_parameters", hook_parameters)
        self.inside: dict[str, torch.Tensor] = {}
        self._handles = []

    def __enter__(self) -> GradientAudit:
        if not self.hook_parameters:  # the caller observes from inside its own backward
            return self
        for name, param in self.model.named_parameters():
            if param.requires_grad:
                self._handles.append(param.register_hook(lambda grad, name=name: self.observe(name, grad)))
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def observe(self, name: str, grad: torch.Tensor) -> None:
        """Add one backward's gradient for ``name`` (in float64)."""
        if not isinstance(name, str):
            raise TypeError(f"name must be a parameter name (str), got {checks.shown(name)}")
        checks.tensor("grad", grad, real=True)
        param = dict(self.model.named_parameters()).get(name)
        if param is None:
            names = [n for n, _ in self.model.named_parameters()]
            raise ValueError(
                f"name must name a parameter of the model, got {name!r}; "
                f"closest: {checks.closest(name, names)}"
            )
        if tuple(grad.shape) != tuple(param.shape):
            raise ValueError(
                f"grad for {name} must have the parameter's shape {tuple(param.shape)}, "
                f"got {tuple(grad.shape)}"
            )
        grad = grad.detach().double()
        self.inside[name] = grad.clone() if name not in self.inside else self.inside[name] + grad

    def report(
        self,
        *,
        loss_scale: float = 1.0,
        world_size: int | None = None,
        clip_coefficient: float = 1.0,
        tolerance: float = 1e-3,
    ) -> pd.DataFrame:
        """One row per parameter: observed ratio ‖inside‖/‖final‖, the explained factor, what remains.

        ``unexplained`` is ‖final − predicted‖ / ‖final‖; a row whose unexplained part exceeds
        ``tolerance`` is flagged — a scale the known factors cannot account for (e.g. a backward
        that multiplies by a quantization scale it should not).
        """
        loss_scale = checks.number("loss_scale", loss_scale, low=0, open_low=True)
        clip_coefficient = checks.number("clip_coefficient", clip_coefficient, low=0, high=1, open_low=True)
        checks.number("tolerance", tolerance, low=0)
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        if world_size is None:
            world_size = torch.distributed.get_world_size() if distributed else 1
        checks.integer("world_size", world_size, low=1)
        if not self.inside:
            how = "use it as `with audit:` around backward" if self.hook_parameters else "call observe()"
            raise ValueError(
                f"the audit observed no gradient ({how}, before report); an empty report would read as "
                "everything explained"
            )
        params = dict(self.model.named_parameters())
        rows = []
        for name, inside in self.inside.items():
            final = params[name].grad
            if final is None:
                continue
            total = inside.clone()
            if distributed:
                torch.distributed.all_reduce(total)
            predicted = clip_coefficient * total / (loss_scale * world_size)
            final64 = final.detach().double()
            final_norm = torch.linalg.vector_norm(final64).item()
            unexplained = (
                torch.linalg.vector_norm(final64 - predicted).item() / final_norm if final_norm else math.nan
            )
            rows.append(
                {
                    "parameter": name,
                    "inside_norm": torch.linalg.vector_norm(inside).item(),
                    "final_norm": final_norm,
                    "observed_ratio": torch.linalg.vector_norm(inside).item() / final_norm
                    if final_norm
                    else math.nan,
                    "loss_scale": loss_scale,
                    "world_size": world_size,
                    "clip_coefficient": clip_coefficient,
                    "explained_ratio": loss_scale * world_size / clip_coefficient,
                    "unexplained": unexplained,
                    "flagged": not unexplained <= tolerance,
                }
            )
        if not rows:
            raise ValueError(
                f"none of the {len(self.inside)} observed parameters has a .grad to compare with (was "
                "zero_grad(set_to_none=True) called after backward, or is the model another one?)"
            )
        return pd.DataFrame(rows)


# --- weight-gradient agreement ---------------------------------------------------------------------------


def weight_gradients(model: nn.Module, batches, loss_fn, names=None) -> dict[str, torch.Tensor]:
    """The gradient of the mean loss over ``batches`` for each Linear-like layer's weight (float64,
    as stored: (out, in), or (in, out) for transformers' Conv1D), keyed by layer name: zeros for a
    layer the loss does not reach; a frozen layer (weight without requires_grad) is left out, or
    refused where ``names`` (which restricts it to those layers) asks for it. The model is left as
    it was: its ``.grad`` and its buffers (BatchNorm's running statistics a forward in train mode moves)."""
    from qlab.nn import linear_layers

    checks.module("model", model)
    checks.batches("batches", batches)
    checks.function("loss_fn", loss_fn, "a function (model, batch) → loss")
    layers = {name: module for name, module, _ in linear_layers(model)}
    if names is None:
        chosen = [name for name, layer in layers.items() if layer.weight.requires_grad]
    else:
        chosen = checks.names("names", names, list(layers))
        frozen = [name for name in chosen if not layers[name].weight.requires_grad]
        if frozen:
            raise ValueError(f"names must be layers whose weight requires grad; frozen: {frozen}")
    saved = {id(p): p.grad for p in model.parameters()}
    buffers = {name: buffer.clone() for name, buffer in model.named_buffers()}
    try:
        for p in model.parameters():
            p.grad = None
        for batch in batches:
            (loss_fn(model, batch) / len(batches)).backward()
        return {
            name: torch.zeros_like(layers[name].weight, dtype=torch.float64)
            if layers[name].weight.grad is None
            else layers[name].weight.grad.detach().double().clone()
            for name in chosen
        }
    finally:
        for p in model.parameters():
            p.grad = saved[id(p)]
        with torch.no_grad():
            for name, buffer in model.named_buffers():
                if name in buffers:
                    buffer.copy_(buffers[name])


def gradient_agreement(gradients: dict, reference: dict) -> pd.DataFrame:
    """Per layer, ``cosine`` similarity and ``relative_error`` ‖g − g_ref‖ / ‖g_ref‖ (float64) of
    ``gradients`` against ``reference`` (the same keys); NaN where a norm they divide by is 0."""
    for name, value in (("gradients", gradients), ("reference", reference)):
        if not isinstance(value, dict):
            raise TypeError(f"{name} must be a dict of layer name → gradient, got {checks.shown(value)}")
        for layer, tensor in value.items():
            checks.tensor(f"{name}[{layer!r}]", tensor, real=True)
    if set(gradients) != set(reference):
        differing = sorted(set(gradients) ^ set(reference))
        raise ValueError(f"gradients and reference must name the same layers; only one names {differing}")
    rows = []
    for name, g_ref in reference.items():
        if gradients[name].shape != g_ref.shape:
            raise ValueError(
                f"gradients[{name!r}] has shape {tuple(gradients[name].shape)}, reference[{name!r}] "
                f"{tuple(g_ref.shape)}"
            )
        g = gradients[name].double().flatten()
        g_ref = g_ref.double().flatten()
        # over the largest |value| first, so no square underflows; no eps floor (F.cosine_similarity's
        # 1e-8 sent a tiny gradient's cosine to 0)
        scale, other_scale = (v.abs().max() if v.numel() else 0.0 for v in (g_ref, g))
        if scale > 0 and other_scale > 0:
            unit, other_unit = g_ref / scale, g / other_scale
            cosine = float(
                other_unit @ unit / (torch.linalg.vector_norm(other_unit) * torch.linalg.vector_norm(unit))
            )
        else:
            cosine = math.nan
        error = (
            float(torch.linalg.vector_norm((g - g_ref) / scale) / torch.linalg.vector_norm(g_ref / scale))
            if scale > 0
            else math.nan
        )
        rows.append({"layer": name, "cosine": cosine, "relative_error": error})
    return pd.DataFrame(rows)


def gradient_noise_floor(model: nn.Module, batches, other_batches, loss_fn, names=None) -> pd.DataFrame:
    """What the data alone moves a gradient by: ``gradient_agreement`` of the model's weight gradients
    on ``other_batches`` against those on ``batches`` (other mini-batches, or the same data drawn under
    another data-order seed), per layer. A fidelity measured on ``batches`` (quantized against FP32)
    reads against this: a relative error of 0.04 is small beside a mini-batch noise of 0.3."""
    checks.batches("batches", batches)
    checks.batches("other_batches", other_batches)
    return gradient_agreement(
        weight_gradients(model, other_batches, loss_fn, names),
        weight_gradients(model, batches, loss_fn, names),
    )
