"""The run's facts that depend on the machine (kd.run.runtime): a recipe's torch.compile applies on
CUDA only."""

from __future__ import annotations


def test_a_recipes_compile_applies_on_cuda_only_and_says_when_it_starts(image_folder, tmp_path, capfd):
    """Recipes ask for torch.compile on CUDA (``compile: auto``): on the CPU it cost a silent minute
    for little gain. Asked for (--compile), it is used anywhere, and the log says the first step compiles."""

    import torch

    import backends
    from kd import config as kd_config
    from kd.run.loop import Trainer
    from kd.run.runtime import resolve
    from kd.run.students import Students

    cfg = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"data": str(image_folder)})
    assert cfg.compile is None
    assert not resolve(cfg, torch.device("cpu")).compile and resolve(cfg, torch.device("cuda")).compile
    forced = kd_config.resolve(recipe="imagenet/r34_r18_dkd", options={"data": str(image_folder), "compile": True})
    assert resolve(forced, torch.device("cpu")).compile
    tiny = dict(
        data=str(image_folder), out=str(tmp_path / "c"), no_teacher=True, student="resnet18", image_size=32, batch_size=8,
        workers=0, device="cpu", compile=True, progress_bar=False,
    )  # fmt: skip
    cfg = kd_config.resolve(options=tiny)
    backend = backends.get("single")(cfg)
    backend.setup()
    Trainer(Students.alone(cfg), backend).close()  # torch.compile is lazy: nothing compiles before a step
    assert "torch.compile (default): the first step compiles the student (a minute or more)" in capfd.readouterr().err
