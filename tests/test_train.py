"""train.py: exact resume, DDP and gradient-accumulation equivalence, nothing lost, every bad input refused."""
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import fields, replace
from pathlib import Path

import pytest
import torch

import data
import delta_gpt
import train as T
from conftest import ROOT, cfg_for, cli_args, torchrun, train_losses
from delta_gpt import GPT, GPTConfig, RESIDUALS
from plumbing import checkpoint as CK, config as O, rundir as RD, system as SY
from errors import ConfigError, DeltaGPTError, TrainError


def params(path):
    return CK.load_checkpoint(path)["model"]


# ---------------------------------------------------------------- equivalences

@pytest.mark.parametrize("residual", ["baseline", "delta"])
def test_resume_is_bit_exact(tiny_data, tmp_path, residual):
    full = cfg_for(tiny_data, tmp_path / "full", residual=residual, dropout=0.1)
    T.train(full)
    half = cfg_for(tiny_data, tmp_path / "half", residual=residual, dropout=0.1, max_iters=4)
    T.train(half)
    resumed = T.resume_config(out_dir=str(tmp_path / "half"), max_iters=8)
    assert resumed.lr_decay_iters == 8 and resumed.dropout == 0.1 and resumed.residual == residual
    T.train(resumed)
    assert train_losses(tmp_path / "half") == train_losses(tmp_path / "full")
    a, b = params(tmp_path / "full" / "last.pt"), params(tmp_path / "half" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert CK.load_checkpoint(tmp_path / "half" / "last.pt")["iter_num"] == 8
    rows = RD.read_metrics(tmp_path / "half")
    assert any(r["kind"] == "resume" and r["changed"]["max_iters"] == [4, 8] for r in rows)
    # the clocks count on across the resume: wall time and the process's CPU time, beside each evaluation
    evals = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in evals] == [0, 4, 8] and all(r["cpu_s"] > 0 for r in evals[1:])
    assert evals[2]["cpu_s"] > evals[1]["cpu_s"] and evals[2]["elapsed"] > evals[1]["elapsed"]
    assert CK.load_checkpoint(tmp_path / "half" / "last.pt")["cpu_elapsed"] >= evals[2]["cpu_s"] * 0.99


def test_gradient_accumulation_equals_one_big_batch(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "accum", batch_size=2, gradient_accumulation_steps=3, max_iters=3))
    T.train(cfg_for(tiny_data, tmp_path / "big", batch_size=6, max_iters=3))
    a, b = params(tmp_path / "accum" / "last.pt"), params(tmp_path / "big" / "last.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)


@pytest.mark.slow
@pytest.mark.xdist_group("torchrun")  # never beside another torchrun (tests/test_fsdp.py says why)
def test_ddp_two_processes_equal_one(tiny_data, tmp_path):
    """torchrun --nproc_per_node=2 (gloo) with 1 micro-step each == 1 process with 2 micro-steps; under
    torchrun cli.py train, which ends its processes without the interpreter's shutdown, still prints its last line."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    common = cli_args(tiny_data, tmp_path / "x", residual="delta", gradient_accumulation_steps=2, max_iters=3)
    ddp = common[:common.index("--out-dir")] + ["--out-dir", str(tmp_path / "ddp")] + common[common.index("--out-dir") + 2:]
    one = common[:common.index("--out-dir")] + ["--out-dir", str(tmp_path / "one")] + common[common.index("--out-dir") + 2:]
    r = torchrun("cli.py", ["train", *ddp], timeout=240)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert r.stdout.count("done: val loss") == 1, r.stdout[-2000:]  # rank 0's, flushed before the process ends
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *one], capture_output=True, text=True, env=env, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    a, b = params(tmp_path / "ddp" / "last.pt"), params(tmp_path / "one" / "last.pt")
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5)
    # the logged loss is the mean over micro-steps and ranks: equal too
    for (s1, l1), (s2, l2) in zip(train_losses(tmp_path / "ddp"), train_losses(tmp_path / "one")):
        assert s1 == s2 and abs(l1 - l2) < 1e-5


@pytest.mark.parametrize("residual", RESIDUALS)
def test_tiny_model_overfits_one_batch(residual):
    torch.manual_seed(0)
    model = GPT(GPTConfig(block_size=16, vocab_size=32, n_layer=2, n_head=2, n_embd=64, residual=residual))
    opt = model.configure_optimizers(0.0, 3e-3, (0.9, 0.99), "cpu")
    x = torch.randint(0, 32, (4, 16))
    y = torch.roll(x, -1, dims=1)
    for _ in range(150):
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05


FAULTS_PER_STEP = """
import resource, statistics, sys, torch
from plumbing import system as SY
from delta_gpt import GPT, GPTConfig
if sys.argv[1] == "keep":
    assert SY.keep_freed_memory()
torch.manual_seed(0)
model = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=128, block_size=64, vocab_size=65, residual="delta"))
opt = model.configure_optimizers(0.1, 1e-3, (0.9, 0.95), "cpu")
idx = torch.randint(0, 65, (12, 64))  # activations of 0.4 MB: over glibc's first mmap threshold (128 KB)
faults = []
for _ in range(13):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    _, loss = model(idx, idx)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(statistics.median(faults[5:]))  # once warm
"""


@pytest.mark.slow  # a subprocess
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc (Linux)")
def test_keep_freed_memory_stops_the_page_faults_of_each_step():
    """In a process of its own (the setting is process-wide): once warm, CPU training steps reuse freed
    memory instead of page-faulting it in again."""
    def faults(malloc):
        r = subprocess.run([sys.executable, "-c", FAULTS_PER_STEP, malloc], capture_output=True, text=True,
                           env=dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1"), timeout=120)  # one thread: one arena, whatever else runs
        assert r.returncode == 0, r.stderr[-2000:]
        return float(r.stdout.split()[-1])
    default = faults("default")  # median page faults per step
    if default < 50:
        pytest.skip(f"this C library's malloc already reuses freed memory ({default:.0f} page faults per step)")
    assert faults("keep") < default / 20


def test_keep_freed_memory_without_mallopt_is_a_no_op(monkeypatch):
    monkeypatch.setattr(SY.ctypes, "CDLL", lambda name: object())  # a C library without mallopt (macOS, musl builds)
    assert SY.keep_freed_memory() is False


# ---------------------------------------------------------------- nothing lost

def test_checkpoint_write_crash_keeps_previous(tmp_path, monkeypatch):
    path = tmp_path / "last.pt"
    CK.save_checkpoint({"model": {"w": torch.ones(3)}, "model_config": {}, "config": {}}, path)
    before = path.read_bytes()

    def crash(obj, f, *a, **k):
        f.write(b"partial garbage")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(OSError):
        CK.save_checkpoint({"model": {"w": torch.zeros(3)}, "model_config": {}, "config": {}}, path)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


@pytest.mark.slow  # a subprocess
@pytest.mark.parametrize("second", [signal.SIGINT, signal.SIGTERM])
def test_a_second_signal_ends_the_process_inside_a_long_op(second):
    # the first signal only sets the flag (Python runs its handler when the op returns); the second ends it at once
    code = ("import sys, torch; sys.path.insert(0, sys.argv[1]); from plumbing.rundir import StopFlag; "
            "torch.set_num_threads(1); a = torch.randn(2500, 2500, dtype=torch.float64)\n"
            "with StopFlag() as stop:\n"
            "    print('ready', flush=True)\n"
            "    torch.linalg.matrix_power(a, 2**62)  # about a minute in one op\n"
            "    print('the op returned', flush=True)")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.5)  # inside the op
    p.send_signal(signal.SIGINT)
    time.sleep(0.5)
    p.send_signal(second)
    try:
        stdout, stderr = p.communicate(timeout=30)  # well before the op could return
    finally:
        p.kill()
    assert p.returncode == 128 + second and "the op returned" not in stdout
    assert stderr.strip() == ("stopping: the run ends after the current step or evaluation, with a checkpoint (a "
                              "second Ctrl-C quits at once, without one)")


@pytest.mark.slow  # a subprocess
def test_a_second_signal_before_the_first_step_leaves_the_folder_as_it_was(tiny_data, tmp_path):
    """Ctrl-C twice during a fresh run's first (slow) evaluation: one line on each, and no file of the run left."""
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); import train as T\n"
            "def slow(*a, **k):\n    print('evaluating', flush=True); time.sleep(60)\n"
            "T.estimate_loss = slow\n"
            "T.main(['--dataset', 'tiny', '--data-dir', sys.argv[2], '--out-dir', sys.argv[3], '--n-layer', '1',"
            " '--n-embd', '16', '--n-head', '2', '--block-size', '16', '--max-iters', '2', '--no-progress'])")
    run = tmp_path / "new" / "run"
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tiny_data), str(run)], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip().endswith("each loss below is the mean of 20 fixed batches of its split")
        assert p.stdout.readline().strip() == "evaluating"
        p.send_signal(signal.SIGINT)
        time.sleep(0.5)
        p.send_signal(signal.SIGINT)
        stdout, stderr = p.communicate(timeout=30)
    finally:
        p.kill()
    assert p.returncode == 130 and stderr.splitlines()[-1] == (
        f"stopped at once by a second signal, without a checkpoint of the current step; before the run's first "
        f"step: {run} is left as it was")
    assert not (tmp_path / "new").exists()


@pytest.mark.slow  # a subprocess
def test_sigint_writes_a_loadable_checkpoint_and_resumes(tiny_data, tmp_path):
    out = tmp_path / "run"
    args = cli_args(tiny_data, out, max_iters=100000, lr_decay_iters=100000, ckpt_interval=100000, eval_interval=100000)
    p = subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=ROOT, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while time.time() < deadline and len(train_losses(out) if (out / "metrics.jsonl").exists() else []) < 5:
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 130, stderr
    assert "Traceback" not in stderr and "stopped by signal at step" in stdout
    ckpt = CK.load_checkpoint(out / "last.pt")
    assert ckpt["iter_num"] >= 5
    T.train(T.resume_config(out_dir=str(out), max_iters=ckpt["iter_num"] + 2))
    assert CK.load_checkpoint(out / "last.pt")["iter_num"] == ckpt["iter_num"] + 2


def poison_training_step(monkeypatch, n, poison):
    """Make the model's n-th training forward (step index n - 1) return poison(loss)."""
    calls = {"n": 0}
    forward = GPT.forward

    def poisoned(self, idx, targets=None):
        logits, loss = forward(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] == n:
                loss = poison(loss)
        return logits, loss

    monkeypatch.setattr(GPT, "forward", poisoned)


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(tiny_data, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_data, tmp_path / "run", ckpt_interval=2)
    poison_training_step(monkeypatch, 4, lambda loss: loss * float("nan"))
    with pytest.raises(TrainError, match="loss is nan at step 3"):
        T.train(cfg)
    assert CK.load_checkpoint(tmp_path / "run" / "last.pt")["iter_num"] == 2


def test_fresh_run_refuses_to_overwrite_a_run(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    with pytest.raises(ValueError, match="already holds a run .*; pass --resume"):
        T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2, overwrite=True))


# ---------------------------------------------------------------- bad input

def test_resume_with_other_architecture_names_the_fields(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    with pytest.raises(ConfigError, match="another architecture: --n-layer 3 \\(the run has 2\\); "
                                            "--residual delta \\(the run has baseline\\); leave these out") as info:
        T.resume_config(out_dir=str(tmp_path / "run"), n_layer=3, residual="delta")
    assert "route_partial" not in str(info.value)  # only the settings the user gave, no internal defaults


def test_resume_checks_options_against_the_run_not_the_preset(tiny_data, tmp_path):
    """A 2-layer, width-32 delta run: the routing values it already has resume (the preset's 4 layers would
    make n_route_blocks=4 wrong for delta), another head count is named against the run's, and routing
    options on a baseline run name the run's 'none'."""
    T.train(cfg_for(tiny_data, tmp_path / "delta", residual="delta", max_iters=2))
    cfg = T.resume_config(out_dir=str(tmp_path / "delta"), residual="delta", n_route_blocks=4, route_partial=True,
                          max_iters=3)
    assert cfg.n_embd == 32 and cfg.max_iters == 3
    with pytest.raises(ConfigError, match=r"another architecture: --n-head 3 \(the run has 2\)"):
        T.resume_config(out_dir=str(tmp_path / "delta"), n_head=3)
    T.train(cfg_for(tiny_data, tmp_path / "base", max_iters=2))
    with pytest.raises(ConfigError, match=r"--route-partial True \(the run has none\)"):
        T.resume_config(out_dir=str(tmp_path / "base"), route_partial=True)


def test_missing_dataset_names_the_prepare_command(tmp_path):
    cfg = T.make_config("cpu", dataset="nosuch", data_dir=str(tmp_path), out_dir=str(tmp_path / "run"), progress=False)
    with pytest.raises(data.DataError, match="python cli.py prepare"):
        T.train(cfg)


def test_default_dataset_is_prepared_when_missing(tmp_path):
    cfg = T.make_config("cpu", data_dir=str(tmp_path), out_dir=str(tmp_path / "run"), max_iters=1, eval_iters=1,
                        n_layer=1, n_embd=32, progress=False)
    T.train(cfg)
    assert (tmp_path / "shakespeare_char" / "meta.json").exists()


def test_checkpoints_load_with_weights_only(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4))
    ckpt = torch.load(tmp_path / "run" / "last.pt", weights_only=True)
    assert set(ckpt) >= {"model", "optimizer", "scaler", "model_config", "config", "iter_num", "best_val_loss", "rng"}
    assert not any(k.startswith("_orig_mod.") for k in ckpt["model"])
    assert (tmp_path / "run" / "best.pt").exists()
    # a pickled object is refused by weights_only loading, with one clear message
    torch.save({"model": {}, "model_config": {}, "config": {}, "evil": Path("x")}, tmp_path / "pickled.pt")
    with pytest.raises(TrainError, match="unreadable"):
        CK.load_checkpoint(tmp_path / "pickled.pt")


def test_corrupt_or_truncated_checkpoint_is_a_clear_error(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4))
    path = tmp_path / "run" / "last.pt"
    blob = path.read_bytes()
    path.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(TrainError, match=f"checkpoint {path} is unreadable"):
        CK.load_checkpoint(path)
    path.write_bytes(b"not a checkpoint at all")
    with pytest.raises(TrainError, match="unreadable"):
        CK.load_checkpoint(path)
    with pytest.raises(TrainError, match="does not exist"):
        CK.load_checkpoint(tmp_path / "nope.pt")
    torch.save({"weights": torch.ones(1)}, path)
    with pytest.raises(TrainError, match="not a delta-gpt checkpoint"):
        CK.load_checkpoint(path)


@pytest.mark.parametrize("argv,message", [
    (["--max-iter", "5"], "unknown option --max-iter; did you mean --max-iters?"),
    (["--max-iters", "five"], "--max-iters expects an integer, got 'five'"),
    (["--learning-rate", "fast"], "--learning-rate expects a number, got 'fast'"),
    (["--compile=maybe"], "--compile expects true or false, got 'maybe'"),
    (["--compile", "maybe"], "unexpected argument 'maybe'"),
    (["--max-iters"], "--max-iters needs a value"),
    (["delta"], "unexpected argument 'delta'"),
])
def test_parse_args_refuses_bad_options(argv, message):
    with pytest.raises(ValueError, match=message.replace("?", "\\?").replace("(", "\\(")):
        O.parse_args(argv, T.TrainConfig)


def test_parse_args_forms():
    preset, o = O.parse_args(["--preset", "cpu", "--max_iters=5", "--no-compile", "--bias", "--n-route-blocks", "none",
                              "--learning-rate", "3e-4"], T.TrainConfig)
    assert preset == "cpu" and o == dict(max_iters=5, compile=False, bias=True, n_route_blocks=None, learning_rate=3e-4)


@pytest.mark.parametrize("kw,message", [
    (dict(residual="resnet"), "residual='resnet' is unknown"),
    (dict(batch_size=0), "--batch-size must be at least 1"),
    (dict(learning_rate=-1.0), "--learning-rate must not be negative"),
    (dict(dtype="fp8"), "--dtype 'fp8' is unknown"),
    (dict(device="gpu"), "--device 'gpu' is unknown"),
    (dict(resume=True, init_from="x.pt"), "cannot be combined with --init-from"),
    (dict(n_layer=3, residual="attnres"), "n_route_blocks=4 \\(the default for this mode\\) must divide"),
])
def test_bad_config_values(kw, message):
    with pytest.raises(ValueError, match=message):
        T.make_config("cpu", **kw)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown preset 'huge'; choose one of cpu, shakespeare_char, gpt2_124m, paper_220m"):
        T.make_config("huge")


@pytest.mark.slow  # a subprocess
def test_bad_option_on_the_command_line_is_one_line(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), "--max-iter", "5"], capture_output=True, text=True,
                       cwd=tmp_path)
    assert r.returncode == 1
    assert r.stderr.strip() == "error: unknown option --max-iter; did you mean --max-iters? (see `python cli.py train --help`)"


# ---------------------------------------------------------------- warm starts, the run's files, the schedule

def test_init_from_baseline_checkpoint_keeps_the_loss(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "base", max_iters=8))
    base_val = [r for r in RD.read_metrics(tmp_path / "base") if r["kind"] == "eval"][-1]["val_loss"]
    cfg = cfg_for(tiny_data, tmp_path / "delta", residual="delta", init_from=str(tmp_path / "base" / "last.pt"),
                  max_iters=0)
    T.train(cfg)
    first = [r for r in RD.read_metrics(tmp_path / "delta") if r["kind"] == "eval"][0]
    # equal up to LN eps, which still weighs at this tiny width after 8 steps (docs/method.md, section 5)
    assert first["step"] == 0 and abs(first["val_loss"] - base_val) < 1e-3
    T.train(replace(cfg, out_dir=str(tmp_path / "heads"), route_heads=4))  # zero-init identity with heads too
    first = [r for r in RD.read_metrics(tmp_path / "heads") if r["kind"] == "eval"][0]
    assert first["step"] == 0 and abs(first["val_loss"] - base_val) < 1e-3
    with pytest.raises(ValueError, match="different architecture: n_embd"):
        T.train(cfg_for(tiny_data, tmp_path / "x", residual="delta", n_embd=64,
                        init_from=str(tmp_path / "base" / "last.pt")))


def test_init_from_a_routed_checkpoint_says_when_its_routing_is_dropped(tiny_data, tmp_path, capsys):
    T.train(cfg_for(tiny_data, tmp_path / "delta", residual="delta", max_iters=2))
    src = str(tmp_path / "delta" / "last.pt")
    for residual, said in [("baseline", "a baseline has none"), ("attnres", "attnres's routing starts at zero init"),
                           ("delta", None)]:
        capsys.readouterr()
        T.train(cfg_for(tiny_data, tmp_path / f"from-{residual}", residual=residual, init_from=src, max_iters=0))
        out = capsys.readouterr().out
        if said:
            assert f"note: the delta routing of --init-from {src} is dropped: " in out and said in out
        else:
            assert "note:" not in out  # the same routing is kept


def test_metrics_and_config_files(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", residual="attnres"))
    rows = RD.read_metrics(tmp_path / "run")
    train_rows = [r for r in rows if r["kind"] == "train"]
    eval_rows = [r for r in rows if r["kind"] == "eval"]
    assert [r["step"] for r in train_rows] == list(range(1, 9))
    assert {"train_loss", "lr", "tokens_per_s", "elapsed"} <= set(train_rows[0])
    assert [r["step"] for r in eval_rows] == [0, 4, 8]
    assert "sublayers" in eval_rows[-1]["routing"] and eval_rows[-1]["val_loss"] > 0
    info = json.loads((tmp_path / "run" / "config.json").read_text())
    assert info["config"]["residual"] == "attnres" and info["model_config"]["n_route_blocks"] == 4
    assert "commit" in info


def test_every_option_has_help_text():
    assert all(f.metadata["help"].strip() for f in fields(T.TrainConfig))


def test_lr_schedule():
    cfg = T.make_config("cpu", max_iters=100, warmup_iters=10, learning_rate=1.0, min_lr=0.1)
    assert T.get_lr(0, cfg) == pytest.approx(1 / 11)
    assert T.get_lr(10, cfg) == pytest.approx(1.0)
    assert T.get_lr(100, cfg) == pytest.approx(0.1)
    assert 0.1 < T.get_lr(55, cfg) < 1.0


# ---------------------------------------------------------------- resume, init-from and overwrite carry over what they should

def test_resume_after_interrupt_is_bit_exact(tiny_data, tmp_path, monkeypatch):
    """A run stopped by a signal mid-run (step 3 of 8), then resumed, equals the uninterrupted run."""
    T.train(cfg_for(tiny_data, tmp_path / "full", residual="delta", dropout=0.1))
    calls = {"n": 0}
    forward = GPT.forward

    def interrupted(self, idx, targets=None):
        if self.training:
            calls["n"] += 1
            if calls["n"] == 4:  # during step 3: the handler sets the flag, the step is dropped
                os.kill(os.getpid(), signal.SIGINT)
        return forward(self, idx, targets)

    monkeypatch.setattr(GPT, "forward", interrupted)
    with pytest.raises(KeyboardInterrupt):
        T.train(cfg_for(tiny_data, tmp_path / "cut", residual="delta", dropout=0.1))
    monkeypatch.setattr(GPT, "forward", forward)
    assert CK.load_checkpoint(tmp_path / "cut" / "last.pt")["iter_num"] == 3
    T.train(T.resume_config(out_dir=str(tmp_path / "cut")))
    assert train_losses(tmp_path / "cut") == train_losses(tmp_path / "full")
    a, b = params(tmp_path / "full" / "last.pt"), params(tmp_path / "cut" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_gradient_with_finite_loss_stops_before_applying(tiny_data, tmp_path, monkeypatch):
    cfg = cfg_for(tiny_data, tmp_path / "run", ckpt_interval=2)
    poison_training_step(monkeypatch, 4, _InfGrad.apply)  # a finite loss whose gradient is inf
    with pytest.raises(TrainError, match="gradient norm is (inf|nan) at step 3"):
        T.train(cfg)
    ckpt = CK.load_checkpoint(tmp_path / "run" / "last.pt")
    assert ckpt["iter_num"] == 2 and all(torch.isfinite(v).all() for v in ckpt["model"].values())


class _InfGrad(torch.autograd.Function):
    """Identity forward, infinite gradient backward."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return g * float("inf")


def test_resume_applies_changed_optimizer_settings(tiny_data, tmp_path, monkeypatch):
    T.train(cfg_for(tiny_data, tmp_path / "run", residual="delta", max_iters=4))
    seen = {}
    step = torch.optim.AdamW.step

    def spy(self, *a, **k):
        seen.update({g["name"]: (g["weight_decay"], g["betas"], g["lr_mult"]) for g in self.param_groups})
        return step(self, *a, **k)

    monkeypatch.setattr(torch.optim.AdamW, "step", spy)
    T.train(T.resume_config(out_dir=str(tmp_path / "run"), max_iters=5, weight_decay=0.0, beta2=0.5, route_lr_mult=5.0))
    assert seen == {"decay": (0.0, (0.9, 0.5), 1.0), "no_decay": (0.0, (0.9, 0.5), 1.0), "routing": (0.0, (0.9, 0.5), 5.0)}


def test_resume_float32_run_as_float16(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    T.train(T.resume_config(out_dir=str(tmp_path / "run"), max_iters=3, dtype="float16"))
    assert CK.load_checkpoint(tmp_path / "run" / "last.pt")["scaler"]  # the enabled scaler's state is saved


def test_torn_metrics_line_does_not_block_resume(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4))
    with open(tmp_path / "run" / "metrics.jsonl", "a") as f:
        f.write('{"kind": "train", "step": 5, "train_lo')  # a kill -9 mid-write
    T.train(T.resume_config(out_dir=str(tmp_path / "run"), max_iters=6))
    assert [s for s, _ in train_losses(tmp_path / "run")] == [1, 2, 3, 4, 5, 6]


def test_run_started_with_init_from_can_resume(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "base", max_iters=4))
    T.train(cfg_for(tiny_data, tmp_path / "delta", residual="delta", max_iters=4,
                    init_from=str(tmp_path / "base" / "last.pt")))
    T.train(T.resume_config(out_dir=str(tmp_path / "delta"), max_iters=6))
    assert CK.load_checkpoint(tmp_path / "delta" / "last.pt")["iter_num"] == 6
    with pytest.raises(ValueError, match="cannot be combined with --init-from"):
        T.resume_config(out_dir=str(tmp_path / "delta"), init_from="x.pt")


def test_init_from_routed_checkpoint_into_other_mode_zeroes_routing(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "delta", residual="delta", max_iters=4, learning_rate=0.05))
    src = CK.load_checkpoint(tmp_path / "delta" / "last.pt")
    assert any(torch.count_nonzero(v) for k, v in src["model"].items() if k.endswith("router.query"))
    model = CK.model_from_checkpoint(src, residual="attnres")
    assert all(torch.count_nonzero(p) == 0 for n, p in model.named_parameters() if n.endswith("router.query"))
    same = CK.model_from_checkpoint(src)  # same routing: the trained queries are kept
    assert any(torch.count_nonzero(p) for n, p in same.named_parameters() if n.endswith("router.query"))


def test_overwrite_removes_the_old_checkpoints(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4))
    cfg = cfg_for(tiny_data, tmp_path / "run", residual="delta", max_iters=0, overwrite=True)
    T.train(cfg)
    assert not (tmp_path / "run" / "best.pt").exists()
    assert CK.load_checkpoint(tmp_path / "run" / "last.pt")["model_config"]["residual"] == "delta"


def test_eval_only_needs_a_trained_model(tiny_data, tmp_path):
    with pytest.raises(ValueError, match="--eval-only evaluates a trained model"):
        cfg_for(tiny_data, tmp_path / "run", eval_only=True)
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    out = T.train(T.resume_config(out_dir=str(tmp_path / "run"), eval_only=True))
    assert out["iter_num"] == 2 and out["val_loss"] > 0


def test_init_from_gpt2_takes_the_models_shape(tmp_path, monkeypatch):
    """--init-from gpt2 with from_pretrained stubbed (no internet here): the config follows the model."""
    (tmp_path / "t.txt").write_text("Hello world, this is a tiny GPT-2 BPE dataset for a test.\n" * 40)
    data.prepare("text", input=tmp_path / "t.txt", tokenizer="gpt2", out_name="bpe", data_dir=tmp_path, progress=False)
    calls = []

    def fake_from_pretrained(model_type, override_args=None):
        calls.append((model_type, override_args))
        return GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, block_size=1024, vocab_size=50257, bias=True, **override_args))

    monkeypatch.setattr(GPT, "from_pretrained", staticmethod(fake_from_pretrained))
    cfg = T.make_config("cpu", dataset="bpe", data_dir=str(tmp_path), out_dir=str(tmp_path / "run"), init_from="gpt2",
                        residual="delta", block_size=16, batch_size=2, max_iters=1, eval_iters=1, progress=False)
    T.train(cfg)
    assert calls[0][0] == "gpt2" and calls[0][1]["residual"] == "delta"
    saved = CK.load_checkpoint(tmp_path / "run" / "last.pt")
    assert saved["config"]["n_layer"] == saved["model_config"]["n_layer"] == 1
    assert saved["model_config"]["block_size"] == 16 and saved["config"]["bias"] is True
    with pytest.raises(ValueError, match="has 1024 positions"):
        T.make_config("cpu", init_from="gpt2", block_size=2048)
    with pytest.raises(TrainError, match="gpt2_run.pt does not exist"):  # a path, not a model name
        T.train(T.make_config("cpu", dataset="bpe", data_dir=str(tmp_path), out_dir=str(tmp_path / "r3"),
                              init_from=str(tmp_path / "gpt2_run.pt"), block_size=16, progress=False))


# ---------------------------------------------------------------- nothing a user made is replaced

def test_a_second_training_into_a_busy_run_directory_is_refused(tiny_data, tmp_path):
    holder = RD.RunLock(tmp_path / "run", active=True)
    try:
        with pytest.raises(TrainError, match=f"in use by another training run \\(process {os.getpid()}\\)"):
            T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    finally:
        holder.release()
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))  # free again once released


def test_a_refused_training_leaves_the_folder_as_it_was(tiny_data, tmp_path):
    """No folder or lock file is left behind by a run that fails to start, a stale lock's content is put
    back, and a run.lock that no run wrote is refused, not replaced."""
    with pytest.raises(DeltaGPTError, match="not prepared"):
        T.train(cfg_for(tiny_data, tmp_path / "new" / "run", dataset="nope", max_iters=2))
    assert not (tmp_path / "new").exists()
    run = tmp_path / "run"
    run.mkdir()
    (run / "last.pt").write_text("mine")
    (run / "run.lock").write_text("12345\n")  # a killed run's
    with pytest.raises(ConfigError, match="already holds a run"):
        T.train(cfg_for(tiny_data, run, max_iters=2))
    assert (run / "run.lock").read_text() == "12345\n" and (run / "last.pt").read_text() == "mine"
    (run / "run.lock").write_text("mine")
    with pytest.raises(TrainError, match="is not a run lock that delta-gpt wrote"):
        T.train(cfg_for(tiny_data, run, max_iters=2, overwrite=True))
    assert (run / "run.lock").read_text() == "mine" and (run / "last.pt").read_text() == "mine"


@pytest.mark.slow  # a subprocess
def test_a_killed_run_leaves_no_stale_lock(tiny_data, tmp_path):
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from plumbing import rundir as RD; "
            "lock = RD.RunLock(sys.argv[2], True); print('locked', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(tmp_path / "run")], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        with pytest.raises(TrainError, match=f"process {p.pid}"):
            RD.RunLock(tmp_path / "run", True)
    finally:
        p.kill()
        p.wait()
    RD.RunLock(tmp_path / "run", True).release()  # the kernel dropped the dead process's lock


def test_resume_and_overwrite_together_are_refused(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="--resume continues the run in out_dir and --overwrite deletes it"):
        cfg_for(tiny_data, tmp_path / "run", resume=True, overwrite=True)


def test_resuming_a_finished_run_says_how_to_continue(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))
    with pytest.raises(ConfigError, match="already reached --max-iters 2 .*raise --max-iters"):
        T.train(T.resume_config(out_dir=str(tmp_path / "run")))


def test_overwrite_refuses_an_init_checkpoint_inside_the_run_it_would_clear(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "base", max_iters=2))
    init = str(tmp_path / "base" / "last.pt")
    with pytest.raises(ConfigError, match="is inside .* which --overwrite would clear"):
        T.train(cfg_for(tiny_data, tmp_path / "base", residual="delta", init_from=init, overwrite=True))
    assert CK.load_checkpoint(init)["iter_num"] == 2  # the baseline is intact


def test_a_run_directory_with_metrics_but_no_checkpoint_is_not_replaced(tiny_data, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"kind": "train", "step": 1}\n')
    with pytest.raises(ConfigError, match="already holds a run \\(metrics.jsonl\\)"):
        T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=2))


@pytest.mark.parametrize("dtype,native_bfloat16,warns", [("float16", True, True), ("bfloat16", False, True),
                                                         ("bfloat16", True, False), ("float32", False, False)])
def test_slow_half_precision_on_the_cpu_warns_once(tiny_data, tmp_path, capsys, monkeypatch, dtype,
                                                   native_bfloat16, warns):
    """float16 is slow on CPUs; bfloat16 only on one without native bfloat16 matrix products."""
    monkeypatch.setattr(SY, "cpu_has_bfloat16", lambda: native_bfloat16)
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=1, dtype=dtype))
    err = capsys.readouterr().err
    assert err.count(f"warning: --dtype {dtype} on this CPU runs many times slower than float32") == warns


def test_progress_without_a_terminal_prints_plain_lines(tiny_data, tmp_path, capsys):
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4, log_interval=2, progress=True))
    out = capsys.readouterr().out
    assert "step 2/4: loss" in out and "step 4/4: loss" in out and "step 3/4" not in out


def test_threads_option_is_a_process_setting_of_the_entry_point(monkeypatch):
    before = torch.get_num_threads()
    try:
        SY.apply_process_settings(T.make_config("cpu", threads=1, device="cpu"))
        assert torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setattr(SY, "busy_cores", lambda: 1)  # another job holds one core of two
        SY.apply_process_settings(T.make_config("cpu", device="cpu"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ConfigError, match="--threads must be at least 1"):
        T.make_config("cpu", threads=0)


@pytest.mark.slow
def test_the_cpu_preset_trains_on_the_code_a_student_reads(tiny_data, tmp_path, monkeypatch):
    """The cpu preset (make train, the exercises) routes with Router.forward, so an edit of it shows in training;
    every other preset takes the fast path."""
    assert T.make_config("cpu").fast_routing is False and T.make_config("shakespeare_char").fast_routing is True
    calls, forward = [], delta_gpt.Router.forward
    monkeypatch.setattr(delta_gpt.Router, "forward",
                        lambda self, sources: calls.append(len(sources)) or forward(self, sources))
    T.train(cfg_for(tiny_data, tmp_path / "run", residual="delta", fast_routing=False, max_iters=1))
    assert calls and max(calls) == 4  # 2 layers: the last sublayer reads e, v_1, v_2, v_3
    calls.clear()
    T.train(cfg_for(tiny_data, tmp_path / "fast", residual="delta", max_iters=1))  # the tests' runs: the fast path
    assert not calls


def test_a_slow_evaluation_says_how_long_it_takes(tiny_data, tmp_path, monkeypatch, capsys):
    """A run whose evaluation would sit silent for minutes (a very long context) says so at its first batch."""
    monkeypatch.setattr(T, "SILENT_S", 0.0)
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=1, progress=True))
    out = capsys.readouterr().out
    assert "note: one train batch took 0 s: this split's loss takes about 0 min (2 batches, --eval-iters)" in out
    monkeypatch.setattr(T, "SILENT_S", 60)
    T.train(cfg_for(tiny_data, tmp_path / "quiet", max_iters=1, progress=True))
    assert "note: one" not in capsys.readouterr().out


def test_fast_routing_is_a_training_option_not_architecture(tiny_data, tmp_path):
    """A run trained on the plain path resumes on the fast one (and the losses agree to float rounding)."""
    T.train(cfg_for(tiny_data, tmp_path / "plain", residual="delta", fast_routing=False, max_iters=4))
    assert CK.load_checkpoint(tmp_path / "plain" / "last.pt")["model_config"]["fast_routing"] is False
    T.train(T.resume_config(out_dir=str(tmp_path / "plain"), max_iters=8, fast_routing=True))
    T.train(cfg_for(tiny_data, tmp_path / "fast", residual="delta"))
    torch.testing.assert_close(train_losses(tmp_path / "plain"), train_losses(tmp_path / "fast"), rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- a newcomer's trial

def test_a_run_that_diverged_before_its_first_checkpoint_is_started_again_with_overwrite(tiny_data, tmp_path, monkeypatch):
    """Its metrics and config stay behind; the refusal of a rerun, and --resume, both point to --overwrite, which works."""
    cfg = cfg_for(tiny_data, tmp_path / "run", ckpt_interval=8)
    poison_training_step(monkeypatch, 2, lambda loss: loss * float("nan"))
    with pytest.raises(TrainError, match="no checkpoint was written yet"):
        T.train(cfg)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "last.pt").exists() and (tmp_path / "run" / "config.json").exists()
    with pytest.raises(ConfigError, match="it wrote no checkpoint to resume; pass --overwrite to start over") as info:
        T.train(cfg)
    assert "--resume" not in str(info.value)
    with pytest.raises(TrainError, match="the run in .* stopped before writing it; start it again with --overwrite"):
        T.resume_config(out_dir=str(tmp_path / "run"))
    T.train(cfg_for(tiny_data, tmp_path / "run", ckpt_interval=8, overwrite=True))
    assert CK.load_checkpoint(tmp_path / "run" / "last.pt")["iter_num"] == 8


@pytest.mark.slow  # a subprocess holds the run's lock
def test_a_run_still_before_its_first_checkpoint_says_so(tiny_data, tmp_path):
    """--resume, sample and report on a run still training with no checkpoint yet: it is in progress, and when
    its first checkpoint comes."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(dict(config=dict(ckpt_interval=250))))
    code = ("import sys, time; sys.path.insert(0, sys.argv[1]); from plumbing import rundir as RD; "
            "lock = RD.RunLock(sys.argv[2], True); print('locked', flush=True); time.sleep(60)")
    p = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "locked"
        said = f"does not exist yet: the run in {run} is still training \\(process {p.pid}\\) and writes it at step 250"
        with pytest.raises(TrainError, match=said):
            T.resume_config(out_dir=str(run))
        with pytest.raises(TrainError, match=said):
            CK.load_model(run / "last.pt")
        with pytest.raises(TrainError, match="best.pt does not exist yet: .* at its first evaluation that improves"):
            CK.load_model(run / "best.pt")
    finally:
        p.kill()
        p.wait()
    with pytest.raises(TrainError, match="stopped before writing it"):  # the process is gone: no longer in progress
        CK.load_model(run / "last.pt")


def test_a_file_that_is_not_a_checkpoint_gets_one_sentence_of_ours(tmp_path):
    for content, why in ((b"not a zip at all", "torch.load cannot read it (truncated, corrupt, or not a checkpoint)"),
                         (b"PK\x03\x04" + b"\0" * 40, "torch.load cannot read it")):
        path = tmp_path / "x.pt"
        path.write_bytes(content)
        with pytest.raises(TrainError) as info:
            CK.load_checkpoint(path)
        assert str(info.value) == (f"checkpoint {path} is unreadable: {why}"
                                   + ("" if why.endswith(")") else " (truncated, corrupt, or not a checkpoint)")
                                   + "; use another checkpoint or train again")
    torch.save({"model": object}, tmp_path / "pickled.pt")  # a class: refused by weights_only loading
    with pytest.raises(TrainError, match="holds pickled Python objects, which delta-gpt never loads"):
        CK.load_checkpoint(tmp_path / "pickled.pt")


def test_metrics_are_strict_json_and_old_nan_files_still_read(tiny_data, tmp_path):
    """One-source sublayers have no entropy: null in metrics.jsonl (strict JSON), and NaN in old files reads too."""
    T.train(cfg_for(tiny_data, tmp_path / "run", residual="delta", max_iters=4))
    lines = (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()

    def strict(text):
        return json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in strict JSON"))
    rows = [strict(l) for l in lines]
    first = [r for r in rows if r["kind"] == "eval"][0]["routing"]["sublayers"][0]
    assert first["n"] == 1 and first["entropy"] is None and first["adj_cos"] is None
    old = tmp_path / "old"
    old.mkdir()
    (old / "metrics.jsonl").write_text('{"kind": "eval", "step": 0, "val_loss": 1.5, "routing": {"mean_entropy": NaN}}\n')
    assert math.isnan(RD.read_metrics(old)[0]["routing"]["mean_entropy"])


def test_messages_name_options_as_typed_on_the_command_line(tiny_data, tmp_path):
    """GPTConfig's field=value becomes --option value on the command line (a study file keeps its own keys)."""
    for argv, said in ((["--residual", "delta_block", "--n-route-blocks", "3"], "--n-route-blocks 3 must divide"),
                       (["--dropout", "1.5"], "--dropout 1.5 must be in [0, 1)"),
                       (["--residual", "baseline", "--route-partial"], "--route-partial is set but --residual baseline "
                                                                         "has no routing; leave --route-partial unset")):
        with pytest.raises(ConfigError) as info:
            T.config_from_args(argv)
        assert said in str(info.value) and "=" not in str(info.value).replace("2*n_layer=", ""), str(info.value)


def test_eval_and_training_average_the_same_batches_by_default(tiny_data, tmp_path):
    import inspect
    import sample as SA
    defaults = inspect.signature(SA.evaluate_checkpoint).parameters
    assert defaults["eval_iters"].default == T.TrainConfig().eval_iters == 20
    assert defaults["batch_size"].default == T.TrainConfig().batch_size
    T.train(cfg_for(tiny_data, tmp_path / "run", max_iters=4))
    last_eval = [r for r in RD.read_metrics(tmp_path / "run") if r["kind"] == "eval"][-1]
    _, loss, _ = SA.evaluate_checkpoint(tmp_path / "run" / "last.pt", eval_iters=2, batch_size=4)
    assert loss == pytest.approx(last_eval["val_loss"], abs=1e-6)


# ---------------------------------------------------------------- the static-routing control

def test_static_routing_is_recorded_as_architecture(tiny_data, tmp_path):
    """A static run's checkpoint says so; resuming it as dynamic is refused; report shows its (token-independent) weights."""
    T.train(cfg_for(tiny_data, tmp_path / "static", residual="delta", route_weights="static", max_iters=4))
    ckpt = CK.load_checkpoint(tmp_path / "static" / "last.pt")
    assert ckpt["model_config"]["route_weights"] == "static" and ckpt["config"]["route_weights"] == "static"
    assert any(k.endswith("attn_router.logits") for k in ckpt["model"]) and not any(k.endswith("query") for k in ckpt["model"])
    with pytest.raises(ConfigError, match="--route-weights dynamic \\(the run has static\\)"):
        T.resume_config(out_dir=str(tmp_path / "static"), route_weights="dynamic", max_iters=8)
    T.train(T.resume_config(out_dir=str(tmp_path / "static"), max_iters=6))
    from workbench import report as R
    table, _ = R.report_checkpoints([tmp_path / "static" / "last.pt"], batches=1, batch_size=2)
    assert "delta" in table


def test_a_one_head_static_run_of_the_previous_shape_resumes_bit_exact(tiny_data, tmp_path):
    """Static logits (and so their AdamW moments) were (n,) for one head before they were (H, n): a run saved
    that way resumes, and ends where the run of today's shape ends."""
    T.train(cfg_for(tiny_data, tmp_path / "new", residual="delta", route_weights="static", max_iters=4))
    path = tmp_path / "old" / "last.pt"
    path.parent.mkdir()
    for name in ("last.pt", "config.json", "metrics.jsonl"):
        (path.parent / name).write_bytes((tmp_path / "new" / name).read_bytes())
    ckpt = CK.load_checkpoint(path)
    ckpt["model"] = {k: v.squeeze(0) if k.endswith("_router.logits") else v for k, v in ckpt["model"].items()}
    for state in ckpt["optimizer"]["state"].values():
        for k, v in state.items():
            if v.dim() == 2 and v.size(0) == 1:
                state[k] = v.squeeze(0)
    CK.save_checkpoint(ckpt, path)
    for run in ("new", "old"):
        T.train(T.resume_config(out_dir=str(tmp_path / run), max_iters=8))
    a, b = params(tmp_path / "new" / "last.pt"), params(tmp_path / "old" / "last.pt")
    assert all(torch.equal(a[k], b[k]) for k in a) and train_losses(tmp_path / "old") == train_losses(tmp_path / "new")


# ---------------------------------------------------------------- multi-head routing

def test_multi_head_routing_is_recorded_as_architecture(tiny_data, tmp_path):
    """A run with routing heads records them; resuming with other heads is refused; report gives the sharpness
    averaged over heads and each head's in report.json."""
    T.train(cfg_for(tiny_data, tmp_path / "heads", residual="delta_block", route_heads=4, max_iters=4))
    ckpt = CK.load_checkpoint(tmp_path / "heads" / "last.pt")
    assert ckpt["model_config"]["route_heads"] == 4 and ckpt["config"]["route_heads"] == 4
    with pytest.raises(ConfigError, match="--route-heads 2 \\(the run has 4\\)"):
        T.resume_config(out_dir=str(tmp_path / "heads"), route_heads=2, max_iters=8)
    T.train(T.resume_config(out_dir=str(tmp_path / "heads"), max_iters=6))
    from workbench import report as R
    _, written = R.report_checkpoints([tmp_path / "heads" / "last.pt"], batches=1, batch_size=2)
    rows = json.loads(written[0].read_text())["delta_block-h4"]["sublayers"]  # the label names the heads
    routed = [r for r in rows if r["n"] > 1]
    assert routed and all(len(r["heads"]) == 4 for r in routed)
    for r in routed:
        assert r["max_weight"] == pytest.approx(sum(h["max_weight"] for h in r["heads"]) / 4)
        assert len(r["mean_weight"]) == r["n"] and all(len(h["mean_weight"]) == r["n"] for h in r["heads"])


@pytest.mark.slow  # a subprocess each
@pytest.mark.parametrize("argv,said", [
    (["--residual", "delta", "--route-weights", "fixed"], "--route-weights fixed is unknown; choose one of dynamic, static"),
    (["--residual", "baseline", "--route-weights", "static"],
     "--route-weights is set but --residual baseline has no routing; leave --route-weights unset or choose attnres, "
     "delta or delta_block"),
    (["--residual", "delta", "--route-heads", "2.5"], "--route-heads expects an integer, got '2.5'"),
    (["--residual", "delta", "--route-heads", "0"],
     "--route-heads 0 must be a whole number that divides --n-embd 128; choose one of 1, 2, 4, 8, 16, 32, 64, 128"),
    (["--residual", "attnres", "--route-heads", "3"],
     "--route-heads 3 must be a whole number that divides --n-embd 128; choose one of 1, 2, 4, 8, 16, 32, 64, 128"),
    (["--residual", "baseline", "--route-heads", "2"],
     "--route-heads is set but --residual baseline has no routing; leave --route-heads unset or choose attnres, "
     "delta or delta_block"),
])
def test_bad_routing_options_are_one_line_before_any_work(tiny_data, tmp_path, argv, said):
    r = subprocess.run([sys.executable, str(ROOT / "train.py"), *argv, "--out-dir", str(tmp_path / "x")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stderr.strip() == f"error: {said}" and not (tmp_path / "x").exists(), r.stderr


def test_evaluation_lines_print_routing_sharpness_only_where_a_router_has_two_sources(tiny_data, tmp_path, capsys):
    T.train(cfg_for(tiny_data, tmp_path / "one", residual="delta_block", n_route_blocks=1, max_iters=4))
    one = capsys.readouterr().out  # N = 1: every router reads the embedding alone
    T.train(cfg_for(tiny_data, tmp_path / "two", residual="delta_block", n_route_blocks=2, max_iters=4))
    two = capsys.readouterr().out
    assert "step 4: " in one and "routing" not in one and "nan" not in one
    assert "step 4: " in two and "routing max weight 0." in two
