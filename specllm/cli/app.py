"""The Typer application every command module registers on (kept apart so that commands import it
without importing the package that imports them)."""

from importlib import metadata
from typing import Annotated

import typer

class _FlagHelp:
    """--help takes no value, so its row shows none (Typer 0.29 builds it showing `<bool>`)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class Group(_FlagHelp, typer.core.TyperGroup):
    pass


class Command(_FlagHelp, typer.core.TyperCommand):
    """Every specllm command's class (`@app.command(cls=Command)`)."""


app = typer.Typer(
    name="specllm",
    help="Lossless speculative decoding for local GGUF models.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    cls=Group,
)


def flag(*names: str, help: str, **options) -> typer.models.OptionInfo:
    """An on/off option: given, it takes no value, so the help shows it none (Typer 0.29 shows `<bool>`,
    and a user typing `--json true` is refused)."""
    return typer.Option(*names, help=help, metavar="", **options)


def version_line() -> str:
    """specllm's version and the llama-cpp-python it runs on (whose llama.cpp decides the kernels), as installed."""

    def installed(package: str) -> str:
        try:
            return metadata.version(package)
        except metadata.PackageNotFoundError:
            return "not installed"

    return f"specllm {installed('specllm')} (llama-cpp-python {installed('llama-cpp-python')})"


def _print_version(asked: bool) -> None:
    if asked:
        print(version_line())
        raise typer.Exit()


@app.callback()
def before_any_command(
    version: Annotated[bool, flag("--version", is_eager=True, callback=_print_version, help="Print the version and exit.")] = False,
) -> None:
    """The options that come before a command (the help text is the app's)."""
