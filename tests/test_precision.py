"""Numbers kept in float32 where the papers keep them, whatever autocast does around them: edm2's uncertainty head
u(sigma) (NVlabs/edm2 training/networks_edm2.py, Precond computes it in float32 beside its fp16 UNet) and EDM's
attention logits and softmax (NVlabs/edm training/networks.py, AttentionOp). CPU autocast stands in for CUDA's:
it lowers matmuls (so einsum and MPConv's linear) to float16 or bfloat16 the same way."""

import pytest
import torch

from diffrelay import config, objectives
from diffrelay.training.state import _first_scale

LOW = [torch.float16, torch.bfloat16]
EDM2 = {"arch": "edm2", "class_conditional": False,
        "kwargs": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [4],
                   "channels_per_head": 8}}
DDPMPP = {"arch": "ddpmpp", "class_conditional": False,
          "kwargs": {"model_channels": 16, "channel_mult": [1, 2], "num_blocks": 1, "attn_resolutions": [8],
                     "dropout": 0.0}}


def cfg_of(model: dict, **train) -> config.Config:
    return config.Config(config.validate({"data": {"resolution": 8}, "model": model, "train": train}))


def built(cfg, seed=0):
    torch.manual_seed(seed)
    return objectives.build(cfg.to_dict()["model"], 8, 0)


def draws(seed, batch=8):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, 3, 8, 8, generator=g), torch.randn(batch, generator=g),
            torch.randn(batch, 3, 8, 8, generator=g))


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_edm2_uncertainty_is_float32_under_autocast(dtype):
    """u(sigma) under autocast is the float32 head's output bit for bit, from the network and through Denoiser."""
    den = built(cfg_of(EDM2)).eval()
    x, rnd, _ = draws(0)
    sigma = (rnd * 1.2 - 1.2).exp()
    c_noise = sigma.log() / 4
    with torch.no_grad():
        want = den.net.logvar(c_noise)
        with torch.autocast("cpu", dtype=dtype):
            got = den.net.logvar(c_noise)
            _, through = den(x, sigma, return_logvar=True)
    assert want.dtype == got.dtype == through.dtype == torch.float32
    assert torch.equal(got, want) and torch.equal(through, want)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_edm_attention_logits_and_softmax_are_float32_under_autocast(dtype, monkeypatch):
    """Each attention's logits come out of the einsum in float32, and its weights are the float32 softmax of those
    q, k rounded once to q's dtype (as AttentionOp returns them)."""
    seen = []
    einsum = torch.einsum

    def spy(eq, *ops):
        out = einsum(eq, *ops)
        seen.append((eq, ops, out))
        return out

    den = built(cfg_of(DDPMPP)).eval()
    with torch.no_grad():  # logits of a few units, as a trained network's, so rounding them would show
        for name, p in den.named_parameters():
            if name.endswith("qkv.weight"):
                p.mul_(3)
    x, rnd, _ = draws(0)
    monkeypatch.setattr(torch, "einsum", spy)
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype):
        den(x, (rnd * 1.2 - 1.2).exp())
    monkeypatch.undo()
    logits = [(ops, out) for eq, ops, out in seen if eq == "ncq,nck->nqk"]
    weights = [ops[0] for eq, ops, _ in seen if eq == "nqk,nck->ncq"]
    assert logits and len(logits) == len(weights)
    for ((q, k), out), w in zip(logits, weights):
        assert out.dtype == torch.float32
        want = torch.einsum("ncq,nck->nqk", q.float(), k.float()).softmax(dim=2)
        assert w.dtype == dtype  # the cast back, as AttentionOp's .to(q.dtype)
        torch.testing.assert_close(w.float(), want, rtol=torch.finfo(dtype).eps, atol=1e-7)


@pytest.mark.parametrize("seed", [1, 2])
def test_edm2_sum_loss_has_finite_gradients_under_fp16_autocast(seed):
    """train.loss_reduction sum makes u(sigma)'s gradient a sum over C x H x W; at the first loss scale training
    uses, a float16 head overflowed it (NaN in logvar_linear.weight alone). In float32 every gradient is finite."""
    cfg = cfg_of(EDM2, loss_reduction="sum")
    den = built(cfg, seed).train()
    images, rnd, noise = draws(seed)
    scale = _first_scale(cfg.train, images.shape[1:])  # what training's GradScaler starts at
    with torch.autocast("cpu", dtype=torch.float16):
        loss = objectives.loss(cfg, den, images, None, rnd, noise)
    (loss * scale).backward()
    grads = {name: p.grad for name, p in den.named_parameters()}
    assert grads["net.logvar_linear.weight"] is not None
    bad = [name for name, g in grads.items() if g is not None and not torch.isfinite(g).all()]
    assert not bad, f"non-finite gradients in {bad}"
