"""--initial-checkpoint: the file's tensors in the model, a new head for another number of classes, each format
(state dict, wrapped keys, .safetensors, a dlojz checkpoint), one line for a file that is not there or weights of
another architecture, and a run that trains from them."""

import os

import pytest
import torch
import torchvision
from conftest import TINY, read_json

from dlojz_lib.checks import UserError
from dlojz_lib.dist import Distribution
from dlojz_lib.model.build import build_model
from dlojz_lib.settings.config import resolve_config
from dlojz_lib.settings.flags import get_args_parser


@pytest.fixture(autouse=True)
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the default --output-dir (./runs/...) is made and checked writable


def model_from(weights, num_classes=3, arch="resnet18", *flags):
    lines = []
    cfg = resolve_config(
        get_args_parser().parse_args(["--device", "cpu", "--arch", arch, "--initial-checkpoint", str(weights), *flags])
    )
    model = build_model(cfg, num_classes, Distribution(1, 0, 0, torch.device("cpu")), lines.append)
    return model.module, lines


def imagenet_resnet18(seed=0):
    torch.manual_seed(seed)
    return torchvision.models.resnet18(num_classes=1000).state_dict()


def test_the_file_s_tensors_are_loaded_and_the_head_is_new_for_the_data_s_classes(tmp_path):
    saved = imagenet_resnet18()
    torch.save(saved, tmp_path / "resnet18.pth")
    module, lines = model_from(tmp_path / "resnet18.pth")
    own = module.state_dict()
    body = [key for key in saved if not key.startswith("fc.")]
    assert all(torch.equal(own[key], saved[key]) for key in body)
    assert own["fc.weight"].shape == (3, 512) and own["fc.bias"].shape == (3,)
    line = next(line for line in lines if line.startswith("initial weights:"))
    assert (
        f"{len(body)} of {len(own)} tensors" in line
        and "new, freshly initialised for 3 classes: fc.bias, fc.weight" in line
    )


def test_the_same_number_of_classes_keeps_the_file_s_head(tmp_path):
    torch.manual_seed(1)
    saved = torchvision.models.resnet18(num_classes=3).state_dict()
    torch.save({"state_dict": {f"module.{key}": value for key, value in saved.items()}}, tmp_path / "ddp.pt")
    module, lines = model_from(tmp_path / "ddp.pt")  # DDP's prefix, under timm's 'state_dict' key
    assert all(torch.equal(module.state_dict()[key], value) for key, value in saved.items())
    assert not any("new" in line for line in lines)


def test_a_safetensors_file_and_a_dlojz_checkpoint_load(tmp_path):
    from safetensors.torch import save_file

    import dlojz_lib.checkpoint as ckpt

    saved = imagenet_resnet18(seed=2)
    save_file(saved, tmp_path / "w.safetensors")
    module, _ = model_from(tmp_path / "w.safetensors")
    assert torch.equal(module.state_dict()["conv1.weight"], saved["conv1.weight"])
    ckpt.write({"model": saved, "epoch": 3}, tmp_path / "ckpt_e0003_s000000030.pt")
    module, lines = model_from(tmp_path / "ckpt_e0003_s000000030.pt")
    assert torch.equal(module.state_dict()["layer4.1.bn2.weight"], saved["layer4.1.bn2.weight"])
    assert any("dlojz checkpoint's model" in line for line in lines)


def test_weights_of_another_architecture_are_one_line_naming_a_key(tmp_path):
    torch.manual_seed(0)
    torch.save(torchvision.models.resnet34(num_classes=3).state_dict(), tmp_path / "resnet34.pth")
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*resnet34\.pth: its tensor layer1\.2\.conv1\.weight"):
        model_from(tmp_path / "resnet34.pth")
    torch.save(torchvision.models.resnet18(num_classes=3).state_dict(), tmp_path / "r18.pth")
    with pytest.raises(UserError, match=r"conv1\.weight is \(64, 3, 7, 7\) there, \(32, 3, 7, 7\) in this model"):
        _narrow(tmp_path / "r18.pth")


def _narrow(weights):
    """A model whose stem is narrower than the file's: a shape mismatch outside the head."""
    from dlojz_lib.model.pretrained import load_initial_weights

    module = torchvision.models.resnet18(num_classes=3)
    module.conv1 = torch.nn.Conv2d(3, 32, 7, 2, 3, bias=False)
    return load_initial_weights(module, weights, 3)


def test_a_missing_or_unreadable_file_is_one_line_before_the_run(tmp_path):
    parser = get_args_parser()
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*gone\.pth: no such file; give a \.pt/\.pth"):
        resolve_config(parser.parse_args(["--device", "cpu", "--initial-checkpoint", str(tmp_path / "gone.pth")]))
    os.mkfifo(tmp_path / "pipe.pth")  # torch.load would wait on it for a writer, for ever
    with pytest.raises(UserError, match=r"^--initial-checkpoint .*pipe\.pth: not a regular file \(a pipe"):
        resolve_config(parser.parse_args(["--device", "cpu", "--initial-checkpoint", str(tmp_path / "pipe.pth")]))
    (tmp_path / "text.pth").write_text("not weights")
    with pytest.raises(
        UserError,
        match=r"^--initial-checkpoint .*text\.pth is not a PyTorch file \(neither a zip archive nor a pickle\)",
    ):
        model_from(tmp_path / "text.pth")
    (tmp_path / "latest").write_text("ckpt_e0001_s000000009.pt\n")  # a run's pointer, not weights
    with pytest.raises(
        UserError, match=r"^--initial-checkpoint: checkpoint .*latest: the pointer to the newest checkpoint"
    ):
        model_from(tmp_path / "latest")


def test_a_run_trains_from_the_weights_of_another_run(tiny_data, tmp_path, run_inline):
    """A model trained on the tiny set's 3 classes, then fine-tuned from its checkpoint: the run says what it loaded
    and counts its own epochs (in this process, at 16 px: the loading is what is tested)."""
    tiny = [*TINY, "--arch", "resnet18", "--data-root", tiny_data, "--epochs", "1"]
    first = tmp_path / "first"
    proc = run_inline(*tiny, "--output-dir", first)
    assert proc.returncode == 0, proc.stderr
    checkpoint = sorted(first.glob("ckpt_e*.pt"))[-1]
    proc = run_inline(
        *tiny, "--lr", "1e-9", "--initial-checkpoint", checkpoint, "--output-dir", tmp_path / "second",
        "--metrics-json", tmp_path / "second.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert f"initial weights: 122 of 122 tensors from {checkpoint} (dlojz checkpoint's model)" in proc.stdout
    assert read_json(tmp_path / "second.json")["epochs"] == 1  # a fresh epoch count, not the first run's


def test_pretrained_reads_torchvision_s_file_from_the_local_hub_cache_only(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    missing = r"--pretrained DEFAULT: .*torch/hub/checkpoints/resnet18-f37072fd\.pth is not in torch hub's cache, .*"
    with pytest.raises(
        UserError, match=missing + r"python dlojz\.py --arch resnet18 --pretrained DEFAULT --fetch-weights"
    ):
        resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", "--pretrained"]))
    cache = tmp_path / "torch" / "hub" / "checkpoints"
    cache.mkdir(parents=True)
    saved = imagenet_resnet18(seed=4)
    torch.save(saved, cache / "resnet18-f37072fd.pth")  # the name torchvision's download gives it
    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", "--pretrained"]))
    model = build_model(cfg, 5, Distribution(1, 0, 0, torch.device("cpu")), lambda line: None)
    assert torch.equal(model.module.state_dict()["layer3.0.conv1.weight"], saved["layer3.0.conv1.weight"])
    assert model.module.fc.out_features == 5


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--pretrained", "IMAGENET1K_V9"], r"--pretrained IMAGENET1K_V9: --arch resnet18's weights are IMAGENET1K_V1"),
        (
            ["--arch", "timm:resnet10t", "--pretrained", "nope"],
            r"--pretrained nope: --arch timm:resnet10t's weights are c3_in1k \(or DEFAULT\)",
        ),
        (["--fetch-weights"], r"--fetch-weights fetches --pretrained's weights: add --pretrained"),
        (
            ["--pretrained", "--initial-checkpoint", "w.pt"],
            r"--pretrained and --initial-checkpoint both give the starting",
        ),
    ],
)
def test_pretrained_refuses_in_one_line(flags, message):
    with pytest.raises(UserError, match=message):
        resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", *flags]))


def test_pretrained_takes_the_weights_sizes_unless_given(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    (tmp_path / "hub" / "checkpoints" / "resnet50-11ad3fa6.pth").touch()  # there: read when the model is made

    def sizes(*flags):
        cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet50", *flags]))
        return cfg.image_size, cfg.val_resize_size, cfg.val_crop_size, cfg.notes

    assert sizes()[:3] == (64, 73, 64)  # the CPU profile without --pretrained
    image, resize, crop, notes = sizes("--pretrained", "IMAGENET1K_V2")  # evaluated at 232 -> 224
    assert (image, resize, crop) == (224, 232, 224)
    assert any(
        note.startswith("--pretrained IMAGENET1K_V2: the weights' preprocessing: --val-resize-size 232")
        for note in notes
    )
    assert sizes("--pretrained", "IMAGENET1K_V2", "--val-resize-size", "240")[:3] == (224, 240, 224)


def hugging_face_cache(root, repo, filename, write):
    """The layout huggingface_hub's download leaves: refs/main names a snapshot whose file links to a blob."""
    folder = root / f"models--{repo.replace('/', '--')}"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    (folder / "blobs").mkdir()
    write(folder / "blobs" / "blob")
    (folder / "snapshots" / commit).mkdir(parents=True)
    (folder / "snapshots" / commit / filename).symlink_to(folder / "blobs" / "blob")
    return folder / "snapshots" / commit / filename


def test_pretrained_reads_timm_s_file_from_hugging_face_s_local_cache_only(tmp_path, monkeypatch):
    import timm
    from safetensors.torch import save_file

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    flags = ["--device", "cpu", "--arch", "timm:resnet10t", "--pretrained"]
    missing = r"--pretrained DEFAULT: timm's timm/resnet10t\.c3_in1k is not in Hugging Face's cache \(.*/hf\)"
    with pytest.raises(UserError, match=missing + r".*--arch timm:resnet10t --pretrained DEFAULT --fetch-weights"):
        resolve_config(get_args_parser().parse_args(flags))
    torch.manual_seed(5)
    saved = timm.create_model("resnet10t", num_classes=1000).state_dict()
    hugging_face_cache(tmp_path / "hf", "timm/resnet10t.c3_in1k", "model.safetensors", lambda p: save_file(saved, p))
    cfg = resolve_config(get_args_parser().parse_args(flags))
    assert (cfg.image_size, cfg.val_resize_size, cfg.val_crop_size) == (176, 201, 176)  # timm's 176 px, crop 0.875
    lines = []
    model = build_model(cfg, 5, Distribution(1, 0, 0, torch.device("cpu")), lines.append)
    own = model.module.state_dict()
    assert all(torch.equal(own[key], value) for key, value in saved.items() if not key.startswith("fc."))
    assert model.module.fc.out_features == 5
    assert any(
        "(safetensors file); new, freshly initialised for 5 classes: fc.bias, fc.weight" in line for line in lines
    )


def test_fetch_weights_keeps_only_a_file_with_the_published_hash(tmp_path, monkeypatch, run_inline):
    """torchvision's: the SHA-256 prefix in the file's name; here the download is served from a local file whose
    bytes are not the published ones, so nothing may be kept."""
    import hashlib
    import urllib.request

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    (tmp_path / "served.pth").write_bytes(b"not resnet18's weights")
    served = (tmp_path / "served.pth").as_uri()
    asked = []
    monkeypatch.setattr(
        torch.hub, "urlopen", lambda request, **kw: asked.append(request.full_url) or urllib.request.urlopen(served)
    )
    proc = run_inline("--arch", "resnet18", "--pretrained", "--fetch-weights")
    assert proc.returncode == 2, proc.stdout
    assert asked == ["https://download.pytorch.org/models/resnet18-f37072fd.pth"]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("dlojz: error: ")]  # (and the progress bar)
    assert len(errors) == 1 and "does not match its published SHA-256" in errors[0] and "Traceback" not in proc.stderr
    assert not list((tmp_path / "torch" / "hub" / "checkpoints").iterdir())  # not even the partial download
    # The same path with the right hash keeps the file.
    from dlojz_lib.model.pretrained import fetch_file

    prefix = hashlib.sha256(b"not resnet18's weights").hexdigest()[:8]
    fetch_file(served, tmp_path / "kept" / f"w-{prefix}.pth", prefix)
    assert (tmp_path / "kept" / f"w-{prefix}.pth").read_bytes() == b"not resnet18's weights"
    # A truncated or damaged file in the cache is not "already there": it is fetched again (and here refused again).
    cached = tmp_path / "torch" / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    cached.write_bytes(b"x")
    asked.clear()
    proc = run_inline("--arch", "resnet18", "--pretrained", "--fetch-weights")
    assert proc.returncode == 2 and asked == ["https://download.pytorch.org/models/resnet18-f37072fd.pth"]
    assert not cached.exists()
    # Already there, intact (its SHA-256 starts with the name's prefix): said, nothing fetched.
    import dlojz_lib.model.pretrained

    intact = tmp_path / "torch" / "hub" / "checkpoints" / f"resnet18-{prefix}.pth"
    intact.write_bytes(b"not resnet18's weights")
    monkeypatch.setattr(dlojz_lib.model.pretrained, "torchvision_weights_path", lambda weights: intact)
    asked.clear()
    proc = run_inline("--arch", "resnet18", "--pretrained", "--fetch-weights")
    assert proc.returncode == 0 and f"{intact}: already in torch hub's cache" in proc.stdout and not asked


def test_fetch_weights_into_a_read_only_cache_is_one_line(tmp_path, monkeypatch, run_inline):
    """A cache folder the user cannot write in (a shared TORCH_HOME): one line saying what to set, no traceback.
    (Refused here by a stand-in: the tests run as root, who may write in a read-only folder.)"""
    import errno
    import pathlib

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    mkdir = pathlib.Path.mkdir

    def read_only(self, *args, **kwargs):
        if str(self).startswith(str(tmp_path / "torch")):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))
        return mkdir(self, *args, **kwargs)

    monkeypatch.setattr(pathlib.Path, "mkdir", read_only)
    proc = run_inline("--arch", "resnet18", "--pretrained", "--fetch-weights")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert "(Permission denied): set TORCH_HOME to a folder you can write in" in last, last


@pytest.mark.parametrize("intact", [True, False])
def test_fetch_weights_of_a_timm_model_checks_the_blob_s_sha256(intact, tmp_path, monkeypatch, run_inline):
    import hashlib

    import huggingface_hub

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    data = b"weights"
    digest = hashlib.sha256(data).hexdigest()

    def download(repo, filename, cache_dir):  # what the hub's download leaves, a blob named by its SHA-256
        assert (repo, filename, str(cache_dir)) == ("timm/resnet10t.c3_in1k", "model.safetensors", str(tmp_path / "hf"))
        path = hugging_face_cache(tmp_path / "hf", repo, filename, lambda p: p.write_bytes(data if intact else b"x"))
        path.resolve().rename(path.resolve().with_name(digest))
        path.unlink()
        path.symlink_to(path.parent.parent.parent / "blobs" / digest)
        return str(path)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    proc = run_inline("--arch", "timm:resnet10t", "--pretrained", "--fetch-weights")
    if intact:
        assert (
            proc.returncode == 0
            and f"fetched from Hugging Face's timm/resnet10t.c3_in1k, SHA-256 {digest}" in proc.stdout
        )
    else:
        assert proc.returncode == 2 and "does not match its SHA-256" in proc.stderr, proc.stderr
        assert not list((tmp_path / "hf").rglob("model.safetensors")) and not list((tmp_path / "hf").rglob(digest))


def test_the_weights_mean_and_std_normalise_the_images_unless_given(tmp_path, monkeypatch):
    from dlojz_lib.data.loaders import normalisation

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    hugging_face_cache(tmp_path / "hf", "timm/test_vit.r160_in1k", "model.safetensors", lambda p: p.write_bytes(b""))
    flags = ["--device", "cpu", "--arch", "timm:test_vit", "--pretrained"]
    cfg = resolve_config(get_args_parser().parse_args(flags))  # trained on images normalised to [-1, 1]
    assert tuple(cfg.mean) == tuple(cfg.std) == (0.5, 0.5, 0.5)
    assert any("--mean 0.5 0.5 0.5 --std 0.5 0.5 0.5 (given flags win)" in note for note in cfg.notes), cfg.notes
    white = torch.full((1, 3, 2, 2), 255, dtype=torch.uint8)
    assert torch.allclose(
        normalisation(cfg.section("data"), cfg.channels_last, Distribution(1, 0, 0, torch.device("cpu")))(white),
        torch.ones(1),
    )
    cfg = resolve_config(get_args_parser().parse_args([*flags, "--mean", "0.25", "0.25", "0.25"]))
    assert tuple(cfg.mean) == (0.25, 0.25, 0.25) and tuple(cfg.std) == (0.5, 0.5, 0.5)
    assert torch.allclose(
        normalisation(cfg.section("data"), cfg.channels_last, Distribution(1, 0, 0, torch.device("cpu")))(white),
        torch.tensor(1.5),
    )
    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--std", "0.25", "0.5", "1"]))
    black = torch.zeros((1, 3, 1, 1), dtype=torch.uint8)  # ImageNet's mean, this std
    expected = -torch.tensor([0.485 / 0.25, 0.456 / 0.5, 0.406 / 1]).view(1, 3, 1, 1)
    assert torch.allclose(
        normalisation(cfg.section("data"), cfg.channels_last, Distribution(1, 0, 0, torch.device("cpu")))(black),
        expected,
    )


def test_an_older_file_without_num_batches_tracked_loads_as_torch_s_strict_load_does(tmp_path):
    saved = {key: value for key, value in imagenet_resnet18().items() if not key.endswith("num_batches_tracked")}
    strict = torchvision.models.resnet18(num_classes=1000)
    strict.load_state_dict(saved, strict=True)  # torch's own loader accepts it
    torch.save(saved, tmp_path / "old.pth")
    module, lines = model_from(tmp_path / "old.pth")
    own = module.state_dict()
    assert all(torch.equal(own[key], value) for key, value in saved.items() if not key.startswith("fc."))
    assert own["bn1.num_batches_tracked"] == 0
    line = next(line for line in lines if line.startswith("initial weights:"))
    assert "num_batches_tracked" not in line  # not "new": the model's own, as torch leaves it


def test_quantised_weights_are_one_line(tmp_path):
    saved = imagenet_resnet18()
    saved["conv1.weight"] = saved["conv1.weight"].to(torch.int8)
    torch.save(saved, tmp_path / "int8.pth")
    with pytest.raises(UserError, match=r"conv1\.weight is int8 there, not floating point \(quantised weights\?\)"):
        model_from(tmp_path / "int8.pth")


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_weights_that_are_not_finite_are_one_line_naming_the_file(tmp_path, bad):
    """A NaN (weights saved after a diverged step) once trained and was blamed on --lr: one line naming the file
    and the tensor, before any step."""
    saved = imagenet_resnet18()
    saved["layer1.0.conv1.weight"][0, 0, 0, 0] = bad
    torch.save(saved, tmp_path / "diverged.pth")
    with pytest.raises(UserError, match=r"diverged\.pth: layer1\.0\.conv1\.weight holds NaN or infinite values"):
        model_from(tmp_path / "diverged.pth")


def test_a_damaged_cache_file_is_named_by_pretrained_with_what_to_do(tmp_path, monkeypatch):
    """The user gave --pretrained, not --initial-checkpoint: the error names the flag they gave and says how to
    get the file back."""
    from dlojz_lib.model.pretrained import torchvision_weights, torchvision_weights_path

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cached = torchvision_weights_path(torchvision_weights("resnet18", "DEFAULT"))
    cached.parent.mkdir(parents=True)
    cached.write_bytes(b"PK\x03\x04 truncated")
    cfg = resolve_config(get_args_parser().parse_args(["--device", "cpu", "--arch", "resnet18", "--pretrained"]))
    with pytest.raises(UserError) as caught:
        build_model(cfg, 3, Distribution(1, 0, 0, torch.device("cpu")), lambda line: None)
    message = str(caught.value)
    assert message.startswith(f"--pretrained DEFAULT: the cached file {cached} is truncated or damaged (torch: ")
    assert message.endswith(
        "; delete it and fetch it again with python dlojz.py --arch resnet18 --pretrained DEFAULT --fetch-weights"
    )
    assert "--initial-checkpoint" not in message


def test_a_truncated_timm_file_in_the_cache_is_fetched_again(tmp_path, monkeypatch, run_inline):
    """Hugging Face stores a large file under its SHA-256: a blob whose bytes no longer hash to its name is not
    "already in the cache"; it is removed and fetched again (here no network: one line)."""
    import dlojz_lib.model.pretrained

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    asked = []

    def no_network(repo):  # (the hub's own client would log its connection errors with tracebacks)
        asked.append(repo)
        dlojz_lib.model.pretrained.fail(f"--fetch-weights: cannot download {repo} (no network here)")

    monkeypatch.setattr(dlojz_lib.model.pretrained, "fetch_from_hugging_face", no_network)
    repo = tmp_path / "hf" / "models--timm--resnet10t.c3_in1k"
    blob = repo / "blobs" / ("a" * 64)
    blob.parent.mkdir(parents=True)
    blob.write_bytes(b"truncated")
    snapshot = repo / "snapshots" / "0123abc" / "model.safetensors"
    snapshot.parent.mkdir(parents=True)
    snapshot.symlink_to(blob)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abc")
    proc = run_inline("--arch", "timm:resnet10t", "--pretrained", "--fetch-weights")
    assert proc.returncode == 2 and "already" not in proc.stdout and "Traceback" not in proc.stderr, proc.stderr
    assert "--fetch-weights: cannot download timm/resnet10t.c3_in1k" in proc.stderr.strip().splitlines()[-1]
    assert asked == ["timm/resnet10t.c3_in1k"] and not blob.exists() and not snapshot.is_symlink()
