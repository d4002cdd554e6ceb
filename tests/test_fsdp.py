"""FSDP2 (--fsdp) on the CPU with gloo: trains like one process, checkpoints in the one-file format that
resume, eval and sample read in one process, and a rank killed mid-write loses nothing."""
import os

import pytest
import torch

import sample as S
import train as T
from conftest import ROOT, cfg_for, cli_args, train_losses, torchrun as run_torchrun
from plumbing import checkpoint as CK
from errors import ConfigError

# torchrun's --standalone picks a free port by closing a socket it bound: two at once can collide (make test: -n 2)
pytestmark = pytest.mark.xdist_group("torchrun")
STEPS = dict(max_iters=6, lr_decay_iters=6, eval_interval=3, ckpt_interval=3, gradient_accumulation_steps=2)


def torchrun(tiny_data, out_dir, extra_env=None, **kw):
    """train.py under torchrun with 2 gloo processes, FSDP on; returns the CompletedProcess."""
    return run_torchrun("train.py", cli_args(tiny_data, out_dir, **{**STEPS, "fsdp": True, **kw}), extra_env)


def ok(r):
    assert r.returncode == 0, r.stdout[-1500:] + r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("residual", ["baseline", "delta"])
def test_fsdp_on_two_processes_trains_like_one(tiny_data, tmp_path, residual):
    """2 ranks x 2 micro-steps, sharded (gradients synced on the last micro-step only), == 1 process x 4
    micro-steps, on the same batches; activation checkpointing on the FSDP side changes nothing either."""
    accumulate = dict(gradient_accumulation_steps=4)
    ok(torchrun(tiny_data, tmp_path / "fsdp", residual=residual, activation_checkpointing=True, **accumulate))
    T.train(cfg_for(tiny_data, tmp_path / "one", residual=residual, **{**STEPS, **accumulate}))
    sharded, one = train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "one")
    assert [s for s, _ in sharded] == [s for s, _ in one] == list(range(1, 7))
    torch.testing.assert_close([l for _, l in sharded], [l for _, l in one], rtol=1e-6, atol=1e-6)
    ckpt = CK.load_checkpoint(tmp_path / "fsdp" / "last.pt")  # today's format: plain tensors, int-keyed optimizer
    assert ckpt["iter_num"] == 6 and sorted(ckpt["optimizer"]["state"]) == list(range(len(ckpt["optimizer"]["state"])))
    _, loss, _ = S.evaluate_checkpoint(tmp_path / "fsdp" / "last.pt", eval_iters=2, batch_size=4)
    _, loss_one, _ = S.evaluate_checkpoint(tmp_path / "one" / "last.pt", eval_iters=2, batch_size=4)
    assert loss == pytest.approx(loss_one, rel=1e-5)


@pytest.mark.slow
def test_fsdp_resume_is_exact_and_crosses_to_and_from_one_process(tiny_data, tmp_path):
    T.train(cfg_for(tiny_data, tmp_path / "full", residual="delta", **STEPS))
    full = train_losses(tmp_path / "full")
    # FSDP for 3 steps, then resumed under FSDP
    ok(torchrun(tiny_data, tmp_path / "a", residual="delta", max_iters=3))
    ok(torchrun(tiny_data, tmp_path / "a", resume=True))
    # one process for 3 steps, resumed under FSDP; and the other way round
    T.train(cfg_for(tiny_data, tmp_path / "b", residual="delta", **{**STEPS, "max_iters": 3}))
    ok(torchrun(tiny_data, tmp_path / "b", resume=True))
    ok(torchrun(tiny_data, tmp_path / "c", residual="delta", max_iters=3))
    T.train(T.resume_config(out_dir=str(tmp_path / "c"), max_iters=6, fsdp=False))
    for run in ("a", "b", "c"):
        torch.testing.assert_close(train_losses(tmp_path / run), full, rtol=1e-6, atol=1e-6)


SITECUSTOMIZE = """
import os, signal
if os.environ.get("RANK") == "0":
    import torch
    real, calls = torch.save, [0]
    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == int(os.environ["KILL_AT_SAVE"]):  # half a file, then the process dies
            f.write(b"PK\\x03\\x04 half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real(obj, f, *args, **kwargs)
    torch.save = save
"""


@pytest.mark.slow
def test_a_rank_killed_while_writing_leaves_the_previous_checkpoint(tiny_data, tmp_path):
    """Saves: best.pt and last.pt at step 3, then best.pt and last.pt at step 6; rank 0 dies in the 4th."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(SITECUSTOMIZE)
    r = torchrun(tiny_data, tmp_path / "run", residual="delta",
                 extra_env={"KILL_AT_SAVE": "4", "PYTHONPATH": f"{hook}{os.pathsep}{ROOT}"})
    assert r.returncode != 0 and "Signal 9 (SIGKILL)" in r.stderr, r.stdout[-1500:] + r.stderr[-3000:]  # the kill, no other failure
    assert CK.load_checkpoint(tmp_path / "run" / "last.pt")["iter_num"] == 3  # whole, and the step before
    ok(torchrun(tiny_data, tmp_path / "run", resume=True))
    T.train(cfg_for(tiny_data, tmp_path / "full", residual="delta", **STEPS))
    torch.testing.assert_close(train_losses(tmp_path / "run"), train_losses(tmp_path / "full"), rtol=1e-6, atol=1e-6)


def test_fsdp_in_one_process_equals_the_plain_run(tiny_data, tmp_path):
    """--fsdp without torchrun runs as a process group of one (world size 1)."""
    T.train(cfg_for(tiny_data, tmp_path / "fsdp", residual="delta", fsdp=True, max_iters=3))
    T.train(cfg_for(tiny_data, tmp_path / "one", residual="delta", max_iters=3))
    torch.testing.assert_close(train_losses(tmp_path / "fsdp"), train_losses(tmp_path / "one"), rtol=1e-6, atol=1e-6)
    assert not torch.distributed.is_initialized()


def test_fsdp_refuses_float16(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="--fsdp .* use --dtype bfloat16"):
        cfg_for(tiny_data, tmp_path / "run", fsdp=True, dtype="float16")


def test_fsdp_without_fsdp2_in_torch_says_what_to_do(tiny_data, tmp_path, monkeypatch):
    """On a PyTorch without FSDP2 (older than 2.6, which also cannot compile it), --fsdp is one line."""
    import torch.distributed.fsdp
    monkeypatch.delattr(torch.distributed.fsdp, "fully_shard")
    with pytest.raises(ConfigError, match="--fsdp needs PyTorch's FSDP2 .* upgrade torch or train with DDP"):
        cfg_for(tiny_data, tmp_path / "run", fsdp=True, compile=True)
