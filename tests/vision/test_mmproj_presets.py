"""The `mmproj` preset key and --models-dir's folders of GGUF files (llama.cpp's router layout:
a model and its `mmproj*.gguf` side by side), and the worker command line they give."""

from __future__ import annotations

from pathlib import Path

from router.lifecycle.modalities import modalities
from router.lifecycle.process import worker_argv
from router.presets import load_presets, scan_models_dir
from worker.testing.tiny_models import ModelPaths
from worker.testing.tiny_vlm import VlmPaths


def test_models_dir_folder_pairs_a_model_with_its_mmproj(tmp_path: Path, tiny_vlm: VlmPaths) -> None:
    folder = tmp_path / "smolvlm"
    folder.mkdir()
    (folder / "model-f32.gguf").symlink_to(tiny_vlm.gguf)
    (folder / "mmproj-model-f32.gguf").symlink_to(tiny_vlm.mmproj)
    (tmp_path / "mmproj-alone.gguf").symlink_to(tiny_vlm.mmproj)  # a projector alone is no model
    (tmp_path / "empty").mkdir()
    found = {p.name: p for p in scan_models_dir(tmp_path)}
    assert list(found) == ["smolvlm"]
    p = found["smolvlm"]
    assert p.model == (folder / "model-f32.gguf").resolve()
    assert p.mmproj == (folder / "mmproj-model-f32.gguf").resolve()
    argv = worker_argv(p, 8080, 1)
    assert argv[argv.index("--mmproj") + 1] == str(p.mmproj)
    assert modalities(p) == {"vision": True, "audio": False}


def test_mmproj_key_resolves_beside_the_preset_and_a_missing_one_fails_that_model(
    tmp_path: Path, tiny_vlm: VlmPaths
) -> None:
    (tmp_path / "proj.gguf").symlink_to(tiny_vlm.mmproj)
    preset = tmp_path / "p.ini"
    preset.write_text(f"[vlm]\nmodel = {tiny_vlm.gguf}\nmmproj = proj.gguf\n\n"
                      f"[broken]\nmodel = {tiny_vlm.gguf}\nmm = nowhere.gguf\n")
    got = {p.name: p for p in load_presets(preset)}
    assert got["vlm"].mmproj == (tmp_path / "proj.gguf").resolve() and got["vlm"].model_error is None
    assert got["broken"].model_error is not None and "mmproj path 'nowhere.gguf'" in got["broken"].model_error
    assert modalities(got["broken"]) == {"vision": False, "audio": False}


def test_an_idefics3_folder_on_the_torch_backend_takes_images(
    tmp_path: Path, tiny_vlm: VlmPaths, tiny_models: ModelPaths
) -> None:
    """No projector: the folder's config.json says (worker/protocol/modalities.py), as the worker
    loads its vision side; a text-only folder, or the VLM as an embedding model, does not."""
    preset = tmp_path / "p.ini"
    preset.write_text(f"[vlm]\nmodel = {tiny_vlm.hf_dir}\n\n[text]\nmodel = {tiny_models.hf_dir}\n\n"
                      f"[vlm-embed]\nmodel = {tiny_vlm.hf_dir}\nembedding = true\n")
    got = {p.name: modalities(p) for p in load_presets(preset)}
    assert got == {"vlm": {"vision": True, "audio": False}, "text": {"vision": False, "audio": False},
                   "vlm-embed": {"vision": False, "audio": False}}
