"""``kd eval``: top-1/top-5 of one model with local weights on ``DATA/val``.

A kd checkpoint names its model and holds its run's config: the model, the number of classes,
the image size and the val resize come from there unless given, so a checkpoint evaluates as
its run validated it. Other weights (plain state dicts, ``pretrained``) need the model's name.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, Optional

from kd import models
from kd.config import RunConfig
from kd.data.data_config import DataConfig
from kd.data.layout import scan_split
from kd.data.loader import Shard, default_workers, make_pil_loader
from kd.data.model_data import data_config
from kd.errors import KDError
from kd.precision import make_precision
from kd.run.runtime import resolve as resolve_runtime
from kd.siblings import own
from kd.utils import weight_files
from kd.utils.accuracy import evaluate

DEFAULT_IMAGE_SIZE = 224


@dataclass
class EvalSettings:
    """What an evaluation uses, and where each setting came from (option, checkpoint, default)."""

    model: str
    num_classes: Optional[int]  # None: the number of class folders in val/
    image_size: int
    val_resize: int
    workers: int
    sources: Dict[str, str]
    data: DataConfig = dataclasses.field(default_factory=DataConfig)  # mean, std, interpolation

    def describe(self, num_classes: int) -> str:
        return ", ".join(
            [
                f"model {self.model} ({self.sources['model']})",
                f"{num_classes} classes ({self.sources['classes']})",
                f"image size {self.image_size} ({self.sources['image size']})",
                f"val resize {self.val_resize} ({self.sources['val resize']})",
                f"{self.data.interpolation}, mean ({', '.join(f'{m:g}' for m in self.data.mean)}) "
                f"std ({', '.join(f'{v:g}' for v in self.data.std)}) ({self.data.source})",
                f"workers {self.workers} ({self.sources['workers']})",
            ]
        )


def resolve(
    model: Optional[str],
    weights: str,
    image_size: Optional[int] = None,
    val_resize: Optional[int] = None,
    num_classes: Optional[int] = None,
    workers: Optional[int] = None,
) -> EvalSettings:
    """The settings of an evaluation: what is given, else the checkpoint's run, else the defaults."""
    run = weight_files.run_settings(weights)
    cfg = run.get("config", {})
    sources: Dict[str, str] = {}

    def pick(key, given, from_run, default, default_source="default"):
        if given is not None:
            sources[key] = "option"
            return given
        if from_run is not None:
            sources[key] = "checkpoint"
            return from_run
        sources[key] = default_source
        return default

    model = pick("model", model, run.get("model"), None)
    if model is None:
        if not models.is_named(weights) and weights != "none":
            weight_files.load_state_file(weights)  # a file kd cannot read: what is wrong with it, not a missing option
        what = "with --weights pretrained" if weights == "pretrained" else f"for {weights}: not a kd checkpoint"
        raise KDError(f"--model NAME is required {what} (a kd checkpoint names its model)")
    num_classes = pick("classes", num_classes, run.get("num_classes"), None, "class folders of val/")
    own = DataConfig.from_dict(cfg["student_data"]) if cfg.get("student_data") else None
    if own is None:
        own = data_config(model, weights)
    # weights of a published size evaluate at it (torchvision's transforms(), timm's test size and crop)
    published, published_resize = own.evaluation(DEFAULT_IMAGE_SIZE)
    size_source = f"the weights': {own.source}" if own.eval_size else "default"
    image_size = pick("image size", image_size, cfg.get("image_size"), published, size_source)
    same_size = bool(run) and image_size == cfg.get("image_size")  # the run's resize belongs to the run's size
    model_resize = published_resize if image_size == published else own.val_resize(image_size)
    val_resize = pick(
        "val resize",
        val_resize,
        (cfg.get("val_resize") or own.val_resize(image_size)) if same_size else None,
        model_resize,
        f"the model's: {own.source}",
    )
    workers = pick("workers", workers, None, default_workers(1), "default: CPU cores less one")
    sources["data"] = own.source
    return EvalSettings(model, num_classes, image_size, val_resize, workers, sources, own)


def result_line(model: str, weights: str, result: Dict[str, Any]) -> str:
    """kd eval's result: top-1, top-5, loss, and the images they are over (unreadable ones counted as errors)."""
    bad = result["unreadable"]
    over = f"{result['images']} images, {bad} unreadable, counted as errors" if bad else f"{result['images']} images"
    return (
        f"{model} {weights}: top-1 {result['top1']:.2f}  top-5 {result['top5']:.2f}  loss {result['loss']:.4f}  "
        f"({over})"
    )


def evaluate_model(
    model: Optional[str],
    weights: str,
    data: str,
    batch_size: int = 256,
    device: str = "auto",
    image_size: Optional[int] = None,
    workers: Optional[int] = None,
    num_classes: Optional[int] = None,
    opt: str = "O0",
    amp_dtype=None,
    val_resize: Optional[int] = None,
) -> Dict[str, Any]:
    """Evaluate ``model`` with ``weights`` (a file, or pretrained) on the ``val/`` split of ``data``.

    None means: from the kd checkpoint ``weights`` where it is one (see :func:`resolve`), else the
    default. The result holds the metrics, the settings used and ``settings``, a line saying so.
    """
    from kd.teacher.precision import TeacherPrecision

    backends = own("backends")

    s = resolve(model, weights, image_size, val_resize, num_classes, workers)
    classes, samples = scan_split(Path(data), "val")
    n = s.num_classes or len(classes)
    if n != len(classes):
        raise KDError(
            f"{s.model} from {weights} has {n} classes ({s.sources['classes']}) but {data}/val has "
            f"{len(classes)} class folders; evaluate it on data with its own classes"
        )
    weight_files.check_classes(weight_files.run_classes(weights), classes, weights, f"{data}/val")
    cfg = RunConfig(
        data=data,
        student=s.model,
        teacher=s.model,
        batch_size=batch_size,
        device=device,
        image_size=s.image_size,
        val_resize=s.val_resize,
        student_data=s.data.to_dict(),
        workers=s.workers,
        num_classes=n,
        opt=opt,
        amp_dtype=amp_dtype,
    )
    backend = backends.get("single")(cfg)
    backend.setup()
    net = models.freeze(models.build(s.model, n, weights, s.image_size))
    runtime = resolve_runtime(cfg, backend.device)
    channels_last = runtime.channels_last
    # the ignore: torch's stub has no overload of Module.to with both, which Module.to takes
    net = net.to(backend.device, memory_format=runtime.memory_format)  # type: ignore[call-overload]
    # frozen, as kd runs a teacher
    precision = TeacherPrecision(backend.device, make_precision(cfg, backend.device).dtype)
    net = precision.convert(net)
    shard = Shard(1, 0, batch_size, backend.device, channels_last)
    loader = make_pil_loader(dataclasses.replace(cfg), samples, False, shard)
    try:
        result = evaluate(net, loader, backend, precision)
    finally:
        loader.close()
    return {
        "model": s.model,
        "weights": weights,
        **result,
        "line": result_line(s.model, weights, result),
        "num_classes": n,
        "image_size": s.image_size,
        "val_resize": s.val_resize,
        "workers": s.workers,
        "settings": s.describe(n),
    }
