"""LoRA on the torch backend, at the backend: a PEFT folder applied in the forward pass (never
merged) gives the logits of the model with the adapter merged into its weights, to 1e-4; scale 0
is the base model bitwise; an adapter made for another model is refused with the reason."""

from __future__ import annotations

import pytest
import torch

from tests.util import ROOT
from worker.backends.base import BatchEntry, DecodeStatus
from worker.backends.lora import LoraError
from worker.backends.torch_backend import TorchBackend
from worker.testing.tiny_lora import lora_paths, merged_paths
from worker.testing.tiny_models import ModelPaths

TOL = 1e-4
PROMPT = [5, 17, 300, 42, 7, 99, 512, 3, 8, 64, 128, 256]
MODELS = ROOT / "models"


def backend(path: str, kernels: bool = True) -> TorchBackend:
    return TorchBackend(path, n_ctx=256, n_slots=2, n_batch=64, device="cpu", cpu_kernels=kernels)


def logits(b: TorchBackend, seq: int = 0) -> torch.Tensor:
    b.seq_rm(seq, 0)
    assert b.decode([BatchEntry(seq, PROMPT, 0, True)]) is DecodeStatus.OK
    assert b.decode([BatchEntry(seq, [11], len(PROMPT), True)]) is DecodeStatus.OK  # a decode row too
    return b._logits[0].clone()


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "torch-ops"])
def test_lora_scale_1_gives_the_merged_models_logits(tiny_loras: ModelPaths, kernels: bool) -> None:
    b = backend(str(tiny_loras.hf_dir), kernels)
    base = logits(b)
    assert b.load_lora(str(lora_paths(MODELS, "a").peft)) == ("", "")
    b.set_lora(((0, 1.0),))
    adapted = logits(b)
    merged = logits(backend(str(merged_paths(MODELS)[0]), kernels))
    torch.testing.assert_close(adapted, merged, atol=TOL, rtol=0)
    assert (adapted - base).abs().max() > 1.0, "the adapter changes the logits"
    b.set_lora(())
    assert torch.equal(logits(b), base), "no adapter set: the base model, bitwise"


def test_two_adapters_and_scales_add_their_updates(tiny_loras: ModelPaths) -> None:
    """Scale s of one adapter is s times its update; a set of two adds both (linear in each
    projection, so the logits are close to, not equal to, a mix: checked at the update)."""
    b = backend(str(tiny_loras.hf_dir))
    b.load_lora(str(lora_paths(MODELS, "a").peft))
    b.load_lora(str(lora_paths(MODELS, "b").peft))
    layer = b._require_model().layers[0]
    x = torch.randn(3, b.cfg.hidden_size)
    updates = {}
    for key in (((0, 1.0),), ((0, 0.5),), ((1, 1.0),), ((0, 1.0), (1, 1.0))):
        b.set_lora(key)
        a, bb = layer.lora["qkv"]
        updates[key] = (x @ a.t()) @ bb.t()
    torch.testing.assert_close(updates[((0, 0.5),)], 0.5 * updates[((0, 1.0),)], atol=1e-5, rtol=0)
    torch.testing.assert_close(updates[((0, 1.0), (1, 1.0))], updates[((0, 1.0),)] + updates[((1, 1.0),)],
                               atol=1e-5, rtol=0)


def test_an_adapter_for_another_base_model_is_refused_with_the_reason(tiny_loras: ModelPaths) -> None:
    b = backend(str(tiny_loras.hf_dir))
    with pytest.raises(LoraError, match="made for another base model"):
        b.load_lora(str(lora_paths(MODELS, "bad").peft))
    with pytest.raises(LoraError, match="not a PEFT adapter folder"):
        b.load_lora(str(tiny_loras.hf_dir))


def test_sleep_takes_the_adapters_off_the_device_and_wake_brings_them_back(
        tiny_loras: ModelPaths, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression (issue 47, 10): a sleeping torch backend kept its adapters, the sets built from
    them and the model's active set on the GPU, and the router counted that memory as free. No GPU
    here: the place a sleeping backend keeps its adapters is made `meta` (any device other than
    the model's), and every adapter tensor must be there after the sleep, with no set left
    built. Unmeasured on CUDA. Then, on the CPU, a sleep and wake give the adapted logits again."""
    import worker.backends.torch_backend as tb

    b = backend(str(tiny_loras.hf_dir))
    b.load_lora(str(lora_paths(MODELS, "a").peft))
    b.set_lora(((0, 1.0),))
    adapted = logits(b)
    assert b._lora_sets and b._require_model().layers[0].lora
    monkeypatch.setattr(tb, "_ASLEEP", torch.device("meta"), raising=False)
    b.sleep()
    weights = b._loras[0]
    assert weights is not None and weights.tensors()
    assert {t.device.type for t in weights.tensors()} == {"meta"}
    assert b._lora_sets == {} and b._lora_set == ()

    b = backend(str(tiny_loras.hf_dir))
    b.load_lora(str(lora_paths(MODELS, "a").peft))
    monkeypatch.setattr(tb, "_ASLEEP", torch.device("cpu"))
    b.sleep()
    b.wake()
    weights = b._loras[0]
    assert weights is not None and {t.device for t in weights.tensors()} == {b.device}
    b.set_lora(((0, 1.0),))
    torch.testing.assert_close(logits(b), adapted, atol=0, rtol=0)
