"""delta-gpt command line: prepare data, train, sample, inspect routing, convert, compare.

    python cli.py prepare                      # embedded Shakespeare, character level
    python cli.py train --residual delta       # the cpu preset on a machine without CUDA
    python cli.py COMMAND --help               # every command documents its options

Bad input ends with one line on stderr and exit status 1, never a traceback.
"""
import functools
import json
import math
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer
import typer.core

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}  # train-style --field value options


@app.callback()
def main():
    """delta-gpt: Delta Attention Residuals beside AttnRes and the plain residual, nanoGPT-sized."""


def fail(message: str):
    """Print one clear line and exit 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def friendly(fn):
    """Turn the project's bad-input errors (ValueError and its subclasses such as DataError, TrainError,
    missing files) into one line and exit 1; an interrupted training run exits 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130)
        except RuntimeError as e:
            train = sys.modules.get("train")  # imported lazily: commands without torch start fast
            if train is None or not isinstance(e, train.TrainError):
                raise
            fail(str(e))
    return wrapper


def train_options_help():
    """The help text listing every TrainConfig field as an option, with the cpu preset's value."""
    import train
    helps, defaults = train.field_help(), train.TrainConfig()
    lines = [f"  --{train.flag(f.name):<27} {helps[f.name]} [cpu: {getattr(defaults, f.name)}]"
             for f in train.fields(train.TrainConfig)]
    return ("Training options: any TrainConfig field, as --field VALUE, --field=VALUE or --flag / --no-flag.\n\n"
            "\b\n" + "\n".join(lines) + f"\n\nPresets: {', '.join(train.PRESETS)} (default: cpu without CUDA, "
            "shakespeare_char with it).")


class TrainHelp(typer.core.TyperCommand):
    """A command whose --help lists every TrainConfig field, built only when help is shown (it imports
    torch, which would slow every other command's start)."""

    def format_epilog(self, ctx, formatter):
        self.epilog = train_options_help()
        super().format_epilog(ctx, formatter)


def load_model(ckpt_path, device="cpu"):
    """(model in eval mode, checkpoint dict) from a checkpoint path."""
    import train
    ckpt = train.load_checkpoint(ckpt_path, map_location=device)
    model = train.model_from_checkpoint(ckpt).to(device).eval()
    return model, ckpt


def open_eval_dataset(ckpt, ckpt_path, dataset=None, data_dir=None):
    """The checkpoint's dataset (or `dataset`), refused when its tokenizer differs from the checkpoint's."""
    import data
    import train
    saved = ckpt.get("dataset") or {}
    name = dataset or saved.get("name") or ckpt["config"].get("dataset")
    data_dir = data_dir or ckpt["config"].get("data_dir")
    kw = {"data_dir": data_dir} if data_dir else {}
    ds = data.load(name, block_size=ckpt["model_config"]["block_size"], **kw)
    train.check_tokenizer(ckpt, ds.meta, ckpt_path)
    return ds


def checkpoint_tokenizer(ckpt, ckpt_path):
    import data
    saved = ckpt.get("dataset") or {}
    if not saved.get("tokenizer"):
        fail(f"{ckpt_path} does not record its tokenizer; it was not written by delta-gpt's train.py")
    return data.get_tokenizer(saved)


@app.command()
@friendly
def prepare(
    dataset: str = typer.Argument("shakespeare_char", help="shakespeare_char | shakespeare | text | fineweb_edu"),
    input: Optional[Path] = typer.Option(None, "--input", help="text: a UTF-8 file or a folder of .txt files"),
    tokenizer: str = typer.Option("char", "--tokenizer", help="text: char | gpt2"),
    name: Optional[str] = typer.Option(None, "--name", help="text: the dataset's name under data/ (default: the input's name)"),
    max_tokens: int = typer.Option(100_000_000, "--max-tokens", help="fineweb_edu: stop after this many tokens"),
    subset: str = typer.Option("sample-10BT", "--subset", help="fineweb_edu: the Hugging Face config"),
    num_proc: Optional[int] = typer.Option(None, "--num-proc", help="fineweb_edu: tokenizer processes (default: CPU count)"),
    force: bool = typer.Option(False, "--force", help="prepare again even if the dataset is there"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="where datasets live (default: data/)"),
):
    """Tokenise a dataset into data/NAME/{train,val}.bin and meta.json."""
    import data
    kwargs = dict(force=force, input=input, tokenizer=tokenizer, out_name=name, max_tokens=max_tokens,
                  subset=subset, num_proc=num_proc)
    if data_dir is not None:
        kwargs["data_dir"] = data_dir
    path = data.prepare(dataset, **kwargs)
    typer.echo(f"prepared {path}")


@app.command(context_settings=PASS_THROUGH, cls=TrainHelp)
@friendly
def train(ctx: typer.Context):
    """Train a model: train --residual MODE [--preset P] [--resume] [--FIELD VALUE ...].

    Works under torchrun for DDP: torchrun --standalone --nproc_per_node=N cli.py train ...
    """
    import train as T
    preset, overrides = T.parse_args(ctx.args)
    cfg = T.resume_config(preset, **overrides) if overrides.get("resume") else T.make_config(preset, **overrides)
    summary = T.train(cfg)
    if summary.get("val_loss") is not None and int(os.environ.get("RANK", 0)) == 0:
        typer.echo(f"done: val loss {summary['val_loss']:.4f} (perplexity {math.exp(summary['val_loss']):.2f}) "
                   f"after {summary['iter_num']} steps; checkpoints in {cfg.out_dir or T.out_dir_of(cfg)}")


@app.command()
@friendly
def sample(
    ckpt: Path = typer.Option(..., "--ckpt", help="a checkpoint (last.pt or best.pt)"),
    prompt: Optional[str] = typer.Option(None, "--prompt", help="the start text (default: a newline, or <|endoftext|> for GPT-2 BPE)"),
    prompt_file: Optional[Path] = typer.Option(None, "--prompt-file", help="read the start text from a file"),
    num_samples: int = typer.Option(3, "--num-samples", help="how many samples"),
    max_new_tokens: int = typer.Option(300, "--max-new-tokens", help="tokens generated per sample"),
    temperature: float = typer.Option(0.8, "--temperature", help="1.0 as trained, lower is more predictable, 0 is greedy"),
    top_k: Optional[int] = typer.Option(None, "--top-k", help="sample only from the k most likely tokens [default: 200, or the vocabulary size if smaller]"),
    seed: int = typer.Option(1337, "--seed", help="random seed"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, mps"),
):
    """Generate text from a checkpoint with the KV cache, decoded with the checkpoint's tokenizer."""
    import torch
    model, ck = load_model(ckpt, device)
    tok = checkpoint_tokenizer(ck, ckpt)
    if prompt is not None and prompt_file is not None:
        fail("give --prompt or --prompt-file, not both")
    if prompt_file is not None:
        if not prompt_file.is_file():
            fail(f"prompt file {prompt_file} does not exist")
        prompt = prompt_file.read_text(encoding="utf-8")
    if prompt is None:
        prompt = "\n" if tok.name == "char" else "<|endoftext|>"
    if prompt == "":
        fail("the prompt is empty; give at least one character")
    if max_new_tokens < 1:
        fail(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if num_samples < 1:
        fail(f"--num-samples must be at least 1, got {num_samples}")
    if top_k is not None and not 1 <= top_k <= tok.vocab_size:
        fail(f"--top-k must be between 1 and the vocabulary size {tok.vocab_size}, got {top_k}")
    top_k = top_k or min(200, tok.vocab_size)
    ids = tok.encode(prompt)
    x = torch.tensor(ids, dtype=torch.long, device=device)[None, -model.config.block_size:]
    torch.manual_seed(seed)
    for i in range(num_samples):
        y = model.generate(x, max_new_tokens, temperature=temperature, top_k=top_k)
        typer.echo(tok.decode(y[0].tolist()))
        typer.echo("---------------")


@app.command()
@friendly
def report(
    ckpt: List[Path] = typer.Option(..., "--ckpt", help="a routed checkpoint; give --ckpt twice to compare two runs"),
    out: Optional[Path] = typer.Option(None, "--out", help="folder for report.json and the PNGs (default: beside the first checkpoint)"),
    batches: int = typer.Option(8, "--batches", help="fixed validation batches to average over"),
    batch_size: int = typer.Option(8, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="where datasets live (default: the checkpoint's)"),
):
    """Routing sharpness on fixed validation batches: a table, report.json and report.png."""
    import report as R
    import train as T
    from tqdm import tqdm
    if len(ckpt) > 2:
        fail("report compares at most two checkpoints")
    if batches < 1 or batch_size < 1:
        fail("--batches and --batch-size must be at least 1")
    reports = []
    for path in tqdm(ckpt, desc="routing statistics", disable=len(ckpt) < 2, leave=False):
        model, ck = load_model(path)
        if model.config.residual == "baseline":
            fail(f"{path} is a baseline model: it has no routing to report; train or convert a routed one "
                 f"(--residual attnres, delta or delta_block)")
        ds = open_eval_dataset(ck, path, data_dir=data_dir)
        label = model.config.residual if len({str(p) for p in ckpt}) == len(ckpt) else str(path)
        if any(label == l for l, _ in reports):
            label = f"{label} ({path.parent.name})"
        reports.append((label, T.routing_stats(model, ds, batches, batch_size)))
    typer.echo(R.routing_table(reports))
    out = out or Path(ckpt[0]).parent / "report"
    out.mkdir(parents=True, exist_ok=True)
    R.save_json({label: dict(stats, checkpoint=str(p)) for (label, stats), p in zip(reports, ckpt)}, out / "report.json")
    R.draw_routing(reports, out / "report.png")
    typer.echo(f"\nwrote {out / 'report.json'} and {out / 'report.png'}")


@app.command()
@friendly
def convert(
    ckpt: Path = typer.Option(..., "--ckpt", help="a baseline checkpoint"),
    residual: str = typer.Option(..., "--residual", help="attnres | delta | delta_block"),
    out: Path = typer.Option(..., "--out", help="where to write the routed checkpoint"),
    n_route_blocks: Optional[int] = typer.Option(None, "--n-route-blocks", help="routing blocks N (default per mode)"),
    route_partial: Optional[bool] = typer.Option(None, "--route-partial/--no-route-partial", help="delta_block: route the current partial block too"),
    eval_iters: int = typer.Option(20, "--eval-iters", help="fixed validation batches for the before/after loss"),
    batch_size: int = typer.Option(12, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="where datasets live (default: the checkpoint's)"),
):
    """A routed checkpoint from a baseline one, routing at zero init; prints the val loss before and after."""
    import train as T
    from dataclasses import asdict
    from delta_gpt import RESIDUALS
    if residual not in RESIDUALS or residual == "baseline":
        fail(f"--residual {residual!r} is not a routed mode; choose attnres, delta or delta_block")
    base, ck = load_model(ckpt)
    if base.config.residual != "baseline":
        fail(f"{ckpt} is already a {base.config.residual} model; convert starts from a baseline checkpoint")
    route = dict(residual=residual, n_route_blocks=n_route_blocks, route_partial=route_partial)
    routed = T.model_from_checkpoint(ck, **route).eval()
    ds = open_eval_dataset(ck, ckpt, data_dir=data_dir)
    before = T.estimate_loss(base, ds, "val", eval_iters, batch_size, progress=True)
    after = T.estimate_loss(routed, ds, "val", eval_iters, batch_size, progress=True)
    config = dict(ck["config"], **{k: getattr(routed.config, k) for k in route}, init_from=str(ckpt))
    T.save_checkpoint(dict(model=routed.state_dict(), model_config=asdict(routed.config), config=config,
                           iter_num=0, best_val_loss=after, dataset=ck.get("dataset"), converted_from=str(ckpt)), out)
    typer.echo(f"val loss: baseline {before:.6f}, {residual} {after:.6f} (change {after - before:+.2e})")
    if residual != "delta_block" or routed.config.route_partial:
        typer.echo("the sources telescope, so the routed model computes the baseline's function at zero init, "
                   "up to LayerNorm's eps" + (": replacement routing feeds x/n to LayerNorm, which weighs eps about "
                   "n^2 more while the stream is small (little training)" if residual == "attnres" else ""))
    else:
        typer.echo("plain delta_block is not the baseline's function at zero init: its sources sum to the "
                   "block-start state, not the stream; --route-partial makes the conversion exact")
    typer.echo(f"wrote {out}")


@app.command()
@friendly
def bench(
    residual: str = typer.Option("baseline,attnres,delta,delta_block", "--residual", help="comma-separated modes"),
    config: str = typer.Option("all", "--config", help="cpu (4 layers, 128 wide, ctx 64, batch 12), d768 (12 layers, 768, ctx 128, batch 4), or all; on CUDA: d768 (ctx 1024)"),
    iters: Optional[int] = typer.Option(None, "--iters", help="steps per timing round [default: about a second's worth; 10 on CUDA]"),
    rounds: Optional[int] = typer.Option(None, "--rounds", help="timing rounds (interleaved over the modes on the CPU); the fastest is taken [default: 15; 3 on CUDA]"),
    malloc: str = typer.Option("keep", "--malloc", help="keep: malloc keeps freed memory for reuse, as CPU training does; default: the C library's behaviour"),
    device: str = typer.Option("cpu", "--device", help="cpu, or cuda: GPT-2 small at context 1024 in bf16, eager and compiled, with MFU and peak memory"),
    batch_size: Optional[int] = typer.Option(None, "--batch-size", help="CUDA only: sequences per step [default: 16]"),
    variants: Optional[str] = typer.Option(None, "--variants", help="CUDA only: eager, compiled or eager,compiled [default: both]"),
):
    """Tokens/s (forward+backward), saved-activation bytes and parameters per mode, with ratios to baseline;
    with --device cuda: tokens/s, MFU and peak memory, eager and compiled."""
    import bench as B
    from delta_gpt import RESIDUALS
    modes = [m for m in residual.split(",") if m]
    bad = [m for m in modes if m not in RESIDUALS]
    if bad:
        fail(f"unknown mode {bad[0]!r}; choose from {', '.join(RESIDUALS)}")
    if config not in (*B.CONFIGS, "all"):
        fail(f"unknown --config {config!r}; choose one of {', '.join(B.CONFIGS)} or all")
    if (iters is not None and iters < 1) or (rounds is not None and rounds < 1):
        fail("--iters and --rounds must be at least 1")
    if malloc not in ("keep", "default"):
        fail(f"unknown --malloc {malloc!r}; choose keep or default")
    if device not in ("cpu", "cuda"):
        fail(f"unknown --device {device!r}; choose cpu or cuda")
    argv = ["--config", config, "--residual", ",".join(modes), "--malloc", malloc, "--device", device]
    for flag, value in (("--iters", iters), ("--rounds", rounds), ("--batch-size", batch_size), ("--variants", variants)):
        if value is not None:
            argv += [flag, str(value)]
    problem = B.check_args(B.parse_args(argv))
    if problem:
        fail(problem)
    B.main(argv)


@app.command(context_settings=PASS_THROUGH, cls=TrainHelp)
@friendly
def compare(
    ctx: typer.Context,
    residual: str = typer.Option("baseline,attnres,delta,delta_block", "--residual", help="comma-separated modes"),
    seeds: str = typer.Option("1,2,3", "--seeds", help="comma-separated seeds"),
    preset: Optional[str] = typer.Option(None, "--preset", help="training preset (default: cpu without CUDA)"),
    max_iters: Optional[int] = typer.Option(None, "--max-iters", help="steps per run (default: the preset's)"),
    out: Path = typer.Option(Path("runs/compare"), "--out", help="folder for the runs, compare.json/.md and curves.png"),
):
    """Train each mode and seed on the same batches, then tabulate val loss, perplexity, sharpness, speed.

    Any other train option (--n-layer 2, --eval-interval 100, ...) applies to every run. Finished runs in
    --out are reused, unfinished ones resumed, so an interrupted compare continues where it stopped.
    """
    import report as R
    import train as T
    from delta_gpt import RESIDUALS
    modes = [m for m in residual.split(",") if m]
    bad = [m for m in modes if m not in RESIDUALS]
    if bad or not modes:
        fail(f"unknown mode {bad[0] if bad else ''!r}; choose from {', '.join(RESIDUALS)}")
    try:
        seed_list = [int(s) for s in seeds.split(",") if s]
    except ValueError:
        fail(f"--seeds takes comma-separated integers, got {seeds!r}")
    if not seed_list:
        fail("--seeds needs at least one seed")
    _, overrides = T.parse_args(ctx.args)
    for key in ("residual", "seed", "out_dir", "resume", "overwrite"):
        if key in overrides:
            fail(f"compare sets --{T.flag(key)} itself; leave it out")
    if max_iters is not None:
        overrides["max_iters"] = max_iters
    runs, curves = {}, {}
    for mode in modes:
        # routing options (--n-route-blocks, --route-sources, ...) apply to the routed modes only
        mode_overrides = {k: v for k, v in overrides.items() if mode != "baseline" or k not in T.ROUTE_FIELDS}
        for seed in seed_list:
            cfg = T.make_config(preset, **mode_overrides, residual=mode, seed=seed, out_dir=str(out / f"{mode}-s{seed}"))
            last = Path(cfg.out_dir) / "last.pt"
            done = T.load_checkpoint(last, mmap=True)["iter_num"] if last.exists() else None
            if done is not None and done >= cfg.max_iters:
                typer.echo(f"{mode} seed {seed}: reusing the finished run in {cfg.out_dir}")
            else:
                if done is not None:
                    cfg = T.resume_config(preset, **mode_overrides, residual=mode, seed=seed, out_dir=cfg.out_dir, resume=True)
                T.train(cfg)
            rows = T.read_metrics(cfg.out_dir)
            evals = [r for r in rows if r["kind"] == "eval"]
            speeds = [r["tokens_per_s"] for r in rows if r["kind"] == "train"]
            runs.setdefault(mode, []).append(dict(
                seed=seed, val_loss=evals[-1]["val_loss"], tokens_per_s=sorted(speeds)[len(speeds) // 2] if speeds else None,
                max_weight=(evals[-1].get("routing") or {}).get("mean_max_weight"),
                params=json.loads((Path(cfg.out_dir) / "config.json").read_text())["params"]))
            curves.setdefault(mode, []).append([(r["step"], r["val_loss"]) for r in evals])
    rows = R.compare_rows(runs)
    table = R.compare_table(rows)
    typer.echo(table)
    out.mkdir(parents=True, exist_ok=True)
    R.save_json(dict(rows=rows, runs=runs), out / "compare.json")
    (out / "compare.md").write_text(table + "\n")
    R.draw_curves(curves, out / "curves.png")
    typer.echo(f"\nwrote {out / 'compare.md'}, {out / 'compare.json'} and {out / 'curves.png'}")


@app.command("eval")
@friendly
def evaluate(
    ckpt: Path = typer.Option(..., "--ckpt", help="a checkpoint"),
    dataset: Optional[str] = typer.Option(None, "--dataset", help="a prepared dataset with the same tokenizer (default: the checkpoint's)"),
    eval_iters: int = typer.Option(50, "--eval-iters", help="fixed validation batches"),
    batch_size: int = typer.Option(12, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help="where datasets live (default: the checkpoint's)"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, mps"),
):
    """Validation loss and perplexity of a checkpoint on fixed batches."""
    import train as T
    if eval_iters < 1 or batch_size < 1:
        fail("--eval-iters and --batch-size must be at least 1")
    model, ck = load_model(ckpt, device)
    ds = open_eval_dataset(ck, ckpt, dataset=dataset, data_dir=data_dir)
    loss = T.estimate_loss(model, ds, "val", eval_iters, batch_size, progress=True)
    typer.echo(f"{ds.name} val loss {loss:.4f}, perplexity {math.exp(loss):.3f} "
               f"({eval_iters} batches of {batch_size} x {model.config.block_size} tokens)")


if __name__ == "__main__":
    app()
