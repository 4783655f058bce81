"""train.block_swap's mechanics (runtime/block_swap.py) on a FLUX.1-style transformer with a LoRA: the output and
every adapter gradient equal no swap bit for bit, step after step; at most two swapped blocks are resident; a
swapped-out block holds no weights (a stray use fails on its shape); and a backward whose recomputed forward did
not bring its block back fails, so the equality is not an accident of weights left in place. tests/test_flux.py
trains with it."""

import pytest
import torch

from diffrelay.errors import UserError
from diffrelay.runtime import block_swap

LISTS = ("transformer_blocks", "single_transformer_blocks")


def flux_lora():
    from diffusers import FluxTransformer2DModel
    from peft import LoraConfig, inject_adapter_in_model

    torch.manual_seed(0)
    net = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=2, num_single_layers=2, attention_head_dim=8,
                                 num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                                 guidance_embeds=True, axes_dims_rope=(2, 2, 4)).requires_grad_(False)
    torch.manual_seed(1)
    config = LoraConfig(r=2, target_modules=["to_q", "to_k", "to_v", "to_out.0"], init_lora_weights="gaussian")
    net = inject_adapter_in_model(config, net)
    for module in net.modules():  # a random B too, so every gradient is non-zero
        if hasattr(module, "lora_B"):
            torch.nn.init.normal_(module.lora_B["default"].weight)
    net.enable_gradient_checkpointing()
    return net


def step(net, seed):
    g = torch.Generator().manual_seed(seed)
    x, text, pooled = torch.randn(2, 16, 16, generator=g), torch.randn(2, 4, 32, generator=g), torch.randn(2, 32, generator=g)
    out = net(hidden_states=x, encoder_hidden_states=text, pooled_projections=pooled, timestep=torch.tensor([0.5, 0.7]),
              img_ids=torch.zeros(16, 3), txt_ids=torch.zeros(4, 3), guidance=torch.tensor([3.5, 3.5])).sample
    for p in net.parameters():
        p.grad = None
    out.square().mean().backward()
    return out.detach(), {n: p.grad for n, p in net.named_parameters() if p.requires_grad}


def test_a_swapped_transformer_gives_the_same_bits_and_holds_at_most_two_swapped_blocks():
    plain, swapped = flux_lora(), flux_lora()
    blocks = block_swap.swap_blocks(swapped, LISTS, 3)
    assert blocks == [swapped.transformer_blocks[1], *swapped.single_transformer_blocks]
    frozen = sum(p.numel() * 4 for b in blocks for p in b.parameters() if not p.requires_grad)
    swap = block_swap.BlockSwap(blocks, torch.device("cpu")).hook()
    assert swap.frozen_bytes() == frozen and not any(p.numel() for b in blocks for p in b.parameters()
                                                     if not p.requires_grad)
    most = []
    real = swap._in
    swap._in = lambda i: (real(i), most.append(len(swap.resident)))
    for seed in (1, 2):
        (a, ga), (b, gb) = step(plain, seed), step(swapped, seed)
        assert torch.equal(a, b) and set(ga) == set(gb) and len(ga) == 28
        assert all(torch.equal(ga[k], gb[k]) and ga[k].abs().sum() > 0 for k in ga), seed
    assert max(most) == 2
    # forward 0 1 2, backward 2 1 0: each block in twice a step, out once it ran (the last kept for the backward)
    assert list(swap.events)[:9] == [("in", 0), ("in", 1), ("out", 0), ("in", 2), ("out", 1), ("in", 1), ("out", 2),
                               ("in", 0), ("out", 1)]
    assert list(swap.resident) == [0]  # the first stays for the next step's forward
    args = torch.randn(2, 16, 16), torch.randn(2, 4, 16), torch.randn(2, 16), None
    with pytest.raises(RuntimeError):  # out of the schedule (forward, not the hooked call), it has no weights
        blocks[2].forward(*args)
    swap.restore()
    assert all(p.numel() for b in blocks for p in b.parameters())
    blocks[2].forward(*args)  # back in place, the same call runs


def test_a_backward_that_did_not_bring_a_block_back_fails():
    net = flux_lora()
    swap = block_swap.BlockSwap(block_swap.swap_blocks(net, LISTS, 2), torch.device("cpu")).hook()
    before = swap._before
    swap._before = lambda i: None if block_swap.in_backward() else before(i)  # no swap-in for the recompute
    with pytest.raises(RuntimeError):
        step(net, 1)


def test_more_blocks_than_the_network_has_or_none_are_refused_in_one_line():
    net = flux_lora()
    with pytest.raises(UserError, match="has 4 blocks; swap at most 4$"):
        block_swap.swap_blocks(net, LISTS, 5)
    with pytest.raises(UserError, match="has no transformer blocks to swap"):
        block_swap.swap_blocks(net, ("down_blocks",), 1)


def test_validate_counts_the_swapped_blocks_frozen_bytes_less_the_two_resident():
    from types import SimpleNamespace

    from diffrelay import families
    from diffrelay.config import memory

    net = flux_lora()
    wrapper = SimpleNamespace(net=SimpleNamespace(family=families.of_network("flux"), model=net))
    sizes = memory._block_bytes(lambda: wrapper, 0.5)
    blocks = [*net.transformer_blocks, *net.single_transformer_blocks]
    assert sizes == [int(sum(p.numel() * 4 for p in b.parameters() if not p.requires_grad) * 0.5) for b in blocks]
    assert sizes[0] > sizes[2]  # a double-stream block holds more than a single-stream one
    assert memory.swap_saving(sizes, 4) == sum(sorted(sizes)[:2]) and memory.swap_saving(sizes, 3) == sizes[3]
    assert memory.swap_saving(sizes, 2) == memory.swap_saving(sizes, 0) == 0
