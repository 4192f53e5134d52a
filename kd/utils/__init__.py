"""What kd's packages share, below all of them: where a process sits among a run's processes
(``placement``), stops asked for by signals (``signals``), top-1/top-5 over a split exact across
processes (``accuracy``), a model's intermediate outputs (``taps``), and kd's tensor files written
atomically with their SHA-256 and read with ``weights_only`` (``checkpoint_io``), state dicts read
from files and kd's run checkpoints read as weights (``weight_files``), the model
names torchvision and timm list, kept per version to answer before torch (``model_names``), and
whether the installed torch and torchvision can work together (``installed``).

May import: the top-level helpers (``kd.errors``, ``kd.checksum``, ``kd.runfolder``, ...); never
kd's packages (``kd.data``, ``kd.models``, ``kd.teacher``, ``backends``, ``kd.run``, ...), which
import it.
"""
