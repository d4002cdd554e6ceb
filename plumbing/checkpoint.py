"""Checkpoints: plain dicts (weights, GPTConfig, TrainConfig, step, optimizer, RNG), written atomically and
read with weights_only=True, so a crash never leaves half a file and loading never runs pickled code; and the
model and optimizer a run starts from, built afresh or restored (start_model, start_optimizer)."""
import os
import pickle
from dataclasses import asdict
from pathlib import Path

import torch

import data
from delta_gpt import GPT, GPT2_MODELS, is_routing_key
from errors import ConfigError, TrainError
from plumbing.config import ARCH_FIELDS, ROUTE_FIELDS, gpt_config, model_config, with_model_defaults
from plumbing.distributed import load_optimizer_state, shard
from plumbing.rundir import why_no_checkpoint
from plumbing.system import checked_device


def save_checkpoint(obj, path):
    """torch.save to a temporary file in the same folder, then rename: a crash leaves the old file whole."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def load_checkpoint(path, map_location="cpu", mmap=False):
    """A checkpoint dict, or one clear TrainError saying what is wrong with the file."""
    path = Path(path)
    if path.is_dir():
        raise TrainError(f"{path} is a folder, not a checkpoint file; give a file such as {path / 'last.pt'}")
    if not path.is_file():
        raise TrainError(why_no_checkpoint(path))
    try:
        ckpt = torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
    except Exception as e:  # truncated, corrupt, another kind of file, or pickled objects weights_only refuses
        why = ("it holds pickled Python objects, which delta-gpt never loads (weights_only=True)"
               if isinstance(e, pickle.UnpicklingError) and "Unsupported global" in str(e)
               else "torch.load cannot read it (truncated, corrupt, or not a checkpoint)")
        raise TrainError(f"checkpoint {path} is unreadable: {why}; use another checkpoint or train again") from None
    if not isinstance(ckpt, dict) or not {"model", "model_config", "config"} <= set(ckpt):
        raise TrainError(f"{path} is not a delta-gpt checkpoint (it lacks model, model_config and config)")
    return ckpt


def load_model(ckpt_path, device="cpu"):
    """(model in eval mode on `device`, checkpoint dict); the device is checked before the file is read."""
    device = checked_device(device)
    ckpt = load_checkpoint(ckpt_path, map_location=device)
    return model_from_checkpoint(ckpt).to(device).eval(), ckpt


def checkpoint_dict(model_state, model_config_, config, iter_num, best_val_loss, dataset, **extra):
    """The one layout of a checkpoint; training adds optimizer, scaler, rng, elapsed and commit, convert converted_from."""
    return dict(model=model_state, model_config=asdict(model_config_), config=config, iter_num=iter_num,
                best_val_loss=best_val_loss, dataset=dataset, **extra)


def dataset_info(meta, name):
    """What sample and report need to decode without the dataset: name, tokenizer, vocabulary."""
    return dict(name=name, tokenizer=meta.get("tokenizer"), vocab_size=meta.get("vocab_size"), chars=meta.get("chars"))


def filled(saved):
    """A checkpoint's model config with today's defaults filled in (older checkpoints lack newer fields)."""
    return asdict(gpt_config(**saved))


def routing_changed(saved, config):
    """Whether GPTConfig `config` routes otherwise than the checkpoint's model config `saved` (its routing then does not apply)."""
    saved = filled(saved)
    return any(getattr(config, k) != saved.get(k) for k in ROUTE_FIELDS)


def model_from_checkpoint(ckpt, **override):
    """The GPT stored in a checkpoint; `override` may change fields such as residual (new routing starts at zero init)."""
    config = gpt_config(**{**ckpt["model_config"], **override})
    model = GPT(config)
    state = {k.removeprefix("_orig_mod."): v for k, v in ckpt["model"].items()}  # nanoGPT's compiled-model prefix
    # static logits were (n,) for one head before they were (H, n) for every H
    state = {k: v[None] if k.endswith("_router.logits") and v.dim() == 1 else v for k, v in state.items()}
    if routing_changed(ckpt["model_config"], config):
        state = {k: v for k, v in state.items() if not is_routing_key(k)}  # new routing starts at zero init
    missing, unexpected = model.load_state_dict(state, strict=False)
    bad = [k for k in missing if not is_routing_key(k)] + list(unexpected)
    if bad:
        raise TrainError(f"checkpoint weights do not fit the model: {', '.join(bad[:4])} ...; "
                         f"is it a delta-gpt checkpoint of this architecture?")
    return model


def arch_diff(old, new, keys=ARCH_FIELDS):
    """The architecture fields whose values differ between two model-config dicts, for messages."""
    old = filled(old)
    return [f"{k} ({old.get(k)!r} in the checkpoint, {new.get(k)!r} now)" for k in keys if old.get(k) != new.get(k)]


def check_tokenizer(ckpt, meta, path):
    """A checkpoint's dataset tokenizer must match the run's dataset (same ids for the same text)."""
    saved = ckpt.get("dataset") or {}
    if saved.get("tokenizer") != meta.get("tokenizer"):
        raise ConfigError(f"{path} was trained with the {saved.get('tokenizer')} tokenizer (dataset "
                          f"{saved.get('name')}), and this dataset uses {meta.get('tokenizer')}; use a dataset with "
                          f"the same tokenizer")
    if saved.get("chars") != meta.get("chars"):
        raise ConfigError(f"{path} was trained on the {len(saved.get('chars') or '')} characters of dataset "
                          f"{saved.get('name')}, and this dataset's {len(meta.get('chars') or '')} characters are not "
                          f"the same; use the dataset it was trained on, or one with the same characters")


def checkpoint_dataset(ckpt, ckpt_path, dataset=None, data_dir=None):
    """The checkpoint's dataset (or `dataset`), refused when its tokenizer differs from the checkpoint's."""
    saved = ckpt.get("dataset") or {}
    name = dataset or saved.get("name") or ckpt["config"].get("dataset")
    data_dir = data_dir or ckpt["config"].get("data_dir")
    ds = data.load(name, block_size=ckpt["model_config"]["block_size"], **({"data_dir": data_dir} if data_dir else {}))
    check_tokenizer(ckpt, ds.meta, ckpt_path)
    return ds


def rng_state():
    """The RNG states (dropout is reseeded from (seed, step, rank) every step; these serve anything else)."""
    state = dict(torch=torch.get_rng_state())
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state):
    torch.set_rng_state(state["torch"].cpu())  # RNG states must be CPU byte tensors, wherever the checkpoint was mapped
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def resume_checkpoint(cfg, master):
    """(out_dir/last.pt, the settings a resume changes), refused when the run has already reached --max-iters."""
    ckpt = load_checkpoint(Path(cfg.out_dir) / "last.pt", mmap=True)  # read lazily: under FSDP only rank 0 reads the weights
    asked = asdict(with_model_defaults(cfg))  # as the run recorded its settings
    changed = {k: (v, asked[k]) for k, v in ckpt["config"].items() if k in asked and asked[k] != v and k != "resume"}
    if ckpt["iter_num"] >= cfg.max_iters and not cfg.eval_only:
        raise ConfigError(f"the run in {cfg.out_dir} has already reached --max-iters {cfg.max_iters} (it is at step "
                          f"{ckpt['iter_num']}); raise --max-iters to train it further")
    if master and changed:
        print("resuming with changed settings: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()))
    return ckpt, changed


def resume_model(cfg, ckpt, meta):
    """The run's model from its last.pt, refused when the options ask for another architecture or tokenizer."""
    wanted = asdict(model_config(cfg, ckpt["model_config"]["vocab_size"]))
    diff = arch_diff(ckpt["model_config"], wanted)
    if diff:
        raise ConfigError(f"cannot resume {cfg.out_dir}/last.pt with a different architecture: {'; '.join(diff)}")
    check_tokenizer(ckpt, meta, f"{cfg.out_dir}/last.pt")
    return model_from_checkpoint(ckpt, dropout=cfg.dropout, fast_routing=cfg.fast_routing)


def run_options(cfg):
    """The model fields a run sets on weights it starts from (--init-from): its routing, dropout and path."""
    return {k: getattr(cfg, k) for k in ROUTE_FIELDS + ("dropout", "fast_routing")}


def model_from_gpt2(cfg, tokenizer):
    """--init-from gpt2 (-medium, -large, -xl): OpenAI's weights (through transformers), this run's routing at zero
    init, cropped to --block-size; the dataset must be GPT-2 BPE."""
    if tokenizer != "gpt2":
        raise ConfigError(f"--init-from {cfg.init_from} needs a GPT-2 BPE dataset; {cfg.dataset} is {tokenizer}")
    try:
        model = GPT.from_pretrained(cfg.init_from, run_options(cfg))
    except ValueError as e:  # no transformers package, or no network
        raise ConfigError(str(e)) from None
    if cfg.block_size < model.config.block_size:
        model.crop_block_size(cfg.block_size)
    return model


def model_from_init_checkpoint(cfg, meta, master):
    """--init-from PATH: the checkpoint's weights with this run's routing (kept only if it routes the same way)."""
    src = load_checkpoint(cfg.init_from)
    check_tokenizer(src, meta, cfg.init_from)
    wanted = asdict(model_config(cfg, src["model_config"]["vocab_size"]))
    diff = arch_diff(src["model_config"], wanted, [k for k in ARCH_FIELDS if k not in ROUTE_FIELDS])
    if diff:
        raise ConfigError(f"--init-from {cfg.init_from} has a different architecture: {'; '.join(diff)}")
    model = model_from_checkpoint(src, **run_options(cfg))
    was = src["model_config"]
    if master and was["residual"] != "baseline" and routing_changed(was, model.config):
        print(f"note: the {was['residual']} routing of --init-from {cfg.init_from} is dropped: " +
              ("a baseline has none" if cfg.residual == "baseline" else
               f"other routing settings, so {cfg.residual}'s routing starts at zero init"))
    return model


def model_vocab(ds):
    """The vocabulary a new model of dataset ds gets: its own, or GPT-2's padded up to a multiple of 64."""
    return 50304 if ds.tokenizer.name == "gpt2" else ds.vocab_size


def start_model(cfg, ckpt, ds, rank, device, dtype, master):
    """(model on `device`, iter_num, best_val_loss) a run starts from: its last.pt (--resume), a new model
    (scratch), GPT-2's weights or a checkpoint's (--init-from); under FSDP rank 0 builds it and every rank
    takes its shards."""
    model, iter_num, best_val_loss = None, 0, float("inf")
    if master or not cfg.fsdp:
        if ckpt is not None:
            model = resume_model(cfg, ckpt, ds.meta)
            iter_num, best_val_loss = ckpt["iter_num"], ckpt["best_val_loss"]
        elif cfg.init_from == "scratch":
            model = GPT(model_config(cfg, model_vocab(ds)))
        elif cfg.init_from in GPT2_MODELS:
            model = model_from_gpt2(cfg, ds.tokenizer.name)
        else:
            model = model_from_init_checkpoint(cfg, ds.meta, master)
    if cfg.fsdp:
        return shard(model, iter_num, best_val_loss, rank, device, dtype, cfg.activation_checkpointing)
    for block in model.transformer.h:  # recompute attention and MLP in backward
        block.recompute = cfg.activation_checkpointing
    return model.to(device), iter_num, best_val_loss


def start_optimizer(model, cfg, ckpt, scaler, rank, device):
    """(AdamW over the model's three groups, wall and CPU seconds run so far): on resume with the checkpoint's
    state, its scaler and RNG, and this run's settings (learning rate, decay, ...)."""
    optimizer = model.configure_optimizers(cfg.weight_decay, cfg.learning_rate, (cfg.beta1, cfg.beta2),
                                           device.type, route_lr_mult=cfg.route_lr_mult)
    if ckpt is None:
        return optimizer, 0.0, 0.0
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    load_optimizer_state(model, optimizer, ckpt["optimizer"], cfg.fsdp, rank)
    for group, setting in zip(optimizer.param_groups, settings):
        group.update(setting)
    for p, state in optimizer.state.items():  # one-head static logits were (n,): their moments too
        for k, v in state.items():
            if torch.is_tensor(v) and v.dim() and v.shape != p.shape and v.numel() == p.numel():
                state[k] = v.view_as(p)
    if scaler.is_enabled() and ckpt["scaler"]:  # a float32/bf16 run saved a disabled scaler's empty state
        scaler.load_state_dict(ckpt["scaler"])
    restore_rng(ckpt["rng"])
    return optimizer, ckpt.get("elapsed", 0.0), ckpt.get("cpu_elapsed", 0.0)
