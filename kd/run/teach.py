"""``kd teach``: the teacher's outputs on a run's crops written to a soft-label store
(:mod:`kd.teacher.store`) that later runs read in the teacher's place (``--soft-labels``): the same
input pipeline and teacher as ``kd train``, and no student."""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import time
from pathlib import Path
from typing import Any, Dict, Sequence, Tuple

import torch

from kd import models
from kd.data.augment_options import wanted as augments
from kd.data.model_data import with_data_configs
from kd.data.pipeline import build as build_data
from kd.data.pipeline import choose_loader
from kd.errors import KDError
from kd.precision import make_precision
from kd.run.build import seeded, teacher_size
from kd.run.lane import stop_in_setup
from kd.run.log import NullLogger, RunLogger
from kd.run.runtime import resolve as resolve_runtime
from kd.run.step import StepHook, StepOutput, check_batch
from kd.runfolder import nearest_folder
from kd.teacher import store as kd_store
from kd.teacher.frozen import build_teacher
from kd.teacher.precision import PROBE_BATCHES
from kd.utils.signals import Interrupted, StopFlag


class Teaching:
    """Writes ``cfg.out``'s store: ``cfg.epochs`` epochs of the teacher's logits on the run's crops."""

    def __init__(self, cfg, backend, stop: StopFlag, hooks: Sequence[StepHook] = (), validate: bool = True):
        """``hooks``: kd bench's step timer, shown the teacher and each batch; ``validate=False``: the
        teacher's top-1 is not measured (a timed run)."""
        self.cfg = cfg
        self.backend = backend
        self.stop = stop
        self.hooks = list(hooks)
        self.validates = validate
        self.global_step = 0  # batches taught by this process in this run (the hooks' step count)
        self.root = Path(cfg.out)
        self.data: Any = None
        self.teacher: Any = None
        self.logger: Any = NullLogger()

    def run(self) -> Dict[str, Any]:
        cfg, backend = self.cfg, self.backend
        try:
            stop_in_setup(self.stop, backend)
            num_replicas, rank = backend.data_shard()
            cfg = with_data_configs(cfg)
            if cfg.student_data is None:  # no student: the loaders normalise as the teacher wants
                cfg = dataclasses.replace(cfg, student_data=cfg.teacher_data)
            self.cfg = cfg
            if backend.device.type == "cuda":  # as a student's run sets it (kd.run.build)
                torch.backends.cudnn.benchmark = cfg.cudnn_benchmark
            self.data = build_data(  # every sample's row: a last short batch too
                cfg,
                num_replicas,
                rank,
                backend.local_batch(cfg.batch_size),
                backend.device,
                resolve_runtime(cfg, backend.device).channels_last,
                every_sample=True,
            )
            classes = cfg.num_classes or len(self.data.classes)
            if backend.placement.world_size > backend.placement.local_world_size:
                raise KDError(
                    "kd teach writes its store through memory maps, which hosts do not share coherently; "
                    "run it on one host (its processes may use every GPU there)"
                )
            if backend.is_main:
                self.logger = RunLogger(self.root, cfg.progress_bar, "")
            precision = make_precision(cfg, backend.device, prefer_apex=False)
            settings = self._settings(classes)  # a store for another teaching fails before the teacher is built
            with seeded(cfg.seed + 1):  # as kd train builds it: a teacher without weights is the same one
                model = models.freeze(models.build(cfg.teacher, classes, cfg.teacher_weights, teacher_size(cfg)))
            runtime = resolve_runtime(cfg, backend.device)
            log = self.logger.info
            resized = models.other_size_line("teacher", cfg.teacher, model, teacher_size(cfg))
            if resized:
                log(resized)
            self.teacher = build_teacher(model, [], cfg, backend, self.data, precision, log, runtime, self.hooks)
            self._choose_dtype(settings)  # an explicit float16 that cannot hold the logits fails before any write
            self._check_space(settings)
            stop_in_setup(self.stop, backend)
            manifest = self._write_manifest(settings)
        except BaseException:
            self.close()
            raise
        log = self.logger.info
        log(self.data.train.describe())
        first = manifest["epochs_done"]
        if first >= cfg.epochs:
            log(f"kd teach: {self.root} already holds {first} epoch(s); nothing to do")
            return {"epochs": float(first)}
        if first:
            log(f"kd teach: {self.root} holds {first} epoch(s); continuing at epoch {first + 1}")
        per_epoch = kd_store.epoch_bytes(manifest["samples"], classes, manifest["k"], manifest["dtype"])
        log(
            f"kd teach: {cfg.epochs - first} epoch(s) of {manifest['samples']:,} samples, "
            f"{kd_store.human(per_epoch)} an epoch ({kd_store.human(per_epoch * (cfg.epochs - first))} in all)"
        )
        start = time.perf_counter()
        images = 0
        for epoch in range(first, cfg.epochs):
            taught, files, largest = self._epoch(epoch, manifest)
            images += taught
            if backend.is_main:  # the epoch's files, their checksums and its check, with the epoch
                manifest["epoch_files"].append(files)
                manifest["epoch_largest_logit"].append(largest)
                manifest["epochs_done"] = epoch + 1
                kd_store.write_manifest(self.root, manifest)
            log(f"kd teach: epoch {epoch + 1}/{cfg.epochs} written")
        seconds = time.perf_counter() - start
        rate = images * backend.world_size / max(seconds, 1e-9)
        record: Dict[str, Any] = {
            "epochs": cfg.epochs,
            "img_per_s": rate,
            "seconds": seconds,
            "batches": self.global_step,
        }
        for hook in self.hooks:  # kd bench's timer ends with the teaching, before the teacher's validation
            hook.on_epoch_end(self, record)
        if self.validates and manifest.get("teacher_val_top1") is None:
            top1 = self.teacher.validate(self.stop)
            if top1 is not None and backend.is_main:
                manifest["teacher_val_top1"] = top1
                kd_store.write_manifest(self.root, manifest)
        if backend.is_main:  # the store keeps what each teaching cost, for its break-even against live runs
            device = backend.device
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            try:
                kd_store.log_teaching(
                    self.root, {"epochs_from": first, **record, "processes": backend.world_size, "device": name}
                )
            except OSError as exc:
                raise kd_store.disk_error(self.root, exc) from None
        log(f"kd teach: done, {self.root}: {cfg.epochs} epoch(s), {rate:,.0f} img/s")
        return record

    def _settings(self, classes: int) -> Dict[str, Any]:
        """The store's manifest for this run; where the store exists, checked against it (a store
        for other crops, another teacher or another k is refused) and continued."""
        cfg = self.cfg
        wanted = kd_store.wanted_manifest(cfg, self.data.train_samples, classes)
        synthetic = cfg.data == "synthetic"
        # its crops agree with the other loader's to rounding
        loader = "synthetic" if synthetic else choose_loader(cfg.loader, self.backend.device, augments(cfg))[0]
        k = classes if cfg.soft_label_k is None or cfg.soft_label_k >= classes else cfg.soft_label_k
        settings = {
            **wanted,
            "format": kd_store.FORMAT,
            "teacher": cfg.teacher,
            "teacher_weights": cfg.teacher_weights,
            "teacher_weights_sha256": kd_store.file_sha256(cfg.teacher_weights),
            "teacher_data": cfg.teacher_data,
            "data": cfg.data if synthetic else str(Path(cfg.data).absolute()),
            "loader": loader,
            "k": k,
            "dtype": cfg.soft_label_dtype,  # auto: chosen once the teacher is built (_choose_dtype)
            "epochs": cfg.epochs,
            "epochs_done": 0,
            "epoch_files": [],  # per complete epoch: its files' sizes and sha256
            "epoch_largest_logit": [],  # per complete epoch: its largest |logit| (every row checked finite)
        }
        if kd_store.is_store(self.root):
            have = kd_store.read_manifest(self.root, "--out")
            why = kd_store.mismatch(have, wanted)
            keys = ["teacher", "teacher_weights_sha256", "k"] + (["dtype"] if cfg.soft_label_dtype != "auto" else [])
            if settings["teacher_weights_sha256"] is None:  # named weights (pretrained, torchvision:...): by name
                keys.append("teacher_weights")
            for key in keys:
                if why is None and have.get(key) != settings[key]:
                    why = f"its {key} is {have.get(key)}, this run's {settings[key]}"
            if why:
                raise KDError(f"--out {self.root} holds a store for another teaching: {why}; give another --out")
            for key in ("dtype", "epochs_done", "epoch_files", "epoch_largest_logit", "teacher_val_top1"):
                settings[key] = have.get(key)
            settings["continued"] = True
        return settings

    def _choose_dtype(self, settings: Dict[str, Any]) -> None:
        """``settings``' dtype from the teacher's largest |logit| on its probe batches (the first
        validation batches of every process, as its precision probe): float16 where auto finds it
        small enough, refused where float16 cannot hold it (:func:`kd.teacher.store.choose_dtype`)."""
        backend, teacher = self.backend, self.teacher
        num_replicas, rank = backend.data_shard()
        largest = torch.zeros(max(num_replicas, 1), device=backend.device)  # a slot per process: a max by a sum
        images = torch.zeros((), device=backend.device)
        with torch.no_grad():
            for index, batch in enumerate(teacher.val):
                if index >= PROBE_BATCHES:
                    break
                if len(batch):
                    logits = teacher.forward(batch.images)[0]
                    largest[rank] = torch.maximum(largest[rank], logits.abs().max().float())
                    images += len(batch)
        backend.all_reduce_sum(largest)
        backend.all_reduce_sum(images)
        top = float(largest.max().item()) if not torch.isnan(largest).any() else math.nan
        asked, how = self.cfg.soft_label_dtype, "as given"
        if settings.pop("continued", False):
            asked, how = settings["dtype"], "the store's"
        settings["dtype"], line = kd_store.choose_dtype(asked, top, int(images.item()), self.cfg.teacher, how)
        self.logger.info(line)

    def _check_space(self, settings: Dict[str, Any]) -> None:
        """The store's epochs still to write fit the disk, or are refused before any is written."""
        folder = nearest_folder(self.root)
        epochs = max(self.cfg.epochs - settings["epochs_done"], 0)
        block = os.statvfs(folder).f_frsize if hasattr(os, "statvfs") else 4096
        needed = kd_store.disk_bytes(
            settings["samples"], settings["classes"], settings["k"], settings["dtype"], epochs, block
        )
        free = shutil.disk_usage(folder).free
        # the main process's measure for every process (each measuring its own could split them at a barrier)
        flag = torch.tensor(float(needed > free) if self.backend.is_main else 0.0, device=self.backend.device)
        self.backend.all_reduce_sum(flag)
        if flag.item() > 0:
            raise KDError(
                f"--out {self.root}: the store needs {kd_store.human(needed)} more and the disk has "
                f"{kd_store.human(free)} free; free space, give fewer --epochs or a smaller --top-k"
            )

    def _write_manifest(self, settings: Dict[str, Any]) -> Dict[str, Any]:
        """The manifest written by the main process, then read by every process."""
        settings["teacher_precision"] = self.teacher.dtype_name
        if self.backend.is_main:
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise kd_store.disk_error(self.root, exc) from None
            kd_store.write_manifest(self.root, settings)
        self.backend.barrier()
        return kd_store.read_manifest(self.root, "--out")

    def _epoch(self, epoch: int, manifest: Dict[str, Any]) -> Tuple[int, Dict[str, Any], float]:
        """One epoch's rows of this process: (the images it fed the teacher, the epoch's files with
        their checksums (rank 0's; empty elsewhere), the epoch's largest |logit|). A batch that is
        not finite as stored stops kd teach in every process, the epoch not committed."""
        backend, loader = self.backend, self.data.train
        if backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=True, device=backend.device)
        backend.barrier()
        if not backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=False, device=backend.device)
        loader.set_epoch(epoch)
        bar = self.logger.progress(len(loader), f"teach {epoch + 1}/{self.cfg.epochs}")
        images = bad = 0
        with torch.no_grad():
            for i, batch in enumerate(loader):
                stop, bad_anywhere, nonfinite = self._stop_asked(i, bad, writer)
                if nonfinite:
                    bar.close()
                    self._refuse_nonfinite(epoch, writer, manifest["dtype"])
                if bad_anywhere > self.cfg.max_bad_images:  # every process decides alike
                    raise KDError(f"more than --max-bad-images {self.cfg.max_bad_images} unreadable images")
                if stop:
                    writer.flush()
                    bar.close()
                    raise Interrupted(
                        self.stop.signame or "a signal",
                        message=f"stopped by {self.stop.signame} in epoch {epoch + 1}; "
                        f"{self.root} keeps {epoch} complete epoch(s); run the same kd teach again to continue",
                    )
                check_batch(batch, self.logger.info)  # an unreadable image: named, its row left unwritten
                bad += len(batch.bad)
                logits = self.teacher.forward(batch.images)[0]
                writer.write(batch.indices, logits.float())
                images += len(batch)
                bar.update(1)
                self.global_step += 1
                for hook in self.hooks:
                    hook.on_step(self, StepOutput({}, None, None, len(batch)))
        bar.close()
        unchecked = writer.nonfinite.clone()
        backend.all_reduce_sum(unchecked)  # the batches since the last check, in every process
        if unchecked.item():
            self._refuse_nonfinite(epoch, writer, manifest["dtype"])
        largest = self._largest(writer)
        writer.flush()
        backend.barrier()
        return images, writer.commit() if backend.is_main else {}, largest

    def _largest(self, writer: kd_store.EpochWriter) -> float:
        """The epoch's largest |logit| so far over every process (a collective: all call it alike)."""
        num_replicas, rank = self.backend.data_shard()
        slots = torch.zeros(max(num_replicas, 1), device=self.backend.device)
        slots[rank] = writer.largest
        self.backend.all_reduce_sum(slots)
        return math.nan if torch.isnan(slots).any() else float(slots.max().item())

    def _refuse_nonfinite(self, epoch: int, writer: kd_store.EpochWriter, dtype: str) -> None:
        """Every process: the epoch's partial files removed (rank 0), one line saying why."""
        largest = self._largest(writer)
        if self.backend.is_main:
            writer.discard()
        keeps = f"the epoch is not written and {self.root} keeps its {epoch} complete epoch(s)"
        if dtype == "float16" and math.isfinite(largest):
            raise KDError(
                f"kd teach: epoch {epoch + 1}: the teacher's logits pass float16's range (its largest |logit| "
                f"{largest:.4g}, float16's largest {kd_store.FLOAT16_MAX:.0f}); {keeps}; teach again into a new "
                f"--out with --logits-dtype float32"
            )
        raise KDError(
            f"kd teach: epoch {epoch + 1}: the teacher gave non-finite logits (its largest |logit| {largest:.4g}); "
            f"{keeps}; check --teacher-weights, or give --teacher-precision float32"
        )

    def _stop_asked(self, i: int, bad: int, writer: kd_store.EpochWriter) -> Tuple[bool, float, bool]:
        """(a stop signal in any process, the unreadable images of every process so far, a row not
        finite as stored in any process): every batch alone (the rows' copy to the store has
        synchronised already); every tenth batch as a collective with several processes (each has
        the same number of batches, so all ask at the same ones and decide alike)."""
        if self.backend.world_size == 1:
            return self.stop.requested, float(bad), bool(writer.nonfinite.item())
        if i % 10:
            return False, 0.0, False
        flags = torch.tensor([float(self.stop.requested), float(bad)], device=self.backend.device)
        flags = torch.cat([flags, writer.nonfinite.float().reshape(1)])
        self.backend.all_reduce_sum(flags)
        return bool(flags[0].item() > 0), float(flags[1].item()), bool(flags[2].item() > 0)

    def close(self) -> None:
        self.logger.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.data is not None:
            self.data.close()
