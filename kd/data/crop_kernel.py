"""One Triton kernel for a whole batch of ``--loader gpu``: crop, resize, flip, normalise, and
each sample written at its place in the batch.

The loader's other path (:func:`kd.data.gpu.crop_resize`) stacks the device images of each
size, casts them to float and runs one roi_align per size, then concatenates, reorders, flips and
normalises: some ten CUDA calls per image size from the main thread, whose host time the
training step needs (an ImageNet batch holds dozens of sizes). This kernel reads every source
image where it lies (a table of addresses, sizes and strides), so a batch costs one small upload
and one launch. Its sampling is roi_align's with ``aligned=True`` and adaptive sampling (the
other path's), so the two agree to float rounding; the tests compare them.

Triton is imported here only; without it (or without CUDA) the loader keeps the other path.
"""

from __future__ import annotations

import os
from typing import Dict, Optional, Sequence

import torch

#: Environment override of the crop path: ``auto`` (this kernel where it works), ``roi_align``.
CROP_ENV = "KD_GPU_CROP"
BLOCK = 512

_kernel = None


def unavailable(device: torch.device) -> Optional[str]:
    """Why the kernel cannot run for ``device``, or None."""
    choice = os.environ.get(CROP_ENV, "auto").strip() or "auto"
    if choice not in ("auto", "roi_align"):
        return f"{CROP_ENV}={choice!r} is not auto or roi_align"
    if choice == "roi_align":
        return f"{CROP_ENV}=roi_align"
    if device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return "needs a CUDA device"
    key = str(device)
    if key not in _CHECKED:
        try:
            _CHECKED[key] = self_check(device)
        except Exception as exc:  # no Triton, no C compiler for its launcher, an unsupported GPU...
            _CHECKED[key] = f"Triton unusable here ({type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]})"
    return _CHECKED[key]


_CHECKED: Dict[str, Optional[str]] = {}


def self_check(device: torch.device) -> Optional[str]:
    """Compile and run the kernel on two small images whose crops are known: None if right, else
    what was wrong. A copy at full size, mirrored, and a 2x reduction, where roi_align's adaptive
    sampling lands on the pixel centres and so averages each 2x2 block."""
    g = torch.Generator().manual_seed(0)
    a = torch.randint(0, 256, (3, 8, 8), dtype=torch.uint8, generator=g)
    b = torch.randint(0, 256, (3, 16, 16), dtype=torch.uint8, generator=g)
    out = torch.empty(2, 3, 8, 8, device=device)
    scale, bias = torch.tensor([0.5, 1.0, 2.0]), torch.tensor([1.0, 0.0, -1.0])
    boxes = torch.tensor([[0, 0, 8, 8], [0, 0, 16, 16]], dtype=torch.float32)
    crop_batch(
        [a.to(device), b.to(device)],
        boxes,
        torch.tensor([True, False]),
        torch.tensor([1, 0]),
        out,
        scale.to(device),
        bias.to(device),
    )
    channel = (3, 1, 1)
    expect = torch.stack([b.float().view(3, 8, 2, 8, 2).mean(dim=(2, 4)), a.float().flip(2)]) * scale.view(
        channel
    ) + bias.view(channel)
    worst = float((out.cpu() - expect).abs().max())
    return None if worst < 1e-3 else f"self-check: off by {worst:.3g} from the expected crops"


def _compiled():
    global _kernel
    if _kernel is None:
        _kernel = _build()
    return _kernel


def _build():
    import triton
    import triton.language as tl

    @triton.jit
    def crop_kernel(table, boxes, out, scale, bias, S: tl.constexpr, on, oc, oh, ow, BLOCK: tl.constexpr):
        # table row: address, height, width, strides (channel, row, column), flip, place in the batch
        n = tl.program_id(0)
        row = table + n * 8
        src = tl.load(row).to(tl.pointer_type(tl.uint8))
        h = tl.load(row + 1)
        w = tl.load(row + 2)
        sc = tl.load(row + 3)
        sh = tl.load(row + 4)
        sw = tl.load(row + 5)
        flip = tl.load(row + 6)
        dest = tl.load(row + 7)
        x1 = tl.load(boxes + n * 4)
        y1 = tl.load(boxes + n * 4 + 1)
        x2 = tl.load(boxes + n * 4 + 2)
        y2 = tl.load(boxes + n * 4 + 3)
        offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < S * S
        oy = offs // S
        ox = offs % S
        # roi_align, aligned=True, adaptive sampling: ceil(box / S) samples per output pixel and axis
        start_x = x1 - 0.5
        start_y = y1 - 0.5
        bin_w = (x2 - x1) / S
        bin_h = (y2 - y1) / S
        grid_w = tl.maximum(tl.ceil((x2 - x1) / S).to(tl.int32), 1)
        grid_h = tl.maximum(tl.ceil((y2 - y1) / S).to(tl.int32), 1)
        hf = h.to(tl.float32)
        wf = w.to(tl.float32)
        acc0 = tl.zeros([BLOCK], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK], dtype=tl.float32)
        acc2 = tl.zeros([BLOCK], dtype=tl.float32)
        for iy in range(0, grid_h):
            y = start_y + oy.to(tl.float32) * bin_h + (iy + 0.5) * bin_h / grid_h.to(tl.float32)
            y_in = (y >= -1.0) & (y <= hf)
            y = tl.maximum(y, 0.0)
            y_low = y.to(tl.int32)
            y_top = y_low >= h - 1
            y_low = tl.where(y_top, h - 1, y_low)
            y_high = tl.where(y_top, h - 1, y_low + 1)
            y = tl.where(y_top, y_low.to(tl.float32), y)
            ly = y - y_low.to(tl.float32)
            for ix in range(0, grid_w):
                x = start_x + ox.to(tl.float32) * bin_w + (ix + 0.5) * bin_w / grid_w.to(tl.float32)
                inside = mask & y_in & (x >= -1.0) & (x <= wf)
                x = tl.maximum(x, 0.0)
                x_low = x.to(tl.int32)
                x_top = x_low >= w - 1
                x_low = tl.where(x_top, w - 1, x_low)
                x_high = tl.where(x_top, w - 1, x_low + 1)
                x = tl.where(x_top, x_low.to(tl.float32), x)
                lx = x - x_low.to(tl.float32)
                w1 = (1.0 - ly) * (1.0 - lx)
                w2 = (1.0 - ly) * lx
                w3 = ly * (1.0 - lx)
                w4 = ly * lx
                p1 = y_low * sh + x_low * sw
                p2 = y_low * sh + x_high * sw
                p3 = y_high * sh + x_low * sw
                p4 = y_high * sh + x_high * sw
                for c in tl.static_range(3):
                    base = src + c * sc
                    v = (
                        w1 * tl.load(base + p1, mask=inside, other=0).to(tl.float32)
                        + w2 * tl.load(base + p2, mask=inside, other=0).to(tl.float32)
                        + w3 * tl.load(base + p3, mask=inside, other=0).to(tl.float32)
                        + w4 * tl.load(base + p4, mask=inside, other=0).to(tl.float32)
                    )
                    if c == 0:
                        acc0 += v
                    elif c == 1:
                        acc1 += v
                    else:
                        acc2 += v
        count = (grid_h * grid_w).to(tl.float32)
        ox_out = tl.where(flip != 0, S - 1 - ox, ox)
        dst = out + dest * on + oy * oh + ox_out * ow
        tl.store(dst, acc0 / count * tl.load(scale) + tl.load(bias), mask=mask)
        tl.store(dst + oc, acc1 / count * tl.load(scale + 1) + tl.load(bias + 1), mask=mask)
        tl.store(dst + 2 * oc, acc2 / count * tl.load(scale + 2) + tl.load(bias + 2), mask=mask)

    return crop_kernel


def crop_batch(
    images: Sequence[torch.Tensor],
    boxes: torch.Tensor,
    flips: torch.Tensor,
    places: torch.Tensor,
    out: torch.Tensor,
    scale: torch.Tensor,
    bias: torch.Tensor,
) -> torch.Tensor:
    """``out[places[i]]`` = box ``boxes[i]`` of the ``(3, H, W)`` uint8 ``images[i]``, resized to
    ``out``'s size, mirrored where ``flips[i]``, times ``scale`` plus ``bias`` (per channel).

    ``boxes`` (N, 4) float32 ``(x1, y1, x2, y2)``, ``flips`` (N,) bool and ``places`` (N,) int64
    are CPU tensors; ``out`` is ``(B, 3, S, S)`` float32 in any memory format. Enqueued on the
    current stream; the caller keeps ``images`` alive until that stream has passed this point.
    """
    n = len(images)
    if n == 0:
        return out
    pin = out.device.type == "cuda"
    table = torch.empty(n, 8, dtype=torch.int64, pin_memory=pin)
    table[:, :6] = torch.tensor([(img.data_ptr(), *img.shape[1:], *img.stride()) for img in images])
    table[:, 6] = flips
    table[:, 7] = places
    box = torch.empty(n, 4, dtype=torch.float32, pin_memory=pin)
    box.copy_(boxes)
    size = out.shape[-1]
    _compiled()[(n, (size * size + BLOCK - 1) // BLOCK)](
        table.to(out.device, non_blocking=True),
        box.to(out.device, non_blocking=True),
        out,
        scale.reshape(3),
        bias.reshape(3),
        size,
        *out.stride(),
        BLOCK=BLOCK,
    )
    return out
