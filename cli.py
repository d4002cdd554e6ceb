"""delta-gpt command line: prepare data, train, sample, inspect routing, convert, compare.

    python cli.py prepare                      # embedded Shakespeare, character level
    python cli.py train --residual delta       # the cpu preset on a machine without CUDA
    python cli.py COMMAND --help               # every command documents its options

Bad input ends with one line on stderr and exit status 1, never a traceback.
"""
import functools
import sys
from pathlib import Path
from typing import Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help=__doc__.split("\n")[0])


@app.callback()
def main():
    """delta-gpt: Delta Attention Residuals beside AttnRes and the plain residual, nanoGPT-sized."""


def fail(message: str) -> None:
    """Print one clear line and exit 1."""
    typer.echo(f"error: {message}", err=True)
    raise typer.Exit(1)


def friendly(fn):
    """Turn the project's bad-input errors (ValueError and its subclasses, missing files) into one line."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except (ValueError, FileNotFoundError) as e:
            fail(str(e))
    return wrapper


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


if __name__ == "__main__":
    app()
