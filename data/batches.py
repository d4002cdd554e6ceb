"""Batches: windows of a token array at starts drawn from a seeded generator, so any step's batch can be redrawn."""
import numpy as np
import torch

EVAL_SEED = 20260518  # seeds the fixed evaluation batches, the same whatever the training seed
TRAIN_BATCHES, EVAL_BATCHES, DROPOUT = 0, 1, 2  # the streams of random numbers a run draws: one tag in each key


def batch_starts(arr, block_size, count, key):
    """`count` window starts in arr, drawn by a generator seeded with `key` (a tuple of ints)."""
    return np.random.default_rng(key).integers(0, len(arr) - block_size, size=count)


def get_batch(arr, block_size, starts, device):
    """The windows of arr at `starts`: inputs x and next-token targets y, (B, T) each."""
    x = torch.from_numpy(np.stack([arr[i:i + block_size] for i in starts]).astype(np.int64))
    y = torch.from_numpy(np.stack([arr[i + 1:i + 1 + block_size] for i in starts]).astype(np.int64))
    if device.type == "cuda":  # pin arrays x,y, which allows us to move them to GPU asynchronously
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def eval_batch(ds, split, k, batch_size, block_size, device):
    """Evaluation batch k of a split: the same for every evaluation of every run, whatever the seed."""
    arr = ds.val if split == "val" else ds.train
    key = (EVAL_SEED, EVAL_BATCHES, int(split == "val"), k)  # never a training step's key (seed, TRAIN_BATCHES, step)
    return get_batch(arr, block_size, batch_starts(arr, block_size, batch_size, key), device)
