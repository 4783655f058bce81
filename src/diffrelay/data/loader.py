"""Batch loading: each step's images, labels (or captions' embeddings) and noise, made by a background thread while
a step runs.

A batch is a pure function of (seed, step, stream position): the thread reads this rank's rows from
the memory-mapped images (in sorted order, kinder to the page cache), converts them (uint8 NHWC ->
float NCHW in [-1, 1]; on CUDA the uint8 rows go through pinned memory and are converted on the
device, a quarter of the bytes a float copy would move) and draws the step's noise. Reading ahead
never changes what is trained, and the checkpointed DataOrder advances only when the loop takes a
batch, so a checkpoint's `consumed` always counts the steps actually trained.

A thread rather than DataLoader worker processes: the work per batch is one sorted memory-mapped
read, one conversion and two random draws, mostly inside numpy/torch calls that release the GIL,
and a thread cannot outlive its process, so no worker is ever left behind.
"""

import dataclasses
import queue
import threading
from dataclasses import dataclass, field

import numpy as np
import torch

from diffrelay.data import augment, edm_augment, subsets, tags
from diffrelay.objectives import ddpm, edm
from diffrelay.errors import UserError
from diffrelay.data.order import DataOrder, noise_seed, rank_slice
from diffrelay.runtime import mapped

# Bumped whenever the same checkpoint would go on to different noise: 1 = one generator per sample,
# 2 = one generator per step drawing the whole global batch (this module).
DRAWS_VERSION = 2
DEPTH = 2  # batches made ahead: one hides the work; a second absorbs a slow read (page-cache miss)


@dataclass
class Batch:
    step: int
    indices: np.ndarray  # this rank's dataset indices, in training order (the --trace record)
    rounds: list  # one (images, labels, rnd_normal, noise) per accumulation round, on the device
    masks: list = field(default_factory=list)  # one (drop, flip) augment.Rows per round, on the device
    augments: list = field(default_factory=list)  # one edm_augment.Draws per round (rows on the device); [] = off
    pipe: edm_augment.Pipe | None = None  # EDM's augmentation pipe at train.augment; None = off
    bucket: int | None = None  # the step's bucket (data.buckets), None for squares
    subsets: np.ndarray | None = None  # the global batch's rows of each subset (data.subsets), None without
    weights: list = field(default_factory=list)  # prior preservation: each round's per-row loss weights; [] = none

    def augmented(self, k: int, images: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(images, augmentation labels) of round k: EDM's pipe applied to its clean images, or (images, None)."""
        return edm_augment.apply(images, self.augments[k], self.pipe) if self.augments else (images, None)


def check_draws(path, meta: dict) -> None:
    """Refuse a checkpoint whose run drew its noise another way: it could not continue bit for bit."""
    found = meta.get("draws", 1)
    if found != DRAWS_VERSION:
        raise UserError(f"{path}: made by a diffrelay that draws training noise differently (draws version "
                        f"{found}, this one {DRAWS_VERSION}), so it cannot continue the same run; start a new run "
                        "(another run.name, or move its results folder away)")


def check_intact(array) -> None:
    """A memory-mapped array's file must still hold all of it (runtime/mapped.py: else a SIGBUS, no file named)."""
    mapped.check_intact(array, "training ran", "rebuild the dataset (diffrelay prepare) and rerun")


def read_rows(data, idx: np.ndarray, pin: bool = False, flip: np.ndarray | None = None,
              bucket: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 NHWC images, int64 labels) of dataset rows `idx`, in that order; pinned when asked. A latent
    dataset gives its float32 (mean, std) rows instead, those in `flip` from the mirrored images' latents.
    `bucket`: the rows are all of that bucket of a bucketed dataset (data/bucketed.py), read from its arrays."""
    arrays = (data.images,) if data.latent is None else (data.latents, data.latents_xflip)
    labels_of = idx
    if bucket is not None:
        b = data.buckets
        arrays, idx = (b.arrays[bucket], b.flipped[bucket]), np.asarray(b.rows[idx, 1])
    for array in (*arrays, data.labels):
        if array is not None:
            check_intact(array)  # one stat call a batch
    order = np.argsort(idx, kind="stable")  # sorted reads are kinder to a memory-mapped file
    rows = torch.empty((len(idx), *arrays[0].shape[1:]), dtype=getattr(torch, arrays[0].dtype.name),
                       pin_memory=pin)
    if flip is None or not flip.any():
        rows.numpy()[order] = arrays[0][idx[order]]
    else:
        for array, take in zip(arrays, (~flip[order], flip[order])):
            rows.numpy()[order[take]] = array[idx[order[take]]]
    labels = torch.from_numpy(np.ascontiguousarray(data.labels[labels_of]))
    return rows, labels.pin_memory() if pin else labels


def to_float(rows: torch.Tensor) -> torch.Tensor:
    """uint8 NHWC -> float NCHW in [-1, 1], on the rows' device (in place: a third of the allocations).

    Contiguous NCHW, not the permuted view's NHWC strides: those would give channels-last weight
    gradients, which DDP reports as "grad strides do not match bucket view strides" on every run."""
    return rows.permute(0, 3, 1, 2).to(torch.float32, memory_format=torch.contiguous_format).div_(127.5).sub_(1)


class BatchMaker:
    """Makes the batch of one step for one rank; holds the step's noise generator."""

    def __init__(self, data, seed: int, global_batch: int, *, rank: int, world: int, grad_accum: int, device,
                 label_dropout: float = 0.0, xflip: float = 0.0, augment: float = 0.0, text=None,
                 caption_dropout: float = 0.0, noise_offset: float = 0.0, prior_weight: float | None = None,
                 caption_tags=None, random_crop=1.0):
        self.data, self.seed, self.global_batch = data, seed, global_batch
        self.noise_offset = noise_offset  # model.ddpm.noise_offset (objectives.noise_offset)
        # train.prior_loss_weight where the order is order.PairedOrder: each row's weight (subsets.prior_weights)
        self.prior_weight = prior_weight
        self.tags = caption_tags  # the data section where data/tags.py processes the captions, else None
        self.random_crop = random_crop  # where data.wide is: 1.0 for all rows, or each dataset row's 1.0 or 0.0
        # text: a text.source.TextSource for a captioned dataset (the cached embeddings, or the encoders).
        # xflip and caption_dropout: one probability, or one a dataset row (data.subsets' own: subsets.per_row)
        self.text, self.caption_dropout = text, caption_dropout
        self.label_dropout, self.xflip = label_dropout, xflip
        # train.augment: EDM's CIFAR-10 pipe (EDM train.py:143-146) at that probability.
        self.pipe = dataclasses.replace(edm_augment.EDM_CIFAR10, p=augment) if augment else None
        self.rank, self.world, self.grad_accum, self.device = rank, world, grad_accum, torch.device(device)
        self.generator = torch.Generator(device=self.device)
        self.shape = data.shape
        if data.latent is not None:
            self.scale, self.bias = (torch.tensor(data.latent[k], dtype=torch.float32, device=self.device)
                                     .view(1, -1, 1, 1) for k in ("scale", "bias"))

    def make(self, step: int, global_indices: np.ndarray, bucket: int | None = None) -> Batch:
        """The batch of `step` from the global batch `global_indices` (all of `bucket`, in a bucketed dataset)."""
        cuda = self.device.type == "cuda"
        mine = global_indices[self.rank::self.world]
        shape = self.data.shape_of(bucket)
        # Label dropout and x-flips of this step's rows (augment.masks, pure functions of the position).
        # data.subsets' own probabilities: each row's, compared with the same draws as the run's one
        xflip = self.xflip if np.ndim(self.xflip) == 0 else self.xflip[mine]
        caption_dropout = self.caption_dropout if np.ndim(self.caption_dropout) == 0 else self.caption_dropout[mine]
        drops, flips = augment.masks(self.seed, step, self.global_batch, self.rank, self.world, self.label_dropout,
                                     xflip)
        latent = self.data.latent is not None
        rows, labels = read_rows(self.data, mine, pin=cuda, flip=flips if latent else None, bucket=bucket)
        cut = None  # data.random_crop: this step's windows and where they were cut (data/wide.py)
        if getattr(self.data, "wide", None) is not None:
            u_top, u_left = (rank_slice(augment.uniforms(self.seed, augment.CROP + k, step, self.global_batch),
                                        self.rank, self.world) for k in (0, 1))
            w, h = (self.data.resolution,) * 2 if bucket is None else self.data.buckets.sizes[bucket]
            on = np.ones(len(mine), bool) if np.ndim(self.random_crop) == 0 else self.random_crop[mine] > 0
            pixels, where = self.data.wide.crops(mine[on], u_top[on], u_left[on], w, h)
            rows.numpy()[on] = pixels  # the others keep their centred cut
            if bucket is not None:
                cut = np.asarray(self.data.buckets.meta[mine][:, 2:4], dtype=np.int64)
                cut[on] = where
        if latent:
            flips = np.zeros_like(flips)  # flipped already: those rows are the mirrored images' latents
        images = rows.to(self.device, non_blocking=True) if latent else to_float(rows.to(self.device, non_blocking=True))
        labels = labels.to(self.device, non_blocking=True)
        if self.text is not None:  # a text run: the Text of each row's caption travels where labels do
            u, drop = augment.captions(self.seed, step, self.global_batch, self.rank, self.world, caption_dropout)
            ids = self.data.captions.pick(mine, u)
            ids[drop] = 0  # texts[0] is the empty caption, the unconditional branch of guidance
            labels = labels if self.data.num_classes else None
            if self.tags is None:
                labels = self.text.take(ids, self.device, labels)
            else:  # data.shuffle_caption / caption_tag_dropout: this step's captions, encoded now (data/tags.py)
                own = np.arange(self.global_batch)[self.rank::self.world]
                texts = tags.rows([self.data.captions.texts[i] for i in ids], self.seed, step, own, self.tags)
                labels = dataclasses.replace(self.text.encode(texts, self.device), labels=labels)
            if bucket is not None:  # SDXL's size conditioning of each row: its original size, crop and bucket
                labels = dataclasses.replace(labels, sizes=self._sizes(mine, bucket, cut))
        # Every rank draws the whole global batch and keeps its rows (rank r: rows r::world), so row i
        # is the same for any process count. That is O(global batch) per rank; on a GPU it is one kernel
        # at memory speed (4096 x 3 x 64 x 64 floats is 200 MB, a fraction of a millisecond), and on a
        # CPU the global batch is the local one at the process counts that make sense there. Chunked
        # draws that skip other ranks' rows would tie the draws to how positions are dealt out.
        self.generator.manual_seed(noise_seed(self.seed, step))
        rnd, noise = edm.draw_noise(self.generator, self.global_batch, shape, self.device)
        rnd, noise = rnd[self.rank::self.world], noise[self.rank::self.world].contiguous()
        if latent:  # this step's sample of each latent, drawn for the whole global batch after the noise
            eps = torch.randn((self.global_batch, *shape), generator=self.generator, device=self.device)
            mean, std = images.chunk(2, dim=1)
            images = ((mean + std * eps[self.rank::self.world]) * self.scale + self.bias).contiguous()
        if self.noise_offset:  # diffusers' offset noise: noise + offset * randn(b, c, 1, 1), drawn last (0: no draw)
            off = torch.randn((self.global_batch, shape[0], 1, 1), generator=self.generator, device=self.device)
            noise = ddpm.offset_noise(noise, off[self.rank::self.world], self.noise_offset)
        parts = (x.tensor_split(self.grad_accum) for x in (images, labels, rnd, noise))
        # The masks on the device here, so that the loop never copies them from pageable memory.
        masks = [(augment.to_device(d, self.device, cuda), augment.to_device(f, self.device, cuda))
                 for d, f in zip(np.split(drops, self.grad_accum), np.split(flips, self.grad_accum))]
        weights = []
        if self.prior_weight is not None:
            coef = subsets.prior_weights(self.global_batch, self.prior_weight)[self.rank::self.world]
            weights = [torch.from_numpy(c).to(self.device) for c in np.split(coef, self.grad_accum)]
        of = getattr(self.data, "subsets", None)
        counts = None if of is None else np.bincount(of[global_indices], minlength=len(self.data.subset_names))
        return Batch(step, mine, list(zip(*parts)), masks, self._augments(step, cuda, shape), self.pipe, bucket, counts,
                     weights)

    def _sizes(self, rows: np.ndarray, bucket: int, cut: np.ndarray | None = None) -> torch.Tensor:
        """(B, 6) float32: original height, width, crop top, left, target height, width of each row, in pixels
        (StableDiffusionXLPipeline's add_time_ids order); `cut`: the step's random crops' top and left."""
        w, h = self.data.buckets.sizes[bucket]
        meta = np.asarray(self.data.buckets.meta[rows], dtype=np.float32)
        if cut is not None:
            meta[:, 2:4] = cut
        full = np.concatenate([meta, np.tile(np.float32([h, w]), (len(rows), 1))], axis=1)
        return torch.from_numpy(full).to(self.device, non_blocking=True)

    def _augments(self, step: int, cuda: bool, shape: tuple) -> list:
        """This rank's rows of the step's augmentation draws, split like the images, each round's on the device;
        the padding comes from the whole global batch (edm_augment.draw), so it is the same for any split."""
        if self.pipe is None:
            return []
        draws = edm_augment.draw(self.seed, step, self.global_batch, self.rank, self.world, self.pipe,
                                 *shape[1:])
        rows = torch.from_numpy(draws.rows)
        return [edm_augment.Draws((r.pin_memory() if cuda else r).to(self.device, non_blocking=True), draws.pad)
                for r in rows.tensor_split(self.grad_accum)]


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Batches for steps [step, until), made DEPTH ahead by one thread; use as a context manager.

    `order` is the checkpointed DataOrder: the thread reads ahead with its own copy, and `next()`
    advances `order` by one batch as it hands one over. `close()` (also on exit from the `with`)
    stops and joins the thread, whether the segment ended, was stopped by a signal or failed.
    """

    def __init__(self, maker: BatchMaker, order: DataOrder, step: int, until: int):
        self.maker, self.order, self.step, self.until = maker, order, step, until
        self._ahead = order.copy()
        self._queue = queue.Queue(maxsize=DEPTH)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._work, name="diffrelay-batches", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.close()

    def _work(self) -> None:
        try:
            if self.maker.device.type == "cuda":
                torch.cuda.set_device(self.maker.device)  # the current device is per thread
            for step in range(self.step, self.until):
                if self._stop.is_set():
                    return
                batch = self._ahead.next_batch()[0]
                bucket = () if self._ahead.bucket is None else (self._ahead.bucket,)
                self._put(self.maker.make(step, batch, *bucket))
        except BaseException as e:  # noqa: BLE001 -- handed to the main thread, which raises it
            self._put(_Failed(e))

    def _put(self, item) -> None:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return
            except queue.Full:
                continue

    def next(self) -> Batch:
        if self.step >= self.until:
            raise RuntimeError(f"no batch after step {self.until}: the segment ends there")
        item = self._queue.get()
        if isinstance(item, _Failed):
            raise item.error
        self.order.advance()
        self.step += 1
        return item

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
        while not self._queue.empty():
            self._queue.get_nowait()
