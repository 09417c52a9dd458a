"""Modules built without init (meta device) and the file's tensors assigned (model_dir.build_models)
are the modules built the old way (random init, then load_state_dict's copy): every parameter,
buffer (computed ones included) and tensor attribute equal, same dtypes, devices and ties; the
CosyVoice3 vocoder's fixed NSF noise the same draws."""
from __future__ import annotations

import shutil
import threading

import pytest
import torch
from torch import nn

from async_cosyvoice.errors import ModelDirError
from async_cosyvoice.model_dir import (
    LM_CLASSES,
    TOKEN2WAV_CLASSES,
    build_models,
    load_model_dir,
    load_strict,
)
from async_cosyvoice.models.cosyvoice3.hift import CausalHiFT
from async_cosyvoice.models.cosyvoice3.nsf_noise import FixedNSFNoise
from async_cosyvoice.models.empty_init import (
    empty_init,
    finish_empty_init,
    meta_tensors,
)


def built_the_old_way(md, dtype: torch.dtype, llm_dtype: torch.dtype) -> dict[str, nn.Module]:
    """Random init on the CPU, `load_state_dict` copying the file's tensors in, then `.to(dtype)`."""
    flow_cls, hift_cls = TOKEN2WAV_CLASSES[md.kind]
    parts = {"llm": (LM_CLASSES[md.kind](md.dims.lm), md.llm_state_dict(), llm_dtype),
             "flow": (flow_cls(md.dims.flow), md.flow_state_dict(), dtype),
             "hift": (hift_cls(md.dims.hift, md.dims.flow), md.hift_state_dict(), torch.float32)}
    out = {}
    for name, (module, sd, to) in parts.items():
        module.load_state_dict(sd, strict=True)
        out[name] = module.to(dtype=to).eval()
    return out


def tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameters and buffers under every name (ties listed twice) and plain tensor attributes."""
    out = {f"param {k}": v for k, v in module.named_parameters(remove_duplicate=False)}
    out |= {f"buffer {k}": v for k, v in module.named_buffers(remove_duplicate=False)}
    for prefix, sub in module.named_modules():
        out |= {f"attr {prefix}.{k}": v for k, v in vars(sub).items() if isinstance(v, torch.Tensor)}
    return out


def assert_same_module(new: nn.Module, old: nn.Module) -> None:
    a, b = tensors(new), tensors(old)
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].device == b[k].device, k
        assert a[k].is_contiguous() and torch.equal(a[k], b[k]), k
        assert type(a[k]) is type(b[k]) and a[k].requires_grad == b[k].requires_grad, k
    # the same ties: as many distinct parameters
    assert len(list(new.parameters())) == len(list(old.parameters()))
    assert new.training is False and all(not m.training for m in new.modules())


@pytest.mark.parametrize("which", ["cosyvoice2", "cosyvoice3"])
@pytest.mark.parametrize("dtype,llm_dtype", [(torch.float32, torch.float32), (torch.float16, torch.bfloat16)])
def test_built_without_init_equals_built_the_old_way(which, dtype, llm_dtype, tiny_dir, tiny3_dir):
    md = load_model_dir(tiny_dir if which == "cosyvoice2" else tiny3_dir)
    new = build_models(md, dtype=dtype, llm_dtype=llm_dtype)
    old = built_the_old_way(md, dtype, llm_dtype)
    for name in ("llm", "flow", "hift"):
        assert_same_module(getattr(new, name), old[name])
    # computed buffers are there, on the CPU, and what the constructor computes
    window = dict(new.hift.named_buffers())["stft_window"]
    assert window.device.type == "cpu" and torch.equal(window, type(new.hift)._hann(new.hift.n_fft))
    if which == "cosyvoice3":
        assert isinstance(new.hift, CausalHiFT)
        # the CPU generator's replay, not skipped by the meta device: the same rand_ini and noise
        n_new, n_old = new.hift.nsf_noise, old["hift"].nsf_noise
        assert not n_new.is_zero and torch.equal(n_new.rand_ini, n_old.rand_ini)
        assert torch.equal(n_new.sine_noise(5000, "cpu"), n_old.sine_noise(5000, "cpu"))


def test_nsf_noise_replay_ignores_the_meta_device(tiny3_dir):
    dims = load_model_dir(tiny3_dir).dims
    with empty_init():
        inside = FixedNSFNoise.replay(dims.flow, dims.hift)
    outside = FixedNSFNoise.replay(dims.flow, dims.hift)
    assert inside.rand_ini.device.type == "cpu" and torch.equal(inside.rand_ini, outside.rand_ini)
    assert torch.equal(inside.sine_noise(1000, "cpu"), outside.sine_noise(1000, "cpu"))


def test_file_tensors_take_the_module_dtype_and_are_not_copied():
    with empty_init():
        module = nn.Linear(4, 3)
    weight, bias = torch.randn(3, 4), torch.randn(3, dtype=torch.float64)
    load_strict(module, {"weight": weight, "bias": bias}, "flow.pt")
    finish_empty_init(module)
    assert module.weight.data_ptr() == weight.data_ptr()  # assigned, no copy
    assert module.bias.dtype == torch.float32 and torch.equal(module.bias, bias.float())  # as copy_ would cast
    assert isinstance(module.weight, nn.Parameter) and module.weight.requires_grad


def test_load_strict_on_an_empty_module_names_the_file_and_the_keys():
    with empty_init():
        module = nn.Sequential(nn.Linear(4, 3), nn.Conv1d(3, 2, 5))
    bad = {"0.weight": torch.zeros(3, 5), "0.bias": torch.zeros(3), "1.weight": torch.zeros(2, 3, 5),
           "1.extra": torch.zeros(1)}
    with pytest.raises(ModelDirError) as e:
        load_strict(module, bad, "flow.pt")
    msg = str(e.value)
    assert "flow.pt" in msg and "missing keys [1.bias]" in msg and "unexpected keys [1.extra]" in msg
    assert "0.weight (file (3, 5), model (3, 4))" in msg
    assert meta_tensors(module) == ["0.weight", "0.bias", "1.weight", "1.bias"]  # nothing half-assigned


class MakesATensorInItsConstructor(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(2, 2)
        self.register_buffer("table", torch.arange(4.0), persistent=False)  # in no weight file, not made on the CPU explicitly


def test_a_constructor_tensor_left_on_the_meta_device_is_reported():
    with empty_init():
        module = MakesATensorInItsConstructor()
    load_strict(module, {"proj.weight": torch.eye(2), "proj.bias": torch.zeros(2)}, "flow.pt")
    with pytest.raises(RuntimeError, match=r"MakesATensorInItsConstructor .* 1 tensor\(s\) unset \(table\)"):
        finish_empty_init(module)


def test_weights_do_not_follow_a_model_file_rewritten_in_place(tiny_dir, tmp_path):
    """float32 on the CPU is the file's dtype and device: nothing converts the assigned tensors, which
    are the file's mmap pages until build_models gives them memory of their own."""
    d = tmp_path / "model"
    shutil.copytree(tiny_dir, d, ignore=shutil.ignore_patterns("golden"))
    models = build_models(d)
    before = {k: v.clone() for k, v in models.llm.state_dict().items()}
    sd = torch.load(d / "llm.pt", map_location="cpu", weights_only=True)
    torch.save({k: torch.zeros_like(v) for k, v in sd.items()}, d / "llm.pt")  # the same inode, rewritten
    after = models.llm.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_empty_init_is_the_building_threads_only():
    """Synthesizer._build loads the request front in another thread while the LM is built in
    empty_init(): that thread's tensors and modules stay real and initialised."""
    inside, seen = threading.Event(), {}

    def other_thread():
        inside.wait()
        layer = nn.Linear(2, 2)
        seen.update(tensor=torch.zeros(3).device.type, layer=layer.weight.device.type,
                    initialised=bool(layer.weight.abs().sum() > 0))

    thread = threading.Thread(target=other_thread)
    thread.start()
    with empty_init():
        inside.set()
        thread.join()
        assert torch.zeros(1).is_meta
    assert seen == {"tensor": "cpu", "layer": "cpu", "initialised": True}
