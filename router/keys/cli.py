"""`omni-router keys add NAME [--role user|admin] [--models M]... [--rpm N] [--tpm N]
[--concurrency N] [--file keys.toml]`: make a key, append its SHA-256 to the file, print the key
once (it is stored nowhere). The router reads the file with `--keys FILE` and again on
`POST /models/reload` or SIGHUP."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from router.keys.keyfile import KeyFileError, Role, add_key

keys_cli = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Manage the keys file (--keys FILE).",
)


@keys_cli.callback()
def _group() -> None:
    """Manage the keys file (--keys FILE)."""  # a callback: `add` stays a named subcommand


@keys_cli.command("add")
def add(
    name: Annotated[str, typer.Argument(help="the key's name (metrics, /keys/usage, the audit log)")],
    role: Annotated[
        str, typer.Option(metavar="user|admin", help="admin: every route; user: inference and listing")
    ] = "user",
    models: Annotated[
        list[str],
        typer.Option(
            "--models",
            "--model",
            metavar="NAME|GLOB",
            help="a model it may use (repeatable, or comma-separated; default: all)",
        ),
    ] = [],  # noqa: B006  # typer copies it
    rpm: Annotated[int | None, typer.Option(min=1, help="requests per minute")] = None,
    tpm: Annotated[int | None, typer.Option(min=1, help="tokens per minute")] = None,
    concurrency: Annotated[int | None, typer.Option(min=1, help="requests at once")] = None,
    queue: Annotated[int | None, typer.Option(min=0, help="requests waiting past --concurrency (64)")] = None,
    file: Annotated[Path, typer.Option("--file", metavar="FILE", help="the keys file")] = Path("keys.toml"),
) -> None:
    """Add a key: prints it once; the file keeps only its hash."""
    if role not in (Role.ADMIN.value, Role.USER.value):
        raise typer.BadParameter("expected user or admin", param_hint="--role")
    names = [m.strip() for spec in models for m in spec.split(",") if m.strip()]
    try:
        plain = add_key(
            file,
            name,
            Role(role),
            names,
            {"rpm": rpm, "tpm": tpm, "concurrency": concurrency, "queue": queue},
        )
    except KeyFileError as e:
        raise typer.BadParameter(str(e), param_hint="NAME or --file") from None
    typer.echo(plain)
    typer.echo(f"added key {name!r} ({role}) to {file}; it is shown only now", err=True)
