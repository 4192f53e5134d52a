"""JPEG decoders for ``--loader gpu``: nvImageCodec, torchvision's nvJPEG, or the CPU.

A decoder turns one packed host batch (:func:`kd.data.bytes_dataset.collate_packed`) into a
list of ``(3, H, W)`` uint8 images on the device, with None where it could not decode an image
(the loader then sends that file through PIL). It is called from the loader's decode thread,
whose current CUDA stream is the loader's decode stream. :func:`make_decoder` picks the first
one that works here and passes a self-check on small JPEGs, and says why others were skipped.
nvImageCodec is optional and imported only here.
"""

from __future__ import annotations

import io
import warnings
from typing import ClassVar, Dict, List, Optional, Sequence, Tuple, Type

import numpy as np
import torch

from kd.errors import KDError

# torchvision 0.29 deprecates its image codecs in favour of TorchCodec; they still work and
# torchvision 0.26 has no replacement to switch to, so say it once per process at most.
warnings.filterwarnings(
    "ignore", message="The image decoding and encoding capabilities of TorchVision", category=DeprecationWarning
)

#: Frame types a device decoder takes: baseline, extended sequential and progressive Huffman.
DEVICE_SOF = (0xC0, 0xC1, 0xC2)
BASELINE_ONLY = (0xC0, 0xC1)


def torchvision_decode(blob: torch.Tensor, device: Optional[torch.device] = None) -> Optional[torch.Tensor]:
    """One JPEG as ``(3, H, W)`` uint8 RGB by torchvision, with nvJPEG on a CUDA ``device``, else
    on the CPU; None where it cannot (the caller sends the file through PIL)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    try:
        if device is None or device.type == "cpu":
            return decode_jpeg(blob, mode=ImageReadMode.RGB)
        return decode_jpeg([blob], mode=ImageReadMode.RGB, device=device)[0]
    except RuntimeError:
        return None


def device_lengths(host: dict) -> Tuple[List[int], List[int]]:
    """Bytes per device sample of a packed batch (:func:`kd.data.bytes_dataset.collate_packed`),
    apart: the bitstreams (or the workers' decodes) for the decoder, then the ``regions`` the
    workers decoded, which follow them in ``data``."""
    lengths = host["lengths"].tolist()
    split = len(lengths) - host["regions"]
    return lengths[:split], lengths[split:]


class Decoder:
    """Base class. ``in_workers``: the DataLoader workers decode and this object only moves pixels."""

    name: ClassVar[str] = ""
    in_workers: ClassVar[bool] = False
    #: Whether progressive JPEGs go to this decoder. The GPU decoders say no: their hardware engines
    #: take baseline files only, and a progressive file sends them to a CPU Huffman path that held a
    #: whole batch up (decode alone: 4,400-4,600 images/s on an ImageNet-like folder with 5 %
    #: progressive files on the H200, docs/benchmarks.md); the workers decode those with PIL instead.
    progressive: ClassVar[bool] = True

    def __init__(self, device: torch.device):
        self.device = device
        #: JPEG frame types (SOF markers) this decoder takes; others go through PIL in the workers.
        self.frame_types: Tuple[int, ...] = DEVICE_SOF if self.progressive else BASELINE_ONLY

    @classmethod
    def unavailable(cls, device: torch.device) -> Optional[str]:
        """Why this decoder cannot run for ``device``, or None."""
        return None

    def images(self, host: dict) -> List[Optional[torch.Tensor]]:
        """The device images of a packed host batch's bitstreams, in its order (not its
        ``regions``, the pixels the workers decoded, which follow them)."""
        lengths, _ = device_lengths(host)
        if not lengths:
            return []
        return self.decode(list(torch.split(host["data"][: sum(lengths)], lengths)))

    def decode(self, blobs: List[torch.Tensor]) -> List[Optional[torch.Tensor]]:
        raise NotImplementedError

    def describe(self) -> str:
        return self.name

    def self_check(self) -> Optional[str]:
        """Decode small JPEGs and compare with PIL: None if fine, else what went wrong."""
        baseline, progressive = probe_jpegs(False), probe_jpegs(True)
        reason = _compare(self._probe_decode(baseline), baseline)
        if reason is None and self.progressive and _compare(self._probe_decode(progressive), progressive) is not None:
            self.frame_types = BASELINE_ONLY
        return reason

    def _probe_decode(self, jpegs: Sequence[bytes]) -> List[Optional[torch.Tensor]]:
        return self.decode([torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in jpegs])


class NvImageCodec(Decoder):
    """nvImageCodec's batched decoder, hardware JPEG engine first, then CUDA, then hybrid."""

    name = "nvimgcodec"
    progressive = False

    @classmethod
    def unavailable(cls, device):
        if device.type != "cuda":
            return "needs a CUDA device"
        try:
            from nvidia import nvimgcodec  # noqa: F401
        except ImportError:
            return "not installed (pip install nvidia-nvimgcodec-cu12 or -cu13)"
        return None

    def __init__(self, device):
        super().__init__(device)
        from nvidia import nvimgcodec

        self.version = getattr(nvimgcodec, "__version__", "?")
        kinds = [
            nvimgcodec.BackendKind.HW_GPU_ONLY,
            nvimgcodec.BackendKind.GPU_ONLY,
            nvimgcodec.BackendKind.HYBRID_CPU_GPU,
        ]
        # fancy upsampling: chroma interpolated as libjpeg (PIL) does, not replicated
        self.code_stream = nvimgcodec.CodeStream
        self.decoder = nvimgcodec.Decoder(
            device_id=device.index, backends=[nvimgcodec.Backend(k) for k in kinds], options=":fancy_upsampling=1"
        )
        params = nvimgcodec.DecodeParams()
        params.apply_exif_orientation = False  # as PIL's plain open(): pixels in file order
        spec = nvimgcodec.ColorSpec
        params.color_spec = spec.RGB if hasattr(spec, "RGB") else spec.SRGB  # 0.9 renamed RGB to SRGB
        if hasattr(params, "allow_any_depth"):
            params.allow_any_depth = False
        self.params = params

    def decode(self, blobs):
        stream = torch.cuda.current_stream(self.device).cuda_stream
        arrays = [b.numpy() for b in blobs]
        try:
            out = self.decoder.decode(arrays, params=self.params, cuda_stream=stream)
        except TypeError:  # versions without implicit array -> code stream conversion
            arrays = [self.code_stream(a) for a in arrays]
            out = self.decoder.decode(arrays, params=self.params, cuda_stream=stream)
        if len(out) != len(arrays):  # some versions drop failed images from the list: find them
            out = [self.decoder.decode(a, params=self.params, cuda_stream=stream) for a in arrays]
        return [None if img is None else self._tensor(img) for img in out]

    def _tensor(self, img) -> torch.Tensor:
        t = torch.as_tensor(img, device=self.device)  # keeps img (and its buffer) alive
        return t.permute(2, 0, 1) if t.dim() == 3 and t.shape[-1] == 3 else t

    def describe(self):
        return (
            f"nvImageCodec {self.version} on {self.device} (hardware JPEG decoder first, then CUDA, "
            f"then hybrid CPU+GPU)"
        )


class Nvjpeg(Decoder):
    """torchvision.io.decode_jpeg(list, device='cuda'): nvJPEG, batched, hardware engine where present."""

    name = "nvjpeg"
    progressive = False

    @classmethod
    def unavailable(cls, device):
        return None if device.type == "cuda" else "needs a CUDA device"

    def decode(self, blobs):
        from torchvision.io import ImageReadMode, decode_jpeg

        try:
            return list(decode_jpeg(blobs, mode=ImageReadMode.RGB, device=self.device))
        except RuntimeError:  # one bad image fails the whole batch: decode one by one to find it
            return [torchvision_decode(blob, self.device) for blob in blobs]

    def describe(self):
        import torchvision

        return (
            f"torchvision {torchvision.__version__} nvJPEG on {self.device} (batched; its hardware "
            f"JPEG engine for baseline files where the GPU has one)"
        )


class CpuThread(Decoder):
    """torchvision's CPU decoder in the loader's decode thread (one core): tests, small machines."""

    name = "cpu-thread"

    def decode(self, blobs):
        images = [torchvision_decode(blob) for blob in blobs]
        return [None if img is None else img.to(self.device, non_blocking=True) for img in images]

    def describe(self):
        return "CPU: torchvision.io.decode_jpeg in the loader's decode thread"


class CpuWorkers(Decoder):
    """The DataLoader workers decode with torchvision on the CPU; here pixels only move and split."""

    name = "cpu"
    in_workers = True

    def images(self, host):
        lengths, _ = device_lengths(host)
        if not lengths:
            return []
        data = host["data"][: sum(lengths)].to(self.device, non_blocking=True)
        return [
            part.view(3, int(h), int(w)) for part, (h, w) in zip(torch.split(data, lengths), host["shapes"].tolist())
        ]

    def self_check(self):
        return None

    def describe(self):
        return "CPU: torchvision.io.decode_jpeg in the DataLoader workers"


DECODERS: Dict[str, Type[Decoder]] = {c.name: c for c in (NvImageCodec, Nvjpeg, CpuWorkers, CpuThread)}
#: nvJPEG first: on an ImageNet-like folder (mixed sizes, progressive files to PIL) the gpu loader alone
#: ran at 9,997 images/s with it and 5,843 with nvImageCodec, below the step's 9,300 (H200,
#: docs/benchmarks.md); nvImageCodec's hardware engine leaves the SMs to the step but decoded
#: at 4,825 images/s there.
AUTO_ORDER = ("nvjpeg", "nvimgcodec", "cpu")


def make_decoder(device: torch.device, choice: str = "auto") -> Tuple[Decoder, List[str]]:
    """The decoder for ``device``: ``choice``, or for ``auto`` the first of AUTO_ORDER that works.

    Returns it with notes on the candidates skipped and why; a named choice that cannot run
    is a KDError.
    """
    if choice != "auto" and choice not in DECODERS:
        raise KDError(f"unknown JPEG decoder {choice!r}; choose from: auto, {', '.join(DECODERS)}")
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    notes: List[str] = []
    for name in AUTO_ORDER if choice == "auto" else (choice,):
        cls = DECODERS[name]
        reason = cls.unavailable(device)
        if reason is None:
            try:
                decoder = cls(device)
                reason = decoder.self_check()
            except Exception as exc:  # an optional library failing in any way means: not this one
                reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
        if reason is None:
            return decoder, notes
        if choice != "auto":
            raise KDError(f"JPEG decoder {name} cannot run on {device}: {reason}")
        notes.append(f"{name} {reason}")
    raise AssertionError("the cpu decoder always works")  # pragma: no cover


def probe_jpegs(progressive: bool) -> List[bytes]:
    """Two small JPEGs (colour 4:2:0 with odd sizes, and grey) for self-checks."""
    from PIL import Image

    y, x = np.mgrid[0:37, 0:53]
    colour = np.stack([x * 4, y * 6, (x + y) * 2 % 256], axis=-1).astype(np.uint8)
    grey = (np.add.outer(np.arange(24) * 9, np.arange(40) * 5) % 256).astype(np.uint8)
    out = []
    for array in (colour, grey):
        buf = io.BytesIO()
        Image.fromarray(array).save(buf, format="JPEG", quality=90, progressive=progressive)
        out.append(buf.getvalue())
    return out


def pil_rgb(jpeg: bytes) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(jpeg)) as im:
        return np.asarray(im.convert("RGB"))


def _compare(decoded: List[Optional[torch.Tensor]], jpegs: Sequence[bytes], tolerance: float = 3.0) -> Optional[str]:
    if len(decoded) != len(jpegs):
        return f"returned {len(decoded)} images for {len(jpegs)}"
    for img, jpeg in zip(decoded, jpegs):
        ref = pil_rgb(jpeg)
        if img is None:
            return "failed to decode a test JPEG"
        got = img.permute(1, 2, 0).cpu().numpy()
        if got.shape != ref.shape:
            return f"decoded a test JPEG as {tuple(got.shape)}, PIL as {ref.shape}"
        diff = float(np.abs(got.astype(np.float32) - ref).mean())
        if diff > tolerance:
            return f"decodes a test JPEG {diff:.1f} levels away from PIL on average"
    return None
