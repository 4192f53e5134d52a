"""Named weights offline (kd.utils.weights): not in the cache and no network, one ``kd: error:``
line at once, saying which file to place where, without a download's attempts (torch hub's
``Downloading:``, Hugging Face's retries); in the cache, read from it without asking the hub.
Nothing here touches the network: the probe goes to a closed local port, or HF_HUB_OFFLINE is set."""

from __future__ import annotations

import hashlib

import pytest
import timm
import timm.models._hub as timm_hub
import torch
import torch.hub
import torchvision.models as tvm
from conftest import kd_main, train_args

from kd import models
from kd.errors import KDError
from kd.utils import weights

#: a port nothing listens on: a connection there is refused at once
CLOSED = ("127.0.0.1", 9)


@pytest.fixture
def downloads(monkeypatch, tmp_path):
    """Empty torch and Hugging Face caches in ``tmp_path``, every download host the closed port, and
    each download function of torch hub, torchvision and Hugging Face recording its calls (and failing)."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HTTPS_PROXY", "https_proxy"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(weights, "host_of", lambda url: CLOSED)
    calls = []

    def download(*args, **kwargs):
        calls.append(args)
        raise OSError("a download was tried")

    monkeypatch.setattr(torch.hub, "load_state_dict_from_url", download)
    monkeypatch.setattr(torch.hub, "download_url_to_file", download)
    monkeypatch.setattr(timm_hub, "hf_hub_download", download)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    return calls


def test_a_torchvision_weight_offline_is_one_line_without_a_download(downloads, tmp_path):
    with pytest.raises(KDError) as err:
        models.build("resnet50", 1000, "pretrained")
    assert downloads == []
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    assert str(err.value) == (
        "torchvision weights ResNet50_Weights.IMAGENET1K_V2 are not in the cache and 127.0.0.1:9 cannot be "
        "reached (no network): place resnet50-11ad3fa6.pth (from https://download.pytorch.org/models/"
        f"resnet50-11ad3fa6.pth) in {folder}"
    )


@pytest.mark.parametrize("offline_by", ["probe", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"])
def test_a_timm_weight_offline_is_one_line_without_the_hubs_retries(downloads, tmp_path, monkeypatch, offline_by):
    if offline_by != "probe":
        monkeypatch.setenv(offline_by, "1")
    with pytest.raises(KDError) as err:
        models.build("timm:resnet50", 1000, "pretrained")
    assert downloads == []
    why = "127.0.0.1:9 cannot be reached (no network)" if offline_by == "probe" else f"{offline_by} is set"
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith(f"timm weights resnet50.a1_in1k are not in the cache and {why}: "), message
    assert str(tmp_path / "hf" / "hub" / "models--timm--resnet50.a1_in1k") in message
    assert "https://huggingface.co/timm/resnet50.a1_in1k" in message


def test_kd_train_offline_ends_with_one_error_line(downloads, image_folder, tmp_path):
    r = kd_main(*train_args(image_folder, tmp_path / "run", teacher="resnet50", teacher_weights="pretrained"))
    assert r.returncode == 2
    assert "Downloading" not in r.stderr and downloads == []
    assert r.stderr.strip().splitlines() == [
        "kd: error: torchvision weights ResNet50_Weights.IMAGENET1K_V2 are not in the cache and 127.0.0.1:9 "
        "cannot be reached (no network): place resnet50-11ad3fa6.pth (from https://download.pytorch.org/models/"
        f"resnet50-11ad3fa6.pth) in {tmp_path / 'torch' / 'hub' / 'checkpoints'}"
    ], r.stderr


def place_timm_weights(hf_home, arch: str, tag: str, revision: str = "0123abcd" * 5):
    """A generated weight file of timm ``arch`` (its real keys, seeded values) where the Hugging Face
    cache keeps ``timm/arch.tag``'s model.safetensors: (its path, its state)."""
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = timm.create_model(arch, pretrained=False).state_dict()
    repo = hf_home / "hub" / f"models--timm--{arch}.{tag}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(revision)
    path = repo / "snapshots" / revision / "model.safetensors"
    path.parent.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    return path, state


def test_cached_timm_weights_are_read_without_asking_the_hub(downloads, tmp_path):
    path, state = place_timm_weights(tmp_path / "hf", "resnet10t", "c3_in1k")
    found = models.named_weights("timm:resnet10t", "pretrained")
    assert (found.name, found.cached) == ("resnet10t.c3_in1k", path)
    model = models.build("timm:resnet10t", 1000, "pretrained")
    assert downloads == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in state.items())
    assert hashlib.sha256(path.read_bytes()).hexdigest()  # a real file, as provenance hashes it


def test_cached_torchvision_weights_need_no_probe(downloads, tmp_path, monkeypatch):
    monkeypatch.setattr(weights, "reachable", lambda host: pytest.fail("probed although cached"))
    member = tvm.ResNet18_Weights.IMAGENET1K_V1
    folder = tmp_path / "torch" / "hub" / "checkpoints"
    folder.mkdir(parents=True)
    torch.save(tvm.resnet18().state_dict(), folder / "resnet18-f37072fd.pth")
    assert models.named_weights("resnet18", "torchvision:IMAGENET1K_V1").cached == folder / "resnet18-f37072fd.pth"
    models.build("resnet18", 1000, "torchvision:IMAGENET1K_V1")
    assert downloads == [] and member.url.endswith("resnet18-f37072fd.pth")


def test_a_proxy_is_what_the_probe_asks(monkeypatch):
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.example:3128")
    assert weights.host_of("https://download.pytorch.org/models/x.pth") == ("proxy.example", 3128)
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.delenv("https_proxy", raising=False)
    monkeypatch.delenv("ALL_PROXY", raising=False)
    monkeypatch.delenv("all_proxy", raising=False)
    assert weights.host_of("https://download.pytorch.org/models/x.pth") == ("download.pytorch.org", 443)
    assert not weights.reachable(CLOSED)


def test_an_unknown_timm_tag_lists_the_tags(downloads):
    with pytest.raises(KDError, match=r"^timm publishes no weights resnet10t\.nope; its tags: c3_in1k$"):
        models.build("timm:resnet10t", 1000, "timm:nope")
    assert downloads == []
