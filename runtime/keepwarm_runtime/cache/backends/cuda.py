"""GPU tier: one CUDA VMM allocation per model, shared by POSIX fd (tests/gpu/cache: passed on an H200).

The daemon creates the allocation with ``cuMemCreate`` requesting
``CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR``, exports it once with
``cuMemExportToShareableHandle`` and sends that fd over the socket by SCM_RIGHTS, exactly like a
host-tier memfd. A client imports it (``cuMemImportFromShareableHandle``), reserves address space,
maps it and asks for read-only access (``cuMemSetAccess`` with ``PROT_READ``); drivers that refuse
read-only get read-write and the mapping says so. Fd handles need no hostIPC/hostPID, so they cross
pod boundaries (the way NVIDIA Dynamo's GPU Memory Service shares weights). torch's legacy CUDA IPC
handles (``cudaIpcGetMemHandle``) would be a second path; it is not implemented: it needs the same
PID namespace and cannot share one allocation read-only.

The driver is reached through ctypes (``libcuda.so.1``) so no CUDA toolkit or extra package is
needed; tensors over mapped memory come from ``__cuda_array_interface__``. torch is imported only where
an allocation is made or mapped (``CudaArena``, ``ImportedArena``): finding a GPU's ordinal and UUID
and holding, adopting or sending an allocation's fd need the driver alone, so a gpu-tier daemon that
restarts serves what it adopted before torch is imported (cache/core.py; untested on GPU).
"""

from __future__ import annotations

import ctypes
import os
import re
import threading
from typing import TYPE_CHECKING

from keepwarm_runtime.weights.huge_pages import round_up

if TYPE_CHECKING:
    import torch

_CUDA_DEVICE = re.compile(r"cuda(?::(0|[1-9][0-9]*))?")  # torch.device's spelling of a CUDA device
CU_MEM_ALLOCATION_TYPE_PINNED = 1
CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR = 1
CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READ = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3
CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1
CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED = 102
CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED = 103


class CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class CUmemAllocationProp(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", CUmemLocation),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class CUmemAccessDesc(ctypes.Structure):
    _fields_ = [("location", CUmemLocation), ("flags", ctypes.c_int)]


class CudaError(RuntimeError):
    """A CUDA driver call failed; the message names the call and the driver's error."""


_lib: ctypes.CDLL | None = None
_lib_lock = threading.Lock()


def _driver() -> ctypes.CDLL:
    global _lib
    with _lib_lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libcuda.so.1")
            except OSError as exc:
                raise CudaError(f"cannot load the CUDA driver (libcuda.so.1): {exc}") from None
            _check(lib, lib.cuInit(0), "cuInit")
            _lib = lib
        return _lib


def _check(lib: ctypes.CDLL, result: int, call: str) -> None:
    if result != 0:
        msg = ctypes.c_char_p()
        lib.cuGetErrorString(result, ctypes.byref(msg))
        raise CudaError(f"{call} failed: {msg.value.decode() if msg.value else result}")


def _call(name: str, *args) -> None:
    lib = _driver()
    _check(lib, getattr(lib, name)(*args), name)


def device_ordinal(device: str | torch.device) -> int:
    """The ordinal of ``cuda`` / ``cuda:N`` (a string or a torch.device), read as torch reads it but
    without torch."""
    found = _CUDA_DEVICE.fullmatch(str(device))
    if found is None:
        raise ValueError(f"the gpu tier needs a CUDA device (cuda or cuda:N), got {str(device)[:64]!r}")
    return int(found.group(1) or 0)


def _device(ordinal: int) -> ctypes.c_int:
    dev = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(dev), ordinal)
    return dev


def _make_current(ordinal: int) -> None:
    """Bind the device's primary context (the one torch uses) to this thread."""
    ctx = ctypes.c_void_p()
    _call("cuDevicePrimaryCtxRetain", ctypes.byref(ctx), _device(ordinal))
    _call("cuCtxSetCurrent", ctx)


def format_uuid(raw: bytes) -> str:
    """The driver's 16 UUID bytes as nvidia-smi prints them: ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``."""
    if len(raw) != 16:
        raise ValueError(f"a GPU UUID has 16 bytes, got {len(raw)}")
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def gpu_uuid(ordinal: int) -> str:
    """``GPU-xxxxxxxx-xxxx-...`` as nvidia-smi prints it: stable across pods and CUDA_VISIBLE_DEVICES."""
    raw = (ctypes.c_ubyte * 16)()
    _call("cuDeviceGetUuid_v2", raw, _device(ordinal))
    return format_uuid(bytes(raw))


def device_count() -> int:
    """CUDA devices this process sees (after CUDA_VISIBLE_DEVICES/NVIDIA_VISIBLE_DEVICES)."""
    count = ctypes.c_int()
    _call("cuDeviceGetCount", ctypes.byref(count))
    return count.value


def _location(ordinal: int) -> CUmemLocation:
    return CUmemLocation(CU_MEM_LOCATION_TYPE_DEVICE, ordinal)


def _prop(ordinal: int) -> CUmemAllocationProp:
    prop = CUmemAllocationProp()
    prop.type = CU_MEM_ALLOCATION_TYPE_PINNED
    prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
    prop.location = _location(ordinal)
    return prop


def _granularity(ordinal: int) -> int:
    gran = ctypes.c_size_t()
    prop = _prop(ordinal)
    _call(
        "cuMemGetAllocationGranularity",
        ctypes.byref(gran),
        ctypes.byref(prop),
        CU_MEM_ALLOC_GRANULARITY_RECOMMENDED,
    )
    return gran.value


def arena_bytes(size: int, ordinal: int) -> int:
    """The memory a CudaArena of ``size`` bytes takes on GPU ``ordinal``: whole units of the VMM
    allocation granularity (the daemon's budget counts this, not the tensors' bytes)."""
    return round_up(max(size, 1), _granularity(ordinal))


def _set_access(ptr: int, size: int, ordinal: int, flags: int) -> None:
    desc = CUmemAccessDesc(_location(ordinal), flags)
    _call(
        "cuMemSetAccess", ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(desc), ctypes.c_size_t(1)
    )


class _DeviceBytes:
    """``__cuda_array_interface__`` over mapped memory; torch keeps it (and the mapping) alive."""

    def __init__(self, owner: object, ptr: int, size: int) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {
            "shape": (size,),
            "typestr": "|u1",
            "data": (ptr, False),
            "version": 3,
            "strides": None,
        }


class _Mapping:
    """A reserved address range with an allocation mapped into it."""

    def __init__(self, handle: int, size: int, ordinal: int, access: int) -> None:
        self.size, self.ordinal = size, ordinal
        ptr = ctypes.c_uint64()
        _call(
            "cuMemAddressReserve",
            ctypes.byref(ptr),
            ctypes.c_size_t(size),
            ctypes.c_size_t(0),
            ctypes.c_uint64(0),
            ctypes.c_uint64(0),
        )
        self.ptr = ptr.value
        try:
            _call(
                "cuMemMap",
                ctypes.c_uint64(self.ptr),
                ctypes.c_size_t(size),
                ctypes.c_size_t(0),
                ctypes.c_uint64(handle),
                ctypes.c_uint64(0),
            )
        except CudaError:
            _call("cuMemAddressFree", ctypes.c_uint64(self.ptr), ctypes.c_size_t(size))
            raise
        self.read_only = False
        if access == CU_MEM_ACCESS_FLAGS_PROT_READ:
            try:
                _set_access(self.ptr, size, ordinal, CU_MEM_ACCESS_FLAGS_PROT_READ)
                self.read_only = True
            except CudaError:  # driver refuses read-only device mappings: fall back to read-write
                _set_access(self.ptr, size, ordinal, CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
        else:
            _set_access(self.ptr, size, ordinal, access)
        import torch

        self._bytes = torch.as_tensor(_DeviceBytes(self, self.ptr, size), device=f"cuda:{ordinal}")

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        count = dtype.itemsize
        for d in shape:
            count *= d
        return self._bytes[offset : offset + count].view(dtype).view(shape)

    def unmap(self) -> None:
        if self.ptr:
            import torch

            self._bytes = None
            torch.cuda.synchronize(self.ordinal)
            _call("cuMemUnmap", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
            _call("cuMemAddressFree", ctypes.c_uint64(self.ptr), ctypes.c_size_t(self.size))
            self.ptr = 0


class CudaArena:
    """Daemon side: one VMM allocation of at least ``size`` bytes on GPU ``ordinal``, exported as an fd."""

    page_mode = "vmm"

    def __init__(self, name: str, size: int, ordinal: int) -> None:
        import torch

        torch.cuda.init()
        _make_current(ordinal)
        for attr, what in (
            (CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, "virtual memory management"),
            (CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, "POSIX fd handles"),
        ):
            value = ctypes.c_int()
            _call("cuDeviceGetAttribute", ctypes.byref(value), attr, _device(ordinal))
            if not value.value:
                raise CudaError(f"GPU {ordinal} does not support {what}; use --tier host")
        self.name, self.ordinal = name, ordinal
        self.size = arena_bytes(size, ordinal)
        handle = ctypes.c_uint64()
        prop = _prop(ordinal)
        _call(
            "cuMemCreate",
            ctypes.byref(handle),
            ctypes.c_size_t(self.size),
            ctypes.byref(prop),
            ctypes.c_uint64(0),
        )
        self.handle = handle.value
        fd = ctypes.c_int(-1)
        try:
            _call(
                "cuMemExportToShareableHandle",
                ctypes.byref(fd),
                ctypes.c_uint64(self.handle),
                CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
                ctypes.c_uint64(0),
            )
            self.fd = fd.value
            self._map: _Mapping | None = _Mapping(
                self.handle, self.size, ordinal, CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            )
        except BaseException:
            _call("cuMemRelease", ctypes.c_uint64(self.handle))
            if fd.value >= 0:
                os.close(fd.value)
            raise

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._map.tensor(offset, dtype, shape)

    def seal(self) -> None:
        """Finish the copies; the daemon keeps its read-write mapping (clients map read-only)."""
        import torch

        torch.cuda.synchronize(self.ordinal)

    def close(self) -> None:
        if self._map is not None:
            _make_current(self.ordinal)
            self._map.unmap()
            self._map = None
            _call("cuMemRelease", ctypes.c_uint64(self.handle))  # freed once clients unmap too
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


class ImportedArena:
    """Client side: the daemon's allocation mapped (read-only where the driver allows)."""

    def __init__(self, fd: int, size: int, ordinal: int) -> None:
        import torch

        torch.cuda.init()
        _make_current(ordinal)
        handle = ctypes.c_uint64()
        _call(
            "cuMemImportFromShareableHandle",
            ctypes.byref(handle),
            ctypes.c_void_p(fd),
            CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR,
        )
        try:
            self._map = _Mapping(handle.value, size, ordinal, CU_MEM_ACCESS_FLAGS_PROT_READ)
        finally:
            _call("cuMemRelease", ctypes.c_uint64(handle.value))  # the mapping holds its own reference
        self.read_only = self._map.read_only

    def tensor(self, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        return self._map.tensor(offset, dtype, shape)


def import_arena(fd: int, size: int, ordinal: int) -> ImportedArena:
    return ImportedArena(fd, size, ordinal)
