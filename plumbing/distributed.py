"""Past one process: the process group (torchrun, or FSDP in one process), FSDP2 sharding, and the whole
model's and optimizer's state gathered into (and scattered from) the one-file checkpoint format."""
import contextlib
import os

import torch
from torch.distributed import destroy_process_group, init_process_group

import data
from delta_gpt import GPT
from errors import ConfigError
from plumbing.system import pick_device


@contextlib.contextmanager
def process_group(cfg):
    """(rank, world_size, device): one process, or one of torchrun's (one GPU each on CUDA)."""
    torchrun = int(os.environ.get("RANK", -1)) != -1
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if torchrun else 1
    if cfg.gradient_accumulation_steps % world_size:
        raise ConfigError(f"--gradient-accumulation-steps {cfg.gradient_accumulation_steps} must be a "
                          f"multiple of the number of processes {world_size}")
    if not torchrun and not cfg.fsdp:
        yield 0, 1, pick_device(cfg)
        return
    rank, device = int(os.environ.get("RANK", 0)), pick_device(cfg)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    backend = "nccl" if device.type == "cuda" else "gloo"
    if torchrun:
        init_process_group(backend=backend)
    else:  # FSDP in one process: a process group of one, with an in-memory store
        init_process_group(backend=backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        if rank == 0:  # prepares the default dataset once, before the other ranks read it
            data.load_or_prepare(cfg.dataset, data_dir=cfg.data_dir, block_size=cfg.block_size)
        torch.distributed.barrier()
        yield rank, world_size, device
        torch.distributed.barrier()  # every rank done (rank 0 may still be writing) before the group goes away
    finally:
        destroy_process_group()


def shard(model, iter_num, best_val_loss, rank, device, dtype, recompute):
    """FSDP2: every rank builds rank 0's model (built on the CPU) on the meta device, shards it and takes its shards.
    Each attention and MLP is a group; the root holds embeddings, LayerNorms, lm_head and the routers (read together)."""
    from torch.distributed.checkpoint.state_dict import set_model_state_dict
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    full, box = {}, [None]
    if rank == 0:
        full, box = model.state_dict(), [(model.config, iter_num, best_val_loss)]
    torch.distributed.broadcast_object_list(box, src=0)
    config, iter_num, best_val_loss = box[0]
    with torch.device("meta"):
        model = GPT(config)
    for block in model.transformer.h:
        block.recompute = recompute
    mixed = device.type == "cuda" and dtype == "bfloat16"
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    for block in model.transformer.h:
        fully_shard(block.attn, mp_policy=policy)
        fully_shard(block.mlp, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    model.to_empty(device=device)
    set_model_state_dict(model, full, options=full_state_options(broadcast_from_rank0=True))
    return model, iter_num, best_val_loss


def full_state_options(**kw):
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(full_state_dict=True, **kw)


def full_state(model, optimizer, fsdp, master):
    """(model state_dict, optimizer state_dict) in the one-process format; under FSDP every rank gathers, rank 0 receives."""
    if not fsdp:
        return model.state_dict(), optimizer.state_dict()
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    options = full_state_options(cpu_offload=True)
    model_state = get_model_state_dict(model, options=options)
    optim_state = get_optimizer_state_dict(model, optimizer, options=options)
    return model_state, by_index(optim_state, optimizer_names(model, optimizer)) if master else None


def load_optimizer_state(model, optimizer, state, fsdp, rank):
    """A one-process optimizer state_dict into the optimizer; under FSDP rank 0's is sent to every rank's shards."""
    if not fsdp:
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict
    state = by_name(state, optimizer_names(model, optimizer)) if rank == 0 else {}
    set_optimizer_state_dict(model, optimizer, state, options=full_state_options(broadcast_from_rank0=True))


def optimizer_names(model, optimizer):
    """The parameter names in the optimizer's order: what a plain optimizer state_dict numbers 0, 1, ..."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def by_index(state, names):
    """An optimizer state_dict keyed by parameter name (torch.distributed.checkpoint's) -> keyed by index."""
    index = {n: i for i, n in enumerate(names)}
    return dict(state={index[n]: s for n, s in state["state"].items()},
                param_groups=[dict(g, params=[index[n] for n in g["params"]]) for g in state["param_groups"]])


def by_name(state, names):
    """An optimizer state_dict keyed by index (a plain one's) -> keyed by parameter name."""
    return dict(state={names[i]: s for i, s in state["state"].items()},
                param_groups=[dict(g, params=[names[i] for i in g["params"]]) for g in state["param_groups"]])


@contextlib.contextmanager
def root_gathered(model, fsdp):
    """The root FSDP group's parameters gathered for a pass that does not enter through GPT.forward (GPT.hidden)."""
    if not fsdp:
        yield
        return
    model.unshard()
    try:
        yield
    finally:
        model.reshard()
