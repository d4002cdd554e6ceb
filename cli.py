"""delta-gpt command line: prepare data, train, sample, inspect routing, convert, compare.

    python cli.py prepare                      # embedded Shakespeare, character level
    python cli.py train --residual delta       # the cpu preset on a machine without CUDA
    python cli.py COMMAND --help               # every command documents its options

Bad input ends with one line on stderr and exit status 1, never a traceback. A command line that
does not parse (an unknown command, a missing or mistyped option of a command other than train,
compare and plan, whose training options delta-gpt parses itself) gets a usage message and exit
status 2. Each command is a function NAME_command, so that the modules keep their own names.
"""
import functools
import math
from pathlib import Path
from typing import List, Optional

from errors import ConfigError, DeltaGPTError, check_packages

check_packages()  # one line, not a traceback, in a shell without the project's .venv

import typer  # noqa: E402
import typer.core  # noqa: E402

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  rich_markup_mode=None, context_settings={"help_option_names": ["-h", "--help"]})
# every command's one rule for threads
THREADS = typer.Option(None, "--threads",
                       help="CPU threads (default: the cores free when it starts)")
PASS_THROUGH = {"allow_extra_args": True, "ignore_unknown_options": True}  # --field value options
DATA_DIR = "where datasets live (default: the checkpoint's)"


@app.callback()
def commands():
    """delta-gpt: Delta Attention Residuals beside AttnRes and the plain residual, nanoGPT-sized."""


def fail(message: str):
    """Print one clear line and exit 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def friendly(fn):
    """Turn the project's bad-input errors (errors.DeltaGPTError and its subclasses) into one line
    and exit 1; an interrupted training run exits 130."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except DeltaGPTError as e:
            fail(str(e))
        except KeyboardInterrupt:
            raise typer.Exit(130)
    return wrapper


class TrainHelp(typer.core.TyperCommand):
    """A command whose --help lists every TrainConfig field, built only when help is shown (it
    imports torch, which would slow every other command's start)."""

    def format_epilog(self, ctx, formatter):
        import train
        from plumbing.config import train_help
        self.epilog = train_help(train.TrainConfig, train.PRESETS)
        super().format_epilog(ctx, formatter)


@app.command("prepare")
@friendly
def prepare_command(
    dataset: str = typer.Argument(
        "shakespeare_char", help="shakespeare_char | shakespeare | text | fineweb_edu"),
    input: Optional[Path] = typer.Option(
        None, "--input", help="text: a UTF-8 file or a folder of .txt files"),
    tokenizer: str = typer.Option("char", "--tokenizer", help="text: char | gpt2"),
    name: Optional[str] = typer.Option(
        None, "--name", help="text: the dataset's name under data/ (default: the input's name)"),
    max_tokens: int = typer.Option(
        100_000_000, "--max-tokens", help="fineweb_edu: stop after this many tokens"),
    subset: str = typer.Option(
        "sample-10BT", "--subset", help="fineweb_edu: the Hugging Face config"),
    num_proc: Optional[int] = typer.Option(
        None, "--num-proc", help="fineweb_edu: tokenizer processes (default: CPU count)"),
    force: bool = typer.Option(
        False, "--force", help="prepare again, replacing whatever data/NAME holds"),
    data_dir: Optional[Path] = typer.Option(
        None, "--data-dir", help="where datasets live (default: data/)"),
):
    """Tokenise a dataset into data/NAME/{train,val}.bin and meta.json."""
    import data
    kwargs = dict(force=force, input=input, tokenizer=tokenizer, out_name=name,
                  max_tokens=max_tokens, subset=subset, num_proc=num_proc)
    if data_dir is not None:
        kwargs["data_dir"] = data_dir
    done = data.prepare_dataset(dataset, **kwargs)
    if done.written:
        typer.echo(f"prepared {done.path} ({data.describe(done.meta)})")
    else:
        typer.echo(f"{done.path} is already prepared ({data.describe(done.meta)}); "
                   f"pass --force to prepare it again")


@app.command("train", context_settings=PASS_THROUGH, cls=TrainHelp)
def train_command(ctx: typer.Context):
    """Train a model: train --residual MODE [--preset P] [--resume] [--FIELD VALUE ...].

    Works under torchrun for DDP: torchrun --standalone --nproc_per_node=N cli.py train ...
    """
    import train
    train.main(ctx.args)  # the one entry flow of python train.py: its errors, its last line


@app.command("sample")
@friendly
def sample_command(
    ckpt: Path = typer.Option(..., "--ckpt", help="a checkpoint (last.pt or best.pt)"),
    prompt: Optional[str] = typer.Option(
        None, "--prompt",
        help="the start text (default: a newline, or <|endoftext|> for GPT-2 BPE)"),
    prompt_file: Optional[Path] = typer.Option(
        None, "--prompt-file", help="read the start text from a file"),
    num_samples: int = typer.Option(3, "--num-samples", help="how many samples"),
    max_new_tokens: int = typer.Option(
        300, "--max-new-tokens", help="tokens generated per sample"),
    temperature: float = typer.Option(
        0.8, "--temperature",
        help="1.0 as trained, lower is more predictable, 0 is greedy"),
    top_k: Optional[int] = typer.Option(
        None, "--top-k", help="sample only from the k most likely tokens "
                              "[default: 200, or the vocabulary size if smaller]"),
    seed: int = typer.Option(1337, "--seed", help="random seed"),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, mps"),
    threads: Optional[int] = THREADS,
):
    """Generate text from a checkpoint with the KV cache, decoded with its tokenizer."""
    import sample
    from plumbing.system import choose_threads
    choose_threads(threads, "sampling")
    texts = sample.generate_text(ckpt, prompt, prompt_file, num_samples, max_new_tokens,
                                 temperature, top_k, seed, device)
    typer.echo(next(texts))  # the header: the checkpoint's step and val loss, the seed
    for text in texts:
        typer.echo(text)
        typer.echo("---------------")


@app.command("report")
@friendly
def report_command(
    ckpt: List[Path] = typer.Option(
        ..., "--ckpt", help="a routed checkpoint; give --ckpt twice to compare two runs"),
    out: Optional[Path] = typer.Option(
        None, "--out", help="folder for report.json and the PNGs "
                            "(default: report/ in the first checkpoint's folder)"),
    batches: int = typer.Option(8, "--batches", help="fixed validation batches to average over"),
    batch_size: int = typer.Option(8, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_DIR),
    force: bool = typer.Option(
        False, "--force", help="replace report.json and report.png if --out holds them"),
    threads: Optional[int] = THREADS,
):
    """Routing sharpness on fixed validation batches: a table, report.json and report.png."""
    from plumbing.system import choose_threads
    from workbench import report
    choose_threads(threads, "reporting")
    table, written = report.report_checkpoints(ckpt, out, batches, batch_size, data_dir, force)
    typer.echo(table)
    typer.echo(f"\nwrote {' and '.join(str(p) for p in written)}")


@app.command("convert")
@friendly
def convert_command(
    ckpt: Path = typer.Option(..., "--ckpt", help="a baseline checkpoint"),
    residual: str = typer.Option(..., "--residual", help="attnres | delta | delta_block"),
    out: Path = typer.Option(..., "--out", help="where to write the routed checkpoint"),
    n_route_blocks: Optional[int] = typer.Option(
        None, "--n-route-blocks", help="routing blocks N (default per mode)"),
    route_partial: Optional[bool] = typer.Option(
        None, "--route-partial/--no-route-partial",
        help="delta_block: route the current partial block too"),
    route_heads: Optional[int] = typer.Option(
        None, "--route-heads",
        help="H routing heads, each over one of H channel groups (default 1)"),
    eval_iters: int = typer.Option(
        20, "--eval-iters",
        help="fixed validation batches for the before/after loss (as training)"),
    batch_size: int = typer.Option(12, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_DIR),
    force: bool = typer.Option(
        False, "--force", help="replace --out if it exists (never the input checkpoint)"),
    threads: Optional[int] = THREADS,
):
    """A routed checkpoint from a baseline one, routing at zero init; prints the val loss before and
    after."""
    import sample
    from plumbing.system import choose_threads
    choose_threads(threads, "converting")
    before, after, _ = sample.convert_checkpoint(ckpt, out, residual, n_route_blocks,
                                                 route_partial, eval_iters, batch_size, data_dir,
                                                 force, route_heads=route_heads)
    typer.echo(f"val loss: baseline {before:.6f}, {residual} {after:.6f} "
               f"(change {after - before:+.2e}; each the mean of {eval_iters} fixed validation "
               f"batches)")
    typer.echo(f"wrote {out}")


class BenchHelp(typer.core.TyperCommand):
    """The bench command, whose --help lists workbench/bench.py's own options (one parser for both
    entry points)."""

    def format_epilog(self, ctx, formatter):
        from workbench import bench
        self.epilog = ("Options (as python -m workbench.bench takes them):\n\n\b\n"
                       + bench.options_help())
        super().format_epilog(ctx, formatter)


@app.command("bench", context_settings=PASS_THROUGH, cls=BenchHelp)
@friendly
def bench_command(ctx: typer.Context):
    """Tokens/s (forward+backward), saved-activation bytes and parameters per mode, with ratios to
    baseline; with --device cuda: tokens/s, MFU and peak memory, eager and compiled.

    bench [--config cpu|d768|all] [--residual a,b,c] [--device cuda] [--batch-size N] ...
    """
    from workbench import bench
    bench.main(ctx.args, prog="cli.py bench")


@app.command("compare", context_settings=PASS_THROUGH, cls=TrainHelp)
@friendly
def compare_command(
    ctx: typer.Context,
    study: Optional[Path] = typer.Option(
        None, "--study",
        help="a TOML study file (see studies/): its variants, seeds, sweep and options"),
    residual: Optional[str] = typer.Option(
        None, "--residual", help="comma-separated modes, without --study "
                                 "[default: baseline,attnres,delta,delta_block]"),
    seeds: Optional[str] = typer.Option(
        None, "--seeds", help="comma-separated seeds, without --study [default: 1,2,3]"),
    out: Optional[Path] = typer.Option(
        None, "--out", help="folder for the runs, compare.json/.md and the pictures "
                            "[default: runs/compare, or runs/STUDY for --study FILE]"),
    overwrite: bool = typer.Option(
        False, "--overwrite", help="train every run again, even finished ones in --out"),
    dry_run: bool = typer.Option(
        False, "--dry-run",
        help="check everything and print the plan and time estimate; train nothing"),
    jobs: int = typer.Option(
        1, "--jobs", help="runs trained at a time, each in its own process with cores / N "
                          "threads (--threads to choose) and its output in train.log in its "
                          "run directory"),
    clock: str = typer.Option(
        "wall", "--clock", help="what the equal-time column and the time plot read: wall, or cpu "
                                "(each run's own CPU time, which other jobs on the machine "
                                "inflate less)"),
    speed_rounds: Optional[int] = typer.Option(
        None, "--speed-rounds",
        help="after the runs, time a training step of each variant at its shape, interleaved, this "
             "many rounds (the per-minute columns; default 10, or the results' timing when nothing "
             "trained); 0 leaves it out"),
    reprint: bool = typer.Option(
        False, "--reprint", help="with --study FILE: print the tables and draw the pictures from "
                                 "the study's results (results/NAME.json beside FILE) in --out "
                                 "(default runs/NAME-reprint), training nothing"),
    by_step: int = typer.Option(
        0, "--by-step", help="also print the lead (val and train loss) of each variant over the reference, "
                             "and of each pair, at every evaluation at a multiple of N steps"),
):
    """Train each variant and seed on the same batches, then tabulate val loss, the paired
    difference to the reference, routing sharpness and speed.

    compare --residual a,b,c compares modes; compare --study FILE runs a study file (see studies/).
    Any train option (--preset P, --max-iters 500, --n-layer 2, ...) applies to every run, on top of
    the study's [train] (a variant's own options and the sweep keep theirs). Finished runs in --out
    are reused and unfinished ones resumed when their recorded settings match the ones asked for
    (otherwise the command refuses, naming them), so an interrupted compare continues where it
    stopped.
    """
    if jobs < 1:
        raise ConfigError(f"--jobs {jobs} must be at least 1 (the runs trained at a time)")
    if clock not in ("wall", "cpu"):
        raise ConfigError(f"unknown --clock {clock!r}; choose wall or cpu")
    if speed_rounds is not None and speed_rounds < 0:
        raise ConfigError(f"--speed-rounds {speed_rounds} must be 0 (no timing) or more")
    if by_step < 0:
        raise ConfigError(f"--by-step {by_step} must be a number of steps (or 0: no lead by step)")
    if reprint and study is None:
        raise ConfigError("--reprint reads a study's results: give --study FILE")
    if reprint and (jobs != 1 or overwrite or dry_run or speed_rounds is not None):
        raise ConfigError("--reprint trains and times nothing: leave out --jobs, --overwrite, "
                          "--dry-run and --speed-rounds")
    from workbench import compare, study as study_files
    from plumbing.system import apply_process_settings
    plan = compare.study_of(study, residual, seeds, ctx.args)
    results = study.parent / "results" / f"{plan.name}.json" if study is not None else None
    if reprint:
        out = out or Path("runs") / f"{plan.name}-reprint"
        typer.echo(compare.reprint(plan, results, out, typer.echo, clock, by_step))
        typer.echo(f"\nwrote {out / 'compare.md'} and {out / 'compare.json'}")
        return
    if results is not None and compare.same_study(study_files.load_study(study).definition(),
                                                  plan.definition()):
        results = None  # the file's study with other options: not its results
        typer.echo(f"note: options beside --study change the study, so "
                   f"{study.parent / 'results'} is left as it is")
    out = out or Path("runs") / plan.name
    apply_process_settings(compare.process_config(plan))
    table = compare.run_study(plan, out, overwrite, typer.echo, dry_run, jobs, clock, speed_rounds,
                              results, by_step)
    if table is not None:
        typer.echo(table)
        typer.echo(f"\nwrote {out / 'compare.md'} and {out / 'compare.json'}")


@app.command("eval")
@friendly
def eval_command(
    ckpt: Path = typer.Option(..., "--ckpt", help="a checkpoint"),
    dataset: Optional[str] = typer.Option(
        None, "--dataset",
        help="a prepared dataset with the same tokenizer (default: the checkpoint's)"),
    eval_iters: int = typer.Option(
        20, "--eval-iters", help="fixed validation batches (as training's evaluation)"),
    batch_size: int = typer.Option(12, "--batch-size", help="sequences per batch"),
    data_dir: Optional[Path] = typer.Option(None, "--data-dir", help=DATA_DIR),
    device: str = typer.Option("cpu", "--device", help="cpu, cuda, mps"),
    threads: Optional[int] = THREADS,
):
    """Validation loss and perplexity of a checkpoint on fixed batches."""
    import sample
    from plumbing.system import choose_threads
    choose_threads(threads, "evaluating")
    name, loss, block_size = sample.evaluate_checkpoint(ckpt, dataset, eval_iters, batch_size,
                                                        data_dir, device)
    typer.echo(f"{name} val loss {loss:.4f}, perplexity {math.exp(loss):.3f} "
               f"({eval_iters} batches of {batch_size} x {block_size} tokens)")


@app.command("plan", context_settings=PASS_THROUGH, cls=TrainHelp)
@friendly
def plan_command(
    ctx: typer.Context,
    nproc: int = typer.Option(1, "--nproc", help="GPUs the run uses (torchrun's world size)"),
    gpu_memory: Optional[float] = typer.Option(
        None, "--gpu-memory", help="GiB per GPU (80 for an 80 GB A100 or H100): say whether it "
                                   "fits, and what would"),
    vocab_size: Optional[int] = typer.Option(
        None, "--vocab-size",
        help="the vocabulary [default: the prepared dataset's, else GPT-2's 50,304]"),
):
    """Memory per GPU of a training run: parameters, gradients, AdamW state, activations.

    Takes the train options (--preset, --residual, --batch-size, --block-size, --fsdp,
    --activation-checkpointing, --dtype, ...). Activations are the model's own saved tensors,
    measured on the CPU at small sizes and scaled (see docs/scaling.md). Nothing is trained and no
    GPU is needed.
    """
    import train
    from workbench import plan
    typer.echo(plan.plan_report(train.config_from_args(ctx.args), nproc, gpu_memory, vocab_size))


if __name__ == "__main__":
    app()
