"""plan.py: the activation figure against measured runs, the parameter count, FSDP's sharding, the
advice, and every bad input as one line."""
import re

import pytest
import torch

import train as T
from workbench import bench
from workbench import plan as P
from delta_gpt import GPT
from conftest import ok, refused
from plumbing import config as O

VOCAB = 65
TINY = ["--preset", "cpu", "--n-layer", "2", "--n-head", "2", "--n-embd", "32", "--block-size", "16",
        "--batch-size", "4", "--gradient-accumulation-steps", "4", "--vocab-size", VOCAB]


def small(**kw):
    return T.make_config("cpu", **{**dict(n_layer=2, n_head=2, n_embd=32, block_size=16, batch_size=4,
                                          gradient_accumulation_steps=4, dtype="float32"), **kw})


def measured(cfg, seed=1):
    """bench.saved_bytes of the real model of cfg for one micro-step, as train.py runs it (DDP precision)."""
    torch.manual_seed(seed)
    model = GPT(O.model_config(cfg, VOCAB))
    for block in model.transformer.h:
        block.recompute = cfg.activation_checkpointing
    idx = torch.randint(0, VOCAB, (cfg.batch_size, cfg.block_size))
    if cfg.dtype == "float32":
        return bench.saved_bytes(model, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return bench.saved_bytes(model, idx)


# sizes the planner does not measure at: it measures 1 to 3 layers (2 to 6 for 4 routing blocks), two and
# three heads of 16 (the head size here), batches 2 and 3, contexts 16 to 48
@pytest.mark.parametrize("size", [dict(n_layer=5, n_head=5, n_embd=80, batch_size=4, block_size=24),
                                  dict(n_layer=4, n_head=4, n_embd=64, batch_size=5, block_size=40)])
@pytest.mark.parametrize("residual,dtype,checkpointing,dropout", [
    ("baseline", "float32", False, 0.0), ("delta", "float32", False, 0.0), ("delta_block", "float32", False, 0.0),
    ("delta", "bfloat16", False, 0.0), ("delta", "float32", True, 0.0), ("baseline", "float32", False, 0.1)])
def test_activations_match_a_measured_run(size, residual, dtype, checkpointing, dropout):
    if residual == "delta_block":
        size = dict(size, n_layer=8)  # 16 sublayers: 4 routing blocks divide them
    cfg = small(residual=residual, dtype=dtype, activation_checkpointing=checkpointing, dropout=dropout, **size)
    planned, real = P.activations(cfg, VOCAB), measured(cfg)
    assert abs(planned - real) <= 0.1 * real, (planned, real)


def test_activations_grow_linearly_in_batch_and_context():
    act = lambda batch=4, block_size=64: P.activations(small(n_layer=4), VOCAB, batch, block_size)
    assert act(batch=8) - act(batch=4) == pytest.approx(4 * (act(batch=2) - act(batch=1)))
    assert act(block_size=1024) - act(block_size=512) == pytest.approx(2 * (act(block_size=512) - act(block_size=256)))


@pytest.mark.parametrize("residual,bias", [("baseline", False), ("baseline", True), ("delta", False), ("attnres", False)])
def test_parameter_count_is_the_models(residual, bias):
    cfg = small(residual=residual, bias=bias, n_layer=4)
    n, block = P.parameters(cfg, VOCAB)
    model = GPT(O.model_config(cfg, VOCAB))
    assert n == model.get_num_params(non_embedding=False) == sum(p.numel() for p in model.parameters())
    assert block == sum(p.numel() for p in model.transformer.h[0].parameters())
    if residual == "baseline" and not bias:  # 12 D^2 in the Linears, two LayerNorm weights
        assert block == 12 * 32 * 32 + 2 * 32


def test_fsdp_divides_the_state_by_nproc():
    ddp, fsdp = P.memory(small(), VOCAB, 4), P.memory(small(fsdp=True), VOCAB, 4)
    n = P.parameters(small(), VOCAB)[0]
    assert (ddp["parameters"], ddp["gradients"], ddp["AdamW state"], ddp["DDP buckets"]) == (4 * n, 4 * n, 8 * n, 4 * n)
    for part in ("parameters", "gradients", "AdamW state"):
        assert fsdp[part] == ddp[part] / 4
    assert "DDP buckets" not in fsdp and fsdp["FSDP gathered"] > 0
    assert fsdp["activations"] == ddp["activations"]  # fp32: the same forward
    assert "DDP buckets" not in P.memory(small(), VOCAB, 1)


def test_advice_names_the_largest_batch_that_fits():
    cfg = small(batch_size=64, gradient_accumulation_steps=4, block_size=64)
    step = lambda b: sum(P.memory(cfg, VOCAB, 1, b).values())
    gpu = (step(20) + step(21)) / 2 / P.GIB / P.USABLE  # batch 20 fits, 21 does not
    text = P.plan_report(cfg, 1, gpu, VOCAB)
    assert "does not fit" in text
    batch, accum = map(int, re.search(r"--batch-size (\d+) --gradient-accumulation-steps (\d+)", text).groups())
    assert batch * accum == 64 * 4 and batch <= 20 and 256 % batch == 0 and batch == 16  # the same sequences per step
    assert P.largest_batch(cfg, VOCAB, 1, gpu * P.USABLE * P.GIB) == 20
    assert "fits: " in P.plan_report(cfg, 1, step(64) / P.GIB / P.USABLE * 1.01, VOCAB)


def test_cli_plan_prints_the_table():
    out = ok("plan", *TINY, "--nproc", "2", "--fsdp", "--gpu-memory", "1")
    assert "| total |" in out and "FSDP over 2 GPUs" in out and "1/2 each" in out and "fits: " in out


# ---------------------------------------------------------------- bad input

def test_bad_plan_input():
    refused("unknown preset 'huge'", "plan", "--preset", "huge")
    refused("--gpu-memory must be positive", "plan", *TINY, "--gpu-memory", "0")
    refused("--gpu-memory must be positive", "plan", *TINY, "--gpu-memory", "-80")
    refused("--nproc must be at least 1", "plan", *TINY, "--nproc", "0")
    refused("must be a multiple of --nproc 3", "plan", *TINY, "--nproc", "3")
    refused("does not fit on 2 GPUs of 1e-05 GiB at any batch size", "plan", *TINY, "--nproc", "2",
            "--gpu-memory", "0.00001")


def test_the_plain_routing_path_is_planned_apart_from_the_fast_one():
    """The plain router keeps O(S^2) stacked copies: a plan of it must not reuse the fast path's fit."""
    fast = P.activations(small(residual="delta", n_layer=4, fast_routing=True), VOCAB)
    plain = P.activations(small(residual="delta", n_layer=4, fast_routing=False), VOCAB)
    assert plain > 1.5 * fast
    assert abs(plain - measured(small(residual="delta", n_layer=4, fast_routing=False))) <= 0.1 * plain
