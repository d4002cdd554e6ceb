"""
Memory planner: what one GPU holds while it trains a config, known before any GPU is rented.

    python cli.py plan --preset paper_7b --nproc 8 --gpu-memory 80
    python cli.py plan --preset paper_1b --residual delta --nproc 8 --batch-size 16 --gpu-memory 80

What it counts per GPU, and how the activations are fitted to the model's own saved tensors: docs/scaling.md.
"""
import math
from dataclasses import replace

import numpy as np
import torch
from torch.nn import functional as F

import data
from delta_gpt import GPT, LayerNorm
from errors import ConfigError
from plumbing import config as O
from workbench import bench

GIB = 2**30
USABLE = 0.9  # the share of --gpu-memory a plan may fill
TERMS = ("B*T*L*D", "B*T*L*L*D", "B*T*L", "B*T*L*L", "B*T*D", "B*T", "B*T*T*L*D",
         "L*D*D", "L*D", "D", "T*T*L", "T*T", "T", "1")
SIZES = ((2, 16), (3, 16), (2, 32), (3, 32), (2, 48))  # (micro-batch, context) measured at each depth and width
EXACT = 1e-6  # the fit's largest relative error at the points measured


def vocab_size(cfg):
    """The vocabulary train.py would build for cfg: the prepared dataset's (GPT-2's padded to 50,304),
    or GPT-2's padded when the dataset is not prepared here."""
    meta = data.prepared_meta(cfg.dataset, cfg.data_dir)
    return 50304 if meta is None or meta.get("tokenizer") == "gpt2" else int(meta["vocab_size"])


def planned_precision(cfg):
    """(compute dtype, whether the weights themselves are cast to it): FSDP computes with bf16 weights,
    DDP with autocast over fp32 ones. 'auto' plans for CUDA: bfloat16."""
    dtype = "bfloat16" if cfg.dtype == "auto" else cfg.dtype
    return dtype, cfg.fsdp and dtype != "float32"


def measured_config(cfg, vocab, **change):
    """The GPTConfig of cfg, with `change` (n_layer, n_head, n_embd, block_size) for a measurement."""
    config = O.model_config(cfg, vocab)
    n_route_blocks = None if config.residual == "delta" else config.n_route_blocks  # delta: always 2 * n_layer
    return replace(config, n_route_blocks=n_route_blocks, **change)


def parameters(cfg, vocab):
    """(all parameters, one block's) of cfg's model, counted on the meta device (no memory, no init)."""
    with torch.device("meta"):
        model = GPT(O.model_config(cfg, vocab))
    return sum(p.numel() for p in model.parameters()), sum(p.numel() for p in model.transformer.h[0].parameters())


def fp32_layer_norm(ln):
    """ln's forward as CUDA's autocast runs it: in float32, whatever the input's dtype."""
    def forward(x):
        bias = ln.bias.float() if ln.bias is not None else None
        return F.layer_norm(x.float(), ln.weight.shape, ln.weight.float(), bias, ln.eps)
    return forward


def measured_model(config, cfg, seed=0):
    """The model of `config` as cfg would train it: its weights in cfg's precision, its blocks
    recomputing in backward with activation checkpointing."""
    dtype, cast = planned_precision(cfg)
    torch.manual_seed(seed)
    model = GPT(config)
    for block in model.transformer.h:
        block.recompute = cfg.activation_checkpointing  # each sublayer under torch.utils.checkpoint
    if cast:
        model.to(torch.bfloat16)
    if dtype != "float32":
        for module in model.modules():
            if isinstance(module, LayerNorm):
                module.forward = fp32_layer_norm(module)
    return model


def measure(model, cfg, batch, block_size):
    """bench.saved_bytes of one micro-step of `batch` sequences of `block_size` tokens, in cfg's precision."""
    idx = torch.randint(0, model.config.vocab_size, (batch, block_size))
    if planned_precision(cfg)[0] == "float32":
        return bench.saved_bytes(model, idx)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return bench.saved_bytes(model, idx)


def monomials(B, T, L, D):
    """The TERMS at one size."""
    env = dict(B=B, T=T, L=L, D=D)
    return [math.prod(env.get(f, 1) for f in term.split("*")) for term in TERMS]


FIT_FIELDS = (*O.ROUTE_FIELDS, "bias", "dropout", "fast_routing",
              "activation_checkpointing")  # with the head size, precision and vocabulary: what a fit depends on
_fits = {}


def fit(cfg, vocab):
    """Coefficients of TERMS (bytes) for cfg's activations at vocabulary `vocab`, from 30 measurements."""
    key = (tuple(getattr(cfg, f) for f in FIT_FIELDS), cfg.n_embd // cfg.n_head, planned_precision(cfg), vocab)
    if key not in _fits:
        _fits[key] = _fit(cfg, vocab)
    return _fits[key]


def _fit(cfg, vocab):
    head = cfg.n_embd // cfg.n_head
    blocks = O.model_config(cfg, vocab).n_route_blocks if cfg.residual in ("attnres", "delta_block") else 1
    l = blocks // math.gcd(blocks, 2)  # the fewest layers whose 2L sublayers the routing blocks divide
    rows, saved = [], []
    for L in (l, 2 * l, 3 * l):
        for heads in (2, 3):
            config = measured_config(cfg, vocab, n_layer=L, n_head=heads, n_embd=heads * head,
                                  block_size=max(T for _, T in SIZES))
            model = measured_model(config, cfg)
            for B, T in SIZES:
                rows.append(monomials(B, T, L, heads * head))
                saved.append(measure(model, cfg, B, T))
    A, y = np.array(rows, dtype=np.float64), np.array(saved, dtype=np.float64)
    scale = np.abs(A).max(axis=0)  # columns of one size, for a well-conditioned solve
    coef = np.linalg.lstsq(A / scale, y, rcond=None)[0] / scale
    worst = np.max(np.abs(A @ coef - y) / y)
    if worst > EXACT:
        raise RuntimeError(f"the activation model does not fit the measured saved tensors of this config "
                           f"(worst relative error {worst:.2e}): a saved tensor's size is not a product of TERMS")
    return coef


def activations(cfg, vocab, batch=None, block_size=None):
    """Bytes one micro-step's forward keeps for backward, at cfg's size or the given batch and context."""
    B, T = batch or cfg.batch_size, block_size or cfg.block_size
    return float(np.dot(fit(cfg, vocab), monomials(B, T, cfg.n_layer, cfg.n_embd)))


def memory(cfg, vocab, nproc, batch=None):
    """Bytes per GPU of one training step of cfg on nproc GPUs (at micro-batch `batch`), by part."""
    n, block = parameters(cfg, vocab)
    shards = nproc if cfg.fsdp else 1
    dtype, _ = planned_precision(cfg)
    compute = 4 if dtype == "float32" else 2
    parts = {"parameters": 4 * n / shards, "gradients": 4 * n / shards, "AdamW state": 8 * n / shards}
    if cfg.fsdp:
        root = n - cfg.n_layer * block  # embeddings (lm_head tied), ln_f, attnres's final router
        parts["FSDP gathered"] = (root + 2 * block) * (compute + 4)
    elif nproc > 1:
        parts["DDP buckets"] = 4 * n
    B = batch or cfg.batch_size
    parts["activations"] = activations(cfg, vocab, B)
    parts["logits gradient"] = B * cfg.block_size * vocab * 4
    return parts


def largest_batch(cfg, vocab, nproc, usable):
    """The largest micro-batch whose step fits in `usable` bytes (0 if not even one): memory is linear in it."""
    one, two = sum(memory(cfg, vocab, nproc, 1).values()), sum(memory(cfg, vocab, nproc, 2).values())
    per, base = two - one, 2 * one - two
    return max(0, math.floor((usable - base) / per))


def batch_options(cfg, nproc, largest):
    """--batch-size B --gradient-accumulation-steps G with B <= largest and, where some B allows it,
    the same sequences per step (G a multiple of nproc, as train.py needs)."""
    seqs = cfg.batch_size * cfg.gradient_accumulation_steps  # sequences per step over all GPUs
    same = [b for b in range(min(largest, seqs), 0, -1) if seqs % (b * nproc) == 0]
    b = same[0] if same else largest
    g = seqs // b if same else nproc * math.ceil(seqs / (b * nproc))
    kept = "the same" if same else "about the same"
    return b, f"--batch-size {b} --gradient-accumulation-steps {g} ({kept} {b * g:,} sequences per step)"


def variants(cfg, nproc):
    """cfg with each change that keeps less per GPU and is not on yet, with its train options."""
    out = []
    if not cfg.activation_checkpointing:
        out.append(("--activation-checkpointing", replace(cfg, activation_checkpointing=True)))
    if not cfg.fsdp and nproc > 1:
        out.append(("--fsdp", replace(cfg, fsdp=True)))
        if not cfg.activation_checkpointing:
            out.append(("--fsdp --activation-checkpointing", replace(cfg, fsdp=True, activation_checkpointing=True)))
    return out


def gpus_needed(cfg, vocab, usable, batch):
    """The fewest GPUs on which cfg with FSDP fits `batch` sequences a GPU, or None if no count does."""
    cfg = replace(cfg, fsdp=True)
    whole = sum(memory(cfg, vocab, 1, batch).values())
    sharded = 16 * parameters(cfg, vocab)[0]  # parameters, gradients and AdamW state
    room = usable - (whole - sharded)
    return math.ceil(sharded / room) if room > 0 else None


def gib(n):
    """Bytes as GiB: one decimal, or two significant digits below 1 GiB."""
    return f"{n / GIB:.1f}" if n >= GIB else f"{n / GIB:.2g}"


def plan_table(cfg, vocab, nproc):
    """The header and the per-GPU table of cfg on nproc GPUs, as lines of Markdown."""
    n, block = parameters(cfg, vocab)
    dtype, cast = planned_precision(cfg)
    setup = f"FSDP over {nproc} GPUs" if cfg.fsdp else f"DDP over {nproc} GPUs" if nproc > 1 else "one GPU"
    shard = f", 1/{nproc} each" if cfg.fsdp and nproc > 1 else ""
    mode = "bf16 weights" if cast else "fp32" if dtype == "float32" else f"{dtype} autocast"
    labels = {"parameters": f"parameters (fp32{shard})", "gradients": f"gradients (fp32{shard})",
              "AdamW state": f"AdamW state (fp32{shard})",
              "FSDP gathered": f"FSDP gathered: root + 2 blocks ({'fp32' if dtype == 'float32' else 'bf16'}, "
                               "with fp32 gradients)",
              "DDP buckets": "DDP gradient buckets (fp32)",
              "activations": f"activations ({mode}{', checkpointed' if cfg.activation_checkpointing else ''})",
              "logits gradient": "logits gradient (fp32)"}
    parts = memory(cfg, vocab, nproc)
    lines = [f"{cfg.preset}, {cfg.residual}: {n:,} parameters ({cfg.n_layer} layers, width {cfg.n_embd}, "
             f"{cfg.n_head} heads, vocabulary {vocab:,})",
             f"per GPU: micro-batch {cfg.batch_size} x {cfg.block_size} tokens, {dtype}, {setup}"
             f"{', activation checkpointing' if cfg.activation_checkpointing else ''}", "",
             "| per GPU | GiB |", "|---|---:|"]
    lines += [f"| {labels[k]} | {gib(v)} |" for k, v in parts.items()]
    return lines + [f"| total | {gib(sum(parts.values()))} |"]


def advice(cfg, vocab, nproc, gpu_memory):
    """Whether cfg fits in gpu_memory GiB a GPU and, if not, what would (lines); ConfigError when nothing
    at this GPU count fits even one sequence."""
    usable = USABLE * gpu_memory * GIB
    room = f"{gib(usable)} GiB usable ({gpu_memory:g} GiB less 10%)"
    step = lambda c, b=None, n=nproc: sum(memory(c, vocab, n, b).values())
    largest = largest_batch(cfg, vocab, nproc, usable)
    if step(cfg) <= usable:
        return [f"fits: {gib(step(cfg))} of {room}; the largest --batch-size that fits is {largest}"]
    lines = []
    if largest:
        b, opts = batch_options(cfg, nproc, largest)
        lines.append(f"  {opts}: {gib(step(cfg, b))} GiB")
    for flags, alt in variants(cfg, nproc):
        most = largest_batch(alt, vocab, nproc, usable)
        if most:
            b, opts = batch_options(alt, nproc, most) if most < cfg.batch_size else (cfg.batch_size, "")
            lines.append(f"  {flags}{' ' + opts if opts else ''}: {gib(step(alt, b))} GiB "
                         f"(the largest --batch-size that fits is {most})")
    if not lines:
        raise ConfigError(no_fit(cfg, vocab, nproc, gpu_memory, room))
    gpus = gpus_needed(cfg, vocab, usable, cfg.batch_size)
    if gpus and gpus > nproc:
        lines.append(f"  --fsdp --nproc {gpus}: {gib(step(replace(cfg, fsdp=True), n=gpus))} GiB (or more GPUs; "
                     f"--gradient-accumulation-steps must be a multiple of --nproc)")
    return [f"does not fit: {gib(step(cfg))} GiB, {room}. Each of these fits:"] + lines


def no_fit(cfg, vocab, nproc, gpu_memory, room):
    """The one line for a plan that no batch size fits on nproc GPUs, even with everything that saves memory."""
    least = replace(cfg, activation_checkpointing=True, fsdp=cfg.fsdp or nproc > 1)
    flags = "--fsdp --activation-checkpointing" if least.fsdp else "--activation-checkpointing"
    need = sum(memory(least, vocab, nproc, 1).values())
    gpus = gpus_needed(least, vocab, USABLE * gpu_memory * GIB, 1)
    what = (f"use --nproc {gpus} or more with --fsdp --activation-checkpointing" if gpus
            else "use a shorter --block-size or GPUs with more memory")
    return (f"{cfg.preset} ({cfg.residual}) does not fit on {nproc} GPU{'s' if nproc > 1 else ''} of {gpu_memory:g} GiB "
            f"at any batch size: --batch-size 1 with {flags} needs {gib(need)} of {room}; {what}")


def plan_report(cfg, nproc=1, gpu_memory=None, vocab=None):
    """The plan of cfg on nproc GPUs as text; ConfigError for bad input or a plan nothing makes fit."""
    if nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    if gpu_memory is not None and not gpu_memory > 0:
        raise ConfigError(f"--gpu-memory must be positive (GiB a GPU, e.g. 80), got {gpu_memory:g}")
    if vocab is not None and vocab < 1:
        raise ConfigError(f"--vocab-size must be at least 1, got {vocab}")
    if cfg.gradient_accumulation_steps % nproc:
        raise ConfigError(f"--gradient-accumulation-steps {cfg.gradient_accumulation_steps} must be a multiple of "
                          f"--nproc {nproc} (train.py divides the micro-steps among the GPUs)")
    vocab = vocab or vocab_size(cfg)
    lines = plan_table(cfg, vocab, nproc)
    if gpu_memory is not None:
        lines += [""] + advice(cfg, vocab, nproc, gpu_memory)
    return "\n".join(lines)
