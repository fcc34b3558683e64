"""torch.compile of quantized layers and models: no graph breaks, and the same bits as eager.

QuantLinear is pinned bit for bit against its own eager run (outputs, dx, dW, db over two steps, so the
stochastic-rounding stream advances; NVFP4 covers the Hadamard transform). Whole models are compared
within a tolerance: inductor fuses LayerNorm, softmax and the loss with its own reduction order.
Graph-break counts come from torch._dynamo's counters; aot_eager traces forward and backward as
inductor does without compiling C++, so most checks here cost seconds.
"""

import copy

import pytest
import torch
import torch._dynamo as dynamo
from torch import nn

from qlab import formats, kernels, scaling
from qlab import quantize as Q
from qlab.nn import QuantLinear, quantize_model
from qlab.recipe import PRESETS, get_recipe
from qlab.train import TrainConfig, train
from qlab.train.models import CharGPT

CURRENT_SCALING = [
    "fp8_tensorwise",
    "int8_per_token",
    "mxfp8",
    "mxfp4",
    "nvfp4",
    "fp8_blockwise",
    "mxfp8_2d",
    "mxfp4_training",
]
# On CUDA eager QuantLinear takes its operands from qlab's Triton kernels (kernels.qdq copies axis-0
# results out of their transposed view, so the GEMMs see qlab.quantize's layouts). There the traced graph
# run by aot_eager gives the eager bits (test_traced_quantlinear_on_cuda_gives_the_eager_bits); inductor's
# own Triton code does not: measured on an H100 (torch 2.11), y differs in the last bits (bias folded into
# cuBLAS's addmm, one rounding instead of two), and for int8_per_token one quantized column of x in the
# wgrad GEMM came out one code apart (dW off by 7.6e-4 of its largest element in 96 of 6144 entries):
# inductor's CUDA arithmetic can round an element differently from ATen's. So on CUDA inductor is held to
# 2^-8 of each tensor's largest element, which still catches a wrong or missing gradient.
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
OVERRIDES = [None, "high_precision", "dequantized"]


@pytest.fixture(autouse=True)
def fresh_dynamo(monkeypatch):
    monkeypatch.delenv("QLAB_BACKWARD_OVERRIDE", raising=False)
    dynamo.reset()
    dynamo.utils.counters.clear()
    monkeypatch.setattr(scaling, "_HADAMARD_SIGNS", {})  # traced cold, as in a fresh process
    with dynamo.config.patch(recompile_limit=64):  # every test compiles fresh layers
        yield
    dynamo.reset()


def graph_breaks() -> int:
    return sum(dynamo.utils.counters["graph_break"].values())


def layer_step(layer, x, call):
    """Forward, backward of a fixed non-uniform loss; (y, dx, dW, db)."""
    x = x.clone().requires_grad_()
    layer.zero_grad(set_to_none=True)
    y = call(layer, x)
    (y * torch.linspace(-1, 1, y.numel(), device=y.device).reshape(y.shape)).sum().backward()
    return y.detach(), x.grad, layer.weight.grad, layer.bias.grad


def eager_and_compiled(recipe, backend, steps=2, tokens=48, device="cpu"):
    """The same QuantLinear run eagerly and compiled (fullgraph) for ``steps`` steps."""
    torch.manual_seed(0)
    eager = QuantLinear(64, 96, recipe=recipe, seed=3, device=device)
    compiled = copy.deepcopy(eager)  # its own generators, in the same state
    call = torch.compile(lambda layer, x: layer(x), backend=backend, fullgraph=True)
    results = []
    for step in range(steps):
        x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(step)).to(device)
        # compiled first: Dynamo traces before eager code has filled any of qlab's caches
        compiled_step = layer_step(compiled, x, call)
        results.append((layer_step(eager, x, lambda layer, x: layer(x)), compiled_step))
    return results


@pytest.mark.parametrize("override", OVERRIDES)
@pytest.mark.parametrize("preset", CURRENT_SCALING)
def test_quantlinear_forward_and_backward_trace_without_graph_breaks(preset, override):
    recipe = get_recipe(preset, backward_override=override)
    for eager, compiled in eager_and_compiled(recipe, "aot_eager"):
        for a, b in zip(eager, compiled):
            assert torch.equal(a, b)
    assert graph_breaks() == 0


@pytest.mark.parametrize(
    "preset, override",
    [(preset, None) for preset in CURRENT_SCALING] + [("nvfp4", "dequantized"), ("mxfp4", "high_precision")],
)
@pytest.mark.parametrize("device", DEVICES)
def test_inductor_compiled_quantlinear_gives_the_eager_bits(preset, override, device):
    """Inductor's fused kernels, the stochastic-rounding stream (nvfp4, mxfp4: noise drawn through the
    qlab::stochastic_noise op from the layer's generator) and the Hadamard transform (nvfp4): same bits.
    On CUDA eager runs qlab's Triton kernels (and FP8 tensor cores), compiled code inductor's own."""
    recipe = get_recipe(preset, backward_override=override)
    for eager, compiled in eager_and_compiled(recipe, "inductor", device=device):
        for name, a, b in zip(("y", "dx", "dW", "db"), eager, compiled):
            if device == "cpu":
                assert torch.equal(a, b), name
            else:  # inductor's CUDA rounding, see DEVICES
                torch.testing.assert_close(b, a, rtol=0, atol=2**-8 * a.abs().max().item(), msg=name)
    assert graph_breaks() == 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA: the traced graph on the GPU")
@pytest.mark.parametrize("preset", CURRENT_SCALING)
def test_traced_quantlinear_on_cuda_gives_the_eager_bits(preset):
    """The traced forward and backward, run op by op (aot_eager), give eager's bits on CUDA. Under
    torch 2.11 this caught a backward that Dynamo handed dy = 0 (see _LinearFunction.forward)."""
    for eager, compiled in eager_and_compiled(get_recipe(preset), "aot_eager", device="cuda"):
        for name, a, b in zip(("y", "dx", "dW", "db"), eager, compiled):
            assert torch.equal(a, b), name
    assert graph_breaks() == 0


def test_stochastic_rounding_stream_continues_across_compiled_and_eager_calls():
    """A layer that alternates compiled and eager calls draws one stream: the same as all-eager."""
    recipe = get_recipe("nvfp4")
    torch.manual_seed(0)
    reference = QuantLinear(32, 32, recipe=recipe, seed=5)
    mixed = copy.deepcopy(reference)
    compiled = torch.compile(lambda layer, x: layer(x), backend="inductor", fullgraph=True)
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        call = compiled if step % 2 else (lambda layer, x: layer(x))
        for a, b in zip(layer_step(reference, x, lambda layer, x: layer(x)), layer_step(mixed, x, call)):
            assert torch.equal(a, b)


def test_noise_source_draws_what_the_generator_would():
    layer = QuantLinear(8, 8, recipe="nvfp4", seed=9)
    shapes = [(4, 3), (5,)]
    drawn = kernels.noise.drawn_noise(layer._noise_source, shapes, torch.zeros(1))
    generator = torch.Generator().manual_seed(9)
    for noise, shape in zip(drawn, shapes):
        assert torch.equal(noise, formats.stochastic_noise(shape, generator))


def test_layers_of_one_recipe_share_one_compiled_graph():
    """Each layer draws its stochastic-rounding noise through its own key, a tensor: one compiled graph
    serves every layer of a recipe, as it must for a model's repeated blocks (an int key was a
    constant of the graph, and each layer recompiled), and each layer still draws its own stream."""
    layers = [QuantLinear(32, 32, recipe="nvfp4", seed=seed) for seed in (1, 2, 3)]
    twins = copy.deepcopy(layers)  # the same seeds: the same streams, drawn eagerly
    compiled = torch.compile(lambda layer, x: layer(x), backend="aot_eager", fullgraph=True)
    for step in range(2):
        for layer, twin in zip(layers, twins):
            x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
            for a, b in zip(layer_step(layer, x, compiled), layer_step(twin, x, lambda layer, x: layer(x))):
                assert torch.equal(a, b)
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_the_noise_key_is_a_cpu_tensor_whatever_the_default_device():
    """The key is read back by int() in every draw: on a GPU that would synchronize, on meta it raises."""
    layer = QuantLinear(8, 8, recipe="nvfp4", seed=3)
    with torch.device("meta"):
        key = kernels.noise.register_noise_source(layer._generator)
    assert key.device.type == "cpu" and key.dtype == torch.int64 and key.dim() == 0
    drawn = kernels.noise.drawn_noise(key, [(4,)], torch.zeros(1))[0]
    assert torch.equal(drawn, formats.stochastic_noise((4,), torch.Generator().manual_seed(3)))


def test_a_copied_layer_draws_from_its_own_generators():
    layer = QuantLinear(32, 32, recipe="nvfp4", seed=1)
    x = torch.randn(16, 32)
    layer(x).sum().backward()  # creates the CPU generator
    state = layer._generator(torch.device("cpu")).get_state()
    twin = copy.deepcopy(layer)
    twin(x).sum().backward()
    assert torch.equal(layer._generator(torch.device("cpu")).get_state(), state)
    assert not torch.equal(twin._generator(torch.device("cpu")).get_state(), state)


@pytest.mark.parametrize("spec, axis", [("mxfp4", 0), (Q.NVFP4Spec(rounding="stochastic"), -1)])
def test_qdq_with_predrawn_noise_equals_qdq_with_the_generator(spec, axis):
    spec = Q.get_spec(spec)
    if spec.rounding != "stochastic":
        spec = Q.MXSpec("e2m1", rounding="stochastic")
    x = torch.randn(64, 48)
    from_generator = Q.qdq(x, spec, axis, generator=torch.Generator().manual_seed(4))
    noise = formats.stochastic_noise(Q.noise_shape(x, spec, axis), torch.Generator().manual_seed(4))
    assert torch.equal(Q.qdq(x, spec, axis, noise=noise), from_generator)
    blocked = formats.stochastic_noise(
        Q.noise_shape(x, spec, axis, blocked=True), torch.Generator().manual_seed(4)
    )
    q = Q.quantize(x, spec, axis, generator=torch.Generator().manual_seed(4))
    assert torch.equal(Q.quantize(x, spec, axis, noise=blocked).codes, q.codes)


def test_delayed_scaling_runs_as_an_eager_island_with_the_eager_bits():
    torch.manual_seed(0)
    eager = QuantLinear(32, 32, recipe="fp8_delayed")
    compiled_layer = copy.deepcopy(eager)
    compiled = torch.compile(lambda layer, x: layer(x), backend="aot_eager")
    for step in range(3):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(step))
        for a, b in zip(
            layer_step(eager, x, lambda layer, x: layer(x)), layer_step(compiled_layer, x, compiled)
        ):
            assert torch.equal(a, b)
    for role, scaler in eager.scalers.items():
        assert torch.equal(scaler.history, compiled_layer.scalers[role].history)
    assert not compiled_layer.compiles and graph_breaks() > 0


def test_fullgraph_names_why_delayed_scaling_cannot_be_traced():
    layer = QuantLinear(32, 32, recipe="fp8_delayed")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with pytest.raises(Exception, match="delayed scaling"):
        compiled(torch.randn(4, 32))


def chargpt():
    torch.manual_seed(0)
    return CharGPT(32, context=16, layers=2, width=32, heads=4)


def tiny_llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=32,
        max_position_embeddings=16,
    )
    return transformers.LlamaForCausalLM(config)


IDS = torch.randint(0, 32, (2, 16), generator=torch.Generator().manual_seed(1))
MODELS = {
    "chargpt": (chargpt, lambda model: nn.functional.cross_entropy(model(IDS).flatten(0, 1), IDS.flatten())),
    "llama": (tiny_llama, lambda model: model(input_ids=IDS, labels=IDS).loss),
}


@pytest.mark.parametrize(
    "name, recipe, autocast",
    [("chargpt", "nvfp4", False), ("llama", "mxfp8", True)],
)
def test_quantized_models_compile_whole(name, recipe, autocast):
    """fullgraph=True on a quantized CharGPT and a Hugging Face Llama: no graph break, and the loss and
    every gradient as eager within 1e-5 relative to their norm (bf16 autocast: 1e-2), the difference
    being the order of the fused reductions outside QuantLinear (LayerNorm/RMSNorm, softmax, loss)."""
    build, loss_of = MODELS[name]
    model = build().train()
    quantize_model(model, recipe)
    twin = copy.deepcopy(model)
    compiled = torch.compile(twin, backend="aot_eager", fullgraph=True)
    grads = []
    for candidate, run in ((model, model), (twin, compiled)):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = loss_of(run)
        loss.backward()
        grads.append([loss.detach().float()] + [p.grad for p in candidate.parameters()])
    tolerance = 1e-2 if autocast else 1e-5
    for a, b in zip(*grads):
        assert (a - b).norm() <= tolerance * a.norm() + 1e-12
    assert graph_breaks() == 0


def test_training_compiled_tracks_eager_training(monkeypatch):
    """TrainConfig(compile=True) compiles CharGPT's blocks, one graph for all of them (here with
    torch.compile's aot_eager backend: inductor's bits are pinned layer by layer above), follows the
    eager run, and leaves the model it returns eager."""
    from qlab.train import loop

    compile_calls, compile = [], torch.compile

    def aot_eager(model, **options):
        compile_calls.append(options)
        return compile(model, backend="aot_eager", **options)

    monkeypatch.setattr(loop.torch, "compile", aot_eager)
    config = TrainConfig(
        recipe="mxfp4",
        context=16,
        layers=2,
        width=32,
        batch_size=4,
        steps=3,
        eval_every=3,
        eval_batches=1,
        warmup_steps=0,
        progress=False,
    )
    eager = train(config).metrics
    dynamo.utils.counters.clear()
    result = train(config.replace(compile=True))
    compiled = result.metrics
    assert (eager.train_loss - compiled.train_loss).abs().max() < 1e-4
    assert abs(eager.val_loss.iloc[-1] - compiled.val_loss.iloc[-1]) < 1e-4
    expected = {"dynamic": False, "options": kernels.compiled.COMPILE_OPTIONS}
    assert compile_calls == [expected] * 2  # one per block
    assert dynamo.utils.counters["stats"]["unique_graphs"] == 1  # the second block reuses the first's
    assert all(type(block).__name__ == "Block" for block in result.model.blocks)


def test_compiled_training_refuses_a_lowered_matmul_precision():
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        with pytest.raises(ValueError, match="highest"):
            train(
                TrainConfig(
                    context=16, layers=1, width=32, batch_size=2, steps=1, compile=True, progress=False
                )
            )
    finally:
        torch.set_float32_matmul_precision(previous)


# --- CUDA graphs (TrainConfig.compile_mode="reduce-overhead") ----------------------------------------


def aot_graphs(layer, x):
    """The forward and backward ATen graphs AOTAutograd hands a compiler for one step of ``layer``:
    the graphs inductor decides on, node by node, whether CUDA graphs can capture."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    call = torch.compile(lambda layer, x: layer(x), backend=aot_autograd(fw_compiler=keep), fullgraph=True)
    layer_step(layer, x, call)
    return graphs


NEEDS_THE_TAG = pytest.mark.skipif(
    not kernels.noise.NOISE_STAYS_OUT_OF_CUDA_GRAPHS,
    reason="this torch has no Tag.cudagraph_unsafe: compile_mode='reduce-overhead' is refused (tested below)",
)


@NEEDS_THE_TAG
@pytest.mark.parametrize("preset, draws", [("mxfp8", False), ("fp8_tensorwise", False), ("nvfp4", True)])
def test_cudagraph_capture_excludes_exactly_stochastic_roundings_draws(preset, draws):
    """Inductor's own test of a graph node (``is_cudagraph_unsafe_fx_node``, what decides where it
    splits a graph for CUDA graphs) finds the noise op, and only it: nvfp4's gradient draws run between
    the captured partitions (a replay would repeat the recorded numbers), while an RNE recipe's layer
    is captured whole."""
    from torch._inductor import utils

    def is_cudagraph_unsafe_fx_node(node):  # inductor's own test where this torch has it (2.13 does)
        if hasattr(utils, "is_cudagraph_unsafe_fx_node"):
            return utils.is_cudagraph_unsafe_fx_node(node)
        target = node.target
        return isinstance(target, torch._ops.OpOverload) and torch.Tag.cudagraph_unsafe in target.tags

    layer = QuantLinear(64, 64, recipe=get_recipe(preset), seed=2)
    graphs = aot_graphs(layer, torch.randn(32, 64))
    assert len(graphs) == 2  # forward, backward
    unsafe = [node for gm in graphs for node in gm.graph.nodes if is_cudagraph_unsafe_fx_node(node)]
    noise = torch.ops.qlab.stochastic_noise.default
    assert [node.target for node in unsafe] == [noise] * len(unsafe)
    assert bool(unsafe) == draws


@NEEDS_THE_TAG
def test_training_with_cudagraphs_compiles_with_them_and_marks_each_step(monkeypatch):
    """compile_mode="reduce-overhead" passes inductor's CUDA-graph option (and graph partitioning, which
    keeps the noise op out) beside COMPILE_OPTIONS, and marks the start of each optimizer step for the
    CUDA-graph trees: once a step, not once a micro-batch, which would free the gradients the last
    micro-batch's backward left in .grad (the run on the GPU is the test below)."""
    from qlab.train import loop

    compile_calls, compile = [], torch.compile
    marks = []

    def aot_eager(model, **options):
        compile_calls.append(options)
        return compile(model, backend="aot_eager", dynamic=options["dynamic"])

    monkeypatch.setattr(loop.torch, "compile", aot_eager)
    monkeypatch.setattr(loop.torch.compiler, "cudagraph_mark_step_begin", lambda: marks.append(1))
    config = TrainConfig(
        recipe="nvfp4", context=16, layers=2, width=32, batch_size=4, grad_accum=2, steps=3,
        eval_every=3, eval_batches=1, warmup_steps=0, progress=False, compile=True,
    )  # fmt: skip
    train(config)
    assert marks == []
    train(config.replace(compile_mode="reduce-overhead"))
    options = {**kernels.compiled.COMPILE_OPTIONS, "triton.cudagraphs": True, "graph_partition": True}
    assert compile_calls[-2:] == [{"dynamic": False, "options": options}] * 2
    assert len(marks) == 3  # one a step


def test_cudagraphs_need_the_tag_that_keeps_draws_out(monkeypatch):
    from qlab.train import loop

    monkeypatch.setattr(loop, "NOISE_STAYS_OUT_OF_CUDA_GRAPHS", False)
    with pytest.raises(ValueError, match="cudagraph_unsafe"):
        loop.compiled_step_model(CharGPT(32, context=16, layers=1, width=32, heads=4), "reduce-overhead")


@NEEDS_THE_TAG
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize(
    "recipe, override",
    [(preset, None) for preset in PRESETS if preset != "bf16"]
    + [("nvfp4", "dequantized"), ("nvfp4", "high_precision"), ("mxfp8", "dequantized")],
)
def test_cudagraph_training_on_cuda_replays_what_compiled_training_computes(recipe, override):
    """Inductor with CUDA graphs against inductor without, 5 steps of 2 micro-batches on the GPU (step 0
    warms up, step 1 records, steps 2-4 replay): the same losses and gradient norms (the graphs replay
    the same kernels; nvfp4's draws, made between the partitions, advance as without graphs; the
    accumulated .grad survives the second micro-batch), graphs recorded and none skipped."""
    config = TrainConfig(
        recipe=recipe, backward_override=override, context=32, layers=2, width=64, batch_size=8, grad_accum=2,
        steps=5, eval_every=5, eval_batches=1, warmup_steps=0, progress=False, compile=True, device="cuda",
    )  # fmt: skip
    default = train(config).metrics
    dynamo.utils.counters.clear()
    graphs = train(config.replace(compile_mode="reduce-overhead")).metrics
    inductor = dict(dynamo.utils.counters["inductor"])
    assert inductor.get("cudagraph_skips", 0) == 0, inductor
    assert inductor.get("cudagraph_recorded_non_static_inputs", 0) > 0, inductor  # counted as it records
    # 1e-5: splitting nvfp4's backward around the draws may fuse LayerNorm's reductions in another
    # order (last bits). Replayed draws, the failure this guards, moved this config's grad_norm by
    # 1.0e-3 to 2.4e-3 and its train_loss by 6.5e-5 to 1.4e-4 from step 2 on (simulated on the CPU)
    for column in ("train_loss", "grad_norm", "val_loss"):  # val_loss: NaN between evaluations
        expected, found = (torch.tensor(frame[column].to_numpy()) for frame in (default, graphs))
        torch.testing.assert_close(found, expected, rtol=1e-5, atol=0, equal_nan=True, msg=column)


@pytest.mark.parametrize(
    "shape, preset, out_dtype",
    [((2, 20), "nvfp4_torchao", torch.bfloat16), ((33, 17, 1), "nvfp4_2d", torch.bfloat16),
     ((3, 40), "nvfp4_torchao", torch.float16)],
)  # fmt: skip
def test_a_16_bit_result_with_a_partial_last_block_has_the_reference_bits(shape, preset, out_dtype):
    """inductor's C++ loop writing a 16-bit result left a partial last block's elements unwritten
    (garbage that changed from run to run); the compiled path now casts its float32 result."""
    x = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    expected = Q.qdq(x, preset, dtype=out_dtype)
    got = kernels.qdq(x, preset, dtype=out_dtype, backend="cpu")
    assert torch.equal(got.view(torch.int16), expected.view(torch.int16))
