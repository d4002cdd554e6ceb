"""
Use a trained checkpoint: generate text from it, or measure its validation loss.

    python cli.py sample --ckpt runs/cpu-delta/last.pt --prompt "Sampson."
    python cli.py eval --ckpt runs/cpu-delta/last.pt

Generation uses the KV cache and decodes with the tokenizer the checkpoint records, so it needs no
dataset; evaluation uses the same fixed validation batches as training.
"""
import sys
from pathlib import Path

import torch

import data
import train as T


def load_model(ckpt_path, device="cpu"):
    """(model in eval mode on `device`, checkpoint dict); the device is checked before the file is read."""
    device = T.checked_device(device)
    ckpt = T.load_checkpoint(ckpt_path, map_location=device)
    return T.model_from_checkpoint(ckpt).to(device).eval(), ckpt


def read_prompt(prompt=None, prompt_file=None, default="\n"):
    """The start text: --prompt, or the contents of --prompt-file (UTF-8), or `default`."""
    if prompt is not None and prompt_file is not None:
        raise T.ConfigError("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        path = Path(prompt_file)
        if not path.is_file():
            said = "is a folder" if path.is_dir() else "does not exist"
            raise T.ConfigError(f"prompt file {path} {said}; give a UTF-8 text file")
        try:
            prompt = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise T.ConfigError(f"prompt file {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset "
                                f"{e.start}); save it as UTF-8") from None
    if prompt is None:
        prompt = default
    if prompt == "":
        raise T.ConfigError("the prompt is empty; give at least one character")
    return prompt


def generate_text(ckpt_path, prompt=None, prompt_file=None, num_samples=3, max_new_tokens=300, temperature=0.8,
                  top_k=None, seed=1337, device="cpu"):
    """Yield `num_samples` texts (the prompt and its continuation) from a checkpoint."""
    T.at_least_one(max_new_tokens=max_new_tokens, num_samples=num_samples)
    if temperature < 0:
        raise T.ConfigError(f"--temperature must be at least 0 (0 is greedy), got {temperature}")
    model, ckpt = load_model(ckpt_path, device)
    saved = ckpt.get("dataset") or {}
    if not saved.get("tokenizer"):
        raise T.ConfigError(f"{ckpt_path} does not record its tokenizer; it was not written by delta-gpt's train.py")
    tok = data.get_tokenizer(saved)
    prompt = read_prompt(prompt, prompt_file, "\n" if tok.name == "char" else "<|endoftext|>")
    if top_k is not None and not 1 <= top_k <= tok.vocab_size:
        raise T.ConfigError(f"--top-k must be between 1 and the vocabulary size {tok.vocab_size}, got {top_k}")
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


def evaluate_checkpoint(ckpt_path, dataset=None, eval_iters=50, batch_size=12, data_dir=None, device="cpu"):
    """(dataset name, mean validation loss, block_size) of a checkpoint on the fixed validation batches."""
    T.at_least_one(eval_iters=eval_iters, batch_size=batch_size)
    model, ckpt = load_model(ckpt_path, device)
    ds = T.checkpoint_dataset(ckpt, ckpt_path, dataset=dataset, data_dir=data_dir)
    loss = T.estimate_loss(model, ds, "val", eval_iters, batch_size, progress=True)
    return ds.name, loss, model.config.block_size
