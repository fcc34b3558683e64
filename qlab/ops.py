"""qlab's hot torch operators (the C qdq kernel, stochastic rounding's draws, the bias gradient),
defined with ``torch.library.Library``: a schema, one Python kernel and a fake (shape-only) kernel for
torch.compile, to which each op is one opaque call. A call dispatches faster than through
``torch.library.custom_op``'s Python wrapper, which matters because these ops run dozens of times per
training step. They have no autograd formula, as they run only on tensors that need no gradient (inside
an autograd.Function's forward or backward)."""

from __future__ import annotations

import torch

_LIBRARY = torch.library.Library("qlab", "FRAGMENT")


def define(name: str, schema: str, kernel, fake, dispatch_key: str = "CompositeExplicitAutograd", tags=()):
    """Define ``qlab::name`` with ``schema`` (its arguments and result, e.g. ``"(Tensor x) -> Tensor"``),
    ``kernel`` for ``dispatch_key`` (the default: every device) and ``fake`` for tracing; returns the
    op's overload to call."""
    _LIBRARY.define(name + schema, tags=tags)
    _LIBRARY.impl(name, kernel, dispatch_key)
    torch.library.register_fake(f"qlab::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.qlab, name).default
