"""Shared fixtures: a small character dataset and tiny trained checkpoints, made once per session."""
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from errors import check_packages  # noqa: E402

check_packages(("pytest", "torch", "numpy", "tqdm", "typer", "tiktoken"))  # one line in a shell without the .venv

import pytest  # noqa: E402

from typer.testing import CliRunner  # noqa: E402

import cli  # noqa: E402
import data  # noqa: E402
import train as T  # noqa: E402
from plumbing import rundir as RD, system  # noqa: E402
from workbench import speed  # noqa: E402

runner = CliRunner()


@pytest.fixture(autouse=True)
def idle_machine(monkeypatch):
    """Every test sees an idle machine: other jobs' load on the machine running the tests must not change
    what a command prints (train's "cores are busy" note) or how many threads it takes."""
    monkeypatch.setattr(system, "busy_cores", lambda seconds=0.25: 0)


@pytest.fixture(autouse=True)
def short_speed_rounds(monkeypatch):
    """compare's timed speed in short rounds: the tests check what it computes and writes, never a time."""
    monkeypatch.setattr(speed, "ROUND_S", 0.01)


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


# ---------------------------------------------------------------- helpers the test files share

def run(*args):
    result = runner.invoke(cli.app, [str(a) for a in args])
    assert "Traceback" not in result.output
    return result


def ok(*args):
    result = run(*args)
    assert result.exit_code == 0, result.output
    return result.stdout


def refused(message, *args):
    """The command exits 1 with exactly one line on stderr containing `message`, and no traceback."""
    result = run(*args)
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], result.stderr


def cfg_for(tiny_data, out_dir, **kw):
    """A tiny run on the fast routing path (every preset's but cpu's, which trains on the readable one)."""
    base = dict(dataset="tiny", data_dir=str(tiny_data), out_dir=str(out_dir), n_layer=2, n_head=2, n_embd=32,
                block_size=16, batch_size=4, max_iters=8, lr_decay_iters=8, warmup_iters=2, eval_interval=4,
                eval_iters=2, log_interval=1, ckpt_interval=4, progress=False, fast_routing=True)
    return T.make_config("cpu", **{**base, **kw})


def cli_args(tiny_data, out_dir, **kw):
    """The same settings as cfg_for, as command-line options."""
    base = dict(dataset="tiny", data_dir=str(tiny_data), out_dir=str(out_dir), n_layer=2, n_head=2, n_embd=32,
                block_size=16, batch_size=4, max_iters=8, lr_decay_iters=8, warmup_iters=2, eval_interval=4,
                eval_iters=2, log_interval=1, ckpt_interval=4)
    args = ["--no-progress", "--fast-routing"]
    for k, v in {**base, **kw}.items():
        args += [f"--{k.replace('_', '-')}", str(v)]
    return args


def torchrun(script, args, extra_env=None, timeout=300):
    """`script args` under torchrun with 2 gloo processes of one thread; returns the CompletedProcess."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT), "GLOO_SOCKET_IFNAME": "lo", **(extra_env or {})}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(ROOT / script), *args]
    r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    if r.returncode != 0 and "address already in use" in r.stderr.lower():  # --standalone's port taken by another process
        r = subprocess.run(command, capture_output=True, text=True, env=env, timeout=timeout)
    return r


def train_losses(out_dir):
    return [(r["step"], r["train_loss"]) for r in RD.read_metrics(out_dir) if r["kind"] == "train"]
