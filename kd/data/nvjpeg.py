"""nvJPEG's hardware JPEG engine through its C API: the ``nvjpeg-hw`` decoder of ``--loader gpu``.

torchvision's ``decode_jpeg(..., device='cuda')`` drives the same engine but, per batch, parses
every header twice, allocates every image apart, waits for its stream before and after the
decode, and holds one lock for the whole process: the decode thread sat 25.8 ms per batch of
about 180 images in it beside the step (H200, docs/benchmarks.md), the longest stage of the
loader. Here one ``nvjpegDecodeBatched`` call per batch writes every image into one device
buffer and returns once the work is queued on the caller's stream (the loader's decode
stream, which the prep stream waits on through an event), so the thread goes on to the next
batch while the engine works. ctypes releases the interpreter lock for each call.

Two decoder states take turns, each reused only after the batch it last decoded has finished
on the device. Files the engine does not take (``nvjpegDecodeBatchedSupported``: e.g. some
chroma layouts), and whole batches the engine fails on, go through torchvision's nvJPEG.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from pathlib import Path
from typing import List, Optional, Tuple

import numpy as np
import torch

_BACKEND_HARDWARE = 3
_OUTPUT_RGB = 3
_STATUS = {
    1: "not initialized",
    2: "invalid parameter",
    3: "bad JPEG",
    4: "JPEG not supported",
    5: "allocator failure",
    6: "execution failed",
    7: "no hardware JPEG engine on this GPU",
    8: "internal error",
    9: "not supported by this backend",
    10: "incomplete bitstream",
}


class NvjpegError(RuntimeError):
    pass


def library_path() -> Optional[str]:
    """The libnvjpeg to call: the one this process has loaded (torchvision's image extension links
    it; read from /proc/self/maps), else one shipped beside torchvision or by the nvidia-nvjpeg
    wheel, else the system's; None where there is none."""
    try:
        import torchvision.io  # noqa: F401  (loads torchvision's image extension, and with it libnvjpeg)
    except ImportError:
        return None
    try:
        for line in Path("/proc/self/maps").read_text().splitlines():
            name = Path(line.split()[-1]).name if line.split() else ""
            if name.startswith("libnvjpeg") and ".so" in name:
                return line.split()[-1]
    except OSError:  # not Linux
        pass
    import torchvision

    site = Path(torchvision.__file__).resolve().parent.parent
    for pattern in ("torchvision.libs/libnvjpeg*.so*", "nvidia/*/lib/libnvjpeg.so*", "nvidia/*/*/lib/libnvjpeg.so*"):
        found = sorted(site.glob(pattern))
        if found:
            return str(found[-1])
    return ctypes.util.find_library("nvjpeg")


def _bind(path: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(path)
    p, i, u, s = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
    signatures = {
        "nvjpegCreateEx": [i, p, p, u, ctypes.POINTER(p)],
        "nvjpegJpegStateCreate": [p, ctypes.POINTER(p)],
        "nvjpegJpegStreamCreate": [p, ctypes.POINTER(p)],
        "nvjpegJpegStreamParseHeader": [p, p, s, p],
        "nvjpegDecodeBatchedSupported": [p, p, ctypes.POINTER(i)],
        "nvjpegGetImageInfo": [p, p, s, ctypes.POINTER(i), ctypes.POINTER(i), ctypes.POINTER(i), ctypes.POINTER(i)],
        "nvjpegDecodeBatchedInitialize": [p, p, i, i, i],
        "nvjpegDecodeBatched": [p, p, p, p, p, p],
    }
    for name, args in signatures.items():
        fn = getattr(lib, name)
        fn.argtypes, fn.restype = args, i
    return lib


def _check(status: int, what: str) -> None:
    if status != 0:
        raise NvjpegError(f"{what}: {_STATUS.get(status, f'status {status}')}")


class HardwareJpeg:
    """One GPU's hardware JPEG engine (see the module docstring); errors raise :class:`NvjpegError`."""

    def __init__(self, device: torch.device):
        self.device = device
        path = library_path()
        if path is None:
            raise NvjpegError("libnvjpeg not found")
        self.lib = _bind(path)
        self.handle = ctypes.c_void_p()
        _check(self.lib.nvjpegCreateEx(_BACKEND_HARDWARE, None, None, 0, ctypes.byref(self.handle)), "nvjpegCreateEx")
        self.parsed = ctypes.c_void_p()
        _check(self.lib.nvjpegJpegStreamCreate(self.handle, ctypes.byref(self.parsed)), "nvjpegJpegStreamCreate")
        self.states: List[ctypes.c_void_p] = []
        for _ in range(2):
            state = ctypes.c_void_p()
            _check(self.lib.nvjpegJpegStateCreate(self.handle, ctypes.byref(state)), "nvjpegJpegStateCreate")
            self.states.append(state)
        self.busy: List[Optional[tuple]] = [None, None]  # per state: (event, what the call read)
        self.turn = 0

    def takes(self, pointer: int, length: int) -> bool:
        """Whether the engine takes this file (its header parsed, nvjpegDecodeBatchedSupported)."""
        if self.lib.nvjpegJpegStreamParseHeader(self.handle, pointer, length, self.parsed) != 0:
            return False
        supported = ctypes.c_int(-1)
        status = self.lib.nvjpegDecodeBatchedSupported(self.handle, self.parsed, ctypes.byref(supported))
        return status == 0 and supported.value == 0

    def dims(self, pointer: int, length: int) -> Tuple[int, int]:
        """(height, width) from the header, (0, 0) where it cannot be read."""
        comps, sampling = ctypes.c_int(), ctypes.c_int()
        widths, heights = (ctypes.c_int * 4)(), (ctypes.c_int * 4)()
        if self.lib.nvjpegGetImageInfo(self.handle, pointer, length, comps, sampling, widths, heights) != 0:
            return 0, 0
        return heights[0], widths[0]

    def enqueue(self, pointers: np.ndarray, lengths: np.ndarray, destinations: np.ndarray, stream, keep) -> None:
        """Queue one batched decode on ``stream`` (a torch CUDA stream): the files at ``pointers``
        (host addresses, ``lengths`` bytes each) into the planes of ``destinations`` (nvjpegImage_t
        rows: :func:`rgb_planes`). ``keep`` (the host memory the pointers point into) and the
        arrays the call read stay referenced until the device has finished the batch."""
        slot, self.turn = self.turn, 1 - self.turn
        previous = self.busy[slot]
        if previous is not None:  # the batch before last, decoded with this state, must have finished
            previous[0].synchronize()
        state = self.states[slot]
        pointers = np.ascontiguousarray(pointers, dtype=np.uint64)
        sizes = np.ascontiguousarray(lengths, dtype=np.uint64)
        destinations = np.ascontiguousarray(destinations, dtype=np.uint64)
        lib, handle = self.lib, self.handle
        status = lib.nvjpegDecodeBatchedInitialize(handle, state, len(sizes), 1, _OUTPUT_RGB)
        _check(status, "nvjpegDecodeBatchedInitialize")
        status = lib.nvjpegDecodeBatched(
            handle,
            state,
            pointers.ctypes.data,
            sizes.ctypes.data,
            destinations.ctypes.data,
            ctypes.c_void_p(stream.cuda_stream),
        )
        _check(status, "nvjpegDecodeBatched")
        event = torch.cuda.Event()
        event.record(stream)
        self.busy[slot] = (event, keep, pointers, sizes, destinations)


def rgb_planes(dims: np.ndarray, device: torch.device) -> Tuple[List[torch.Tensor], np.ndarray]:
    """One uint8 device buffer for images of ``dims`` (height, width) as planar RGB: the
    ``(3, H, W)`` views, and the nvjpegImage_t of each (4 channel pointers, 4 pitches) as rows
    of a uint64 array. Allocated on the current stream."""
    planes = dims[:, 0] * dims[:, 1]
    sizes = 3 * planes
    offsets = np.zeros(len(sizes), dtype=np.int64)
    np.cumsum(sizes[:-1], out=offsets[1:])
    buffer = torch.empty(int(sizes.sum()), dtype=torch.uint8, device=device)
    first = (buffer.data_ptr() + offsets).astype(np.uint64)
    destinations = np.zeros((len(sizes), 8), dtype=np.uint64)
    for c in range(3):
        destinations[:, c] = first + (c * planes).astype(np.uint64)
        destinations[:, 4 + c] = dims[:, 1]
    parts = torch.split(buffer, sizes.tolist())
    return [part.view(3, int(h), int(w)) for part, (h, w) in zip(parts, dims.tolist())], destinations
