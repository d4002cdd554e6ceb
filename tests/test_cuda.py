"""CUDA: bf16 and fp16 training, routing in float32 under autocast, torch.compile with Inductor's kernels,
fused AdamW, the KV cache, checkpoints across devices and DDP over NCCL. Skipped without CUDA;
`pytest -m cuda` (or `make gpu-check`) selects them. Tiny models, so they take seconds each, but for
Inductor's compiles."""
import copy
import math
import os
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch.nn import functional as F

import train
from delta_gpt import GPT, GPTConfig, RESIDUALS
from plumbing import checkpoint as CK

pytestmark = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

ROOT = Path(__file__).resolve().parent.parent
CUDA = torch.device("cuda")
VOCAB = 61
ROUTED = [m for m in RESIDUALS if m != "baseline"]


@pytest.fixture(autouse=True)
def exact_float32():
    """fp32 references in true float32: TF32 off (only entry points turn it on; gpu_check runs these tests in
    a process of their own), restored after."""
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    yield
    torch.set_float32_matmul_precision(saved)


def tiny(residual="baseline", **kw):
    kw = dict(dict(block_size=64, vocab_size=VOCAB, n_layer=2, n_head=4, n_embd=64, dropout=0.0), **kw)
    return GPTConfig(residual=residual, **kw)


def model_of(config, seed=0, queries=0.5):
    """A model on CUDA whose routers have random queries and gains (zero init would hide the routing)."""
    torch.manual_seed(seed)
    model = GPT(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "_router." in name and name.endswith("query"):
                p.normal_(0, queries)
            elif "_router." in name:
                p.uniform_(0.5, 1.5)
    return model.to(CUDA)


def batch(B=4, T=64, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (B, T), generator=g).to(CUDA)


def loss_and_grads(model, idx, dtype=None):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
        _, loss = model(idx, idx)
    loss.backward()
    return loss.float(), torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])


# ---------------------------------------------------------------- mixed precision

@pytest.mark.parametrize("residual", RESIDUALS)
def test_bf16_step_is_finite_and_matches_fp32(residual):
    model = model_of(tiny(residual))
    idx = batch()
    loss32, grad32 = loss_and_grads(model, idx)
    loss16, grad16 = loss_and_grads(model, idx, torch.bfloat16)
    assert torch.isfinite(loss16) and torch.isfinite(grad16).all()
    assert abs(loss16.item() - loss32.item()) < 1e-2 * loss32.item(), (loss16.item(), loss32.item())
    assert F.cosine_similarity(grad16, grad32, dim=0) > 0.99
    # and a whole step (clip, fused AdamW) leaves the weights and the next loss finite
    optimizer = model.configure_optimizers(0.1, 1e-3, (0.9, 0.99), "cuda")
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert torch.isfinite(loss_and_grads(model, idx, torch.bfloat16)[0])


def router_of(model, k):
    """The router of the k-th read in the record: h.0.attn, h.0.mlp, h.1.attn, ..., the final router last."""
    n = model.config.n_layer
    if k == 2 * n:
        return model.get_submodule("transformer.final_router")
    return model.get_submodule(f"transformer.h.{k // 2}.{'attn' if k % 2 == 0 else 'mlp'}_router")


@pytest.mark.parametrize("residual", ROUTED)
def test_routing_logits_and_softmax_in_float32_under_autocast(residual):
    """Under bf16 autocast alpha is float32 and equals softmax(w . RMSNorm_g(s_i)) computed in float64 from
    the recorded (bf16) sources to float32 rounding: logits or softmax in bf16 would be off by about 1e-3."""
    model = model_of(tiny(residual, n_layer=4), queries=0.2).eval()
    record = []
    with torch.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
        model.hidden(batch(B=2, T=32), record=record)
    assert len(record) == 2 * 4 + (residual == "attnres")
    assert any(s.dtype == torch.bfloat16 for sources, _ in record for s in sources)  # autocast was on
    for k, (sources, alpha) in enumerate(record):
        assert alpha.dtype == torch.float32
        router = router_of(model, k)
        s = torch.stack([x.double() for x in sources], dim=-2)  # (B, T, n, D)
        keys = F.rms_norm(s, s.shape[-1:], router.norm.weight.double(), router.norm.eps)
        expected = (keys @ router.query.double()).softmax(dim=-1)  # (B, T, n)
        torch.testing.assert_close(alpha[..., 0, :].double(), expected, atol=2e-5, rtol=0, msg=f"read {k}")  # one head


def tiny_run(tiny_data, tmp_path, name, **kw):
    """train.train's config for a tiny run on the conftest 'tiny' dataset, on CUDA, without compile."""
    kw = dict(dict(dataset="tiny", data_dir=str(tiny_data), out_dir=str(tmp_path / name), device="cuda",
                   compile=False, n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=4, max_iters=2,
                   warmup_iters=0, eval_interval=1000, eval_iters=1, log_interval=1, ckpt_interval=1000,
                   progress=False), **kw)
    return train.make_config("cpu", **kw)


class InfGradientAt:
    """In the n-th training forward of a GPT (counted from 1) makes every gradient inf, and keeps a copy of
    the weights each training forward starts from; through a global forward hook, as train.train builds
    its own model."""

    def __init__(self, n):
        self.n, self.weights = n, []

    def __call__(self, module, args, output):
        if isinstance(module, GPT) and torch.is_grad_enabled():
            self.weights.append({k: v.detach().clone() for k, v in module.state_dict().items()})
            if len(self.weights) == self.n:
                output[0].register_hook(lambda g: torch.full_like(g, float("inf")))

    def __enter__(self):
        self.handle = torch.nn.modules.module.register_module_forward_hook(self)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def test_fp16_grad_scaler_skips_an_inf_step_and_goes_on(tiny_data, tmp_path):
    cfg = tiny_run(tiny_data, tmp_path, "fp16", residual="delta", dtype="float16", max_iters=6)
    with InfGradientAt(3) as hook:
        summary = train.train(cfg)
    assert summary["iter_num"] == 6 and math.isfinite(summary["val_loss"]) and math.isfinite(summary["train_loss"])
    w = hook.weights  # w[k]: the weights step k + 1 starts from
    assert len(w) == 6  # one training forward per step (no accumulation)
    same = lambda a, b: all(torch.equal(a[k], b[k]) for k in a)
    assert not same(w[1], w[2]) and same(w[2], w[3]) and not same(w[3], w[4])  # step 3 skipped, 2 and 4 applied
    ckpt = CK.load_checkpoint(Path(cfg.out_dir) / "last.pt")
    assert all(torch.isfinite(v).all() for v in ckpt["model"].values())
    assert ckpt["scaler"]["scale"] == torch.amp.GradScaler("cuda").state_dict()["scale"] / 2  # halved once


# ---------------------------------------------------------------- torch.compile (Inductor, Triton)

@pytest.mark.compile
@pytest.mark.parametrize("residual", RESIDUALS)
def test_compile_fullgraph_matches_eager(residual):
    model = model_of(tiny(residual))
    idx = batch()
    eager_loss, eager_grads = loss_and_grads(model, idx)
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True)
    loss, grads = loss_and_grads(compiled, idx)
    torch._dynamo.reset()
    torch.testing.assert_close(loss, eager_loss, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(grads, eager_grads, atol=1e-5, rtol=1e-3)


def activation_bytes(model, idx):
    """CUDA memory held after a forward (what autograd keeps for backward, and the loss), after a warm-up
    step that compiles and allocates any workspaces."""
    loss_and_grads(model, idx)
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    _, loss = model(idx, idx)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    loss.backward()
    model.zero_grad(set_to_none=True)
    return held


@pytest.mark.compile
def test_compiled_activation_memory_linear_in_depth():
    """Inductor's graph for the routed model keeps about what the eager fast path keeps: its ratio to
    baseline stays flat from 1 to 4 layers (the plain path's grows, 1.33 to 2.09 on the CPU)."""
    idx = batch(B=8, T=64)

    def held(residual, n_layer):
        torch._dynamo.reset()
        model = model_of(tiny(residual, n_layer=n_layer, n_embd=128))
        return activation_bytes(torch.compile(model, fullgraph=True), idx)

    r1, r4 = (held("delta", L) / held("baseline", L) for L in (1, 4))
    torch._dynamo.reset()
    assert r4 < 1.35 and r4 / r1 < 1.1, (r1, r4)


# ---------------------------------------------------------------- optimizer, generation, checkpoints

def test_fused_adamw_is_used_and_matches_the_unfused_step():
    fused_model = model_of(tiny("delta"))
    plain_model = copy.deepcopy(fused_model)
    fused = fused_model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cuda")
    plain = plain_model.configure_optimizers(0.1, 1e-2, (0.9, 0.99), "cpu")  # the same groups, not fused
    assert all(g["fused"] for g in fused.param_groups) and not any(g.get("fused") for g in plain.param_groups)
    for step in range(3):
        loss_and_grads(fused_model, batch(seed=step))
        for p, q in zip(fused_model.parameters(), plain_model.parameters()):
            q.grad = p.grad.clone()
        fused.step()
        plain.step()
    start = model_of(tiny("delta"))
    for (name, p), q, p0 in zip(fused_model.named_parameters(), plain_model.parameters(), start.parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=name)
        # the steps moved every weight with a gradient (Adam: about lr per step); a router that reads one
        # source (the first) has alpha = 1 whatever its query, so a zero gradient
        assert (p - p0).abs().max() > 1e-3 or not p.grad.any(), name


@pytest.mark.parametrize("residual", RESIDUALS)
def test_kv_cache_generation_equals_recompute(residual):
    model = model_of(tiny(residual, block_size=32)).eval()
    prompt = batch(B=2, T=8)
    for kw in (dict(temperature=0.0), dict(temperature=1.0, top_k=5)):
        runs = []
        for use_cache in (True, False):
            g = torch.Generator(device="cuda").manual_seed(0)
            runs.append(model.generate(prompt, 40, use_cache=use_cache, generator=g, **kw))  # 48 > 32: crops
        assert torch.equal(*runs), kw
    # a prompt fed in two chunks: the second attends to the cache through SDPA's boolean mask
    cache = [[] for _ in model.transformer.h]
    with torch.no_grad():
        first = model.hidden(prompt[:, :5], cache)
        second = model.hidden(prompt[:, 5:], cache)
        full = model.hidden(prompt)
    torch.testing.assert_close(torch.cat([first, second], dim=1), full, atol=1e-5, rtol=1e-5)


def test_checkpoints_move_between_cuda_and_cpu(tiny_data, tmp_path):
    cfg = tiny_run(tiny_data, tmp_path, "run", residual="delta", max_iters=2)
    train.train(cfg)
    path = Path(cfg.out_dir) / "last.pt"
    on_cpu = CK.load_checkpoint(path, map_location="cpu")
    assert all(v.device.type == "cpu" for v in on_cpu["model"].values())
    cpu_model = CK.model_from_checkpoint(on_cpu).eval()
    cuda_model = CK.model_from_checkpoint(CK.load_checkpoint(path, map_location="cuda")).to(CUDA).eval()
    idx = torch.randint(0, cpu_model.config.vocab_size, (2, 32), device=CUDA)
    with torch.no_grad():
        torch.testing.assert_close(cpu_model(idx.cpu())[0], cuda_model(idx)[0].cpu(), atol=1e-4, rtol=1e-4)
    # a CUDA run resumed on the CPU, and that CPU checkpoint resumed on CUDA
    for device, steps in (("cpu", 4), ("cuda", 6)):
        summary = train.train(tiny_run(tiny_data, tmp_path, "run", residual="delta", device=device, max_iters=steps,
                                     resume=True))
        assert summary["iter_num"] == steps and math.isfinite(summary["val_loss"])
    resumed = CK.load_checkpoint(path, map_location="cpu")
    assert resumed["iter_num"] == 6 and resumed["config"]["device"] == "cuda"


# ---------------------------------------------------------------- DDP over NCCL, one process

DDP_SCRIPT = textwrap.dedent("""
    import copy, math, sys
    import torch, torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    sys.path.insert(0, sys.argv[1])
    import train
    from delta_gpt import GPT, GPTConfig, RESIDUALS

    # train.train under torchrun's variables: NCCL process group of one
    cfg = train.make_config("cpu", dataset="tiny", data_dir=sys.argv[2], out_dir=sys.argv[3], device="cuda",
                            compile=False, n_layer=2, n_head=2, n_embd=64, block_size=32, batch_size=4, max_iters=2,
                            eval_interval=1000, eval_iters=1, residual="delta", progress=False)
    summary = train.train(cfg)
    assert summary["iter_num"] == 2 and math.isfinite(summary["val_loss"]), summary

    # a DDP-wrapped model on NCCL: its gradients (averaged over one rank) equal the plain model's; attention
    # on SDPA's math backend, whose backward is deterministic (flash's accumulates dq with atomics, and a
    # last-bit difference can round to another bf16 value)
    from torch.nn.attention import SDPBackend, sdpa_kernel
    dist.init_process_group("nccl")
    assert dist.get_backend() == "nccl" and dist.get_world_size() == 1
    idx = torch.randint(0, 61, (4, 32), device="cuda")
    for residual in RESIDUALS:
        torch.manual_seed(0)
        model = GPT(GPTConfig(block_size=32, vocab_size=61, n_layer=2, n_head=2, n_embd=64, residual=residual)).cuda()
        plain, ddp = copy.deepcopy(model), DDP(model, device_ids=[0])
        for step in range(2):  # a second step: DDP would complain here of parameters without gradients
            for m in (ddp, plain):
                m.zero_grad(set_to_none=True)
                with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
                    m(idx, idx)[1].backward()
        for (name, p), q in zip(model.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=f"{residual} {name}")
    dist.destroy_process_group()
    print("ddp ok")
""")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_ddp_nccl_one_process(tiny_data, tmp_path):
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1",
               MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run([sys.executable, "-c", DDP_SCRIPT, str(ROOT), str(tiny_data), str(tmp_path / "ddp")],
                         env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and "ddp ok" in out.stdout, out.stdout[-2000:] + out.stderr[-4000:]
