"""What a text-conditional network receives beside x and c_noise: the encoders' outputs for each row.

The objectives and samplers pass the network's conditioning through untouched (their `labels` argument), so a
Text travels where class labels do; the objectives' wrappers (edm.Denoiser, ddpm.EpsModel, flow.VelocityModel)
unpack it with `call`. A network of the contract then gets

    forward(x, c_noise, labels, text=Text(states, mask, pooled, labels=None))

states (B, L, D) are the hidden states (several encoders combined as SDXL and SD3 combine them, encoders.py),
mask (B, L) int64 is 1 for a real token and 0 for padding, as transformers' attention_mask, and pooled (B, P)
the pooled embedding of the encoders that give one (None when none does). `labels` are the class labels
carried along, None for a text-only dataset. `null` is the unconditional branch of classifier-free guidance
for the same rows: the empty caption's embedding, or the negative prompt's; it is set only when sampling.
`guidance` (B,) float32 is a guidance-distilled network's guidance input (FLUX.1-dev's), set only when sampling;
None in training, where the network feeds its own (families/). `sizes` (B, 6) float32 is each row's
original height and width, crop top and left and target height and width in pixels (SDXL's add_time_ids), set by
a bucketed dataset's loader (data.buckets); None: the network takes them from x's size, as the pipelines do.
"""

from dataclasses import dataclass, replace

import torch


@dataclass
class Text:
    states: torch.Tensor
    mask: torch.Tensor
    pooled: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    null: "Text | None" = None
    guidance: torch.Tensor | None = None
    sizes: torch.Tensor | None = None

    def _map(self, fn) -> "Text":
        return Text(fn(self.states), fn(self.mask), None if self.pooled is None else fn(self.pooled),
                    None if self.labels is None else fn(self.labels), None if self.null is None else self.null._map(fn),
                    None if self.guidance is None else fn(self.guidance), None if self.sizes is None else fn(self.sizes))

    def to(self, device, non_blocking: bool = False) -> "Text":
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    def __len__(self) -> int:
        return self.states.shape[0]

    def __getitem__(self, rows) -> "Text":
        return self._map(lambda t: t[rows])

    def tensor_split(self, n: int) -> tuple:
        parts = [t.tensor_split(n) for t in (self.states, self.mask)]
        pooled = self.pooled.tensor_split(n) if self.pooled is not None else [None] * n
        labels = self.labels.tensor_split(n) if self.labels is not None else [None] * n
        nulls = self.null.tensor_split(n) if self.null is not None else [None] * n
        guides = self.guidance.tensor_split(n) if self.guidance is not None else [None] * n
        sizes = self.sizes.tensor_split(n) if self.sizes is not None else [None] * n
        return tuple(Text(s, m, p, c, u, g, z) for s, m, p, c, u, g, z in zip(*parts, pooled, labels, nulls, guides,
                                                                               sizes))

    def where(self, rows: torch.Tensor, other: "Text") -> "Text":
        """`other`'s rows where the boolean `rows` is set (caption dropout: the empty caption's embedding)."""
        def pick(a, b):
            return torch.where(rows.view(-1, *[1] * (a.dim() - 1)), b.to(a.dtype), a)
        return Text(pick(self.states, other.states), pick(self.mask, other.mask),
                    None if self.pooled is None else pick(self.pooled, other.pooled), self.labels, self.null,
                    self.guidance, self.sizes)

    def with_null(self) -> "Text":
        """The rows followed by their unconditional rows, one batch (classifier-free guidance's two branches);
        class labels, when carried, take the contract's null class in the second half from `null.labels`."""
        u = self.null
        if u is None:
            raise ValueError("guidance with text needs the unconditional embedding (Text.null)")
        return Text(torch.cat([self.states, u.states]), torch.cat([self.mask, u.mask]),
                    None if self.pooled is None else torch.cat([self.pooled, u.pooled]),
                    None if self.labels is None else torch.cat([self.labels, u.labels]),
                    guidance=None if self.guidance is None else torch.cat([self.guidance, self.guidance]),
                    sizes=None if self.sizes is None else torch.cat([self.sizes, self.sizes]))

    def without_null(self) -> "Text":
        return replace(self, null=None)


def call(net, x, c_noise, labels, *extra, **kwargs):
    """net(x, c_noise, labels, ...) of the contract; a Text conditioning is given as text=, its class labels as
    labels."""
    if isinstance(labels, Text):
        return net(x, c_noise, labels.labels, *extra, text=labels.without_null(), **kwargs)
    return net(x, c_noise, labels, *extra, **kwargs)
