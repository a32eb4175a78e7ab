"""The Typer application every command module registers on (kept apart so that commands import it
without importing the package that imports them)."""

import typer

app = typer.Typer(
    name="specllm",
    help="Lossless speculative decoding for local GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
