"""Load a cubin into torch's CUDA context and launch its kernel on a given stream.

Two implementations of the same small interface, chosen by $SPARSECNN_CODEGEN_LOADER
("cuda-python" or "cupy"; default: cuda-python when installed, else CuPy). Both are imported on
first use only, so `import sparsecnn` never touches them. Both load into the device's primary
context, which is the one torch uses, and launch on the stream handle they are given (callers pass
`torch.cuda.current_stream().cuda_stream`, so launches are captured by CUDA graphs).

Kernel signature expected: pointers first, then 32-bit ints. Callers load and launch inside
`torch.cuda.device(index)`, so the device's primary context is current on the calling thread.
"""
from __future__ import annotations

import threading
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

import sparsecnn.settings as settings

LOADERS = settings.CODEGEN_LOADERS
_DEFAULT_SMEM_LIMIT = 48 * 1024  # dynamic shared memory a kernel may use without opting in
Dim3 = Tuple[int, int, int]


def missing_loader() -> Optional[str]:
    """None when a loader is available (`loader_name`), else why not."""
    try:
        loader_name()
    except RuntimeError as error:
        return str(error)
    return None


def loader_name() -> str:
    """The loader to use: $SPARSECNN_CODEGEN_LOADER, else the first of LOADERS that imports."""
    chosen = settings.codegen_loader()
    if chosen:
        return chosen
    try:
        _cuda_driver()
        return "cuda-python"
    except ImportError:
        pass
    try:
        import cupy  # noqa: F401
        return "cupy"
    except ImportError as exc:
        raise RuntimeError("the codegen backend needs cuda-python (cuda.bindings) or CuPy to load "
                           "kernels; pip install cuda-python") from exc


def load_kernel(cubin: bytes, name: str, device_index: int, loader: str = "", dynamic_smem: int = 0):
    """The kernel `name` of `cubin` on CUDA device `device_index`; `.launch(grid, block, pointers,
    ints, stream, shared_mem=None)` enqueues it with `shared_mem` bytes of dynamic shared memory
    (default and most: `dynamic_smem`)."""
    loader = loader or loader_name()
    if loader == "cuda-python":
        return _CudaPythonKernel(cubin, name, device_index, dynamic_smem)
    if loader == "cupy":
        return _CupyKernel(cubin, name, device_index, dynamic_smem)
    raise ValueError(f"unknown loader {loader!r}; expected one of {LOADERS}")


class LazyKernels:
    """The kernel `name` of each of some cubins, loaded on each device on first use (thread-safe,
    lock-free once loaded): what every generated kernel (codegen's slices, staged, unrolled's modules)
    keeps beside its cubins."""

    def __init__(self, cubins: Sequence[bytes], name: str, dynamic_smem: int = 0):
        self.cubins, self.name, self.dynamic_smem = tuple(cubins), name, dynamic_smem
        self._loaded: Dict[int, list] = {}
        self._lock = threading.Lock()

    def kernels(self, device_index: int) -> list:
        """The loaded kernels (`load_kernel`'s objects), in cubin order, on CUDA device `device_index`."""
        loaded = self._loaded.get(device_index)
        if loaded is None:
            with self._lock:
                if device_index not in self._loaded:
                    self._loaded[device_index] = [load_kernel(cubin, self.name, device_index,
                                                              dynamic_smem=self.dynamic_smem)
                                                  for cubin in self.cubins]
                loaded = self._loaded[device_index]
        return loaded


def _cuda_driver():
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python < 12.6 exposes the same API as cuda.cuda
        from cuda import cuda as driver
    return driver


class _CudaPythonKernel:
    """cuda.bindings.driver: cuModuleLoadData + cuLaunchKernel with a reused argument block.

    Both act on the thread's current context. Callers hold torch's device guard, so on a thread
    where torch has used the device that is its primary context (torch's own); a thread with no
    context at all gets the primary context made current here.
    """

    def __init__(self, cubin: bytes, name: str, device_index: int, dynamic_smem: int = 0):
        self.driver = driver = _cuda_driver()
        self.device_index = device_index
        self._check(driver.cuInit(0), "cuInit")
        if driver.cuCtxGetDevice()[0] != driver.CUresult.CUDA_SUCCESS:  # no current context
            self._make_primary_current()
        image = np.frombuffer(cubin, dtype=np.uint8).copy()
        self.module = self._check(driver.cuModuleLoadData(image.ctypes.data), "cuModuleLoadData")
        self.function = self._check(driver.cuModuleGetFunction(self.module, name.encode()), "cuModuleGetFunction")
        self.dynamic_smem = dynamic_smem
        if dynamic_smem > _DEFAULT_SMEM_LIMIT:
            attribute = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            self._check(driver.cuFuncSetAttribute(self.function, attribute, dynamic_smem), "cuFuncSetAttribute")
        self._lock = threading.Lock()
        self._arity = None

    def _check(self, result, what: str):
        err, *values = result
        if err != self.driver.CUresult.CUDA_SUCCESS:
            _, message = self.driver.cuGetErrorString(err)
            raise RuntimeError(f"{what} failed: {err} ({message.decode() if message else '?'})")
        return values[0] if len(values) == 1 else None

    def _make_primary_current(self) -> None:
        device = self._check(self.driver.cuDeviceGet(self.device_index), "cuDeviceGet")
        context = self._check(self.driver.cuDevicePrimaryCtxRetain(device), "cuDevicePrimaryCtxRetain")
        self._check(self.driver.cuCtxSetCurrent(context), "cuCtxSetCurrent")

    def _arguments(self, n_pointers: int, n_ints: int) -> None:
        # Values live in two arrays; `params` holds their addresses (the void** of cuLaunchKernel).
        self._pointers = np.zeros(n_pointers, dtype=np.uint64)
        self._ints = np.zeros(n_ints, dtype=np.int32)
        self._params = np.array([self._pointers.ctypes.data + 8 * i for i in range(n_pointers)]
                                + [self._ints.ctypes.data + 4 * i for i in range(n_ints)], dtype=np.uint64)
        self._arity = (n_pointers, n_ints)

    def launch(self, grid: Dim3, block: Dim3, pointers: Sequence[int], ints: Sequence[int], stream: int,
               shared_mem: Optional[int] = None) -> None:
        shared_mem = self.dynamic_smem if shared_mem is None else shared_mem
        with self._lock:  # the argument block is shared: one launch at a time
            if self._arity != (len(pointers), len(ints)):
                self._arguments(len(pointers), len(ints))
            self._pointers[:] = pointers
            self._ints[:] = ints
            args = (self.function, *grid, *block, shared_mem, self.driver.CUstream(stream),
                    self._params.ctypes.data, 0)
            result = self.driver.cuLaunchKernel(*args)
            if result[0] == self.driver.CUresult.CUDA_ERROR_INVALID_CONTEXT:  # a thread new to CUDA
                self._make_primary_current()
                result = self.driver.cuLaunchKernel(*args)
            self._check(result, "cuLaunchKernel")


class _CupyKernel:
    """CuPy's cuda.function.Module (driver module load) and Function launch on an external stream."""

    def __init__(self, cubin: bytes, name: str, device_index: int, dynamic_smem: int = 0):
        import cupy
        from cupy.cuda import function

        self.cupy = cupy
        self.device_index = device_index
        with cupy.cuda.Device(device_index):
            self.module = function.Module()
            self.module.load(cubin)
            self.function = self.module.get_function(name)
            if dynamic_smem > _DEFAULT_SMEM_LIMIT:
                self.function.max_dynamic_shared_size_bytes = dynamic_smem
        self.dynamic_smem = dynamic_smem

    def launch(self, grid: Dim3, block: Dim3, pointers: Sequence[int], ints: Sequence[int], stream: int,
               shared_mem: Optional[int] = None) -> None:
        shared_mem = self.dynamic_smem if shared_mem is None else shared_mem
        args = tuple(np.uint64(p) for p in pointers) + tuple(np.int32(i) for i in ints)
        with self.cupy.cuda.Device(self.device_index):
            self.function(tuple(grid), tuple(block), args, shared_mem=shared_mem,
                          stream=self.cupy.cuda.ExternalStream(stream, self.device_index))
