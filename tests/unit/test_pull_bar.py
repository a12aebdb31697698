"""`omni-router pull`'s progress (router/hub/pull_cli.py): a redrawn bar on a terminal, a line per
tenth otherwise."""

from __future__ import annotations

import io

from router.hub.download import Progress
from router.hub.pull_cli import Bar


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_lines_one_per_tenth() -> None:
    out = io.StringIO()
    bar = Bar(out, "o/r:Q8_0")
    for done in range(0, 1001, 50):
        bar(Progress(done, 1000, "r-Q8_0.gguf"))
    bar.close()
    lines = out.getvalue().splitlines()
    assert [line.split(":")[2].split()[0] for line in lines] == [f"{p}%" for p in range(0, 101, 10)]
    assert lines[-1] == "pulling o/r:Q8_0: 100% (1000 of 1000 bytes) r-Q8_0.gguf"


def test_a_terminal_gets_one_redrawn_line() -> None:
    out = Tty()
    bar = Bar(out, "o/r")
    bar(Progress(250, 1000, "f"))
    bar(Progress(1000, 1000, "f"))
    bar.close()
    text = out.getvalue()
    assert text.count("\n") == 1 and text.startswith("\ro/r [") and "100%" in text.rsplit("\r", 1)[1]
