"""
Use a trained checkpoint: generate text from it, measure its validation loss, or convert a baseline into a
routed model.

    python cli.py sample --ckpt runs/cpu-delta/last.pt --prompt "Sampson."
    python cli.py eval --ckpt runs/cpu-delta/last.pt
    python cli.py convert --ckpt runs/base/last.pt --residual delta --out runs/base/delta.pt

Generation uses the KV cache and decodes with the tokenizer the checkpoint records, so it needs no
dataset; evaluation uses the same fixed validation batches as training (20 by default, as training).
"""
import sys
from pathlib import Path

import torch

import data
from delta_gpt import RESIDUALS
from errors import ConfigError
from train import estimate_loss
from plumbing.checkpoint import (checkpoint_dataset, checkpoint_dict, load_checkpoint, load_model,
                                  model_from_checkpoint, save_checkpoint)
from plumbing.config import as_typed, at_least_one
from plumbing.rundir import refuse_to_replace

EVAL_ITERS = 20  # fixed validation batches: the same default as training's evaluation


def read_prompt(prompt=None, prompt_file=None, default="\n"):
    """The start text: --prompt, or the contents of --prompt-file (UTF-8), or `default`."""
    if prompt is not None and prompt_file is not None:
        raise ConfigError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            said = "is a folder" if path.is_dir() else "does not exist"
            raise ConfigError(f"prompt file {path} {said}; give a UTF-8 text file")
        try:
            prompt = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"prompt file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                              f"{e.start}); save it as UTF-8") from None
    if prompt is None:
        prompt = default
    if prompt == "":
        raise ConfigError("the prompt is empty; give at least one character")
    return prompt


def generate_text(ckpt_path, prompt=None, prompt_file=None, num_samples=3, max_new_tokens=300, temperature=0.8,
                  top_k=None, seed=1337, device="cpu"):
    """Yield a header line (the checkpoint's step and val loss, the seed), then `num_samples` texts (prompt and continuation)."""
    at_least_one(max_new_tokens=max_new_tokens, num_samples=num_samples)
    if temperature < 0:
        raise ConfigError(f"--temperature must be at least 0 (0 is greedy), got {temperature}")
    model, ckpt = load_model(ckpt_path, device)
    saved = ckpt.get("dataset") or {}
    if not saved.get("tokenizer"):
        raise ConfigError(f"{ckpt_path} does not record its tokenizer; it was not written by delta-gpt's train.py")
    tok = data.get_tokenizer(saved)
    prompt = read_prompt(prompt, prompt_file, "\n" if tok.name == "char" else "<|endoftext|>")
    if top_k is not None and not 1 <= top_k <= tok.vocab_size:
        raise ConfigError(f"--top-k must be between 1 and the vocabulary size {tok.vocab_size}, got {top_k}")
    step, best = ckpt.get("iter_num"), ckpt.get("best_val_loss")
    yield (f"{ckpt_path}: step {step}" + (f", best val loss {best:.4f}" if isinstance(best, float) and best < float("inf")
                                          else "") + f"; seed {seed} (the same seed draws the same samples; --seed N for others)")
    ids = tok.encode(prompt)
    block_size = model.config.block_size
    if len(ids) > block_size:
        print(f"note: the prompt is {len(ids)} tokens, longer than the model's context of {block_size}; the model "
              f"sees its last {block_size} (the whole prompt is printed)", file=sys.stderr)
    x = torch.tensor(ids[-block_size:], dtype=torch.long, device=model.lm_head.weight.device)[None]  # (1, T)
    torch.manual_seed(seed)
    for _ in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k or min(200, tok.vocab_size))
        yield tok.decode(ids + y[0, x.size(1):].tolist())  # the whole prompt, then the new tokens


def evaluate_checkpoint(ckpt_path, dataset=None, eval_iters=EVAL_ITERS, batch_size=12, data_dir=None, device="cpu"):
    """(dataset name, mean validation loss, block_size) of a checkpoint on the fixed validation batches."""
    at_least_one(eval_iters=eval_iters, batch_size=batch_size)
    model, ckpt = load_model(ckpt_path, device)
    ds = checkpoint_dataset(ckpt, ckpt_path, dataset=dataset, data_dir=data_dir)
    loss = estimate_loss(model, ds, "val", eval_iters, batch_size, progress=True)
    return ds.name, loss, model.config.block_size


def convert_checkpoint(src, out, residual, n_route_blocks=None, route_partial=None, eval_iters=EVAL_ITERS,
                       batch_size=12, data_dir=None, force=False, route_heads=None):
    """A routed checkpoint at `out` from the baseline checkpoint `src`, routing at zero init.
    Returns (val loss before, val loss after, the routed model's config)."""
    at_least_one(eval_iters=eval_iters, batch_size=batch_size)
    refuse_to_replace(out, force, inputs=[src])
    routed_modes = [m for m in RESIDUALS if m != "baseline"]
    if residual not in routed_modes:
        raise ConfigError(f"--residual {residual!r} is not a routed mode; choose {', '.join(routed_modes)}")
    ckpt = load_checkpoint(src)
    if ckpt["model_config"]["residual"] != "baseline":
        raise ConfigError(f"{src} is already a {ckpt['model_config']['residual']} model; "
                          f"convert starts from a baseline checkpoint")
    route = dict(residual=residual, n_route_blocks=n_route_blocks, route_partial=route_partial, route_heads=route_heads)
    try:
        routed = model_from_checkpoint(ckpt, **route).eval()
    except ConfigError as e:  # a routing option the model refuses, in command-line words
        raise ConfigError(as_typed(str(e))) from None
    base = model_from_checkpoint(ckpt).eval()
    ds = checkpoint_dataset(ckpt, src, data_dir=data_dir)
    before = estimate_loss(base, ds, "val", eval_iters, batch_size, progress=True)
    after = estimate_loss(routed, ds, "val", eval_iters, batch_size, progress=True)
    config = dict(ckpt["config"], **{k: getattr(routed.config, k) for k in route}, init_from=str(src))
    save_checkpoint(checkpoint_dict(routed.state_dict(), routed.config, config, 0, after, ckpt.get("dataset"),
                                    converted_from=str(src)), out)
    return before, after, routed.config
