"""
Training script for delta-gpt, in nanoGPT's shape: the knobs, a few helpers, then train(), one
narrative from setup to the loop, and last the command line that builds a TrainConfig. One process
on CPU, CUDA or MPS, or several under torchrun with DDP (each holds the whole model) or FSDP2
(--fsdp: parameters, gradients and optimizer state sharded).

    python train.py --residual delta  # the `cpu` preset where there is no CUDA
    python train.py --out-dir runs/cpu-delta --resume --max-iters 4000  # continue, bit-exact on CPU
    torchrun --standalone --nproc_per_node=8 train.py --preset gpt2_124m --residual delta
    torchrun --standalone --nproc_per_node=8 train.py --preset paper_1b --residual delta --fsdp

`python cli.py train ...` takes the same options: every TrainConfig field (--max-iters or
--max_iters; --compile / --no-compile for flags). The plumbing (option checks, checkpoints, the
run directory, FSDP, process settings) lives in plumbing/, below this file, each piece called once
from here.
"""
import math
import os
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Optional

import numpy as np
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm import tqdm

from data import DROPOUT, TRAIN_BATCHES, batch_starts, eval_batch, get_batch
import data
from errors import DeltaGPTError, TrainError
from plumbing import run_config
from plumbing.checkpoint import (checkpoint_dict, dataset_info, resume_checkpoint, rng_state,
                                 save_checkpoint, start_model, start_optimizer)
from plumbing.config import MODEL_FIELDS, check_config, mode_label, out_dir_of, train_help
from plumbing.distributed import full_state, process_group, root_gathered
from plumbing.routing_stats import routing_stats
from plumbing.rundir import (Progress, RunLock, RunRecord, StopFlag, check_folder, check_same_data,
                             claim_run_dir)
from plumbing.system import apply_process_settings, check_memory, end_torchrun_process, precision

# -----------------------------------------------------------------------------
# the knobs: every field is an option of `python train.py` and `python cli.py train`
# (--help lists them)

def option(default, help):
    return field(default=default, metadata={"help": help})  # the help both command lines show


@dataclass
class TrainConfig:
    preset: str = option("cpu", "the preset these values started from "
                                "(recorded; --preset chooses it)")
    out_dir: Optional[str] = option(None, "run directory for checkpoints and metrics "
                                          "(default runs/PRESET-RESIDUAL)")
    dataset: str = option("shakespeare_char", "a prepared dataset under data_dir "
                                              "(see `python cli.py prepare`)")
    data_dir: Optional[str] = option(None, "where datasets live (default: the data/ folder)")
    # model
    residual: str = option("baseline", "baseline | attnres | delta | delta_block")
    n_layer: int = option(4, "transformer layers (2 sublayers each)")
    n_head: int = option(4, "attention heads")
    n_embd: int = option(128, "model width")
    block_size: int = option(64, "context length in tokens")
    dropout: float = option(0.0, "dropout in attention, residual and embeddings")
    bias: bool = option(False, "bias in Linear and LayerNorm layers")
    n_route_blocks: Optional[int] = option(None, "routing blocks N "
                                                 "(must divide 2*n_layer; default per mode)")
    route_partial: Optional[bool] = option(None, "also route the current block's partial sum "
                                                 "(delta_block)")
    route_sources: Optional[str] = option(None, "delta (block sums) or "
                                                "cumulative (stream snapshots)")
    route_weights: Optional[str] = option(None, "dynamic (per token, from the sources) or static "
                                                "(one learned weight per source: the control)")
    route_heads: Optional[int] = option(None, "H routing heads: each of H channel groups "
                                              "is routed apart (multi-head routing; default 1)")
    fast_routing: bool = option(True, "route with the fast path (delta_gpt.py's last section); "
                                      "off: Router and Stream as written (the cpu preset's "
                                      "default, so that what a student edits runs)")
    init_from: str = option("scratch", "scratch, a checkpoint path (any mode of the same shape: "
                                       "its weights, its routing if it routes the same way), "
                                       "or gpt2 / gpt2-medium / ...")
    # optimisation
    batch_size: int = option(12, "sequences per micro-step per rank")
    gradient_accumulation_steps: int = option(1, "micro-steps per step, over all ranks "
                                                 "(divided among them)")
    max_iters: int = option(2000, "total optimizer steps")
    learning_rate: float = option(1e-3, "peak learning rate")
    min_lr: float = option(1e-4, "final learning rate of the cosine decay")
    warmup_iters: int = option(100, "linear warmup steps")
    lr_decay_iters: Optional[int] = option(None, "cosine decay length in steps (default max_iters)")
    decay_lr: bool = option(True, "warmup + cosine decay; off: constant learning_rate")
    weight_decay: float = option(0.1, "AdamW weight decay of 2-D weights")
    beta1: float = option(0.9, "AdamW beta1")
    beta2: float = option(0.99, "AdamW beta2")
    grad_clip: float = option(1.0, "clip gradients at this global norm; 0 disables")
    route_lr_mult: float = option(1.0, "learning-rate multiplier of the routing queries and gains")
    seed: int = option(1337, "seeds batches, dropout and init")
    # evaluation, logging, checkpoints
    eval_interval: int = option(250, "evaluate every this many steps")
    eval_iters: int = option(20, "fixed batches per evaluation (each split)")
    log_interval: int = option(10, "write a metrics line (and, without a terminal, "
                                   "a progress line) every this many steps")
    ckpt_interval: int = option(250, "write last.pt every this many steps")
    eval_only: bool = option(False, "evaluate once and exit")
    resume: bool = option(False, "continue from out_dir/last.pt")
    overwrite: bool = option(False, "start afresh even if out_dir holds a run "
                                    "(its checkpoints are deleted)")
    progress: bool = option(True, "show a progress bar "
                                  "(a plain line every log_interval steps without a terminal)")
    # system
    device: str = option("auto", "auto (cuda, then mps, then cpu), or cpu, cuda, cuda:1, mps")
    dtype: str = option("auto", "auto (bfloat16 on CUDA where supported, else float16; "
                                "float32 on CPU/MPS), float32, bfloat16, float16")
    compile: Optional[bool] = option(None, "torch.compile the model "
                                           "(default: on for CUDA, off elsewhere)")
    threads: Optional[int] = option(None, "CPU threads for torch "
                                          "(default: the free cores, so a busy machine gets fewer)")
    keep_freed_memory: bool = option(True, "CPU: malloc keeps freed memory for the next step "
                                           "(no page faults each step)")
    memory_check: bool = option(True, "CPU: refuse a run whose activations alone "
                                      "would exceed this machine's memory")
    fsdp: bool = option(False, "shard parameters, gradients and optimizer state "
                               "over the processes with FSDP2")
    activation_checkpointing: bool = option(False, "recompute each attention and MLP in backward "
                                                   "(less activation memory)")
    wandb_project: Optional[str] = option(None, "also log the metrics to this Weights & Biases "
                                                "project (needs the wandb package)")
    wandb_run_name: Optional[str] = option(None, "the W&B run's name "
                                                 "(default: the run directory's name)")


PAPER = dict(dataset="fineweb_edu", block_size=2048, max_iters=10000, learning_rate=6e-4,
             min_lr=6e-5, warmup_iters=1000, beta2=0.95, eval_interval=500, eval_iters=100,
             ckpt_interval=500)  # the paper's recipe
PRESETS = {
    # nanoGPT's CPU recipe: a few minutes on 2 cores, where a class trains:
    # on the routing code it reads
    "cpu": dict(fast_routing=False),
    # nanoGPT's shakespeare_char GPU recipe (6 layers, 6 heads, 384 wide, context 256)
    "shakespeare_char": dict(n_layer=6, n_head=6, n_embd=384, block_size=256, dropout=0.2,
                             batch_size=64, max_iters=5000, eval_iters=200, log_interval=10,
                             ckpt_interval=500),
    # GPT-2 small on FineWeb-Edu, nanoGPT's train_gpt2 recipe (about 0.5M tokens per step)
    "gpt2_124m": dict(dataset="fineweb_edu", n_layer=12, n_head=12, n_embd=768, block_size=1024,
                      batch_size=12, gradient_accumulation_steps=40, max_iters=600000,
                      learning_rate=6e-4, min_lr=6e-5, warmup_iters=2000, beta2=0.95,
                      eval_interval=1000, eval_iters=200, ckpt_interval=1000),
    # the paper's sizes in its recipe: seq 2048, 10K steps, 6e-4 -> 6e-5 cosine, warmup 1000,
    # AdamW (0.9, 0.95), weight decay 0.1; 256 sequences (0.5M tokens) per step;
    # head size 64 (128 at 7B)
    "paper_220m": dict(PAPER, n_layer=12, n_head=12, n_embd=768, batch_size=8,
                       gradient_accumulation_steps=32),
    "paper_533m": dict(PAPER, n_layer=24, n_head=16, n_embd=1024, batch_size=8,
                       gradient_accumulation_steps=32),
    "paper_1b": dict(PAPER, n_layer=36, n_head=20, n_embd=1280, batch_size=8,
                     gradient_accumulation_steps=32),
    "paper_7b": dict(PAPER, n_layer=36, n_head=32, n_embd=4096, batch_size=8,
                     gradient_accumulation_steps=32, fsdp=True, activation_checkpointing=True),
}


# -----------------------------------------------------------------------------
# helpers the loop uses: learning rate, evaluation, seeds, the step's guards

def get_lr(it, cfg):
    """Linear warmup, then cosine decay from learning_rate to min_lr over lr_decay_iters steps."""
    decay_iters = cfg.lr_decay_iters or cfg.max_iters
    if not cfg.decay_lr:
        return cfg.learning_rate
    if it < cfg.warmup_iters:
        return cfg.learning_rate * (it + 1) / (cfg.warmup_iters + 1)
    if it > decay_iters:
        return cfg.min_lr
    decay_ratio = (it - cfg.warmup_iters) / max(1, decay_iters - cfg.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) # coeff ranges 0..1
    return cfg.min_lr + coeff * (cfg.learning_rate - cfg.min_lr)


SILENT_S = 60  # an evaluation that would sit silent longer than this says how long it takes


@torch.no_grad()
def estimate_loss(model, ds, split, eval_iters, batch_size, ctx=nullcontext(), progress=False):
    """Mean loss over the first eval_iters fixed evaluation batches of a split (the same for every
    run). With progress: a bar on a terminal, and a note when the batches are slow enough that it
    would sit silent."""
    device, training = next(model.parameters()).device, model.training
    model.eval()
    losses, t0 = [], time.time()
    for k in tqdm(range(eval_iters), desc=f"{split} loss", disable=None if progress else True,
                  leave=False):
        X, Y = eval_batch(ds, split, k, batch_size, model.config.block_size, device)
        with ctx:
            losses.append(model(X, Y)[1].item())
        if progress and k == 0 and (time.time() - t0) * eval_iters > SILENT_S:
            print(f"note: one {split} batch took {time.time() - t0:.0f} s: "
                  f"this split's loss takes about {(time.time() - t0) * eval_iters / 60:.0f} min "
                  f"({eval_iters} batches, --eval-iters)", flush=True)
    model.train(training)
    return sum(losses) / len(losses)


def evaluate_model(model, ds, cfg, ctx, device, master):
    """Both splits' mean loss on the fixed eval batches,
    and routing statistics on the first val batch."""
    show = master and cfg.progress
    out = {split: estimate_loss(model, ds, split, cfg.eval_iters, cfg.batch_size, ctx, show)
           for split in ("train", "val")}
    if cfg.residual != "baseline":
        X, _ = eval_batch(ds, "val", 0, cfg.batch_size, cfg.block_size, device)
        model.eval()
        with root_gathered(model, cfg.fsdp), ctx:
            out["routing"] = routing_stats(model, X)
        model.train()
    return out


def derive_seed(*key):
    """A 63-bit seed from a tuple of ints (numpy's SeedSequence mixes them)."""
    return int(np.random.SeedSequence(key).generate_state(2, np.uint64)[0] >> np.uint64(1))


def eval_line(step, losses):
    """'step N: train loss ..., val loss ...', and the routing's max weight where it has one."""
    line = f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}"
    sharpness = losses.get("routing", {}).get("mean_max_weight", math.nan)  # NaN: one source each
    return line + (f", routing max weight {sharpness:.3f}" if math.isfinite(sharpness) else "")


def check_step(step, loss, norm, stop, scaler, checkpoint, out_dir, saved_at, bar):
    """The step's guards, on one host sync: every rank learns the step's mean loss (returned) and
    whether any rank was signalled to stop. A signal writes last.pt as it was before this step
    (resuming redoes it) and ends the run; a non-finite loss, or gradient norm (which fp16's scaler
    skips by itself), ends it before the step is applied. bar: the progress bar, closed before the
    message."""
    stats = torch.stack([loss, torch.tensor(float(stop.signal is not None), device=loss.device)])
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(stats)
        stats[0] /= torch.distributed.get_world_size()
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP: a sharded norm
    loss, stop_now, grad_norm = torch.cat([stats, norm.detach().view(1).to(stats)]).tolist()
    last = out_dir / "last.pt"
    if stop_now > 0:
        checkpoint(last)
        message = (f"stopped by signal at step {step}; checkpoint {last} written "
                   f"(continue with --resume)")
        bar.close()
        bar.write(message)
        raise KeyboardInterrupt(message)
    if math.isfinite(loss) and (math.isfinite(grad_norm) or scaler.is_enabled()):
        return loss
    what = (f"loss is {loss} at step {step}" if not math.isfinite(loss)
            else f"gradient norm is {grad_norm} at step {step} (loss {loss:.4f})")
    kept = (f"{last} still holds step {saved_at}" if saved_at is not None
            else "no checkpoint was written yet")
    raise TrainError(f"{what}; stopped without applying it, {kept} "
                     f"(lower --learning-rate or check the data)")


# -----------------------------------------------------------------------------
# train(): setup, then the loop

def train(cfg):
    """Train as configured; returns a summary dict (rank 0). Bad input or a run that cannot go on
    raises a DeltaGPTError."""
    check_config(cfg)
    cfg = replace(cfg, out_dir=out_dir_of(cfg))
    out_dir = Path(cfg.out_dir)
    check_folder(out_dir, "--out-dir")
    with ExitStack() as run:  # each piece of the run closed however it ends, in reverse order
        # one process or torchrun's, and a lock on the run directory: a run that fails before its
        # first step leaves the folder as it found it
        rank, world_size, device = run.enter_context(process_group(cfg))
        lock = run.enter_context(RunLock(out_dir, rank == 0 and not cfg.eval_only))
        master = rank == 0  # rank 0 writes checkpoints, metrics and the log
        accum = cfg.gradient_accumulation_steps // world_size  # micro-steps per rank
        tokens_per_iter = accum * world_size * cfg.batch_size * cfg.block_size
        check_memory(cfg, device, world_size)  # a run far past this machine's memory: refused now

        # setup 1, the run folder and the data: the run's last.pt (--resume), or the folder claimed
        ckpt, changed = (resume_checkpoint(cfg, master) if cfg.resume
                         else claim_run_dir(cfg, master, lock))
        torch.manual_seed(cfg.seed + rank)
        dtype, ctx, scaler = precision(cfg, device, master)
        ds = data.load_or_prepare(cfg.dataset, data_dir=cfg.data_dir, block_size=cfg.block_size)
        if cfg.resume:
            check_same_data(out_dir, ds.meta, "prepare it again from the text the run began on, or "
                                              "start a new run (--overwrite, or another --out-dir)")

        # setup 2, the model and the optimizer: built, or restored (plumbing/checkpoint.py)
        model, iter_num, best_val_loss = start_model(cfg, ckpt, ds, rank, device, dtype, master)
        cfg = replace(cfg, **{k: getattr(model.config, k) for k in MODEL_FIELDS})  # GPT-2's shape
        optimizer, elapsed, cpu_elapsed = start_optimizer(model, cfg, ckpt, scaler, rank, device)
        raw_model = model  # the plain GPT: its state_dict, evaluation and statistics
        compiled = cfg.compile if cfg.compile is not None else device.type == "cuda"
        if compiled:
            model = torch.compile(model)
        ddp = world_size > 1 and not cfg.fsdp  # FSDP's model is already sharded
        if ddp:
            model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)

        if cfg.eval_only:  # evaluate the model once, write nothing
            losses = evaluate_model(raw_model, ds, cfg, ctx, device, master)
            if master:
                print(f"step {iter_num}: train loss {losses['train']:.4f}, val loss "
                      f"{losses['val']:.4f} (each the mean of {cfg.eval_iters} fixed batches)")
            return dict(val_loss=losses["val"], train_loss=losses["train"], iter_num=iter_num)

        # setup 3, the record: metrics.jsonl (and W&B), the progress bar, SIGINT/SIGTERM as a flag
        resumed_at = iter_num if cfg.resume else None  # the step last.pt holds, evaluated and saved
        record = run.enter_context(RunRecord(out_dir, master, resume_step=resumed_at))
        bar = run.enter_context(Progress(cfg, master, iter_num))
        stop = run.enter_context(StopFlag(master, lock.quit_now))
        t_start = time.time() - elapsed  # wall time counts on across resumes,
        cpu_start = time.process_time() - cpu_elapsed  # and CPU time (another job moves it less)

        def checkpoint(path):
            """The run's state, written atomically by rank 0 (under FSDP all ranks gather it)."""
            model_state, optim_state = full_state(raw_model, optimizer, cfg.fsdp, master)
            if master:
                save_checkpoint(checkpoint_dict(
                    model_state, raw_model.config, asdict(cfg), iter_num, best_val_loss,
                    dataset_info(ds.meta, cfg.dataset), optimizer=optim_state,
                    scaler=scaler.state_dict(), rng=rng_state(), elapsed=time.time() - t_start,
                    cpu_elapsed=time.process_time() - cpu_start, commit=record.commit), path)
            lock.started()  # a checkpoint is there: the folder holds this run

        record.write_config(cfg, raw_model, ds.meta, world_size, device, dtype, iter_num, changed)
        if master:
            print(f"{mode_label(cfg)}: {raw_model.get_num_params():,} parameters, "
                  f"{tokens_per_iter:,} tokens per step, {device} {dtype}"
                  f"{' compiled' if compiled else ''}, run directory {out_dir}; "
                  f"each loss below is the mean of {cfg.eval_iters} fixed batches of its split")
            if cfg.resume:
                print(f"resuming at step {iter_num} from {out_dir / 'last.pt'}")
        saved_at = resumed_at  # the step last.pt holds
        loss, val_loss, tok_s, mfu = float("nan"), None, None, None
        # max_iters + 1 passes: the last one only evaluates and checkpoints the final model
        while True:

            # evaluate every eval_interval steps and at the end, save every ckpt_interval steps and
            # at the end; a resumed run's first step was evaluated and saved before it stopped
            if ((iter_num % cfg.eval_interval == 0 or iter_num == cfg.max_iters)
                    and iter_num != resumed_at):
                losses = evaluate_model(raw_model, ds, cfg, ctx, device, master)
                val_loss = losses["val"]
                record.log(kind="eval", step=iter_num, train_loss=losses["train"],
                           val_loss=val_loss, elapsed=time.time() - t_start,
                           cpu_s=time.process_time() - cpu_start, routing=losses.get("routing"))
                bar.write(eval_line(iter_num, losses))
                improved, best_val_loss = val_loss < best_val_loss, min(best_val_loss, val_loss)
                if improved and iter_num > 0:  # best.pt keeps the best model past step 0
                    checkpoint(out_dir / "best.pt")
            if ((iter_num % cfg.ckpt_interval == 0 and iter_num > 0 or iter_num == cfg.max_iters)
                    and iter_num != resumed_at):  # a fresh run's step 0 is saved only as its end
                checkpoint(out_dir / "last.pt")
                saved_at = iter_num
            if iter_num >= cfg.max_iters:
                break

            # determine and set the learning rate for this iteration
            lr = get_lr(iter_num, cfg)
            for group in optimizer.param_groups:
                group["lr"] = lr * group["lr_mult"]
            t0 = time.time()
            # ---------------- TRAINING STEP BEGIN ----------------
            # batches and dropout from (seed, step): a resumed run, any world size, draw the same
            torch.manual_seed(derive_seed(cfg.seed, DROPOUT, iter_num, rank))
            starts = batch_starts(ds.train, cfg.block_size, cfg.batch_size * accum * world_size,
                                  (cfg.seed, TRAIN_BATCHES, iter_num))
            loss_sum = torch.zeros((), device=device)
            # forward backward update, with gradient accumulation to simulate a larger batch size
            for micro in range(accum):
                part = (rank * accum + micro) * cfg.batch_size  # rank r, micro-step m: r*accum+m
                X, Y = get_batch(ds.train, cfg.block_size, starts[part:part + cfg.batch_size],
                                 device)
                # sync gradients on the last micro-step only (nanoGPT's way, not no_sync())
                if ddp:
                    model.require_backward_grad_sync = micro == accum - 1
                if cfg.fsdp:
                    raw_model.set_requires_gradient_sync(micro == accum - 1)
                with ctx:
                    _, micro_loss = model(X, Y)
                loss_sum += micro_loss.detach()
                # backward pass, with gradient scaling if training in fp16
                scaler.scale(micro_loss / accum).backward()
            # clip the gradient
            scaler.unscale_(optimizer)
            norm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip or math.inf)
            # the guards: a signal, a non-finite loss or gradient ends the run before the update
            loss = check_step(iter_num, loss_sum / accum, norm, stop, scaler, checkpoint, out_dir,
                              saved_at, bar)
            # step the optimizer and scaler if training in fp16
            scaler.step(optimizer)
            scaler.update()
            # flush the gradients as soon as we can, no need for this memory anymore
            optimizer.zero_grad(set_to_none=True)
            # ---------------- TRAINING STEP END ----------------

            # timing and logging
            iter_num += 1
            lock.started()  # a step is done: from here a failure keeps the run's files
            dt = time.time() - t0
            tok_s = tokens_per_iter / dt
            if iter_num % cfg.log_interval == 0:
                mfu = raw_model.estimate_mfu(cfg.batch_size * accum, dt, device) if master else None
                record.log(kind="train", step=iter_num, train_loss=loss, lr=lr, tokens_per_s=tok_s,
                           elapsed=time.time() - t_start, mfu=mfu)
            bar.step(iter_num, loss, lr, tok_s, mfu)
        return dict(val_loss=val_loss, best_val_loss=best_val_loss, train_loss=loss,
                    iter_num=iter_num, elapsed=time.time() - t_start, tokens_per_s=tok_s,
                    out_dir=cfg.out_dir, params=raw_model.get_num_params())


# -----------------------------------------------------------------------------
# the command line: `python train.py --residual delta ...`;
# cli.py, compare and studies build their configs here too

# the config builders (plumbing/run_config.py) bound to these knobs
make_config = partial(run_config.make_config, TrainConfig, PRESETS)
resume_config = partial(run_config.resume_config, TrainConfig, PRESETS)
config_from_args = partial(run_config.config_from_args, TrainConfig, PRESETS)


def main(argv=None):
    """`python train.py ...` and `python cli.py train ...`: parse the options, train, say how it
    ended; bad input becomes one line and exit status 1, an interrupted run exits 130."""
    argv = sys.argv[1:] if argv is None else argv
    if "-h" in argv or "--help" in argv:
        print("usage: python train.py [--preset P] [--FIELD VALUE ...]   "
              "(or python cli.py train ...)\n")
        print(train_help(TrainConfig, PRESETS).replace("\b\n", ""))
        return
    try:
        cfg = config_from_args(argv)
        apply_process_settings(cfg)
        summary = train(cfg)
    except KeyboardInterrupt:
        sys.exit(130)
    except DeltaGPTError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    if summary.get("val_loss") is not None and int(os.environ.get("RANK", 0)) == 0:
        where = ("evaluated only, nothing written" if cfg.eval_only
                 else f"checkpoints in {out_dir_of(cfg)}")
        print(f"done: val loss {summary['val_loss']:.4f} "
              f"(perplexity {math.exp(summary['val_loss']):.2f}, the mean of {cfg.eval_iters} "
              f"fixed batches) after {summary['iter_num']} steps; {where}")
    end_torchrun_process()


if __name__ == "__main__":
    main()
