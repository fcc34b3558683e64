"""The setting of seeds/000: a small transformer whose linears use a custom quantized autograd
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

import torch
from torch import nn

from qlab.probes import probe

MODES = ("as_written", "corrected")


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
    return SeedQuantizerFunction.apply(x, 2 ** (bits - 1) - 1)


class SeedLinearFunction(torch.autograd.Function):
    """The seed's _quantize_global: quantized forward, hand-written backward with probes."""

    @staticmethod
    def forward(ctx, x, weight, bias, mode, name, bits):
        x2d = x.reshape(-1, x.shape[-1])
        q_x, s_x = seed_quantize(x2d, bits)
        q_w, s_w = seed_quantize(weight, bits)
        if mode == "as_written":
            ctx.save_for_backward(x2d, s_x, weight, s_w)  # the raw tensors, yet their scales are used below
        else:
            ctx.save_for_backward(q_x, s_x, q_w, s_w)
        ctx.shape, ctx.has_bias, ctx.name, ctx.bits = x.shape, bias is not None, name, bits
        output = (q_x @ q_w.T) * (s_x * s_w)
        if bias is not None:
            output = output + bias
        return output.reshape(*x.shape[:-1], -1)

    @staticmethod
    def backward(ctx, g):
        x_saved, s_x, w_saved, s_w = ctx.saved_tensors
        g2d = g.reshape(-1, g.shape[-1])
        probe(g2d, f"{ctx.name}.grad_output")
        q_g, s_g = seed_quantize(g2d, ctx.bits)
        grad_x = ((q_g @ w_saved) * (s_g * s_w)).reshape(ctx.shape)
        grad_w = (q_g.T @ x_saved) * (s_g * s_x)
        probe(grad_w, f"{ctx.name}.weight.grad_inside")
        grad_b = g2d.sum(0) if ctx.has_bias else None
        return grad_x, grad_w, grad_b, None, None, None


class SeedLinear(nn.Linear):
    """nn.Linear through SeedLinearFunction (mode "as_written" or "corrected")."""

    def __init__(self, in_features, out_features, bias=True, *, mode="as_written", name="linear", bits=8):
        super().__init__(in_features, out_features, bias=bias)
        if mode not in MODES:
            raise ValueError(f"unknown mode {mode!r}; expected 'as_written' or 'corrected'")
        self.mode, self.name, self.bits = mode, name, bits

    def forward(self, x):
        return SeedLinearFunction.apply(x, self.weight, self.bias, self.mode, self.name, self.bits)


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


class SeedTransformer(nn.Module):
    """A small causal transformer whose linears are SeedLinear (vocab → width → vocab)."""

    def __init__(self, vocab=32, width=64, depth=2, heads=4, tokens=32, mode="as_written", seed=0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(vocab, width)
        self.position = nn.Parameter(torch.randn(tokens, width) * 0.02)
        self.blocks = nn.ModuleList(Block(width, heads, mode, i) for i in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        x = self.embed(ids) + self.position[: ids.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def permutation_task_batch(batch: int, tokens: int, vocab: int, generator: torch.Generator, seed: int = 0):
    """Random token sequences and, as targets, each token mapped through a fixed random permutation.

    The permutation depends only on ``seed`` (and vocab); the model has to learn it: (inputs, targets).
    """
    permutation = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    ids = torch.randint(0, vocab, (batch, tokens), generator=generator)
    return ids, permutation[ids]
