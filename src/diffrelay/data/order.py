"""Resumable data order and per-step seeds: pure functions of (seed, position), no process group needed.

The global order is a sequence of epoch permutations, each derived from (seed, epoch). Training
consumes it `global_batch` positions per step; rank r takes every world-th position of each step's
global batch. The state is just {seed, consumed}, so a resume on any number of processes with the
same global batch continues the very same global sequence, mid-epoch or not.
"""

import numpy as np

MAX_SEED = 2**63 - 1  # seeds go through numpy's SeedSequence and torch.manual_seed


def derive_seed(*parts: int) -> int:
    """A stable 63-bit seed from several integers (never `seed + epoch`, which collides)."""
    return int(np.random.SeedSequence([int(p) for p in parts]).generate_state(2, np.uint64)[0] >> np.uint64(1))


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0xDA7A, epoch]))).permutation(n)


def global_indices(seed: int, n: int, start: int, count: int) -> np.ndarray:
    """Dataset indices at global positions [start, start + count) of the endless shuffled stream."""
    return _stream(lambda epoch: epoch_permutation(seed, epoch, n), n, start, count)


def _stream(permutation, n: int, start: int, count: int) -> np.ndarray:
    out = np.empty(count, dtype=np.int64)
    pos, filled = start, 0
    while filled < count:
        epoch, offset = divmod(pos, n)
        take = min(n - offset, count - filled)
        out[filled:filled + take] = permutation(epoch)[offset:offset + take]
        pos, filled = pos + take, filled + take
    return out


def rank_slice(batch: np.ndarray, rank: int, world: int) -> np.ndarray:
    """This rank's share of one global batch."""
    return batch[rank::world]


def step_seed(seed: int, step: int, rank: int) -> int:
    """Seed for the draws that belong to a process, not a sample (dropout) at one step."""
    return derive_seed(seed, 0x57E9, step, rank)


def noise_seed(seed: int, step: int) -> int:
    """Seed of one step's noise draws, made for the whole global batch at once.

    Keyed by step, not by rank: every rank draws the same global rows and keeps its own, so the
    draws do not depend on the process count or on how the batch is split for accumulation.
    """
    return derive_seed(seed, 0xD4A3, step)


class DataOrder:
    """Global batches for consecutive steps. State: {"seed", "consumed"}.

    The current epoch's permutation is kept, so a step costs O(batch), not O(dataset): rebuilding
    a permutation of 1.28 M indices every step took 20-70 ms. It holds one int64 per image (10 MB
    at 1.28 M), the only per-image memory of a training process besides the memory-mapped arrays.
    """

    def __init__(self, seed: int, n: int, global_batch: int, consumed: int = 0, repeats: np.ndarray | None = None):
        # data.subsets' repeats: an epoch is a permutation of the rows each listed `repeats` times (None: once, the
        # order of every run without them, unchanged)
        self.repeats = repeats
        self.rows = None if repeats is None else np.repeat(np.arange(n, dtype=np.int64), repeats)
        n = n if self.rows is None else len(self.rows)
        self.seed, self.n, self.global_batch, self.consumed = seed, n, global_batch, consumed
        self._epoch, self._perm = None, None
        self.bucket = None  # BucketOrder: the bucket of the last batch made

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            perm = epoch_permutation(self.seed, epoch, self.n)
            self._epoch, self._perm = epoch, perm if self.rows is None else self.rows[perm]
        return self._perm

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        """(dataset indices, global stream positions) of the next global batch."""
        positions = np.arange(self.consumed, self.consumed + self.global_batch, dtype=np.int64)
        batch = _stream(self._permutation, self.n, self.consumed, self.global_batch)
        self.consumed += self.global_batch
        return batch, positions

    def copy(self) -> "DataOrder":
        """A copy at the same position (the prefetcher reads ahead with one)."""
        if self.rows is None:
            return DataOrder(self.seed, self.n, self.global_batch, self.consumed)
        return DataOrder(self.seed, len(self.repeats), self.global_batch, self.consumed, self.repeats)

    def advance(self) -> None:
        """Count one global batch as consumed without computing it (a read-ahead copy computed it)."""
        self.consumed += self.global_batch

    def state_dict(self) -> dict:
        return {"seed": self.seed, "consumed": self.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.seed, self.consumed = int(state["seed"]), int(state["consumed"])
        self._epoch, self._perm = None, None


class BucketOrder(DataOrder):
    """DataOrder for a bucketed dataset (data.buckets): each global batch holds the rows of one bucket.

    Epoch e: each bucket's rows in a permutation drawn from (seed, e, bucket), cut into whole global batches
    (a bucket's last partial batch waits for the next epoch's permutation, so no image is left out for good),
    and the epoch's batches of every bucket in a permutation drawn from (seed, e). The batch at a stream position
    is then a function of the seed and the position alone, as DataOrder's: the same for any process count, and
    `consumed` is the whole state. Building an epoch is O(dataset), once per epoch; a step is O(batch).
    """

    def __init__(self, seed: int, groups: list, global_batch: int, consumed: int = 0,
                 repeats: np.ndarray | None = None):
        # data.subsets' repeats: each bucket lists a row `repeats` times before its epoch's permutation
        self.groups = [np.asarray(g, dtype=np.int64) for g in groups]
        if repeats is not None:
            self.groups = [np.repeat(g, repeats[g]) for g in self.groups]
        self.per_epoch = sum(len(g) // global_batch for g in self.groups)
        if not self.per_epoch:
            raise ValueError("no bucket fills one global batch")  # bucketed.check_batches says it first
        super().__init__(seed, self.per_epoch * global_batch, global_batch, consumed)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            g, batches, owner = self.global_batch, [], []
            for b, rows in enumerate(self.groups):
                rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([self.seed, 0xB0C7, epoch, b])))
                whole = rows[rng.permutation(len(rows))][: len(rows) // g * g]
                batches += np.split(whole, len(whole) // g) if len(whole) else []
                owner += [b] * (len(whole) // g)
            pick = epoch_permutation(self.seed, epoch, len(batches))
            self._epoch, self._perm = epoch, np.concatenate([batches[i] for i in pick])
            self._owner = np.asarray(owner, dtype=np.int64)[pick]
        return self._perm

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        if self.consumed % self.global_batch:
            raise ValueError(f"a bucketed order resumes at whole batches (consumed {self.consumed})")
        epoch, offset = divmod(self.consumed, self.n)
        self._permutation(epoch)
        self.bucket = int(self._owner[offset // self.global_batch])
        return super().next_batch()

    def copy(self) -> "BucketOrder":
        return BucketOrder(self.seed, self.groups, self.global_batch, self.consumed)


class PairedOrder:
    """Prior preservation (data.subsets marked is_reg): each global batch is `global_batch / 2` instance rows, then as
    many regularisation rows, as diffusers' train_dreambooth.py collates a batch with --with_prior_preservation
    (instance examples, then class examples). Each half is a DataOrder of its own rows (their repeats too), the
    regularisation one seeded apart; both advance by one half a step, so {seed, consumed} (the instance half's)
    is still the whole state, and a batch a function of the seed and the position alone."""

    def __init__(self, seed: int, instance_rows, reg_rows, global_batch: int, consumed: int = 0,
                 repeats: np.ndarray | None = None):
        self.seed, self.global_batch, self.repeats, self.bucket = seed, global_batch, repeats, None
        self.instance_rows = np.asarray(instance_rows, dtype=np.int64)
        self.reg_rows = np.asarray(reg_rows, dtype=np.int64)
        self._build(consumed)

    def _build(self, consumed: int) -> None:
        half = self.global_batch // 2
        rep = (lambda rows: None) if self.repeats is None else (lambda rows: self.repeats[rows])
        self.instance = DataOrder(self.seed, len(self.instance_rows), half, consumed, rep(self.instance_rows))
        self.reg = DataOrder(derive_seed(self.seed, 0x8E6), len(self.reg_rows), half, consumed, rep(self.reg_rows))

    def next_batch(self) -> tuple[np.ndarray, np.ndarray]:
        a, pa = self.instance.next_batch()
        b, pb = self.reg.next_batch()
        return np.concatenate([self.instance_rows[a], self.reg_rows[b]]), np.concatenate([pa, pb])

    def copy(self) -> "PairedOrder":
        return PairedOrder(self.seed, self.instance_rows, self.reg_rows, self.global_batch, self.instance.consumed,
                           self.repeats)

    def advance(self) -> None:
        self.instance.advance()
        self.reg.advance()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "consumed": self.instance.consumed}

    def load_state_dict(self, state: dict) -> None:
        self.seed = int(state["seed"])
        self._build(int(state["consumed"]))
