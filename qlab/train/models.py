"""Two small models built from plain nn.Linear layers, so ``qlab.nn.quantize_model`` applies to them.

CharGPT is nanoGPT's shape at toy size: token + position embeddings, pre-LayerNorm blocks of
causal self-attention and a GELU MLP, a final LayerNorm and a linear head (tied to the token
embedding or not). Its Linear layers are named ``blocks.{i}.attn.qkv``, ``blocks.{i}.attn.proj``,
``blocks.{i}.mlp.fc``, ``blocks.{i}.mlp.proj`` and ``head``. The defaults (5 blocks, width 128,
context 128) give about 1.0M parameters. MLP is a plain multi-layer perceptron (``layers.{i}``).
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from qlab import checks


class CausalSelfAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        checks.integer("width", width, low=1)
        if width % checks.integer("heads", heads, low=1):
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, tokens, width = x.shape
        q, k, v = self.qkv(x).split(width, dim=-1)
        q, k, v = (t.view(batch, tokens, self.heads, width // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, tokens, width))


class FeedForward(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln2 = nn.LayerNorm(width)
        self.mlp = FeedForward(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class CharGPT(nn.Module):
    """ids (batch, tokens ≤ context) int64 → logits (batch, tokens, vocab_size) float32."""

    def __init__(
        self,
        vocab_size: int,
        *,
        context: int = 128,
        layers: int = 5,
        width: int = 128,
        heads: int = 4,
        tied_head: bool = True,
    ):
        for name, value in (("vocab_size", vocab_size), ("context", context), ("layers", layers)):
            checks.integer(name, value, low=1)
        checks.integer("width", width, low=1)
        if width % checks.integer("heads", heads, low=1):
            raise ValueError(f"width {width} must be divisible by heads {heads}")
        checks.boolean("tied_head", tied_head)
        checks.allocatable("vocab_size × width, context × width", (max(vocab_size, context), width))
        checks.allocatable("layers × width²", (layers, 12 * width * width))  # 12·width² weights a block
        super().__init__()
        self.context = context
        self.token_embedding = nn.Embedding(vocab_size, width)
        self.position_embedding = nn.Embedding(context, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab_size, bias=False)
        self.apply(_init_weights)
        for name, parameter in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if name.endswith("proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * layers))
        if tied_head:
            self.head.weight = self.token_embedding.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if not isinstance(ids, torch.Tensor):
            raise TypeError(
                f"CharGPT expects ids as an int64 tensor (batch, tokens), got {checks.shown(ids)}"
            )
        if ids.dim() != 2 or ids.dtype != torch.long:
            raise TypeError(
                f"CharGPT expects int64 ids of shape (batch, tokens), got {ids.dtype} {tuple(ids.shape)}"
            )
        if ids.shape[1] > self.context:
            raise ValueError(f"sequence of {ids.shape[1]} tokens is longer than the context {self.context}")
        checks.token_ids_in_range("CharGPT ids", ids, self.token_embedding.num_embeddings)
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.token_embedding(ids) + self.position_embedding(positions)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def block_patterns(self, first: int = 0, last: int = 0) -> list[str]:
        """fnmatch patterns naming the first ``first`` and last ``last`` blocks' layers."""
        count = len(self.blocks)
        chosen = sorted(set(range(min(first, count))) | set(range(max(count - last, 0), count)))
        return [f"blocks.{i}.*" for i in chosen]


class MLP(nn.Module):
    """features (batch, inputs) → logits (batch, classes): Linear-GELU stacks, ``layers.{i}``."""

    def __init__(self, inputs: int = 64, hidden=(128, 128), classes: int = 10):
        checks.integer("inputs", inputs, low=1)
        checks.integer("classes", classes, low=1)
        if not isinstance(hidden, (list, tuple)) or not hidden:
            raise TypeError(f"hidden must be a non-empty list of layer widths, got {checks.shown(hidden)}")
        for width in hidden:
            checks.integer("hidden", width, low=1)
        super().__init__()
        widths = [inputs, *hidden, classes]
        for fan_in, fan_out in zip(widths, widths[1:]):
            checks.allocatable("inputs, hidden and classes", (fan_out, fan_in))
        self.layers = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.gelu(x)
        return x


def _init_weights(module: nn.Module) -> None:
    if isinstance(module, nn.Linear):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if module.bias is not None:
            nn.init.zeros_(module.bias)
    elif isinstance(module, nn.Embedding):
        nn.init.normal_(module.weight, mean=0.0, std=0.02)


def parameter_count(model: nn.Module) -> int:
    """Distinct parameters (a tied head counts once)."""
    checks.module("model", model)
    return sum(p.numel() for p in model.parameters())
