"""The command line (cli.py): its help says the real defaults, and kd losses fits a terminal."""

from __future__ import annotations

from click.testing import CliRunner


def _help(*args) -> str:
    from cli import cli

    r = CliRunner().invoke(cli, [*args, "--help"])
    assert r.exit_code == 0, r.output
    return " ".join(r.output.split())


def test_workers_help_says_the_real_default():
    assert "[CPU cores per process less one]" in _help("train")
    assert "[8]" not in _help("train").split("--workers")[1][:80]
    assert "[CPU cores less one]" in _help("eval")


def test_losses_fit_a_terminal():
    """Each method: its name and formula on one line, its defaults indented below, no line over 88
    columns."""
    from cli import cli
    from kd.losses import LOSSES

    r = CliRunner().invoke(cli, ["losses"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert max(len(line) for line in lines) <= 88, max(lines, key=len)
    words = " ".join(r.output.split())  # the wrapped lines joined again
    for name in LOSSES.names():
        cls = LOSSES.get(name)
        doc = (cls.__doc__ or "").strip().splitlines()[0].replace("``", "")
        params = " ".join(f"{k}={v}" for k, v in cls.defaults.items())
        assert f"{name} {doc} {params}" in words, (name, r.output)
    assert [line.split()[0] for line in lines if not line.startswith(" ")] == LOSSES.names()
