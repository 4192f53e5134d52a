"""Where a library's named weights are kept on this machine (torch's hub cache, the Hugging Face
cache), whether they are there, and, where they are not, whether they can be fetched: offline, one
line at once saying which file to place where, not a download's retries."""

from __future__ import annotations

import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Tuple
from urllib.parse import urlsplit

from kd.errors import KDError

#: the files a timm model's Hugging Face repository may hold, in the order timm tries them
HF_FILES = ("model.safetensors", "pytorch_model.bin", "open_clip_model.safetensors", "open_clip_pytorch_model.bin")
#: seconds a probe of a download host may take (its name's look-up included)
PROBE_SECONDS = 1.5


@dataclass(frozen=True)
class NamedWeights:
    """One library's published weights: ``library`` (torchvision, timm), ``name`` (the enum member
    ``ResNet50_Weights.IMAGENET1K_V1``, the timm tag ``resnet50.a1_in1k``), ``source`` (a URL, or
    ``hf-hub:REPO``) and ``where`` (the file once fetched, or for Hugging Face the repository's
    folder in the cache); ``cached`` is the file where it is on this machine."""

    library: str
    name: str
    source: str
    where: Path
    cached: Optional[Path]
    host: Tuple[str, int]

    def ensure_fetchable(self) -> None:
        """Nothing where the weights are cached or their host answers; else a KDError at once."""
        if self.cached is not None:
            return
        why = offline_reason(self.host, hugging_face=self.source.startswith("hf-hub:"))
        if why is None:
            return
        if self.source.startswith("hf-hub:"):
            repo = self.source[len("hf-hub:") :]
            how = (
                f"fetch them once where there is a network (python -c \"import timm; timm.create_model('{self.name}', "
                f'pretrained=True)") and copy {self.where} here, or download {HF_FILES[0]} from '
                f"https://huggingface.co/{repo} and pass it with --teacher-weights PATH"
            )
        else:
            how = f"place {self.where.name} (from {self.source}) in {self.where.parent}"
        raise KDError(f"{self.library} weights {self.name} are not in the cache and {why}: {how}")


def torchvision_weights(member) -> NamedWeights:
    """Where torchvision's ``Weights`` enum ``member`` is kept: torch's hub cache, ``checkpoints/``."""
    from torch.hub import get_dir

    path = Path(get_dir()) / "checkpoints" / Path(urlsplit(member.url).path).name
    return NamedWeights(
        "torchvision",
        f"{type(member).__name__}.{member.name}",
        member.url,
        path,
        path if path.is_file() else None,
        host_of(member.url),
    )


def timm_weights(arch: str) -> NamedWeights:
    """Where timm keeps the pretrained weights of ``arch`` (``name`` or ``name.tag``; ``name`` is
    timm's default tag, which a timm release may change: the tag is resolved here): the Hugging Face
    cache, or torch's hub cache for weights timm fetches by URL."""
    import timm
    from timm.models import get_pretrained_cfg

    try:
        cfg = get_pretrained_cfg(arch)
    except RuntimeError:  # an unknown tag
        cfg = None
    if cfg is None:
        name = arch.split(".")[0]
        tags = [n.split(".", 1)[1] for n in timm.list_pretrained(f"{name}.*")]
        choose = f"; its tags: {', '.join(tags[:12])}{' ...' if len(tags) > 12 else ''}" if tags else ""
        raise KDError(f"timm publishes no weights {arch}{choose}")
    tagged = f"{arch.split('.')[0]}.{cfg.tag}" if cfg.tag else arch
    if cfg.hf_hub_id:
        repo, _, revision = cfg.hf_hub_id.partition("@")
        folder = hf_cache() / f"models--{repo.replace('/', '--')}"
        names = (cfg.hf_hub_filename,) if cfg.hf_hub_filename else HF_FILES
        cached = next((p for p in (hf_cached(repo, n, revision or None) for n in names) if p is not None), None)
        return NamedWeights("timm", tagged, f"hf-hub:{cfg.hf_hub_id}", folder, cached, host_of(hf_endpoint()))
    url = cfg.url if isinstance(cfg.url, str) or not cfg.url else cfg.url[0]
    if not url:
        raise KDError(f"timm names no file for the weights {tagged}")
    from torch.hub import get_dir

    path = Path(get_dir()) / "checkpoints" / Path(urlsplit(url).path).name
    return NamedWeights("timm", tagged, url, path, path if path.is_file() else None, host_of(url))


def hf_cache() -> Path:
    """The Hugging Face hub cache, as huggingface_hub finds it (HF_HUB_CACHE, HF_HOME, XDG_CACHE_HOME)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hf_cached(repo: str, filename: str, revision: Optional[str]) -> Optional[Path]:
    """The cached file ``filename`` of Hugging Face model ``repo`` (its ``main`` or ``revision``), or None."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(repo, filename, cache_dir=hf_cache(), revision=revision)
    return Path(found) if isinstance(found, str) and os.path.isfile(found) else None


def hf_endpoint() -> str:
    return os.environ.get("HF_ENDPOINT") or "https://huggingface.co"


def host_of(url: str) -> Tuple[str, int]:
    """(host, port) a download from ``url`` connects to first: the proxy where one is set."""
    parts = urlsplit(url)
    proxy = os.environ.get(f"{parts.scheme}_proxy") or os.environ.get(f"{parts.scheme.upper()}_PROXY")
    proxy = proxy or os.environ.get("all_proxy") or os.environ.get("ALL_PROXY")
    if proxy:
        parts = urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def hf_offline_set() -> Optional[str]:
    """The variable that puts Hugging Face offline (HF_HUB_OFFLINE, TRANSFORMERS_OFFLINE), or None."""
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
        if os.environ.get(name, "").strip().upper() in ("1", "ON", "YES", "TRUE"):
            return name
    return None


def offline_reason(host: Tuple[str, int], hugging_face: bool = False) -> Optional[str]:
    """Why the weights cannot be fetched from ``host``: a Hugging Face offline variable is set (for
    Hugging Face's weights), or ``host`` does not answer within :data:`PROBE_SECONDS`; None where it does."""
    if hugging_face and hf_offline_set():
        return f"{hf_offline_set()} is set"
    if not reachable(host):
        return f"{host[0]}:{host[1]} cannot be reached (no network)"
    return None


def reachable(host: Tuple[str, int], seconds: float = PROBE_SECONDS) -> bool:
    """Whether a TCP connection to ``host`` opens within ``seconds`` (the name's look-up too, which a
    socket's timeout does not bound: the probe runs in a thread given that long)."""
    answer = []

    def probe() -> None:
        try:
            socket.create_connection(host, timeout=seconds).close()
            answer.append(True)
        except OSError:
            pass

    thread = threading.Thread(target=probe, daemon=True)
    thread.start()
    thread.join(seconds)
    return bool(answer)
