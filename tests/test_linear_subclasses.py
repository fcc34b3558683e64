"""Every transformers architecture whose modeling code subclasses nn.Linear, built from a tiny config
(nothing downloaded): quantize_model converts the subclasses whose forward is x·Wᵀ + b and skips the
others with a reason naming why.

What each subclass computes, read from its modeling code:
- FalconLinear (Falcon's attention and MLP): x @ W.T (+ b) written out by hand — a Linear;
- EsmFoldLinear (ESMFold's folding trunk and structure module): keeps nn.Linear.forward — a Linear;
- IdeficsDecoupledLinear (Idefics' lm_head): F.linear, with the logits of ``additional_fc`` (a child
  nn.Linear) appended when the config adds vocabulary — a Linear only without additional vocabulary;
- DeepseekV4GroupedLinear (DeepSeek-V4's grouped output projection o_a_proj): a block-diagonal
  batched product, one weight block per head group — not a Linear;
- DoryLMHead (Dory's lm_head): the logits times a learned per-token scale ``logit_scale`` — not a
  Linear, although the scale is 1.0 exactly at initialisation for many initializer ranges (0.02 here,
  not Dory's default 0.0177), so a probe of the forward alone cannot tell it from one;
- Llama4Router and PhimoeTopKRouter (the MoE routers): return a tuple, the router logits with the
  routing scores (Llama 4) or with the routing weights and chosen experts (PhiMoE).

References: each subclass's forward on a probe of this file's own (other Parameters drawn afresh)
against F.linear; the float model's own loss (or output), which unquantize_model must give back bit
for bit.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from qlab.nn import QuantLinear, quantize_model, unquantize_model

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS = 64, 16


def token_ids(seed=1):
    return torch.randint(1, VOCAB, (2, TOKENS), generator=torch.Generator().manual_seed(seed))


def causal_lm_loss(model, ids):
    return model(input_ids=ids, labels=ids).loss


def idefics_logits(model, ids):
    """Logits: transformers' loss views them with the config's vocab_size, without the added vocabulary."""
    pixels = torch.randn(ids.shape[0], 1, 3, 16, 16, generator=torch.Generator().manual_seed(2))
    images = torch.ones(*ids.shape, 1, dtype=torch.long)  # every token sees the one image
    return model(input_ids=ids, pixel_values=pixels, image_attention_mask=images).logits


def esmfold_positions(model, ids):
    return model(input_ids=ids % 21)["positions"]  # residue indices 0..20, as ESMFold takes them


SIZES = dict(hidden_size=32, num_attention_heads=4, max_position_embeddings=64)
LM = dict(SIZES, vocab_size=VOCAB, num_hidden_layers=2)
HEADS = dict(num_key_value_heads=2, head_dim=8)
MOE = dict(num_local_experts=4, intermediate_size=32)
VISION = dict(embed_dim=32, image_size=16, patch_size=8, intermediate_size=64, num_attention_heads=4)
STRUCTURE = dict(
    sequence_dim=32, pairwise_dim=16, ipa_dim=8, num_heads_ipa=2, num_qk_points=2, num_v_points=2
)
STRUCTURE_DEPTH = dict(num_blocks=1, num_transition_layers=1, num_resnet_blocks=1, resnet_dim=8)
TRUNK = dict(
    max_recycles=1, sequence_state_dim=32, pairwise_state_dim=16, sequence_head_width=8, pairwise_head_width=8
)
FOLDING = dict(trunk=dict(TRUNK, num_blocks=1, structure_module=dict(STRUCTURE, **STRUCTURE_DEPTH)))
ESM = dict(SIZES, vocab_size=33, pad_token_id=1, mask_token_id=32, num_hidden_layers=1, intermediate_size=64)
DEEPSEEK_MOE = dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
INDEXER = dict(index_n_heads=2, index_head_dim=8, index_topk=4, hc_mult=2, hc_sinkhorn_iters=2)
ATTENTION = dict(head_dim=16, q_lora_rank=16, o_groups=2, o_lora_rank=8, sliding_window=8)
RECURRENCE = dict(num_hidden_layers=3, n_input_layers=1, n_output_layers=1, n_recurrent_loops=1)
IDEFICS = dict(LM, intermediate_size=64, vision_config=dict(VISION, num_hidden_layers=1))
IDEFICS_ADDED_VOCABULARY = dict(IDEFICS, additional_vocab_size=8)
ESMFOLD = dict(ESM, is_folding_model=True, esmfold_config=FOLDING)
DEEPSEEK_V4 = dict(LM, **DEEPSEEK_MOE, **INDEXER, **ATTENTION)
# Dory at initializer_range 0.02: logit_scale · (1 / 0.02) rounds to 1.0 exactly in float32
DORY = dict(LM, **HEADS, **RECURRENCE, intermediate_size=64, sliding_window=8, initializer_range=0.02)

# architecture: (model class, config arguments, what to compare before and after conversion)
MODELS = {
    "falcon": ("FalconForCausalLM", dict(LM, bias=True), causal_lm_loss),
    "esmfold": ("EsmForProteinFolding", ESMFOLD, esmfold_positions),
    "idefics": ("IdeficsForVisionText2Text", IDEFICS, idefics_logits),
    "idefics-additional-vocab": ("IdeficsForVisionText2Text", IDEFICS_ADDED_VOCABULARY, idefics_logits),
    "deepseek_v4": ("DeepseekV4ForCausalLM", DEEPSEEK_V4, causal_lm_loss),
    "dory": ("DoryForCausalLM", DORY, causal_lm_loss),
    "llama4": ("Llama4ForCausalLM", dict(LM, **HEADS, **MOE, intermediate_size_mlp=64), causal_lm_loss),
    "phimoe": ("PhimoeForCausalLM", dict(LM, **MOE, num_key_value_heads=2), causal_lm_loss),
}
# architecture: {subclass: (how many the tiny model has, None if it computes a Linear, else what the
# reason for skipping it says)}
ANOTHER_COMPUTATION = "with another computation than x·Wᵀ + b"
SUBCLASSES = {
    "falcon": {"FalconLinear": (8, None)},
    "esmfold": {"EsmFoldLinear": (40, None)},
    "idefics": {"IdeficsDecoupledLinear": (1, None)},
    "idefics-additional-vocab": {"IdeficsDecoupledLinear": (1, "holds additional_fc besides weight")},
    "deepseek_v4": {"DeepseekV4GroupedLinear": (2, "failed on a probe input")},  # 3 rows split into no groups
    "dory": {"DoryLMHead": (1, "holds logit_scale besides weight and bias")},
    "llama4": {"Llama4Router": (2, ANOTHER_COMPUTATION)},  # router scores and logits, a tuple
    "phimoe": {"PhimoeTopKRouter": (2, ANOTHER_COMPUTATION)},
}


def build(architecture):
    model_name, arguments, _ = MODELS[architecture]
    model_class = getattr(transformers, model_name, None)
    if model_class is None:
        pytest.skip(f"transformers {transformers.__version__} has no {model_name}")
    try:
        config = model_class.config_class(**arguments)
        torch.manual_seed(0)
        return model_class(config).eval()
    except (ImportError, OSError) as err:  # an optional dependency, or a file it would download
        pytest.skip(f"{model_name} cannot be built offline from a tiny config: {err}")


def computes_linear(module: nn.Linear) -> bool:
    """Whether the module's forward is x·Wᵀ + b (to float32 rounding) on a probe of this file's own,
    with its Parameters other than weight and bias drawn afresh: a forward that reads them is no Linear."""
    layer = copy.deepcopy(module)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, parameter in layer.named_parameters():
            if name not in ("weight", "bias"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
        x = torch.randn(2, 5, layer.in_features, generator=generator).to(layer.weight.dtype)
        try:
            y = layer(x)
        except Exception:  # noqa: BLE001 — a forward that cannot take a batch of rows is no Linear
            return False
        expected = F.linear(x, layer.weight, layer.bias)
    return (
        isinstance(y, torch.Tensor) and y.shape == expected.shape and torch.allclose(y, expected, 1e-6, 1e-6)
    )


@pytest.fixture(autouse=True)
def eager(monkeypatch):  # no torch.compile, and no backward override from the environment
    monkeypatch.setenv("QLAB_COMPILE", "0")
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE", raising=False)


@pytest.mark.parametrize("architecture", MODELS)
def test_linear_subclasses_are_converted_exactly_when_they_compute_a_linear(architecture):
    model = build(architecture)
    output_of, expected = MODELS[architecture][2], SUBCLASSES[architecture]
    subclassed = {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, nn.Linear) and type(module) is not nn.Linear
    }
    counts = {}
    for module in subclassed.values():
        counts[type(module).__name__] = counts.get(type(module).__name__, 0) + 1
    assert counts == {cls: count for cls, (count, _) in expected.items()}
    for name, module in subclassed.items():  # the reading of the modeling code, checked on a probe
        assert computes_linear(module) == (expected[type(module).__name__][1] is None), name
    classes = {name: type(module) for name, module in subclassed.items()}
    ids = token_ids()
    keys = set(model.state_dict())
    with torch.no_grad():
        reference = output_of(model, ids)

    report = {row["name"]: row for row in quantize_model(model, "mxfp8")}
    for name, cls in classes.items():
        row, why = report[name], expected[cls.__name__][1]
        if why is None:
            assert row["action"] == "quantized" and isinstance(model.get_submodule(name), QuantLinear), row
        else:
            assert row["action"] == "skipped" and model.get_submodule(name) is subclassed[name], row
            assert row["reason"].startswith(cls.__name__) and why in row["reason"], row
    plain = [row for row in report.values() if row["class"] == "Linear"]
    assert plain and all(row["action"] == "quantized" for row in plain)
    assert set(model.state_dict()) == keys  # no Parameter or buffer of a subclass dropped
    with torch.no_grad():
        quantized = output_of(model, ids)
    assert quantized.isfinite().all() and not torch.equal(quantized, reference)

    unquantize_model(model)
    assert {name: type(model.get_submodule(name)) for name in classes} == classes
    with torch.no_grad():
        assert torch.equal(output_of(model, ids), reference)  # the same Parameters, the float model again


class _DroppedLinear(nn.Linear):
    """A Linear whose output goes through dropout: the same as F.linear in eval mode only."""

    def forward(self, x):
        return F.dropout(F.linear(x, self.weight, self.bias), 0.5, self.training)


def test_the_probe_runs_both_modes_and_leaves_the_random_state_and_the_mode_as_they_were():
    model = nn.Sequential(_DroppedLinear(8, 8)).eval()
    state = torch.get_rng_state()
    report = {row["name"]: row for row in quantize_model(model, "mxfp8")}
    assert report["0"]["action"] == "skipped" and "another computation" in report["0"]["reason"]
    assert torch.equal(torch.get_rng_state(), state) and not model[0].training
