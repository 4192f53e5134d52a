"""``kd teach``: one process's part of writing a soft-label store (:mod:`kd.teacher.store`).

The same data pipeline as ``kd train`` (its sampler, seeds, crops and flips, on either loader and
any backend, sharded over the processes) feeds the teacher prepared as ``kd train`` prepares it
(fused, its precision probed); every process writes its samples' rows of each epoch. Epochs
already complete in the store are skipped, so a stopped ``kd teach`` continues where it stopped.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Dict, Optional

import torch

from kd import models
from kd.data.pipeline import build as build_data
from kd.data.pipeline import choose_loader
from kd.errors import KDError
from kd.precision import make_precision
from kd.run.build import seeded
from kd.run.lane import Lane, stop_in_setup
from kd.run.log import SetupClock, command_start
from kd.run.loop import Shared, prepare_teacher
from kd.run.signals import Interrupted, StopFlag
from kd.teacher import store as kd_store


class Teaching:
    """Writes ``cfg.out``'s store: ``cfg.epochs`` epochs of the teacher's logits on the run's crops."""

    def __init__(self, cfg, backend, stop: StopFlag):
        self.cfg = cfg
        self.backend = backend
        self.stop = stop
        self.root = Path(cfg.out)
        self.data: Any = None
        self.teacher: Any = None
        self.lane: Optional[Lane] = None

    def run(self) -> Dict[str, float]:
        cfg, backend = self.cfg, self.backend
        clock = SetupClock(command_start(default=time.time()))
        try:
            stop_in_setup(self.stop, backend)
            num_replicas, rank = backend.data_shard()
            cfg = models.with_data_configs(cfg)
            if cfg.student_data is None:  # no student: the loaders normalise as the teacher wants
                cfg = dataclasses.replace(cfg, student_data=cfg.teacher_data)
            self.cfg = cfg
            channels_last = cfg.channels_last if cfg.channels_last is not None else backend.device.type == "cuda"
            self.data = build_data(
                cfg, num_replicas, rank, backend.local_batch(cfg.batch_size), backend.device, channels_last
            )
            classes = cfg.num_classes or len(self.data.classes)
            shared = Shared(self.data, None, self.stop, clock)
            self.lane = lane = Lane(cfg, backend, self.root, None, shared, validate=True, alone=True)
            lane.precision = make_precision(cfg, backend.device, prefer_apex=False)
            settings = self._settings(classes)  # a store for another teaching fails before the teacher is built
            with seeded(cfg.seed + 1):  # as kd train builds it: a teacher without weights is the same one
                model = models.freeze(models.build(cfg.teacher, classes, cfg.teacher_weights))
            self.teacher = prepare_teacher(lane, model, [], (), backend, [])
            stop_in_setup(self.stop, backend)
            manifest = self._write_manifest(settings)
        except BaseException:
            self.close()
            raise
        log = lane.logger.info
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
            images += self._epoch(epoch, manifest)
            if backend.is_main:
                manifest["epochs_done"] = epoch + 1
                kd_store.write_manifest(self.root, manifest)
            log(f"kd teach: epoch {epoch + 1}/{cfg.epochs} written")
        seconds = time.perf_counter() - start
        if self.lane.validates and manifest.get("teacher_val_top1") is None:
            top1 = self.teacher.validate(self.stop)
            if top1 is not None and backend.is_main:
                manifest["teacher_val_top1"] = top1
                kd_store.write_manifest(self.root, manifest)
        rate = images * backend.world_size / max(seconds, 1e-9)
        log(f"kd teach: done, {self.root}: {cfg.epochs} epoch(s), {rate:,.0f} img/s")
        return {"epochs": float(cfg.epochs), "img_per_s": rate, "seconds": seconds}

    def _settings(self, classes: int) -> Dict[str, Any]:
        """The store's manifest for this run; where the store exists, checked against it (a store
        for other crops, another teacher or another k is refused) and continued."""
        cfg = self.cfg
        wanted = kd_store.wanted_manifest(cfg, self.data.train_samples, classes)
        k = classes if cfg.soft_label_k is None or cfg.soft_label_k >= classes else cfg.soft_label_k
        settings = {
            **wanted,
            "format": kd_store.FORMAT,
            "teacher": cfg.teacher,
            "teacher_weights": cfg.teacher_weights,
            "teacher_weights_sha256": kd_store.file_sha256(cfg.teacher_weights),
            "teacher_data": cfg.teacher_data,
            "data": str(Path(cfg.data).absolute()),
            "loader": choose_loader(cfg.loader, self.backend.device)[0],  # its crops agree with the other's to rounding
            "k": k,
            "dtype": cfg.soft_label_dtype,
            "epochs": cfg.epochs,
            "epochs_done": 0,
        }
        if kd_store.is_store(self.root):
            have = kd_store.read_manifest(self.root, "--out")
            why = kd_store.mismatch(have, wanted)
            for key in ("teacher", "teacher_weights_sha256", "k", "dtype"):
                if why is None and have.get(key) != settings[key]:
                    why = f"its {key} is {have.get(key)}, this run's {settings[key]}"
            if why:
                raise KDError(f"--out {self.root} holds a store for another teaching: {why}; give another --out")
            settings["epochs_done"] = have.get("epochs_done", 0)
            settings["teacher_val_top1"] = have.get("teacher_val_top1")
        return settings

    def _write_manifest(self, settings: Dict[str, Any]) -> Dict[str, Any]:
        """The manifest written by the main process, then read by every process."""
        settings["teacher_precision"] = self.teacher.dtype_name
        if self.backend.is_main:
            self.root.mkdir(parents=True, exist_ok=True)
            kd_store.write_manifest(self.root, settings)
        self.backend.barrier()
        return kd_store.read_manifest(self.root, "--out")

    def _epoch(self, epoch: int, manifest: Dict[str, Any]) -> int:
        """One epoch's rows of this process; the images it fed the teacher."""
        backend, loader = self.backend, self.data.train
        if backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=True)
        backend.barrier()
        if not backend.is_main:
            writer = kd_store.EpochWriter(self.root, epoch, manifest, create=False)
        loader.set_epoch(epoch)
        lane = self.lane
        assert lane is not None
        bar = lane.logger.progress(len(loader), f"teach {epoch + 1}/{self.cfg.epochs}")
        images = 0
        with torch.no_grad():
            for i, batch in enumerate(loader):
                if self._stop_asked(i):
                    writer.flush()
                    bar.close()
                    raise Interrupted(
                        self.stop.signame or "a signal",
                        message=f"stopped by {self.stop.signame} in epoch {epoch + 1}; "
                        f"{self.root} keeps {epoch} complete epoch(s); run the same kd teach again to continue",
                    )
                logits = self.teacher.forward(batch.images)[0]
                writer.write(batch.indices, logits.float())
                images += len(batch)
                bar.update(1)
        bar.close()
        writer.flush()
        backend.barrier()
        if backend.is_main:
            writer.commit()
        return images

    def _stop_asked(self, i: int) -> bool:
        """A stop signal in any process: every batch alone, every tenth batch as a collective (every
        process has the same number of batches, so all ask at the same ones)."""
        if self.backend.world_size == 1:
            return self.stop.requested
        if i % 10:
            return False
        flag = torch.tensor(float(self.stop.requested), device=self.backend.device)
        self.backend.all_reduce_sum(flag)
        return flag.item() > 0

    def close(self) -> None:
        if self.lane is not None:
            self.lane.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.data is not None:
            self.data.close()
