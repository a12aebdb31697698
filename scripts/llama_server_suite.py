#!/usr/bin/env python3
"""Run llama.cpp's own server test-suite (tools/server/tests) against omni-worker or llama-server.

    .venv/bin/python scripts/llama_server_suite.py                       # the whole suite, ours
    .venv/bin/python scripts/llama_server_suite.py unit/test_tokenize.py
    .venv/bin/python scripts/llama_server_suite.py -k "grammar or json_schema" unit/test_chat_completion.py
    .venv/bin/python scripts/llama_server_suite.py --server llama-server unit/test_chat_completion.py
    .venv/bin/python scripts/llama_server_suite.py --json out.json ... -- -x -v    # after --: to pytest

Test ids are relative to the suite's directory (unit/test_x.py::test_y[...]). What it does:

1. The suite comes from the llama-cpp-python sdist pinned in pyproject.toml (its vendored llama.cpp is
   the one our worker links). If third_party/llama-cpp-python-<v>/vendor/llama.cpp/tools/server/tests
   is missing, the sdist is fetched like scripts/build_llama_server.sh does (`pip download
   llama-cpp-python==<v> --no-deps --no-binary :all:` into third_party/dist) and only tools/server/tests
   is extracted, with models/templates (the chat templates test_template.py and test_tool_call.py
   read). If that fails: exit 3 (EXIT_UNAVAILABLE).
2. LLAMA_SERVER_BIN_PATH points at a generated two-line shell wrapper (a temp dir) that runs
   scripts/llama_server_shim.py with this Python: it maps llama-server's flags to omni-worker's and
   puts the local GGUF (--model, default models/tiny-llama-f32.gguf) in place of the hub models the
   suite names. `--server llama-server` runs the reference binary (third_party/llama-server-build-<v>,
   scripts/build_llama_server.sh) through the same shim, so it gets the same model.
3. pytest runs with this Python in the suite's directory, on a free PORT, with this module loaded as
   a pytest plugin (-p llama_server_suite) that
   - makes the suite's session fixture `load_server_presets` a no-op: it calls
     `ServerPreset.load_all()`, which starts every preset once with --offline off to download its
     model from the hub. There is no env var or option for that, so the plugin replaces
     `utils.ServerPreset.load_all` once the suite's conftest has imported `utils`; their files are
     not touched.
   - puts an inert `wget` module in sys.modules when the package is not installed: utils.py imports
     it at the top but uses it only in download_file() (tests that download media, which cannot
     work here anyway). Its download() raises. Other missing packages are not stubbed: a test
     module that imports one fails to collect and shows up as an error. (aiohttp and pytest-xdist,
     in their requirements.txt, are imported by none of the unit tests.)
   - makes `utils.download_file` answer the LoRA adapter the suite downloads from the hub with a
     local stand-in (`lora_stand_in`): test_lora.py's Shakespeare adapter for stories15M_MOE ->
     models/tiny-lora-suite-lora.gguf when the model is models/tiny-lora-suite-f32.gguf (made to
     answer test_lora.py's words, worker/testing/tiny_lora.py), else
     models/tiny-llama-lora-a.gguf (an adapter of the tiny model); env OMNI_SUITE_LORA names
     another. Any other download goes to the real function (and fails offline). So:
         scripts/llama_server_suite.py --model models/tiny-lora-suite-f32.gguf unit/test_lora.py
   - stops a test after --test-timeout seconds (120; SIGALRM, like pytest-timeout's signal method):
     the suite's own request timeout is 600 s and its streaming requests have none, so a server
     that never answers would otherwise hold the run for ten minutes per test. The test fails with
     TestTimeout and its teardown stops the server.
   - appends every test's outcome to a report as it goes (a run killed halfway still reports), for
     the table printed at the end (and --json).
   pytest runs in its own process group, with the servers it starts: --timeout for the whole run,
   Ctrl-C or SIGTERM stop the group (SIGTERM, then SIGKILL).
4. Exit status: pytest's (0: all passed, 1: some failed, 5: nothing collected), 124 past --timeout,
   3 if the suite could not be fetched, 2 for a usage error.

Most of the suite asserts on the text or the token counts of its own models (stories260K), so it
fails on both servers with our tiny model; compare against `--server llama-server` to tell a gap of
ours from a test that cannot pass here. tests/yardstick/test_llama_server_suite.py does that for the
grammar / json_schema / response_format tests.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tarfile
import tempfile
import tomllib
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
THIRD_PARTY = ROOT / "third_party"
SHIM = ROOT / "scripts" / "llama_server_shim.py"
DEFAULT_MODEL = ROOT / "models" / "tiny-llama-f32.gguf"
SUITE_SUBDIR = Path("vendor/llama.cpp/tools/server/tests")
# What is extracted from the sdist: the suite, and the chat templates that test_template.py and
# test_tool_call.py read from ../../../models/templates.
EXTRACTED = (SUITE_SUBDIR, Path("vendor/llama.cpp/models/templates"))
EXIT_USAGE = 2
EXIT_UNAVAILABLE = 3
LORA_URL_NAME = "moe_shakespeare15M.gguf"  # test_lora.py's adapter (the URL's file name)


def lora_stand_in(model: str | None) -> Path:
    """The local adapter in place of test_lora.py's: env OMNI_SUITE_LORA, else the one of `model`."""
    if env := os.environ.get("OMNI_SUITE_LORA"):
        return Path(env).resolve()
    is_suite = model is not None and Path(model).name == "tiny-lora-suite-f32.gguf"
    return ROOT / "models" / ("tiny-lora-suite-lora.gguf" if is_suite else "tiny-llama-lora-a.gguf")

REPORT_ENV = "OMNI_SUITE_REPORT"  # where the plugin appends its results (JSON lines)
TEST_TIMEOUT_ENV = "OMNI_SUITE_TEST_TIMEOUT"  # seconds one test may run (the plugin's alarm)
DEFAULT_TEST_TIMEOUT = 120.0


class SuiteUnavailable(Exception):
    """The test-suite is not on disk and could not be fetched."""


# ---------------------------------------------------------------- fetching the suite


def pinned_version() -> str:
    """llama-cpp-python's version: env LLAMA_CPP_PYTHON_VERSION, else pyproject's `==` pin."""
    if v := os.environ.get("LLAMA_CPP_PYTHON_VERSION"):
        return v
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    for dep in deps:
        if m := re.fullmatch(r"llama-cpp-python==([\w.]+)", dep.replace(" ", "")):
            return m.group(1)
    raise SuiteUnavailable("pyproject.toml pins no llama-cpp-python==VERSION")


def suite_dir(version: str) -> Path:
    return THIRD_PARTY / f"llama-cpp-python-{version}" / SUITE_SUBDIR


def reference_binary(version: str) -> Path:
    return THIRD_PARTY / f"llama-server-build-{version}" / "bin" / "llama-server"


def ensure_suite(version: str) -> Path:
    """The suite's directory, fetched and extracted (its files only) if it is not there yet."""
    src = THIRD_PARTY / f"llama-cpp-python-{version}"
    if all((src / d).is_dir() for d in EXTRACTED):
        return suite_dir(version)
    sdist = fetch_sdist(version)
    top = f"llama_cpp_python-{version}"
    print(f"[suite] extracting {', '.join(map(str, EXTRACTED))} from {sdist}", file=sys.stderr)
    with tempfile.TemporaryDirectory(dir=THIRD_PARTY) as tmp:
        try:
            with tarfile.open(sdist) as tar:
                prefixes = tuple(f"{top}/{d.as_posix()}/" for d in EXTRACTED)
                members = [m for m in tar.getmembers() if m.name.startswith(prefixes)]
                if not members:
                    raise SuiteUnavailable(f"{sdist} has none of {prefixes}")
                tar.extractall(tmp, members=members, filter="data")
        except (tarfile.TarError, OSError) as e:
            raise SuiteUnavailable(f"cannot extract {sdist}: {e}") from None
        for d in EXTRACTED:
            if (src / d).is_dir():
                continue
            (src / d).parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(Path(tmp) / top / d), src / d)
    return suite_dir(version)


def fetch_sdist(version: str) -> Path:
    """third_party/dist/llama_cpp_python-<v>.tar.gz, downloaded with pip if missing."""
    dist = THIRD_PARTY / "dist"
    sdist = dist / f"llama_cpp_python-{version}.tar.gz"
    if sdist.exists():
        return sdist
    dist.mkdir(parents=True, exist_ok=True)
    print(f"[suite] downloading llama-cpp-python=={version} sdist", file=sys.stderr)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
         "--no-binary", ":all:", "-d", str(dist)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, check=False)
    if proc.returncode != 0 or not sdist.exists():
        raise SuiteUnavailable(f"pip download llama-cpp-python=={version} failed:\n{proc.stdout[-2000:]}")
    return sdist


# ---------------------------------------------------------------- running it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def write_wrapper(directory: Path) -> Path:
    """An executable that runs the shim with this Python (the suite execs LLAMA_SERVER_BIN_PATH as is)."""
    path = directory / "llama-server"
    path.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {shlex.quote(str(SHIM))} "$@"\n')
    path.chmod(0o755)
    return path


def suite_env(server: str, model: Path, wrapper: Path, report: Path, test_timeout: float,
              version: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items() if k not in ("DEBUG", "DEBUG_EXTERNAL", "OMNI_SHIM_LLAMA_SERVER")
    }
    env.update(
        {
            "LLAMA_SERVER_BIN_PATH": str(wrapper),
            "OMNI_SHIM_MODEL": str(model),
            "PORT": str(free_port()),
            "PYTHONPATH": os.pathsep.join(
                filter(None, [str(Path(__file__).parent), os.environ.get("PYTHONPATH")])
            ),
            REPORT_ENV: str(report),
            TEST_TIMEOUT_ENV: str(test_timeout),
        }
    )
    if server == "llama-server":
        env["OMNI_SHIM_LLAMA_SERVER"] = str(reference_binary(version))
    return env


@dataclass(frozen=True)
class Result:
    nodeid: str
    outcome: str  # passed | failed | error (collection, setup or teardown) | skipped
    message: str


def read_report(path: Path) -> list[Result]:
    """The plugin's JSON lines; a test's last line wins (a teardown error after a pass)."""
    if not path.exists():
        return []
    by_id = {r["nodeid"]: r for r in map(json.loads, path.read_text().splitlines())}
    return [Result(**r) for r in by_id.values()]


def run_pytest(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float | None) -> int:
    """pytest in its own process group (the servers it starts are in it too): on a timeout, Ctrl-C or
    SIGTERM the whole group gets SIGTERM, then SIGKILL if it lingers."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, start_new_session=True)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        print(f"[suite] pytest ran past --timeout {timeout:g}s: stopping it", file=sys.stderr)
        return 124
    finally:
        signal.signal(signal.SIGTERM, previous)
        if proc.poll() is None:
            for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 5.0)):
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(grace)
                    break
                except ProcessLookupError:
                    break
                except subprocess.TimeoutExpired:
                    continue


def run_suite(
    server: str,
    model: Path,
    tests: list[str],
    keyword: str | None,
    version: str,
    *,
    test_timeout: float = DEFAULT_TEST_TIMEOUT,
    timeout: float | None = None,
) -> tuple[int, list[Result]]:
    """Run pytest on the suite; (pytest's exit status, or 124 past `timeout`; one result per test)."""
    directory = ensure_suite(version).resolve()  # nodeids are relative to it: no symlinks
    if server == "llama-server" and not reference_binary(version).exists():
        raise SystemExit(
            f"{reference_binary(version)} not found: build it with scripts/build_llama_server.sh"
        )
    with tempfile.TemporaryDirectory(prefix="llama-server-suite-") as tmp:
        report = Path(tmp) / "report.jsonl"
        env = suite_env(server, model, write_wrapper(Path(tmp)), report, test_timeout, version)
        cmd = [sys.executable, "-m", "pytest", "-p", "llama_server_suite", "-p", "no:cacheprovider",
               "-p", "no:asyncio", "-c", str(directory / "pytest.ini"), "--rootdir", str(directory),
               "-o", "addopts=", "-rN", *(["-k", keyword] if keyword else []), *(tests or ["unit"])]
        print(f"[suite] {server} on {model.name}: {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
        rc = run_pytest(cmd, directory, env, timeout)
        return rc, read_report(report)


def print_table(server: str, results: list[Result]) -> None:
    width = max((len(r.nodeid) for r in results), default=10)
    print(f"\nllama.cpp server tests against {server}:")
    for r in results:
        why = f"  {r.message}" if r.outcome != "passed" and r.message else ""
        print(f"{r.outcome.upper():<8} {r.nodeid:<{width}}{why}".rstrip())
    counts = {o: sum(r.outcome == o for r in results) for o in ("passed", "failed", "error", "skipped")}
    print(", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests ran")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--server", choices=("ours", "llama-server"), default="ours")
    p.add_argument("--model", type=Path, default=Path(os.environ.get("OMNI_SHIM_MODEL") or DEFAULT_MODEL),
                   help="the GGUF every test runs on (default: models/tiny-llama-f32.gguf)")
    p.add_argument("-k", dest="keyword", default=None, help="pytest -k expression")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--test-timeout", type=float, default=DEFAULT_TEST_TIMEOUT,
                   help="seconds one test may run (0: no limit; the suite's own request timeout is 600 s)")
    p.add_argument("--timeout", type=float, default=None, help="seconds for the whole run")
    p.add_argument("--fetch-only", action="store_true", help="make sure the suite is on disk, print its path")
    p.add_argument(
        "tests", nargs="*", help="test ids relative to the suite (default: unit); after --, pytest options"
    )
    args = p.parse_args(argv)
    try:
        version = pinned_version()
        if args.fetch_only:
            print(ensure_suite(version))
            return 0
        if not args.model.exists():
            print(f"model {args.model} not found: `make models`", file=sys.stderr)
            return EXIT_USAGE
        rc, results = run_suite(args.server, args.model.resolve(), args.tests, args.keyword, version,
                                test_timeout=args.test_timeout, timeout=args.timeout)
    except SuiteUnavailable as e:
        print(f"llama.cpp server test-suite unavailable: {e}", file=sys.stderr)
        return EXIT_UNAVAILABLE
    print_table(args.server, results)
    if args.json:
        args.json.write_text(json.dumps([r.__dict__ for r in results], indent=2))
    return rc


# ---------------------------------------------------------------- the pytest plugin (-p llama_server_suite)
# Loaded into the suite's pytest process (its env carries REPORT_ENV); nothing above runs there.


def _install_wget_stub() -> None:
    try:
        import wget  # noqa: F401  # only checks that it is installed
    except ImportError:
        def download(url: str, out: str | None = None) -> str:
            raise RuntimeError(f"no downloads under llama_server_suite (wget is not installed): {url}")

        stub = types.ModuleType("wget")
        stub.download = download  # type: ignore[attr-defined]
        sys.modules["wget"] = stub


if os.environ.get(REPORT_ENV):
    _install_wget_stub()

_outcomes: dict[str, str] = {}  # nodeid -> the outcome recorded so far


def pytest_sessionstart(session: Any) -> None:
    """No model downloads: the suite's conftest calls ServerPreset.load_all() once per session."""
    utils = sys.modules.get("utils") or importlib.import_module("utils")  # the suite's utils.py
    utils.ServerPreset.load_all = staticmethod(lambda: None)
    real_download = utils.download_file

    def download_file(url: str, output_file_path: str | None = None) -> str:
        if url.rsplit("/", 1)[-1] == LORA_URL_NAME:
            return str(lora_stand_in(os.environ.get("OMNI_SHIM_MODEL")))
        return str(real_download(url, output_file_path))

    utils.download_file = download_file


class TestTimeout(Exception):
    """The test ran past TEST_TIMEOUT_ENV seconds (a server that never answers: the suite's own
    request timeout is 600 s, and its streaming requests have none)."""


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item: Any) -> Any:
    """SIGALRM interrupts a blocked request in the main thread; teardown then stops the server."""
    seconds = float(os.environ.get(TEST_TIMEOUT_ENV) or 0)

    def on_alarm(signum: int, frame: Any) -> None:
        raise TestTimeout(f"no result after {seconds:g}s (--test-timeout)")

    previous = signal.signal(signal.SIGALRM, on_alarm) if seconds > 0 else None
    if seconds > 0:
        signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        if seconds > 0:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)


def _message(report: Any) -> str:
    crash = getattr(getattr(report, "longrepr", None), "reprcrash", None)
    if crash is not None:
        text = str(crash.message)
    elif isinstance(report.longrepr, tuple):  # a skip: (path, line, reason)
        text = str(report.longrepr[2])
    else:
        text = str(report.longrepr or "")
    return " ".join(text.split())[:300]


def _record(nodeid: str, outcome: str, message: str) -> None:
    """Append to the report at once: a run killed halfway still reports what it ran."""
    _outcomes[nodeid] = outcome
    with open(os.environ[REPORT_ENV], "a") as f:
        f.write(json.dumps({"nodeid": nodeid, "outcome": outcome, "message": message}) + "\n")


def pytest_runtest_logreport(report: Any) -> None:
    """One result per test: its first failure or skip, else passed once its call passed."""
    if _outcomes.get(report.nodeid, "passed") != "passed" or not os.environ.get(REPORT_ENV):
        return
    if report.failed:
        _record(report.nodeid, "failed" if report.when == "call" else "error", _message(report))
    elif report.skipped:
        _record(report.nodeid, "skipped", _message(report))
    elif report.when == "call":
        _record(report.nodeid, "passed", "")


def pytest_collectreport(report: Any) -> None:
    if report.failed and os.environ.get(REPORT_ENV):
        _record(report.nodeid, "error", _message(report))


if __name__ == "__main__":
    sys.exit(main())
