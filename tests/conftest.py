"""Shared fixtures: a small character dataset and tiny trained checkpoints, made once per session."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from errors import check_packages  # noqa: E402

check_packages(("pytest", "torch", "numpy", "tqdm", "typer", "tiktoken"))  # one line in a shell without the .venv

import pytest  # noqa: E402

import data  # noqa: E402
from plumbing import system  # noqa: E402


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """Every test sees an idle machine: other jobs' load on the machine running the tests must not change
    what a command prints (train's "cores are busy" note) or how many threads it takes."""
    monkeypatch.setattr(system, "busy_cores", lambda seconds=0.25: 0)


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory):
    """A data dir holding 'tiny', a small character dataset."""
    d = tmp_path_factory.mktemp("data")
    text = "".join(f"{w} the quick brown fox {i % 7} jumps over {w}.\n" for i, w in
                   enumerate(["alpha", "beta", "gamma", "delta", "epsilon"] * 60))
    src = d / "tiny.txt"
    src.write_text(text)
    data.prepare("text", input=src, tokenizer="char", out_name="tiny", data_dir=d, progress=False)
    return d
