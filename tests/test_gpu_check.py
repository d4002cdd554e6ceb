"""gpu_check.py and bench --device cuda where there is no GPU: the one-line refusals, the prerequisite check,
the tests part and a training command on the CPU, and the tables on made-up rows."""
import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from workbench import bench
import data
from workbench import gpu_check as G
from conftest import ROOT, refused

no_cuda = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


@pytest.mark.slow
@no_cuda
def test_gpu_check_without_cuda_says_so_in_one_line():
    out = subprocess.run([sys.executable, "-m", "workbench.gpu_check"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: no CUDA GPU") and "CUDA build of PyTorch" in lines[0], out.stderr


def test_train_args_reach_every_training_run():
    args = G.gpu_check_args(["--train-args=--batch-size 32", "--steps", "10"])
    cmd = G.train_command("delta", args.steps, "runs/x", args.train_args.split())
    assert cmd[-2:] == ["--batch-size", "32"] and cmd[cmd.index("--max-iters") + 1] == 10


def test_gpu_check_takes_no_folder_it_did_not_make(tmp_path):
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "delta").mkdir()  # a user's run: gpu-check would train into runs/delta afresh
    assert "holds files that gpu-check did not write (delta)" in G.foreign(tmp_path / "runs", "--runs")
    (tmp_path / "afile").write_text("x")
    assert G.foreign(tmp_path / "afile", "--out") == f"--out {tmp_path / 'afile'} is a file; give a folder"
    assert G.foreign(tmp_path / "new", "--out") is None
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / G.MARK).touch()
    (tmp_path / "mine" / "gpu_check.md").write_text("an earlier check")
    assert G.foreign(tmp_path / "mine", "--out") is None  # its own folder, used again


@pytest.mark.slow
def test_gpu_check_refuses_a_users_folder_in_one_line(tmp_path):
    (tmp_path / "delta").mkdir()
    out = subprocess.run([sys.executable, "-m", "workbench.gpu_check", "--runs", tmp_path], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip().startswith(f"error: --runs {tmp_path} holds files"), out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["delta"]


@pytest.mark.slow
def test_gpu_check_bad_parts():
    out = subprocess.run([sys.executable, "-m", "workbench.gpu_check", "--parts", "tests,fly"], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 1 and out.stderr.strip() == "error: unknown --parts fly; choose from tests, bench, train"


def test_prerequisites_name_what_is_missing(tmp_path, tiny_data, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    (line,) = G.problems(tmp_path)
    assert "lacks train.bin, val.bin, meta.json" in line and "python cli.py prepare" in line
    # a prepared dataset passes; a truncated one is named with what to do
    src = tmp_path / "text.txt"
    src.write_text((tiny_data / "tiny.txt").read_text() * 2)
    data.prepare("text", input=src, tokenizer="char", out_name="shakespeare_char", data_dir=tmp_path, progress=False)
    assert G.problems(tmp_path) == []
    with open(tmp_path / "shakespeare_char" / "train.bin", "r+b") as f:
        f.truncate(100)
    (line,) = G.problems(tmp_path)
    assert "train.bin has 100 bytes" in line and "copy data/shakespeare_char/ again" in line
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None if name == "typer" else object())
    assert any("the Python package typer is missing" in l for l in G.problems(tmp_path))
    monkeypatch.setattr(G.importlib.util, "find_spec", lambda name: None)
    assert G.problems(tmp_path) == ["PyTorch is not installed: install a CUDA build of PyTorch (docs/gpus.md)"]


def test_table_and_targets_on_made_up_rows(tmp_path):
    rows = [dict(mode="baseline", params=100, eager_tok_s=1000.0, eager_mfu=0.30, eager_peak=2 * 2**30,
                 compiled_tok_s=2000.0, compiled_mfu=0.42, compiled_peak=2**30),
            dict(mode="attnres", params=101, eager_tok_s=900.0, eager_mfu=0.27, eager_peak=2.5 * 2**30,
                 compiled_tok_s=1800.0, compiled_mfu=0.38, compiled_peak=1.2 * 2**30),
            dict(mode="delta", params=101, eager_tok_s=None, eager_mfu=None, eager_peak=None, eager_error="out of memory",
                 compiled_tok_s=1920.0, compiled_mfu=0.40, compiled_peak=1.1 * 2**30)]  # delta_block: not reached
    (tmp_path / "bench.json").write_text(json.dumps(dict(rows=rows)))
    table_rows = ([dict(part="CUDA tests", mode=None, result="20 passed", seconds=95.2)]
                  + G.bench_rows(tmp_path / "bench.json", "timed out after 150 s", 150.0)
                  + [dict(part="train 500 steps", mode=m, tok_s=t, mfu=None, val_loss=v, result="ok", seconds=30.0)
                     for m, t, v in (("baseline", 400e3, 1.61), ("delta", 380e3, 1.58))])
    lines = G.check_table(table_rows).splitlines()
    assert lines[0].startswith("| part | mode | tokens/s | x | MFU | peak GiB | x | val loss | result | s |")
    assert "| CUDA tests | - | - | - | - | - | - | - | 20 passed | 95 |" in lines
    assert "| bench eager | delta | - | - | - | - | - | - | out of memory | - |" in lines
    assert "| bench compiled | attnres | 1,800 | 0.900 | 38.0% | 1.20 | 1.200 | - | ok | - |" in lines
    assert "| bench compiled | delta_block | - | - | - | - | - | - | not reached (timed out after 150 s) | - |" in lines
    assert "| bench eager | baseline | 1,000 | 1.000 | 30.0% | 2.00 | 1.000 | - | ok | 150 |" in lines
    assert "| train 500 steps | delta | 380,000 | 0.950 | - | - | - | 1.5800 | ok | 30 |" in lines
    assert G.targets(table_rows) == [
        "- baseline MFU >= 40%: met (42.0%)",
        "- attnres tokens/s >= 0.93x baseline: missed (0.900)",
        "- delta tokens/s >= 0.95x baseline: met (0.960)",
        "- delta_block tokens/s >= 0.95x baseline: not measured",
        "- attnres peak memory <= 1.15x baseline: missed (1.200)",
        "- delta peak memory <= 1.15x baseline: met (1.100)",
        "- delta_block peak memory <= 1.15x baseline: not measured"]


def test_bench_that_wrote_nothing_is_one_row(tmp_path):
    assert G.bench_rows(tmp_path / "none.json", "exit 1: error: no GPU", 3.0) == [
        dict(part="bench", mode=None, result="exit 1: error: no GPU", seconds=3.0)]


def test_junit_result(tmp_path):
    (tmp_path / "r.xml").write_text(
        '<testsuites><testsuite><testcase name="a"/><testcase name="b"><failure/></testcase>'
        '<testcase name="c"><skipped/></testcase><testcase name="d"/></testsuite></testsuites>')
    assert G.junit_result(tmp_path / "r.xml") == ("1 failed (b), 2 passed, 1 skipped", False)
    assert G.junit_result(tmp_path / "missing.xml") is None


@pytest.mark.slow
@no_cuda
def test_tests_part_runs_pytest_and_reads_its_result(tmp_path):
    """Without CUDA every CUDA test is skipped, which the check counts as not passed."""
    args = SimpleNamespace(parts=["tests"], no_warm=True)
    row = G.run_tests_and_warm(args, tmp_path, 0.0, G.time.time() + 300)
    assert row["result"].startswith("0 passed, ") and row["result"].endswith(" skipped") and row["ok"] is False
    assert (tmp_path / "tests.xml").exists() and (tmp_path / "tests.log").exists()


@pytest.mark.slow
def test_training_command_runs_and_its_metrics_are_read(tiny_data, tmp_path):
    """The check's training command as the CLI parses it (on the CPU and tiny: the later options win)."""
    cpu = ["--device", "cpu", "--dtype", "float32", "--no-compile", "--dataset", "tiny", "--data-dir", tiny_data,
           "--n-layer", 2, "--n-head", 2, "--n-embd", 32, "--block-size", 16, "--batch-size", 4, "--eval-iters", 2,
           "--log-interval", 1]
    cmd = [str(c) for c in G.train_command("delta", 4, tmp_path / "run", cpu)]
    out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    values, finished = G.train_result(tmp_path / "run", 4)
    assert finished and values["tok_s"] > 0 and values["mfu"] is None and 0 < values["val_loss"] < 10
    assert G.train_result(tmp_path / "run", 5)[1] is False  # a run that stopped short is not finished


# ---------------------------------------------------------------- bench --device cuda

@pytest.mark.slow
@no_cuda
def test_bench_cuda_options_refused_without_cuda():
    refused("--device cuda needs a CUDA GPU", "bench", "--device", "cuda")
    refused("apply to --device cuda only", "bench", "--batch-size", "8")
    refused("apply to --device cuda only", "bench", "--variants", "eager")
    refused("unknown --device 'gpu'", "bench", "--device", "gpu")
    out = subprocess.run([sys.executable, "-m", "workbench.bench", "--device", "cuda"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 1 and out.stderr.strip().startswith("error: --device cuda needs a CUDA GPU")


def test_bench_cuda_option_checks(monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    check = lambda *argv: bench.check_args(bench.bench_args(["--device", "cuda", *argv]))
    check()
    check("--variants", "compiled", "--batch-size", "32")
    (tmp_path / "rows.json").write_text("mine")
    for argv, message in ((("--config", "cpu"), "is a CPU config"), (("--variants", "fast"), "unknown --variants"),
                          (("--batch-size", "0"), "--batch-size must be at least 1"),
                          (("--json", str(tmp_path / "rows.json")), "already exists")):
        with pytest.raises(bench.BenchError, match=message):
            check(*argv)


def test_cuda_table_on_made_up_rows():
    rows = [dict(mode="baseline", params=1000, eager_tok_s=100.0, eager_mfu=0.2, eager_peak=2**30),
            dict(mode="delta", params=1010, eager_tok_s=None, eager_mfu=None, eager_peak=None, eager_error="out of memory")]
    bench.add_ratios(rows, ["params", "eager_tok_s", "eager_peak"])
    lines = bench.cuda_table(rows, ("eager",)).splitlines()
    assert lines[0] == "| mode | params | x | eager tokens/s | x | MFU | peak GiB | x |"
    assert lines[2] == "| baseline | 1,000 | 1.0000 | 100 | 1.000 | 20.0% | 1.00 | 1.000 |"
    assert lines[3] == "| delta | 1,010 | 1.0100 | out of memory | - | - | - | - |"
