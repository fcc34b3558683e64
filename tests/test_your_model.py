"""Any checkpoint, any text, offline: qlab.models.load_any and text_batches on tiny models saved here.

The models are built with random weights and saved with save_pretrained; the tokenizer is a
character-level BertTokenizer written from a vocabulary file. A hub id is served from a Hugging Face
cache folder laid out as huggingface_hub lays it out, and every socket connection is refused.
"""

import socket

import pytest
import torch
import transformers

from qlab import advisor, models, plan
from qlab.nn import linear_layers

TEXT = "Shall I compare thee to a summer's day? Thou art more lovely and more temperate.\n" * 40


def _tokenizer(folder):
    """A character-level fast tokenizer: every character of TEXT one token (``folder`` is unused)."""
    import tokenizers

    vocabulary = {token: index for index, token in enumerate(["[UNK]", *sorted(set(TEXT))])}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocabulary, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Split(
        tokenizers.Regex(r"[\s\S]"), behavior="isolated"
    )
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="[UNK]")


def _save(model, folder, with_tokenizer=True):
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    if with_tokenizer:
        _tokenizer(folder).save_pretrained(folder)
    return folder


SIZES = dict(vocab_size=64, max_position_embeddings=64, num_hidden_layers=1, intermediate_size=64)


def _llama():
    torch.manual_seed(0)
    heads = dict(num_attention_heads=4, num_key_value_heads=2)
    config = transformers.LlamaConfig(hidden_size=32, **heads, **SIZES)
    return transformers.LlamaForCausalLM(config)


def _gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=64)
    return transformers.GPT2LMHeadModel(config)


def _bert():
    torch.manual_seed(0)
    heads = dict(num_attention_heads=2)
    config = transformers.BertConfig(hidden_size=32, **heads, **SIZES)
    return transformers.BertForMaskedLM(config)


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("a network connection was attempted")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


@pytest.mark.parametrize(
    "build, kind, expected_class",
    [(_llama, models.CAUSAL_LM, "LlamaForCausalLM"), (_gpt2, models.CAUSAL_LM, "GPT2LMHeadModel"),
     (_bert, models.ENCODER, "BertModel")],
)  # fmt: skip
def test_a_checkpoint_folder_loads_with_its_weights_and_tokenizer(
    tmp_path, no_network, build, kind, expected_class
):
    original = build().eval()
    folder = _save(original, tmp_path / "checkpoint")
    model, tokenizer, found = models.load_any(str(folder))
    assert found == kind and type(model).__name__ == expected_class and not model.training
    loaded = model.state_dict()
    for name, value in original.state_dict().items():
        key = name.removeprefix("bert.")  # the encoder loads as its base model
        if key in loaded:
            assert torch.equal(loaded[key], value), name
    assert tokenizer("Thou art", add_special_tokens=False)["input_ids"] == [
        tokenizer.convert_tokens_to_ids(c) for c in "Thou art"
    ]
    # every Linear-like layer, Conv1D included, is offered to a plan with its (out, in) shape
    table = advisor.layer_table(model, ["mxfp8"])
    convertible = {name: module for name, module, why in linear_layers(model) if why is None}
    assert list(table.layer) == list(convertible)
    assert (model_bf16 := models.load_any(str(folder), "bf16")[0]).dtype == torch.bfloat16, model_bf16


def test_a_cached_hub_id_loads_offline_and_an_uncached_one_fails_clearly(tmp_path, no_network, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / ("a" * 40)
    _save(_llama(), snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("a" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    model, _, kind = models.load_any("someone/tiny-llama")
    assert kind == models.CAUSAL_LM and type(model).__name__ == "LlamaForCausalLM"
    refused = r"'someone/other' is neither .* nor a hub id in the local Hugging Face cache .*hf download"
    with pytest.raises(ValueError, match=refused):
        models.load_any("someone/other")


def test_what_is_not_a_usable_checkpoint_is_refused_before_loading(tmp_path, no_network):
    with pytest.raises(ValueError, match="neither a packaged model .*closest: smollm2-135m"):
        models.load_any("smollm2-13m")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ValueError, match="has no config.json"):
        models.load_any(str(empty))
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    _llama().config.save_pretrained(no_weights)
    with pytest.raises(ValueError, match="has a config.json but no weights"):
        models.load_any(str(no_weights))
    bare = _save(_llama(), tmp_path / "bare", with_tokenizer=False)
    with pytest.raises(ValueError, match="has no tokenizer .*--tokenizer"):
        models.load_any(str(bare))
    tokenizer_only = tmp_path / "tokenizer"
    tokenizer_only.mkdir()
    _tokenizer(tokenizer_only).save_pretrained(tokenizer_only)
    assert models.load_any(str(bare), tokenizer=str(tokenizer_only))[2] == models.CAUSAL_LM
    classifier = transformers.BertForSequenceClassification(_bert().config)
    with pytest.raises(ValueError, match="not a kind qlab scores: a causal LM"):
        models.load_any(str(_save(classifier, tmp_path / "classifier")))


def test_text_windows_are_disjoint_drawn_by_seed_and_short_text_says_how_many_it_holds(tmp_path):
    tokenizer = _tokenizer(tmp_path)
    path = tmp_path / "sonnet.txt"
    path.write_text(TEXT)
    calibration, held_out = models.text_batches(
        tokenizer, [path], batch_size=2, tokens=16, count=3, held_out=2
    )
    assert len(calibration) == 3 and len(held_out) == 2
    assert all(b.shape == (2, 16) and b.dtype == torch.int64 for b in calibration + held_out)
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    windows = [tuple(ids[i : i + 16]) for i in range(0, len(ids) - 15, 16)]
    drawn = [tuple(row.tolist()) for batch in calibration + held_out for row in batch]
    assert all(window in windows for window in drawn)
    positions = [windows.index(window) for window in drawn]  # the text repeats: compare positions drawn
    order = torch.randperm(len(ids) // 16, generator=torch.Generator().manual_seed(0))[:10].tolist()
    assert [windows[i] for i in order] == drawn and len(set(order)) == 10, positions
    again = models.text_batches(tokenizer, str(path), batch_size=2, tokens=16, count=3, held_out=2)
    assert all(torch.equal(a, b) for a, b in zip(calibration + held_out, again[0] + again[1]))
    other = models.text_batches(tokenizer, path, batch_size=2, tokens=16, count=3, seed=1)[0]
    assert not all(torch.equal(a, b) for a, b in zip(calibration, other))

    windows_held = len(ids) // 16
    with pytest.raises(ValueError, match=f"{windows_held} windows of 16; 1000 \\+ 0 batches of 2 need 2000"):
        models.text_batches(tokenizer, path, batch_size=2, tokens=16, count=1000)
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("café".encode("latin-1"))
    with pytest.raises(ValueError, match="is not UTF-8: byte 3 is 0xe9"):
        models.text_batches(tokenizer, latin1)
    blank = tmp_path / "blank.txt"
    blank.write_text("  \n")
    with pytest.raises(ValueError, match="holds no text"):
        models.text_batches(tokenizer, blank)
    with pytest.raises(ValueError, match="does not exist"):
        models.text_batches(tokenizer, tmp_path / "missing.txt")
    from qlab import notebooks, paths

    report = paths.NOTEBOOKS_DIR / "report_your_model.ipynb"  # checked before a kernel starts
    with pytest.raises(ValueError, match=r"^text\[1\]: text file .* is not UTF-8: byte 3 is 0xe9"):
        notebooks.check_parameters(report, {"text": [str(path), str(latin1)]})
    with pytest.raises(ValueError, match=r"^text\[0\]: text file .* holds no text"):
        notebooks.check_parameters(report, {"text": [str(blank)]})


def test_qlab_advise_makes_a_plan_for_a_checkpoint_folder_and_text(tmp_path, no_network, capsys, monkeypatch):
    from qlab import cli
    from qlab.nn import QuantLinear, quantize_model

    folder = _save(_llama(), tmp_path / "checkpoint")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "plan.json"
    common = ["advise", "--model", str(folder), "--text", str(text), "--tokens", "16", "--batches", "2"]
    planned = [
        "--formats",
        "nvfp4,mxfp8,bf16",
        "--effective-bits",
        "8",
        "--plan-out",
        str(out),
        "--held-out",
        "2",
    ]
    assert cli.main([*common, *planned]) == 0
    printed = capsys.readouterr().out
    assert "on 2 held-out batches (paired by batch" in printed
    assert "plan − float model: " in printed and "plan − first and last layers raised: " in printed
    chosen = plan.Plan.load(out)
    assert chosen.reached_bits <= 8 and chosen.model == str(folder) and chosen.kind == "measured"
    assert f"{chosen.reached_bits:.4f} bits per weight element (budget 8)" in printed
    model = models.load_any(str(folder))[0]
    assert chosen.model_config_sha256 == advisor.config_hash(model)
    quantize_model(model, out)
    assert sum(isinstance(m, QuantLinear) for m in model.modules()) == sum(
        f != "bf16" for f in chosen.layers.values()
    )

    def never(*args, **kwargs):
        raise AssertionError("a loss was evaluated before the arguments were checked")

    monkeypatch.setattr(advisor, "measured_scores", never)
    monkeypatch.setattr(advisor, "approximated_scores", never)
    assert cli.main([*common, "--formats", "nvfp4,mxfp9"]) == 2
    assert "'mxfp9', not a recipe preset; closest: mxfp8" in capsys.readouterr().err
    assert cli.main([*common, "--formats", "nvfp4,mxfp8", "--effective-bits", "4"]) == 2
    # NVFP4 weights: 4-bit codes and one E4M3 scale per 16×16 tile, 4 + 8/256 bits (before any model loads)
    assert "--effective-bits 4 is below the 4.03125 bits per weight element of the cheapest of --formats" in (
        capsys.readouterr().err
    )
    assert cli.main([*common, "--formats", "nvfp4", "--text", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_qlab_advise_hierarchical_says_what_it_saved_and_refuses_bad_devices_first(
    tmp_path, no_network, capsys, monkeypatch
):
    from qlab import cli

    folder = _save(_llama(), tmp_path / "checkpoint")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    common = ["advise", "--model", str(folder), "--text", str(text), "--tokens", "16", "--batches", "2",
              "--formats", "nvfp4,bf16", "--effective-bits", "8",
              "--plan-out", str(tmp_path / "p.json")]  # fmt: skip
    assert cli.main([*common, "--score", "hierarchical", "--expand", "0"]) == 0
    # one decoder layer (7 projections) and lm_head, each measured whole in nvfp4: 2 of 8 evaluations
    assert "hierarchical: 2 loss evaluations of the batches instead of 8 (1 layers measured alone" in (
        capsys.readouterr().out
    )
    assert plan.Plan.load(tmp_path / "p.json").kind == "hierarchical"

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_any", never)
    assert cli.main([*common, "--score", "hierarchical", "--expand", "-1"]) == 2
    assert "--expand must be" in capsys.readouterr().err
    if not torch.cuda.is_available():
        assert cli.main([*common, "--device", "cuda"]) == 2
        assert "torch sees no CUDA device" in capsys.readouterr().err
    assert cli.main([*common, "--device", "tpu9"]) == 2
    assert "unknown device --device='tpu9'" in capsys.readouterr().err


@pytest.mark.parametrize("model_type", ["roberta", "mpnet", "bert"])
def test_max_tokens_is_what_the_model_s_forward_takes(model_type):
    """RoBERTa's family numbers positions from pad_token_id + 1: of 40 positions, 38 tokens fit; the
    model's own forward is the reference (one token more fails inside torch's embedding lookup)."""
    config = transformers.AutoConfig.for_model(
        model_type, vocab_size=50, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=40,
    )  # fmt: skip
    model = transformers.AutoModel.from_config(config).eval()
    limit = models.max_tokens(config)
    assert limit == (38 if model_type != "bert" else 40)
    model(input_ids=torch.full((1, limit), 5))
    too_long = torch.full((1, limit + 1), 5)
    with pytest.raises(Exception):  # noqa: B017  (whatever torch raises: IndexError or RuntimeError)
        model(input_ids=too_long)
    with pytest.raises(ValueError, match=f"has {limit + 1} tokens a row; the model takes at most {limit}"):
        models.check_token_ids("batch", too_long, model)


def test_a_damaged_checkpoint_is_refused_in_one_line_naming_its_folder(tmp_path, no_network):
    import json

    truncated = _save(_llama(), tmp_path / "truncated")
    weights = truncated / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(ValueError, match=r"^model '.*truncated' could not be loaded: \w+"):
        models.load_any(str(truncated))
    resized = _save(_llama(), tmp_path / "resized")
    config = json.loads((resized / "config.json").read_text())
    (resized / "config.json").write_text(json.dumps({**config, "intermediate_size": 48}))
    with pytest.raises(ValueError, match=r"^model '.*resized' could not be loaded: RuntimeError: "):
        models.load_any(str(resized))
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(ValueError, match="is a GGUF file; qlab reads Hugging Face checkpoint folders"):
        models.load_any(str(tmp_path / "model.gguf"))


def test_what_loading_would_refuse_is_refused_from_config_json_alone(tmp_path, no_network, monkeypatch):
    """check_source reads config.json only: the report's parameters are checked with it before a kernel
    starts, and qlab advise before a weight loads."""
    from qlab import notebooks, paths

    def never(*args, **kwargs):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", never)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", never)
    encoder = _save(_bert(), tmp_path / "encoder")
    bare = _save(_llama(), tmp_path / "bare", with_tokenizer=False)
    tokenizer_only = tmp_path / "tokenizer"
    _tokenizer(tokenizer_only).save_pretrained(tokenizer_only)
    assert models.check_source(str(encoder)) == models.ENCODER
    assert models.check_source(str(bare), str(tokenizer_only)) == models.CAUSAL_LM
    report = paths.NOTEBOOKS_DIR / "report_your_model.ipynb"
    with pytest.raises(ValueError, match="score 'approximated' needs a loss whose gradient .* encoder"):
        notebooks.check_parameters(report, {"model_name": str(encoder), "score": "approximated"})
    with pytest.raises(ValueError, match="has no tokenizer .*--tokenizer FOLDER"):
        notebooks.check_parameters(report, {"model_name": str(bare)})
    notebooks.check_parameters(report, {"model_name": str(bare), "tokenizer": str(tokenizer_only)})
    with pytest.raises(ValueError, match="tokenizer is for a checkpoint folder or hub id, and the packaged"):
        notebooks.check_parameters(report, {"model_name": "minilm-l6", "tokenizer": str(tokenizer_only)})
    with pytest.raises(ValueError, match="^tokenizer: .*has no tokenizer"):
        notebooks.check_parameters(report, {"tokenizer": str(encoder.parent)})
    # one of the three given: the others are the defaults (the packaged smollm2-135m brings its own)
    with pytest.raises(ValueError, match="tokenizer is for a checkpoint folder or hub id, and the packaged"):
        notebooks.check_parameters(report, {"tokenizer": str(tokenizer_only)})


def test_a_byte_order_mark_is_no_text(tmp_path):
    path = tmp_path / "bom.txt"
    path.write_bytes("\ufeffShall I".encode())
    assert models.read_text(path) == "Shall I"


def test_advise_refuses_a_held_out_check_of_one_batch_before_loading(tmp_path, capsys, monkeypatch):
    from qlab import cli

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the arguments were checked")

    monkeypatch.setattr(models, "load_any", never)
    assert cli.main(["advise", "--formats", "nvfp4,bf16", "--effective-bits", "8", "--held-out", "1"]) == 2
    assert "--held-out must be 0 (no check) or at least 2 batches, got 1" in capsys.readouterr().err
    (tmp_path / "blank.txt").write_text(" \n")
    assert cli.main(["advise", "--text", str(tmp_path / "blank.txt")]) == 2
    assert "--text: text file" in capsys.readouterr().err


def test_a_failed_report_leaves_the_last_complete_one_and_a_new_one_replaces_all_of_it(tmp_path, monkeypatch):
    """run_report writes into <folder>/.partial/ and moves the files into place only when every cell ran:
    a failure leaves the previous report whole; a success also removes the previous run's plan for a
    budget it no longer has, and leaves files that are not the report's alone."""
    from pathlib import Path

    import nbformat

    from qlab import notebooks

    def fake_run(notebook, parameters, *, output, results_dir, **kwargs):
        (results_dir / "data").mkdir(parents=True, exist_ok=True)
        for budget in parameters["budgets"]:
            (results_dir / "data" / f"report_your_model_plan_{budget}bits.json").write_text(f"{budget} new")
        nbformat.write(nbformat.v4.new_notebook(), output)
        if parameters.get("fail"):
            raise notebooks.NotebookError(
                f"notebook report failed in cell In [3]\n  executed copy kept at {output}"
            )
        return notebooks.RunResult(Path(notebook), Path(output), 1.0, parameters, results_dir)

    monkeypatch.setattr(notebooks, "run_notebook", fake_run)
    folder = tmp_path / "report"
    (folder / "data").mkdir(parents=True)
    (folder / "data" / "report_your_model_plan_4.5bits.json").write_text("4.5 old")
    (folder / "data" / "mine.csv").write_text("the user's")
    (folder / "report_your_model.html").write_text("old html")
    with pytest.raises(notebooks.NotebookError, match="the report in .*report is as it was"):
        notebooks.run_report({"budgets": [6], "fail": True}, folder)
    assert (folder / "report_your_model.html").read_text() == "old html"
    assert (folder / "data" / "report_your_model_plan_4.5bits.json").read_text() == "4.5 old"
    assert (folder / ".partial" / "data" / "report_your_model_plan_6bits.json").exists()
    result, html = notebooks.run_report({"budgets": [6]}, folder)
    assert html == folder / "report_your_model.html" and "old html" not in html.read_text()
    assert result.output == folder / "report_your_model.ipynb" and result.results == folder
    assert sorted(p.name for p in (folder / "data").iterdir()) == [
        "mine.csv",
        "report_your_model_plan_6bits.json",
    ]
    assert not (folder / ".partial").exists()


@pytest.mark.notebook
def test_qlab_report_runs_on_a_cached_hub_id_into_its_own_folder(tmp_path, capsys, monkeypatch):
    """The report on a hub id served from a local cache (the kernel reads HF_HUB_CACHE); a checkpoint
    folder takes the same path from load_any on (notebook 06 and qlab advise are run on folders)."""
    import json

    import pandas as pd

    from qlab import cli

    cache = tmp_path / "hub"
    snapshot = cache / "models--someone--tiny-llama" / "snapshots" / ("a" * 40)
    _save(_llama(), snapshot)
    (cache / "models--someone--tiny-llama" / "refs").mkdir()
    (cache / "models--someone--tiny-llama" / "refs" / "main").write_text("a" * 40)
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))  # this process checks the arguments
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))  # the kernel runs the report
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    folder = "someone/tiny-llama"
    (tmp_path / "text.txt").write_text(TEXT)
    monkeypatch.chdir(tmp_path)  # a text named relative to where the command is typed, as the docs do
    out = tmp_path / "report"
    arguments = ["report", "--model", folder, "--text", "text.txt", "--effective-bits", "6,8"]
    arguments += ["--out", str(out)]
    assert cli.main([*arguments, "--smoke"]) == 0
    assert "report on" in capsys.readouterr().out
    html = (out / "report_your_model.html").read_text()
    assert "Your model under a bit budget" in html and "<img" in html  # figures embedded
    claims = pd.read_csv(out / "data" / "report_your_model_claims.csv").set_index("key")
    for budget in ("6", "8"):  # each plan's check: three comparisons, Holm within the budget
        rows = claims.loc[[f"held_out.{budget}.{short}" for short in ("float", "cheapest", "rule")]]
        assert (rows.family == f"held_out.{budget}").all() and rows.p_adjusted.notna().all()
        saved = json.loads((out / "data" / f"report_your_model_plan_{budget}bits.json").read_text())
        assert saved["model"] == folder and saved["effective_bits"] == float(budget)
    assert claims.loc["agreement", "test"] == "bootstrap" and not (out / ".partial").exists()
    for figure in ("formats", "scores", "held_out", "agreement"):
        assert list((out / "figures").glob(f"report_your_model_{figure}.*")), figure
    weights = pd.read_csv(out / "data" / "report_your_model_weights.csv")
    assert set(weights.format) == {"nvfp4", "mxfp8"}
    # bad input is refused before a kernel starts, naming the parameter
    assert cli.main([*arguments, "--formats", "nvfp4,mxfp9"]) == 2
    assert "formats[1] names 'mxfp9', not a recipe preset" in capsys.readouterr().err
    assert cli.main([*arguments[:2], str(tmp_path / "nowhere"), *arguments[3:]]) == 2
    assert "is neither a packaged model" in capsys.readouterr().err
    assert cli.main([*arguments[:6], "0.15,6", "--formats", "nvfp4,mxfp8"]) == 2  # a fraction, not bits
    assert "--effective-bits 0.15 is below the 4.03125 bits per weight element" in capsys.readouterr().err


@pytest.mark.notebook
def test_notebook_06_takes_a_checkpoint_folder_and_refuses_what_is_not_a_llama_style_decoder(tmp_path):
    from qlab.notebooks import NotebookError, run_notebook

    folder = _save(_gpt2(), tmp_path / "gpt2")
    with pytest.raises(NotebookError, match="Llama-style decoders of 2 or more layers.*qlab report --model"):
        run_notebook("06", {"model_name": str(folder)}, smoke=True, output=tmp_path / "06.ipynb",
                     results_dir=tmp_path)  # fmt: skip
    with pytest.raises(ValueError, match="model_name: model .* is neither a packaged model"):
        run_notebook(
            "06", {"model_name": str(tmp_path / "nowhere")}, smoke=True, output=tmp_path / "06.ipynb"
        )


def test_causal_lm_loss_on_an_encoder_names_the_loss_to_use_instead():
    # load_any gives an encoder's base model (BertModel), which returns no loss for labels
    torch.manual_seed(0)
    encoder = transformers.BertModel(transformers.BertConfig(hidden_size=32, num_attention_heads=2, **SIZES))
    batches = [torch.randint(0, 64, (2, 8))]
    with pytest.raises(TypeError, match=r"BertModel\) returns no loss.*hidden_state_error"):
        advisor.measured_scores(encoder, batches, ["nvfp4", "bf16"])
    table = advisor.measured_scores(encoder, batches, ["nvfp4", "bf16"],
                                    loss_fn=advisor.hidden_state_error(encoder, batches))  # fmt: skip
    assert len(table) == 2 * len([1 for _, _, why in linear_layers(encoder) if why is None])
