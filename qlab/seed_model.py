"""The setting of a forum question: a small transformer whose linears use a custom quantized autograd
Function with probes in its backward — as the seed wrote it, and corrected.

The seed's Function (``SeedLinearFunction``) quantizes x and W to integer grids with its
``Quantizer`` (q = round(v / s)), multiplies the grids and rescales the output by s_x·s_w: the
forward is the dequantized product. Its backward, however, saved the *raw* x and W and still
multiplies by their scales:

    as written:  dX = (g_q·W)·s_g·s_w        dW = (g_qᵀ·x)·s_g·s_x
    corrected:   dX = (g_q·q_w)·s_g·s_w      dW = (g_qᵀ·q_x)·s_g·s_x   (= ĝ·Ŵ, ĝᵀ·x̂: the STE)

so the as-written gradients are off by a per-tensor factor ≈ s_w (dX) and s_x (dW). The inner
``SeedQuantizerFunction``'s backward never runs: it is called inside another Function's forward,
where autograd records nothing (``SeedQuantizerFunction.backward_calls`` counts to prove it).
"""

from __future__ import annotations

import contextlib
import gc
import math
from typing import TYPE_CHECKING

import torch
from torch import nn

from qlab import checks
from qlab.probes import probe

if TYPE_CHECKING:
    import pandas as pd

MODES = ("as_written", "corrected")
MAX_STEPS = 10**6  # training steps of one call: notebook 01 runs at most 3000, a default step 0.1 s
MAX_MICROBATCHES = 10_000  # micro-batches of one step
MAX_DEPTH = 1000  # blocks of a SeedTransformer: the seed's has 2
MAX_LR = 1e6  # past any rate that trains; an optimizer step's lr (Adam's: up to 10·lr) stays a float32
MAX_LOSS_SCALE = torch.finfo(torch.float32).max  # GradScaler keeps its scale in float32


class SeedQuantizerFunction(torch.autograd.Function):
    """The seed's QuantizerFunction, symmetric per-tensor branch: (round(x / s), s) with s = amax / Qp."""

    backward_calls = 0

    @staticmethod
    def forward(ctx, x, qp):
        scale = x.abs().max().detach() / qp
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # the seed divided by zero here
        return (x / scale).round().clamp(-qp - 1, qp), scale

    @staticmethod
    def backward(ctx, grad_q, grad_scale):
        SeedQuantizerFunction.backward_calls += 1
        return grad_q, None


def seed_quantize(x: torch.Tensor, bits: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    """The seed's Quantizer(N_bits, "per_tensor", signed=True, symmetric=True) applied to x."""
    checks.tensor("x", x, floating=True)
    if x.numel() == 0:
        raise ValueError(
            f"x must hold at least one value (the scale is its amax), got shape {tuple(x.shape)}"
        )
    checks.integer("bits", bits, low=2, high=16)
    return SeedQuantizerFunction.apply(x, 2 ** (bits - 1) - 1)


def fp16_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a @ b as a GPU's fp16 GEMM computes it: operands rounded to fp16, products accumulated in fp32,
    the result rounded to fp16 (beyond ±65504: ±inf). CPU fp16 GEMMs are 8× slower here, so the fp32
    GEMM of the rounded operands stands in for the accumulation."""
    for name, operand in (("a", a), ("b", b)):
        checks.tensor(name, operand, floating=True)
        if operand.dim() < 1:
            raise ValueError(f"{name} must have at least one dimension for a matmul, got a 0-d tensor")
    if a.shape[-1] != b.shape[0 if b.dim() == 1 else -2]:
        raise ValueError(f"a's last dimension must match b's rows: a {tuple(a.shape)}, b {tuple(b.shape)}")
    return (a.half().float() @ b.half().float()).half()


class SeedLinearFunction(torch.autograd.Function):
    """The seed's _quantize_global: quantized forward, hand-written backward with probes. With
    ``fp16`` every GEMM is ``fp16_matmul`` and the results stay fp16, as under the seed's autocast
    ("since the mixed precision mode, the gradient flows in fp16")."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode, name, bits, fp16=False):
        x2d = x.reshape(-1, x.shape[-1])
        q_x, s_x = seed_quantize(x2d, bits)
        q_w, s_w = seed_quantize(weight, bits)
        if mode == "as_written":
            ctx.save_for_backward(x2d, s_x, weight, s_w)  # the raw tensors, yet their scales are used below
        else:
            ctx.save_for_backward(q_x, s_x, q_w, s_w)
        ctx.shape, ctx.has_bias, ctx.name, ctx.bits, ctx.fp16 = x.shape, bias is not None, name, bits, fp16
        matmul = fp16_matmul if fp16 else torch.matmul
        output = matmul(q_x, q_w.T) * (s_x * s_w)
        if bias is not None:
            output = output + bias
        return output.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x_saved, s_x, w_saved, s_w = ctx.saved_tensors
        g2d = g.reshape(-1, g.shape[-1])
        probe(g2d, f"{ctx.name}.grad_output")
        q_g, s_g = seed_quantize(g2d, ctx.bits)
        matmul = fp16_matmul if ctx.fp16 else torch.matmul
        grad_x = (matmul(q_g, w_saved) * (s_g * s_w)).reshape(ctx.shape)
        grad_w = matmul(q_g.T, x_saved) * (s_g * s_x)
        probe(grad_w, f"{ctx.name}.weight.grad_inside")
        grad_b = g2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None, None


class SeedLinear(nn.Linear):
    """nn.Linear through SeedLinearFunction (mode "as_written" or "corrected")."""

    def __init__(
        self,
        in_features,
        out_features,
        bias=True,
        *,
        mode="as_written",
        name="linear",
        bits=8,
        fp16=False,
    ):
        checks.choice("mode", mode, MODES)
        checks.integer("bits", bits, low=2, high=16)
        from qlab.nn import check_linear_arguments

        check_linear_arguments(in_features, out_features, bias)
        super().__init__(in_features, out_features, bias=bias)
        self.mode, self.name, self.bits = mode, name, bits
        self.fp16 = checks.boolean("fp16", fp16)  # GEMMs in fp16 (fp16_matmul), as under the seed's autocast

    def forward(self, x):
        return SeedLinearFunction.apply(x, self.weight, self.bias, self.mode, self.name, self.bits, self.fp16)


class Block(nn.Module):
    def __init__(self, width, heads, mode, index):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = SeedLinear(width, 3 * width, mode=mode, name=f"blocks.{index}.qkv")
        self.proj = SeedLinear(width, width, mode=mode, name=f"blocks.{index}.proj")
        self.fc1 = SeedLinear(width, 4 * width, mode=mode, name=f"blocks.{index}.fc1")
        self.fc2 = SeedLinear(4 * width, width, mode=mode, name=f"blocks.{index}.fc2")
        self.heads = heads

    def forward(self, x):
        batch, tokens, width = x.shape
        q, k, v = self.qkv(self.norm1(x)).reshape(batch, tokens, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(attended.transpose(1, 2).reshape(batch, tokens, width))
        return x + self.fc2(nn.functional.gelu(self.fc1(self.norm2(x))))


def _check_sizes(
    *, vocab: int, width: int, depth: int, heads: int, tokens: int, batch: int | None = None
) -> None:
    """Refuse, before anything is built, sizes of a SeedTransformer (and of a ``batch`` of its input)
    that are not positive ints, a ``depth`` above ``MAX_DEPTH``, a width that ``heads`` does not divide,
    and weights or activations larger than this machine's memory."""
    for name, value in (("vocab", vocab), ("width", width), ("heads", heads), ("tokens", tokens)):
        checks.integer(name, value, low=1)
    checks.integer("depth", depth, low=1, high=MAX_DEPTH)
    if width % heads:
        raise ValueError(f"width {width} must be divisible by heads {heads}")
    checks.allocatable("vocab × width, tokens × width", (max(vocab, tokens), width))
    checks.allocatable("depth × width²", (depth, 12 * width * width))  # 12·width² weights a block
    if batch is not None:
        checks.integer("batch", batch, low=1)
        # the widest activations: fc1's output (4·width) or the logits (vocab), and the attention scores
        checks.allocatable("batch × tokens × max(4·width, vocab)", (batch, tokens, max(4 * width, vocab)))
        checks.allocatable("batch × heads × tokens²", (batch, heads, tokens, tokens))


class SeedTransformer(nn.Module):
    """A small causal transformer whose linears are SeedLinear (vocab → width → vocab)."""

    def __init__(self, vocab=32, width=64, depth=2, heads=4, tokens=32, mode="as_written", seed=0):
        _check_sizes(vocab=vocab, width=width, depth=depth, heads=heads, tokens=tokens)
        checks.choice("mode", mode, MODES)
        super().__init__()
        torch.manual_seed(checks.seed("seed", seed))
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, mode, i) for i in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        """ids: int64 or int32 token ids of shape (batch, tokens ≤ the model's tokens), each in [0, vocab)."""
        checks.tensor("ids", ids, dtypes=(torch.int64, torch.int32))
        if ids.dim() != 2:
            raise ValueError(f"ids must have shape (batch, tokens), got shape {tuple(ids.shape)}")
        tokens, vocab = self.position.shape[0], self.embed.num_embeddings
        if ids.shape[1] > tokens:
            raise ValueError(
                f"ids must hold at most {tokens} tokens (the model's tokens), got {ids.shape[1]}"
            )
        checks.token_ids_in_range("ids", ids, vocab)
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def permutation_task_batch(batch: int, tokens: int, vocab: int, generator: torch.Generator, seed: int = 0):
    """Random token sequences; the target at position t is the *previous* token through a fixed
    random permutation (position 0: its own token), so the model must attend one step back.

    The permutation depends only on ``seed`` (and vocab). Returns (inputs, targets).
    """
    for name, value in (("batch", batch), ("tokens", tokens), ("vocab", vocab)):
        checks.integer(name, value, low=1)
    checks.generator("generator", generator, optional=False)
    checks.seed("seed", seed)
    checks.allocatable("batch × tokens", (batch, tokens), 8)
    checks.allocatable("vocab", (vocab,), 8)
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
    previous = torch.cat([ids[:, :1], ids[:, :-1]], dim=1)
    return ids, permutation[previous]


# --- training and auditing --------------------------------------------------------------------------


def train(
    mode: str = "corrected",
    optimizer: str = "adam",
    steps: int = 150,
    *,
    lr: float | None = None,
    loss_scale: float | None = None,
    growth_interval: int = 50,
    microbatches: int = 1,
    clip_norm: float | None = None,
    batch: int = 16,
    tokens: int = 32,
    vocab: int = 32,
    width: int = 64,
    depth: int = 2,
    seed: int = 0,
    watch: str = "blocks.0.fc1",
    precision: str = "fp32",
    eps: float = 1e-8,
    audit: bool = True,
    bits: int = 8,
) -> pd.DataFrame:
    """Train a SeedTransformer on the permutation task; one row per step.

    Columns: step, loss, loss_scale (GradScaler's scale during that step's backward, 1 without),
    inside_norm (‖wgrad‖ the probe sees inside the first micro-batch's backward of layer ``watch``),
    final_norm (‖param.grad‖ after unscaling and clipping: what the optimizer uses), ratio,
    audit_unexplained (largest over parameters; GradientAudit given the scale, clip coefficient) — NaN
    with ``audit=False``, which skips the probe and the audit (faster) — and zero_grad_fraction (exact
    zeros among the SeedLinear weight gradients the optimizer gets).

    precision "fp16" is the seed's own setting: every SeedLinear GEMM, forward and backward, in fp16
    (``fp16_matmul``, fp32 accumulation as on a GPU; the other ops stay fp32); pair it with
    ``loss_scale`` (GradScaler), as the seed did. ``eps`` is Adam's ε; ``bits`` the grids' width (the
    seed does not state its own).

    Bounds, checked before anything is built: steps ≤ ``MAX_STEPS`` (10⁶), microbatches ≤
    ``MAX_MICROBATCHES`` (10⁴), depth ≤ ``MAX_DEPTH`` (1000), lr ≤ ``MAX_LR`` (10⁶), loss_scale ≤ the
    largest float32; weights and activations of the sizes given must fit in this machine's memory.
    """
    import pandas as pd

    from qlab.probes import GradientAudit, ProbeSet

    checks.choice("mode", mode, MODES)
    checks.choice("optimizer", optimizer, ("adam", "sgd"))
    checks.choice("precision", precision, ("fp32", "fp16"))
    checks.number("eps", eps, low=0, open_low=True)
    checks.boolean("audit", audit)
    checks.integer("bits", bits, low=2, high=16)
    checks.integer("steps", steps, low=1, high=MAX_STEPS)
    checks.integer("growth_interval", growth_interval, low=1)
    checks.integer("microbatches", microbatches, low=1, high=MAX_MICROBATCHES)
    for name, value, high in (
        ("lr", lr, MAX_LR),
        ("loss_scale", loss_scale, MAX_LOSS_SCALE),
        ("clip_norm", clip_norm, None),
    ):
        if value is not None:
            checks.number(name, value, low=0, high=high, open_low=True)
    checks.seed("seed", seed)
    if not isinstance(watch, str):
        raise TypeError(f"watch must be the name of a SeedLinear layer (str), got {checks.shown(watch)}")
    # heads=4: SeedTransformer's default, which train keeps
    _check_sizes(vocab=vocab, width=width, depth=depth, heads=4, tokens=tokens, batch=batch)
    model = SeedTransformer(vocab=vocab, width=width, depth=depth, tokens=tokens, mode=mode, seed=seed)
    # the probe and the gradient norms are those of a SeedLinear: no other module has them
    names = [name for name, module in model.named_modules() if isinstance(module, SeedLinear)]
    if watch not in names:
        listed = (
            ", ".join(names) if len(names) <= 16 else f"blocks.<i>.qkv, .proj, .fc1 or .fc2 for i < {depth}"
        )
        raise ValueError(
            f"watch must name a SeedLinear layer of the model ({listed}), got {watch!r}; closest: "
            f"{', '.join(checks.closest(watch, names))}"
        )
    linears = [m for m in model.modules() if isinstance(m, SeedLinear)]
    for layer in linears:
        layer.fp16, layer.bits = precision == "fp16", bits
    lr = lr if lr is not None else (3e-3 if optimizer == "adam" else 0.5)
    opt = (
        torch.optim.Adam(model.parameters(), lr, eps=eps)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr)
    )
    scaler = (
        torch.amp.GradScaler("cpu", init_scale=loss_scale, growth_interval=growth_interval)
        if loss_scale is not None
        else None
    )
    generator = torch.Generator().manual_seed(seed + 1)
    watched = model.get_submodule(watch)
    rows = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        scale = scaler.get_scale() if scaler is not None else 1.0
        probes = ProbeSet(model, modules=[watch], roles=("probe",), stats=("l2",)) if audit else None
        loss_total = 0.0
        auditor = GradientAudit(model) if audit else contextlib.nullcontext()
        with auditor:
            for micro in range(microbatches):
                x, y = permutation_task_batch(batch, tokens, vocab, generator, seed)
                loss = nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()) / microbatches
                loss_total += loss.item()
                with probes if micro == 0 and probes is not None else contextlib.nullcontext():
                    (scaler.scale(loss) if scaler is not None else loss).backward()
        if scaler is not None:
            scaler.unscale_(opt)
        coefficient = 1.0
        if clip_norm is not None:
            total = nn.utils.clip_grad_norm_(model.parameters(), clip_norm)
            coefficient = min(1.0, clip_norm / (total.item() + 1e-6))
        if audit:
            unexplained = auditor.report(loss_scale=scale, clip_coefficient=coefficient).unexplained.max()
            frame = probes.to_frame()
            inside = frame[frame.module == f"{watch}.weight.grad_inside"].value.iloc[0]
        else:
            unexplained = inside = math.nan
        final = watched.weight.grad.norm().item()
        zeros = sum(int((layer.weight.grad == 0).sum()) for layer in linears)
        rows.append(
            {
                "step": step,
                "loss": loss_total,
                "loss_scale": scale,
                "inside_norm": inside,
                "final_norm": final,
                "ratio": inside / final,
                "clip_coefficient": coefficient,
                "audit_unexplained": unexplained,
                "zero_grad_fraction": zeros / sum(layer.weight.numel() for layer in linears),
            }
        )
        if scaler is not None:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
    return pd.DataFrame(rows)


def _ddp_worker(rank: int, world_size: int, init_file: str, result_file: str, steps: int, seed: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from qlab.probes import GradientAudit

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        model = DistributedDataParallel(SeedTransformer(mode="corrected", seed=seed))
        opt = torch.optim.Adam(model.parameters(), 3e-3)
        generator = torch.Generator().manual_seed(seed + 100 * (rank + 1))  # each rank its own data
        rows = []
        for step in range(steps):
            opt.zero_grad(set_to_none=True)
            with GradientAudit(model.module) as audit:
                x, y = permutation_task_batch(16, 32, 32, generator, seed)
                nn.functional.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            report = audit.report()
            local = audit.inside["blocks.0.fc1.weight"].norm().item()
            final = model.module.blocks[0].fc1.weight.grad.norm().item()
            rows.append(
                {
                    "step": step,
                    "rank": rank,
                    "local_norm": local,
                    "final_norm": final,
                    "ratio": local / final,
                    "world_size": world_size,
                    "audit_unexplained": report.unexplained.max(),
                }
            )
            opt.step()
        import pandas as pd

        pd.DataFrame(rows).to_csv(f"{result_file}.{rank}", index=False)
        # every all-reduce finished and DDP's reducer freed while the group lives: freed after
        # destroy_process_group, gloo's teardown can deadlock on the GIL (seen once under load)
        dist.barrier()
        del model, opt
        gc.collect()
    finally:
        dist.destroy_process_group()


def ddp_audit(world_size: int = 2, steps: int = 5, seed: int = 0) -> pd.DataFrame:
    """Train the corrected SeedTransformer under DDP (gloo, ``world_size`` CPU processes) and audit
    every step on every rank: the local gradient against the averaged ``param.grad``.
    steps ≤ ``MAX_STEPS``."""
    checks.integer("world_size", world_size, low=2)
    checks.integer("steps", steps, low=1, high=MAX_STEPS)
    checks.seed("seed", seed)
    import tempfile

    import pandas as pd
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as folder:
        result = f"{folder}/audit"
        mp.spawn(
            _ddp_worker,
            args=(world_size, f"{folder}/init", result, steps, seed),
            nprocs=world_size,
            join=True,
        )
        return pd.concat([pd.read_csv(f"{result}.{rank}") for rank in range(world_size)], ignore_index=True)
