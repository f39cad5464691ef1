"""What the generated kernels need to know about a GPU: arch, SM count, shared memory, registers.

`properties(device)` asks the GPU (torch.cuda.get_device_properties, and the CUDA driver through
ctypes libcuda for what torch does not expose: cuDeviceGetAttribute, the call cuda-python wraps;
else the arch's nominal values below), cached per device index. `for_arch(arch)` gives the
nominal properties of a known arch, for offline compile checks and CPU tests. `current()` is what
sizing code uses: the current device's properties when CUDA is in use, else the first GPU's (from
the driver, no context), else `for_arch(DEFAULT_ARCH)` (no GPU: CPU tests keep the H100 numbers).
Nothing here touches CUDA at import.
"""
from __future__ import annotations

import dataclasses
import functools
import sys
from typing import Optional, Tuple

DEFAULT_ARCH = "90"
MIN_CAPABILITY = (8, 0)  # cp.async and the register budget of the generated kernels need Ampere


@dataclasses.dataclass(frozen=True)
class DeviceProperties:
    """One GPU (or an arch's nominal GPU). Sizes in bytes; clock_khz may be None (unknown)."""

    name: str
    capability: Tuple[int, int]
    sm_count: int
    max_shared_per_block_optin: int
    shared_per_sm: int
    registers_per_sm: int = 65536
    registers_per_block: int = 65536
    clock_khz: Optional[int] = None
    warp_size: int = 32

    @property
    def arch(self) -> str:
        """"90" for capability (9, 0): what sm_/compute_ take."""
        return f"{self.capability[0]}{self.capability[1]}"


_KB = 1024
# Nominal values (CUDA C Programming Guide, "Technical Specifications per Compute Capability", and
# the products' data sheets): opt-in shared memory per block, shared memory per SM.
_NOMINAL = {
    "80": DeviceProperties("NVIDIA A100-SXM4 (nominal)", (8, 0), 108, 163 * _KB, 164 * _KB, clock_khz=1410000),
    "86": DeviceProperties("NVIDIA A10 / RTX 30xx (nominal)", (8, 6), 72, 99 * _KB, 100 * _KB, clock_khz=1695000),
    "87": DeviceProperties("NVIDIA Jetson AGX Orin (nominal)", (8, 7), 16, 163 * _KB, 164 * _KB, clock_khz=1300000),
    "89": DeviceProperties("NVIDIA L4 / RTX 40xx (nominal)", (8, 9), 58, 99 * _KB, 100 * _KB, clock_khz=2040000),
    "90": DeviceProperties("NVIDIA H100 SXM (nominal)", (9, 0), 132, 227 * _KB, 228 * _KB, clock_khz=1980000),
}
KNOWN_ARCHES = tuple(_NOMINAL)

# cuDeviceGetAttribute ids (cuda.h CUdevice_attribute)
_ATTRIBUTES = {"registers_per_block": 12, "clock_khz": 13, "sm_count": 16, "warp_size": 10, "major": 75,
               "minor": 76, "shared_per_sm": 81, "registers_per_sm": 82, "max_shared_per_block_optin": 97}


def normalize_arch(arch) -> str:
    """"90" from "90", "sm_90", "compute_90", 90 or (9, 0)."""
    if isinstance(arch, tuple):
        return f"{arch[0]}{arch[1]}"
    text = str(arch).strip().lower()
    for prefix in ("sm_", "compute_"):
        text = text[len(prefix):] if text.startswith(prefix) else text
    return text


def for_arch(arch) -> DeviceProperties:
    """Nominal properties of `arch` ("80", "86", "87", "89", "90"); ValueError for another."""
    key = normalize_arch(arch)
    if key not in _NOMINAL:
        raise ValueError(f"unknown GPU arch {arch!r}: known arches are {', '.join(KNOWN_ARCHES)}")
    return _NOMINAL[key]


def _index(device) -> int:
    import torch

    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, int):
        return device
    device = torch.device(device)
    if device.type != "cuda":
        raise RuntimeError(f"device {device} is not a CUDA device")
    return torch.cuda.current_device() if device.index is None else device.index


def properties(device=None) -> DeviceProperties:
    """Properties of CUDA `device` (index, torch.device or string; None: the current one), cached
    per index; RuntimeError when there is no CUDA device."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device: torch.cuda.is_available() is False (CPU-only torch, no driver "
                           "or no visible GPU); use device.for_arch(arch) for an arch's nominal properties")
    return _properties(_index(device))


def of_index(index: int) -> DeviceProperties:
    """`properties(index)` for the index of a CUDA tensor's device (no availability check: the
    launch paths' cheap form)."""
    return _properties(index)


@functools.lru_cache(maxsize=None)
def _properties(index: int) -> DeviceProperties:
    import torch

    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    driver = _driver_attributes(index) or {}
    nominal = _NOMINAL.get(f"{capability[0]}{capability[1]}")

    def field(name, torch_name):
        value = getattr(props, torch_name, None) if torch_name else None
        value = value if value else driver.get(name)
        return value if value else (getattr(nominal, name) if nominal else None)

    shared_optin = field("max_shared_per_block_optin", "shared_memory_per_block_optin")
    if shared_optin is None:
        raise RuntimeError(f"cannot tell the shared memory of GPU {index} ({props.name}, sm_{capability[0]}"
                           f"{capability[1]}): neither torch nor the CUDA driver reports it")
    return DeviceProperties(
        name=props.name, capability=capability, sm_count=props.multi_processor_count,
        max_shared_per_block_optin=shared_optin,
        shared_per_sm=field("shared_per_sm", "shared_memory_per_multiprocessor") or shared_optin,
        registers_per_sm=field("registers_per_sm", "regs_per_multiprocessor") or 65536,
        registers_per_block=field("registers_per_block", None) or 65536,
        clock_khz=field("clock_khz", "clock_rate"), warp_size=field("warp_size", "warp_size") or 32)


@functools.lru_cache(maxsize=None)
def _libcuda():
    import ctypes

    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    return lib if lib.cuInit(0) == 0 else None


@functools.lru_cache(maxsize=None)
def _driver_attributes(index: int) -> Optional[dict]:
    """{field: value} of driver ordinal `index` (cuInit + cuDeviceGetAttribute: no context), or None."""
    import ctypes

    lib = _libcuda()
    if lib is None:
        return None
    handle = ctypes.c_int(0)
    if lib.cuDeviceGet(ctypes.byref(handle), index) != 0:
        return None
    found = {}
    for name, attribute in _ATTRIBUTES.items():
        value = ctypes.c_int(0)
        if lib.cuDeviceGetAttribute(ctypes.byref(value), attribute, handle) == 0:
            found[name] = value.value
    return found


@functools.lru_cache(maxsize=None)
def _driver_properties(index: int) -> Optional[DeviceProperties]:
    found = _driver_attributes(index)
    if not found or not found.get("major") or not found.get("sm_count"):
        return None
    capability = (found["major"], found["minor"])
    nominal = _NOMINAL.get(f"{capability[0]}{capability[1]}")
    optin = found.get("max_shared_per_block_optin") or (nominal.max_shared_per_block_optin if nominal else 48 * _KB)
    return DeviceProperties(f"CUDA device {index}", capability, found["sm_count"], optin,
                            found.get("shared_per_sm") or optin, found.get("registers_per_sm") or 65536,
                            found.get("registers_per_block") or 65536, found.get("clock_khz") or None,
                            found.get("warp_size") or 32)


def current() -> DeviceProperties:
    """The GPU sizing code targets: torch's current device if torch has initialised CUDA, else the
    driver's first device (no context made: safe in worker processes), else the nominal
    `for_arch(DEFAULT_ARCH)`."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return _properties(torch.cuda.current_device())
    return _driver_properties(0) or for_arch(DEFAULT_ARCH)


def current_arch() -> str:
    """`current().arch`: the arch generated kernels are compiled for when none is given."""
    return current().arch


def resolve(target=None) -> DeviceProperties:
    """DeviceProperties for `target`: itself, an arch (string/tuple: nominal values), or None (`current()`)."""
    if target is None:
        return current()
    if isinstance(target, DeviceProperties):
        return target
    return for_arch(target)


def check_supported(props: DeviceProperties) -> None:
    """RuntimeError unless the generated kernels can run on `props` (capability >= 8.0)."""
    if props.capability < MIN_CAPABILITY:
        raise RuntimeError(f"{props.name} is sm_{props.arch}; the generated kernels need sm_80 or newer "
                           "(cp.async, Ampere's register file)")


# CUDA-core multiply-adds per clock per SM: fp32 FFMA lanes, and fp16/bf16 as packed pairs (HFMA2),
# for the arches whose rates are certain (CUDA C Programming Guide, arithmetic instruction throughput).
_FMA_PER_CLOCK = {"80": {"fp32": 64, "half": 256}, "90": {"fp32": 128, "half": 256}}
# Nominal GPUs by product name, for results recorded elsewhere (the row's device name): the PCIe H100
# has fewer SMs and a lower clock than the SXM one the "90" entry describes.
_BY_NAME = (("H100 PCIe", dataclasses.replace(_NOMINAL["90"], name="NVIDIA H100 PCIe (nominal)", sm_count=114,
                                               clock_khz=1755000)),
            ("H100", _NOMINAL["90"]), ("H200", dataclasses.replace(_NOMINAL["90"], name="NVIDIA H200 (nominal)")),
            ("A100", _NOMINAL["80"]))


def nominal_for_name(name: str) -> Optional[DeviceProperties]:
    """Nominal properties of the GPU named `name` (e.g. "NVIDIA H100 80GB HBM3"), None if unknown."""
    return next((props for key, props in _BY_NAME if key in name), None)


def cuda_core_fma_rate(props: DeviceProperties, half: bool) -> Optional[float]:
    """Multiply-adds per second of `props`' CUDA cores (not tensor cores) at its boost clock: fp32, or
    fp16/bf16 in packed pairs (`half`); None where the arch's rate or the clock is not known."""
    per_clock = _FMA_PER_CLOCK.get(props.arch)
    if per_clock is None or not props.clock_khz:
        return None
    return props.sm_count * per_clock["half" if half else "fp32"] * props.clock_khz * 1e3
