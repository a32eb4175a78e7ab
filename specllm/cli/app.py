"""The Typer application every command module registers on (kept apart so that commands import it
without importing the package that imports them)."""

import inspect
import sys
from importlib import metadata
from typing import Annotated

import typer

# click's exceptions as Typer raises them: its vendored click's (Typer >= 0.2x) or the installed one's
NoSuchOption = sys.modules[typer.BadParameter.__module__].NoSuchOption


class _FlagHelp:
    """--help takes no value, so its row shows none (Typer 0.29 builds it showing `<bool>`)."""

    def get_help_option(self, ctx):
        option = super().get_help_option(ctx)
        if option is not None:
            option.metavar = ""
        return option


class _SaysWhoseOption:
    """An unknown option that a command takes says whose it is: at the top level (`specllm --prompt
    hi`, the command left out) and in another command (`chat --raw`, where click's closest match
    among chat's own options, `--draft`, would mislead). Typos keep click's suggestions."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except NoSuchOption as exc:
            group = ctx if isinstance(self, Group) else ctx.parent
            owners = _commands_taking(group, exc.option_name)
            if not owners:
                raise
            message = f"No such option: {exc.option_name}; it is an option of {_join(owners)}"
            raise NoSuchOption(exc.option_name, message, ctx=ctx) from None


class Group(_SaysWhoseOption, _FlagHelp, typer.core.TyperGroup):
    pass


class Command(_SaysWhoseOption, _FlagHelp, typer.core.TyperCommand):
    """Every specllm command's class (`@app.command(cls=Command)`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.short_help is None and self.help:  # `specllm --help`'s row: the first paragraph, its lines joined (rich markup keeps them)
            self.short_help = " ".join(inspect.cleandoc(self.help).split("\n\n")[0].split())


def _commands_taking(group, option: str) -> list[str]:
    """The command paths (`specllm run`) of the group's visible commands that take `option`."""
    commands = getattr(group.command, "commands", {}) if group is not None else {}
    return [
        f"`{group.command_path} {name}`"
        for name, command in commands.items()
        if not command.hidden
        and any(option in (*param.opts, *param.secondary_opts) for param in command.params if not getattr(param, "hidden", False))
    ]


def _join(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


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
