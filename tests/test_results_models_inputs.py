"""Inputs at the edges of qlab.results, qlab.plotting, qlab.run_lists, qlab.host and qlab.models.

References: transformers' own ``from_pretrained`` (its bf16 model's buffers, its tokenizer), the PNG
header's width and height read from the bytes by hand, matplotlib's own ``savefig`` under the paper
style, CSV bytes and markdown tables written out here, run counts computed from the notebooks'
parameters cells, and torch's CUDA device count. Errors are matched on the words that name the
argument, what was expected and what came.
"""

from __future__ import annotations

import io
import os
import shutil
import struct

import matplotlib
import pandas as pd
import pytest
import torch

from qlab import host, models, paths, plotting, results, run_lists, session

pytestmark = pytest.mark.filterwarnings("ignore::FutureWarning")

NOTEBOOK_03 = "03_backward_override_training_curves"
NOTEBOOK_07 = "07_recipe_ablations"
TOO_LONG = "x" * 300  # past the 255 bytes a file name may have on Linux


# --- models.load: bf16 as transformers loads it, a tokenizer of one's own --------------------------------


def test_a_bf16_load_has_the_buffers_and_weights_transformers_gives():
    """SmolLM2's RoPE frequencies are buffers its checkpoint does not store: transformers' bf16 load
    keeps them float32, and so must qlab's, with every weight its bf16 rounding."""
    import transformers

    model, _ = models.load("smollm2-135m", "bf16")
    with models.quiet_loading():
        reference = transformers.LlamaForCausalLM.from_pretrained(
            models.cache_dir("smollm2-135m"), dtype=torch.bfloat16, local_files_only=True
        ).eval()
    buffers, expected = dict(model.named_buffers()), dict(reference.named_buffers())
    assert buffers.keys() == expected.keys() and "model.rotary_emb.inv_freq" in buffers
    for name, buffer in expected.items():
        assert buffers[name].dtype == buffer.dtype, name
        assert torch.equal(buffers[name], buffer), name
    assert buffers["model.rotary_emb.inv_freq"].dtype == torch.float32
    state, reference_state = model.state_dict(), reference.state_dict()
    assert state.keys() == reference_state.keys()
    assert all(torch.equal(state[name], tensor) for name, tensor in reference_state.items())
    ids = torch.arange(100, 132).reshape(1, 32)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, reference(input_ids=ids).logits)


def test_a_bf16_encoder_has_the_buffers_transformers_gives():
    import transformers

    model, _ = models.load("minilm-l6", "bf16")
    with models.quiet_loading():
        reference = transformers.BertModel.from_pretrained(
            models.model_path("minilm-l6"), dtype=torch.bfloat16, local_files_only=True
        )
    expected = dict(reference.named_buffers())
    assert {name: b.dtype for name, b in model.named_buffers()} == {n: b.dtype for n, b in expected.items()}
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_each_load_has_a_tokenizer_of_its_own():
    import transformers

    first, second = models.load("minilm-l6")[1], models.load("minilm-l6")[1]
    reference = transformers.AutoTokenizer.from_pretrained(
        models.model_path("minilm-l6"), local_files_only=True
    )
    assert first.add_tokens(["qlabxyzzy"]) == 1 and len(first) == len(reference) + 1
    later = models.load("minilm-l6")[1]
    assert len(second) == len(later) == len(reference)
    text = "qlabxyzzy splits into pieces"
    assert later(text)["input_ids"] == reference(text)["input_ids"] != first(text)["input_ids"]


# --- models: the float32 cache of a GGUF file is used only when it says it came from that file -----------


def _tiny_llama(folder, tokenizer_from):
    """A foreign model (2 layers × 16, SmolLM2's vocabulary) saved where the cache would be."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=49152, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)


@pytest.mark.parametrize("stamp", [None, "transformers", "sha256"])
def test_a_cache_that_did_not_come_from_the_gguf_file_is_converted_again(stamp, tmp_path, monkeypatch):
    """A foreign model in the cache folder, without a record of its source or with one naming another
    transformers or another file, is replaced by a conversion; the conversion here links the real
    cache's files (the slow test of test_models.py checks those against the GGUF file itself)."""
    import hashlib
    import json

    import transformers

    real = models.cache_dir("smollm2-135m")
    models.load("smollm2-135m")  # the real cache exists from here on
    (recorded,) = [f for f in real.iterdir() if f.suffix == ".json" and "gguf_sha256" in f.read_text()]
    gguf = models.model_path("smollm2-135m") / models.PACKAGED["smollm2-135m"].gguf_file
    assert json.loads(recorded.read_text())["gguf_sha256"] == hashlib.sha256(gguf.read_bytes()).hexdigest()
    assert json.loads(recorded.read_text())["transformers"] == transformers.__version__
    cached = tmp_path / "smollm2-135m"
    _tiny_llama(cached, real)
    if stamp is not None:
        record = json.loads(recorded.read_text())
        record["transformers" if stamp == "transformers" else "gguf_sha256"] = "0"
        (cached / recorded.name).write_text(json.dumps(record))
    conversions = []

    def convert(model_class, folder, gguf_file, target, *rest):
        conversions.append(gguf_file)
        shutil.rmtree(target)
        target.mkdir()
        for file in real.iterdir():
            os.symlink(file, target / file.name)

    monkeypatch.setattr(models, "cache_dir", lambda name: tmp_path / name)
    monkeypatch.setattr(models, "_convert_gguf", convert)
    models._load_float32.cache_clear()
    try:
        model, _ = models.load("smollm2-135m")
        models._load_float32.cache_clear()
        models.load("smollm2-135m")  # the cache now says where it came from: no conversion
    finally:
        models._load_float32.cache_clear()
    assert conversions == [models.PACKAGED["smollm2-135m"].gguf_file]
    with models.quiet_loading():
        reference = transformers.LlamaForCausalLM.from_pretrained(
            real, dtype=torch.float32, local_files_only=True
        )
    assert model.config.num_hidden_layers == reference.config.num_hidden_layers == 30
    assert all(
        torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values())
    )


# --- models: paths the system refuses, empty and wrong-typed arguments -----------------------------------


@pytest.mark.parametrize(
    "call, argument",
    [
        (lambda: models.checkpoint_folder(TOO_LONG), "model"),
        (lambda: models.load_any(TOO_LONG), "model"),
        (lambda: models.check_source(TOO_LONG), "model"),
        (lambda: models.tokenizer_source(TOO_LONG), "tokenizer"),
        (lambda: models.read_text(TOO_LONG), "text file"),
        (lambda: models.text_batches(len, [TOO_LONG]), "text file"),
        (lambda: models.checkpoint_folder("~qlab-no-such-user/model"), "model"),
    ],
)
def test_a_path_the_system_cannot_look_up_is_refused_by_name(call, argument):
    with pytest.raises(ValueError, match=f"^{argument} '.*' is not a path this system can look up"):
        call()


@pytest.mark.parametrize(
    "call",
    [
        lambda: models.tokenizer_source(""),
        lambda: models.tokenizer_source("  "),
        lambda: models.check_source("smollm2-135m", ""),
        lambda: models.load_any("smollm2-135m", tokenizer=""),
    ],
)
def test_an_empty_tokenizer_is_refused_not_read_as_the_current_folder(call):
    with pytest.raises(ValueError, match="^tokenizer must name a folder or a cached hub id .*got '"):
        call()


@pytest.mark.parametrize(
    "tokenizer, files, message",
    [
        (len, None, r"^files must be a text file's path or a list of paths, got None \(NoneType\)"),
        (len, 3, r"^files must be a text file's path or a list of paths, got 3 \(int\)"),
        (len, [None], r"^files\[0\] must be a text file's path \(a str or Path\), got None"),
        (len, ["a.txt", b"b.txt"], r"^files\[1\] must be a text file's path \(a str or Path\), got b'b.txt'"),
        (None, "a.txt", r"^tokenizer must be a tokenizer \(a callable\), got None"),
    ],
)
def test_text_batches_names_a_wrong_argument(tokenizer, files, message):
    with pytest.raises(TypeError, match=message):
        models.text_batches(tokenizer, files)


def test_read_text_says_a_folder_is_a_folder(tmp_path):
    with pytest.raises(ValueError, match=f"^text file '{tmp_path}' is a folder"):
        models.read_text(tmp_path)
    with pytest.raises(ValueError, match="^text file must be a path, got ''"):
        models.read_text("")
    with pytest.raises(TypeError, match=r"^text file must be a path \(a str or Path\), got None"):
        models.read_text(None)
    with pytest.raises(ValueError, match="does not exist"):
        models.read_text(tmp_path / "missing.txt")


# --- host.resolve_device: the CPU and the GPUs torch sees, nothing else ----------------------------------


@pytest.mark.parametrize("name", ["mps", "meta", "xpu", "cpu:7", torch.device("meta")])
def test_resolve_device_refuses_devices_qlab_does_not_run_on(name):
    with pytest.raises(ValueError, match=r"^where must be a device qlab runs on: 'auto', 'cpu', 'cuda'"):
        host.resolve_device(name, argument="where")


def test_resolve_device_takes_the_cpu_and_only_the_gpus_torch_sees():
    assert host.resolve_device("cpu") == host.resolve_device(torch.device("cpu")) == torch.device("cpu")
    assert str(host.resolve_device("cpu:0")) == "cpu"  # the one CPU, named as everywhere else
    assert host.resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match=r"^where "):
        host.resolve_device(f"cuda:{count}", argument="where")
    if count:
        assert host.resolve_device("cuda:0") == torch.device("cuda", 0)
        assert host.resolve_device("cuda").type == "cuda"
    else:
        with pytest.raises(ValueError, match="^where 'cuda' was asked for, but torch sees no CUDA device"):
            host.resolve_device("cuda", argument="where")
    assert run_lists.run_list(NOTEBOOK_07, _smoke(NOTEBOOK_07), "cpu").configs[0].device == "cpu"


# --- run_lists: each configuration once ------------------------------------------------------------------


def _smoke(notebook: str, **changes) -> dict:
    return {**session.notebook_defaults(notebook), "smoke": True, **changes}


BASELINE_TWICE = "^recipe 'bf16' with override 'none' is trained by the BF16 baseline"


@pytest.mark.parametrize(
    "notebook, changes, message",
    [
        (NOTEBOOK_03, dict(overrides=["none", "none"]), r"^overrides lists 'none' twice \(entries 0 and 1\)"),
        (
            NOTEBOOK_03,
            dict(recipes=["nvfp4", "mxfp8", "nvfp4"]),
            r"^recipes lists 'nvfp4' twice \(entries 0 and 2",
        ),
        (
            NOTEBOOK_03,
            dict(recipe_backward_only=["fp8_delayed"] * 2),
            "^recipe_backward_only lists 'fp8_delayed'",
        ),
        (
            NOTEBOOK_03,
            dict(recipe_backward_only=["nvfp4"]),
            "^recipe 'nvfp4' is in both recipes and recipe_back",
        ),
        (
            NOTEBOOK_03,
            dict(recipe_backward_only=["bf16"]),
            BASELINE_TWICE + " and again by recipe_backward_only",
        ),
        (
            NOTEBOOK_03,
            dict(recipes=["bf16"]),
            BASELINE_TWICE + r" and again by recipes × overrides \('bf16'\)",
        ),
        (NOTEBOOK_07, dict(train_variants=["fp32"]), "^train_variants must not list 'fp32'"),
        (
            NOTEBOOK_07,
            dict(train_variants=["nvfp4", "fp8_blockwise", "nvfp4"]),
            "^train_variants lists 'nvfp4' twice",
        ),
    ],
)
def test_a_repeated_configuration_is_refused_by_name(notebook, changes, message):
    for smoke in (False, True):
        with pytest.raises(ValueError, match=message):
            run_lists.run_list(
                notebook, {**session.notebook_defaults(notebook), "smoke": smoke, **changes}, "cpu"
            )


@pytest.mark.parametrize("profile", ["cpu", "paper"])
def test_the_notebooks_run_lists_train_each_configuration_once(profile):
    """The committed parameters: as many runs as seeds × configurations, each label and config once."""
    for notebook in (NOTEBOOK_03, NOTEBOOK_07):
        defaults = session.notebook_defaults(notebook)
        listed = run_lists.run_list(notebook, {**defaults, "profile": profile}, "cpu")
        seeds = max(defaults["seeds"], 5) if profile == "paper" else defaults["seeds"]
        if notebook == NOTEBOOK_03:
            each = (
                2
                + len(defaults["recipes"]) * len(defaults["overrides"])
                + len(defaults["recipe_backward_only"])
            )
        else:
            each = 1 + len(defaults["train_variants"])
        assert len(listed.labels) == len(listed.configs) == seeds * each
        assert len({tuple(sorted(label.items())) for label in listed.labels}) == seeds * each
        assert len({repr(config) for config in listed.configs}) == seeds * each


# --- results.save_csv: a negative zero, floats in object columns, the index -------------------------------


def test_save_csv_writes_a_negative_zero_as_zero(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    negative = pd.DataFrame({"x": [-0.0, 1.5], "y": pd.Series([-0.0, 2.0], dtype="float32"), "n": [0, 1]})
    positive = pd.DataFrame({"x": [0.0, 1.5], "y": pd.Series([0.0, 2.0], dtype="float32"), "n": [0, 1]})
    assert negative.equals(positive)
    expected = b"x,y,n\n0,0,0\n1.5,2,1\n"
    assert results.save_csv(negative, "negative").read_bytes() == expected
    assert results.save_csv(positive, "positive").read_bytes() == expected
    assert str(negative["x"][0]) == "-0.0"  # the caller's frame is left as it was
    repeated = pd.DataFrame([[-0.0, float("nan")]], columns=["a", "a"])
    assert results.write_csv(repeated, tmp_path / "r.csv").read_bytes() == b"a,a\n0,\n"


def test_save_csv_formats_float_columns_only_and_writes_no_index(tmp_path, monkeypatch):
    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    mixed = pd.DataFrame({"value": [1 / 3, "text"], "float": [1 / 3, 2.0]})
    assert (
        results.save_csv(mixed, "mixed").read_bytes()
        == b"value,float\n0.3333333333333333,0.3333333333\ntext,2\n"
    )
    means = pd.DataFrame({"recipe": ["a", "a", "b"], "loss": [1.0, 2.0, 4.0]}).groupby("recipe").mean()
    assert results.save_csv(means, "dropped").read_bytes() == b"loss\n1.5\n4\n"
    assert results.save_csv(means.reset_index(), "kept").read_bytes() == b"recipe,loss\na,1.5\nb,4\n"
    assert "reset_index()" in results.save_csv.__doc__ and "float columns" in results.save_csv.__doc__


# --- results.markdown_table: the float format, line endings in cells -------------------------------------


@pytest.mark.parametrize(
    "float_format, detail",
    [
        ("{x}", "KeyError"),
        ("{0}{1}", "IndexError"),
        ("{:d}", "Unknown format code 'd'"),
        ("{0.numerator}", "AttributeError"),
        ("{{:.3f}}", "it writes '{:.3f}' for any float"),
    ],
)
def test_markdown_table_refuses_a_float_format_that_cannot_format_a_float(float_format, detail):
    with pytest.raises(
        ValueError, match=r"^float_format must be a format with one replacement field"
    ) as raised:
        results.markdown_table(pd.DataFrame({"a": [1.5]}), float_format)
    assert f"got {float_format!r}" in str(raised.value) and detail in str(raised.value)


def test_markdown_table_takes_formats_that_round_and_breaks_no_row():
    frame = pd.DataFrame({"name": ["a\rb", "c\r\nd", "e\nf"], "x": [1.5, 2.25, 10.0]})
    assert results.markdown_table(frame, "{:.0f}") == (
        "| name | x |\n|---|---|\n| a b | 2 |\n| c d | 2 |\n| e f | 10 |"
    )
    assert results.markdown_table(frame, "{:.1%}").splitlines()[2] == "| a b | 150.0% |"


# --- plotting.save_figure: 300 dpi whatever rcParams say, the paper style's bytes as matplotlib's --------


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk: bytes 16-23 after the 8-byte signature and chunk head."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_save_figure_writes_300_dpi_whatever_rcparams_say(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    with matplotlib.rc_context({"savefig.dpi": 100, "savefig.bbox": "standard"}):
        fig = plt.figure(figsize=(2.0, 1.5))
        fig.add_subplot().plot([0, 1], [1, 0])
        saved = plotting.save_figure(fig, "dpi")
        plt.close(fig)
    assert _png_size(saved.png.read_bytes()) == (600, 450)


def test_save_figure_under_the_paper_style_writes_what_matplotlib_writes(tmp_path, monkeypatch):
    import matplotlib.pyplot as plt

    monkeypatch.setenv(paths.RESULTS_ENV, str(tmp_path))
    with matplotlib.rc_context():
        plotting.use_paper_style()
        fig, ax = plotting.subplots()
        ax.plot([0, 1, 2], [2, 0, 1], label="line")
        ax.imshow([[0.0, 1.0], [1.0, 0.0]], extent=(0, 1, 0, 1))  # rasterized in the PDF
        ax.legend()
        saved = plotting.save_figure(fig, "paper")
        undated = {"Creator": None, "Producer": None, "CreationDate": None, "ModDate": None}
        for kind, metadata, path in (("pdf", undated, saved.pdf), ("png", {"Software": None}, saved.png)):
            reference = io.BytesIO()
            fig.savefig(reference, format=kind, metadata=metadata)  # the style's savefig.dpi: 300
            assert path.read_bytes() == reference.getvalue(), kind
        plt.close(fig)
