"""The worker side of ``--loader gpu``: file bytes, crop boxes and flips, no pixels.

CPU workers read each file, take the image size from the JPEG frame header (no decoding)
and draw the crop from the sample's seed with the same generator calls as the PIL path, so
both loaders augment a sample identically. A batch crosses to the main process as ONE uint8
tensor of concatenated bitstreams and crops plus small arrays (:func:`collate_packed`: each
tensor passed between processes costs the receiver a handshake with the worker). Files the
device decoders cannot take (not a JPEG, CMYK, 12-bit, arithmetic coded, no end-of-image
marker) are decoded by PIL in the worker: for training they arrive as the decoded pixels
around their crop box, which the device crops, resizes and flips with the rest of the batch;
for validation as finished crops. Files PIL cannot read either arrive as bad paths. A fixed
share of the other files, chosen by the sample's seed (:func:`on_cpu`), goes the same way: the
workers' cores decode beside the device decoder instead of idling. Module-level and picklable.
"""

from __future__ import annotations

from typing import NamedTuple, Optional, Sequence, Tuple

import numpy as np
import torch

from kd.data.decoders import DEVICE_SOF, torchvision_decode
from kd.data.folder import ImageFolderPIL, flip_coin, random_resized_crop_params, val_geometry
from kd.data.prepared import RAW, Prepared

#: How far from the end of a file the end-of-image marker is looked for.
EOI_WINDOW = 4096
_STANDALONE = {0x01, 0xD0, 0xD1, 0xD2, 0xD3, 0xD4, 0xD5, 0xD6, 0xD7, 0xD8}
_NOT_SOF = {0xC4, 0xC8, 0xCC}

ENCODED, PIXELS, REGION, PIL_CROP, BAD = "encoded", "pixels", "region", "pil", "bad"


def jpeg_size(data: bytes, frame_types: Sequence[int] = DEVICE_SOF) -> Optional[Tuple[int, int]]:
    """(height, width) of an 8-bit, 1- or 3-component Huffman JPEG with an end marker, else None.

    Reads the markers up to the frame header only; None means "let PIL decode this file".
    """
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8 or data.rfind(b"\xff\xd9", max(0, n - EOI_WINDOW)) < 0:
        return None
    pos = 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        if marker in (0xD9, 0xDA):  # end of image or a scan before any frame header
            return None
        length = (data[pos + 2] << 8) | data[pos + 3]
        if length < 2:
            return None
        if 0xC0 <= marker <= 0xCF and marker not in _NOT_SOF:
            if marker not in frame_types or pos + 10 > n:
                return None
            precision, components = data[pos + 4], data[pos + 9]
            height = (data[pos + 5] << 8) | data[pos + 6]
            width = (data[pos + 7] << 8) | data[pos + 8]
            if precision != 8 or components not in (1, 3) or height == 0 or width == 0:
                return None
            return height, width
        pos += 2 + length
    return None


def on_cpu(seed: int, share: float) -> bool:
    """Whether the sample of ``seed`` is one of the ``share`` the workers decode with PIL.

    A hash of the seed, independent of the crop's draws from it: the same samples every run and
    every worker count, about ``share`` of any batch.
    """
    if share <= 0.0:
        return False
    mixed = (seed * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & 0xFFFFFFFFFFFFFFFF
    mixed = ((mixed ^ (mixed >> 31)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    return ((mixed ^ (mixed >> 29)) >> 11) / 2.0**53 < share


def train_box(height: int, width: int, seed: int, scale=(0.08, 1.0)) -> Tuple[Tuple[int, int, int, int], bool]:
    """RandomResizedCrop box ``(x1, y1, x2, y2)`` and the flip coin, drawn exactly as the PIL path."""
    gen = torch.Generator().manual_seed(seed)
    top, left, h, w = random_resized_crop_params(height, width, gen, scale)
    flip = flip_coin(gen)
    return (left, top, left + w, top + h), flip


def val_box(height: int, width: int, size: int, resize: int) -> Tuple[float, float, float, float]:
    """The source box of the val transform (torchvision's Resize + CenterCrop, :func:`val_geometry`)."""
    new_w, new_h, left, top = val_geometry(height, width, size, resize)
    sx, sy = width / new_w, height / new_h
    return left * sx, top * sy, (left + size) * sx, (top + size) * sy


class Sample(NamedTuple):
    kind: str  # ENCODED, PIXELS, REGION, PIL_CROP or BAD
    # bitstream bytes, decoded CHW pixels, the decoded pixels around the crop box or the PIL crop (both HWC)
    data: Optional[np.ndarray]
    height: int
    width: int
    box: Tuple[float, float, float, float]
    flip: bool
    label: int
    path: str
    sample_index: int  # not ``index``: that would hide tuple.index
    seed: int
    #: the finished strong view (HWC, :mod:`kd.data.views`) where the loader makes two views
    strong: Optional[np.ndarray] = None


class JpegBytes:
    """``(index, seed)`` -> a :class:`Sample` for the device pipeline (see the module docstring).

    ``frame_types``: the JPEG frame types the device decoder takes (others go through PIL).
    ``decode_in_worker=True`` makes the workers decode JPEGs on the CPU (torchvision's
    libjpeg-turbo) and send pixels instead of bitstreams: the fallback where no device decoder
    exists; crop and resize still run batched in the main process. ``cpu_share``: the fraction
    of samples (:func:`on_cpu`) that go through the PIL path whatever their format. ``views`` 2
    (training): each sample also carries its strong view, finished by PIL in the worker
    (:meth:`ImageFolderPIL.strong_view`); a file whose strong view PIL cannot make is a BAD sample.
    """

    def __init__(
        self,
        samples: Sequence[Tuple[str, int]],
        size: int,
        train: bool,
        resize: Optional[int] = None,
        min_scale: float = 0.08,
        decode_in_worker: bool = False,
        frame_types: Sequence[int] = DEVICE_SOF,
        cpu_share: float = 0.0,
        views: int = 1,
    ):
        self.pil = ImageFolderPIL(samples, size, train, resize, min_scale, views=views)
        self.decode_in_worker = decode_in_worker
        self.frame_types = tuple(frame_types)
        self.cpu_share = cpu_share

    @property
    def samples(self) -> Sequence[Tuple[str, int]]:
        return self.pil.samples

    def __len__(self) -> int:
        return len(self.pil)

    def box(self, height: int, width: int, seed: int):
        """``(box, flip)`` of one sample: its train crop, or the val centre crop."""
        if self.pil.train:
            return train_box(height, width, seed, self.pil.scale)
        return val_box(height, width, self.pil.size, self.pil.resize), False

    def __getitem__(self, item) -> Sample:
        sample = self.first_view(item)
        if self.pil.views == 1 or sample.kind == BAD:
            return sample
        strong = self.pil.strong_view((sample.sample_index, sample.seed))
        if strong is None:
            return Sample(
                BAD, None, 0, 0, (0, 0, 0, 0), False, sample.label, sample.path, sample.sample_index, sample.seed
            )
        return sample._replace(strong=np.asarray(strong))

    def first_view(self, item) -> Sample:
        """The sample's own crop (its only one where the loader makes one view)."""
        index, seed = item if isinstance(item, tuple) else (item, 0)
        if on_cpu(seed, self.cpu_share):
            return self.cpu_sample(index, seed)
        samples = self.pil.samples
        path, label = samples[index]
        try:
            if isinstance(samples, Prepared):
                if samples.format(index) == RAW:  # pixels already: the worker crops them out (no decode)
                    return self.cpu_sample(index, seed)
                data = samples.data(index)
            else:
                with open(path, "rb") as fh:
                    data = fh.read()
        except OSError:
            return Sample(BAD, None, 0, 0, (0, 0, 0, 0), False, label, path, index, seed)
        size = jpeg_size(data, self.frame_types)
        if size is not None:
            box, flip = self.box(size[0], size[1], seed)
            array = np.frombuffer(data, dtype=np.uint8)
            if not self.decode_in_worker:
                return Sample(ENCODED, array, size[0], size[1], box, flip, label, path, index, seed)
            pixels = torchvision_decode(torch.from_numpy(array.copy()))
            if pixels is not None and tuple(pixels.shape[1:]) == size:
                return Sample(PIXELS, pixels.numpy(), size[0], size[1], box, flip, label, path, index, seed)
        return self.cpu_sample(index, seed)

    def cpu_sample(self, index: int, seed: int) -> Sample:
        """A sample the worker decodes with PIL: for training, the decoded region around its crop
        box, which the device resizes with the others (:meth:`ImageFolderPIL.region`); for
        validation, the finished crop."""
        if not self.pil.train:
            return self.pil_sample(index, seed)
        pixels, box, flip, label, path = self.pil.region((index, seed))
        if pixels is None:
            return Sample(BAD, None, 0, 0, (0, 0, 0, 0), False, label, path, index, seed)
        return Sample(REGION, pixels, pixels.shape[0], pixels.shape[1], box, flip, label, path, index, seed)

    def pil_sample(self, index: int, seed: int) -> Sample:
        """The PIL path's crop of one sample (HWC: the layout PIL keeps, no transposing copy), or a
        BAD sample."""
        img, label, path = self.pil.crop((index, seed))
        if img is None:
            return Sample(BAD, None, 0, 0, (0, 0, 0, 0), False, label, path, index, seed)
        return Sample(PIL_CROP, np.asarray(img), img.height, img.width, (0, 0, 0, 0), False, label, path, index, seed)


def _payload(sample: Sample) -> np.ndarray:
    """``sample.data`` of a sample that has one (all but BAD samples)."""
    assert sample.data is not None, f"{sample.kind} sample {sample.path} without data"
    return sample.data


def _packed(arrays: Sequence[np.ndarray]) -> torch.Tensor:
    """``arrays`` concatenated into one uint8 tensor; in a DataLoader worker, written straight into
    shared memory, as torch's default collate does (sending a private tensor copies it there)."""
    total = sum(a.size for a in arrays)
    if torch.utils.data.get_worker_info() is None:
        out = torch.empty(total, dtype=torch.uint8)
    else:
        out = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(total))
    if arrays:
        np.concatenate(arrays, out=out.numpy())
    return out


def collate_packed(batch: Sequence[Sample]) -> dict:
    """One batch as ONE tensor plus small arrays: what crosses from a worker to the main process.

    Every tensor a worker returns crosses as its own shared-memory file descriptor, and each costs
    the receiving thread a socket handshake with the worker (about 1 ms): so the device samples'
    bytes and the PIL crops travel packed in ``data`` (one uint8 tensor), and the rest as NumPy
    arrays and lists, pickled with the message. :func:`unpacked` turns it into tensors.
    """
    # the device samples: bitstreams (or the workers' decodes), then the regions the workers decoded
    dev = [s for s in batch if s.kind in (ENCODED, PIXELS)] + [s for s in batch if s.kind == REGION]
    pil = [s for s in batch if s.kind == PIL_CROP]
    strong = [s for s in batch if s.strong is not None]  # in the batch's order
    positions = {id(s): i for i, s in enumerate(batch)}
    arrays = [_payload(s).reshape(-1) for s in dev] + [_payload(s).reshape(-1) for s in pil]
    arrays += [s.strong.reshape(-1) for s in strong if s.strong is not None]
    return {
        "data": _packed(arrays),
        "lengths": np.array([_payload(s).size for s in dev], dtype=np.int64),
        "shapes": np.array([(s.height, s.width) for s in dev], dtype=np.int64).reshape(-1, 2),
        "boxes": np.array([s.box for s in dev], dtype=np.float32).reshape(-1, 4),
        "flips": np.array([s.flip for s in dev], dtype=bool),
        "labels": np.array([s.label for s in dev], dtype=np.int64),
        "index": np.array([s.sample_index for s in dev], dtype=np.int64),
        "seeds": np.array([s.seed for s in dev], dtype=np.int64),
        "positions": np.array([positions[id(s)] for s in dev], dtype=np.int64),
        "paths": [s.path for s in dev],
        "pixels": bool(dev) and dev[0].kind == PIXELS,
        "regions": sum(s.kind == REGION for s in dev),
        "pil_shape": (len(pil), *_payload(pil[0]).shape) if pil else (0, 1, 1, 3),
        "pil_labels": np.array([s.label for s in pil], dtype=np.int64),
        "pil_index": np.array([s.sample_index for s in pil], dtype=np.int64),
        "pil_positions": np.array([positions[id(s)] for s in pil], dtype=np.int64),
        "strong_shape": (len(strong), *strong[0].strong.shape) if strong and strong[0].strong is not None else None,
        "strong_positions": np.array([positions[id(s)] for s in strong], dtype=np.int64),
        "bad": [s.path for s in batch if s.kind == BAD],
    }


def unpacked(host: dict) -> dict:
    """A :func:`collate_packed` batch with tensors for its arrays, on the receiving side.

    Keys: ``data`` (the device samples' bytes, or decoded CHW pixels where ``pixels``; its last
    ``regions`` samples are pixel regions the workers decoded, HWC), ``lengths`` (bytes per
    device sample), ``shapes`` (height, width), ``boxes`` (x1, y1, x2, y2 in source pixels),
    ``flips``, ``labels``, ``index``, ``seeds``, ``positions`` (where each device sample stands
    in the batch), ``paths``; ``pil_images``, ``pil_labels`` and
    ``pil_positions`` (and ``pil_index``): the PIL path's finished crops, ``(N, 3, H, W)`` views of HWC pixels; ``bad``:
    paths nothing could read; ``strong_images`` and ``strong_positions``: the strong views, in the
    batch's order, where the loader makes two views (else None).
    ``data``, ``pil_images`` and ``strong_images`` are views of the one tensor that crossed (pinned where it was).
    """
    out = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in host.items()}
    split = int(out["lengths"].sum())
    data = out["data"]
    out["data"] = data[:split]
    end = split + int(np.prod(host["pil_shape"]))
    out["pil_images"] = data[split:end].view(host["pil_shape"]).permute(0, 3, 1, 2)
    shape = host.get("strong_shape")
    out["strong_images"] = None if shape is None else data[end:].view(shape).permute(0, 3, 1, 2)
    return out
