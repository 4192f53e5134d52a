"""``kd export RUN -o weights.pt|weights.safetensors``: a run's student (``--ema``: the moving average
of its weights) as a plain state dict, with what it needs beside it (model name, classes,
preprocessing) in ``weights.json``.

The state dict is the student's own (the keys its torchvision or timm model has), float32, so
``model.load_state_dict(torch.load("weights.pt"))`` and ``timm.create_model(name,
checkpoint_path="weights.pt", num_classes=N)`` load it as they load any weights. A kd
checkpoint itself holds the same tensors under ``state_dict`` as well, where timm's
``load_checkpoint`` looks.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

from kd.data.data_config import DataConfig
from kd.errors import KDError, writing
from kd.run import checkpoint
from kd.runfolder import RunFolder
from kd.utils import checkpoint_io

FORMATS = (".pt", ".pth", ".safetensors")


def source_checkpoint(run: Path) -> Path:
    """The checkpoint to export: ``run`` itself (a .pt file), or a run folder's best.pt (else last.pt)."""
    if run.is_file():
        return run
    folder = RunFolder(run)
    for path in (folder.best, folder.last):
        if path.is_file():
            return path
    raise KDError(f"{run} holds no checkpoint (neither {folder.best} nor {folder.last})")


def preprocessing(config: Dict[str, Any]) -> Dict[str, Any]:
    """What the student was validated with: the run's crop, resize and interpolation, and its normalisation."""
    size = int(config.get("image_size") or 224)
    data = DataConfig.from_dict(config["student_data"]) if config.get("student_data") else DataConfig()
    return {
        "image_size": size,
        "resize": int(config.get("val_resize") or data.val_resize(size)),
        "interpolation": config.get("val_interpolation") or data.interpolation,
        "mean": [round(m, 6) for m in data.mean],
        "std": [round(s, 6) for s in data.std],
    }


def export(run: Path, out: Path, ema: bool = False) -> Dict[str, Any]:
    """Write the student of ``run`` (a run folder or a kd checkpoint) to ``out`` and its description
    to ``out`` with the suffix .json; returns that description. ``out`` is written atomically.
    ``ema``: the moving average of its weights (``state_dict_ema``, a run of --model-ema) in their place."""
    out = Path(out)
    if out.suffix not in FORMATS:
        raise KDError(f"-o {out}: give a file ending in {', '.join(FORMATS)}")
    path = source_checkpoint(Path(run))
    state = checkpoint.load(path)
    key = "state_dict_ema" if ema else "student"
    if not isinstance(state.get(key), dict):
        raise KDError(f"--ema: {path} holds no moving average of the weights; its run trained without --model-ema")
    weights = {k: v.contiguous() for k, v in state[key].items()}
    config = state.get("config") or {}
    info = {
        "model": state.get("student_name") or config.get("student"),
        "num_classes": state.get("num_classes"),
        "classes": state.get("classes"),
        "preprocessing": preprocessing(config),
        "source": str(path),
        "epoch": state.get("epoch"),
        "best_top1": state.get("best_top1"),
        "ema": ema,
    }
    with writing(out):
        out.parent.mkdir(parents=True, exist_ok=True)
        if out.suffix == ".safetensors":  # serialised here, written by Python: a failed write is an OSError
            from safetensors.torch import save

            tmp = out.with_name(f".{out.name}.tmp")
            try:
                tmp.write_bytes(save(weights, {"model": str(info["model"]), "num_classes": str(info["num_classes"])}))
                tmp.replace(out)
            finally:
                tmp.unlink(missing_ok=True)
        else:
            checkpoint_io.save_atomic(weights, out)
    with writing(out.with_suffix(".json")):
        out.with_suffix(".json").write_text(json.dumps(info, indent=2) + "\n", encoding="utf-8")
    return info


def describe(info: Dict[str, Any], out: Path) -> str:
    load = (
        f"timm.create_model('{str(info['model'])[len('timm:') :]}', checkpoint_path='{out}', "
        f"num_classes={info['num_classes']})"
        if str(info["model"]).startswith("timm:")
        else f"torchvision.models.get_model('{info['model']}', num_classes={info['num_classes']})"
        f".load_state_dict(torch.load('{out}'))"
    )
    return f"wrote {out} and {out.with_suffix('.json')} ({info['model']}, {info['num_classes']} classes); load: {load}"
