"""DINOv2 extractor: download over HTTP, strict checks of the official state dict, TorchScript, edm2's numbers.

A tiny DINOv2-shaped model (dim 32, 2 blocks, 2 heads) stands in for the official files, which are far
too large for tests; its state dict is written here with the official key names, not taken from our module.
"""

import functools
import http.server
import os
import threading

import pytest
import torch
from conftest import run_cli
from torch.nn import functional as F

from diffrelay import cli, io
from diffrelay.evaluation import dinov2, extractor
from diffrelay.errors import UserError

DEAD = "http://127.0.0.1:9"  # the discard port: nothing listens, the connection is refused
TINY = dinov2.Shape(dim=32, depth=2, heads=2, ffn="mlp")


@pytest.fixture
def tiny(monkeypatch):
    monkeypatch.setitem(dinov2.MODELS, "tiny", TINY)
    return "tiny"


def official_state(s: dinov2.Shape, seed: int = 0) -> dict:
    """Random tensors under the key names and shapes of Meta's dinov2_*_pretrain.pth files (block_chunks=0)."""
    d, h, p = s.dim, 4 * s.dim, 14
    shapes = {"cls_token": (1, 1, d), "pos_embed": (1, 1 + 37 * 37, d), "mask_token": (1, d),
              "patch_embed.proj.weight": (d, 3, p, p), "patch_embed.proj.bias": (d,)}
    for i in range(s.depth):
        b = f"blocks.{i}."
        shapes.update({b + "norm1.weight": (d,), b + "norm1.bias": (d,), b + "attn.qkv.weight": (3 * d, d),
                       b + "attn.qkv.bias": (3 * d,), b + "attn.proj.weight": (d, d), b + "attn.proj.bias": (d,),
                       b + "ls1.gamma": (d,), b + "norm2.weight": (d,), b + "norm2.bias": (d,),
                       b + "mlp.fc1.weight": (h, d), b + "mlp.fc1.bias": (h,), b + "mlp.fc2.weight": (d, h),
                       b + "mlp.fc2.bias": (d,), b + "ls2.gamma": (d,)})
    shapes.update({"norm.weight": (d,), "norm.bias": (d,)})
    g = torch.Generator().manual_seed(seed)
    state = {}
    for key, shape in shapes.items():
        gain = key.endswith("gamma") or key.endswith("norm1.weight") or key.endswith("norm2.weight") \
            or key == "norm.weight"
        noise = torch.randn(shape, generator=g)
        state[key] = 1 + 0.1 * noise if gain else 0.05 * noise
    return state


def plain_vit(state: dict, x: torch.Tensor, heads: int) -> torch.Tensor:
    """A direct ViT forward on the state dict: the numbers our module must give, written without it."""
    dim = state["cls_token"].shape[-1]
    t = F.conv2d(x, state["patch_embed.proj.weight"], state["patch_embed.proj.bias"], stride=14)
    rows, cols = t.shape[2], t.shape[3]
    t = t.flatten(2).transpose(1, 2)
    pos = state["pos_embed"]
    if (rows, cols) != (37, 37):  # the official code uses the 518 px table as is, else resizes it
        table = pos[:, 1:].reshape(1, 37, 37, dim).permute(0, 3, 1, 2)
        table = F.interpolate(table, scale_factor=((rows + 0.1) / 37, (cols + 0.1) / 37), mode="bicubic")
        pos = torch.cat([pos[:, :1], table.flatten(2).transpose(1, 2)], dim=1)
    t = torch.cat([state["cls_token"].expand(len(t), -1, -1), t], dim=1) + pos
    depth = len({k.split(".")[1] for k in state if k.startswith("blocks.")})
    for i in range(depth):
        w = {k.removeprefix(f"blocks.{i}."): v for k, v in state.items() if k.startswith(f"blocks.{i}.")}
        y = F.layer_norm(t, (dim,), w["norm1.weight"], w["norm1.bias"], eps=1e-6)
        q, k, v = (z.unflatten(-1, (heads, -1)).transpose(1, 2)
                   for z in F.linear(y, w["attn.qkv.weight"], w["attn.qkv.bias"]).chunk(3, dim=-1))
        att = torch.softmax(q @ k.transpose(-1, -2) / (dim // heads) ** 0.5, dim=-1) @ v
        t = t + w["ls1.gamma"] * F.linear(att.transpose(1, 2).flatten(2), w["attn.proj.weight"], w["attn.proj.bias"])
        y = F.layer_norm(t, (dim,), w["norm2.weight"], w["norm2.bias"], eps=1e-6)
        y = F.gelu(F.linear(y, w["mlp.fc1.weight"], w["mlp.fc1.bias"]))
        y = F.linear(y, w["mlp.fc2.weight"], w["mlp.fc2.bias"])
        t = t + w["ls2.gamma"] * y
    return F.layer_norm(t, (dim,), state["norm.weight"], state["norm.bias"], eps=1e-6)[:, 0]


def edm2_features(state: dict, images: torch.Tensor, heads: int) -> torch.Tensor:
    """edm2's DINOv2Detector steps (resize_mode='torch'), then the plain ViT."""
    x = F.interpolate(images.float(), size=(224, 224), mode="bicubic", antialias=True) / 255
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    x = (x - mean.view(1, 3, 1, 1)) / std.view(1, 3, 1, 1)
    return plain_vit(state, x, heads)


def images(size: int, n: int = 3, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 256, (n, 3, size, size), generator=torch.Generator().manual_seed(seed)).float()


def save_pth(state, path):
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, path)
    return path


@pytest.fixture
def server(tmp_path):
    """An HTTP server on 127.0.0.1 serving tmp_path/www; yields (base URL, list of requested paths)."""
    root, requests = tmp_path / "www", []
    root.mkdir()

    class Handler(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args):
            requests.append(self.path)

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", requests, root
    httpd.shutdown()
    httpd.server_close()


def test_fetch_downloads_checks_and_writes_a_dinov2_torchscript(tmp_path, tiny, server, monkeypatch, capsys):
    base, requests, root = server
    state = official_state(TINY)
    pth = save_pth(state, root / "dinov2_tiny" / "dinov2_tiny_pretrain.pth")
    monkeypatch.setenv("DIFFRELAY_DINOV2_URL", base)
    out = tmp_path / "extractors" / "dinov2-tiny.pt"
    assert cli.main(["fetch-extractor", "--extractor", "dinov2-tiny", "--out", str(out)]) == 0
    assert requests == ["/dinov2_tiny/dinov2_tiny_pretrain.pth"]
    assert io.sha256_file(out) in capsys.readouterr().out
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temp file, no leftover download
    assert extractor.read_meta(out) == {"kind": "dinov2", "model": "tiny", "input": "native",
                                        "source_sha256": io.sha256_file(pth), "dim": 32}
    ext = extractor.load(out)
    assert (ext.kind, ext.label, ext.input_size) == ("dinov2", "FD_DINOv2", None)
    assert extractor.check(ext, want_dim=32) == 32
    for size in (32, 64, 299):
        x = images(size)
        with torch.no_grad():
            torch.testing.assert_close(ext.fn(x), edm2_features(state, x, heads=2), rtol=1e-5, atol=1e-5)


def test_valid_file_is_kept_and_another_model_refused(tmp_path, tiny, monkeypatch):
    out = tmp_path / "dinov2-tiny.pt"
    dinov2.fetch("tiny", out, weights=save_pth(official_state(TINY), tmp_path / "w" / "t.pth"))
    before = (out.stat().st_mtime_ns, io.sha256_file(out))
    monkeypatch.setenv("DIFFRELAY_DINOV2_URL", DEAD)  # a download attempt would fail
    dinov2.fetch("tiny", out)
    assert (out.stat().st_mtime_ns, io.sha256_file(out)) == before
    with pytest.raises(UserError, match="is not the DINOv2 vitl14 extractor"):
        dinov2.fetch("vitl14", out)
    random = extractor.build_random(tmp_path / "random.pt")
    with pytest.raises(UserError, match="is not the DINOv2 tiny extractor"):
        dinov2.fetch("tiny", random)


def test_offline_fetch_names_url_and_where_to_place_the_file(tmp_path):
    out = tmp_path / "extractors" / "dinov2-vitl14.pt"
    p = run_cli("fetch-extractor", "--extractor", "dinov2", "--out", out, check=False,
                env={**os.environ, "DIFFRELAY_DINOV2_URL": DEAD})
    assert p.returncode == 2
    lines = p.stderr.strip().splitlines()
    assert lines[-1].startswith("diffrelay: error:")
    assert f"{DEAD}/dinov2_vitl14/dinov2_vitl14_pretrain.pth" in lines[-1]
    assert str((out.parent / "dinov2_vitl14_pretrain.pth").resolve()) in lines[-1]
    assert not any(line.startswith("Traceback") for line in lines)
    assert list(out.parent.iterdir()) == []  # no partial download, no temp file


def test_hand_placed_weights_are_used_offline_and_never_deleted(tmp_path, tiny, monkeypatch):
    monkeypatch.setenv("DIFFRELAY_DINOV2_URL", DEAD)
    state = official_state(TINY, seed=3)
    placed = save_pth(state, tmp_path / "extractors" / "dinov2_tiny_pretrain.pth")
    sha = io.sha256_file(placed)
    out = dinov2.fetch("tiny", tmp_path / "extractors" / "dinov2-tiny.pt")
    assert io.sha256_file(placed) == sha
    assert extractor.read_meta(out)["source_sha256"] == sha
    x = images(48)
    with torch.no_grad():
        torch.testing.assert_close(extractor.load(out).fn(x), edm2_features(state, x, 2), rtol=1e-5, atol=1e-5)
    with pytest.raises(UserError, match="--weights=.*missing.pth: file not found"):
        dinov2.fetch("tiny", tmp_path / "other.pt", weights=tmp_path / "missing.pth")


class Payload:
    """Unpickling this runs os.mkdir: proof that code ran, if the folder appears."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.mkdir, (self.marker,)


def test_pickle_with_code_is_refused_without_running_it(tmp_path, tiny):
    marker = tmp_path / "code-ran"
    state = official_state(TINY)
    state["cls_token"] = Payload(marker)
    bad = save_pth(state, tmp_path / "bad.pth")
    with pytest.raises(UserError, match=r"bad\.pth: refused by torch\.load\(weights_only=True\)") as e:
        dinov2.fetch("tiny", tmp_path / "out.pt", weights=bad)
    assert "\n" not in str(e.value) and "mkdir" in str(e.value)
    assert not marker.exists()
    assert not (tmp_path / "out.pt").exists()


@pytest.mark.parametrize("change, message", [
    (lambda s: s.pop("blocks.1.ls2.gamma"), "key 'blocks.1.ls2.gamma' missing"),
    (lambda s: s.update(register_tokens=torch.zeros(1, 4, 32)), "unexpected key 'register_tokens'"),
    (lambda s: s.update(pos_embed=torch.zeros(1, 257, 32)),
     r"key 'pos_embed' has shape \(1, 257, 32\), not \(1, 1370, 32\)"),
])
def test_wrong_keys_or_shapes_are_refused_naming_the_key(tmp_path, tiny, change, message):
    state = official_state(TINY)
    change(state)
    bad = save_pth(state, tmp_path / "bad.pth")
    with pytest.raises(UserError, match=message) as e:
        dinov2.fetch("tiny", tmp_path / "out.pt", weights=bad)
    assert str(bad) in str(e.value) and "\n" not in str(e.value)
    assert not (tmp_path / "out.pt").exists()


def test_file_that_is_not_a_state_dict_is_refused(tmp_path, tiny):
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"<html>not found</html>")
    with pytest.raises(UserError, match="junk.pth: not a readable PyTorch weights file"):
        dinov2.fetch("tiny", tmp_path / "out.pt", weights=junk)
    save_pth([torch.zeros(1)], tmp_path / "list.pth")
    with pytest.raises(UserError, match="holds a list, not a flat dict of tensors"):
        dinov2.fetch("tiny", tmp_path / "out.pt", weights=tmp_path / "list.pth")


def test_torchscript_file_equals_the_eager_module(tmp_path, tiny):
    state = official_state(TINY, seed=5)
    out = dinov2.fetch("tiny", tmp_path / "d.pt", weights=save_pth(state, tmp_path / "w.pth"))
    eager = dinov2.build("tiny", state, "w.pth")
    scripted = extractor.load(out, mode="legacy_tensorflow").fn  # the mode changes nothing for DINOv2
    for size in (16, 224, 299):
        x = images(size, seed=size)
        with torch.no_grad():
            assert torch.equal(scripted(x), eager(x))


def test_backbone_keeps_the_table_at_518_and_resizes_it_otherwise(tiny):
    state = official_state(TINY, seed=7)
    net = dinov2.build("tiny", state, "w.pth")
    with torch.no_grad():
        assert torch.equal(net.vit.positions(37, 37, torch.float32), state["pos_embed"])
        for side in (98, 224, 518):
            x = torch.randn(2, 3, side, side, generator=torch.Generator().manual_seed(side))
            torch.testing.assert_close(net.vit(x), plain_vit(state, x, 2), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="not a multiple of the patch size"):
            net.vit(torch.zeros(1, 3, 30, 28))


def test_swiglu_blocks_of_the_giant_model_load_and_run(monkeypatch):
    s = dinov2.Shape(dim=32, depth=1, heads=2, ffn="swiglu")
    monkeypatch.setitem(dinov2.MODELS, "tinyg", s)
    state = {k: v for k, v in official_state(dinov2.Shape(32, 1, 2, "mlp")).items() if ".mlp." not in k}
    # The official SwiGLU width: 2/3 of 4 * dim, rounded up to a multiple of 8 (85 -> 88 here; 4096 for g/14).
    state |= {"blocks.0.mlp.w12.weight": torch.randn(176, 32) * 0.05, "blocks.0.mlp.w12.bias": torch.zeros(176),
              "blocks.0.mlp.w3.weight": torch.randn(32, 88) * 0.05, "blocks.0.mlp.w3.bias": torch.zeros(32)}
    y = dinov2.build("tinyg", state, "g.pth")(images(32))
    assert y.shape == (3, 32) and torch.isfinite(y).all()
    assert dinov2.MODELS["vitg14"].hidden == 4096


def test_model_table_has_the_official_sizes():
    with torch.device("meta"):
        counts = {m: sum(p.numel() for p in dinov2.Features(dinov2.MODELS[m]).parameters())
                  for m in ("vits14", "vitl14", "vitg14")}
    # The official backbones' parameter counts (their hub constructors, pretrained=False).
    assert counts == {"vits14": 22_056_576, "vitl14": 304_368_640, "vitg14": 1_136_480_768}
    assert dinov2.weights_url("vitb14") == \
        "https://dl.fbaipublicfiles.com/dinov2/dinov2_vitb14/dinov2_vitb14_pretrain.pth"


def test_unknown_model_and_misplaced_weights_option_are_refused(tmp_path, capsys):
    assert cli.main(["fetch-extractor", "--extractor", "dinov2-vitz14", "--out", str(tmp_path / "x.pt")]) == 2
    assert "dinov2-vitl14" in capsys.readouterr().err
    assert cli.main(["fetch-extractor", "--extractor", "random", "--weights", "w.pth",
                     "--out", str(tmp_path / "x.pt")]) == 2
    assert "--weights=w.pth: only for --extractor dinov2" in capsys.readouterr().err


def test_other_extractors_want_299_in_clean_mode_and_native_size_in_legacy(tmp_path):
    path = extractor.build_random(tmp_path / "r.pt")
    assert extractor.load(path).input_size == 299
    assert extractor.load(path, mode="legacy_tensorflow").input_size is None
