"""
Side-by-side benchmark of the residual modes: forward+backward tokens/s, bytes of tensors saved for
backward (activation memory), and parameter count, each with its ratio to baseline, in one run.

    python bench.py                          # both configs below, all modes
    python bench.py --config cpu --iters 20  # one config
    python cli.py bench ...                  # the same through the CLI

Saved bytes are counted with torch.autograd.graph.saved_tensors_hooks over one forward+backward,
each storage once (views of one tensor count once) and parameters left out. Timing interleaves the
modes round by round (each round about a second of steps, unless --iters says) and takes each mode's
fastest round: on a shared machine interference only ever adds time, so the best round is the
repeatable figure (as timeit does), and interleaving makes every mode see the same machine. As
training on the CPU does, malloc keeps freed memory for reuse (train.keep_freed_memory; --malloc
default leaves the C library's own behaviour, which page-faults fresh memory in on every step).
"""
import argparse
import time
from dataclasses import replace

import torch

from delta_gpt import GPT, GPTConfig, RESIDUALS
from train import keep_freed_memory

# name -> (model config, batch size), fp32 eager on the CPU: the cpu preset's model (character vocabulary) and GPT-2 small
CONFIGS = {
    "cpu": (GPTConfig(n_layer=4, n_head=4, n_embd=128, block_size=64, vocab_size=65, dropout=0.0), 12),
    "d768": (GPTConfig(n_layer=12, n_head=12, n_embd=768, block_size=128, dropout=0.0), 4),
}


def make(config, residual, **route):
    """A model of `config` in mode `residual`, with routing fields in `route` (ignored for baseline)."""
    route = {} if residual == "baseline" else {k: v for k, v in route.items() if v is not None}
    return GPT(replace(config, residual=residual, n_route_blocks=None, route_partial=None,
                       route_sources=None, **route))


def saved_bytes(model, idx):
    """Bytes of the tensors autograd saves for backward in one forward+backward (each storage once)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def step(model, idx):
    _, loss = model(idx, idx)
    loss.backward()
    model.zero_grad(set_to_none=True)


def bench(config, batch, modes=RESIDUALS, iters=None, rounds=15, memory_layers=(), seed=0, round_s=1.0, **route):
    """Rows of {mode, params, saved, tok_s, ...} for one config, ratios to the first mode (baseline).
    iters: steps per timing round (default: about round_s seconds of the first mode's steps)."""
    torch.manual_seed(seed)
    idx = torch.randint(0, config.vocab_size, (batch, config.block_size))
    models = {m: make(config, m, **route) for m in modes}
    rows = {m: dict(mode=m, params=models[m].get_num_params(), saved=saved_bytes(models[m], idx), times=[])
            for m in modes}
    for n_layer in memory_layers:  # activation memory at other depths, to show it grows linearly
        for m in modes:
            rows[m][f"saved_L{n_layer}"] = saved_bytes(make(replace(config, n_layer=n_layer), m, **route), idx)
    for m in modes:  # warm-up
        step(models[m], idx)
    if iters is None:
        t0 = time.perf_counter()
        step(models[modes[0]], idx)
        iters = max(1, round(round_s / (time.perf_counter() - t0)))
    for _ in range(rounds):
        for m in modes:
            t0 = time.perf_counter()
            for _ in range(iters):
                step(models[m], idx)
            rows[m]["times"].append((time.perf_counter() - t0) / iters)
    for r in rows.values():
        r["tok_s"] = batch * config.block_size / min(r.pop("times"))
    base = rows[modes[0]]
    for r in rows.values():
        for key in [k for k in r if k in ("params", "tok_s") or k.startswith("saved")]:
            r[key + "_x"] = r[key] / base[key]
    return list(rows.values())


def table(rows, memory_layers=()):
    """The rows as a Markdown table."""
    head = ["mode", "params", "x", "saved MB", "x", "tokens/s", "x"]
    for n_layer in memory_layers:
        head += [f"saved MB L{n_layer}", "x"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["mode"], f"{r['params']:,}", f"{r['params_x']:.4f}", f"{r['saved'] / 2**20:.1f}",
                 f"{r['saved_x']:.3f}", f"{r['tok_s']:,.0f}", f"{r['tok_s_x']:.3f}"]
        for n_layer in memory_layers:
            cells += [f"{r[f'saved_L{n_layer}'] / 2**20:.1f}", f"{r[f'saved_L{n_layer}_x']:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", choices=[*CONFIGS, "all"], default="all")
    ap.add_argument("--residual", default=",".join(RESIDUALS), help="comma-separated modes; baseline first")
    ap.add_argument("--iters", type=int, default=None, help="steps per timing round (default: about a second's worth)")
    ap.add_argument("--rounds", type=int, default=15, help="timing rounds, interleaved over the modes (the fastest is taken)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--malloc", choices=["keep", "default"], default="keep",
                    help="keep: malloc keeps freed memory for reuse, as CPU training does; default: the C library's behaviour")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    malloc = "keeps freed memory" if args.malloc == "keep" and keep_freed_memory() else "default"
    modes = tuple(args.residual.split(","))
    if modes[0] != "baseline":
        modes = ("baseline",) + tuple(m for m in modes if m != "baseline")
    for name in CONFIGS if args.config == "all" else [args.config]:
        config, batch = CONFIGS[name]
        memory_layers = (2 * config.n_layer,) if name == "d768" else ()
        print(f"\n{name}: n_layer {config.n_layer}, n_embd {config.n_embd}, context {config.block_size}, "
              f"batch {batch}, fp32 eager, {torch.get_num_threads()} threads, malloc {malloc}, best of {args.rounds} rounds")
        rows = bench(config, batch, modes, iters=args.iters, rounds=args.rounds, memory_layers=memory_layers)
        print(table(rows, memory_layers))


if __name__ == "__main__":
    main()
