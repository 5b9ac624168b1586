"""Which llama.cpp this is: the ggml backends it was built with, the devices they see.

llama-cpp-python does not wrap ggml's backend registry, so this module declares the
few functions it needs (ctypes, like llama.py). They are looked up through libllama's
own handle, so that they are the ggml libllama uses, wherever LLAMA_CPP_LIB_PATH put it.
A CUDA, Metal or Vulkan build lists its backend next to "CPU"; its GPUs are the
devices `-dev`/`-devd` name and `--list-devices` shows, as are an RPC worker's (rpc.py).
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import llama_cpp.llama_cpp as llama_cpp

from specdec_cli.errors import UserError

_DEVICE_TYPE_CPU = 0  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL, META
_DEVICE_TYPE_ACCEL = 3
_MIB = 1024 * 1024


def _declare(name: str, restype: type | None, *argtypes: type) -> Callable[..., Any]:
    function = getattr(llama_cpp._lib, name)
    function.restype = restype
    function.argtypes = list(argtypes)
    return function


_reg_count = _declare("ggml_backend_reg_count", ctypes.c_size_t)
_reg_get = _declare("ggml_backend_reg_get", ctypes.c_void_p, ctypes.c_size_t)
_reg_name = _declare("ggml_backend_reg_name", ctypes.c_char_p, ctypes.c_void_p)
_dev_count = _declare("ggml_backend_dev_count", ctypes.c_size_t)
_dev_get = _declare("ggml_backend_dev_get", ctypes.c_void_p, ctypes.c_size_t)
_dev_name = _declare("ggml_backend_dev_name", ctypes.c_char_p, ctypes.c_void_p)
_dev_description = _declare("ggml_backend_dev_description", ctypes.c_char_p, ctypes.c_void_p)
_dev_type = _declare("ggml_backend_dev_type", ctypes.c_int, ctypes.c_void_p)
_reg_by_name = _declare("ggml_backend_reg_by_name", ctypes.c_void_p, ctypes.c_char_p)
_reg_proc_address = _declare(
    "ggml_backend_reg_get_proc_address", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_char_p
)
_reg_dev_count = _declare("ggml_backend_reg_dev_count", ctypes.c_size_t, ctypes.c_void_p)
_reg_dev_get = _declare(
    "ggml_backend_reg_dev_get", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t
)
_register = _declare("ggml_backend_register", None, ctypes.c_void_p)
_set_abort_callback = _declare("ggml_set_abort_callback", ctypes.c_void_p, ctypes.c_void_p)
_dev_memory = _declare(
    "ggml_backend_dev_memory",
    None,
    ctypes.c_void_p,
    ctypes.POINTER(ctypes.c_size_t),
    ctypes.POINTER(ctypes.c_size_t),
)


@dataclass(frozen=True)
class Device:
    """A device llama.cpp can offload layers to (a ggml_backend_dev_t and what it says)."""

    name: str  # "CUDA0", "Metal", "Vulkan1": what -dev takes
    description: str
    handle: int
    total_bytes: int = 0
    free_bytes: int = 0
    kind: int = 1  # enum ggml_backend_dev_type

    @property
    def accelerator(self) -> bool:
        """An ACCEL device (BLAS, AMX): it helps the CPU, it is not a place for layers."""
        return self.kind == _DEVICE_TYPE_ACCEL

    def line(self) -> str:
        """llama.cpp's --list-devices line."""
        total, free = self.total_bytes // _MIB, self.free_bytes // _MIB
        return f"{self.name}: {self.description} ({total} MiB, {free} MiB free)"


@cache
def backend_names() -> tuple[str, ...]:
    """The ggml backends this llama.cpp was built with, e.g. ("CUDA", "CPU")."""
    return tuple(_reg_name(_reg_get(i)).decode() for i in range(_reg_count()))


def _device(handle: int) -> Device:
    free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
    _dev_memory(handle, ctypes.byref(free), ctypes.byref(total))
    return Device(
        _dev_name(handle).decode(),
        (_dev_description(handle) or b"").decode(errors="replace"),
        handle,
        total.value,
        free.value,
        _dev_type(handle),
    )


def all_devices() -> list[Device]:
    return [_device(_dev_get(i)) for i in range(_dev_count())]


def gpu_devices() -> list[Device]:
    """The devices layers can be offloaded to: every device but the CPU, as llama.cpp's
    own --device and --list-devices count them."""
    return [d for d in all_devices() if d.kind != _DEVICE_TYPE_CPU]


def cpu_devices() -> list[Device]:
    return [d for d in all_devices() if d.kind == _DEVICE_TYPE_CPU]


def reg_proc_address(backend_name: str, function: str) -> int | None:
    """A function a backend exports by name (ggml_backend_reg_get_proc_address)."""
    reg = _reg_by_name(backend_name.encode())
    return _reg_proc_address(reg, function.encode()) if reg else None


def register(reg: int) -> list[Device]:
    """Add a backend's devices to ggml's list (an RPC worker's); they are returned."""
    _register(reg)
    return [_device(_reg_dev_get(reg, i)) for i in range(_reg_dev_count(reg))]


def set_abort_callback(callback: ctypes._CFuncPtr) -> None:
    """What ggml calls before it aborts the process (ggml_set_abort_callback); the
    caller keeps `callback` alive."""
    _set_abort_callback(ctypes.cast(callback, ctypes.c_void_p))


def device_list_text(devices: Sequence[Device]) -> str:
    """What `--list-devices` prints, in llama.cpp's format."""
    lines = [f"  {d.line()}" for d in devices] or ["  (none)"]
    return "\n".join(["Available devices:", *lines])


def supports_gpu_offload() -> bool:
    return bool(llama_cpp.llama_supports_gpu_offload())


@cache
def system_info() -> str:
    """llama.cpp's own summary of its build: backends and the CPU features compiled in."""
    return llama_cpp.llama_print_system_info().decode(errors="replace").strip()


def build_identity() -> dict[str, object]:
    """What tells one llama.cpp build from another on the same machine: a CUDA rebuild
    changes the backends and the system info, so costs measured before do not apply."""
    return {"backends": list(backend_names()), "system_info": system_info()}


def pick_devices(value: str, available: Sequence[Device], flag: str) -> list[int]:
    """The device handles a -dev value names: "CUDA0", "CUDA0,CUDA1", or "none" (no
    offload). Names are matched without regard to case, as llama.cpp does."""
    if value.strip().lower() == "none":
        return []
    by_name = {d.name.lower(): d for d in available}
    names = [name.strip() for name in value.split(",") if name.strip()]
    if not names:
        raise UserError(f"{flag} needs a device name (see `specdec --list-devices`), or 'none'")
    unknown = [name for name in names if name.lower() not in by_name]
    if unknown:
        choices = ", ".join(d.name for d in available) or (
            "none: this llama.cpp build has no GPU backend (see the README, GPU builds)"
        )
        raise UserError(f"unknown device {unknown[0]!r} for {flag}; available: {choices}")
    return [by_name[name.lower()].handle for name in names]
