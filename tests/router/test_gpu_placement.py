"""GPU placement, the pure parts: the policy (router.lifecycle.gpu_placement), the per-device book
(router.lifecycle.gpu_book) and the inventory's parsing (router.lifecycle.gpus). Tables, no I/O."""

from __future__ import annotations

import pytest

from router.lifecycle.eviction import Occupancy
from router.lifecycle.gpu_admission import ask_for, on_devices
from router.lifecycle.gpu_book import DeviceBook, Reserve, parse_reserve
from router.lifecycle.gpu_placement import Ask, Device, Evict, NoRoom, Place, Resident, Wait, place
from router.lifecycle.gpus import Gpu, GpuProcess, Inventory, _visible, parse_gpus, parse_processes
from router.presets import ModelPreset

G = 1 << 30
M = 1 << 20


def dev(index: int, free_gib: float, total_gib: float = 24, reserve_gib: float = 0) -> Device:
    return Device(index, f"GPU{index}", int(total_gib * G), int(free_gib * G), int(reserve_gib * G))


def ask(vram_gib: float, **kw: object) -> Ask:
    return Ask("m", int(vram_gib * G), **kw)  # type: ignore[arg-type]


def idle(name: str, shares: dict[int, float], last_used: float = 0.0) -> Resident:
    return Resident(name, tuple((i, int(g * G)) for i, g in shares.items()), is_evictable=True,
                    last_used=last_used)


def busy(name: str, shares: dict[int, float]) -> Resident:
    return Resident(name, tuple((i, int(g * G)) for i, g in shares.items()), is_evictable=False, is_busy=True)


TWO = [dev(0, 10), dev(1, 6)]


@pytest.mark.parametrize(("devices", "residents", "asked", "expected"), [
    # one device that fits: spread takes the most room, binpack the least that still fits
    (TWO, [], ask(5), Place((0,), (5 * G,))),
    (TWO, [], ask(5, strategy="binpack"), Place((1,), (5 * G,))),
    (TWO, [], ask(8, strategy="binpack"), Place((0,), (8 * G,))),
    # the reserve is kept free on each device: 6 - 1.5 < 5, so only GPU 0
    ([dev(0, 10, reserve_gib=1.5), dev(1, 6, reserve_gib=1.5)], [], ask(5, strategy="binpack"),
     Place((0,), (5 * G,))),
    # a split over two, in proportion to their room (10 : 6)
    (TWO, [], ask(12), Place((0, 1), (int(12 * G * 10 / 16), int(12 * G * 6 / 16)), (0.625, 0.375))),
    # the fewest devices: two of three suffice, those with the most room
    ([dev(0, 4), dev(1, 9), dev(2, 7)], [], ask(12),
     Place((1, 2), (int(12 * G * 9 / 16), int(12 * G * 7 / 16)), (0.562, 0.438))),
    # explicit devices, as given, even where another has more room
    (TWO, [], ask(2, devices=(1,)), Place((1,), (2 * G,))),
    (TWO, [], ask(4, devices=(0, 1)),
     Place((0, 1), (int(4 * G * 10 / 16), int(4 * G * 6 / 16)), (0.625, 0.375))),
])
def test_placement_table(devices: list[Device], residents: list[Resident], asked: Ask,
                         expected: Place) -> None:
    got = place(devices, residents, asked)
    assert isinstance(got, Place)
    assert (got.devices, got.tensor_split, got.warning) == (expected.devices, expected.tensor_split, None)
    assert all(abs(a - b) <= 1 for a, b in zip(got.shares, expected.shares, strict=True))


def test_overhead_is_charged_on_every_device_of_a_split() -> None:
    got = place(TWO, [], ask(13, overhead_bytes=G))  # 12 GiB to split, 1 GiB on each device
    assert isinstance(got, Place) and got.devices == (0, 1)
    assert got.tensor_split == (0.643, 0.357)  # (10 - 1) : (6 - 1)
    assert abs(got.shares[0] - (G + 12 * G * 9 // 14)) <= 1
    assert abs(got.shares[1] - (G + 12 * G * 5 // 14)) <= 1


def test_explicit_devices_that_do_not_fit_are_used_with_a_warning() -> None:
    got = place(TWO, [], ask(8, devices=(1,)))
    assert isinstance(got, Place) and got.devices == (1,)
    assert got.warning is not None and "devices = [1]" in got.warning and "does not fit" in got.warning


def test_explicit_devices_this_box_does_not_have_are_refused() -> None:
    got = place(TWO, [], ask(1, devices=(3,)))
    assert isinstance(got, NoRoom) and "GPU 3" in got.reason and "GPUs: 0, 1" in got.reason


def test_torch_does_not_split_so_it_needs_one_device() -> None:
    assert isinstance(place(TWO, [], ask(12, can_split=False)), NoRoom)
    assert place(TWO, [], ask(9, can_split=False)) == Place((0,), (9 * G,))


def test_eviction_on_the_device_that_needs_room_and_no_other() -> None:
    # GPU 0 has 2 GiB free with `a` (idle, 6 GiB) on it; GPU 1 has 3 GiB free with `b` (idle, 4 GiB,
    # used longer ago). 7.5 GiB fits GPU 0 once `a` is gone, never GPU 1: `b` (older) is not touched.
    devices = [dev(0, 2), dev(1, 3)]
    residents = [idle("a", {0: 6}, last_used=20), idle("b", {1: 4}, last_used=10)]
    assert place(devices, residents, ask(7.5, can_split=False)) == Evict(("a",), (0,))
    # where either would do, the least recently used goes
    assert place(devices, residents, ask(7, can_split=False)) == Evict(("b",), (1,))


def test_eviction_takes_the_least_recently_used_first_and_only_as_many_as_needed() -> None:
    devices = [dev(0, 1)]
    residents = [idle("new", {0: 4}, last_used=30), idle("old", {0: 4}, last_used=10),
                 idle("mid", {0: 4}, last_used=20)]
    assert place(devices, residents, ask(8)) == Evict(("old", "mid"), (0,))


def test_busy_models_holding_the_room_mean_wait_pinned_ones_mean_no_room() -> None:
    devices = [dev(0, 1)]
    assert isinstance(place(devices, [busy("a", {0: 8})], ask(6)), Wait)
    pinned = Resident("p", ((0, 8 * G),), is_evictable=False, is_busy=False)
    assert isinstance(place(devices, [pinned], ask(6)), NoRoom)


def test_a_model_larger_than_all_devices_together_gets_the_figures() -> None:
    got = place([dev(0, 20, reserve_gib=1), dev(1, 18, reserve_gib=1)], [], ask(60))
    assert isinstance(got, NoRoom)
    for text in ("needs ~60.0 GiB", "more than all the GPUs together",
                 "GPU 0 (GPU0): 20.0 GiB free of 24.0 GiB", "1.0 GiB reserved",
                 "GPU 1 (GPU1): 18.0 GiB free", "room in all 36.0 GiB"):
        assert text in got.reason


def test_fit_partial_puts_the_layers_that_fit_on_the_device_with_most_room() -> None:
    # 32 layers of 0.5 GiB each (+1 GiB overhead); GPU 0 has 9 GiB: 16 layers fit
    got = place([dev(0, 9), dev(1, 4)], [], ask(17, overhead_bytes=G, n_layers=32))
    assert isinstance(got, Place) and got.devices == (0,) and got.n_gpu_layers == 16
    assert got.shares == (G + 8 * G,) and got.warning is not None and "16 of 32 layers" in got.warning


def test_the_per_device_budget_caps_room() -> None:
    budgeted = [Device(0, "a", 24 * G, 20 * G, 0, budget_left=4 * G), Device(1, "b", 24 * G, 6 * G)]
    assert place(budgeted, [], ask(5)) == Place((1,), (5 * G,))


# ---- the per-device book


def inv(*gpus: tuple[int, float, float], procs: tuple[GpuProcess, ...] = ()) -> Inventory:
    found = tuple(Gpu(i, f"GPU-{i}", f"Card {i}", int(t * G), int(u * G)) for i, t, u in gpus)
    return Inventory(found, procs, "test")


def test_free_memory_counts_other_processes_as_taken_and_our_bookings_and_measures_for_ours() -> None:
    book = DeviceBook(Reserve(bytes=G))
    book.book("a", Place((0,), (4 * G,)))
    # GPU 0: 10 GiB used, 3 of them by our processes (a, measured); the other 7 are someone else's
    devices = book.devices(inv((0, 24, 10), (1, 24, 0)), {0: 3 * G}, up=())
    assert devices[0].free_bytes == 24 * G - 7 * G - 4 * G  # a loading: the larger of booked and measured
    assert devices[0].room == devices[0].free_bytes - G and devices[1].free_bytes == 24 * G
    book.measure("a", {0: 3 * G})
    up = book.devices(inv((0, 24, 10)), {0: 3 * G}, up={"a"})
    assert up[0].free_bytes == 24 * G - 7 * G - 3 * G  # once it runs, the measure replaces the estimate


def test_residents_are_the_booked_models_with_what_they_hold() -> None:
    book = DeviceBook()
    book.book("a", Place((0, 1), (3 * G, 2 * G), (0.6, 0.4)))
    occupancies = [Occupancy("a", True, False, 0, 5.0), Occupancy("b", True, False, 0, 1.0),
                   Occupancy("c", True, False, 2, 1.0)]
    book.book("c", Place((1,), (G,)))
    residents = book.residents(occupancies)
    assert residents == [Resident("a", ((0, 3 * G), (1, 2 * G)), True, False, 5.0),
                         Resident("c", ((1, G),), False, True, 1.0)]
    book.book("queued", Place((0,), (G,)))  # placed, waiting for a slot: loading, so busy
    assert book.residents(occupancies, asking="c")[-1] == Resident("queued", ((0, G),), False, True)
    assert [r.name for r in book.residents(occupancies, asking="queued")] == ["a", "c"]
    book.forget("a")
    assert book.charge("a", True) == {}


@pytest.mark.parametrize(("raw", "total", "expected"), [
    ("0", 80 * G, 0), ("1GiB", 80 * G, G), ("512M", 8 * G, 512 * M), ("10%", 80 * G, 8 * G),
    ("2.5 %", 40 * G, G),
])
def test_gpu_reserve_is_a_size_or_a_percentage_of_each_device(raw: str, total: int, expected: int) -> None:
    assert parse_reserve(raw).of(total) == expected


@pytest.mark.parametrize("raw", ["lots", "100%", "-1G"])
def test_a_bad_gpu_reserve_says_what_is_expected(raw: str) -> None:
    with pytest.raises(ValueError, match=r"size|percentage"):
        parse_reserve(raw)


# ---- the inventory's parsing and the worker's start


def test_nvidia_smi_rows_parse_and_bad_rows_are_skipped() -> None:
    gpus = parse_gpus("1, GPU-bbb, NVIDIA A10, 23028, 1000\n"
                      "0, GPU-aaa, NVIDIA H100 80GB HBM3, 81559, 0\nbad\n")
    assert gpus == (Gpu(0, "GPU-aaa", "NVIDIA H100 80GB HBM3", 81559 * M, 0), Gpu(1, "GPU-bbb", "NVIDIA A10",
                                                                                   23028 * M, 1000 * M))
    assert parse_processes("123, GPU-aaa, 500\n7, GPU-bbb, [N/A]\n") == (GpuProcess(123, "GPU-aaa", 500 * M),)


def test_use_of_pids_is_by_device_and_the_routers_cuda_visible_devices_limits_the_devices() -> None:
    i = inv((0, 24, 1), (1, 24, 1), procs=(GpuProcess(5, "GPU-0", G), GpuProcess(5, "GPU-1", 2 * G),
                                           GpuProcess(6, "GPU-1", G)))
    assert i.use_of({5}) == {0: G, 1: 2 * G}
    assert [g.index for g in _visible(i, "1").gpus] == [1]
    assert [g.index for g in _visible(i, "GPU-0").gpus] == [0]
    assert _visible(i, "").gpus == ()


def gguf(**kw: object) -> ModelPreset:
    return ModelPreset("m", backend="llama_cpp", **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize(("preset", "where", "env", "args"), [
    (gguf(), Place((1,), (G,)), {"CUDA_VISIBLE_DEVICES": "1"}, {"split-mode": "none"}),
    (gguf(), Place((0, 2), (G, G), (0.7, 0.3)), {"CUDA_VISIBLE_DEVICES": "0,2"}, {"tensor-split": "0.7,0.3"}),
    # the preset's own settings are kept
    (gguf(worker_args=(("tensor-split", "1,1"),)), Place((0, 2), (G, G), (0.7, 0.3)),
     {"CUDA_VISIBLE_DEVICES": "0,2"}, {"tensor-split": "1,1"}),
    (gguf(worker_args=(("split-mode", "row"),)), Place((3,), (G,)), {"CUDA_VISIBLE_DEVICES": "3"},
     {"split-mode": "row"}),
    (gguf(env=(("CUDA_VISIBLE_DEVICES", "GPU-x"),)), Place((0,), (G,)), {"CUDA_VISIBLE_DEVICES": "GPU-x"},
     {"split-mode": "none"}),
    (ModelPreset("t", backend="torch"), Place((2,), (G,)), {"CUDA_VISIBLE_DEVICES": "2"}, {}),  # its cuda:0
])
def test_the_worker_is_started_on_its_devices(preset: ModelPreset, where: Place, env: dict[str, str],
                                              args: dict[str, str]) -> None:
    started = on_devices(preset, where)
    assert {**dict(started.env)} == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", **env}
    assert dict(started.worker_args) == args


def test_a_partial_fit_sets_the_layers_and_a_cpu_model_is_not_placed() -> None:
    assert on_devices(gguf(), Place((0,), (G,), n_gpu_layers=12)).n_gpu_layers == 12
    assert ask_for(gguf(n_gpu_layers=0), 0, "spread") is None
    asked = ask_for(gguf(vram=3 * G), 0, "binpack")
    assert asked is not None
    assert (asked.vram_bytes, asked.can_split, asked.strategy) == (3 * G, True, "binpack")
    assert ask_for(ModelPreset("t", backend="torch", devices=(1,)), 0, "spread") == Ask(
        "t", 0, 0, (1,), can_split=False)


# ---- the worker's own flags for it (llama-server's spellings)


@pytest.mark.parametrize(("raw", "expected"), [
    (None, ()), ("3,1", (3.0, 1.0)), ("0.625,0.375", (0.625, 0.375)), ("1/1/2", (1.0, 1.0, 2.0))])
def test_the_workers_tensor_split_reads_llama_servers_forms(raw: str | None,
                                                            expected: tuple[float, ...]) -> None:
    from worker.server.cli import _tensor_split

    assert _tensor_split(raw) == expected


@pytest.mark.parametrize("raw", ["a,b", "-1,2", "0,0"])
def test_a_bad_tensor_split_or_split_mode_is_refused_by_name(raw: str) -> None:
    import typer

    from worker.server.cli import _split_mode, _tensor_split

    with pytest.raises(typer.BadParameter, match="non-negative numbers"):
        _tensor_split(raw)
    with pytest.raises(typer.BadParameter, match="none, layer, row"):
        _split_mode("rows")
    assert _split_mode(None) == "layer" and _split_mode("none") == "none"
