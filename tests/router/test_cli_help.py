"""`--help` of both CLIs at 80 columns (issue 25: flag names were cut, `--n-predict,--p…`, and
choices shown as `<str>`), `--version`, and one "never" for the idle timers on both sides."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.util import ROOT

CLIS = {"omni-router": "router.cli", "omni-worker": "worker.server.cli"}


def _run(module: str, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "80", "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", module, *args], capture_output=True, text=True, env=env, cwd=ROOT, timeout=60
    )


@pytest.mark.parametrize("module", CLIS.values())
def test_help_fits_80_columns_with_every_flag_name_whole(module: str) -> None:
    out = _run(module, "--help")
    assert out.returncode == 0, out.stderr
    assert "…" not in out.stdout and "╭" not in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) <= 80
    assert "--version" in out.stdout


def test_worker_help_shows_choices_not_str() -> None:
    text = " ".join(_run("worker.server.cli", "--help").stdout.split())  # (help text wraps)
    for choices in ("auto|on|off", "auto|llama_cpp|torch", "auto|deepseek|deepseek-legacy|none", "N|auto|all",
                    "none|mean|cls|last|rank"):
        assert choices in text
    for flag in (
        "--n-predict, --predict",
        "--temp, --temperature",
        "--reasoning-format",
        "--chat-template-file",
    ):
        assert flag in text
    assert "0 or -1: never" in text


def test_router_help_names_profile_report_and_the_same_never() -> None:
    text = " ".join(_run("router.cli", "--help").stdout.split())
    assert "omni-router profile-report DIR" in text and "0 or -1:" in text


@pytest.mark.parametrize(("name", "module"), CLIS.items())
def test_version(name: str, module: str) -> None:
    out = _run(module, "--version")
    assert out.returncode == 0 and out.stdout.startswith(f"{name} ")
