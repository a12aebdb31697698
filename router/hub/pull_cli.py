"""`omni-router pull REPO[:TAG]`: a model from a Hugging Face-style hub into the hub cache.

A progress bar on a terminal (one line, redrawn), plain lines otherwise (one per tenth, for
logs and CI). Exit 0 with where the model is and the preset lines that serve it; 1 with one
line on a failed pull (404 lists the tags there are); 2 on a malformed reference.
"""

from __future__ import annotations

import sys
import time
from typing import Annotated, TextIO

import typer

from router.hub.choice import parse_ref
from router.hub.download import HubError, Progress, pull

pull_cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


class Bar:
    """Progress as a redrawn bar (a terminal) or a line per tenth (anything else)."""

    def __init__(self, out: TextIO, name: str) -> None:
        self.out, self.name = out, name
        self.is_tty = out.isatty()
        self.tenth = -1
        self.started = time.monotonic()
        self.drawn = 0.0

    def __call__(self, p: Progress) -> None:
        frac = p.done / p.total if p.total else 1.0
        if self.is_tty:
            if time.monotonic() - self.drawn < 0.1 and p.done < p.total:
                return
            self.drawn = time.monotonic()
            width = 30
            fill = int(frac * width)
            rate = p.done / max(time.monotonic() - self.started, 1e-3)
            self.out.write(f"\r{self.name} [{'#' * fill}{'.' * (width - fill)}] {frac:4.0%} "
                           f"{_mb(p.done)} / {_mb(p.total)} {_mb(int(rate))}/s ")
            self.out.flush()
            return
        tenth = int(frac * 10)
        if tenth != self.tenth:
            self.tenth = tenth
            print(f"pulling {self.name}: {frac:.0%} ({p.done} of {p.total} bytes) {p.file}", file=self.out,
                  flush=True)

    def close(self) -> None:
        if self.is_tty:
            self.out.write("\n")
            self.out.flush()


@pull_cli.command()
def pull_command(
    reference: Annotated[str, typer.Argument(
        metavar="REPO[:TAG]",
        help="org/repo, with a quantisation tag (Q4_K_M, q8_0, ...; default Q4_K_M, then Q8_0, "
        "then the first)")],
    hf_file: Annotated[str | None, typer.Option("--hf-file", "-hff", help="that file of the repo")] = None,
) -> None:
    """Pull a model into the Hugging Face cache (HF_ENDPOINT, HF_HUB_CACHE, HF_HOME, HF_TOKEN,
    HF_HUB_OFFLINE are honoured); a preset then serves it with `hf-repo = "REPO[:TAG]"`."""
    try:
        ref = parse_ref(reference, hf_file)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="REPO[:TAG]") from None
    bar = Bar(sys.stderr, str(ref))
    try:
        got = pull(ref, bar)
    except HubError as e:
        bar.close()
        print(f"omni-router pull: error: {e}", file=sys.stderr)
        raise typer.Exit(1) from None
    bar.close()
    print(f"{got.name}: {got.model}" + (f" (projector {got.mmproj.name})" if got.mmproj else ""))
    print(f"serve it with a preset:  [models.NAME]  hf-repo = \"{ref}\""
          + (f"  hf-file = \"{ref.file}\"" if ref.file else ""))
