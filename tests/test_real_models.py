"""Hugging Face models built from tiny configs (nothing downloaded): GPT2 (transformers' Conv1D
projections), Llama (keyword-only attention calls, untied head) and Bert (an encoder, tied
embeddings). Conversion is complete or says why not, hooks survive it, probes see kwargs-only
calls, every preset and backward override trains, and save/load and FSDP2 behave.

References: each model's own unconverted forward (the bf16 recipe quantizes nothing, so the
converted model must agree to float32 rounding: its GEMM adds the bias after the product, Conv1D's
addmm fuses it); the dequantized operands multiplied by hand in float64 for the Conv1D layout;
transformers' own save_pretrained/from_pretrained; a one-process run for the two-process FSDP2 run.
"""

from __future__ import annotations

import gc
import math
import os
import tempfile

import pytest
import torch
from torch import nn

from qlab import quantize as Q
from qlab.nn import QuantLinear, linear_layers, quantize_model, unquantize_model
from qlab.probes import GradientAudit, ProbeSet
from qlab.recipe import BACKWARD_OVERRIDES, PRESETS

transformers = pytest.importorskip("transformers")
from transformers.pytorch_utils import Conv1D  # noqa: E402

VOCAB, TOKENS = 64, 32


@pytest.fixture(autouse=True)
def eager(monkeypatch):
    monkeypatch.setenv("QLAB_COMPILE", "0")
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE", raising=False)


SIZES = dict(vocab_size=VOCAB, bos_token_id=0, eos_token_id=0)


def gpt2():
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, n_positions=TOKENS, **SIZES)
    return transformers.GPT2LMHeadModel(config)


def llama():
    heads = dict(num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=TOKENS)
    config = transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, intermediate_size=64, **heads, **SIZES
    )
    return transformers.LlamaForCausalLM(config)


def bert():
    sizes = dict(num_attention_heads=2, vocab_size=VOCAB, max_position_embeddings=TOKENS)
    config = transformers.BertConfig(num_hidden_layers=2, hidden_size=32, intermediate_size=64, **sizes)
    return transformers.BertForMaskedLM(config)


# the projections each architecture has: (class name, count) — what conversion must reach
MODELS = {
    "gpt2": (gpt2, {"Conv1D": 8, "Linear": 1}),
    "llama": (llama, {"Linear": 15}),
    "bert": (bert, {"Linear": 14}),  # 6 per layer, the MLM head's transform and decoder
}


def build(name, seed=0):
    torch.manual_seed(seed)
    return MODELS[name][0]().eval()


def batch(seed=1, size=4):
    ids = torch.randint(0, VOCAB, (size, TOKENS), generator=torch.Generator().manual_seed(seed))
    return ids


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss


@pytest.mark.parametrize("name", MODELS)
def test_every_projection_is_converted_and_counted(name):
    model = build(name)
    expected = MODELS[name][1]
    classes = {}
    for _, module, why in linear_layers(model):
        assert why is None
        classes[type(module).__name__] = classes.get(type(module).__name__, 0) + 1
    assert classes == expected
    parameters = {n: p for n, p in model.named_parameters()}
    report = quantize_model(model, "mxfp8")
    assert [row["action"] for row in report] == ["quantized"] * sum(expected.values())
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == sum(expected.values())
    # the same Parameter objects (the optimizer's), tied weights still tied
    assert all(p is parameters[n] for n, p in model.named_parameters())
    if name in ("gpt2", "bert"):
        output = model.get_output_embeddings()
        assert output.weight is model.get_input_embeddings().weight


@pytest.mark.parametrize("name", MODELS)
def test_the_unquantized_recipe_matches_the_original_model(name):
    model = build(name)
    reference = loss_of(model, batch())
    quantize_model(model, "bf16")  # a QuantLinear with no quantization: only the GEMM's rounding
    converted = loss_of(model, batch())
    assert torch.allclose(converted, reference, rtol=1e-5, atol=0), (converted, reference)
    unquantize_model(model)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    assert torch.equal(loss_of(model, batch()), reference)  # the original modules are back, bit for bit
    if name == "gpt2":
        assert type(model.transformer.h[0].attn.c_attn) is Conv1D


def test_a_conv1d_layer_quantizes_along_its_reduction_axis():
    """Conv1D stores W as (in, out) and computes x·W + b. Its QuantLinear must quantize x and Wᵀ in
    blocks along `in` (the reduction axis), as for an nn.Linear holding Wᵀ."""
    torch.manual_seed(0)
    conv = Conv1D(48, 64)  # nf=48 outputs, nx=64 inputs: weight (64, 48)
    nn.init.normal_(conv.weight)
    x = torch.randn(8, 64)
    layer = QuantLinear.from_linear(conv, "mxfp8")
    assert layer.weight is conv.weight and (layer.in_features, layer.out_features) == (64, 48)
    spec = layer.recipe.spec("input")
    x_q = Q.qdq(x, spec, axis=-1).double()
    w_q = Q.qdq(conv.weight.detach().t().contiguous(), spec, axis=-1).double()  # (out, in), blocks along in
    expected = x_q @ w_q.T + conv.bias.double()
    assert torch.allclose(layer(x).double(), expected, rtol=1e-6, atol=1e-6)


CASES = [
    (name, preset, override)
    for name in MODELS
    for preset in PRESETS
    if preset != "bf16"
    for override in BACKWARD_OVERRIDES
    if not (preset == "fp8_delayed" and override)
]


@pytest.mark.parametrize("name, preset, override", CASES, ids=lambda v: str(v))
def test_every_preset_and_backward_override_trains(name, preset, override):
    model = build(name).train()
    from qlab.recipe import get_recipe

    quantize_model(model, get_recipe(preset, backward_override=override))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for step in range(2):
        optimizer.zero_grad()
        loss = loss_of(model, batch(seed=step))
        loss.backward()
        grads = [p.grad for p in model.parameters() if p.requires_grad]
        assert all(g is not None and torch.isfinite(g).all() for g in grads if g is not None)
        optimizer.step()
        losses.append(loss.item())
    assert all(math.isfinite(v) for v in losses)


@pytest.mark.parametrize("name", MODELS)
def test_bf16_autocast(name):
    model = build(name).train()
    quantize_model(model, "mxfp8")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = loss_of(model, batch())
    loss.backward()
    assert math.isfinite(loss.item())
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


ATTENTION = {
    "gpt2": "transformer.h.0.attn",
    "llama": "model.layers.0.self_attn",
    "bert": "bert.encoder.layer.0.attention",
}


@pytest.mark.parametrize("name", MODELS)
def test_probes_see_attention_modules_including_keyword_only_calls(name):
    model = build(name).train()
    quantize_model(model, "mxfp8")
    roles = ("input", "output", "grad_input", "grad_output")
    with ProbeSet(model, modules=[ATTENTION[name]], stats=("l2",), roles=roles) as probes:
        loss_of(model, batch()).backward()
    roles = set(probes.to_frame().role)
    assert roles == {"input", "output", "grad_input", "grad_output"}, roles


def test_keyword_only_grad_input_is_the_gradient_into_that_module_alone():
    """Llama's self_attn is called as self_attn(hidden_states=h), h the input LayerNorm's output,
    which nothing else consumes: autograd's own h.grad (retain_grad) is the gradient into the
    attention, the value a full backward hook would give for a positional call."""
    model = build("llama").train()
    attention = model.model.layers[0].self_attn
    captured = {}

    def retain(module, args, kwargs):
        kwargs["hidden_states"].retain_grad()
        captured["h"] = kwargs["hidden_states"]

    handle = attention.register_forward_pre_hook(retain, with_kwargs=True)
    with ProbeSet(
        model, modules=["model.layers.0.self_attn"], stats=("l2",), roles=("grad_input",)
    ) as probes:
        loss_of(model, batch()).backward()
    handle.remove()
    expected = torch.linalg.vector_norm(captured["h"].grad.double()).item()
    assert probes.to_frame().value.item() == pytest.approx(expected, rel=1e-6)


def test_forward_hooks_and_pre_hooks_survive_conversion():
    model = build("llama")
    seen = []
    q_proj = model.model.layers[0].self_attn.q_proj
    pre = q_proj.register_forward_pre_hook(lambda m, args: seen.append("pre"))
    post = q_proj.register_forward_hook(lambda m, args, out: seen.append(("post", tuple(out.shape))))
    kw = q_proj.register_forward_hook(lambda m, args, kwargs, out: seen.append("kwargs"), with_kwargs=True)
    quantize_model(model, "fp8_tensorwise")
    assert isinstance(model.model.layers[0].self_attn.q_proj, QuantLinear)
    loss_of(model, batch())
    assert seen == ["pre", ("post", (4, TOKENS, 32)), "kwargs"]
    for handle in (pre, post, kw):  # the handles still remove what they registered
        handle.remove()
    seen.clear()
    loss_of(model, batch())
    assert seen == []


def test_multihead_attention_out_proj_is_reported_not_silently_skipped():
    layer = nn.TransformerEncoderLayer(d_model=32, nhead=4, dim_feedforward=64, batch_first=True)
    report = {row["name"]: row for row in quantize_model(nn.Sequential(layer), "mxfp8")}
    assert report["0.linear1"]["action"] == report["0.linear2"]["action"] == "quantized"
    skipped = report["0.self_attn.out_proj"]
    assert skipped["action"] == "skipped" and "MultiheadAttention" in skipped["reason"]
    assert skipped["class"] == "NonDynamicallyQuantizableLinear"


def test_linear_subclasses_convert_when_their_forward_computes_a_linear():
    class Plain(nn.Linear):
        pass

    class Custom(nn.Linear):
        def forward(self, x):
            return super().forward(x) * 2

    class WrittenOut(nn.Linear):  # x·Wᵀ + b by hand, as Falcon's FalconLinear does
        def forward(self, x):
            return x @ self.weight.T + self.bias

    class TwoDimensional(nn.Linear):  # refuses the 3-D probe
        def forward(self, x):
            assert x.dim() == 2
            return super().forward(x)

    model = nn.Sequential(Plain(8, 8), Custom(8, 8), WrittenOut(8, 8), TwoDimensional(8, 8))
    report = {row["name"]: row for row in quantize_model(model, "mxfp8")}
    assert report["0"]["action"] == "quantized" and isinstance(model[0], QuantLinear)
    assert report["1"]["action"] == "skipped" and "another computation" in report["1"]["reason"]
    assert report["2"]["action"] == "quantized" and isinstance(model[2], QuantLinear)
    assert report["3"]["action"] == "skipped" and "failed on a probe input" in report["3"]["reason"]


@pytest.mark.parametrize("bias", [False, True])
def test_falcon_linears_written_out_by_hand_are_quantized(bias):
    """Falcon's attention and MLP use FalconLinear, an nn.Linear whose forward is x @ W.T (+ b): each
    is verified against F.linear and converted; under mxfp8 the model computes another, finite loss,
    and unquantize_model gives back the float model's loss exactly."""
    config = transformers.FalconConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, bias=bias, **SIZES
    )
    torch.manual_seed(0)
    model = transformers.FalconForCausalLM(config).eval()
    ids = batch()
    reference = loss_of(model, ids).item()
    report = quantize_model(model, "mxfp8")
    falcon = [row for row in report if row["class"] == "FalconLinear"]
    assert len(falcon) == 8  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h per layer
    assert all(row["action"] == "quantized" for row in falcon), [
        r for r in falcon if r["action"] != "quantized"
    ]
    quantized = loss_of(model, ids).item()
    assert math.isfinite(quantized) and quantized != reference
    unquantize_model(model)
    assert loss_of(model, ids).item() == reference  # the same Parameters, back to FalconLinear


def test_patterns_select_huggingface_names_and_direct_children():
    model = build("llama")
    report = quantize_model(model, "mxfp8", keep_high_precision=["lm_head", "model.layers.1.*"])
    kept = sorted(row["name"] for row in report if row["action"] == "kept")
    assert kept == ["lm_head"] + sorted(
        n for n, _, _ in linear_layers(model) if n.startswith("model.layers.1.")
    )
    with pytest.raises(ValueError, match="'layers.1.\\*' matches no Linear layer; closest"):
        quantize_model(build("llama"), "mxfp8", keep_high_precision=["layers.1.*"])  # the old README example
    probes = ProbeSet(build("llama"), modules=[r"re:model\.layers\.\d+"])
    assert list(probes.selected) == ["model.layers.0", "model.layers.1"]  # direct children only
    assert len(ProbeSet(build("llama"), modules=["model.layers.*"]).selected) > 2  # fnmatch's * crosses dots


@pytest.mark.parametrize("name", MODELS)
def test_the_gradient_audit_explains_a_quantized_model(name):
    model = build(name).train()
    quantize_model(model, "nvfp4")
    with GradientAudit(model) as audit:
        (loss_of(model, batch()) * 512.0).backward()
    for p in model.parameters():
        if p.grad is not None:
            p.grad /= 512.0
    report = audit.report(loss_scale=512.0)
    assert len(report) and (report.unexplained < 1e-6).all()


@pytest.mark.parametrize("name", MODELS)
def test_save_pretrained_and_from_pretrained_round_trip(name, tmp_path):
    model = build(name)
    reference = {k: v.clone() for k, v in model.state_dict().items()}
    quantize_model(model, "mxfp8")
    assert model.state_dict().keys() == reference.keys()  # conversion adds no state
    model.save_pretrained(tmp_path)
    loaded = type(model).from_pretrained(tmp_path).eval()
    assert not any(isinstance(m, QuantLinear) for m in loaded.modules())
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in reference.items())
    quantize_model(loaded, "mxfp8")
    assert torch.equal(loss_of(loaded, batch()), loss_of(model, batch()))


def test_checkpointed_huggingface_llama_with_delayed_scaling_matches_plain_training():
    """Gradient checkpointing recomputes each layer's forward inside backward; with delayed scaling
    the recomputation must use the scales of the original forward and roll no amax history."""
    plain, checkpointed = build("llama").train(), build("llama").train()
    enable = (
        getattr(checkpointed, "activation_checkpointing_enable", None)
        or checkpointed.gradient_checkpointing_enable
    )
    enable()
    for model in (plain, checkpointed):
        quantize_model(model, "fp8_delayed")
    for step in range(3):
        for model in (plain, checkpointed):
            model.zero_grad()
            loss_of(model, batch(seed=step)).backward()
        for (name, p), q in zip(plain.named_parameters(), checkpointed.parameters()):
            assert torch.equal(p.grad, q.grad), (step, name)
    layers = [m for m in plain.modules() if isinstance(m, QuantLinear)]
    other = [m for m in checkpointed.modules() if isinstance(m, QuantLinear)]
    for a, b in zip(layers, other):
        for role in a.scalers:
            assert torch.equal(a.scalers[role].history, b.scalers[role].history)


# --- FSDP2: two gloo processes against one ------------------------------------------------------------


def _fsdp_worker(rank: int, world_size: int, init_file: str, out_file: str, steps: int):
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.setdefault("QLAB_COMPILE", "0")
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    model = build("llama").train()
    quantize_model(model, "mxfp8")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        ids = batch(seed=step, size=4)
        local = ids[
            rank * 2 : (rank + 1) * 2
        ]  # 2 × 32 tokens each: MX blocks of the token axis don't straddle ranks
        optimizer.zero_grad()
        loss_of(model, local).backward()
        optimizer.step()
    state = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in model.state_dict().items()}
    if rank == 0:
        torch.save(state, out_file)
    dist.barrier()  # free the sharded model while the group lives (gloo's teardown and the GIL)
    del model, optimizer, state
    gc.collect()
    dist.destroy_process_group()


@pytest.mark.slow
def test_fsdp2_on_two_gloo_processes_matches_one_process(tmp_path):
    import torch.multiprocessing as mp

    steps = 2
    reference = build("llama").train()
    quantize_model(reference, "mxfp8")
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    for step in range(steps):
        ids = batch(seed=step, size=4)
        optimizer.zero_grad()
        # FSDP averages the two ranks' gradients, each the mean over its 2 sequences
        ((loss_of(reference, ids[:2]) + loss_of(reference, ids[2:])) / 2).backward()
        optimizer.step()
    init_file = tempfile.mktemp(dir=tmp_path)
    out_file = str(tmp_path / "state.pt")
    mp.spawn(_fsdp_worker, args=(2, init_file, out_file, steps), nprocs=2, join=True)
    sharded = torch.load(out_file, weights_only=True)
    for key, value in reference.state_dict().items():
        # gloo's reduce-scatter sums the two ranks' gradients in another order than autograd: rtol 1e-5
        assert torch.allclose(sharded[key], value, rtol=1e-5, atol=1e-7), key


def test_sparsify_model_converts_conv1d_layers_too():
    from qlab.sparse import TopKLinear, sparsify_model

    model = build("gpt2")
    reference = loss_of(model, batch())
    replaced = sparsify_model(model, 1.0)  # k = every feature: the dense layer
    assert len(replaced) == 9 and sum(isinstance(m, TopKLinear) for m in model.modules()) == 9
    assert torch.allclose(loss_of(model, batch()), reference, rtol=1e-5, atol=0)
    model = build("gpt2").train()
    sparsify_model(model, 0.25)
    loss_of(model, batch()).backward()
    c_attn = model.transformer.h[0].attn.c_attn.weight.grad  # Conv1D layout (in, out): columns are outputs
    assert (c_attn.abs().sum(0) > 0).sum() == round(0.25 * c_attn.shape[1])  # only k output features move


def test_a_converted_layer_does_not_keep_the_replaced_module_alive():
    """FSDP swaps a layer's Parameters for shards; a reference to the replaced module would keep the
    unsharded originals alive. The replacement keeps its class and plain attributes only."""
    import gc
    import weakref

    model = build("gpt2")
    original = weakref.ref(model.transformer.h[0].attn.c_attn)
    quantize_model(model, "mxfp8")
    gc.collect()
    assert original() is None
    unquantize_model(model)
    restored = model.transformer.h[0].attn.c_attn
    assert type(restored) is Conv1D and (restored.nf, restored.nx) == (96, 32)


def test_buffers_survive_conversion():
    class WithBuffer(nn.Linear):
        pass

    layer = WithBuffer(4, 4)
    layer.register_buffer("calibration", torch.arange(4.0))
    model = nn.Sequential(layer)
    keys = set(model.state_dict())
    quantize_model(model, "mxfp8")
    assert set(model.state_dict()) == keys and torch.equal(model[0].calibration, torch.arange(4.0))
    unquantize_model(model)
    assert type(model[0]) is WithBuffer and torch.equal(model[0].calibration, torch.arange(4.0))
