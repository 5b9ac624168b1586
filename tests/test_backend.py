"""GPU builds, as far as a CPU machine can test them: backends, devices, -ngl, -dev."""

from __future__ import annotations

import ctypes
from pathlib import Path

import pytest
from test_cli_run import assert_user_error, specdec

from specdec_cli.decoding import loading, settings
from specdec_cli.decoding.engine import Engine
from specdec_cli.decoding.loading import model_params, offload_warning
from specdec_cli.decoding.settings import EngineOptions
from specdec_cli.errors import UserError
from specdec_cli.llamacpp import backend, rowexp, rpc
from specdec_cli.llamacpp.backend import Device, pick_devices
from specdec_cli.llamacpp.model import ModelParams

GPUS = [Device("CUDA0", "NVIDIA A", 0x1000, 8 << 30, 6 << 30), Device("CUDA1", "NVIDIA B", 0x2000)]


def test_the_build_names_its_backends() -> None:
    assert "CPU" in backend.backend_names()
    assert backend.build_identity()["system_info"] == backend.system_info() != ""


def test_devices_are_offload_targets_only() -> None:
    """The CPU is no -dev choice (as in llama.cpp); a CPU-only build lists none."""
    devices = backend.gpu_devices()
    assert "CPU" not in [d.name for d in devices]
    if not backend.supports_gpu_offload():
        assert devices == []


def test_device_list_is_llama_cpp_s() -> None:
    assert backend.device_list_text([]) == "Available devices:\n  (none)"
    assert backend.device_list_text(GPUS[:1]) == (
        "Available devices:\n  CUDA0: NVIDIA A (8192 MiB, 6144 MiB free)"
    )


@pytest.mark.parametrize(
    ("value", "handles"),
    [("CUDA1", [0x2000]), ("cuda0,CUDA1", [0x1000, 0x2000]), ("none", [])],
)
def test_pick_devices(value: str, handles: list[int]) -> None:
    assert pick_devices(value, GPUS, "-dev") == handles


def test_an_unknown_device_lists_the_available_ones() -> None:
    with pytest.raises(UserError) as err:
        pick_devices("CUDA0,Vulkan0", GPUS, "-devd")
    assert str(err.value) == "unknown device 'Vulkan0' for -devd; available: CUDA0, CUDA1"
    with pytest.raises(UserError) as err:
        pick_devices("CUDA0", [], "-dev")
    assert "available: none: this llama.cpp build has no GPU backend" in str(err.value)


def devices_in(params: ModelParams) -> list[int | None] | None:
    """The NULL-terminated device array llama_model_params points to, read back."""
    llama_params, _alive = params.to_llama()  # the array must outlive the reads
    if not llama_params.devices:
        return None
    array = ctypes.cast(llama_params.devices, ctypes.POINTER(ctypes.c_void_p))
    out: list[int | None] = []
    while (out[-1:] or [0])[0] is not None:
        out.append(array[len(out)])
    return out


def test_model_params_reach_llama_model_params(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(backend, "gpu_devices", lambda: GPUS)
    params = model_params(20, "CUDA1,CUDA0", "-dev", repack=False)
    assert params == ModelParams(20, (0x2000, 0x1000), False)
    llama_params, _ = params.to_llama()
    assert llama_params.n_gpu_layers == 20 and llama_params.use_extra_bufts is False
    assert devices_in(params) == [0x2000, 0x1000, None]
    assert devices_in(model_params(None, "none", "-dev", True)) == [None]  # offload nothing
    # Not given: llama.cpp's defaults, every layer on every GPU, repacking on.
    defaults = model_params(None, None, "-dev", True)
    assert devices_in(defaults) is None and defaults.to_llama()[0].n_gpu_layers == -1
    assert defaults == ModelParams()


def test_the_draft_device_follows_the_target_s_unless_given_and_stays_off_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    worker = Device("RPC0", "10.0.0.2:50052", 0x3000)
    monkeypatch.setattr(backend, "gpu_devices", lambda: [*GPUS, worker])
    monkeypatch.setattr(rpc, "_registered", {worker.description: [worker]})
    target = Path("t.gguf")

    def draft_devices(**options: object) -> tuple[int, ...] | None:
        return loading._draft_params(EngineOptions(target, **options), True).devices

    assert draft_devices(device="CUDA0") == (0x1000,)
    assert draft_devices(device_draft="CUDA1") == (0x2000,)
    assert draft_devices() is None  # llama.cpp's default: every GPU
    # With --rpc and no -devd: this machine's GPUs, never a worker's (and -devd still can).
    assert draft_devices(rpc=(worker.description,)) == (0x1000, 0x2000)
    assert draft_devices(rpc=(worker.description,), device_draft="RPC0") == (0x3000,)


@pytest.mark.parametrize(
    ("ngl", "ngld", "can_offload", "flags"),
    [
        (None, None, False, None),  # llama.cpp's default, not asked for: no warning
        (0, 0, False, None),  # CPU only, as asked
        (99, None, False, "-ngl"),
        (-1, 8, False, "-ngl and -ngld"),
        (99, 99, True, None),  # a GPU build offloads them
    ],
)
def test_offload_warning(
    ngl: int | None, ngld: int | None, can_offload: bool, flags: str | None
) -> None:
    options = EngineOptions(Path("t.gguf"), n_gpu_layers=ngl, n_gpu_layers_draft=ngld)
    warning = offload_warning(options, can_offload)
    if flags is None:
        assert warning is None
    else:
        assert warning is not None and "\n" not in warning
        assert f"{flags} ignored, the models run on the CPU" in warning


@pytest.mark.parametrize(("value", "layers"), [("auto", -1), ("all", -1), ("0", 0), ("33", 33)])
def test_parse_gpu_layers(value: str, layers: int) -> None:
    assert settings.parse_gpu_layers(value) == layers


def test_engine_loads_with_no_offload_devices(target_model: Path) -> None:
    """-dev none: a device array holding only NULL reaches llama.cpp, which loads."""
    options = EngineOptions(target_model, n_ctx=64, threads=1, device="none", flash_attn="off")
    with Engine(options) as loaded:
        assert loaded.model.n_vocab > 0


def test_cli_version_and_devices() -> None:
    version = specdec("--version")
    assert version.returncode == 0 and "llama.cpp backends: " in version.stdout
    assert "CPU" in version.stdout
    devices = specdec("--list-devices")
    assert devices.returncode == 0 and devices.stdout.startswith("Available devices:\n")
    info = specdec("info")
    assert info.returncode == 0
    assert "llama.cpp backends: " in info.stdout and "GPU offload: " in info.stdout
    assert f"exp over a row (sampling): {rowexp.kernel_name()}\n" in info.stdout


def test_cli_explicit_gpu_layers_on_a_cpu_build_warn_once(target_model: Path) -> None:
    if backend.supports_gpu_offload():
        pytest.skip("this llama.cpp build offloads to a GPU")
    args = ["run", "-m", str(target_model), "-p", "Once", "-n", "4", "--temp", "0", "-q"]
    result = specdec(*args, "-ngl", "99", "-ngld", "all", "-fa", "off")
    assert result.returncode == 0, result.stderr
    warnings = result.stderr.strip().splitlines()
    assert len(warnings) == 1 and "-ngl and -ngld ignored, the models run on" in warnings[0]
    assert specdec(*args, "-fa", "off").stderr == ""  # the default -ngl: no warning


def test_cli_bad_gpu_flags(target_model: Path) -> None:
    run = ["run", "-m", str(target_model), "-p", "hi"]
    assert_user_error(specdec(*run, "-ngl", "many"), "-ngl must be a number of layers")
    assert_user_error(specdec(*run, "-dev", "CUDA7"), "unknown device 'CUDA7' for -dev")
