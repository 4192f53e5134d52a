"""Images/s of ``--loader pil`` and ``--loader gpu`` alone, per stage, and feeding a KD step.

    python benchmarks/loader_stages.py --data /tmp/jpegs --images 5000            # loaders alone
    python benchmarks/loader_stages.py --data /tmp/jpegs --images 5000 --e2e      # + r101 -> r18 bf16 step

``--data DIR`` is used as it is when it holds ``train/`` and ``val/``; otherwise ``--images``
synthetic 500x375 JPEGs (quality 90, about 42 KB, like ImageNet's) are written there first.
Rows: the loader alone over one training epoch (RandomResizedCrop 224 + flip, batches of
``--batch-size``), timed on the second epoch so worker start-up is excluded; for the gpu loader
also decode alone, crop alone (the loader's one Triton kernel per batch where it runs, and
one roi_align per image size, its other path) and, for comparison, a per-image
F.interpolate(antialias=True) loop. ``--e2e``: a KD step
(resnet101 teacher -> resnet18 student, random init, bf16 autocast, channels_last, SGD) on
synthetic input, then fed by each loader. Prints a markdown table. Self-contained apart from kd.
"""

from __future__ import annotations

import argparse
import io
import math
import os
import sys
import time
from multiprocessing import Pool
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kd import config as kd_config  # noqa: E402
from kd.data import crop_kernel as kd_crop_kernel  # noqa: E402
from kd.data import gpu as gpu_loader  # noqa: E402
from kd.data.bytes_dataset import unpacked  # noqa: E402
from kd.data.decoders import DECODERS, device_lengths  # noqa: E402
from kd.data.layout import scan  # noqa: E402
from kd.data.loader import Shard, make_pil_loader  # noqa: E402


# ----------------------------------------------------------------------------- data
def synthetic_jpeg(seed: int, width: int = 500, height: int = 375, quality: int = 90) -> bytes:
    """Smooth colour regions, edges, stripes and mild noise: ~42 KB at 500x375, q90."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    coarse = Image.fromarray((rng.random((height // 40 + 2, width // 40 + 2, 3)) * 255).astype(np.uint8))
    img = np.asarray(coarse.resize((width, height), Image.BICUBIC), dtype=np.float32)
    y, x = np.mgrid[0:height, 0:width]
    f = rng.uniform(3, 12, 2)
    img = img + 18 * np.sin(x / f[0] + y / f[1] + rng.uniform(0, 6))[..., None]
    for _ in range(6):
        x0, y0 = rng.integers(0, width - 20), rng.integers(0, height - 20)
        img[y0 : y0 + rng.integers(10, height // 2), x0 : x0 + rng.integers(10, width // 2)] = rng.random(3) * 255
    img += rng.normal(0, 4.2, img.shape)
    buf = io.BytesIO()
    Image.fromarray(np.clip(img, 0, 255).astype(np.uint8)).save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def _write(job):
    path, seed = job
    path.write_bytes(synthetic_jpeg(seed))


def ensure_folder(root: Path, images: int, classes: int) -> None:
    if (root / "train").is_dir() and (root / "val").is_dir():
        return
    jobs = []
    for split, count, offset in (("train", images, 0), ("val", max(classes, images // 10), 10**7)):
        for i in range(count):
            folder = root / split / f"c{i % classes:04d}"
            folder.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / f"{i:07d}.jpg", offset + i))
    start = time.perf_counter()
    with Pool(os.cpu_count()) as pool:
        pool.map(_write, jobs, chunksize=64)
    size = sum(p.stat().st_size for p, _ in jobs[:200]) / min(200, len(jobs)) / 1024
    print(f"wrote {len(jobs)} JPEGs ({size:.0f} KB each on average) to {root} in {time.perf_counter() - start:.1f}s")


# ----------------------------------------------------------------------------- timing
def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_epoch(loader, device, epoch: int, consume=None) -> float:
    """Images/s of one epoch of ``loader`` (each batch handed to ``consume`` if given)."""
    loader.set_epoch(epoch)
    sync(device)
    start, n = time.perf_counter(), 0
    for batch in loader:
        if consume is not None:
            consume(batch)
        n += len(batch)
    sync(device)
    return n / (time.perf_counter() - start)


def loader_alone(loader, device) -> float:
    time_epoch(loader, device, 0)  # starts the workers, warms the decoder and the allocator
    return time_epoch(loader, device, 1)


def stages(loader, device, max_batches: int):
    """Decode alone, crop alone (the one-kernel crop, roi_align groups) and crop per image
    (interpolate), images/s; the kernel's rate is nan where it does not run."""
    loader.set_epoch(2)
    hosts = []
    for host in loader.loader:
        hosts.append(unpacked(host))
        if len(hosts) == max_batches:
            break
    n = sum(len(device_lengths(h)[0]) for h in hosts)  # bitstreams (the regions were decoded by the workers)
    decoder = loader.decoder
    if decoder.in_workers:
        decoded = [decoder.images(h) for h in hosts]
        decode_rate = float("nan")
    else:
        with torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else _null():
            decoder.images(hosts[0])
            sync(device)
            start = time.perf_counter()
            decoded = [decoder.images(h) for h in hosts]
            sync(device)
            decode_rate = n / (time.perf_counter() - start)
    decoded = [images + gpu_loader.regions(h, device) for images, h in zip(decoded, hosts)]

    def crop_groups(images, host):
        crops = gpu_loader.crop_resize(images, host["boxes"], loader.size)
        flips = host["flips"].to(device, non_blocking=True).view(-1, 1, 1, 1)
        return torch.addcmul(loader.bias, torch.where(flips, crops.flip(3), crops), loader.scale)

    def crop_kernel(images, host):
        out = torch.empty(len(images), 3, loader.size, loader.size, device=device)
        places = torch.arange(len(images))
        return kd_crop_kernel.crop_batch(images, host["boxes"], host["flips"], places, out, loader.scale, loader.bias)

    def crop_each(images, host):
        out = torch.empty(len(images), 3, loader.size, loader.size, device=device)
        for i, (img, (x1, y1, x2, y2)) in enumerate(zip(images, host["boxes"].tolist())):
            part = img[:, int(y1) : math.ceil(y2), int(x1) : math.ceil(x2)].unsqueeze(0).float()
            out[i] = F.interpolate(part, size=(loader.size, loader.size), mode="bilinear", antialias=True)[0]
        return torch.addcmul(loader.bias, out, loader.scale)

    rates = []
    for fn in (crop_kernel, crop_groups, crop_each):
        if fn is crop_kernel and loader.kernel_missing is not None:
            rates.append(float("nan"))
            continue
        fn(decoded[0], hosts[0])
        sync(device)
        start = time.perf_counter()
        for images, host in zip(decoded, hosts):
            fn(images, host)
        sync(device)
        rates.append(n / (time.perf_counter() - start))
    return decode_rate, *rates


class _null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ----------------------------------------------------------------------------- KD step
def kd_step_factory(device, num_classes: int):
    import torchvision

    torch.backends.cudnn.benchmark = True
    teacher = torchvision.models.resnet101(num_classes=num_classes).to(device, memory_format=torch.channels_last).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    student = torchvision.models.resnet18(num_classes=num_classes).to(device, memory_format=torch.channels_last).train()
    opt = torch.optim.SGD(student.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4)
    amp = torch.autocast(device.type, dtype=torch.bfloat16)

    def step(batch):
        images = batch.images.contiguous(memory_format=torch.channels_last)
        with amp:
            with torch.no_grad():
                t_logits = teacher(images)
            s_logits = student(images)
        t, s = t_logits.float() / 4.0, s_logits.float() / 4.0
        kd = F.kl_div(F.log_softmax(s, 1), F.log_softmax(t, 1), reduction="batchmean", log_target=True) * 16.0
        loss = 0.5 * F.cross_entropy(s_logits.float(), batch.labels) + 0.5 * kd
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def synthetic_rate(step, device, batch_size: int, num_classes: int, steps: int) -> float:
    from kd.data.loader import Batch

    batch = Batch(
        torch.randn(batch_size, 3, 224, 224, device=device).contiguous(memory_format=torch.channels_last),
        torch.randint(0, num_classes, (batch_size,), device=device),
    )
    for _ in range(5):
        step(batch)
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step(batch)
    sync(device)
    return steps * batch_size / (time.perf_counter() - start)


# ----------------------------------------------------------------------------- main
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, type=Path)
    ap.add_argument("--images", type=int, default=5000, help="train JPEGs to write when --data is empty")
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--pil-workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    ap.add_argument("--gpu-workers", type=int, default=8)
    ap.add_argument(
        "--decoders",
        default="auto,nvjpeg,nvimgcodec",
        help=f"gpu-loader decoders to measure, from auto,{','.join(DECODERS)}",
    )
    ap.add_argument("--no-pil", action="store_true", help="skip the PIL loader")
    ap.add_argument("--stage-batches", type=int, default=16, help="batches for the decode/crop-alone rows")
    ap.add_argument("--e2e", action="store_true", help="also a KD step r101 -> r18 fed by the loaders")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()

    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    ensure_folder(args.data, args.images, args.classes)
    classes, train, _ = scan(str(args.data))
    import torchvision

    gpu_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "no GPU"
    print(
        f"torch {torch.__version__}, torchvision {torchvision.__version__}, {gpu_name}, "
        f"{os.cpu_count()} CPU cores, {len(train)} train images, batch {args.batch_size}\n"
    )

    def cfg(loader: str, workers: int):
        return kd_config.resolve(
            options=dict(
                data=str(args.data),
                teacher="resnet101",
                student="resnet18",
                loader=loader,
                workers=workers,
                batch_size=args.batch_size,
                device=device.type,
            )
        )

    rows = []  # (loader, decoder, measured, img/s)
    loaders = {}
    if not args.no_pil:
        pil = make_pil_loader(cfg("pil", args.pil_workers), train, True, Shard(1, 0, args.batch_size, device, True))
        print(pil.describe())
        rows.append(("pil", f"PIL, {args.pil_workers} workers", "loader alone", loader_alone(pil, device)))
        loaders["pil"] = pil
    for choice in [c.strip() for c in args.decoders.split(",") if c.strip()]:
        if choice != "auto" and DECODERS[choice].unavailable(device):
            print(f"skipped decoder {choice}: {DECODERS[choice].unavailable(device)}")
            continue
        os.environ[gpu_loader.DECODER_ENV] = choice
        try:
            loader = gpu_loader.make_gpu_loader(
                cfg("gpu", args.gpu_workers), train, True, Shard(1, 0, args.batch_size, device, True)
            )
        except Exception as exc:  # report and go on with the others
            print(f"skipped decoder {choice}: {exc}")
            continue
        if f"gpu {loader.decoder.name}" in loaders:  # auto already measured this one
            continue
        name = loader.decoder.name if choice != "auto" else f"auto -> {loader.decoder.name}"
        print(loader.describe())
        total = loader_alone(loader, device)
        decode, kernel, crop, crop_each = stages(loader, device, args.stage_batches)
        rows += [
            ("gpu", name, "decode alone", decode),
            ("gpu", name, "crop+flip+normalise alone (one Triton kernel)", kernel),
            ("gpu", name, "crop+flip+normalise alone (roi_align groups)", crop),
            ("gpu", name, "crop per image, F.interpolate antialias (comparison)", crop_each),
            ("gpu", name, "loader alone (total)", total),
        ]
        loaders[f"gpu {loader.decoder.name}"] = loader

    if args.e2e:
        step = kd_step_factory(device, len(classes))
        steps = max(10, len(train) // args.batch_size)
        rows.append(
            (
                "synthetic",
                "-",
                "KD step r101->r18 bf16 channels_last",
                synthetic_rate(step, device, args.batch_size, len(classes), steps),
            )
        )
        for key, loader in loaders.items():
            time_epoch(loader, device, 3, step)  # warm
            rows.append(
                (key.split(" ")[0], key, "KD step fed by the loader (end to end)", time_epoch(loader, device, 4, step))
            )

    print("\n| loader | decoder | measured | images/s |\n|---|---|---|---|")
    for loader, decoder, what, rate in rows:
        print(f"| {loader} | {decoder} | {what} | {'-' if math.isnan(rate) else f'{rate:,.0f}'} |")


if __name__ == "__main__":
    main()
