"""Sparse back-propagation (meProp, Sun et al. 2017; docs/reference.md §7): keep only the top-k entries of a
Linear layer's output gradient dy, by magnitude.

Two ways to do it, which must give the same gradients and very different costs:

- ``mask_gradients(model, k)`` — a backward pre-hook zeroes all but the top-k entries of dy and
  hands the dense, mostly-zero dy on: any module, any model, but the GEMMs keep their full size,
  so it saves nothing.
- ``TopKLinear`` / ``sparsify_model(model, k)`` — a drop-in nn.Linear whose backward picks k
  output features and runs *smaller* dense GEMMs on them (shared index set), or multiplies a
  sparse dy (per-row index sets, through torch.sparse):

| mode | which entries of dy (N tokens × M features) survive | dx | dW, db |
|---|---|---|---|
| ``"shared"`` | the k features of largest Σₙ ``|dy[n,m]|`` | dy[:, idx]·W[idx, :] | rows idx: dy[:, idx]ᵀ·x |
| ``"row"`` | each row's own k largest ``|dy[n,m]|`` | sparse(dy)·W | sparse(dy)ᵀ·x (rows any top-k hit) |

k is a count (int ≥ 1) or a fraction of the features (float in (0, 1]: k = max(1, round(f·M))).
With k = M every variant is the dense layer, bit for bit. Ties at the k-th magnitude are broken
by ``torch.topk``, in an order it does not define (on the CPU not lowest index first: three of 40
equal values kept indices 26, 27 and 28); the hooks and TopKLinear break them alike.

``variant="max_child"`` (an experiment from a forum thread, not meProp): after the
three gradients of a Linear (input, weight, bias) are computed densely, only the one with the
largest L1 norm is propagated; the other two are zeroed.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from qlab import checks
from qlab.nn import QlabLinear, oriented_weight, replace_linears

MODES = ("shared", "row")
VARIANTS = ("topk", "max_child")


def check_k(k) -> None:
    """k must be an int count ≥ 1 or a float fraction in (0, 1]."""
    if isinstance(k, bool) or not isinstance(k, (int, float)):
        raise TypeError(f"k must be an int count or a float fraction, got {type(k).__name__} {k!r}")
    if isinstance(k, float) and not 0.0 < k <= 1.0:
        raise ValueError(f"k as a fraction must lie in (0, 1], got {k}")
    if isinstance(k, int) and k < 1:
        raise ValueError(f"k as a count must be at least 1, got {k}")


def resolve_k(k, features: int) -> int:
    """k as a count of the ``features`` (int in [1, features]) or a fraction (float in (0, 1])."""
    check_k(k)
    features = checks.integer("features", features, low=1)
    if isinstance(k, float):
        return max(1, round(k * features))
    if k > features:
        raise ValueError(f"k = {k} is larger than the feature count {features}")
    return k


def topk_mask(grad: torch.Tensor, k, mode: str = "shared") -> torch.Tensor:
    """Boolean mask of ``grad``'s shape (..., M) keeping the top-k magnitudes per ``mode`` (see module)."""
    checks.choice("mode", mode, MODES)
    checks.tensor("grad", grad, real=True)
    if grad.dim() == 0:
        raise ValueError("grad must have at least one dimension (..., M), got a 0-d tensor")
    features = grad.shape[-1]
    count = resolve_k(k, features)
    rows = grad.detach().reshape(-1, features).abs()
    mask = torch.zeros_like(rows, dtype=torch.bool)
    if mode == "shared":
        mask[:, shared_indices(rows, count)] = True
    else:
        mask.scatter_(1, rows.topk(count, dim=1).indices, True)
    return mask.reshape(grad.shape)


def shared_indices(dy: torch.Tensor, count: int) -> torch.Tensor:
    """The ``count`` output features with the largest Σ|dy| over the rows of dy (N, M), sorted ascending."""
    checks.tensor("dy", dy, real=True)
    if dy.dim() != 2:
        raise ValueError(f"dy must be 2-D (rows, features), got shape {tuple(dy.shape)}")
    checks.integer("count", count, low=0, high=dy.shape[1])
    return dy.abs().sum(0).topk(count).indices.sort().values


# --- masking by hooks -------------------------------------------------------------------------------


class GradientMask:
    """Backward pre-hooks that keep only the top-k entries of the selected modules' output gradient.

    modules: fnmatch patterns of qualified names and/or module classes (default: every nn.Linear);
    keep: fnmatch patterns of names left alone (as in ``sparsify_model``). Removable (``remove()``
    or use as a context manager); other hooks (probes) see the masked dy if they run after it.
    ``fractions`` records, per call, the fraction of dy entries kept.
    """

    def __init__(self, model: nn.Module, k, *, mode: str = "shared", modules=(nn.Linear,), keep=()):
        checks.module("model", model)
        checks.choice("mode", mode, MODES)
        check_k(k)  # against the feature count at each call
        self.k, self.mode = k, mode
        patterns = _module_selectors(modules)
        keep = checks.patterns("keep", keep)
        candidates = {
            name: module
            for name, module in model.named_modules()
            if any(
                isinstance(module, p) if isinstance(p, type) else checks.matches(name, p) for p in patterns
            )
        }
        checks.patterns_match("keep", keep, list(candidates), what="selected module")
        self.selected = {
            name: module
            for name, module in candidates.items()
            if not any(checks.matches(name, pattern) for pattern in keep)
        }
        shown = [p.__name__ if isinstance(p, type) else p for p in patterns]
        if not candidates:
            raise ValueError(f"modules {shown} (name patterns or classes) match no module of the model")
        if not self.selected:
            raise ValueError(
                f"keep {keep} keeps every one of the {len(candidates)} modules that modules {shown} select: "
                "nothing is left to sparsify"
            )
        self.fractions: list[float] = []
        self._handles = [
            module.register_full_backward_pre_hook(self._hook) for module in self.selected.values()
        ]

    def _hook(self, module, grad_output):
        dy = grad_output[0]
        if dy is None:
            return None
        if resolve_k(self.k, dy.shape[-1]) == dy.shape[-1]:
            self.fractions.append(1.0)
            return None  # k = all: the gradient passes untouched
        mask = topk_mask(dy, self.k, self.mode)
        self.fractions.append(mask.float().mean().item())
        # dropped entries become zeros, as in TopKLinear: dy · mask would turn a dropped ±inf into NaN
        return (torch.where(mask, dy, 0),) + tuple(grad_output[1:])

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def __enter__(self) -> GradientMask:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def _module_selectors(modules) -> list:
    """GradientMask's ``modules``: one name pattern (str) or nn.Module subclass, or a list, tuple or set
    of them, as a list; ``re:`` patterns must compile."""
    wanted = "a name pattern (str), an nn.Module subclass, or a list of them"
    if isinstance(modules, (str, type)):
        modules = [modules]
    if not isinstance(modules, (list, tuple, set, frozenset)):
        raise TypeError(f"modules must be {wanted}, got {checks.shown(modules)}")
    for entry in modules:
        if not (isinstance(entry, str) or (isinstance(entry, type) and issubclass(entry, nn.Module))):
            hint = "; give its class" if isinstance(entry, nn.Module) else ""
            raise TypeError(
                f"each entry of modules must be a name pattern (str) or an nn.Module subclass, "
                f"got {checks.shown(entry)}{hint}"
            )
    checks.patterns("modules", [entry for entry in modules if isinstance(entry, str)])
    return list(modules)


def mask_gradients(
    model: nn.Module, k, *, mode: str = "shared", modules=(nn.Linear,), keep=()
) -> GradientMask:
    """Keep only the top-k output-gradient entries of the selected modules (see GradientMask)."""
    return GradientMask(model, k, mode=mode, modules=modules, keep=keep)


# --- TopKLinear: a backward that shrinks the GEMMs ---------------------------------------------------


class _TopKLinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, count, mode, variant):
        ctx.save_for_backward(x, weight)
        ctx.count, ctx.mode, ctx.variant, ctx.has_bias = count, mode, variant, bias is not None
        ctx.bias_dtype = None if bias is None else bias.dtype
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x_saved, w_saved = ctx.saved_tensors
        # under autocast the forward ran in dy's dtype: so do the backward GEMMs (grads return in the
        # Parameters' / input's own dtypes below)
        x, weight = x_saved.to(dy.dtype), w_saved.to(dy.dtype)
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        features = dy.shape[-1]
        dx = dw = db = None
        if ctx.variant == "max_child":
            dx, dw, db = dy @ weight, dy.T @ x, dy.sum(0) if ctx.has_bias else None
            # only gradients someone needs compete (a first layer's dx would otherwise win and be dropped)
            norms = {
                key: grad.abs().sum()
                for key, grad, needed in (("x", dx, need_x), ("w", dw, need_w), ("b", db, need_b))
                if needed and grad is not None
            }
            winner = max(norms, key=lambda key: norms[key]) if norms else None
            dx = dx if winner == "x" else torch.zeros_like(dx)
            dw = dw if winner == "w" else torch.zeros_like(dw)
            db = None if db is None else (db if winner == "b" else torch.zeros_like(db))
        elif ctx.mode == "shared":
            idx = shared_indices(dy, ctx.count)
            dy_k = dy[:, idx]
            if need_x:
                dx = dy_k @ weight[idx]
            if need_w:
                dw = torch.zeros_like(weight)
                dw[idx] = dy_k.T @ x
            if need_b and ctx.has_bias:
                db = torch.zeros(features, dtype=dy.dtype, device=dy.device)
                db[idx] = dy_k.sum(0)
        else:  # per-row index sets through a sparse dy
            keep = dy.abs().topk(ctx.count, dim=1).indices
            rows = torch.arange(dy.shape[0], device=dy.device).repeat_interleave(ctx.count)
            values = dy.gather(1, keep).reshape(-1)
            # torch.sparse sums in the tensor's own dtype: a 16-bit dtype would lose the sum over the rows
            # (4096 ones summed in bf16 stop at 256), so 16-bit products run in float32 and are rounded
            # once at the end, as the other paths' dense GEMMs accumulate; float32 and float64 run as they are
            wide = torch.float32 if dy.dtype in (torch.bfloat16, torch.float16) else dy.dtype
            sparse_dy = torch.sparse_coo_tensor(
                torch.stack([rows, keep.reshape(-1)]), values.to(wide), dy.shape, check_invariants=False
            ).coalesce()
            if need_x:
                dx = torch.sparse.mm(sparse_dy, weight.to(wide)).to(dy.dtype)
            if need_w:
                dw = torch.sparse.mm(sparse_dy.t(), x.to(wide)).to(dy.dtype)
            if need_b and ctx.has_bias:
                db = torch.sparse.sum(sparse_dy, dim=0).to_dense().to(dy.dtype)
        dx = None if dx is None else dx.to(x_saved.dtype)
        dw = None if dw is None else dw.to(w_saved.dtype)
        db = None if db is None else db.to(ctx.bias_dtype)
        return dx, dw, db, None, None, None


class TopKLinear(QlabLinear):
    """Drop-in nn.Linear (inputs (..., in_features)) whose backward keeps only the top-k output
    gradient features, computed with gathered (mode "shared") or sparse (mode "row") GEMMs.
    Made from transformers' Conv1D it keeps that layer's (in, out) weight (see QuantLinear)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        k=1.0,
        mode: str = "shared",
        variant: str = "topk",
        device=None,
        dtype=None,
    ):
        super().__init__(
            in_features, out_features, bias, device=device, dtype=dtype, k=k, mode=mode, variant=variant
        )

    def _configure(self, k=1.0, mode="shared", variant="topk"):
        checks.choice("mode", mode, MODES)
        checks.choice("variant", variant, VARIANTS)
        self.count = resolve_k(k, self.out_features)
        self.k, self.mode, self.variant = k, mode, variant

    @classmethod
    def from_linear(
        cls, linear: nn.Linear, k=1.0, *, mode: str = "shared", variant: str = "topk"
    ) -> TopKLinear:
        """A TopKLinear sharing ``linear``'s weight and bias Parameters and hooks (no copy)."""
        return super().from_linear(linear, k=k, mode=mode, variant=variant)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, k={self.count}, mode={self.mode}, variant={self.variant}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise TypeError(
                f"TopKLinear expects a floating-point tensor, got {getattr(x, 'dtype', type(x).__name__)}"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(
                f"TopKLinear expects input of shape (..., {self.in_features}), got {tuple(x.shape)}"
            )
        weight = oriented_weight(self)
        if x.dtype != weight.dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"input dtype {x.dtype} does not match the weight's {weight.dtype}; "
                f"cast one of them (TopKLinear does not mix dtypes silently)"
            )
        if self.count == self.out_features and self.variant == "topk":
            return F.linear(x, weight, self.bias)  # k = all: exactly the dense layer
        y = _TopKLinearFunction.apply(
            x.reshape(-1, self.in_features), weight, self.bias, self.count, self.mode, self.variant
        )
        return y.reshape(*x.shape[:-1], self.out_features)


def sparsify_model(model: nn.Module, k, *, mode: str = "shared", variant: str = "topk", keep=()) -> list[str]:
    """Replace every nn.Linear (in place) by a TopKLinear sharing its Parameters, except names matching
    the fnmatch patterns in ``keep``; return the replaced names. A Linear registered under several
    names becomes one shared TopKLinear. Nothing is replaced if any layer refuses k. A model that already
    holds TopKLinear layers is refused (their k cannot change here): ``qlab.nn.plain_linears(model,
    TopKLinear)`` restores them to the dense layers around the same Parameters, which can then be
    sparsified with another k."""
    checks.module("model", model)
    sparsified = [
        repr(name) if name else "the model itself"
        for name, module in model.named_modules()
        if isinstance(module, TopKLinear)
    ]
    if sparsified:
        shown = ", ".join(sparsified[:5]) + (
            f" and {len(sparsified) - 5} more" if len(sparsified) > 5 else ""
        )
        raise ValueError(
            f"the model is already sparsified (TopKLinear: {shown}); sparsify_model replaces nn.Linear "
            f"layers only and would leave their k as it is. To change k, restore the dense layers first "
            f"with qlab.nn.plain_linears(model, TopKLinear) (same Parameters), then sparsify again"
        )
    chosen = replace_linears(
        model, lambda linear, i: TopKLinear.from_linear(linear, k, mode=mode, variant=variant), keep=keep
    )
    return [name for name, _, replaced in chosen if replaced]


# --- timing (used by notebook 05 and benchmarks/bench_sparse.py) -------------------------------------

BACKWARDS = ("dense", "hook_mask", "gathered", "sparse_rows")


TIMED = ("backward", "step")
MAX_REPEATS = 10_000  # timed passes of one call: more than any timing needs, few enough to finish


def backward_seconds(
    model: nn.Module, x: torch.Tensor, dy: torch.Tensor, backward: str, k, *, keep=(), repeats: int = 5
) -> float:
    """Median seconds of one backward pass of ``model`` (forward excluded): ``pass_seconds``'s median."""
    import statistics

    return statistics.median(pass_seconds(model, x, dy, backward, k, keep=keep, repeats=repeats))


def pass_seconds(
    model: nn.Module,
    x: torch.Tensor,
    dy: torch.Tensor,
    backward: str,
    k,
    *,
    keep=(),
    repeats: int = 5,
    timed: str = "backward",
) -> list[float]:
    """Seconds of each of ``repeats`` passes (after one warm-up) of ``model`` for the ``backward`` variant:

    dense (the model as it is), hook_mask (mask_gradients, shared index set), gathered
    (sparsify_model, mode "shared") or sparse_rows (sparsify_model, mode "row"). ``timed``: "backward"
    (the backward pass alone, forward excluded) or "step" (forward, backward and an AdamW step: what a
    training step costs end to end, the optimizer's dense update included). The model is left as it
    was (a "step" runs on a copy); x must require a gradient if dx is to be timed. keep: names left
    dense in every variant.
    """
    import copy
    import time

    checks.choice("backward", backward, BACKWARDS)
    checks.module("model", model)
    checks.integer("repeats", repeats, low=1, high=MAX_REPEATS)
    checks.choice("timed", timed, TIMED)
    checks.tensor("x", x, floating=True)
    checks.tensor("dy", dy, floating=True)
    checks.same_device("dy", dy, "x", x)
    swapped = backward in ("gathered", "sparse_rows")
    bare = type(model) is nn.Linear  # a bare layer cannot be swapped inside itself: it is wrapped
    if timed == "step" or (swapped and not bare):  # the caller's model is neither stepped nor swapped
        model = copy.deepcopy(model)
    if swapped:
        mode = "shared" if backward == "gathered" else "row"
        if bare:
            model = TopKLinear.from_linear(model, k, mode=mode)
        else:
            sparsify_model(model, k, mode=mode, keep=keep)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4) if timed == "step" else None
    mask = mask_gradients(model, k, keep=keep) if backward == "hook_mask" else None
    synchronize = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    times = []
    try:
        for _ in range(repeats + 1):  # the first is a warm-up
            x.grad = None
            model.zero_grad(set_to_none=True)
            synchronize()
            start = time.perf_counter()
            try:
                y = model(x)
            except (RuntimeError, TypeError, ValueError, IndexError) as err:
                raise ValueError(f"x {tuple(x.shape)} {x.dtype}: the model cannot run it: {err}") from err
            if optimizer is None:
                synchronize()
                start = time.perf_counter()
            # checked before backward, whose own error names neither
            if y.shape != dy.shape or y.dtype != dy.dtype:
                raise ValueError(
                    f"dy must have the shape and dtype of model(x), {tuple(y.shape)} and {y.dtype}, got "
                    f"{tuple(dy.shape)} and {dy.dtype}"
                )
            y.backward(dy)
            if optimizer is not None:
                optimizer.step()
            synchronize()
            times.append(time.perf_counter() - start)
    finally:
        if mask is not None:
            mask.remove()
    return times[1:]


def time_ratios(times, reference) -> dict[str, float]:
    """How ``times`` (seconds of repeated passes of one variant) compare with ``reference`` (those of the
    baseline): the median and the quartiles (``numpy.quantile``, linear) of the ratios times[i] /
    reference[j] over every pair of repeats, so the spread of both sides shows. Keys: ratio, q25, q75."""
    import numpy as np

    arrays = []
    for name, values in (("times", times), ("reference", reference)):
        if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
            raise TypeError(f"{name} must be a sequence of seconds, got {checks.shown(values)}")
        try:
            array = np.asarray(list(values), dtype=np.float64)
        except (TypeError, ValueError):
            raise TypeError(f"{name} must hold numbers of seconds, got {checks.shown(values)}") from None
        if array.ndim != 1 or not len(array):
            raise ValueError(f"{name} must be a non-empty flat sequence of seconds, got shape {array.shape}")
        if not (np.isfinite(array).all() and (array > 0).all()):
            raise ValueError(f"{name} must be positive, finite seconds, got {array.tolist()[:5]}")
        arrays.append(array)
    ratios = (arrays[0][:, None] / arrays[1][None, :]).ravel()
    q25, ratio, q75 = np.quantile(ratios, [0.25, 0.5, 0.75])
    return {"ratio": float(ratio), "q25": float(q25), "q75": float(q75)}


# --- digits runs on a split of their own (used by notebook 05) ----------------------------------------


def train_digits(config, split: int):
    """``qlab.train.train(config)`` for the digits task on the train/validation split drawn with seed
    ``split`` (``qlab.train.data.digits(split)``) instead of the split 0 that ``train`` always uses, so
    that a seed can vary the data split as well as the initial weights and the batches. Returns the
    ``TrainResult``, its model on the CPU. Defined at module level, so ``qlab.runs`` can fan it out:
    ``run_many([task(train_digits, config, seed) for ...])``.

    ``train`` reads the split through ``qlab.train.data.digits``; for the run that name is bound to the
    chosen split and restored afterwards (the run happens in this process, like ``train`` itself)."""
    from unittest import mock

    from qlab.train import TrainConfig, train
    from qlab.train import data as D

    if not isinstance(config, TrainConfig):
        raise TypeError(f"config must be a TrainConfig, got {checks.shown(config)}")
    if config.task != "digits":
        raise ValueError(f"train_digits trains the digits task, got task={config.task!r}")
    checks.seed("split", split)
    images = D.digits(split)

    def chosen(seed: int = 0, val_fraction: float = 0.2):
        return images

    with mock.patch.object(D, "digits", chosen):
        result = train(config)
    result.model.to("cpu")
    return result
