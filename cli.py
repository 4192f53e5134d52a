"""The ``kd`` command line: parsing and error presentation only; the work is in ``kd``.

Every user error ends with one line on stderr and exit code 2.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import click
from click.core import ParameterSource

from kd.commands import demo as kd_demo
from kd.commands import paper as paper_table
from kd.config import AMP_DTYPES, DEVICES, FIELDS, MP_CONTEXTS, SOFT_LABEL_DTYPES, TRAIN_OPTIONS, Option
from kd.data.registry import check_loader, loader_choices
from kd.errors import WRITE_ONLY_ERRNOS, KDError, cannot_write, writing
from kd.siblings import own

#: kd's own ``cli`` (kd.siblings.own checks it: another module of this name has none)
KD_SIBLING = True


def _backend_names():
    return own("backends").BACKENDS.names()


def _loss_names():
    from kd.losses import LOSSES

    return LOSSES.names()


def _copy_formats():
    from kd.data.prepared_writer import TRAIN_FORMATS

    return TRAIN_FORMATS


#: The registries whose names fill a ``{names}`` in an option's help (imported when help is shown).
REGISTRY_NAMES = {"backend": _backend_names, "kd_loss": _loss_names, "loader": loader_choices}


class LazyChoice(click.ParamType):
    """One of the names ``names()`` gives, read when first needed (their module may import torch,
    which ``kd --help`` need not). ``check(value)`` refuses any other with its owner's one line
    (a registry's, with near names); without it click says which names it takes."""

    name = "choice"

    def __init__(self, names: Callable[[], Sequence[str]], check: Optional[Callable[[str], object]] = None):
        self.names = names
        self.check = check

    def get_metavar(self, param, ctx=None) -> str:
        return f"[{'|'.join(self.names())}]"

    def convert(self, value, param, ctx):
        if self.check is not None:
            self.check(value)
        elif value not in self.names():
            self.fail(f"{value!r} is not one of {', '.join(self.names())}", param, ctx)
        return value


class TrainOption(click.Option):
    """A ``kd train`` option made from a :class:`kd.config.Option`; its help ends with the config's
    default, and names a registry's entries only when the help is shown."""

    def __init__(self, param_decls, spec: Option):
        self.spec = spec
        kwargs = dict(metavar=spec.metavar, help=spec.help, default=None)  # None: "not given", see train()
        ftype = FIELDS[spec.field].type
        if spec.switch:
            if "/" not in spec.flags[0]:  # --x/--no-x is a boolean switch by its declaration
                kwargs["is_flag"] = True
        elif spec.choices:
            kwargs["type"] = click.Choice(spec.choices)
        elif "List" not in ftype and ("int" in ftype or "float" in ftype):
            kwargs["type"] = float if "float" in ftype else int
        super().__init__(param_decls, **kwargs)

    def get_help_record(self, ctx):
        names = REGISTRY_NAMES.get(self.spec.field)
        text = self.spec.help.replace("{names}", ", ".join(names())) if names else self.spec.help
        self.help = " ".join(t for t in (text, self.spec.default_text()) if t)
        return super().get_help_record(ctx)


#: kd bench's timed runs: the steps after this many are timed, and nothing is validated
TIMED_AFTER = click.option("--timed-after", "timed_after", type=click.IntRange(min=0), default=0, hidden=True)


def train_options(fn):
    for spec in reversed(TRAIN_OPTIONS):
        fn = click.option(*spec.flags, spec.field, cls=TrainOption, spec=spec)(fn)
    return fn


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="kd", message="kd %(version)s")
@click.option("--local_rank", "--local-rank", "local_rank", type=int, default=None, hidden=True)
def cli(local_rank):
    """kd: knowledge-distillation training for image classification."""
    from kd.run.launch import accept_legacy_local_rank
    from kd.utils.installed import check_torch_pair

    check_torch_pair()  # before torchvision is imported: a pair that cannot work is one line

    accept_legacy_local_rank(local_rank)  # torch.distributed.launch puts it before the command


@cli.command(context_settings={"ignore_unknown_options": False})
@click.option(
    "--recipe",
    "-r",
    "recipes",
    multiple=True,
    metavar="NAME|PATH",
    help="YAML recipe; options override it. Repeat it to train several students at once.",
)
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override any config key (repeatable).")
@click.option(
    "--loss-arg", "loss_arg", multiple=True, metavar="KEY=VALUE", help="A KD method hyper-parameter (repeatable)."
)
@train_options
@click.option(
    "--resume",
    is_flag=False,
    flag_value="last",
    default=None,
    metavar="[PATH]",
    help=(
        "Continue from OUT/checkpoints/last.pt, or from PATH, with the config the run trained with. "
        "--epochs (to extend it), --data (moved) and the machine's options (devices, backend, processes, "
        "precision, compilation, loader workers, logging and saving) may change; any other option must "
        "repeat the run's value, and another is refused."
    ),
)
@click.option("--overwrite", is_flag=True, help="Replace a run already in --out.")
@click.option("--local_rank", "--local-rank", "local_rank", type=int, default=None, hidden=True)
@TIMED_AFTER
# the former label weight of --kd-loss kd (ce_weight = alpha, kd_weight = 1 - alpha), with a deprecation line
@click.option("--alpha", "alpha", type=float, default=None, hidden=True)
@click.pass_context
def train(ctx, recipes, sets, loss_arg, resume, overwrite, local_rank, timed_after, **options):
    """Distil a student from a teacher (or train one model with --no-teacher).

    Several students at once, from one input pipeline and one teacher forward per batch:
    --kd-loss kd,dkd,dist,lskd or --recipe A --recipe B; each gets OUT/<method or recipe>/.
    """
    from kd import config as kd_config
    from kd.run.jobs import TrainJob
    from kd.run.launch import accept_legacy_local_rank
    from kd.run.launch import train as run_training
    from kd.run.students import for_command

    accept_legacy_local_rank(local_rank)
    given = {
        k: v
        for k, v in options.items()
        if v is not None and ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if loss_arg:
        given["loss_args"] = kd_config.parse_set([f"loss_args.{item}" for item in loss_arg])["loss_args"]
    kd_config.refuse_unused(given)
    students = for_command(recipes, given, sets, resume, overwrite)
    job = TrainJob(students, timed_after)
    job.check_early(overwrite)  # a mistaken path is answered before torch is imported
    own("backends")  # which the run imports: another package's is one line here
    started = time.time()
    if run_training(job, overwrite=overwrite) is not None:
        _summary([Path(c.out) for c in students.cfgs], started, students.names if students.grouped else ())


def _summary(runs, started: float, names=()) -> None:
    """One line per run on stdout, from the main process only."""
    from kd.commands.report import summary_line
    from kd.runfolder import RunFolder
    from kd.utils.placement import Placement

    if Placement.from_environment(None).rank == 0:
        for i, run in enumerate(runs):
            if RunFolder(run).is_run():
                click.echo(summary_line(run, time.time() - started, names[i] if names else ""))


@cli.command("teach")
@click.option("--recipe", "-r", "recipe", default=None, metavar="NAME|PATH", help="YAML recipe; options override it.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Override any config key (repeatable).")
@train_options
@click.option(
    "--top-k",
    "top_k",
    default="10",
    show_default=True,
    metavar="K|all",
    help="Logits kept per sample: the K largest (FKD's marginal smoothing spreads the rest) or all.",
)
@click.option(
    "--logits-dtype", type=click.Choice(SOFT_LABEL_DTYPES), default="auto", show_default=True,
    help="How the logits are stored: auto is float16 where the teacher's logits are small enough (largest "
    "|logit| at most 256 on its probe batches), else float32 (float32 with --top-k all: replay equals the live "
    "teacher bit for bit).",
)  # fmt: skip
@TIMED_AFTER
@click.pass_context
def teach(ctx, recipe, sets, top_k, logits_dtype, timed_after, **options):
    """Run the teacher once on kd train's crops and store its logits (--out STORE), for any number
    of students to train from with kd train --soft-labels STORE, without the teacher.

    Give the options the students will train with (the data, --image-size, --seed, --epochs, or
    their --recipe): the crops depend on them. Run it again to continue a stopped store or to
    extend it to more --epochs.
    """
    from kd import config as kd_config
    from kd.run.jobs import TeachJob
    from kd.run.launch import train as run_training

    given = {
        k: v
        for k, v in options.items()
        if v is not None and ctx.get_parameter_source(k) in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT)
    }
    if "out" not in given:
        raise KDError("kd teach needs --out STORE: the folder the teacher's outputs go to")
    if top_k != "all" and not (top_k.isdigit() and int(top_k) >= 1):
        raise KDError(f"--top-k must be a positive number or all, got {top_k!r}")
    given.update(soft_label_k=None if top_k == "all" else int(top_k))
    if ctx.get_parameter_source("logits_dtype") == ParameterSource.COMMANDLINE:  # else the recipe's, or auto
        given["soft_label_dtype"] = logits_dtype
    cfg = kd_config.resolve(recipe=recipe, options=given, sets=list(sets), teaching=True)
    job = TeachJob(cfg, timed_after)
    job.check_early(overwrite=False)  # a mistaken path is answered before torch is imported
    own("backends")  # which the run imports: another package's is one line here
    run_training(job)


@cli.command("eval")
@click.option(
    "--model",
    default=None,
    metavar="NAME",
    help="torchvision model name or timm:NAME[.TAG] [a kd checkpoint's own; required for other weights].",
)
@click.option("--weights", required=True, metavar="PATH|pretrained", help="Weights file (kd checkpoints too).")
@click.option("--data", required=True, metavar="DIR", help="Folder with a val/ ImageFolder.")
@click.option("--batch-size", "-b", type=int, default=256, show_default=True)
@click.option(
    "--image-size",
    type=int,
    default=None,
    help="Val crop size [a kd checkpoint's run's, else the weights' published one, else 224].",
)
@click.option(
    "--val-resize",
    type=int,
    default=None,
    help=(
        "Short-side resize before the crop [the run's at its image size, else the weights' published one, "
        "else image-size * 256/224]."
    ),
)
@click.option("--workers", "-j", type=int, default=None, help="DataLoader worker processes [CPU cores less one].")
@click.option("--num-classes", type=int, default=None, help="[a kd checkpoint's, else the class folders of val/]")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
def eval_cmd(model, weights, data, batch_size, image_size, val_resize, workers, num_classes, device):
    """Top-1/top-5 of a model on DATA/val; a kd checkpoint evaluates with its run's settings."""
    from kd.commands.evaluate import evaluate_model

    r = evaluate_model(
        model, weights, data, batch_size, device, image_size, workers, num_classes, val_resize=val_resize
    )
    click.echo(f"settings: {r['settings']}")
    for path in r["unreadable_files"]:
        click.echo(f"unreadable val image {path}", err=True)
    click.echo(r["line"])


@cli.command("prepare")
@click.argument("src", metavar="SRC")
@click.argument("dst", metavar="DST")
@click.option(
    "--format",
    "fmt",
    type=LazyChoice(_copy_formats),
    default="raw",
    show_default=True,
    help="Training images as raw RGB pixels (nothing to decode) or re-encoded baseline JPEGs (smaller).",
)
@click.option("--max-side", type=int, default=256, show_default=True, help="Training images' longer side at most.")
@click.option("--quality", type=int, default=90, show_default=True, help="--format jpeg: the JPEG quality.")
@click.option("--workers", "-j", type=int, default=None, help="Processes [the CPU cores].")
@click.option("--overwrite", is_flag=True, help="Write DST anew (a copy of another source or settings, or damaged).")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def prepare_cmd(src, dst, fmt, max_side, quality, workers, overwrite, no_progress):
    """Write a copy of the ImageNet-layout folder SRC to DST that the loaders read faster: training
    images reduced once (longer side capped) into a few large shard files, validation images as they
    are. Resumable: run it again to finish. Train with kd train --data DST."""
    from kd.data.prepared_writer import Settings, prepare

    prepare(
        src,
        dst,
        Settings(format=fmt, max_side=max_side, quality=quality),
        workers=workers,
        overwrite=overwrite,
        echo=click.echo,
        progress=not no_progress,
    )


@cli.command("export")
@click.argument("run", type=click.Path(path_type=Path))
@click.option(
    "--out", "-o", required=True, type=click.Path(path_type=Path), help="weights.pt, .pth or .safetensors to write."
)
@click.option("--ema", is_flag=True, help="The moving average of its weights (a run trained with --model-ema).")
def export_cmd(run, out, ema):
    """A run's student (RUN: a run folder, its best.pt, or a kd checkpoint) as a plain state dict,
    with its model name, classes and preprocessing in OUT's .json beside it."""
    from kd.commands.export import describe, export

    click.echo(describe(export(run, out, ema), out))


@cli.command("verify")
@click.argument("path", type=click.Path(path_type=Path))
def verify_cmd(path):
    """Check PATH against the checksums kd wrote: a checkpoint, a run folder (each checkpoint), a
    prepared copy (every shard) or a soft-label store. One line per file; exit 2 if any is damaged."""
    from kd.commands.verify import verify

    click.echo(verify(path, click.echo))


@cli.command()
@click.option("--out", "-o", default="runs/demo", show_default=True, metavar="DIR", help="Where the demo runs go.")
@click.option(
    "--epochs",
    type=int,
    default=None,
    help=f"Epochs of every run [teacher {kd_demo.TEACHER_EPOCHS}, students {kd_demo.STUDENT_EPOCHS}].",
)
@click.option("--overwrite", is_flag=True, help="Start over, replacing what --out holds.")
def demo(out, epochs, overwrite):
    """A real KD experiment on scikit-learn's bundled digits, offline, on the CPU.

    Stopped (Ctrl-C), it continues where it stopped when run again with the same options.
    """
    from kd.commands.demo import run_demo

    run_demo(Path(out), epochs=epochs, overwrite=overwrite)


@cli.group()
def recipes():
    """The YAML recipes shipped with kd (recipes/)."""


@recipes.command("list")
def recipes_list():
    """All recipes with the paper's setting and reported top-1."""
    from kd.commands.recipes import table

    click.echo(table())


@recipes.command("show")
@click.argument("name")
def recipes_show(name):
    """Print one recipe (use it with kd train --recipe NAME)."""
    from kd.commands.recipes import show

    click.echo(show(name), nl=False)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--csv", "csv_path", type=click.Path(path_type=Path), help="Also write the table as CSV.")
@click.option(
    "--plot",
    "plot_path",
    type=click.Path(path_type=Path),
    metavar="FILE.png",
    help="Also draw val top-1 (paper references dashed) and train loss per epoch (needs matplotlib).",
)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["runs", *paper_table.FORMATS]),
    default="runs",
    show_default=True,
    help="runs: one row per run with every column; markdown, latex or csv: the paper's table of each teacher "
    "and student pair (teacher, student alone, each method: top-1, top-5, paper top-1, difference).",
)
@click.option(
    "--epoch",
    type=click.Choice(paper_table.EPOCHS),
    default="both",
    show_default=True,
    help="The paper's table: the best epoch's top-1/top-5 (chosen on the validation set; what the papers "
    "report), the last epoch's, or both side by side.",
)
@click.option(
    "--provenance",
    is_flag=True,
    help="Also print what each run was made of (its provenance.json): each side's weights as resolved, with "
    "their SHA-256, the versions of torch, torchvision, timm and apex, kd's version and commit, devices, processes.",
)
def report(runs, csv_path, plot_path, fmt, epoch, provenance):
    """Several runs' results as one table: best/last top-1/top-5, reference, difference, times.

    RUNS are run folders or folders of runs (kd report runs/demo); what is not a run is skipped with a note.
    wall_time: from the kd command's start to the run's end, every resumed part added (start-up and
    validation included); train_time: the epochs' training seconds only. A run of an older kd has no
    wall_time (-).
    """
    from kd.commands.report import markdown, plot, provenance_table, to_csv
    from kd.commands.report import report as collect

    note = lambda line: click.echo(f"kd report: {line}", err=True)  # noqa: E731
    notes: list = []
    rows = collect(runs, note=notes.append)
    if fmt != "runs":  # before the notes: a table that cannot be printed is one line
        paper_table.check(rows)
    for line in notes:
        note(line)
    if fmt == "runs":
        click.echo(markdown(rows))
    else:
        write = {"markdown": paper_table.markdown, "latex": paper_table.latex, "csv": paper_table.to_csv}[fmt]
        click.echo(write(rows, note, epoch), nl=fmt != "csv")
    if provenance:
        click.echo("\n" + provenance_table(rows, note))
    if csv_path:
        with writing(csv_path):
            csv_path.write_text(to_csv(rows), encoding="utf-8")
    if plot_path:  # the table is out first: a missing matplotlib costs only the figure
        click.echo(f"figure: {plot(runs, plot_path)}")


@cli.group(invoke_without_command=True)
@click.option("--teacher", default="resnet101", show_default=True)
@click.option("--student", default="resnet18", show_default=True)
@click.option("--backends", "backend_list", default="single", show_default=True, help="Comma-separated backends.")
@click.option("--opt", "opt_list", default="O0,O1", show_default=True, help="Comma-separated opt levels.")
@click.option("--gpus", default=None, metavar="0,1,3")
@click.option("--nproc", type=int, default=None, help="Processes per combination on the CPU.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--batch-size", "-b", type=int, default=256, show_default=True, help="Global batch.")
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option("--iters", type=int, default=100, show_default=True, help="Timed iterations.")
@click.option("--warmup", type=int, default=20, show_default=True, help="Untimed iterations first.")
@click.option("--data", default="synthetic", show_default=True, metavar="DIR|synthetic")
@click.option("--workers", "-j", type=int, default=None)
@click.option("--amp-dtype", type=click.Choice(AMP_DTYPES), default=None)
@click.option("--compile/--no-compile", default=False, show_default=True)
@click.option(
    "--loader",
    type=LazyChoice(loader_choices, check_loader),
    default=None,
    help="With --data DIR, as kd train's [auto: gpu where CUDA and a GPU JPEG decoder work].",
)
@click.option(
    "--vs-synthetic",
    is_flag=True,
    help="With --data DIR: also time each combination on synthetic tensors; adds that img/s and the folder "
    "run's img/s as a % of it.",
)
@click.option(
    "--methods",
    default=None,
    metavar="kd,dkd,..",
    help="Time these KD methods trained together (one teacher forward) against each alone.",
)
@click.option(
    "--vs-store",
    is_flag=True,
    help="Per combination, time the student with the live teacher, kd teach's store of the teacher's outputs, "
    "the student from that store and the student alone (--no-teacher), on the same input.",
)
@click.option(
    "--top-k", "top_k", default="10", show_default=True, metavar="K|all",
    help="With --vs-store: the logits its store keeps per sample (as kd teach --top-k).",
)  # fmt: skip
@click.option(
    "--set", "sets", multiple=True, metavar="KEY=VALUE",
    help="Passed to every combination's kd train (and kd teach, with --vs-store).",
)  # fmt: skip
@click.option("--out", "-o", type=click.Path(path_type=Path), default=Path("runs/bench"), show_default=True)
@click.option("--keep-runs", is_flag=True, help="Keep each combination's run folder (OUT/runs/) after the table.")
@click.option(
    "--timeout",
    type=float,
    default=1800,
    show_default=True,
    help="Seconds per run (a combination, or its synthetic run).",
)
@click.pass_context
def bench(
    ctx,
    teacher,
    student,
    backend_list,
    opt_list,
    gpus,
    nproc,
    device,
    batch_size,
    image_size,
    iters,
    warmup,
    data,
    workers,
    amp_dtype,
    compile,
    loader,
    vs_synthetic,
    methods,
    vs_store,
    top_k,
    sets,
    out,
    keep_runs,
    timeout,
):
    """Compare backends x opt levels on this machine: s/20 iters, img/s, peak memory per GPU.

    'kd bench data --data DIR' measures the input pipeline alone.
    """
    if ctx.invoked_subcommand:
        return
    from kd.commands.bench import bench as run_bench
    from kd.commands.bench import markdown

    if not vs_store and ctx.get_parameter_source("top_k") == ParameterSource.COMMANDLINE:
        raise KDError("--top-k sets the store of --vs-store; give --vs-store too, or leave --top-k out")

    args = dict(
        teacher=teacher,
        student=student,
        gpus=gpus,
        nproc=nproc,
        device=device,
        batch_size=batch_size,
        image_size=image_size,
        iters=iters,
        warmup=warmup,
        data=data,
        workers=workers,
        amp_dtype=amp_dtype,
        compile=compile,
        loader=loader,
        vs_synthetic=vs_synthetic,
        sets=list(sets),
        methods=[m.strip() for m in (methods or "").split(",") if m.strip()],
        keep_runs=keep_runs,
        vs_store=vs_store,
        top_k=top_k,
    )
    from kd import config as kd_config

    for key, value in kd_config.parse_set(list(sets)).items():  # a bad --set fails here, not in every row
        kd_config.coerce(key, value)
    rows = run_bench(
        [b for b in backend_list.split(",") if b], [o for o in opt_list.split(",") if o], args, out, timeout
    )
    click.echo(markdown(rows))
    png = ", bench.png" if (out / "bench.png").exists() else " (no bench.png)"
    click.echo(f"\n{out}/bench.csv, bench.json, bench.md{png}")


@bench.command("data")
@click.option("--data", required=True, metavar="DIR", help="ImageNet-layout folder.")
@click.option("--split", type=click.Choice(["train", "val"]), default="train", show_default=True, help="Which split.")
@click.option(
    "--loader", type=LazyChoice(loader_choices, check_loader), default="auto", show_default=True, help="As kd train's."
)
@click.option("--cpu-decode-share", type=float, default=None, help="--loader gpu: as kd train's [from the workers].")
@click.option("--val-cache-gb", type=float, default=None, help="--split val: as kd train's [an eighth of memory].")
@click.option("--workers", "-j", type=int, default=None, help="DataLoader workers [CPU cores less one].")
@click.option("--batch-size", "-b", type=int, default=256, show_default=True)
@click.option("--image-size", type=int, default=224, show_default=True)
@click.option(
    "--epochs", type=int, default=2, show_default=True, help="Passes over the split (the first starts the workers)."
)
@click.option("--limit-batches", type=int, default=None, help="At most this many batches per epoch.")
@click.option("--device", type=click.Choice(DEVICES), default="auto", show_default=True)
@click.option("--mp-context", type=click.Choice(MP_CONTEXTS), default=None)
def bench_data_cmd(
    data,
    split,
    loader,
    cpu_decode_share,
    val_cache_gb,
    workers,
    batch_size,
    image_size,
    epochs,
    limit_batches,
    device,
    mp_context,
):
    """Images/s of the input pipeline alone (decode, crop, flip, normalise, to the device)."""
    from kd.commands.bench import bench_data

    bench_data(
        dict(
            data=data,
            loader=loader,
            cpu_decode_share=cpu_decode_share,
            val_cache_gb=val_cache_gb,
            workers=workers,
            batch_size=batch_size,
            image_size=image_size,
            limit_train_batches=limit_batches,
            limit_val_batches=limit_batches,
            device=device,
            mp_context=mp_context,
        ),
        epochs,
        click.echo,
        split,
    )


@cli.command("losses")
def losses_cmd():
    """The registered KD methods and their hyper-parameters (every one has ce_weight and label_smoothing)."""
    import textwrap

    from kd.losses import LOSSES

    width = 8 + max(len(name) for name in LOSSES.names()) // 8 * 8  # the names' column
    for name in LOSSES.names():
        cls = LOSSES.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0].replace("``", "") if cls.__doc__ else ""
        params = "  ".join(f"{k}={v}" for k, v in cls.defaults.items()) or "-"
        for text in (f"{name:<{width}}{doc}", " " * width + params):
            click.echo(textwrap.fill(text, 88, subsequent_indent=" " * width))


@cli.command("backends")
def backends_cmd():
    """The parallel backends, whether each can run here, and why not."""
    from kd.commands.table import aligned

    backends = own("backends")

    click.echo(aligned([(name, "yes" if ok else "no", note) for name, ok, note in backends.report()]))


#: The commands that run a run: a stop signal before it starts is one line (kd.utils.signals.install_first).
RUN_COMMANDS = ("train", "teach", "demo")


def _command_name(args) -> str:
    """The command ``args`` names (its first word that is not a group option or its value)."""
    words = iter(args)
    for word in words:
        if word in ("--local_rank", "--local-rank"):
            next(words, None)
        elif not word.startswith("-"):
            return word
    return ""


def main(argv=None) -> int:
    """Entry point of the ``kd`` console script: one line and exit code 2 for any user error."""
    from kd.utils.signals import Interrupted, install_first, run_ended

    args = sys.argv[1:] if argv is None else list(argv)
    # first, before torch and the rest are imported: a stop signal from here on is one line
    restore_signals = install_first() if _command_name(args) in RUN_COMMANDS else None
    from kd.run.log import START_ENV, mark_command_start

    mark_command_start()  # processes that kd launches inherit it
    code = 0
    try:
        try:
            cli.main(args=args, prog_name="kd", standalone_mode=False)
        finally:
            run_ended()  # from here a stop is noted, not raised into the lines below
    except Interrupted as exc:
        click.echo(f"kd: {exc}", err=True)
        code = 143 if exc.signame == "SIGTERM" else 130
    except KDError as exc:
        click.echo(f"kd: error: {exc}", err=True)
        code = getattr(exc, "exit_code", 2)  # a killed rank's tells the kill (kd.run.launch.RankFailed)
    except click.UsageError as exc:
        if type(exc).__name__.startswith("NoArgsIsHelp"):  # 'kd' or 'kd train' alone: show the help
            click.echo(exc.ctx.get_help() if exc.ctx else str(exc))
            code = 2
        else:
            hint = f" (see 'kd {exc.ctx.info_name} --help')" if exc.ctx and exc.ctx.info_name != "kd" else ""
            click.echo(f"kd: error: {exc.format_message()}{hint}", err=True)
            code = 2
    except click.exceptions.Exit as exc:
        code = exc.exit_code
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("kd: interrupted", err=True)
        code = 130
    except OSError as exc:
        if exc.errno not in WRITE_ONLY_ERRNOS:
            raise
        click.echo(f"kd: error: {cannot_write(exc)}", err=True)
        code = 2
    finally:
        os.environ.pop(START_ENV, None)
        noted = restore_signals() if restore_signals is not None else ""
    if noted and code == 0:  # a stop as the run ended: what it wrote is complete
        click.echo(f"kd: stopped by {noted} as the run ended; the run is complete", err=True)
        code = 143 if noted == "SIGTERM" else 130
    return code


EXIT_GRACE_S = 30.0


def run() -> None:
    """The console script: :func:`main`, then an exit that cannot hang.

    kd stops its own workers and threads before ``main`` returns; should anything else (a
    library's thread, a child process) keep the interpreter from exiting, a watchdog ends the
    process with ``main``'s exit code after EXIT_GRACE_S seconds and names what was left.
    """
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()

    def force_exit():
        left = [t.name for t in threading.enumerate() if t is not threading.current_thread() and t.is_alive()]
        sys.stderr.write(
            f"kd: exiting after {EXIT_GRACE_S:.0f} s of shutdown; still running: {', '.join(left) or '-'}\n"
        )
        sys.stderr.flush()
        os._exit(code)

    timer = threading.Timer(EXIT_GRACE_S, force_exit)
    timer.daemon = True
    timer.start()
    sys.exit(code)


if __name__ == "__main__":
    run()
