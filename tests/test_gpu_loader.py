"""--loader gpu: header parsing, crop distribution, pixel parity with the PIL path, bad files,
mid-epoch skip, the decode thread, the CLI; device tests carry the gpu marker."""

from __future__ import annotations

import io
import math
import threading
from pathlib import Path
from typing import List

import numpy as np
import pytest
import torch
from conftest import kd_main, run_kd, train_args
from PIL import Image
from torchvision.transforms import RandomResizedCrop

from kd import config as kd_config
from kd.data import build, crop_kernel
from kd.data import gpu as gpu_mod
from kd.data.bytes_dataset import (
    ENCODED,
    PIL_CROP,
    REGION,
    JpegBytes,
    collate_packed,
    jpeg_size,
    on_cpu,
    train_box,
    unpacked,
    val_box,
)
from kd.data.decoders import BASELINE_ONLY, DECODERS, CpuThread, CpuWorkers, Nvjpeg, make_decoder, pil_rgb
from kd.data.gpu import GpuLoader, auto_cpu_share, crop_resize, make_gpu_loader
from kd.data.loader import GPU_LOADER_HINT, MEAN, STD, Shard, dataloader_and_sampler, make_pil_loader
from kd.data.pipeline import choose_loader
from kd.data.sampler import sample_seed
from kd.errors import KDError

CPU = torch.device("cpu")
pytestmark = pytest.mark.filterwarnings("ignore:The image decoding and encoding capabilities of TorchVision")


def natural_image(rng, width: int, height: int) -> np.ndarray:
    """Smooth colour regions, a few edges and texture, mild noise: JPEG-like content."""
    coarse = Image.fromarray((rng.random((height // 24 + 2, width // 24 + 2, 3)) * 255).astype(np.uint8))
    img = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.float32)
    y, x = np.mgrid[0:height, 0:width]
    img = img + 25 * np.sin(x / 7.0 + y / 11.0)[..., None]
    for _ in range(4):
        x0, y0 = rng.integers(0, width - 10), rng.integers(0, height - 10)
        img[y0 : y0 + rng.integers(5, height // 2), x0 : x0 + rng.integers(5, width // 2)] = rng.random(3) * 255
    img += rng.normal(0, 5, img.shape)
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg_bytes(array: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(array).save(buf, format="JPEG", quality=kw.pop("quality", 90), **kw)
    return buf.getvalue()


def natural_folder(root: Path, sizes=((200, 150), (150, 200), (181, 97)), per_class: int = 4, classes: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in range(classes):
            folder = root / split / f"c{c}"
            folder.mkdir(parents=True, exist_ok=True)
            for i in range(per_class):
                w, h = sizes[(i + c) % len(sizes)]
                (folder / f"{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, w, h)))
    return root


def cfg_for(data, **kw):
    opts = dict(
        data=str(data),
        teacher="resnet18",
        student="resnet18",
        workers=0,
        image_size=64,
        batch_size=8,
        loader="gpu",
        device="cpu",
    )
    opts.update(kw)
    return kd_config.resolve(options=opts)


def batches(loader, epoch=0, skip=0):
    loader.set_epoch(epoch, skip)
    return list(loader)


def unnormalise(images: torch.Tensor) -> torch.Tensor:
    return images.float().cpu() * torch.tensor(STD).view(1, 3, 1, 1) + torch.tensor(MEAN).view(1, 3, 1, 1)


@pytest.fixture(scope="module")
def nat_folder(tmp_path_factory):
    return natural_folder(tmp_path_factory.mktemp("natural"))


# ----------------------------------------------------------------------------- JPEG headers
def test_jpeg_size_reads_the_frame_header(tmp_path):
    rng = np.random.default_rng(1)
    colour, grey = natural_image(rng, 61, 43), natural_image(rng, 30, 52)[..., 0]
    assert jpeg_size(jpeg_bytes(colour)) == (43, 61)
    assert jpeg_size(jpeg_bytes(colour, subsampling=0)) == (43, 61)  # 4:4:4
    assert jpeg_size(jpeg_bytes(grey)) == (52, 30)
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation: still the stored size (PIL's plain open does not rotate either)
    assert jpeg_size(jpeg_bytes(colour, exif=exif.tobytes())) == (43, 61)
    progressive = jpeg_bytes(colour, progressive=True)
    assert jpeg_size(progressive) == (43, 61)
    assert jpeg_size(progressive, BASELINE_ONLY) is None
    cmyk = io.BytesIO()
    Image.fromarray(colour).convert("CMYK").save(cmyk, format="JPEG")
    assert jpeg_size(cmyk.getvalue()) is None  # 4 components: PIL converts those
    png = io.BytesIO()
    Image.fromarray(colour).save(png, format="PNG")
    assert jpeg_size(png.getvalue()) is None
    data = jpeg_bytes(colour)
    assert jpeg_size(data[: len(data) // 2]) is None  # truncated: no end marker
    assert jpeg_size(b"\xff\xd8 not really a jpeg \xff\xd9") is None
    assert jpeg_size(b"") is None


# ----------------------------------------------------------------------------- crop distribution
def _ks(a: np.ndarray, b: np.ndarray) -> float:
    """Two-sample Kolmogorov-Smirnov statistic."""
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max())


def _box_stats(top, left, h, w, height, width):
    return h * w / (height * width), math.log(w / h), (left + w / 2) / width, (top + h / 2) / height


@pytest.mark.parametrize("height,width", [(375, 500), (100, 1000)])
def test_crop_distribution_matches_torchvision(height, width):
    n = 4000
    crit = 1.95 * math.sqrt(2 / n)  # KS at alpha = 0.001
    ours, flips = [], 0
    for i in range(n):
        (x1, y1, x2, y2), flip = train_box(height, width, sample_seed(0, 3, i))
        assert 0 <= x1 < x2 <= width and 0 <= y1 < y2 <= height
        ours.append(_box_stats(y1, x1, y2 - y1, x2 - x1, height, width))
        flips += flip
    img = torch.empty(3, height, width)

    def reference(scale, ratio, seed):
        torch.manual_seed(seed)
        return np.array([_box_stats(*RandomResizedCrop.get_params(img, scale, ratio), height, width) for _ in range(n)])

    ours = np.array(ours)
    ref = reference((0.08, 1.0), (3 / 4, 4 / 3), 1)
    for k, what in enumerate(("area fraction", "log aspect", "centre x", "centre y")):
        assert _ks(ours[:, k], ref[:, k]) < crit, what
        assert abs(ours[:, k].mean() - ref[:, k].mean()) < 4 * ref[:, k].std() / math.sqrt(n) + 1e-9, what
    assert abs(flips / n - 0.5) < 4 * math.sqrt(0.25 / n)
    # the same test tells apart distributions only slightly wrong: it cannot pass by accident
    assert _ks(reference((0.2, 1.0), (3 / 4, 4 / 3), 2)[:, 0], ref[:, 0]) > 3 * crit
    assert _ks(reference((0.08, 1.0), (0.6, 1.6), 3)[:, 1], ref[:, 1]) > 3 * crit


def test_boxes_and_flips_are_the_pil_paths(nat_folder):
    """Same sample seed -> same crop and flip as ImageFolderPIL (the same generator calls)."""
    from kd.data.folder import random_resized_crop_params
    from kd.data.layout import scan

    _, train, _ = scan(str(nat_folder))
    dataset = JpegBytes(train, 64, True)
    for index in range(len(train)):
        seed = sample_seed(5, 2, index)
        sample = dataset[(index, seed)]
        gen = torch.Generator().manual_seed(seed)
        with Image.open(train[index][0]) as im:
            top, left, h, w = random_resized_crop_params(im.height, im.width, gen)
        assert sample.box == (left, top, left + w, top + h)
        assert sample.flip == (torch.rand(1, generator=gen).item() < 0.5)


# ----------------------------------------------------------------------------- batched crop
def test_crop_resize_identity_and_order():
    rng = np.random.default_rng(2)
    images = [
        torch.from_numpy(natural_image(rng, w, h)).permute(2, 0, 1).contiguous()
        for w, h in ((40, 30), (30, 40), (40, 30), (25, 25), (40, 30))
    ]
    boxes = torch.tensor(
        [[0, 0, 40, 30], [0, 0, 30, 40], [3, 2, 33, 32], [0, 0, 25, 25], [10, 0, 40, 30]], dtype=torch.float32
    )
    out = crop_resize(images, boxes, 24)
    assert out.shape == (5, 3, 24, 24) and out.dtype == torch.float32
    single = [
        torch.ops.torchvision.roi_align(img[None].float(), torch.cat([torch.zeros(1), b])[None], 1.0, 24, 24, -1, True)
        for img, b in zip(images, boxes)
    ]
    assert torch.allclose(out, torch.cat(single), atol=1e-4)  # grouping keeps the input order
    assert torch.allclose(crop_resize(images, boxes, 24, max_elements=3 * 40 * 30), out, atol=1e-4)  # chunked
    same = crop_resize([images[3]], torch.tensor([[0, 0, 25, 25]], dtype=torch.float32), 25)
    assert torch.allclose(same[0], images[3].float(), atol=1e-3)  # full box at full size: the pixels


# ----------------------------------------------------------------------------- reduced decode
def test_large_jpegs_are_decoded_reduced_and_still_give_torchvisions_crops(tmp_path, monkeypatch):
    """A training crop that shrinks 4x or more is decoded by libjpeg at 1/2, 1/4 or 1/8 size: the
    result must stay the crop torchvision's transforms make from the full-size image (a box one
    pixel off is 35 levels off on this image), and other formats are decoded whole. Validation
    decodes in full and equals torchvision's crop exactly."""
    import torchvision.transforms.functional as F

    from kd.data import folder as folder_mod
    from kd.data.folder import ImageFolderPIL, random_resized_crop_params, reduced_decode

    rng = np.random.default_rng(3)
    big = tmp_path / "big.jpg"
    big.write_bytes(jpeg_bytes(natural_image(rng, 1200, 900)))
    png = tmp_path / "big.png"
    Image.fromarray(natural_image(rng, 1200, 900)).save(png)
    with Image.open(big) as im:  # 1/10: at least two decoded pixels per output pixel, so 1/4
        assert reduced_decode(im, 0.1, 0.1) == 4 and im.size == (300, 225)
    with Image.open(big) as im:
        assert reduced_decode(im, 0.2, 0.2) == 2 and im.size == (600, 450)
    with Image.open(big) as im:
        assert reduced_decode(im, 0.3, 0.1) == 1 and im.size == (1200, 900)  # x shrinks less than 4x
    with Image.open(png) as im:
        assert reduced_decode(im, 0.1, 0.1) == 1 and im.size == (1200, 900)

    factors = []

    def spy(im, sx, sy):
        factors.append(reduced_decode(im, sx, sy))
        return factors[-1]

    monkeypatch.setattr(folder_mod, "reduced_decode", spy)
    with Image.open(big) as im:
        full = im.convert("RGB")
    size = 48
    for train in (True, False):
        ds = ImageFolderPIL([(str(big), 0)], size, train)
        for seed in range(12):
            got = ds[(0, seed)][0].float()
            if train:
                gen = torch.Generator().manual_seed(seed)
                top, left, h, w = random_resized_crop_params(900, 1200, gen)
                ref = F.resized_crop(full, top, left, h, w, [size, size], F.InterpolationMode.BILINEAR)
                if torch.rand(1, generator=gen).item() < 0.5:
                    ref = F.hflip(ref)
            else:  # validation decodes in full: torchvision's Resize + CenterCrop, bit for bit
                ref = F.center_crop(F.resize(full, ds.resize, F.InterpolationMode.BILINEAR), [size, size])
                assert torch.equal(got, F.pil_to_tensor(ref).float()), seed
                continue
            diff = (got - F.pil_to_tensor(ref).float()).abs().mean().item()
            assert diff < 2.5, (train, seed, diff)  # 0.4-1.5 measured; the full-size decode: 0.2-0.4
    assert max(factors) >= 4 and min(factors) >= 1


# ----------------------------------------------------------------------------- pixel parity
@pytest.mark.parametrize("decoder", ["cpu", "cpu-thread"])
@pytest.mark.parametrize("train", [False, True])
def test_pixels_match_the_pil_path(nat_folder, monkeypatch, decoder, train):
    monkeypatch.setenv(gpu_mod.DECODER_ENV, decoder)
    cfg = cfg_for(nat_folder)
    from kd.data.layout import scan

    _, train_s, val_s = scan(str(nat_folder))
    samples = train_s if train else val_s
    gpu = make_gpu_loader(cfg, samples, train, Shard(1, 0, 8, CPU, False))
    pil = make_pil_loader(cfg, samples, train, Shard(1, 0, 8, CPU, False))
    assert gpu.decoder.name == decoder
    for epoch in (0, 1):
        for g, p in zip(batches(gpu, epoch), batches(pil, epoch), strict=True):
            assert torch.equal(g.labels, p.labels)
            diff = (unnormalise(g.images) - unnormalise(p.images)).abs()
            per_image = diff.mean(dim=(1, 2, 3))
            assert per_image.max() < (2.5 if train else 2.0), per_image  # a wrong box or flip is tens of levels
            assert diff.mean() < 1.5


def test_a_share_of_the_images_is_decoded_by_the_workers_in_the_batchs_order(nat_folder, monkeypatch):
    """--cpu-decode-share: a share chosen by seed is decoded by PIL in the workers, which send the
    pixels around the crop box (the same box and flip); the device crops them with the rest, so
    the batch is the one the device decoder alone gives, in the sampler's order. Validation's
    share arrives as finished crops."""
    from torchvision.io import decode_jpeg

    from kd.data.layout import scan

    _, train, val = scan(str(nat_folder))
    dataset = JpegBytes(train, 64, True, cpu_share=0.5)
    seeds = [sample_seed(5, 0, i) for i in range(200)]
    routed = [on_cpu(seed, 0.5) for seed in seeds]
    assert 70 < sum(routed) < 130 and routed == [on_cpu(seed, 0.5) for seed in seeds]
    assert not any(on_cpu(seed, 0.0) for seed in seeds) and all(on_cpu(seed, 1.0) for seed in seeds)
    for i, seed in enumerate(seeds[:16]):
        sample = dataset[(i % len(train), seed)]
        assert (sample.kind == REGION) == routed[i]
        if routed[i]:
            whole = decode_jpeg(torch.frombuffer(bytearray(Path(sample.path).read_bytes()), dtype=torch.uint8))
            (x1, y1, x2, y2), flip = train_box(whole.shape[1], whole.shape[2], seed)
            left, top = round(x1 - sample.box[0]), round(y1 - sample.box[1])
            assert sample.flip == flip and (x2 - left, y2 - top) == sample.box[2:]
            assert left == max(0, x1 - 1) and top == max(0, y1 - 1)  # one pixel of margin where there is one
            part = whole.permute(1, 2, 0)[top : top + sample.height, left : left + sample.width]
            assert sample.data.shape == (sample.height, sample.width, 3) and np.array_equal(sample.data, part.numpy())
    val_sample = JpegBytes(val, 64, False, cpu_share=1.0)[(0, 7)]
    assert val_sample.kind == PIL_CROP and val_sample.data.shape == (64, 64, 3)

    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    shared = make_gpu_loader(cfg_for(nat_folder, cpu_decode_share=0.5), train, True, Shard(1, 0, 8, CPU, False))
    assert shared.dataset.cpu_share == 0.5 and "50 % of the images decoded by the workers (PIL)" in shared.describe()
    alone = make_gpu_loader(cfg_for(nat_folder, cpu_decode_share=0.0), train, True, Shard(1, 0, 8, CPU, False))
    for epoch in (0, 1):
        for s, a in zip(batches(shared, epoch), batches(alone, epoch), strict=True):
            assert torch.equal(s.labels, a.labels)
            assert (unnormalise(s.images) - unnormalise(a.images)).abs().max() < 1e-3


def test_a_region_resizes_as_the_whole_decoded_image(tmp_path):
    """The region's margin: a bilinear resize of the box reads from half a pixel before it to its
    rounded-up end, so the region (and, for a large image, its reduced decode) gives the crop the
    whole decoded image gives, whatever the box's fractions and the image's borders. A region far
    larger than the output (a large PNG: no reduced decode) comes as the finished PIL crop."""
    from kd.data.folder import ImageFolderPIL

    rng = np.random.default_rng(3)
    paths = []
    for i, (w, h) in enumerate(((173, 131), (90, 203), (1100, 830))):
        paths.append(str(tmp_path / f"{i}.jpg"))
        Path(paths[-1]).write_bytes(jpeg_bytes(natural_image(rng, w, h)))
    paths.append(str(tmp_path / "large.png"))
    Image.fromarray(natural_image(rng, 900, 700)).save(paths[-1])
    folder = ImageFolderPIL([(p, 0) for p in paths], 48, True)
    reduced = finished = 0
    for index in range(len(paths)):
        for seed in range(12):
            pixels, box, flip, _, path = folder.region((index, seed))
            if box == (0.0, 0.0, 48.0, 48.0) and pixels.shape == (48, 48, 3) and not flip:
                finished += path.endswith(".png")  # the worker's own crop, flipped, as the PIL loader's
                assert np.array_equal(pixels, np.asarray(folder.crop((index, seed))[0]))
                continue
            with Image.open(path) as im:
                full_width = im.width
                _, whole_box = folder._train_box(im, seed)
                whole = np.array(im.convert("RGB"))
            reduced += whole.shape[1] < full_width
            got = crop_resize([torch.from_numpy(np.array(pixels)).permute(2, 0, 1)], torch.tensor([box]), 48)
            want = crop_resize([torch.from_numpy(whole).permute(2, 0, 1)], torch.tensor([whole_box]), 48)
            assert (got - want).abs().max() < 0.01, (index, seed)  # float32 coordinates; no margin: levels off
    assert reduced > 0  # the large JPEG's small crops were decoded at a fraction of its size
    assert finished > 0  # the PNG's large crops


class RefusingDecoder(CpuThread):
    """Refuses every image: each goes through PIL in the decode thread."""

    name = "refusing"

    def decode(self, blobs):
        return [None for _ in blobs]


def test_order_holds_when_every_crop_is_pils(nat_folder):
    """Validation: worker crops (the share) and decode-thread fallbacks, no device crop; training:
    the workers' regions, cropped on the device, and the fallbacks. Still the sampler's order."""
    from kd.data.layout import scan

    _, train, val = scan(str(nat_folder))
    cfg = cfg_for(nat_folder)
    for samples, is_train in ((val, False), (train, True)):
        dataset = JpegBytes(samples, 64, is_train, cpu_share=0.5)
        dl, sampler = dataloader_and_sampler(cfg, dataset, collate_packed, is_train, Shard(1, 0, 8, CPU))
        refusing = GpuLoader(dl, sampler, CPU, False, None, dataset, RefusingDecoder(CPU))
        pil = make_pil_loader(cfg, samples, is_train, Shard(1, 0, 8, CPU, False))
        exact = []
        for r, p in zip(batches(refusing), batches(pil), strict=True):
            assert torch.equal(r.labels, p.labels)
            diff = (unnormalise(r.images) - unnormalise(p.images)).abs()
            assert diff.mean(dim=(1, 2, 3)).max() < (1e-3 if not is_train else 2.5)  # a region: another resize filter
            exact += (diff.amax(dim=(1, 2, 3)) < 1e-3).tolist()
        assert all(exact) if not is_train else 0 < sum(exact) < len(exact)  # training: fallbacks and regions


def test_a_batch_crosses_from_a_worker_as_one_tensor(nat_folder):
    """Each tensor a worker returns costs the receiving thread a handshake with the worker (about
    1 ms; 12 of them per batch held it 13-19 ms a batch): the device samples' bytes and the PIL
    crops travel as one tensor, and the receiving side gets them back apart."""
    from kd.data.layout import scan

    _, train, val = scan(str(nat_folder))
    dataset = JpegBytes(train, 64, True, cpu_share=0.5)
    samples = [dataset[(i % len(train), sample_seed(1, 0, i))] for i in range(12)]
    samples[5:5] = [JpegBytes(val, 64, False, cpu_share=1.0)[(i, i)] for i in range(2)]  # finished crops too
    encoded = [s for s in samples if s.kind == ENCODED]
    regions = [s for s in samples if s.kind == REGION]
    crops = [s for s in samples if s.kind == PIL_CROP]
    assert encoded and regions and crops
    packed = collate_packed(samples)
    assert [k for k, v in packed.items() if isinstance(v, torch.Tensor)] == ["data"]
    host = unpacked(packed)
    assert host["regions"] == len(regions)
    blobs = torch.split(host["data"], host["lengths"].tolist())  # the bitstreams, then the regions
    assert [bytes(b.numpy()) for b in blobs] == [bytes(s.data) for s in encoded] + [s.data.tobytes() for s in regions]
    assert [tuple(t.shape) for t in gpu_mod.regions(host, CPU)] == [(3, *s.data.shape[:2]) for s in regions]
    assert all(
        torch.equal(t, torch.from_numpy(np.array(s.data)).permute(2, 0, 1))
        for t, s in zip(gpu_mod.regions(host, CPU), regions)
    )
    # the crops travel as PIL keeps them (HWC) and are handed on as (N, 3, H, W) views
    assert torch.equal(host["pil_images"], torch.from_numpy(np.stack([s.data for s in crops])).permute(0, 3, 1, 2))
    assert host["positions"].tolist() + host["pil_positions"].tolist() != list(range(14))  # interleaved
    assert sorted(host["positions"].tolist() + host["pil_positions"].tolist()) == list(range(14))
    assert host["boxes"].shape == (len(encoded) + len(regions), 4) and host["labels"].dtype == torch.long
    only_device = unpacked(collate_packed(encoded))
    assert only_device["pil_images"].shape[0] == 0 and only_device["data"].numel() == sum(s.data.size for s in encoded)
    assert only_device["regions"] == 0 and gpu_mod.regions(only_device, CPU) == []


def _packed_in_shared_memory(samples):
    packed = collate_packed(samples)
    return packed, packed["data"].is_shared()


def test_a_worker_packs_its_batch_straight_into_shared_memory(nat_folder):
    """A tensor a worker sends that is not in shared memory is copied there first: the packed batch
    (megabytes of bitstreams and crops) is written there by the collate itself."""
    from kd.data.layout import scan

    _, train, _ = scan(str(nat_folder))
    dataset = JpegBytes(train, 64, True, cpu_share=0.5)
    items = [(i % len(train), sample_seed(2, 0, i)) for i in range(16)]
    for packed, shared in torch.utils.data.DataLoader(
        [dataset[item] for item in items], batch_size=8, num_workers=1, collate_fn=_packed_in_shared_memory
    ):
        assert shared
        host = unpacked(packed)
        assert host["regions"] > 0 and host["data"].numel() > 0
    packed = collate_packed([dataset[item] for item in items])  # outside a worker: a private tensor
    assert not packed["data"].is_shared()


def test_auto_cpu_share_follows_the_workers():
    cuda = torch.device("cuda", 0)  # only named: no CUDA call
    shares = [auto_cpu_share(Nvjpeg(cuda), workers) for workers in (0, 2, 8, 15, 64)]
    assert shares[0] == 0.0 and all(0.0 < a < b < 1.0 for a, b in zip(shares[1:], shares[2:]))
    assert auto_cpu_share(Nvjpeg(cuda), 15, train=False) < shares[3]  # validation's workers finish crops: slower
    assert auto_cpu_share(CpuWorkers(cuda), 15) == 0.0  # the workers decode everything anyway
    assert auto_cpu_share(CpuThread(CPU), 15) == 0.0  # no device to share with


# ----------------------------------------------------------------------------- bad and odd files
def odd_folder(root: Path):
    rng = np.random.default_rng(3)
    folder = root / "val" / "c0"
    folder.mkdir(parents=True)
    (root / "train" / "c0").mkdir(parents=True)
    good = jpeg_bytes(natural_image(rng, 90, 70))
    for i in range(3):
        (folder / f"good{i}.jpg").write_bytes(jpeg_bytes(natural_image(rng, 90 + i, 70)))
    (root / "train" / "c0" / "a.jpg").write_bytes(good)
    Image.fromarray(natural_image(rng, 80, 60)).save(folder / "png_named.jpg", format="PNG")
    Image.fromarray(natural_image(rng, 80, 60)).convert("CMYK").save(folder / "cmyk.jpg", format="JPEG")
    (folder / "progressive.jpg").write_bytes(jpeg_bytes(natural_image(rng, 77, 55), progressive=True))
    (folder / "garbage.jpg").write_bytes(b"this is not an image" * 20)
    (folder / "truncated.jpg").write_bytes(good[: len(good) // 2])
    sos = good.find(b"\xff\xda")
    (folder / "broken_scan.jpg").write_bytes(good[:sos] + b"\xff\xda\x00\x02" + good[sos + 20 :])  # header fine
    return root, {str(folder / n) for n in ("garbage.jpg", "truncated.jpg", "broken_scan.jpg")}


@pytest.mark.parametrize("decoder", ["cpu", "cpu-thread"])
def test_bad_images_are_counted_and_named(tmp_path, monkeypatch, decoder):
    monkeypatch.setenv(gpu_mod.DECODER_ENV, decoder)
    root, bad = odd_folder(tmp_path)
    from kd.data.layout import scan

    _, _, val = scan(str(root))
    cfg = cfg_for(root)
    gpu = make_gpu_loader(cfg, val, False, Shard(1, 0, 4, CPU, False))
    pil = make_pil_loader(cfg, val, False, Shard(1, 0, 4, CPU, False))
    got, ref = batches(gpu), batches(pil)
    assert {p for b in got for p in b.bad} == bad == {p for b in ref for p in b.bad}
    g = unnormalise(torch.cat([b.images for b in got if len(b)]))
    r = unnormalise(torch.cat([b.images for b in ref if len(b)]))
    assert len(g) == len(r) == len(val) - len(bad)
    # PNG, CMYK and progressive files arrive too, each as close to its PIL crop as a JPEG is
    dist = (g[:, None] - r[None]).abs().mean(dim=(2, 3, 4))
    assert dist.min(dim=0).values.max() < 2.0


class FlakyDecoder(CpuThread):
    """Fails every second image, as a device decoder failing on a file PIL still reads."""

    name = "flaky"

    def decode(self, blobs):
        return [None if i % 2 else img for i, img in enumerate(super().decode(blobs))]


def test_decoder_failures_go_through_pil(nat_folder):
    from kd.data.layout import scan

    _, _, val = scan(str(nat_folder))
    cfg = cfg_for(nat_folder)
    dataset = JpegBytes(val, 64, False)
    dl, sampler = dataloader_and_sampler(cfg, dataset, collate_packed, False, Shard(1, 0, 8, CPU))
    flaky = GpuLoader(dl, sampler, CPU, False, None, dataset, FlakyDecoder(CPU))
    pil = make_pil_loader(cfg, val, False, Shard(1, 0, 8, CPU, False))
    for g, p in zip(batches(flaky), batches(pil), strict=True):
        assert sorted(g.labels.tolist()) == sorted(p.labels.tolist()) and not g.bad
        dist = (unnormalise(g.images)[:, None] - unnormalise(p.images)[None]).abs().mean(dim=(2, 3, 4))
        assert dist.min(dim=0).values.max() < 2.0


def test_batches_name_their_samples_in_order(nat_folder, tmp_path, monkeypatch):
    """Each batch carries its samples' dataset indices in its own order, on both loaders, with a
    share decoded by the workers, the decoder's failures finished by PIL, and unreadable files
    left out: what a store of the teacher's outputs per sample is looked up by."""
    from kd.data.layout import scan

    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    _, train, _ = scan(str(nat_folder))
    cfg = cfg_for(nat_folder, cpu_decode_share=0.5, seed=3)
    dataset = JpegBytes(train, 64, True, cpu_share=0.5)
    dl, sampler = dataloader_and_sampler(cfg, dataset, collate_packed, True, Shard(1, 0, 8, CPU))
    loaders = {
        "gpu": GpuLoader(dl, sampler, CPU, False, None, dataset, FlakyDecoder(CPU)),
        "pil": make_pil_loader(cfg, train, True, Shard(1, 0, 8, CPU, False)),
    }
    for epoch in (0, 1):
        sampler.set_epoch(epoch)
        order = [index for index, _ in sampler]
        assert order != sorted(order)  # shuffled: the test would see a wrong order
        got = {name: batches(loader, epoch) for name, loader in loaders.items()}
        for name, bs in got.items():
            assert torch.cat([b.indices for b in bs]).tolist() == order, name
            for b in bs:
                assert b.labels.tolist() == [train[i][1] for i in b.indices.tolist()], name
        for g, p in zip(got["gpu"], got["pil"], strict=True):
            assert (unnormalise(g.images) - unnormalise(p.images)).abs().mean() < 2.0

    root, bad = odd_folder(tmp_path)
    _, _, val = scan(str(root))
    for loader in (make_gpu_loader(cfg_for(root), val, False, Shard(1, 0, 4, CPU, False)),
                   make_pil_loader(cfg_for(root), val, False, Shard(1, 0, 4, CPU, False))):  # fmt: skip
        got = batches(loader)
        good = [i for i, (path, _) in enumerate(val) if path not in bad]
        assert torch.cat([b.indices for b in got]).tolist() == good


# ----------------------------------------------------------------------------- loader behaviour
def test_same_batches_as_pil_loader_and_mid_epoch_skip(image_folder):
    cfg = cfg_for(image_folder, workers=2, image_size=32)
    gpu = build(cfg, 1, 0, 8, CPU, False)
    pil = build(kd_config.resolve(options={**cfg.to_dict(), "loader": "pil"}), 1, 0, 8, CPU, False)
    full = batches(gpu.train, epoch=1)
    assert len(full) == len(gpu.train) == 3
    assert [b.labels.tolist() for b in full] == [b.labels.tolist() for b in batches(pil.train, epoch=1)]
    resumed = batches(gpu.train, epoch=1, skip=1)
    assert len(gpu.train) == 2 and len(resumed) == 2
    for a, b in zip(full[1:], resumed, strict=True):
        assert torch.equal(a.labels, b.labels) and torch.allclose(a.images, b.images)
    assert "loader gpu" in gpu.train.describe() and "decoder cpu" in gpu.train.describe()


def test_the_pil_loader_points_to_the_gpu_loader_on_a_gpu(image_folder):
    """The default loader on a GPU decodes every image on the CPU: its log line says what to use."""
    pil = build(cfg_for(image_folder, loader="pil", image_size=32), 1, 0, 8, CPU, False).train
    assert pil.describe().startswith("loader pil: ") and "--loader gpu" not in pil.describe()
    pil.device = torch.device("cuda", 0)  # only the line is asked for: nothing runs there
    assert pil.describe().endswith(f"normalised on cuda:0; {GPU_LOADER_HINT}")
    gpu = build(cfg_for(image_folder, image_size=32), 1, 0, 8, CPU, False).train
    gpu.device = torch.device("cuda", 0)
    assert GPU_LOADER_HINT not in gpu.describe()


def test_the_default_loader_is_auto_and_says_what_it_chose_and_why(image_folder):
    """--loader auto (the default) is the gpu loader where CUDA and a GPU JPEG decoder work, else
    pil, and its log line says which and why; on a GPU without a GPU decoder it names what failed."""
    assert kd_config.RunConfig().loader == "auto"
    data = build(cfg_for(image_folder, loader="auto", image_size=32), 1, 0, 8, CPU, False)
    assert data.train.describe().startswith("loader pil (--loader auto: no CUDA device): PIL decode")
    # validation under auto is the PIL path's (torchvision's crops bit for bit), under gpu the device's
    for loader, kind in (("auto", "DeviceLoader"), ("gpu", "GpuLoader")):
        val = build(cfg_for(image_folder, loader=loader, image_size=32), 1, 0, 8, CPU, False).val
        assert type(getattr(val, "loader", val)).__name__ == kind, loader  # (inside the val cache)
    if not torch.cuda.is_available():  # on a CPU machine a CUDA device has no GPU decoder: each one's reason
        name, why = choose_loader("auto", torch.device("cuda", 0))
        assert name == "pil" and why.startswith("--loader auto: no GPU JPEG decoder works here (nvjpeg "), why
        assert "nvimgcodec" in why
    assert choose_loader("gpu", CPU) == ("gpu", "") and choose_loader("pil", CPU) == ("pil", "")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_default_loader_on_a_gpu_is_the_gpu_loader(image_folder):
    name, why = choose_loader("auto", torch.device("cuda", 0))
    assert name == "gpu" and why.startswith("--loader auto: CUDA and the nv"), why


def test_limit_and_early_stop_leave_no_thread(image_folder):
    cfg = cfg_for(image_folder, image_size=32, limit_train_batches=2)
    data = build(cfg, 1, 0, 4, CPU, False)

    def decode_threads():
        return [t for t in threading.enumerate() if t.name == "kd-gpu-decode"]

    assert len(batches(data.train)) == 2
    assert not decode_threads()
    one_by_one = build(cfg, 1, 0, 1, CPU, False)  # 12 val batches: more than the decode thread runs ahead
    it = iter(one_by_one.val)
    next(it)
    assert len(decode_threads()) == 1
    it.close()  # the consumer stops early
    assert not decode_threads()


class BrokenDecoder(CpuThread):
    name = "broken"

    def decode(self, blobs):
        raise RuntimeError("decoder exploded")


def test_stage_times_account_for_every_batch(nat_folder, monkeypatch):
    """GpuLoader.stage_times (what profile_epoch.py prints): the decode thread's waits and decodes,
    and the main thread's prep, for every batch of the epoch."""
    from kd.data.layout import scan

    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    _, train_s, _ = scan(str(nat_folder))
    gpu = make_gpu_loader(cfg_for(nat_folder), train_s, True, Shard(1, 0, 4, CPU, False))
    for epoch in range(2):
        got = batches(gpu, epoch)
        times = gpu.stage_times
        assert times["batches"] == (epoch + 1) * len(got) == (epoch + 1) * len(gpu)
        assert times["decode"] > 0 and times["prep"] > 0 and min(times.values()) >= 0


#: Tensor calls that make the host wait for the device: a value read back, or an output whose
#: size depends on the values (nonzero, a boolean mask...).
DEVICE_READS = tuple(
    "item tolist __bool__ __float__ __int__ __index__ cpu numpy equal allclose nonzero masked_select unique argwhere".split()
)


class OnDevice(torch.Tensor):
    """A tensor the loader put on its device (on the CPU in CI), and every result computed from one:
    counts the calls that would wait for a GPU (DEVICE_READS, boolean-mask indexing)."""

    reads: List[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", str(func))
        index = args[1] if name == "__getitem__" and len(args) > 1 else ()
        parts = index if isinstance(index, (tuple, list)) else (index,)
        masks = [a for a in parts if isinstance(a, torch.Tensor) and a.dtype == torch.bool]
        if name in DEVICE_READS or masks:
            cls.reads.append(name)
        return super().__torch_function__(func, types, args, kwargs or {})


class _Launcher:
    """Stands in for the compiled crop kernel: ``kernel[grid](*args)`` only records the launch."""

    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


def test_the_loader_never_waits_for_the_device(nat_folder, monkeypatch):
    """The decode thread and the main thread's prep queue work and return: a read of a device value
    (or an op whose output size depends on one) would make the host wait for the GPU once per
    batch. Everything the loader puts on its device is marked, and so is all computed from it."""
    from kd.data import loader as loader_mod
    from kd.data.layout import scan

    monkeypatch.setattr(gpu_mod, "upload", lambda t, device: loader_mod.upload(t, device).as_subclass(OnDevice))
    decode = CpuThread.decode
    monkeypatch.setattr(
        CpuThread,
        "decode",
        lambda self, blobs: [None if img is None else img.as_subclass(OnDevice) for img in decode(self, blobs)],
    )
    monkeypatch.setattr(OnDevice, "reads", [])
    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu-thread")
    _, train, val = scan(str(nat_folder))
    launches: List[object] = []  # the one-kernel crop's Python side; its launch is left out (no GPU here)
    monkeypatch.setattr(crop_kernel, "_compiled", lambda: _Launcher(launches))
    fused_batches = 0
    for samples, is_train, fused in (
        (train, True, False),
        (val, False, False),
        (train, True, True),
        (val, False, True),
    ):
        gpu = make_gpu_loader(cfg_for(nat_folder, cpu_decode_share=0.5), samples, is_train, Shard(1, 0, 4, CPU, False))
        if fused:
            gpu.kernel_missing = None
        OnDevice.reads.clear()  # the decoder's self-check read its probe once when it was made
        for epoch in (0, 1):
            got = batches(gpu, epoch)
            # the marks reached the output (the kernel writes into memory it did not compute from)
            assert got and all(isinstance(b.labels, OnDevice) and isinstance(b.images, OnDevice) != fused for b in got)
            assert OnDevice.reads == [], f"the loader waits for the device: {OnDevice.reads}"
            fused_batches += len(got) if fused else 0
    assert len(launches) == fused_batches > 0
    bool(got[0].labels.any())  # the counter itself sees a read
    assert OnDevice.reads == ["__bool__"]


def test_decode_thread_errors_reach_the_consumer(image_folder):
    from kd.data.layout import scan

    _, train, _ = scan(str(image_folder))
    cfg = cfg_for(image_folder)
    dataset = JpegBytes(train, 32, True)
    dl, sampler = dataloader_and_sampler(cfg, dataset, collate_packed, True, Shard(1, 0, 8, CPU))
    with pytest.raises(RuntimeError, match="decoder exploded"):
        list(GpuLoader(dl, sampler, CPU, False, None, dataset, BrokenDecoder(CPU)))


def test_decoder_choice(monkeypatch):
    decoder, notes = make_decoder(CPU)
    assert decoder.name == "cpu" and decoder.in_workers
    assert any("nvjpeg" in n for n in notes) and any("nvimgcodec" in n for n in notes)
    assert set(DECODERS) == {"nvimgcodec", "nvjpeg", "cpu", "cpu-thread"}
    if not torch.cuda.is_available():
        with pytest.raises(KDError, match="nvjpeg cannot run"):
            make_decoder(CPU, "nvjpeg")
    with pytest.raises(KDError, match="choose from"):
        make_decoder(CPU, "dali")
    thread, _ = make_decoder(CPU, "cpu-thread")
    assert thread.frame_types == (0xC0, 0xC1, 0xC2)  # it passed the progressive self-check too


def test_unknown_loader_lists_the_choices(image_folder):
    with pytest.raises(KDError, match="choose from: auto, gpu, pil"):
        build(cfg_for(image_folder, loader="dali"), 1, 0, 8, CPU, False)


def test_val_box_is_the_pil_resize_and_centre_crop():
    # 500x375 -> short side 256 -> 341x256, centre 224 crop at (58, 16) in resized pixels
    x1, y1, x2, y2 = val_box(375, 500, 224, 256)
    assert (x1, y1) == pytest.approx((58 * 500 / 341, 16 * 375 / 256))
    assert (x2 - x1, y2 - y1) == pytest.approx((224 * 500 / 341, 224 * 375 / 256))


def test_cli_train_with_gpu_loader(image_folder, tmp_path):
    r = kd_main(*train_args(image_folder, tmp_path / "run", workers=2, loader="gpu"))
    assert r.returncode == 0, r.stderr
    assert "loader gpu" in r.stderr and "decoder cpu" in r.stderr, r.stderr
    assert (tmp_path / "run" / "metrics.jsonl").is_file()


# ----------------------------------------------------------------------------- on a GPU
@pytest.mark.parametrize("name", ["nvjpeg", "nvimgcodec"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_device_decoders_match_pil(name):
    device = torch.device("cuda", 0)
    if DECODERS[name].unavailable(device):
        pytest.skip(DECODERS[name].unavailable(device))
    decoder, _ = make_decoder(device, name)
    rng = np.random.default_rng(4)
    jpegs = [jpeg_bytes(natural_image(rng, w, h)) for w, h in ((500, 375), (375, 500), (333, 500), (97, 181))]
    jpegs.append(jpeg_bytes(natural_image(rng, 120, 90)[..., 0]))
    # chroma layouts other than PIL's default 4:2:0, and a large photo
    jpegs += [jpeg_bytes(natural_image(rng, 211, 143), subsampling=k) for k in (0, 1)]
    jpegs.append(jpeg_bytes(natural_image(rng, 1600, 1200), quality=75))
    out = decoder.decode([torch.frombuffer(bytearray(j), dtype=torch.uint8) for j in jpegs])
    torch.cuda.synchronize()
    for img, j in zip(out, jpegs, strict=True):
        assert img.device.type == "cuda" and img.dtype == torch.uint8
        ref = pil_rgb(j)
        got = img.permute(1, 2, 0).cpu().numpy()
        assert got.shape == ref.shape
        # decoders differ by a level or two; nvJPEG's chroma upsampling gave 3.005 on a 97x181 image on an H200
        assert np.abs(got.astype(np.float32) - ref).mean() < 4.0
    assert decoder.describe()
    # progressive files go to PIL in the workers: they would take the batch off the hardware engine
    assert decoder.frame_types == BASELINE_ONLY
    assert jpeg_size(jpeg_bytes(natural_image(rng, 64, 48), progressive=True), decoder.frame_types) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("train", [False, True])
def test_cuda_loader_matches_the_cpu_path(nat_folder, monkeypatch, train):
    from kd.data.layout import scan

    _, train_s, val_s = scan(str(nat_folder))
    samples = train_s if train else val_s
    cfg = cfg_for(nat_folder, device="cuda", cpu_decode_share=0.3)  # the workers' regions (train) too
    device = torch.device("cuda", 0)
    gpu = make_gpu_loader(cfg, samples, train, Shard(1, 0, 8, device, True))
    assert gpu.decoder.name in ("nvimgcodec", "nvjpeg"), gpu.describe()
    monkeypatch.setenv(gpu_mod.DECODER_ENV, "cpu")
    cpu = make_gpu_loader(cfg, samples, train, Shard(1, 0, 8, CPU, False))
    quiet = batches(gpu)
    for g, c in zip(quiet, batches(cpu), strict=True):
        assert g.images.is_cuda and g.images.is_contiguous(memory_format=torch.channels_last)
        assert torch.equal(g.labels.cpu(), c.labels)
        assert (unnormalise(g.images) - unnormalise(c.images)).abs().mean() < 3.0
    # a busy consumer stream must not change what it reads (events, record_stream)
    gpu.set_epoch(0)
    big = torch.randn(4096, 4096, device=device)
    for g, q in zip(gpu, quiet, strict=True):
        for _ in range(20):
            big = (big @ big).tanh_()
        assert torch.equal(g.images, q.images) and torch.equal(g.labels, q.labels)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cli_train_with_gpu_loader_on_cuda(image_folder, tmp_path):
    r = run_kd(*train_args(image_folder, tmp_path / "run", workers=2, device="cuda", loader="gpu"))
    assert r.returncode == 0, r.stderr
    assert "loader gpu" in r.stderr and "side CUDA streams" in r.stderr, r.stderr
