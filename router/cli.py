"""`omni-router --preset FILE ...`: parse arguments and presets, then serve with uvicorn.
`omni-router profile-report DIR`: summarize a profiling run (router.observability.profile_report).

Bad arguments or a bad preset: one line on stderr (`omni-router: error: ...`) and exit 2.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from typer._click.exceptions import ClickException  # typer vendors its own click

from router.banner import banner
from router.discovery import Discovery
from router.keys.keyfile import KeyFileError
from router.presets import ModelPreset, PresetError, check_unique, load_presets, merge, scan_models_dir

if TYPE_CHECKING:
    import socket

    from router.lifecycle.gpu_admission import GpuPlacement
    from router.lifecycle.pool import Placement

cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


def default_data_dir() -> Path:
    """Where the router keeps its state (the Responses API store): the user's state dir."""
    state = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(state) / "omni-router"


def build_presets(
    preset: list[Path], models_dir: Path | None, overrides: dict[str, Any], *, has_ray: bool = False,
    discovery: Discovery | None = None,
) -> list[ModelPreset]:
    presets: list[ModelPreset] = []
    for path in preset:
        presets.extend(load_presets(path, overrides))
    check_unique(presets)
    if models_dir is not None:
        presets = merge(presets, scan_models_dir(models_dir, overrides))
    if discovery is not None:  # the hub cache, Ollama's store, LM Studio's folder (router/discovery)
        from router.discovery import discovered, merge_discovered

        presets = merge_discovered(presets, discovered(discovery, overrides))
    if not presets:
        raise PresetError("no models: give --preset FILE and/or --models-dir DIR, or pull one first "
                          "(omni-router pull ORG/REPO[:TAG])")
    if not has_ray:
        for p in presets:
            if p.placement == "ray" or p.ray_resources or p.ray_node_labels:
                raise PresetError(f"{p.source}: placement on Ray (placement, ray-resources, ray-node-labels) "
                                  "needs omni-router --ray ADDRESS (docs/ray.md)")
        return presets
    # On Ray the file must be on the nodes, not here: a node without it fails that load.
    return [replace(p, model_error=None) if p.placement != "local" and not p.is_remote else p
            for p in presets]


EPILOG = """\b
Other commands:
  omni-router profile-report DIR  per-request timelines and a per-stage
                                  summary of a profiling run (--help)
  omni-router pull REPO[:TAG]     a model from a Hugging Face hub into its
                                  cache; a preset's hf-repo serves it (--help)
  omni-router keys add NAME       add a key to a keys file (--keys FILE;
                                  --help)
\b
Presets take any omni-worker flag by its long name (temp = 0.7) and the
router's own keys (ttl, unload-after, load-timeout, stop-timeout, pin,
memory, alias, backend, cmd, upstream): see the README's first section."""


def raise_open_files_limit() -> tuple[int, int, int]:
    """Raise the soft RLIMIT_NOFILE to the hard one (the workers inherit it): a router holds a
    descriptor per client connection and one per request forwarded to a worker, and the usual
    soft default of 1,024 (or even 20,000) is the first wall under load. (soft before, soft
    now, hard); a failure to raise it leaves it as it was."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft, hard
        return soft, target, hard
    return soft, soft, hard


@cli.command(epilog=EPILOG)
def serve(
    preset: Annotated[
        list[Path],
        typer.Option(
            "--preset", "--models-preset", metavar="FILE", help="INI or TOML preset file (repeatable)"
        ),
    ] = [],  # noqa: B006  # typer copies it, never mutated
    models_dir: Annotated[
        Path | None, typer.Option(metavar="DIR", help="also serve every *.gguf / HF folder in DIR")
    ] = None,
    host: Annotated[str, typer.Option(help="bind address")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535)] = 8080,
    models_max: Annotated[int, typer.Option(min=0, help="models loaded at once (0 = unlimited)")] = 4,
    models_autoload: Annotated[bool, typer.Option("--models-autoload/--no-models-autoload")] = True,
    sleep_idle_seconds: Annotated[
        float,
        typer.Option(
            min=-1,
            help="idle seconds before a worker sleeps (0 or -1: "
            "never, as omni-worker's -1); per model: `ttl`",
        ),
    ] = 0.0,
    unload_idle_seconds: Annotated[
        float,
        typer.Option(
            min=-1, help="idle seconds before a worker (awake or asleep) is stopped (0 or -1: never)"
        ),
    ] = 0.0,
    ram_budget: Annotated[
        str,
        typer.Option(
            help="host RAM the workers may use: SIZE (512M, 20GiB), 0 = no limit, "
            "auto = total less 10% (at least 1 GiB)"
        ),
    ] = "auto",
    vram_budget: Annotated[
        str,
        typer.Option(
            help="GPU memory the workers may use: SIZE, 0 = no limit, "
            "auto = total less 10% (no limit without a GPU); with the GPU placement (GPUs, no --ray): "
            "on each GPU, and auto = no cap beyond --gpu-reserve"
        ),
    ] = "auto",
    gpu_reserve: Annotated[str, typer.Option(
        metavar="SIZE|N%", help="GPU memory kept free on each device (the GPU placement's one headroom: "
        "a model fits a device when its share is at most the free memory less this; 0: all of it)",
    )] = "1GiB",
    placement: Annotated[str, typer.Option(
        "--placement", metavar="spread|binpack", help="a model that fits one GPU goes to the one with the "
        "most free memory (spread) or the least that fits (binpack) (docs/gpu-placement.md)",
    )] = "spread",
    max_queue: Annotated[int, typer.Option(min=0, help="requests allowed to wait for a model")] = 256,
    # -- the swap scheduler (router/lifecycle/swap.py, docs/internals.md "Swaps")
    swap_policy: Annotated[str, typer.Option(
        metavar="fair|fifo|fifo-batch", help="which waiting model loads next and when a busy one is swapped "
        "out: fair (serve the loaded model first, within the bounds below); fifo (requests in arrival order, "
        "a swap for each head of the queue); fifo-batch (the model of the oldest waiting "
        "request loads and serves all of its queued requests) (docs/swaps.md)",
    )] = "fair",
    swap_max_wait: Annotated[float, typer.Option(
        min=0, help="seconds a waiting model may wait for a busy one before it is swapped out for it",
    )] = 10.0,
    swap_max_passes: Annotated[int, typer.Option(
        min=0, help="loads of other models a waiting model may see before a busy one is swapped out for it",
    )] = 3,
    forward_margin: Annotated[int, typer.Option(
        min=0, help="requests forwarded to one of our workers beyond its slots; the rest wait in the router",
    )] = 2,
    max_connections: Annotated[int, typer.Option(
        min=0, help="client connections held at once, past it a 503 (0: from the open-files limit, "
        "docs/reliability.md)",
    )] = 0,
    api_key: Annotated[list[str], typer.Option(help="required bearer key (repeatable): an admin key")] = [],  # noqa: B006  # typer copies it, never mutated
    keys: Annotated[Path | None, typer.Option(
        "--keys", metavar="FILE", help="keys file (TOML): roles, models, limits per key; reloaded with the "
        "presets (`omni-router keys add --help`, docs/keys.md)")] = None,
    cors_origin: Annotated[list[str], typer.Option(help="allowed CORS origin (repeatable, * for any)")] = [],  # noqa: B006  # typer copies it, never mutated
    ctx_size: Annotated[int | None, typer.Option("--ctx-size", "-c", help="override for every model")] = None,
    parallel: Annotated[
        int | None, typer.Option("--parallel", "-np", help="override for every model")
    ] = None,
    n_gpu_layers: Annotated[
        int | None, typer.Option("--n-gpu-layers", "-ngl", help="override for every model")
    ] = None,
    threads: Annotated[int | None, typer.Option("--threads", "-t", help="override for every model")] = None,
    data_dir: Annotated[
        Path | None,
        typer.Option(help="state dir (Responses API store) [default: $XDG_STATE_HOME/omni-router]"),
    ] = None,
    responses_max_entries: Annotated[
        int, typer.Option(min=0, help="stored responses (and conversations) kept; 0 = store nothing")
    ] = 10000,
    responses_ttl: Annotated[
        float, typer.Option(min=0, help="seconds a stored response is kept (0: no expiry)")
    ] = 30 * 24 * 3600.0,
    max_body_size: Annotated[
        int, typer.Option(min=0, help="largest request body in bytes, larger is a 413 (0 = no limit)")
    ] = 100 * 1024 * 1024,
    ray: Annotated[
        str | None,
        typer.Option(
            "--ray", metavar="ADDRESS",
            help="place workers on a Ray cluster (auto, ray://HOST:10001 or HOST:6379): every model "
            "but placement = local ones (docs/ray.md; pip install omni-router[ray])",
        ),
    ] = None,
    discover_hub_cache: Annotated[bool, typer.Option(
        "--discover-hub-cache/--no-discover-hub-cache",
        help="serve every GGUF repo in the Hugging Face cache as org/repo:TAG")] = True,
    discover_ollama: Annotated[bool, typer.Option(
        "--discover-ollama/--no-discover-ollama",
        help="serve Ollama's models (~/.ollama/models, $OLLAMA_MODELS) as name:tag")] = True,
    discover_lmstudio: Annotated[bool, typer.Option(
        "--discover-lmstudio/--no-discover-lmstudio",
        help="serve LM Studio's models (~/.lmstudio/models) as publisher/repo:TAG")] = True,
    log_level: Annotated[str, typer.Option(metavar="debug|info|warning|error")] = "info",
    version: Annotated[
        bool,
        typer.Option(
            "--version",
            is_eager=True,
            callback=lambda v: _print_version(v),
            help="print the version and exit",
        ),
    ] = False,
) -> None:
    """One OpenAI-compatible endpoint for many models."""
    overrides = {"ctx-size": ctx_size, "parallel": parallel, "n-gpu-layers": n_gpu_layers, "threads": threads}
    from router.prompt_cache_dir import with_default_cache_dirs

    has_ray = ray is not None
    state_dir = data_dir or default_data_dir()
    discovery = Discovery(discover_hub_cache, discover_ollama, discover_lmstudio)
    presets = with_default_cache_dirs(
        build_presets(preset, models_dir, overrides, has_ray=has_ray, discovery=discovery), state_dir)
    from router.lifecycle.memory import budget, gpu_total_bytes, host_total_bytes

    budgets = []
    for flag, raw, total in (("--ram-budget", ram_budget, host_total_bytes), ("--vram-budget", vram_budget,
                                                                             gpu_total_bytes)):
        try:
            budgets.append(budget(raw, total() if raw.strip().lower() == "auto" else None))
        except ValueError as e:
            raise typer.BadParameter(str(e), param_hint=flag) from None
    gpus = _gpu_placement(gpu_reserve, placement, vram_budget) if ray is None else None
    if gpus is not None:
        budgets[1] = 0  # --vram-budget applies per device (router.lifecycle.gpu_book)
    if log_level.lower() not in ("debug", "info", "warning", "error"):
        raise typer.BadParameter("expected one of debug, info, warning, error", param_hint="--log-level")
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    logging.getLogger("httpcore").setLevel(logging.INFO)  # --log-level debug: not a line per /health poll
    from router.keys.keyfile import load_keyring

    keyring = load_keyring(keys, api_key)  # a bad file: KeyFileError, one line and exit 2
    for line in banner(presets, host, port, has_api_key=keyring.is_enabled, log_level=log_level.lower(),
                       gpus=gpus.inventory.gpus if gpus is not None else (), gpu_reserve=gpu_reserve):
        logging.getLogger("omni.router").info("%s", line)
    soft, new_soft, hard = raise_open_files_limit()
    logging.getLogger("omni.router").info(
        "open files: soft limit %s%s, hard limit %s (each streamed request holds a client and a "
        "worker connection)", soft, f" -> {new_soft}" if new_soft != soft else "", hard)

    import uvicorn

    from router.http import connection_budget
    from router.http.app import ResponsesConfig, RouterApp

    if not max_connections:
        unbounded = any(p.backend in ("cmd", "remote") for p in presets)
        max_connections = connection_budget.connection_budget(new_soft, unbounded_upstreams=unbounded)
    logging.getLogger("omni.router").info("connection budget: %d client connections (past it, a 503)",
                                          max_connections)
    connection_budget.install()
    from router.lifecycle.pool import Pool, PoolConfig
    from router.lifecycle.swap import POLICIES, SwapRule

    if swap_policy not in POLICIES:
        raise typer.BadParameter(f"{swap_policy!r} is not one of {', '.join(POLICIES)}",
                                 param_hint="--swap-policy")
    config = PoolConfig(
        swap=SwapRule(swap_policy, swap_max_wait, swap_max_passes),  # type: ignore[arg-type]  # checked above
        models_max=models_max,
        max_queue=max_queue,
        forward_margin=forward_margin,
        sleep_idle_seconds=sleep_idle_seconds,
        unload_idle_seconds=unload_idle_seconds,
        ram_budget=budgets[0],
        vram_budget=budgets[1],
        autoload=models_autoload,
    )
    responses = ResponsesConfig(state_dir, responses_max_entries, responses_ttl)
    where: Placement | None = _join_ray(ray) if ray is not None else gpus
    pool = Pool(presets, config, source=lambda: with_default_cache_dirs(
        build_presets(preset, models_dir, overrides, has_ray=has_ray, discovery=discovery), state_dir),
        placement=where)
    app = RouterApp(
        pool, api_keys=api_key, cors_origins=cors_origin, responses=responses, max_body_size=max_body_size,
        keys_file=keys,
    )
    import uvicorn.config

    class Server(uvicorn.Server):
        async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
            # The event streams end first (router.endless): the graceful wait that follows
            # is then for the requests that end by themselves, not a fixed 3 s per open web UI.
            app.endless.close()
            await super().shutdown(sockets)

    server = Server(uvicorn.Config(
        app, host=host, port=port, loop=_best("uvloop", "asyncio"), http=_best("httptools", "h11"),
        log_level=log_level.lower(), access_log=False, timeout_keep_alive=75, lifespan="on",
        proxy_headers=False, server_header=False, date_header=False, timeout_graceful_shutdown=3,
        limit_concurrency=max_connections))
    with contextlib.suppress(KeyboardInterrupt):  # what uvicorn.run does around it
        server.run()
    if not server.started:
        sys.exit(uvicorn.config.STARTUP_FAILURE)


report_cli = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None)


@report_cli.command()
def profile_report(
    directory: Annotated[Path, typer.Argument(help="the event_dir of a profiling run")],
    run_id: Annotated[str | None, typer.Option(help="only this run's events")] = None,
    timelines: Annotated[
        bool, typer.Option("--timelines/--no-timelines", help="one timeline per request")
    ] = True,
) -> None:
    """Per-request timelines and a per-stage summary of `/start_profile` events."""
    from router.observability.profile_report import load_events, write_report
    from router.observability.profile_report import timelines as build_timelines

    if not directory.is_dir():
        raise typer.BadParameter(f"{directory} is not a directory", param_hint="DIR")
    events = load_events(directory, run_id)
    if not events:
        raise typer.BadParameter(f"no events_*.jsonl events in {directory}", param_hint="DIR")
    write_report(build_timelines(events), sys.stdout, with_timelines=timelines)


def _print_version(is_asked: bool) -> None:
    if is_asked:
        from importlib.metadata import PackageNotFoundError
        from importlib.metadata import version as package_version

        try:
            print(f"omni-router {package_version('omni-router')}")
        except PackageNotFoundError:  # run from a checkout that was not installed
            print("omni-router (not installed: version unknown)")
        raise typer.Exit(0)


def _join_ray(address: str) -> Placement:
    """Connect to the Ray cluster as a driver; a clear error when ray is missing or unreachable."""
    try:
        from router.placement.ray_cluster import RayPlacement, connect
    except ImportError as e:
        raise typer.BadParameter(f"needs ray ({e}): pip install 'omni-router[ray]'",
                                 param_hint="--ray") from None
    try:
        connect(address)
    except Exception as e:  # ConnectionError, or Ray's own errors: one line, exit 2
        raise typer.BadParameter(f"cannot join the Ray cluster at {address!r}: {e}",
                                 param_hint="--ray") from None
    return RayPlacement()


def _gpu_placement(reserve_raw: str, strategy: str, vram_budget: str) -> GpuPlacement | None:
    """The GPU placement when this box has NVIDIA GPUs (read now, blocking: before serving); else None
    and nothing changes. Checks --gpu-reserve and --placement either way."""
    from router.lifecycle.gpu_admission import GpuPlacement
    from router.lifecycle.gpu_book import DeviceBook, parse_reserve
    from router.lifecycle.gpu_placement import STRATEGIES
    from router.lifecycle.gpus import read_inventory
    from router.presets import parse_size

    try:
        reserve = parse_reserve(reserve_raw)
    except ValueError as e:
        raise typer.BadParameter(str(e), param_hint="--gpu-reserve") from None
    if strategy not in STRATEGIES:
        raise typer.BadParameter(f"expected one of {', '.join(STRATEGIES)}", param_hint="--placement")
    inventory = read_inventory()
    if inventory is None:
        return None
    per_device = 0 if vram_budget.strip().lower() == "auto" else parse_size(vram_budget)
    return GpuPlacement(read_inventory, inventory, DeviceBook(reserve, per_device),
                        "binpack" if strategy == "binpack" else "spread")


def _best(preferred: str, fallback: str) -> str:
    try:
        __import__(preferred)
        return preferred
    except ImportError:
        return fallback


def main(argv: list[str] | None = None) -> None:
    args = argv if argv is not None else sys.argv[1:]
    prog = "omni-router"
    if args[:1] == ["profile-report"]:  # a subcommand beside the default `serve` (no name)
        command = typer.main.get_command(report_cli)
        args, prog = args[1:], "omni-router profile-report"
    elif args[:1] == ["pull"]:  # a model from a hub into its cache (router/hub/pull_cli.py)
        from router.hub.pull_cli import pull_cli

        command = typer.main.get_command(pull_cli)
        args, prog = args[1:], "omni-router pull"
    elif args[:1] == ["keys"]:  # `omni-router keys add NAME ...` (router.keys.cli)
        from router.keys.cli import keys_cli

        command = typer.main.get_command(keys_cli)
        args, prog = args[1:], "omni-router keys"
    else:
        command = typer.main.get_command(cli)
    try:
        code = command.main(args=args, prog_name=prog, standalone_mode=False)
        if isinstance(code, int) and code:  # a typer.Exit(code) (click returns it without standalone mode)
            sys.exit(code)
    except typer.Exit as e:
        sys.exit(e.exit_code)
    except typer.Abort:
        sys.exit(130)
    except ClickException as e:
        print(f"omni-router: error: {e.format_message()}", file=sys.stderr)
        sys.exit(2)
    except (PresetError, KeyFileError) as e:
        print(f"omni-router: error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
