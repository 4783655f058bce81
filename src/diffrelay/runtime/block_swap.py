"""train.block_swap: the frozen weights of N transformer blocks live in host memory and are copied to the GPU just
before each block runs, forward and backward, on a side stream that overlaps the copy of the next block with the
compute of this one (musubi-tuner's and sd-scripts' blocks_to_swap, docs/gpus.md "Block swap").

What is swapped: a LoRA run's frozen base only (every parameter of the block with requires_grad false; buffers
stay). The adapter's tensors stay on the GPU, so the optimizer, the gradients and the EMAs never see a parameter
change device. A full fine-tune is refused (its trained weights would have to travel with their gradients).

When: the swapped blocks are the last N in the order they run (a FLUX.1 network's double-stream blocks, then its
single-stream ones). Activation checkpointing is required: under it a block keeps only its inputs for the backward
and runs its forward again there, so its weights are needed exactly while its forward runs, twice a step:
  forward    before block i: i is made resident (waiting for its copy), every other swapped block but i + 1 leaves,
             i + 1 starts copying; after it, i leaves unless it is the last (the backward starts with it);
  backward   before block i's recomputed forward: the same with i - 1 for i + 1; i stays for its own backward, and
             leaves when block i - 1 comes in (the autograd engine finishes a block's backward before the one below
             starts: its nodes come later in the forward, and the engine runs the latest first). Leaving is safe
             in any case: the recomputed forward's saved tensors hold the weights they read until the backward
             used them, and a copy never writes into memory something else still reads (each is a new tensor).
At most two swapped blocks are resident at once (and the one whose backward is finishing).

A swapped-out parameter's slot holds an empty placeholder on the device, so a stray use is a shape error, never a
read of stale memory. On the CPU (nothing needs to move: the tests) a resident block holds the very tensors it was
built with: the same bits, and the schedule's mechanics tested.
"""

import collections

import torch
from torch import nn

from diffrelay.errors import UserError

EVENTS = 4096  # the swap events kept (BlockSwap.events)


def in_backward() -> bool:
    """Whether autograd's engine is running (a checkpointed block's forward recomputed for its backward)."""
    return torch._C._current_graph_task_id() != -1


def _slots(block: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    return [(m, name, p) for m in block.modules() for name, p in m._parameters.items()
            if p is not None and not p.requires_grad]


def _pinned(p: nn.Parameter) -> nn.Parameter:
    """p on the host, page-locked where it is a plain tensor (a quantized weight, a tensor subclass, is kept as it
    is: its own .to moves its scales with it)."""
    if type(p) is nn.Parameter and type(p.data) is torch.Tensor:
        return nn.Parameter(p.detach().to("cpu").pin_memory(), requires_grad=False)
    return p if p.device.type == "cpu" else p.to("cpu")


class BlockSwap:
    """Swaps the frozen weights of `blocks` (the swapped ones, in the order they run) onto `device` on demand.

    Made on the network before it is moved to the device (`park`), so the swapped weights never reach the GPU
    whole; hooked (`hook`) after the EMAs are copied, so no average carries the hooks."""

    def __init__(self, blocks: list[nn.Module], device: torch.device):
        self.blocks, self.device = list(blocks), torch.device(device)
        self.cuda = self.device.type == "cuda"
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        found = [_slots(b) for b in self.blocks]
        self.host = [[_pinned(p) if self.cuda else p for _, _, p in s] for s in found]
        # (module, name) alone: the unpinned originals are not kept alive beside their pinned copies
        self.slots = [[(m, name) for m, name, _ in s] for s in found]
        del found
        self.resident: dict[int, object] = {}  # block index -> its copy's CUDA event (None on the CPU)
        # ("in" | "out", index), the latest in order (what the tests read); bounded: a run makes 4N a step
        self.events: collections.deque = collections.deque(maxlen=EVENTS)
        self.handles = []
        for i in range(len(self.blocks)):  # parked: what the network's move to the device then moves is nothing
            self._set(i, [self._placeholder("cpu") for _ in self.host[i]])

    @staticmethod
    def _placeholder(device) -> nn.Parameter:
        """An empty weight in a swapped-out slot: a stray use fails on its shape, and DDP, which checks that every
        parameter is on the one device and broadcasts them all at its start, finds it there, holding nothing."""
        return nn.Parameter(torch.empty(0, dtype=torch.uint8, device=device), requires_grad=False)

    def _set(self, i: int, params: list) -> None:
        for (module, name), p in zip(self.slots[i], params, strict=True):
            module._parameters[name] = p

    def hook(self) -> "BlockSwap":
        """Swapped out until each block's first forward, then as the module docstring says."""
        for i, block in enumerate(self.blocks):
            self.handles.append(block.register_forward_pre_hook(lambda _m, _a, i=i: self._before(i)))
            self.handles.append(block.register_forward_hook(lambda _m, _a, _o, i=i: self._after(i)))
        return self

    def frozen_bytes(self) -> int:
        """The bytes of weights kept off the device."""
        return sum(h.numel() * h.element_size() for hosts in self.host for h in hosts)

    # --- the schedule (the module docstring)
    def _before(self, i: int) -> None:
        step = -1 if in_backward() else 1
        nxt = i + step if 0 <= i + step < len(self.blocks) else None
        for j in [j for j in self.resident if j not in (i, nxt)]:
            self._out(j)
        self._in(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_event(self.resident[i])
        if nxt is not None:
            self._in(nxt)

    def _after(self, i: int) -> None:
        if not in_backward() and i < len(self.blocks) - 1:
            self._out(i)

    def _in(self, i: int) -> None:
        if i in self.resident:
            return
        self.events.append(("in", i))
        if not self.cuda:
            self._set(i, self.host[i])
            self.resident[i] = None
            return
        main = torch.cuda.current_stream(self.device)
        # The copy waits for the work queued so far: memory freed by the block that left is reused by this copy
        # (the side stream's own pool) only after the main stream stopped reading it.
        self.stream.wait_stream(main)
        with torch.cuda.stream(self.stream):
            moved = [h.to(self.device, non_blocking=True) for h in self.host[i]]
            done = torch.cuda.Event()
            done.record(self.stream)
        self._set(i, [m if isinstance(m, nn.Parameter) else nn.Parameter(m, requires_grad=False) for m in moved])
        self.resident[i] = done

    def _out(self, i: int) -> None:
        self.events.append(("out", i))
        self._set(i, [self._placeholder(self.device) for _ in self.host[i]])
        del self.resident[i]

    def restore(self) -> None:
        """Every block back in place, unhooked: on the CPU the network holds its own tensors again."""
        for h in self.handles:
            h.remove()
        self.handles.clear()
        for i in range(len(self.blocks)):
            if i not in self.resident:
                self._in(i)
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


def all_blocks(model: nn.Module, lists: tuple) -> list[nn.Module]:
    """The blocks of `model`'s ModuleLists named `lists` (a family's swap_lists), in the order they run."""
    return [b for name in lists for b in getattr(model, name, None) or []]


def swap_blocks(model: nn.Module, lists: tuple, n: int, where: str = "train.block_swap") -> list[nn.Module]:
    """The last `n` of `all_blocks`."""
    blocks = all_blocks(model, lists)
    if not blocks:
        raise UserError(f"{where}={n}: {type(model).__name__} has no transformer blocks to swap (it holds none of "
                        f"{', '.join(lists) or 'the lists a transformer family names'}); set train.block_swap: 0")
    if n > len(blocks):
        raise UserError(f"{where}={n}: {type(model).__name__} has {len(blocks)} blocks; swap at most {len(blocks)}")
    return blocks[len(blocks) - n:]
