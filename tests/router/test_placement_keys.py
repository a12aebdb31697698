"""Issue 27's pure parts: the placement preset keys, which Ray nodes may take a model, a node's
budgets, and that a single-box router never imports ray."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from router.lifecycle.eviction import Limits, Need, Occupancy
from router.placement.nodes import GIB, Node, can_take, from_ray, limits_of, need_on, none_can_take, reserved
from router.presets import ModelPreset, PresetError, load_presets
from tests.util import ROOT, free_port


@pytest.fixture
def gguf(tmp_path: Path) -> Path:
    p = tmp_path / "m.gguf"
    p.write_bytes(b"GGUF")
    return p


def one(tmp_path: Path, text: str, suffix: str) -> ModelPreset:
    path = tmp_path / f"p{suffix}"
    path.write_text(text)
    (preset,) = load_presets(path)
    return preset


@pytest.mark.parametrize(("suffix", "body"), [
    (".toml", '[models.a]\nmodel = "{m}"\nplacement = "ray"\nray-resources = {{GPU = 1, vram_gib = 24}}\n'
              'ray-node-labels = {{zone = "a", tier = 2}}\n'),
    (".ini", "[a]\nmodel = {m}\nplacement = ray\nray-resources = GPU=1, vram_gib=24\n"
             "ray-node-labels = zone=a,tier=2\n"),
    (".ini", '[a]\nmodel = {m}\nplacement = RAY\nray_resources = {{"vram_gib": 24, "GPU": 1}}\n'
             'ray-node-labels = {{"tier": 2, "zone": "a"}}\n'),
])
def test_placement_keys_in_toml_ini_and_json(tmp_path: Path, gguf: Path, suffix: str, body: str) -> None:
    p = one(tmp_path, body.format(m=gguf), suffix)
    assert p.placement == "ray"
    assert p.ray_resources == (("GPU", 1.0), ("vram_gib", 24.0))
    assert p.ray_node_labels == (("tier", "2"), ("zone", "a"))


@pytest.mark.parametrize(("body", "pattern"), [
    ('placement = "cloud"',
     r"models\.a\.placement: invalid value 'cloud' for 'placement': expected one of local, ray"),
    ("ray-resources = {GPU = -1}", r"resource 'GPU': expected a number >= 0"),
    ('ray-resources = {GPU = "lots"}', r"resource 'GPU': expected a number, got 'lots'"),
    ('placement = "local"\nray-resources = {GPU = 1}', r"'ray-resources' needs placement = \"ray\""),
    ('placement = "local"\nray-node-labels = {zone = "a"}', r"'ray-node-labels' needs placement = \"ray\""),
])
def test_placement_key_errors_name_the_key(tmp_path: Path, gguf: Path, body: str, pattern: str) -> None:
    with pytest.raises(PresetError, match=pattern):
        one(tmp_path, f'[models.a]\nmodel = "{gguf}"\n{body}\n', ".toml")


def test_placement_does_not_apply_to_remote(tmp_path: Path) -> None:
    with pytest.raises(PresetError, match="'placement' does not apply to backend = remote"):
        one(tmp_path, '[models.a]\nbackend = "remote"\nupstream = "http://h:1"\nplacement = "ray"\n', ".toml")


def test_ray_keys_without_ray_are_refused_at_startup(tmp_path: Path, gguf: Path) -> None:
    path = tmp_path / "p.toml"
    path.write_text(f'[models.a]\nmodel = "{gguf}"\nray-resources = {{GPU = 1}}\n')
    proc = subprocess.run([sys.executable, "-m", "router.cli", "--preset", str(path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "needs omni-router --ray ADDRESS" in proc.stderr


def test_a_single_box_router_never_imports_ray() -> None:
    code = ("import sys, router.cli, router.http.app, router.lifecycle.pool, router.placement.nodes; "
            "sys.exit('ray' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT, timeout=60).returncode == 0


A = Node("a" * 56, "10.0.0.1", {"CPU": 8, "GPU": 1, "vram_gib": 24, "memory": 64 * GIB}, {"zone": "a"})
B = Node("b" * 56, "10.0.0.2", {"CPU": 8, "vram_gib": 8, "memory": 16 * GIB}, {"zone": "b"})


@pytest.mark.parametrize(("resources", "labels", "expected"), [
    ((), (), ["a", "b"]),
    ((("vram_gib", 20.0),), (), ["a"]),
    ((("GPU", 1.0),), (("zone", "b"),), []),
    ((("vram_gib", 4.0),), (("zone", "b"),), ["b"]),
    ((("tpu", 1.0),), (), []),
])
def test_which_nodes_may_take_a_model(resources: tuple[tuple[str, float], ...],
                                      labels: tuple[tuple[str, str], ...], expected: list[str]) -> None:
    p = ModelPreset("m", ray_resources=resources, ray_node_labels=labels)
    assert [n.node_id[0] for n in (A, B) if can_take(n, p)] == expected


def test_none_can_take_gives_the_figures() -> None:
    p = ModelPreset("m", ray_resources=(("vram_gib", 64.0),), ray_node_labels=(("zone", "a"),))
    assert none_can_take([A, B], p) == (
        "no node of the Ray cluster has vram_gib=64 with labels zone=a (ray-resources / ray-node-labels; "
        "the nodes: 10.0.0.1/aaaaaaaa: CPU=8, GPU=1, vram_gib=24; 10.0.0.2/bbbbbbbb: CPU=8, vram_gib=8)")


def test_a_node_budgets_and_what_a_model_is_charged_there() -> None:
    assert limits_of(A, Limits(4, 32 * GIB, 0)) == Limits(4, 32 * GIB, 24 * GIB)  # capped by --ram-budget
    assert limits_of(B, Limits(0, 32 * GIB, 0)) == Limits(0, 16 * GIB, 8 * GIB)  # by the node's memory
    assert limits_of(Node("c", "x", {}), Limits(0, 0, 5)) == Limits(0, 0, 5)  # nothing declared
    p = ModelPreset("m", ray_resources=(("vram_gib", 6.0),))
    assert need_on(p, Need(100, 0)) == Need(100, 6 * GIB)
    assert need_on(p, Need(100, 7 * GIB)) == Need(100, 7 * GIB)  # the estimate is larger

    class Held:
        preset = p

        def occupancy(self) -> Occupancy:
            return Occupancy("m", True, False, 0, 0.0, ram_bytes=5, vram_bytes=1)

    assert reserved(Held()).vram_bytes == 6 * GIB  # type: ignore[arg-type]  # a stand-in for a ModelHandle


def test_from_ray_keeps_alive_nodes_in_a_stable_order() -> None:
    entries = [{"NodeID": "z1", "Alive": True, "NodeManagerAddress": "h", "Resources": {"CPU": 1.0},
                "Labels": {"zone": "b"}},
               {"NodeID": "a1", "Alive": False, "NodeManagerAddress": "h"},
               {"NodeID": "m1", "Alive": True, "NodeManagerAddress": "h", "Resources": None}]
    assert [(n.node_id, dict(n.labels)) for n in from_ray(entries)] == [("m1", {}), ("z1", {"zone": "b"})]


def test_an_unreachable_ray_address_is_one_line_and_exit_2(tmp_path: Path, gguf: Path) -> None:
    pytest.importorskip("ray", reason="the ray extra is not installed")
    path = tmp_path / "p.toml"
    path.write_text(f'[models.a]\nmodel = "{gguf}"\n')
    address = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = subprocess.run([sys.executable, "-m", "router.cli", "--preset", str(path), "--ray", address],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert f"cannot join the Ray cluster at '{address}': nothing answers at {address}" in proc.stderr
