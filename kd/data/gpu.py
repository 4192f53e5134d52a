"""``--loader gpu``: JPEG bytes from CPU workers, decoded, cropped and normalised on the device.

Each stage works one batch ahead of the next:

1. DataLoader workers read file bytes and draw each crop box from the sample's seed
   (:mod:`kd.data.bytes_dataset`); for a share of the samples they decode with PIL and send the
   pixels around the box. A batch arrives as one packed uint8 tensor.
2. A decode thread turns a packed batch into device images on the *decode* stream
   (:mod:`kd.data.decoders`), and the workers' regions into device views (one copy); the
   decoders release the GIL while they work, and the thread does little else, so the training
   step's Python thread is not held up by it.
3. The main thread enqueues, on the *prep* stream, the crop, resize, per-sample flip and
   normalisation: one Triton kernel for the whole batch (:mod:`kd.data.crop_kernel`), or where
   that cannot run, one roi_align per image size and the calls around it (:func:`crop_resize`);
   then it hands over the batch before: the consumer's stream waits on an event and the tensors
   are recorded on it. So batch k+1 is cropped, and k+2 decoded, while the step of batch k runs.

Decoded images stay referenced until the prep stream has read them (an event per batch), so no
decoder writes into memory a pending kernel still reads. Without CUDA the same code runs on
CPU tensors, with no streams: that is how CI tests it. Images the device decoder refuses go
through PIL (the workers for non-JPEGs, as regions in training; this module for decoder
failures, as finished crops); files PIL cannot read either are reported in ``Batch.bad`` as the
PIL path does.
"""

from __future__ import annotations

import os
import queue
import sys
import threading
import time
from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torchvision.ops  # noqa: F401  (registers torch.ops.torchvision.roi_align)

from kd.data import crop_kernel
from kd.data.bytes_dataset import BAD, JpegBytes, collate_packed, unpacked
from kd.data.decoders import Decoder, device_lengths, make_decoder
from kd.data.loader import (
    MEAN,
    STD,
    Batch,
    DeviceLoader,
    Shard,
    dataloader_and_sampler,
    left_out,
    normalisation,
    upload,
    val_transform,
    worker_count,
)

#: Environment override of the decoder choice: auto, nvimgcodec, nvjpeg, cpu, cpu-thread.
DECODER_ENV = "KD_GPU_DECODER"
#: Images per second one DataLoader worker decodes with PIL for training, and the device side
#: delivers beside the training step (resnet101 -> resnet18, O1 float16, batch 256,
#: --cpu-decode-share 0: 6,457), on the H200 machine and the ImageNet-like folder of
#: docs/benchmarks.md. The auto --cpu-decode-share gives each side its part. A worker finishing
#: crops made 144 images/s (--loader pil alone: 2,154 with 15 workers); sending the decoded region
#: instead leaves the resize to the device and costs a worker about two thirds of that CPU time,
#: and with it 0.3 measured 86.7 % of the step's speed and 0.2 76.9 % (15 workers, one machine):
#: so the rate that gives 0.3 with 15 workers.
PIL_RATE_PER_WORKER = 184.0
#: The same for validation, whose workers still finish their crops.
PIL_CROP_RATE_PER_WORKER = 144.0
DEVICE_DECODE_RATE = 6450.0
#: Largest float32 stack handed to one roi_align call (elements; 2**27 is 512 MiB).
MAX_STACK_ELEMENTS = 1 << 27


def crop_resize(
    images: Sequence[torch.Tensor], boxes: torch.Tensor, size: int, max_elements: int = MAX_STACK_ELEMENTS
) -> torch.Tensor:
    """Box ``(x1, y1, x2, y2)`` of each ``(3, H, W)`` uint8 image resized to ``size`` x ``size``.

    Returns ``(N, 3, size, size)`` float32 in 0..255, in the order of ``images``. Images of one
    size are stacked and cropped by one roi_align: ``aligned=True`` puts pixel centres at +0.5
    as PIL does, and adaptive sampling takes ceil(box / size) bilinear samples per output pixel
    and axis, an area filter when reducing (close to PIL's antialiased bilinear). ``boxes`` is
    an ``(N, 4)`` float32 CPU tensor.
    """
    n = len(images)
    device = images[0].device
    groups: Dict[Tuple[int, int], List[int]] = {}
    for i, img in enumerate(images):
        groups.setdefault((int(img.shape[-2]), int(img.shape[-1])), []).append(i)
    chunks: List[List[int]] = []
    for (h, w), members in groups.items():
        step = max(1, max_elements // (3 * h * w))
        chunks.extend(members[s : s + step] for s in range(0, len(members), step))
    order = [i for chunk in chunks for i in chunk]
    pin = device.type == "cuda"
    rois = torch.empty(n, 5, pin_memory=pin)
    rois[:, 0] = torch.cat([torch.arange(len(chunk), dtype=torch.float32) for chunk in chunks])
    rois[:, 1:] = boxes[order]
    rois = rois.to(device, non_blocking=True)
    outs, start = [], 0
    for chunk in chunks:
        stack = images[chunk[0]].unsqueeze(0) if len(chunk) == 1 else torch.stack([images[i] for i in chunk])
        # the op itself: torchvision.ops.roi_align swaps in a slow Python version in deterministic mode
        outs.append(
            torch.ops.torchvision.roi_align(stack.float(), rois[start : start + len(chunk)], 1.0, size, size, -1, True)
        )
        start += len(chunk)
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    if order != list(range(n)):
        inverse = torch.empty(n, dtype=torch.long, pin_memory=pin)
        inverse[torch.tensor(order)] = torch.arange(n)
        out = out.index_select(0, inverse.to(device, non_blocking=True))
    return out


def regions(host: dict, device: torch.device) -> List[Optional[torch.Tensor]]:
    """The ``regions`` last device samples of an unpacked batch (HWC pixels the workers decoded)
    on ``device`` in one copy, each as a ``(3, h, w)`` view."""
    bitstreams, lengths = device_lengths(host)
    if not lengths:
        return []
    block = upload(host["data"][sum(bitstreams) :], device)
    shapes = host["shapes"][len(bitstreams) :].tolist()
    return [part.view(h, w, 3).permute(2, 0, 1) for part, (h, w) in zip(torch.split(block, lengths), shapes)]


class _CudaStages:
    """The decode and prep streams, and the events between them and the consumer."""

    def __init__(self, device: torch.device):
        self.device = device
        self.decode = torch.cuda.Stream(device)
        self.prep = torch.cuda.Stream(device)

    def enter_decode_thread(self) -> None:
        torch.cuda.set_device(self.device)
        torch.cuda.set_stream(self.decode)

    def decoded(self):
        event = torch.cuda.Event()
        event.record(self.decode)
        return event

    @contextmanager
    def cropping(self, after):
        with torch.cuda.stream(self.prep):
            self.prep.wait_event(after)
            yield

    def cropped(self):
        event = torch.cuda.Event()
        event.record(self.prep)
        return event

    def hand_over(self, tensors: Sequence[torch.Tensor], event) -> None:
        current = torch.cuda.current_stream(self.device)
        current.wait_event(event)
        for t in tensors:
            t.record_stream(current)

    @staticmethod
    def done(event) -> bool:
        return event.query()

    def finish(self) -> None:
        self.decode.synchronize()
        self.prep.synchronize()


class _HostStages:
    """The same steps on the CPU: nothing to wait for."""

    def enter_decode_thread(self) -> None:
        pass

    def decoded(self):
        return None

    def cropping(self, after):
        return nullcontext()

    def cropped(self):
        return None

    def hand_over(self, tensors, event) -> None:
        pass

    @staticmethod
    def done(event) -> bool:
        return True

    def finish(self) -> None:
        pass


@dataclass
class _Decoded:
    host: dict
    images: List[Optional[torch.Tensor]]  # per device sample; None: decoder failed
    fallback: List[torch.Tensor]  # PIL crops (HWC) of the failures PIL could read
    fallback_labels: List[int]
    fallback_positions: List[int]  # where they stand in the batch
    fallback_index: List[int]  # their indices in the dataset
    bad: List[str]
    event: object  # decode finished (on the decode stream)


_END = object()
#: What :attr:`GpuLoader.stage_times` reports: the decode thread's waits for input, decodes and
#: waits for the consumer, the main thread's crop/flip/normalise enqueueing, and the batches.
STAGE_TIMES = ("input", "decode", "output", "prep", "batches")


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


class _DecodeThread:
    """Pulls packed batches and decodes them, ``depth`` batches ahead; exceptions reach ``get``."""

    def __init__(self, batches: Iterator[dict], decode: Callable[[dict], _Decoded], stages, depth: int = 2):
        self.batches = batches
        self.decode = decode
        self.stages = stages
        self.queue: queue.Queue = queue.Queue(maxsize=depth)
        self.stopping = threading.Event()
        #: seconds the thread spent waiting for the workers' batches, decoding, and waiting for the
        #: consumer to take a decoded batch (the queue full); and the batches it decoded
        self.times: Dict[str, float] = dict.fromkeys(STAGE_TIMES, 0.0)
        self.thread = threading.Thread(target=self._run, name="kd-gpu-decode", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        times = self.times
        try:
            self.stages.enter_decode_thread()
            while True:
                t0 = time.perf_counter()
                host = next(self.batches, None)
                t1 = time.perf_counter()
                if host is None:
                    break
                decoded = self.decode(host)
                t2 = time.perf_counter()
                if self.stopping.is_set() or not self._put(decoded):
                    return
                times["input"] += t1 - t0
                times["decode"] += t2 - t1
                times["output"] += time.perf_counter() - t2
                times["batches"] += 1
            self._put(_END)
        except BaseException as exc:  # handed to the consumer, raised there
            self._put(_Failed(exc))

    def _put(self, item) -> bool:
        while not self.stopping.is_set():
            try:
                self.queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def get(self) -> Optional[_Decoded]:
        item = self.queue.get()
        if isinstance(item, _Failed):
            raise item.exc
        return None if item is _END else item

    def close(self) -> None:
        self.stopping.set()
        if not sys.is_finalizing():  # at interpreter exit a daemon thread is frozen: a join would never return
            self.thread.join()
        while not self.queue.empty():
            self.queue.get_nowait()


class GpuLoader(DeviceLoader):
    """The loader of ``--loader gpu``: same interface as :class:`DeviceLoader`, batches of
    normalised float images and labels on the device (see the module docstring)."""

    def __init__(
        self,
        loader,
        sampler,
        device: torch.device,
        channels_last: bool,
        limit: Optional[int],
        dataset: JpegBytes,
        decoder: Decoder,
        notes: Sequence[str] = (),
        norm: Tuple[Tuple[float, ...], Tuple[float, ...]] = (MEAN, STD),
    ):
        super().__init__(loader, sampler, device, channels_last, limit, norm)
        self.dataset = dataset
        self.decoder = decoder
        self.notes = list(notes)
        self.size = dataset.pil.size
        #: why the one-kernel crop (kd.data.crop_kernel) is not used, or None where it is
        self.kernel_missing = crop_kernel.unavailable(device)
        self._stage_obj = None
        #: seconds per stage over every epoch so far (STAGE_TIMES): where a slow loader waits
        self.stage_times: Dict[str, float] = dict.fromkeys(STAGE_TIMES, 0.0)

    def describe(self) -> str:
        where = (
            "on side CUDA streams, one batch ahead of the step"
            if self.device.type == "cuda"
            else "on the CPU (no CUDA device)"
        )
        share = self.dataset.cpu_share
        by_workers = (
            "by the workers (PIL), cropped with the rest"
            if self.dataset.pil.train
            else "and cropped by the workers (PIL)"
        )
        text = (
            f"{self.heading('gpu')}: file bytes from {self.loader.num_workers} DataLoader worker(s); "
            f"decoder {self.decoder.name}: {self.decoder.describe()}; "
            + (f"{100 * share:.0f} % of the images decoded {by_workers}; " if share else "")
            + (
                f"crop, resize, flip and normalisation: one Triton kernel per batch, {where}"
                if self.kernel_missing is None
                else f"crop+resize: one roi_align per image size, {where} (one-kernel crop: {self.kernel_missing})"
            )
        )
        if self.dataset.pil.views == 2:
            text += "; each sample's strong view made by the workers (PIL) and normalised with the rest"
        return text + (f"; skipped decoders: {'; '.join(self.notes)}" if self.notes else "")

    def _stages(self):
        # made once: the caching allocator keeps freed memory per stream, so new streams every
        # epoch would strand what the old ones cached
        if self._stage_obj is None:
            self._stage_obj = _CudaStages(self.device) if self.device.type == "cuda" else _HostStages()
        return self._stage_obj

    def __iter__(self) -> Iterator[Batch]:
        remaining = len(self)
        if remaining == 0:
            return
        stages = self._stages()
        feeder = _DecodeThread(iter(self.loader), lambda host: self._decode(unpacked(host), stages), stages)
        retire: deque = deque()  # (event, decoded batch) kept until the prep stream has read it
        pending = None
        first = self.left_out if self.limit is None else []  # with the first batch of a whole pass
        try:
            while True:
                staged = None
                if remaining - (pending is not None) > 0:
                    item = feeder.get()
                    if item is not None:
                        t0 = time.perf_counter()
                        staged = self._crop(item, stages)
                        self.stage_times["prep"] += time.perf_counter() - t0
                        retire.append((staged[4], item))
                if pending is not None:
                    images, labels, bad, indices, event, second = pending
                    stages.hand_over((images, labels) if second is None else (images, labels, second), event)
                    yield Batch(images, labels, bad, indices, first, second_images=second)
                    first = []
                    remaining -= 1
                while retire and stages.done(retire[0][0]):
                    retire.popleft()
                if staged is None:
                    break
                pending = staged
        finally:
            feeder.close()
            for key, seconds in feeder.times.items():  # its "prep" stays 0: the main thread times that
                self.stage_times[key] += seconds
            stages.finish()
            retire.clear()

    def _decode(self, host: dict, stages) -> _Decoded:
        """Decode-thread work for one batch: device images (the decoder's, then the regions the
        workers decoded, in one upload), plus PIL for what the decoder refused."""
        images = self.decoder.images(host) + regions(host, self.device)
        fallback, labels, positions, indices, bad = [], [], [], [], list(host["bad"])
        for i, img in enumerate(images):
            if img is None:
                sample = self.dataset.pil_sample(int(host["index"][i]), int(host["seeds"][i]))
                if sample.kind == BAD:
                    bad.append(sample.path)
                else:
                    fallback.append(torch.from_numpy(np.array(sample.data)))  # HWC, as the workers' crops
                    labels.append(sample.label)
                    positions.append(int(host["positions"][i]))
                    indices.append(int(host["index"][i]))
        return _Decoded(host, images, fallback, labels, positions, indices, bad, stages.decoded())

    def _crop(self, item: _Decoded, stages):
        """Main-thread work for one batch, enqueued on the prep stream: crop, flip, normalise, and
        the samples back in the sampler's order (PIL crops came apart from the device's)."""
        host, dev = item.host, self.device
        keep = [i for i, img in enumerate(item.images) if img is not None]
        boxes, flips, labels, positions = host["boxes"], host["flips"], host["labels"], host["positions"]
        samples = host["index"]
        if len(keep) < len(item.images):
            index = torch.tensor(keep, dtype=torch.long)
            boxes, flips, labels, positions, samples = (t[index] for t in (boxes, flips, labels, positions, samples))
        crops = [item.images[i] for i in keep]
        finished = [host["pil_images"]] if host["pil_labels"].numel() else []
        if item.fallback:
            finished.append(torch.stack(item.fallback).permute(0, 3, 1, 2))
        # the workers' PIL crops and the fallbacks are finished: flipped, at the output size
        done_labels = [host["pil_labels"], torch.tensor(item.fallback_labels, dtype=torch.long)]
        done_positions = [host["pil_positions"], torch.tensor(item.fallback_positions, dtype=torch.long)]
        where = torch.cat([positions, *done_positions])  # each sample's place in the batch
        with stages.cropping(item.event):
            done = upload(finished[0] if len(finished) == 1 else torch.cat(finished), dev) if finished else None
            crop = self._fused if self.kernel_missing is None else self._separate
            images = crop(crops, done, boxes, flips, where)
            order = where.argsort()
            label_dev = upload(torch.cat([labels, *done_labels])[order], dev)
            second = self._second_views(host, where)
            event = stages.cropped()
        indices = torch.cat([samples, host["pil_index"], torch.tensor(item.fallback_index, dtype=torch.long)])[order]
        return images, label_dev, item.bad, indices, event, second

    def _second_views(self, host: dict, where: torch.Tensor) -> Optional[torch.Tensor]:
        """The workers' strong views of the batch's samples (those at the places ``where``, in their
        order), normalised on the device; None where the loader makes one view."""
        strong = host.get("strong_images")
        if strong is None:
            return None
        kept = torch.isin(host["strong_positions"], where)  # not a sample the device decoder and PIL then lost
        return self.normalise(upload(strong[kept].contiguous(), self.device), self.memory_format)

    def _fused(self, crops, done, boxes, flips, where) -> torch.Tensor:
        """One Triton kernel: every sample cropped (the finished ones copied), flipped, normalised
        and written at its place in the batch (:mod:`kd.data.crop_kernel`)."""
        size = self.size
        sources = list(crops) + (list(done.unbind(0)) if done is not None else [])
        n_done = len(sources) - len(crops)
        full = torch.tensor([0.0, 0.0, size, size]).expand(n_done, 4)
        places = torch.empty_like(where)
        places[where.argsort()] = torch.arange(len(where))
        out = torch.empty(len(sources), 3, size, size, device=self.device, memory_format=self.memory_format)
        return crop_kernel.crop_batch(
            sources,
            torch.cat([boxes, full]),
            torch.cat([flips, torch.zeros(n_done, dtype=torch.bool)]),
            places,
            out,
            self.normalise.scale,
            self.normalise.bias,
        )

    def _separate(self, crops, done, boxes, flips, where) -> torch.Tensor:
        """roi_align per image size, then flip, concatenation, reordering and normalisation."""
        dev = self.device
        parts = []
        if crops:
            cropped = crop_resize(crops, boxes, self.size)
            parts.append(torch.where(upload(flips, dev).view(-1, 1, 1, 1), cropped.flip(3), cropped))
        if done is not None:
            parts.append(done.float())
        if parts:
            x = parts[0] if len(parts) == 1 else torch.cat(parts)
        else:
            x = torch.empty(0, 3, self.size, self.size, device=dev)
        if bool((where[1:] < where[:-1]).any()):  # device crops, then the workers' and the fallbacks'
            x = x.index_select(0, upload(where.argsort(), dev))
        return self.normalise.fused(x, self.memory_format)


def auto_cpu_share(decoder: Decoder, workers: int, train: bool = True) -> float:
    """The share of images the workers decode when --cpu-decode-share is not given: none where the
    CPU decodes anyway, else in proportion to the two sides' rates (PIL_RATE_PER_WORKER, or
    PIL_CROP_RATE_PER_WORKER for validation's finished crops, against DEVICE_DECODE_RATE)."""
    if decoder.in_workers or decoder.device.type != "cuda" or workers == 0:
        return 0.0
    cpu = workers * (PIL_RATE_PER_WORKER if train else PIL_CROP_RATE_PER_WORKER)
    return round(cpu / (cpu + DEVICE_DECODE_RATE), 2)


_SHARED: Dict[Tuple[str, str], Tuple[Decoder, List[str]]] = {}


def shared_decoder(device: torch.device, choice: str) -> Tuple[Decoder, List[str]]:
    """One decoder per device and choice in a process (train and val loaders share it)."""
    key = (str(device), choice)
    if key not in _SHARED:
        _SHARED[key] = make_decoder(device, choice)
    return _SHARED[key]


def decoder_choice() -> str:
    """The JPEG decoder asked for in the environment (DECODER_ENV), else ``auto``."""
    return os.environ.get(DECODER_ENV, "auto").strip() or "auto"


def make_gpu_loader(cfg, samples, train: bool, shard: Shard, every_sample: bool = False, views: int = 1) -> GpuLoader:
    """A ``--loader gpu`` loader over ``samples`` for ``shard``, sampled exactly as the PIL loader (``every_sample``
    as there); ``views`` 2: the workers make each training sample's strong view with PIL
    (:class:`JpegBytes`), normalised on the device."""
    decoder, notes = shared_decoder(shard.device, decoder_choice())
    share = cfg.cpu_decode_share
    if share is None:
        share = auto_cpu_share(decoder, worker_count(cfg, shard.num_replicas), train)
    dataset = JpegBytes(
        samples,
        cfg.image_size,
        train,
        val_transform(cfg)[0],
        cfg.min_crop_scale,
        decode_in_worker=decoder.in_workers,
        frame_types=decoder.frame_types,
        cpu_share=share,
        views=views if train else 1,
    )
    loader, sampler = dataloader_and_sampler(cfg, dataset, collate_packed, train, shard, every_sample)
    limit = cfg.limit_train_batches if train else cfg.limit_val_batches
    out = GpuLoader(
        loader, sampler, decoder.device, shard.channels_last, limit, dataset, decoder, notes, normalisation(cfg)
    )
    out.left_out = left_out(samples, train, shard.rank)
    return out
