"""cli.py: every command on tiny data and tiny checkpoints, every bad input as one line, and the quick start."""
import json
import re
import shutil
import subprocess
import sys

import matplotlib.image
import pytest
import torch

import data
import train as T
from conftest import ROOT, ok, refused, run
from plumbing import checkpoint as CK, rundir as RD
from workbench import report as R
from errors import ConfigError

TINY = ["--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16", "--batch-size", "4",
        "--eval-iters", "2", "--warmup-iters", "2", "--no-progress"]


@pytest.fixture(scope="session")
def runs(tiny_data, tmp_path_factory):
    """A tiny delta run and a tiny baseline run on 'tiny', 12 steps each, trained through the CLI."""
    d = tmp_path_factory.mktemp("runs")
    for mode in ("delta", "baseline"):
        ok("train", "--residual", mode, "--dataset", "tiny", "--data-dir", tiny_data, "--out-dir", d / mode,
           "--max-iters", 12, "--eval-interval", 6, *TINY)
    return d


# ---------------------------------------------------------------- every command

def test_prepare_text(tmp_path):
    (tmp_path / "t.txt").write_text("hello world\n" * 50)
    out = ok("prepare", "text", "--input", tmp_path / "t.txt", "--name", "hw", "--data-dir", tmp_path / "d")
    assert "prepared" in out and (tmp_path / "d" / "hw" / "train.bin").exists()


def test_train_writes_checkpoints_and_metrics(runs):
    for mode in ("delta", "baseline"):
        ckpt = CK.load_checkpoint(runs / mode / "last.pt")
        assert ckpt["iter_num"] == 12 and ckpt["model_config"]["residual"] == mode
        assert (runs / mode / "best.pt").exists() and RD.read_metrics(runs / mode)


def test_train_resume_through_the_cli(runs, tmp_path):
    shutil.copytree(runs / "delta", tmp_path / "delta")
    out = ok("train", "--out-dir", tmp_path / "delta", "--resume", "--max-iters", 14)
    assert "after 14 steps" in out
    assert CK.load_checkpoint(tmp_path / "delta" / "last.pt")["iter_num"] == 14


def test_eval_only_says_it_wrote_nothing(runs, tiny_data, tmp_path):
    out = ok("train", "--residual", "delta", "--init-from", runs / "baseline" / "last.pt", "--eval-only",
             "--dataset", "tiny", "--data-dir", tiny_data, "--out-dir", tmp_path / "eo", *TINY)
    assert "evaluated only, nothing written" in out and "checkpoints in" not in out
    assert not (tmp_path / "eo").exists()


def test_sample(runs, tmp_path):
    out = ok("sample", "--ckpt", runs / "delta" / "last.pt", "--prompt", "alpha", "--num-samples", 2,
             "--max-new-tokens", 20, "--seed", 1)
    header, body = out.split("\n", 1)  # the header says which step the checkpoint holds, and the seed
    ckpt = CK.load_checkpoint(runs / "delta" / "last.pt")
    assert header.startswith(f"{runs / 'delta' / 'last.pt'}: step {ckpt['iter_num']}, best val loss "
                             f"{ckpt['best_val_loss']:.4f}; seed 1 (the same seed draws the same samples")
    samples = body.split("---------------\n")
    assert len(samples) == 3 and all(s.startswith("alpha") and len(s) >= 25 for s in samples[:2])
    assert out == ok("sample", "--ckpt", runs / "delta" / "last.pt", "--prompt", "alpha", "--num-samples", 2,
                     "--max-new-tokens", 20, "--seed", 1)  # same seed, same text
    (tmp_path / "p.txt").write_text("beta the")
    out = ok("sample", "--ckpt", runs / "delta" / "last.pt", "--prompt-file", tmp_path / "p.txt",
             "--num-samples", 1, "--max-new-tokens", 5, "--temperature", 0)
    assert out.split("\n", 1)[1].startswith("beta the")


def test_report_one_and_two_checkpoints(runs, tmp_path):
    out = ok("report", "--ckpt", runs / "delta" / "last.pt", "--batches", 2, "--out", tmp_path / "one")
    assert "h.1.mlp" in out and "max weight, deeper half" in out
    stats = json.loads((tmp_path / "one" / "report.json").read_text())["delta"]
    assert [r["n"] for r in stats["sublayers"]] == [1, 2, 3, 4]
    assert all(1 / r["n"] - 1e-6 <= r["max_weight"] <= 1 + 1e-6 for r in stats["sublayers"])
    png = matplotlib.image.imread(tmp_path / "one" / "report.png")
    assert png.shape[0] > 200 and png.shape[1] > 200 and png.std() > 0.05
    ok("convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "attnres", "--n-route-blocks", 2,
       "--out", tmp_path / "a.pt", "--eval-iters", 1)
    out = ok("report", "--ckpt", runs / "delta" / "last.pt", "--ckpt", tmp_path / "a.pt", "--batches", 1,
             "--out", tmp_path / "two")
    both = json.loads((tmp_path / "two" / "report.json").read_text())
    assert set(both) == {"delta", "attnres"} and "max w delta" in out and "max w attnres" in out
    # the runs' source counts differ (attnres with 2 blocks: 1, 2, 2, 3, then 3 for its final router), so each
    # gets its own n column, and attnres's final router has a row of its own
    assert "| n delta |" in out and "| n attnres |" in out
    assert [r["n"] for r in both["attnres"]["sublayers"]] == [1, 2, 2, 3, 3]
    final = next(line for line in out.splitlines() if line.startswith("| final |"))
    assert final.split("|")[2].strip() == "-" and final.split("|")[6].strip() == "3"
    assert matplotlib.image.imread(tmp_path / "two" / "report.png").shape[1] > png.shape[1]
    # one mode twice: the labels say what differs, or where each checkpoint is when nothing does
    ok("convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "attnres", "--n-route-blocks", 4,
       "--out", tmp_path / "b.pt", "--eval-iters", 1)
    ok("report", "--ckpt", tmp_path / "a.pt", "--ckpt", tmp_path / "b.pt", "--batches", 1, "--out", tmp_path / "ab")
    assert set(json.loads((tmp_path / "ab" / "report.json").read_text())) == {
        "attnres (n_route_blocks=2)", "attnres (n_route_blocks=4)"}
    (tmp_path / "copy").mkdir()
    shutil.copy(tmp_path / "a.pt", tmp_path / "copy" / "a.pt")
    ok("report", "--ckpt", tmp_path / "a.pt", "--ckpt", tmp_path / "copy" / "a.pt", "--batches", 1, "--out", tmp_path / "aa")
    assert set(json.loads((tmp_path / "aa" / "report.json").read_text())) == {str(tmp_path / "a.pt"),
                                                                              str(tmp_path / "copy" / "a.pt")}


@pytest.mark.parametrize("residual,exact", [("delta", True), ("attnres", True), ("delta_block", False)])
def test_convert_measures_before_and_after(runs, tmp_path, residual, exact):
    out = ok("convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", residual, "--out", tmp_path / "c.pt",
             "--eval-iters", 2)
    before, after = [float(x.split()[-1].rstrip(",")) for x in out.split("(change")[0].split(":")[1].split(",")]
    ckpt = CK.load_checkpoint(tmp_path / "c.pt")
    assert ckpt["model_config"]["residual"] == residual
    assert all(torch.count_nonzero(v) == 0 for k, v in ckpt["model"].items() if k.endswith("router.query"))
    if exact:  # equal up to LayerNorm eps, which replacement routing weighs ~n^2 more (tiny model, 12 steps)
        assert abs(after - before) < (2e-2 if residual == "attnres" else 2e-3)
    # it says what each loss averaged, and leaves exercise 1's question (why the change is or is not ~0) to the reader
    assert "each the mean of 2 fixed validation batches" in out
    assert not any(answer in out for answer in ("telescope", "block-start", "function at zero init", "exact"))
    # the converted checkpoint is a usable model: it evaluates and samples
    assert "val loss" in ok("eval", "--ckpt", tmp_path / "c.pt", "--eval-iters", 1)

def test_convert_with_routing_heads_keeps_the_loss(runs, tmp_path):
    out = ok("convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "delta", "--route-heads", 4,
             "--out", tmp_path / "c.pt", "--eval-iters", 2)
    before, after = [float(x.split()[-1].rstrip(",")) for x in out.split("(change")[0].split(":")[1].split(",")]
    assert CK.load_checkpoint(tmp_path / "c.pt")["model_config"]["route_heads"] == 4 and abs(after - before) < 2e-3
    refused("--route-heads 3 must be a whole number", "convert", "--ckpt", runs / "baseline" / "last.pt",
            "--residual", "delta", "--route-heads", 3, "--out", tmp_path / "x.pt")


def test_bench(monkeypatch):
    from workbench import bench
    from delta_gpt import GPTConfig
    monkeypatch.setitem(bench.CONFIGS, "cpu", (GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), 2))
    out = ok("bench", "--config", "cpu", "--residual", "baseline,delta", "--iters", 1, "--rounds", 1, "--malloc", "default")
    assert "| baseline |" in out and "| delta |" in out and "tokens/s" in out and "saved MB" in out
    out = ok("bench", "--config", "cpu", "--residual", "baseline,delta", "--iters", 1, "--rounds", 1, "--malloc", "default",
             "--n-layer", 3, "--n-embd", 16)
    assert "cpu: n_layer 3, n_embd 16," in out
    # rounds sized by time (the default), ratios against baseline
    rows = bench.bench(*bench.CONFIGS["cpu"], ("baseline", "delta"), rounds=2, round_s=0.05)
    assert rows[0]["tok_s_x"] == 1.0 and rows[1]["tok_s"] > 0 and rows[1]["saved_x"] > 1.0
    # a routed mode's static control: a row of its own, a model with the static routers
    out = ok("bench", "--config", "cpu", "--residual", "baseline,delta,delta-static", "--iters", 1, "--rounds", 1)
    assert "| delta |" in out and "| delta-static |" in out
    assert bench.make(bench.CONFIGS["cpu"][0], "attnres-static").config.route_weights == "static"
    # routing heads: -hH, after the static suffix where there is one
    out = ok("bench", "--config", "cpu", "--residual", "baseline,delta_block-h2,delta_block-static-h2", "--iters", 1, "--rounds", 1)
    assert "| delta_block-h2 |" in out and "| delta_block-static-h2 |" in out
    config = bench.make(bench.CONFIGS["cpu"][0], "delta_block-static-h2").config
    assert (config.residual, config.route_weights, config.route_heads) == ("delta_block", "static", 2)
    # the ratio columns: the best round's and the median of each round's ratio, both 1 for the baseline
    assert rows[0]["paired_x"] == 1.0 and rows[1]["paired_x"] > 0 and "x median" in out


def test_bench_compile_without_a_working_cpp_compiler_is_one_line_before_any_work(monkeypatch):
    from workbench import bench
    monkeypatch.setattr(bench, "cpp_compiler", lambda: "no-such-c++")
    monkeypatch.setattr(bench, "bench_compiled", lambda *a, **k: pytest.fail("benchmarked without a compiler"))
    refused("--compile on the CPU needs a working C++ compiler for torch.compile's Inductor, and no-such-c++ does "
            "not work", "bench", "--config", "cpu", "--compile")
    monkeypatch.setattr(bench, "profile_compiled", lambda *a, **k: pytest.fail("profiled without a compiler"))
    refused("no-such-c++ does not work", "bench", "--config", "cpu", "--compile", "--profile")


@pytest.mark.compile
@pytest.mark.xdist_group("bench-compile")  # one process: the second test finds the graphs in Inductor's cache
def test_bench_compile_times_every_mode_compiled(monkeypatch):
    """bench --compile: each mode's first and second compile time, and its speed against the compiled and the eager
    baseline, on a tiny config."""
    from workbench import bench
    from delta_gpt import GPTConfig
    monkeypatch.setitem(bench.CONFIGS, "cpu", (GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), 2))
    out = ok("bench", "--config", "cpu", "--compile", "--residual", "baseline,attnres-h2", "--iters", 1, "--rounds", 2)
    rows = {line.split("|")[1].strip(): line for line in out.splitlines() if line.startswith("| ") and "mode" not in line}
    assert set(rows) == {"eager baseline", "baseline", "attnres-h2"} and "Inductor's cache in" in out
    assert rows["baseline"].split("|")[5].strip() == "1.000" and rows["eager baseline"].split("|")[2].strip() == "-"


@pytest.mark.compile
@pytest.mark.xdist_group("bench-compile")  # one process: the second test finds the graphs in Inductor's cache
def test_bench_compile_profile_splits_the_compiled_step_by_kind(monkeypatch):
    """bench --compile --profile: per mode and pass, the compiled step's milliseconds by kind (matrix products,
    attention, Inductor's fused kernels, other), and each mode's difference to the baseline."""
    from workbench import bench
    from delta_gpt import GPTConfig
    monkeypatch.setitem(bench.CONFIGS, "cpu", (GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), 2))
    out = ok("bench", "--config", "cpu", "--compile", "--profile", "--steps", 1, "--residual", "baseline,attnres-h2")
    assert "| mode | pass | matrix products | attention | fused kernels | other | step |" in out
    rows = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): [float(c) for c in line.strip("|").split("|")[2:]]
            for line in out.splitlines() if line.startswith("| ") and not line.startswith("| mode")}
    assert set(rows) == {(m, p) for m in ("baseline", "attnres-h2") for p in ("forward", "backward")} | {
        ("attnres-h2", "minus baseline")}
    for cells in rows.values():
        assert sum(cells[:4]) == pytest.approx(cells[4], abs=0.2)  # the kinds add up to the step
    assert rows["baseline", "forward"][0] > 0 and rows["baseline", "forward"][2] > 0  # products and fused code found
    diff = [a + b - c - d for a, b, c, d in zip(rows["attnres-h2", "forward"], rows["attnres-h2", "backward"],
                                                rows["baseline", "forward"], rows["baseline", "backward"])]
    assert rows["attnres-h2", "minus baseline"] == pytest.approx(diff, abs=0.2)


def test_bench_profile(monkeypatch):
    """bench --profile: per mode and pass, routing's milliseconds, its share of the step and its largest operations."""
    from workbench import bench
    from delta_gpt import GPTConfig
    monkeypatch.setitem(bench.CONFIGS, "w128", (GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65), 2))
    out = ok("bench", "--config", "w128", "--profile", "--steps", 1, "--residual", "baseline,attnres-h2,delta_block")
    lines = {tuple(c.strip() for c in line.strip("|").split("|")[:2]): line for line in out.splitlines()
             if line.startswith("| ") and not line.startswith("| mode")}
    assert set(lines) == {(m, p) for m in ("baseline", "attnres-h2", "delta_block") for p in ("forward", "backward")}
    assert "RouteRead (Python)" in lines["attnres-h2", "forward"] and "Score (Python)" in lines["delta_block", "forward"]
    assert "RouteReadBackward (Python)" in lines["attnres-h2", "backward"]
    cells = {k: [float(c.strip().rstrip("%")) for c in line.strip("|").split("|")[2:5]] for k, line in lines.items()}
    for (mode, p), (pass_ms, routing_ms, share) in cells.items():  # structure only: no timing is compared
        step_ms = cells[mode, "forward"][0] + cells[mode, "backward"][0]
        assert 0 <= routing_ms <= pass_ms + 0.1 and share == pytest.approx(100 * routing_ms / step_ms, abs=0.1 + 5 / step_ms)
    # the stream methods are restored after profiling: a model runs unlabelled again
    from delta_gpt import Stream, FastStream
    assert Stream.read.__qualname__ == "Stream.read" and FastStream.read.__qualname__ == "FastStream.read"


@pytest.mark.slow
def test_compare_two_modes(tiny_data, tmp_path):
    args = ["compare", "--residual", "baseline,delta", "--seeds", "1,2", "--max-iters", 4, "--out", tmp_path / "cmp",
            "--dataset", "tiny", "--data-dir", tiny_data, "--eval-interval", 2, *TINY]
    out = ok(*args)
    assert "| baseline | 2 |" in out and "| delta | 2 |" in out and "+0.00%" in out
    result = json.loads((tmp_path / "cmp" / "compare.json").read_text())
    assert [r["variant"] for r in result["rows"]] == ["baseline", "delta"]
    assert sorted((r["variant"], r["seed"]) for r in result["runs"]) == [("baseline", 1), ("baseline", 2),
                                                                         ("delta", 1), ("delta", 2)]
    assert matplotlib.image.imread(tmp_path / "cmp" / "curves.png").shape[0] > 100
    assert "reusing the finished run" in ok(*args)  # a second compare reuses the runs


def test_eval(runs):
    out = ok("eval", "--ckpt", runs / "delta" / "last.pt", "--eval-iters", 2)
    assert "tiny val loss" in out and "perplexity" in out


def test_help_lists_every_command_and_train_option():
    out = ok("--help")
    for command in ("prepare", "train", "sample", "report", "convert", "bench", "compare", "eval"):
        assert command in out
    assert "--max-iters" in ok("train", "--help") and "--route-lr-mult" in ok("train", "--help")
    assert "--malloc" in ok("bench", "--help") and "--max-iters" in ok("compare", "--help")
    # each option's value in the cpu preset, the preset's own settings included (it trains on the readable path)
    assert re.search(r"--fast-routing [^[]*\[cpu: False\]", " ".join(ok("train", "--help").split()))


@pytest.mark.slow
def test_train_py_help_lists_the_same_options():
    out = subprocess.run([sys.executable, "train.py", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--route-lr-mult" in out.stdout and "--max-iters" in out.stdout


# ---------------------------------------------------------------- bad input

def test_missing_and_corrupt_checkpoints(tmp_path):
    for command in ("sample", "report", "eval"):
        refused("does not exist", command, "--ckpt", tmp_path / "nope.pt")
    (tmp_path / "bad.pt").write_bytes(b"\x80\x02garbage")
    for command in ("sample", "report", "eval"):
        refused("is unreadable", command, "--ckpt", tmp_path / "bad.pt")
    refused("does not exist", "convert", "--ckpt", tmp_path / "nope.pt", "--residual", "delta", "--out", tmp_path / "x.pt")


def test_checkpoint_and_dataset_with_different_tokenizers(runs, tiny_data, tmp_path):
    (tmp_path / "other.txt").write_text("completely different characters: XYZ 123 ~~~\n" * 40)
    data.prepare("text", input=tmp_path / "other.txt", tokenizer="char", out_name="other", data_dir=tiny_data,
                 progress=False)
    refused("characters are not the same", "eval", "--ckpt", runs / "delta" / "last.pt", "--dataset", "other")
    with pytest.raises(ConfigError, match="trained with the char tokenizer \\(dataset tiny\\), and this dataset "
                                            "uses gpt2"):
        CK.check_tokenizer(CK.load_checkpoint(runs / "delta" / "last.pt"), dict(tokenizer="gpt2"), "c.pt")


def test_unknown_mode_and_preset(runs, tmp_path):
    refused("--residual resnet is unknown", "train", "--residual", "resnet")
    refused("unknown preset 'huge'", "train", "--preset", "huge")
    refused("unknown option --max-iter; did you mean --max-iters?", "train", "--max-iter", "3")
    refused("--max-iters expects an integer", "train", "--max-iters", "many")
    refused("unknown mode 'resnet'", "compare", "--residual", "baseline,resnet")
    refused("unknown preset 'huge'", "compare", "--preset", "huge", "--out", tmp_path / "c")
    refused("unknown mode 'resnet'", "bench", "--residual", "resnet")
    refused("unknown mode 'baseline-static'", "bench", "--residual", "baseline-static")
    refused("unknown mode 'baseline-h2'", "bench", "--residual", "baseline-h2")
    refused("unknown mode 'delta-h2-static'", "bench", "--residual", "delta-h2-static")
    refused("route_heads=3 must be a whole number that divides n_embd=128", "bench", "--config", "cpu", "--residual", "delta-h3")
    refused("unknown --malloc 'huge'", "bench", "--malloc", "huge")
    refused("n_embd=66 is not divisible by n_head=4", "bench", "--config", "cpu", "--n-embd", "66")
    refused("--n-layer must be at least 1, got 0", "bench", "--config", "w128", "--n-layer", "0")
    refused("--threads must be at least 1, got 0", "bench", "--threads", "0")
    refused("--steps must be at least 1, got 0", "bench", "--profile", "--steps", "0")
    refused("--steps sets how many steps --profile records", "bench", "--steps", "3")
    refused("route_heads=3 must be a whole number that divides n_embd=128", "bench", "--config", "w128",
            "--residual", "attnres-h3")
    refused("unknown mode 'baseline-h4'", "bench", "--config", "w128", "--residual", "baseline-h4", "--profile")
    refused("unknown --config 'study'; choose one of cpu, w128, d768 or all", "bench", "--config", "study")
    refused("is not a routed mode", "convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "resnet",
            "--out", tmp_path / "x.pt")
    refused("already a delta model", "convert", "--ckpt", runs / "delta" / "last.pt", "--residual", "attnres",
            "--out", tmp_path / "x.pt")


def test_a_prompt_longer_than_the_context_is_printed_whole_with_a_note(runs):
    prompt = "alpha beta gamma " * 3  # 51 characters, context 16
    result = run("sample", "--ckpt", runs / "delta" / "last.pt", "--prompt", prompt, "--num-samples", 1,
                 "--max-new-tokens", 5)
    assert result.exit_code == 0 and result.stdout.split("\n", 1)[1].startswith(prompt)
    assert "note: the prompt is 51 tokens, longer than the model's context of 16" in result.stderr


def test_bad_sample_arguments(runs, tmp_path):
    ckpt = runs / "delta" / "last.pt"
    refused("the prompt is empty", "sample", "--ckpt", ckpt, "--prompt", "")
    (tmp_path / "empty.txt").write_text("")
    refused("the prompt is empty", "sample", "--ckpt", ckpt, "--prompt-file", tmp_path / "empty.txt")
    refused("character 'Q' is not in this dataset's vocabulary", "sample", "--ckpt", ckpt, "--prompt", "Quick")
    refused("--top-k must be between 1 and the vocabulary size", "sample", "--ckpt", ckpt, "--top-k", 0)
    refused("--top-k must be between 1 and the vocabulary size", "sample", "--ckpt", ckpt, "--top-k", 100000)
    refused("--max-new-tokens must be at least 1", "sample", "--ckpt", ckpt, "--max-new-tokens", 0)
    refused("prompt file", "sample", "--ckpt", ckpt, "--prompt-file", tmp_path / "missing.txt")


@pytest.mark.parametrize("option", ["--eval-iters", "--batch-size", "--batches", "--num-samples"])
def test_counts_below_one_are_refused_before_any_work(runs, tmp_path, option):
    """convert, eval, report and sample take their counts of batches and sequences from the command line."""
    ckpt = runs / "delta" / "last.pt"
    commands = {"--eval-iters": [["convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "delta",
                                  "--out", tmp_path / "c.pt"], ["eval", "--ckpt", ckpt]],
                "--batch-size": [["convert", "--ckpt", runs / "baseline" / "last.pt", "--residual", "delta",
                                  "--out", tmp_path / "c.pt"], ["eval", "--ckpt", ckpt],
                                 ["report", "--ckpt", ckpt, "--out", tmp_path / "r"]],
                "--batches": [["report", "--ckpt", ckpt, "--out", tmp_path / "r"]],
                "--num-samples": [["sample", "--ckpt", ckpt]]}[option]
    for command in commands:
        refused(f"{option} must be at least 1, got 0", *command, option, 0)
    assert not (tmp_path / "c.pt").exists() and not (tmp_path / "r").exists()


def test_report_refuses_baseline(runs):
    refused("is a baseline model: it has no routing to report", "report", "--ckpt", runs / "baseline" / "last.pt")


def test_prepare_unknown_dataset():
    refused("unknown dataset", "prepare", "wikipedia")


# ---------------------------------------------------------------- the quick start

@pytest.mark.slow
@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
def test_quick_start_make_train(tmp_path):
    """`make train` as the README gives it (prepare, train delta, sample, report), on a tiny setting; a second
    `make train` starts the quick-start run afresh, its report included."""
    for _ in range(2):
        r = subprocess.run(["make", "-s", "-o", ".venv/.installed", "train", f"PY={sys.executable}",
                            f"RUN={tmp_path / 'run'}", f"DATA_ARGS=--data-dir {tmp_path / 'data'}",
                            "TRAIN_ARGS=--max-iters 20 --eval-interval 10 --eval-iters 2 --n-layer 2 --no-progress"],
                           cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        assert "done: val loss" in r.stdout and "---------------" in r.stdout
        assert "max weight, deeper half" in r.stdout
        assert (tmp_path / "run" / "report" / "report.png").exists()
    assert "already prepared" in r.stdout


# ---------------------------------------------------------------- nothing a user made is replaced

def test_convert_never_writes_over_its_input_and_asks_before_replacing(runs, tmp_path):
    base = runs / "baseline" / "last.pt"
    before = base.read_bytes()
    refused("is the input checkpoint itself", "convert", "--ckpt", base, "--residual", "delta", "--out", base)
    refused("is the input checkpoint itself", "convert", "--ckpt", base, "--residual", "delta", "--out", base, "--force")
    assert base.read_bytes() == before
    other = tmp_path / "other.pt"
    other.write_bytes(b"mine")
    refused("already exists; pass --force", "convert", "--ckpt", base, "--residual", "delta", "--out", other)
    assert other.read_bytes() == b"mine"
    ok("convert", "--ckpt", base, "--residual", "delta", "--out", other, "--force", "--eval-iters", 1)
    assert CK.load_checkpoint(other)["model_config"]["residual"] == "delta"


def test_a_file_where_a_folder_belongs_is_one_line_before_any_work(runs, tiny_data, tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("mine")
    base, delta = runs / "baseline" / "last.pt", runs / "delta" / "last.pt"
    refused("is a file, not a folder", "convert", "--ckpt", base, "--residual", "delta", "--out", afile / "x.pt")
    refused("is a file, not a folder", "report", "--ckpt", delta, "--out", afile)
    refused("is a file, not a folder", "report", "--ckpt", delta, "--out", afile / "sub")
    refused("is a file, not a folder", "train", "--out-dir", afile, "--dataset", "tiny", "--data-dir", tiny_data, *TINY)
    refused("is a folder", "sample", "--ckpt", delta, "--prompt-file", tmp_path)
    assert afile.read_text() == "mine"
    ok("convert", "--ckpt", base, "--residual", "delta", "--out", tmp_path / "new" / "x.pt", "--eval-iters", 1)
    assert (tmp_path / "new" / "x.pt").exists()  # a missing folder is made


def test_train_never_replaces_a_run_file_in_a_folder_without_a_checkpoint(tiny_data, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.json").write_text('{"mine": 1}')
    refused("already holds a run (config.json)", "train", "--out-dir", tmp_path / "run", "--dataset", "tiny",
            "--data-dir", tiny_data, *TINY)
    assert (tmp_path / "run" / "config.json").read_text() == '{"mine": 1}'


@pytest.mark.slow
def test_compare_refuses_finished_runs_with_other_settings(tiny_data, tmp_path):
    args = ["compare", "--residual", "baseline", "--seeds", "1", "--out", tmp_path / "cmp",
            "--dataset", "tiny", "--data-dir", tiny_data, "--eval-interval", 2, *TINY]
    ok(*args, "--max-iters", 4)
    refused("holds the runs of another study (it differs in train.max_iters (4 there, 2 here))", *args, "--max-iters", 2)
    refused("train.n_embd (32 there, 64 here)", *args, "--max-iters", 4, "--n-embd", 64)
    (tmp_path / "cmp" / "study.json").unlink()  # a folder of an older compare: each run's settings are checked
    refused("holds a run with other settings: max_iters (4 in the run, 2 asked)", *args, "--max-iters", 2)
    out = ok(*args, "--max-iters", 2, "--overwrite")
    assert json.loads((tmp_path / "cmp" / "compare.json").read_text())["runs"][0]["val_loss"]
    assert CK.load_checkpoint(tmp_path / "cmp" / "baseline-s1" / "last.pt")["iter_num"] == 2
    assert "| baseline | 1 |" in out and "± -" in out  # one seed: no spread to show


@pytest.mark.slow
def test_a_run_on_a_dataset_prepared_again_from_other_text_is_neither_reused_nor_resumed(tmp_path):
    d = tmp_path / "data"
    lines = [f"line {i}: the quick brown fox jumps over the lazy dog\n" for i in range(60)]

    def prepare(text):
        (tmp_path / "t.txt").write_text(text)
        data.prepare("text", input=tmp_path / "t.txt", tokenizer="char", out_name="re", data_dir=d, force=True,
                     progress=False)

    args = ["compare", "--residual", "baseline", "--seeds", "1", "--out", tmp_path / "cmp", "--dataset", "re",
            "--data-dir", d, "--eval-interval", 2, "--max-iters", 2, *TINY]
    prepare("".join(lines))
    ok(*args)
    prepare("".join(reversed(lines)))  # the same characters, another text
    refused("holds a run trained on dataset re as it was before it was prepared again from other text", *args)
    refused("prepared again from other text", "train", "--resume", "--out-dir", tmp_path / "cmp" / "baseline-s1",
            "--max-iters", 4)
    ok(*args, "--overwrite")


@pytest.mark.slow
def test_compare_never_reports_a_run_resumed_with_other_settings_nor_takes_over_a_users_folder(tiny_data, tmp_path):
    args = ["--residual", "baseline", "--seeds", "1", "--dataset", "tiny", "--data-dir", tiny_data,
            "--eval-interval", 2, *TINY]
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "compare.md").write_text("my notes")
    refused("holds files that no compare wrote (compare.md)", "compare", *args, "--max-iters", 2, "--out", mine)
    assert (mine / "compare.md").read_text() == "my notes" and sorted(p.name for p in mine.iterdir()) == ["compare.md"]
    (tmp_path / "afile").write_text("x")
    refused("is a file", "compare", *args, "--max-iters", 2, "--out", tmp_path / "afile")
    cmp = tmp_path / "cmp"
    ok("compare", *args, "--max-iters", 2, "--out", cmp)
    # the user resumes the run with another learning rate: no longer one run with one setting
    run = cmp / "baseline-s1"
    ok("train", "--resume", "--out-dir", run, "--max-iters", 4, "--learning-rate", "0.01")
    (cmp / "study.json").unlink()  # as an older compare's folder: each run's settings are checked
    refused("resumed with other settings (max_iters (2 -> 4 at step 2); learning_rate (0.001 -> 0.01 at step 2))",
            "compare", *args,
            "--max-iters", 4, "--learning-rate", "0.01", "--out", cmp)
    ok("compare", *args, "--max-iters", 4, "--learning-rate", "0.01", "--out", cmp, "--overwrite")
    (run / "metrics.jsonl").unlink()
    refused("has a checkpoint but no evaluation in metrics.jsonl", "compare", *args, "--max-iters", 4,
            "--learning-rate", "0.01", "--out", cmp)


def test_report_checks_every_checkpoint_before_computing(runs, tmp_path, monkeypatch):
    monkeypatch.setattr(R, "routing_stats", lambda *a, **k: pytest.fail("computed before checking"))
    refused("is a baseline model", "report", "--ckpt", runs / "delta" / "last.pt", "--ckpt",
            runs / "baseline" / "last.pt", "--out", tmp_path / "r")


def test_report_keeps_an_existing_report_unless_forced(runs, tmp_path):
    ckpt = runs / "delta" / "last.pt"
    ok("report", "--ckpt", ckpt, "--out", tmp_path / "r", "--batches", 1)
    refused("already holds a report; pass --force", "report", "--ckpt", ckpt, "--out", tmp_path / "r")
    ok("report", "--ckpt", ckpt, "--out", tmp_path / "r", "--batches", 1, "--force")


def test_commands_without_cuda_say_so_like_train(runs):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    ckpt = runs / "delta" / "last.pt"
    for command in (["sample", "--ckpt", ckpt], ["eval", "--ckpt", ckpt]):
        refused("asks for CUDA, which this machine does not have; use --device cpu", *command, "--device", "cuda")
    refused("asks for CUDA, which this machine does not have; use --device cpu", "train", "--device", "cuda")


def test_a_folder_given_as_checkpoint_says_so(runs):
    refused("is a folder, not a checkpoint file", "sample", "--ckpt", runs / "delta")


def test_a_prompt_file_that_is_not_utf8_is_named(runs, tmp_path):
    (tmp_path / "latin1.txt").write_bytes("caf\xe9".encode("latin-1"))
    refused("latin1.txt is not UTF-8 text", "sample", "--ckpt", runs / "delta" / "last.pt", "--prompt-file",
            tmp_path / "latin1.txt")


def test_usage_errors_keep_typers_exit_status_2():
    for args in (["sample", "--ckpt", "x.pt", "--num-samples", "abc"], ["sample"], ["frobnicate"]):
        result = run(*args)
        assert result.exit_code == 2 and "Usage:" in result.output, result.output


@pytest.mark.parametrize("argv", [["cli.py", "train", "--help"], ["cli.py", "sample", "--ckpt", "x.pt"], ["cli.py", "--help"],
                                  ["-c", "import sys; sys.path.insert(0, 'tests'); import conftest"]])
def test_a_python_without_the_packages_gets_one_line(argv):
    # -S leaves out site-packages, as a shell where the .venv is not active does: one line naming the fix
    out = subprocess.run([sys.executable, "-S", *argv], cwd=ROOT, capture_output=True, text=True, timeout=60)
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 1 and len(lines) == 1 and "lacks delta-gpt's packages" in lines[0], out.stderr
    assert "make install" in lines[0] and ".venv/bin/activate" in lines[0] and not out.stdout


def test_a_context_past_the_machines_memory_is_refused_before_any_work(tiny_data, tmp_path):
    # the student's run: a context of 100,000 was accepted and sat 43 minutes inside one op at 13 GB
    out = tmp_path / "huge"
    refused("--no-memory-check to try anyway", "train", "--residual", "delta", "--block-size", "100000", "--max-iters", "10",
            "--dataset", "tiny", "--data-dir", tiny_data, "--out-dir", out, "--device", "cpu")
    assert not out.exists()
    from plumbing.system import check_memory
    cfg = T.make_config("cpu", block_size=100000, memory_check=False)
    assert check_memory(cfg, torch.device("cpu"), 1) is None  # --no-memory-check: the user's call
    check_memory(T.make_config("cpu"), torch.device("cpu"), 1)  # the cpu preset fits anywhere


def test_every_command_chooses_its_threads_by_one_rule(runs, tmp_path, monkeypatch):
    # one core of two busy: sample, evaluate, report and convert take the free one, as train does, and say so
    from plumbing import system
    monkeypatch.setattr(system, "busy_cores", lambda seconds=0.25: 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    ckpt, base = runs / "delta" / "last.pt", runs / "baseline" / "last.pt"
    for doing, args in (("sampling", ["sample", "--ckpt", ckpt, "--num-samples", 1, "--max-new-tokens", 4]),
                        ("evaluating", ["eval", "--ckpt", ckpt, "--eval-iters", 1]),
                        ("reporting", ["report", "--ckpt", ckpt, "--batches", 1, "--out", tmp_path / "r"]),
                        ("converting", ["convert", "--ckpt", base, "--residual", "delta", "--out", tmp_path / "c.pt",
                                        "--eval-iters", 1])):
        result = run(*args)
        assert result.exit_code == 0 and f"1 of 2 cores are busy; {doing} with" in result.stderr, result.output
        assert chosen.pop() == 1 and not chosen
        assert run(*args[:3], "--threads", 2, *args[3:]).exit_code in (0, 1) and chosen.pop() == 2  # --threads rules
    refused("--threads must be at least 1", "sample", "--ckpt", ckpt, "--threads", 0)


def test_static_cumulative_and_multi_head_runs_are_named_apart(tiny_data, tmp_path):
    # the header, report's column and report.json name the control and the heads, as bench and studies do
    base = ["--dataset", "tiny", "--data-dir", tiny_data, "--max-iters", 4, "--eval-interval", 2, *TINY]
    for args, label in ((["--residual", "delta", "--route-weights", "static"], "delta-static"),
                        (["--residual", "delta_block", "--route-heads", 2], "delta_block-h2"),
                        (["--residual", "attnres", "--route-sources", "cumulative"], "attnres cumulative")):
        out = ok("train", *args, "--out-dir", tmp_path / label, *base)
        assert f"\n{label}: " in "\n" + out or out.startswith(f"{label}: "), out
        ok("report", "--ckpt", tmp_path / label / "last.pt", "--batches", 1, "--out", tmp_path / label / "r")
        assert list(json.loads((tmp_path / label / "r" / "report.json").read_text())) == [label]
    resumed = ok("train", "--out-dir", tmp_path / "delta-static", "--resume", "--max-iters", 6)
    assert f"resuming at step 4 from {tmp_path / 'delta-static' / 'last.pt'}" in resumed
    plan = ok("compare", "--residual", "baseline,delta-static,delta_block-static-h2", "--seeds", 1, "--dry-run",
              "--out", tmp_path / "cmp", "--dataset", "tiny", "--data-dir", tiny_data, "--max-iters", 4, *TINY)
    assert "3 runs" in plan
    refused("unknown mode 'delta-dynamic'", "compare", "--residual", "delta-dynamic", "--dry-run")
