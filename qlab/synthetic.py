"""Synthetic activations with the shapes of trouble seen in real models (generated, never downloaded).

Every function returns float32 of the requested shape, drawn from ``generator`` only, so the same
seed gives the same bytes on the same machine.
"""

from __future__ import annotations

import torch

from qlab import checks

DISTRIBUTIONS = ("gaussian", "laplace", "student_t3", "outlier_channels")


def activations(
    kind: str,
    shape: tuple[int, ...],
    generator: torch.Generator,
    *,
    outlier_channels: int = 8,
    outlier_scale: float = 100.0,
) -> torch.Tensor:
    """Draw activations of one kind, float32, unit scale before outliers:

    gaussian — N(0, 1); laplace — Laplace(0, 1/√2) (unit variance, exponential tails);
    student_t3 — the standard Student's t with 3 degrees of freedom (unit scale; heavy, polynomial
    tails; its standard deviation is √3);
    outlier_channels — N(0, 1) with ``outlier_channels`` evenly spaced last-axis channels scaled by
    ``outlier_scale`` (the per-channel outliers of LLM activations).
    """
    checks.choice("kind", kind, DISTRIBUTIONS)
    if not isinstance(shape, (tuple, list, torch.Size)) or not shape:
        raise TypeError(f"shape must be a non-empty tuple of ints, got {checks.shown(shape)}")
    for size in shape:
        checks.integer("shape", size, low=0)
    checks.allocatable("shape", shape)
    checks.generator("generator", generator, optional=False)
    checks.integer("outlier_channels", outlier_channels, low=0)
    checks.number("outlier_scale", outlier_scale)
    normal = torch.randn(shape, generator=generator, dtype=torch.float32)
    if kind == "gaussian":
        return normal
    if kind == "laplace":
        # u in the open interval (−1/2, 1/2): torch.rand can return 0, and log1p(−1) = −inf
        uniform = (
            torch.rand(shape, generator=generator, dtype=torch.float32) * (1 - 2.0**-24) + 2.0**-25 - 0.5
        )
        return -torch.sign(uniform) * torch.log1p(-2 * uniform.abs()) / 2**0.5
    if kind == "student_t3":
        chi2 = (torch.randn((*shape, 3), generator=generator, dtype=torch.float32) ** 2).sum(-1)
        return normal / torch.sqrt(chi2 / 3)
    channels = shape[-1]
    if not 0 <= outlier_channels <= channels:
        raise ValueError(f"outlier_channels must be in [0, {channels}], got {outlier_channels}")
    scale = torch.ones(channels, dtype=torch.float32)
    if outlier_channels:
        chosen = torch.linspace(0, channels - 1, outlier_channels, dtype=torch.float32).round().long()
        scale[chosen] = outlier_scale
    return normal * scale
