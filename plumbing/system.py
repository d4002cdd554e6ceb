"""Process-wide settings, set only by entry points: the device, torch's threads, malloc, TF32; and a run's
precision on its device (dtype, autocast, gradient scaler)."""
import ctypes
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

from errors import ConfigError
from plumbing.config import at_least_one


def pick_device(cfg):
    """The device the run asks for; auto is CUDA, then MPS, then the CPU."""
    if cfg.device != "auto":
        return checked_device(cfg.device)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if getattr(torch.backends, "mps", None) and torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def checked_device(name):
    """torch.device(name), refused in one line when this machine does not have it."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"--device {name!r} is unknown; choose auto, cpu, cuda, cuda:N or mps") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"--device {name} asks for CUDA, which this machine does not have; use --device cpu")
    if device.type == "mps" and not torch.backends.mps.is_available():
        raise ConfigError(f"--device {name} asks for MPS, which this machine does not have; use --device cpu")
    return device


def check_memory(cfg, device, world_size):
    """Refuse, before any work, a CPU training run whose saved activations and weights alone exceed this machine's
    memory: such a run swaps, or sits for an hour inside one op. The count is a lower bound (64 bytes per token,
    channel and layer in float32, below what every mode saves), so a run it lets through may still not fit."""
    if device.type != "cpu" or not cfg.memory_check or cfg.eval_only:
        return
    ranks = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))  # torchrun's processes on this machine
    need = ranks * (64 * cfg.batch_size * cfg.block_size * cfg.n_embd * cfg.n_layer + 16 * 12 * cfg.n_layer * cfg.n_embd ** 2)
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have:
        raise ConfigError(f"training --block-size {cfg.block_size} at --batch-size {cfg.batch_size} ({cfg.n_layer} layers, "
                          f"width {cfg.n_embd}) needs at least {need / 2**30:.1f} GiB on this CPU (its saved activations "
                          f"and weights), more than the machine's {have / 2**30:.1f} GiB; use a smaller --block-size or "
                          f"--batch-size (python cli.py plan estimates a config's memory), or pass --no-memory-check to "
                          f"try anyway")


def cpu_has_bfloat16():
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16, AMX, Arm BF16), as Linux reports it; False if unknown."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def precision(cfg, device, master):
    """(dtype name, autocast context, gradient scaler): bf16 or fp16 autocast on CUDA, float32 on
    CPU/MPS unless asked."""
    dtype = cfg.dtype
    if dtype == "auto":
        dtype = ("float32" if device.type != "cuda"
                 else "bfloat16" if torch.cuda.is_bf16_supported() else "float16")
    slow = dtype == "float16" or (dtype == "bfloat16" and not cpu_has_bfloat16())
    if slow and device.type == "cpu" and master:
        print(f"warning: --dtype {dtype} on this CPU runs many times slower than float32 "
              f"(it has no fast {dtype} matrix products); it is allowed, but use --dtype float32 "
              f"(the CPU default) unless you are testing mixed precision", file=sys.stderr)
    ptdtype = {'float32': torch.float32, 'bfloat16': torch.bfloat16,
               'float16': torch.float16}[dtype]
    ctx = (nullcontext() if dtype == "float32"
           else torch.autocast(device_type=device.type, dtype=ptdtype))
    return dtype, ctx, torch.amp.GradScaler(device.type, enabled=(dtype == "float16"))


def keep_freed_memory():
    """Have glibc's malloc keep freed memory for the next step (no page faults each step; docs/speed.md).
    Returns whether it took effect."""
    M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt parameters, from glibc's malloc.h
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError, TypeError):  # no C library to ask, or one without mallopt
        return False
    return bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))


def busy_cores(seconds=0.25):
    """How many CPU cores other work keeps busy now, from /proc/stat over `seconds` (0 where unknown)."""
    def sample():
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:]]
        return sum(ticks), ticks[3] + ticks[4]  # total, idle + iowait
    try:
        (t0, i0), _, (t1, i1) = sample(), time.sleep(seconds), sample()
    except (OSError, ValueError, IndexError):
        return 0
    return round((1 - (i1 - i0) / max(1, t1 - t0)) * (os.cpu_count() or 1))


def choose_threads(threads, doing):
    """Every command's one rule for torch's CPU threads: --threads N, or else the cores free when it starts (two
    jobs with all threads each on the same cores run many times slower); a note says when some are busy. The
    choice holds for the whole command: a load that comes later is not seen."""
    if threads is not None:
        at_least_one(threads=threads)
        torch.set_num_threads(threads)
        return
    cores, busy = torch.get_num_threads(), busy_cores()
    if busy and cores > 1:
        torch.set_num_threads(max(1, cores - busy))
        print(f"note: {busy} of {cores} cores are busy; {doing} with {torch.get_num_threads()} thread(s) "
              f"(--threads N to choose)", file=sys.stderr)


def apply_process_settings(cfg):
    """Threads (--threads, or the free cores: two jobs with all threads each run many times slower), malloc
    on the CPU (--keep-freed-memory), TF32 on CUDA for the float32 matmuls autocast leaves (as nanoGPT)."""
    kind = pick_device(cfg).type
    on_cpu = kind == "cpu"
    if kind == "cuda":
        torch.set_float32_matmul_precision("high")  # allow tf32 on matmul
    if cfg.threads is not None or (on_cpu and int(os.environ.get("WORLD_SIZE", 1)) == 1):
        choose_threads(cfg.threads, "training")
    if on_cpu and cfg.keep_freed_memory:
        keep_freed_memory()


def end_torchrun_process():
    """A torchrun process whose training is done exits here, skipping the interpreter's shutdown: the gloo
    group's worker threads outlive destroy_process_group (torch's DTensor caches keep the FSDP group alive),
    and one that drops a tensor as the interpreter shuts down aborts the process (a rank of a finished run
    died so, twice in CI). Everything is written and closed by now; only the output buffers need flushing."""
    if int(os.environ.get("RANK", -1)) == -1:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def cpu_name():
    """This machine's CPU model, as /proc/cpuinfo names it (the machine every timed figure names)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or "unknown CPU"
