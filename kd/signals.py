"""Stops asked for by signals: SIGTERM / SIGINT set a flag the loop checks at step boundaries."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Optional

from kd.runfolder import RunFolder


class Interrupted(Exception):
    """A stop asked for by a signal, after the checkpoint of that exact step was written."""

    def __init__(self, signame: str, step: int = 0, out: Optional[Path] = None, message: Optional[str] = None):
        self.signame = signame
        if not message:
            assert out is not None, "Interrupted needs the run folder or a message"
            message = (
                f"stopped by {signame} at step {step}; checkpoint written to "
                f"{RunFolder(out).last}; continue with: kd train --out {out} --resume"
            )
        super().__init__(message)


class StopFlag:
    """SIGTERM / SIGINT set a flag; the loop stops at the next step boundary it checks."""

    def __init__(self):
        self.requested = False
        self.signame = ""
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested and signum == signal.SIGINT:  # a second Ctrl-C: stop now
            raise KeyboardInterrupt
        self.requested = True
        self.signame = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous = {}
