"""Options and helpers shared by the `diag` commands."""

from __future__ import annotations

import functools
import shlex
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import click
import typer
import yaml
from rich.console import Console
from rich.markup import escape

from submerge.diagnostics import demo
from submerge.diagnostics.data import parse_named
from submerge.diagnostics.errors import SubmergeError

# soft_wrap: a message is one logical line the terminal wraps, so a long path in it stays whole (rich would break
# it at the console width, 80 columns when the output is not a terminal); tables still fit the width
console = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

# ------------------------------------------------------------------ --config run.yaml


def load_config(ctx: click.Context, param, value: Optional[Path]):
    """Read a YAML file whose keys are the command's option names; command-line options win."""
    if value is None:
        return value
    path = Path(value)
    if not path.exists():
        raise typer.BadParameter(f"config file {path} not found")
    try:
        content = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise typer.BadParameter(f"{path} is not valid YAML: {exc}") from exc
    if not isinstance(content, dict):
        raise typer.BadParameter(f"{path} must hold a mapping of option names to values")
    defaults = {}
    for key, item in content.items():
        name = key.replace("-", "_")
        if isinstance(item, dict):  # finetuned: {math: path} → ["math=path"]
            item = [f"{k}={v}" for k, v in item.items()]
        defaults[name] = item
    known = {p.name: p.name for p in ctx.command.params}  # option names (--out) map to parameters (out_path)
    known.update({o[2:].replace("-", "_"): p.name for p in ctx.command.params for o in p.opts if o.startswith("--")})
    unknown = sorted(set(defaults) - set(known))
    if unknown:
        raise typer.BadParameter(f"{path}: unknown option(s) {unknown} for `diag {ctx.command.name}`")
    ctx.default_map = {**(ctx.default_map or {}), **{known[k]: v for k, v in defaults.items()}}
    return value


ConfigOption = Annotated[
    Optional[Path],
    typer.Option("--config", help="YAML file with any of this command's options (names as keys).",
                 callback=load_config, is_eager=True, expose_value=False),
]

def command_line() -> str:
    return " ".join(shlex.quote(a) for a in ["diag", *sys.argv[1:]])


def user_errors(function):
    """Turn `SubmergeError`s (bad input) into one clear message and exit code 2."""

    @functools.wraps(function)
    def wrapper(*args, **kwargs):
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("default")
                for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
                    warnings.simplefilter("ignore", category)
                return function(*args, **kwargs)
        except SubmergeError as exc:
            console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)  # a "[...]" is not markup
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            console.print("[yellow]interrupted[/]: finished modules are saved; run the same command to resume.")
            raise typer.Exit(130) from None

    return wrapper


def resolve_inputs(model: Optional[str], finetuned: Optional[list[str]], data: Optional[list[str]],
                   *, need_data: bool = True) -> tuple[str, dict[str, str], dict[str, str]]:
    """The base / fine-tunes / data the user named, or the embedded demo kit when no --model."""

    named_finetuned = parse_named(finetuned, "finetuned")
    named_data = parse_named(data, "data")
    if model is None:
        if named_finetuned:
            raise typer.BadParameter("--finetuned given without --model; name the base model too")

        console.print("[bold]No --model: using the embedded demo kit[/] (SmolLM2-135M-Instruct and LoRA fine-tunes "
                      f"on {', '.join(demo.DEMO_TASKS)}).")
        model = str(demo.ensure_demo_base(console))
        named_finetuned = {task: str(path) for task, path in demo.demo_adapters().items()}
        if need_data and not named_data:
            named_data = {task: str(path) for task, path in demo.ensure_demo_data(console).items()}
    return model, named_finetuned, named_data
