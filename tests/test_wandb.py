"""--wandb-project: an offline Weights & Biases run logs what metrics.jsonl holds; without the package,
one line before anything trains."""
import json
import struct
import sys
import time
from pathlib import Path

import pytest

import train as T
from conftest import refused
from conftest import cfg_for, cli_args, train_losses
from plumbing import rundir as RD

BLOCK = 32768  # the .wandb log's block size


def history(path):
    """The history rows of a W&B run file: a LevelDB-style log (a 7-byte ':W&B' header, then 32 KiB
    blocks of chunks: crc32 (4 bytes), length (2), type (1: whole, 2: first, 3: middle, 4: last), data)
    of protobuf Records."""
    from wandb.proto import wandb_internal_pb2
    raw = Path(path).read_bytes()
    assert raw[:4] == b":W&B"
    pos, data, rows = 7, b"", []
    while pos + 7 <= len(raw):
        if BLOCK - pos % BLOCK < 7:  # a chunk header never straddles blocks: the tail is padding
            pos += BLOCK - pos % BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos:pos + 7])
        data += raw[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            data = b""
            if record.WhichOneof("record_type") == "history":
                rows.append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                             for item in record.history.item})
    return rows


def history_once_written(path, train_rows, seconds=60):
    """history(path) once it holds `train_rows` training rows, or as it is after `seconds`: wandb's service
    process may still be writing the file when wandb.finish() returns (seen on a loaded machine)."""
    deadline = time.time() + seconds
    while True:
        try:
            rows = history(path)
        except Exception:  # a chunk still being written
            rows = []
        if len(logged(rows, "train/train_loss")) >= train_rows or time.time() > deadline:
            return rows
        time.sleep(0.25)


def logged(rows, key):
    return [(r["_step"], r[key]) for r in rows if key in r]


@pytest.mark.slow  # wandb starts its own service process
def test_offline_run_logs_the_metrics(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    T.train(cfg_for(tiny_data, tmp_path / "run", residual="delta", wandb_project="delta-gpt-test", wandb_run_name="tiny"))
    (run_file,) = tmp_path.glob("wandb/offline-run-*/run-*.wandb")
    rows = history_once_written(run_file, len(train_losses(tmp_path / "run")))
    assert logged(rows, "train/train_loss") == train_losses(tmp_path / "run") and len(rows) >= 8
    evals = [r for r in RD.read_metrics(tmp_path / "run") if r["kind"] == "eval"]
    assert logged(rows, "eval/val_loss") == [(r["step"], r["val_loss"]) for r in evals]
    assert logged(rows, "eval/routing/mean_max_weight") == [(r["step"], r["routing"]["mean_max_weight"]) for r in evals]


def test_without_wandb_one_line_before_training(tiny_data, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` now raises ImportError
    with pytest.raises(ValueError, match="needs the wandb package"):
        cfg_for(tiny_data, tmp_path / "run", wandb_project="delta-gpt-test")
    refused("--wandb-project needs the wandb package, which is not installed", "train",
            *cli_args(tiny_data, tmp_path / "run", wandb_project="delta-gpt-test"))
    assert not (tmp_path / "run").exists()  # nothing was trained or written


def test_wandb_run_name_needs_a_project(tiny_data, tmp_path):
    refused("--wandb-run-name names a Weights & Biases run: add --wandb-project NAME", "train",
            *cli_args(tiny_data, tmp_path / "run", wandb_run_name="tiny"))
