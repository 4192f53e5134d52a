"""Top-1/top-5 over the val split, exact across processes (used by the loop, the teacher probe and kd eval)."""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

import torch


def accuracy_counts(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[correct@1, correct@5] for a batch, on the device."""
    k = min(5, logits.shape[1])
    top = logits.topk(k, dim=1).indices
    hit = top.eq(labels.view(-1, 1))
    return torch.stack([hit[:, :1].any(dim=1).sum(), hit.any(dim=1).sum()]).float()


@torch.no_grad()
def evaluate(
    forward, loader, backend, precision, limit: Optional[int] = None, stop: Optional[Callable[[], bool]] = None
) -> Dict[str, Any]:
    """top-1/top-5 (percent), loss and non-finite count of ``forward(images) -> logits`` over the
    val split (its first ``limit`` batches per process, where given).

    The accuracy is over every image of the split: an unreadable one (a loader's ``Batch.bad``)
    counts as an error, neither top-1 nor top-5 correct. The result's ``images`` is that
    denominator, ``unreadable`` how many of them could not be read and ``unreadable_files`` their
    names (gathered from every process, sorted); ``count`` the images the model saw, which the
    loss is the mean over.

    ``precision`` gives ``autocast()`` and ``input_cast()`` (a run's or a teacher's precision).
    Exact across processes: the val sampler shards without padding and the counts are summed.
    A RuntimeError in any process's forward is raised in every process, after the one collective.
    ``stop()`` is asked before each batch: where it says so in any process, the pass ends early
    and the result has ``stopped`` > 0 in every process (its figures are then partial).
    The caller puts the model in eval mode.
    """
    # correct1, correct5, n, loss*n, rows with non-finite logits, processes whose forward raised, stopped,
    # unreadable images
    sums = torch.zeros(8, device=backend.device)
    error: Optional[RuntimeError] = None
    unreadable: List[str] = []
    for index, batch in enumerate(loader):
        if limit is not None and index >= limit:
            break
        if stop is not None and stop():
            sums[6] = 1.0
            break
        unreadable.extend(batch.bad)
        if limit is None:  # the split's images no batch holds count in a whole pass only
            unreadable.extend(batch.left_out)
        if len(batch) == 0:
            continue
        try:
            with precision.autocast():
                logits = forward(precision.input_cast(batch.images))
        except RuntimeError as exc:  # out of memory, a kernel the device refuses: every process hears of it
            error = exc
            break
        logits = logits.float()
        sums[:2] += accuracy_counts(logits, batch.labels)
        sums[2] += len(batch)
        sums[3] += torch.nn.functional.cross_entropy(logits, batch.labels, reduction="sum")
        sums[4] += (~torch.isfinite(logits).all(dim=1)).sum()
    sums[5] = float(error is not None)
    sums[7] = float(len(unreadable))
    backend.all_reduce_sum(sums)
    if sums[5].item() > 0:  # the same exception on every process, so they stay in step
        raise error if error is not None else RuntimeError("the forward failed on another process")
    c1, c5, n, loss, nonfinite, _, stopped, bad = sums.tolist()
    if bad > 0 and getattr(backend, "world_size", 1) > 1:  # rare: every process learns every name
        unreadable = [path for paths in backend.all_gather_object(unreadable) for path in paths]
    images = max(n + bad, 1.0)
    return {
        "top1": 100.0 * c1 / images,
        "top5": 100.0 * c5 / images,
        "loss": loss / max(n, 1.0),
        "count": int(n),
        "images": int(n + bad),
        "unreadable": int(bad),
        "unreadable_files": sorted(unreadable),
        "nonfinite": int(nonfinite),
        "stopped": int(stopped),
    }


def validate_student(
    side, forward, loader, backend, precision, stop=None
) -> Optional[Tuple[Dict[str, float], List[str]]]:
    """The student on the val split, as the record's ``val_*`` keys (``val_images``: the images the
    accuracy is over, ``val_unreadable``: how many of them could not be read), and the names of the
    unreadable ones: the model the checkpoint holds (every process's buffers as rank 0's); None
    where ``stop()`` ended the pass (in every process)."""
    import time

    side.eval()
    backend.sync_buffers(side)
    start = time.perf_counter()
    val = evaluate(forward, loader, backend, precision, stop=stop)
    if val["stopped"]:
        return None
    record = {
        "val_top1": val["top1"],
        "val_top5": val["top5"],
        "val_loss": val["loss"],
        "val_images": val["images"],
        "val_unreadable": val["unreadable"],
        "val_s": time.perf_counter() - start,
    }
    return record, val["unreadable_files"]


def unreadable_note(unreadable: int, images: int) -> str:
    """How an accuracy counts the split's unreadable images, for a log line ("" where there are none)."""
    if not unreadable:
        return ""
    return f"{unreadable} of {images} val images unreadable, counted as errors in top-1 and top-5"
