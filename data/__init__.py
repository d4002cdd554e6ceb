"""delta-gpt's data layer: prepare datasets once, then read them as flat token arrays.

    import data
    data.prepare("shakespeare_char")                      # -> data/shakespeare_char/
    data.prepare_dataset("shakespeare_char").written      # False: already prepared, nothing written
    ds = data.load("shakespeare_char", block_size=256)    # ds.train, ds.val: np.memmap of token ids
    ds.tokenizer.decode(ds.val[:100].tolist())

Datasets live in data/<name>/ as train.bin, val.bin and meta.json (loaded by data/dataset.py, prepared by
data/preparation.py);
tokenizers are in data/tokenizer.py, batches in data/batches.py. Every bad input raises DataError with a one-line message.
"""
from .batches import DROPOUT, TRAIN_BATCHES, batch_starts, eval_batch, get_batch
from .dataset import DATASETS, DEFAULT_DATA_DIR, Dataset, describe, load, prepared_meta, token_dtype
from .preparation import Prepared, load_or_prepare, prepare, prepare_dataset
from .tokenizer import CharTokenizer, DataError, GPT2Tokenizer, get_tokenizer, gpt2_encoding

__all__ = ["DATASETS", "DEFAULT_DATA_DIR", "DataError", "Dataset", "Prepared", "prepare", "prepare_dataset", "describe",
           "load", "load_or_prepare", "prepared_meta", "get_tokenizer", "gpt2_encoding", "CharTokenizer", "GPT2Tokenizer", "token_dtype",
           "batch_starts", "get_batch", "eval_batch", "TRAIN_BATCHES", "DROPOUT"]
