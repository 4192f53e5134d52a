"""The training loop and evaluation. It asks the backend and the precision object; it never
branches on which backend or opt level is in use."""
from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Dict, List, Optional

import torch
from torch import nn

import kd
from kd import checkpoint, models
from kd import config as kd_config
from kd import data as kd_data
from kd.errors import KDError
from kd.features import check_layers, layer_names, tap
from kd.logging import NullLogger, RunLogger
from kd.losses import DistillInputs, build_loss
from kd.optim import build_optimizer, build_scheduler


class StudentSide(nn.Module):
    """The trainable side: the student and the loss with its connectors.

    The backend wraps this one module, so connector gradients are synchronised with the
    student's; the forward returns the loss parts, so DataParallel replicas compute them too.
    """

    def __init__(self, student: nn.Module, loss: nn.Module, layers: List[str]):
        super().__init__()
        self.student = student
        self.loss = loss
        self.layers = layers

    def forward(self, images, labels, teacher_logits=None, teacher_feats=None, progress: float = 0.0):
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.student, self.layers, feats):
            logits = self.student(images)
        return self.loss(DistillInputs(logits, labels, teacher_logits, feats, teacher_feats or {}, progress))


class TeacherSide(nn.Module):
    """The frozen teacher: logits cast to float32 for the KD softmax, plus tapped features."""

    def __init__(self, teacher: nn.Module, layers: List[str]):
        super().__init__()
        self.teacher = teacher
        self.layers = layers

    def forward(self, images):
        feats: Dict[str, torch.Tensor] = {}
        with tap(self.teacher, self.layers, feats):
            logits = self.teacher(images)
        return logits.float(), feats


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[correct@1, correct@5] for a batch, on the device."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hit = top.eq(labels.view(-1, 1))
    return torch.stack([hit[:, :1].any(dim=1).sum(), hit.any(dim=1).sum()]).float()


@torch.no_grad()
def evaluate(forward, loader, backend, precision) -> Dict[str, float]:
    """top-1/top-5 (percent) and loss of ``forward(images) -> logits`` over the whole val split.

    Exact across processes: the val sampler shards without padding and the counts are summed.
    The caller puts the model in eval mode.
    """
    sums = torch.zeros(4, device=backend.device)  # correct1, correct5, n, loss*n
    for batch in loader:
        if len(batch) == 0:
            continue
        with precision.autocast():
            logits = forward(precision.input_cast(batch.images))
        logits = logits.float()
        sums[:2] += accuracy_counts(logits, batch.labels)
        sums[2] += len(batch)
        sums[3] += torch.nn.functional.cross_entropy(logits, batch.labels, reduction="sum")
    backend.all_reduce_sum(sums)
    c1, c5, n, loss = sums.tolist()
    n = max(n, 1.0)
    return {"top1": 100.0 * c1 / n, "top5": 100.0 * c5 / n, "loss": loss / n, "count": int(sums[2].item())}


class Trainer:
    """One process's part of a run: built from a config, a set-up backend and the run folder."""

    def __init__(self, cfg, backend, out: Path, resume_from: Optional[Path] = None):
        self.cfg = cfg
        self.backend = backend
        self.out = Path(out)
        self.device = backend.device
        dev = self.device
        channels_last = cfg.channels_last if cfg.channels_last is not None else dev.type == "cuda"
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.logger = RunLogger(self.out, cfg.progress_bar) if backend.is_main else NullLogger()

        torch.manual_seed(cfg.seed)  # the same initial student on every process
        num_replicas, rank = backend.data_shard()
        self.data = kd_data.build(cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), dev, channels_last)
        num_classes = cfg.num_classes or len(self.data.classes)
        if cfg.num_classes and cfg.data != "synthetic" and cfg.num_classes != len(self.data.classes):
            raise KDError(f"--num-classes {cfg.num_classes} but {cfg.data} has {len(self.data.classes)} class folders")
        self.num_classes = num_classes

        self.precision = backend.precision()
        self.logger.info(self.precision.describe())
        loss = build_loss("ce" if cfg.no_teacher else cfg.kd_loss, num_classes, cfg.loss_kwargs())
        student = models.build(cfg.student, num_classes, cfg.student_weights)
        teacher = None
        if loss.needs_teacher:
            teacher = models.freeze(models.build(cfg.teacher, num_classes, cfg.teacher_weights))
        layers = self._feature_layers(loss, student, teacher)

        self.side = StudentSide(student, loss, layers).to(dev, memory_format=self.memory_format)
        self.teacher = None
        if teacher is not None:
            teacher = self.precision.prepare_teacher(teacher.to(dev, memory_format=self.memory_format))
            self.teacher = backend.wrap_forward(TeacherSide(teacher, layers))
        optimizer = build_optimizer(cfg, self.side.named_parameters())
        self.side, self.optimizer = self.precision.prepare(self.side, optimizer)
        self.model = backend.wrap(self.side)
        self.logger.info(backend.describe())  # after wrap: what the backend decided there (e.g. torch_ddp's detection)
        self.eval_forward = backend.wrap_forward(self.side.student)
        self.params = [p for p in self.side.parameters() if p.requires_grad]
        self.scheduler = build_scheduler(cfg, self.optimizer, len(self.data.train))

        self.epoch = 0
        self.batch_in_epoch = 0
        self.global_step = 0
        self.best_top1 = -1.0
        self.bad_images = 0
        if resume_from is not None:
            self._restore(checkpoint.load(resume_from))
            self.logger.info(f"resumed from {resume_from} at epoch {self.epoch + 1}")
        if backend.is_main:  # written once set-up has succeeded, so a failed start leaves no run behind
            kd_config.save(cfg, self.out / "config.yaml")

    # ----------------------------------------------------------------- set-up helpers
    def _feature_layers(self, loss, student, teacher) -> List[str]:
        if not loss.uses_features:
            return []
        layers = self.cfg.feature_layers or loss.default_layers(layer_names(student), layer_names(teacher))
        check_layers(student, layers, f"student {self.cfg.student}")
        check_layers(teacher, layers, f"teacher {self.cfg.teacher}")
        probe = torch.zeros(2, 3, self.cfg.image_size, self.cfg.image_size)
        shapes = []
        for model in (student, teacher):
            was_training = model.training
            model.eval()
            feats: Dict[str, torch.Tensor] = {}
            with torch.no_grad(), tap(model, layers, feats):
                model(probe)
            model.train(was_training)
            shapes.append({k: v.shape for k, v in feats.items()})
        loss.setup_features(*shapes)
        return layers

    def _restore(self, state: dict) -> None:
        side_state = {f"student.{k}": v for k, v in state["student"].items()}
        side_state.update({f"loss.{k}": v for k, v in state.get("loss", {}).items()})
        self.precision.load_model_state(self.side, side_state)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.precision.load_state_dict(state.get("precision", {}))
        self.epoch = state["epoch"]
        self.batch_in_epoch = state.get("batch_in_epoch", 0)
        self.global_step = state["global_step"]
        self.best_top1 = state["best_top1"]
        self.bad_images = state.get("bad_images", 0)
        rng = state.get("rng", {}).get(str(self.backend.rank))
        if rng is not None:
            checkpoint.set_rng_state(rng)

    def state(self) -> dict:
        side = self.precision.model_state(self.side)
        return {
            "format": checkpoint.FORMAT_VERSION,
            "kd_version": kd.__version__,
            "student": {k[len("student."):]: v for k, v in side.items() if k.startswith("student.")},
            "loss": {k[len("loss."):]: v for k, v in side.items() if k.startswith("loss.")},
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "precision": self.precision.state_dict(),
            "epoch": self.epoch,
            "batch_in_epoch": self.batch_in_epoch,
            "global_step": self.global_step,
            "best_top1": self.best_top1,
            "bad_images": self.bad_images,
            "rng": {str(self.backend.rank): checkpoint.rng_state()},
            "student_name": self.cfg.student,
            "num_classes": self.num_classes,
            "config": self.cfg.to_dict(),
        }

    def save(self, best: bool) -> None:
        if self.backend.is_main:
            path = self.out / "checkpoints" / "last.pt"
            checkpoint.save_atomic(self.state(), path)
            if best:
                tmp = path.with_name(".best.pt.tmp")
                shutil.copyfile(path, tmp)
                tmp.replace(path.with_name("best.pt"))
        self.backend.barrier()

    # ----------------------------------------------------------------- the loop
    def fit(self) -> Dict[str, float]:
        cfg = self.cfg
        record: Dict[str, float] = {}
        if self.teacher is not None and self.epoch == 0 and self.batch_in_epoch == 0:
            teacher_val = evaluate(lambda x: self.teacher(x)[0], self.data.val, self.backend, self.precision)
            self.teacher_top1 = teacher_val["top1"]
            self.logger.info(f"teacher {cfg.teacher}: val top-1 {teacher_val['top1']:.2f}")
        else:
            self.teacher_top1 = None
        while self.epoch < cfg.epochs:
            start = time.perf_counter()
            train = self.train_epoch()
            seconds = time.perf_counter() - start
            last = self.epoch == cfg.epochs - 1
            record = {"epoch": self.epoch + 1, **{f"train_{k}": v for k, v in train.items()},
                      "lr": self.optimizer.param_groups[0]["lr"], "seconds": seconds}
            record["img_per_s"] = train.get("images", 0) / max(seconds, 1e-9)
            if (self.epoch + 1) % cfg.eval_every == 0 or last:
                self.side.eval()
                val = evaluate(self.eval_forward, self.data.val, self.backend, self.precision)
                record.update(val_top1=val["top1"], val_top5=val["top5"], val_loss=val["loss"])
            if self.teacher_top1 is not None:
                record["teacher_top1"] = self.teacher_top1
                self.teacher_top1 = None
            if torch.cuda.is_available() and self.device.type == "cuda":
                record["gpu_mem_gb"] = torch.cuda.max_memory_allocated(self.device) / 2**30
            best = record.get("val_top1", -1.0) > self.best_top1
            if best:
                self.best_top1 = record["val_top1"]
            record["best_top1"] = self.best_top1
            self.logger.epoch(record)
            self.logger.info(format_record(record, cfg.epochs))
            self.epoch += 1
            self.batch_in_epoch = 0
            self.save(best)
        self.logger.close()
        return record

    def train_epoch(self) -> Dict[str, float]:
        cfg, backend, precision = self.cfg, self.backend, self.precision
        loader = self.data.train
        loader.set_epoch(self.epoch, self.batch_in_epoch)
        steps = len(loader) + self.batch_in_epoch
        self.side.train()
        dev = self.device
        sums: Dict[str, torch.Tensor] = {}
        count = torch.zeros((), device=dev)
        interval: Dict[str, torch.Tensor] = {}
        interval_n = torch.zeros((), device=dev)
        streak = torch.zeros((), device=dev)
        worst = torch.zeros((), device=dev)
        skipped = torch.zeros((), device=dev)
        bad_seen = 0
        images_seen = 0
        wait = 0.0
        bar = self.logger.progress(steps, f"epoch {self.epoch + 1}/{cfg.epochs}")
        bar.update(self.batch_in_epoch)
        t_interval = time.perf_counter()
        it = iter(loader)
        while True:
            t0 = time.perf_counter()
            batch = next(it, None)
            wait += time.perf_counter() - t0
            if batch is None:
                break
            if batch.bad:
                bad_seen += len(batch.bad)
                for path in batch.bad:
                    self.logger.info(f"skipped unreadable image {path}")
            if len(batch) == 0:
                raise KDError("a whole batch of images was unreadable; check the data folder")
            images = precision.input_cast(batch.images)
            progress = self.epoch + self.batch_in_epoch / max(steps, 1)
            t_logits = t_feats = None
            if self.teacher is not None:
                with torch.no_grad(), precision.autocast():
                    t_logits, t_feats = self.teacher(images)
            with precision.autocast():
                parts = self.model(images, batch.labels, t_logits, t_feats, progress)
            parts = {k: v.float().mean() for k, v in parts.items()}
            was_skipped = precision.step(parts["loss"], self.optimizer, self.params,
                                         lambda: backend.sync_gradients(self.model), cfg.grad_clip)
            self.scheduler.step()
            self.global_step += 1
            self.batch_in_epoch += 1
            n = float(len(batch))
            images_seen += len(batch)
            with torch.no_grad():
                for k, v in parts.items():
                    d = v.detach()
                    sums[k] = sums.get(k, 0.0) + d * n
                    interval[k] = interval.get(k, 0.0) + d * n
                count += n
                interval_n += n
                finite = torch.isfinite(parts["loss"].detach())
                streak = torch.where(finite, torch.zeros_like(streak), streak + 1)
                worst = torch.maximum(worst, streak)
                skipped += was_skipped.float()
            bar.update(1)
            if self.global_step % cfg.log_every == 0 or self.batch_in_epoch == steps:
                keys = sorted(interval)
                vec = torch.stack([interval[k] for k in keys] + [interval_n, worst, skipped,
                                                                  torch.tensor(float(bad_seen), device=dev)])
                backend.all_reduce_sum(vec)
                values = vec.tolist()
                n_all = max(values[len(keys)], 1.0)
                worst_all, skipped_all, bad_all = values[len(keys) + 1:]
                elapsed = time.perf_counter() - t_interval
                scalars = {k: values[i] / n_all for i, k in enumerate(keys)}
                scalars.update(lr=self.optimizer.param_groups[0]["lr"], img_per_s=n_all / max(elapsed, 1e-9),
                               skipped_steps=skipped_all, bad_images=self.bad_images + bad_all)
                scale = precision.loss_scale()
                if scale is not None:
                    scalars["loss_scale"] = float(scale)
                if dev.type == "cuda":
                    scalars["gpu_mem_gb"] = torch.cuda.memory_allocated(dev) / 2**30
                self.logger.scalars("train", scalars, self.global_step)
                bar.set_postfix_str(f"loss {scalars['loss']:.4f} lr {scalars['lr']:.4g} img/s {scalars['img_per_s']:.0f}")
                if worst_all >= cfg.max_nonfinite_steps:
                    raise KDError(
                        f"the loss was not finite for {cfg.max_nonfinite_steps} consecutive steps "
                        f"(epoch {self.epoch + 1}, step {self.global_step}); stopped, the last good checkpoint "
                        f"is {self.out / 'checkpoints' / 'last.pt'}; lower --lr or use --opt O0"
                    )
                if self.bad_images + bad_all > cfg.max_bad_images:
                    raise KDError(f"{int(self.bad_images + bad_all)} unreadable images, more than --max-bad-images "
                                  f"{cfg.max_bad_images}; see the log for their names")
                interval = {}
                interval_n = torch.zeros((), device=dev)
                t_interval = time.perf_counter()
        bar.close()
        keys = sorted(sums)
        vec = torch.stack([sums[k] for k in keys] + [count, skipped, torch.tensor(float(bad_seen), device=dev)])
        backend.all_reduce_sum(vec)
        values = vec.tolist()
        n_all = max(values[len(keys)], 1.0)
        out = {k: values[i] / n_all for i, k in enumerate(keys)}
        self.bad_images += int(values[-1])
        out.update(images=values[len(keys)], skipped_steps=values[len(keys) + 1], data_wait_s=wait,
                   bad_images=self.bad_images)
        return out


def format_record(record: Dict[str, float], epochs: int) -> str:
    parts = [f"epoch {record['epoch']}/{epochs}", f"loss {record.get('train_loss', float('nan')):.4f}"]
    if "val_top1" in record:
        parts.append(f"val top-1 {record['val_top1']:.2f} top-5 {record['val_top5']:.2f}")
    parts.append(f"{record['img_per_s']:.0f} img/s")
    parts.append(f"{record['seconds']:.1f}s")
    return " | ".join(parts)


def run_worker(cfg, out: Path, resume_from: Optional[Path] = None) -> Dict[str, float]:
    """Everything one process does for a run, from backend set-up to teardown."""
    import backends

    backend = backends.get(cfg.backend)(cfg)
    backend.setup()
    try:
        return Trainer(cfg, backend, out, resume_from).fit()
    finally:
        backend.teardown()

