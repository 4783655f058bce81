"""Encoding a latent dataset: fixed chunks, spread over the ranks of `diffrelay launch`, kept across a kill.

The images are cut into chunks of chunk_rows(resolution) rows, a multiple of encoders.ROWS fixed by the
resolution alone; rank r of w encodes chunks r, r + w, r + 2w, ... Each chunk is encoded in the same ROWS-row
calls whatever the process count, and written as one file in the work folder beside the dataset
(.<dataset>.encoding/chunk_000012.safetensors, renamed into place when whole): the bytes do not depend on the
process count, a killed prepare keeps every finished chunk, and the next one encodes only the missing ones.
Each chunk's header holds a sha256 of its data, its index and the plan's fingerprint (chunk_digest): a resumed
prepare reads every chunk it would keep and encodes again, saying so in one line, one that fails it.
When every rank is done, rank 0 joins the chunks into the dataset folder (atomically) and deletes the work
folder, which only prepare writes.

Ranks meet twice, every rank at both: after rank 0 has planned (a broadcast of its status) and after the last
chunk (a barrier). The group's timeout is long (GROUP_MINUTES): rank 0 may hash a large folder first, and a
resumed rank with little left waits for the others; a rank that dies makes torchrun stop the rest.
"""

import dataclasses
import hashlib
import itertools
import json
import math
from pathlib import Path

import numpy as np

from diffrelay import io, logs
from diffrelay.data import bucketed, datasets, encoders, latents
from diffrelay.data.buckets import file_name
from diffrelay.errors import UserError

CHUNK_BYTES = 48 << 20  # pixels of one chunk in memory: 256 rows up to 256 px, 64 at 512 px
GROUP_MINUTES = 24 * 60
PLAN = "plan.json"
MAX_PLAN_BYTES = 1 << 36


def chunk_rows(resolution: int) -> int:
    per_call = encoders.ROWS * resolution * resolution * 3
    return encoders.ROWS * max(1, min(16, CHUNK_BYTES // per_call))


def work_dir(out: Path) -> Path:
    return out.parent / f".{out.name}.encoding"


def chunk_path(work: Path, index: int) -> Path:
    return work / f"chunk_{index:06d}.safetensors"


def write_plan(work: Path, p, device_type: str) -> None:
    """Rank 0's plan, for the other ranks (JSON: no pickle crosses between processes). Chunks already there are
    kept only when they were made from exactly this plan on this kind of device (a GPU's latents and a CPU's
    differ in rounding); otherwise they are removed: they are prepare's own files."""
    d = dataclasses.asdict(p) | {"root": None if p.root is None else str(p.root), "device": device_type}
    try:
        work.mkdir(parents=True, exist_ok=True)
        old = io.read_json(work / PLAN, max_bytes=MAX_PLAN_BYTES) if (work / PLAN).is_file() else None
    except UserError:
        old = None
    except OSError as e:
        raise UserError(f"{work}: cannot make prepare's work folder beside the dataset ({e.strerror}); check the "
                        "permissions of --out's parent folder, and that nothing else is named so") from e
    if old != json.loads(json.dumps(d)):
        stale = list(work.glob("chunk_*.safetensors"))
        if stale:
            logs.get().info(f"prepare: {work} holds {len(stale)} chunks made from other inputs; encoding anew")
        for f in stale:
            f.unlink()
    # Compact: a folder of millions of images makes a plan of hundreds of MB.
    io.write_text(work / PLAN, json.dumps(d, separators=(",", ":")))


def read_plan(work: Path):
    d = io.read_json(work / PLAN, max_bytes=MAX_PLAN_BYTES)
    d.pop("device")
    return datasets.Plan(**d | {"root": None if d["root"] is None else Path(d["root"]),
                                "files": tuple(tuple(f) for f in d["files"])})


def chunk_span(p, index: int) -> range:
    """The source indices of chunk `index`."""
    rows = chunk_rows(p.resolution)
    return range(index * rows, min(p.total, (index + 1) * rows))


def _shapes(p, rows: int, index: int = 0) -> dict:
    """name: (shape with None for the kept-image count, -1 for any count, safetensors dtype) of a chunk file's
    arrays. A bucketed plan's chunk holds each kept row's bucket and sizes, and the latents of each bucket its
    files go to (latents.<bucket index>), in place of the squares' latents."""
    c, side = p.latent["channels"], p.resolution // p.latent["factor"]
    want = {"kept": ((rows,), "U8"), "labels": ((None,), "I64"), "latents": ((None, 2 * c, side, side), "F32")}
    if p.buckets:
        del want["latents"]
        want |= {"bucket": ((None,), "I64"), "sizes": ((None, 4), "I64")}
        for b in sorted({p.bucket_of[i] for i in chunk_span(p, index)} - {-1}):
            w, h = p.buckets[b]
            want[f"latents.{b}"] = ((-1, 2 * c, h // p.latent["factor"], w // p.latent["factor"]), "F32")
    for name in [k for k in want if k.startswith("latents")] if p.xflip else []:
        want[name.replace("latents", "latents_xflip")] = want[name]
    if p.keep_images:
        want["images"] = ((None, p.resolution, p.resolution, 3), "U8")
    return want


def chunk_digest(p, index: int, arrays: dict) -> str:
    """sha256 of a chunk's arrays (names, dtypes, shapes, bytes), its index and the plan's fingerprint: a flipped
    byte, a NaN written into a row or one chunk copied over another all fail it."""
    h = hashlib.sha256(f"{p.fingerprint}:{index};".encode())
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}:{a.dtype.str}:{a.shape};".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def check_chunk(work: Path, p, index: int, verify: bool = False) -> np.ndarray | None:
    """A finished chunk's kept-image mask, read with its header only (and with verify=True its data, against the
    sha256 written in its header); None when the chunk is missing or not what this plan makes (then it is encoded
    again, with one line when it was there)."""
    from safetensors import SafetensorError, safe_open
    from safetensors.numpy import load_file

    path, rows = chunk_path(work, index), len(chunk_span(p, index))
    if not path.is_file():
        return None
    want, problem = _shapes(p, rows, index), "its arrays are not the ones this plan makes"
    try:
        with safe_open(path, framework="np") as f:
            if set(f.keys()) != set(want):
                raise ValueError(problem)
            kept, digest = f.get_tensor("kept"), (f.metadata() or {}).get("sha256")
            n = int(kept.sum()) if kept.shape == (rows,) else -1
            for name, (shape, dtype) in want.items():
                s = f.get_slice(name)
                got = tuple(s.get_shape())
                any_count = got[0] if got else -1  # a -1 entry: any number of rows (a bucket's share of the chunk)
                if s.get_dtype() != dtype or got != tuple(n if d is None else any_count if d == -1 else d for d in shape):
                    raise ValueError(problem)
        if verify and digest != chunk_digest(p, index, load_file(path)):
            problem = ("it has no sha256 of its data (an older diffrelay wrote it)" if digest is None else
                       "its data fail the sha256 written with it (changed since, or copied from another chunk)")
            raise ValueError(problem)
    except (OSError, SafetensorError, ValueError):
        if verify:
            logs.get().warning(f"prepare: {path}: {problem}; encoding it again")
        return None
    return kept.astype(bool)


def encode_chunks(p, work: Path, workers: int, enc, device, rank: int, world: int) -> None:
    """Encode this rank's chunks that are not in `work` yet; `workers` processes decode the images."""
    import contextlib

    import torch
    from safetensors.numpy import save

    # Encoding makes the dataset's bytes: no TF32, no kernels picked by a benchmark (they may change with the
    # batch), as edm2's dataset_tool.py encode sets them.
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    total, rows = p.total, chunk_rows(p.resolution)
    mine = range(rank, math.ceil(total / rows), world)
    todo = [c for c in mine if check_chunk(work, p, c, verify=True) is None]
    if len(todo) < len(mine):
        logs.get().info(f"prepare: rank {rank} of {world} resumes: {len(mine) - len(todo)} of its {len(mine)} "
                        f"chunks are already encoded in {work}")
    spans = [chunk_span(p, c) for c in todo]
    progress = datasets.Progress(sum(map(len, spans)), f"prepare: rank {rank} of {world} encoded", "encoded")
    # The encoder is loaded (CUDA's threads), and under torchrun NCCL's or gloo's threads run: a fork would copy
    # their locks mid-use into the decoding processes (runtime/parallel.py).
    rows_of = datasets.source_rows(p, workers, list(itertools.chain.from_iterable(spans)), start="spawn")
    with contextlib.closing(rows_of) as results:
        for c, span in zip(todo, spans):
            want = _shapes(p, rows, c)  # (only the trailing dimensions are read from it)
            got = [(img, label) for img, label, _ in itertools.islice(results, len(span))]
            arrays = {"kept": np.array([img is not None for img, _ in got], dtype=np.uint8),  # the chunk's rows
                      "labels": np.array([label for img, label in got if img is not None], dtype=np.int64)}
            kept = [(i, img) for i, (img, _) in zip(span, got) if img is not None]
            if p.buckets:  # each image is (square, its bucket's cut, its sizes): the cuts are encoded, by bucket
                arrays["bucket"] = np.array([p.bucket_of[i] for i, _ in kept], dtype=np.int64)
                arrays["sizes"] = np.array([img[2] for _, img in kept], dtype=np.int64).reshape(-1, 4)
                groups = {int(k[8:]): [(i, img[1]) for i, img in kept if p.bucket_of[i] == int(k[8:])]
                          for k in want if k.startswith("latents.")}
                kept = [(i, img[0]) for i, img in kept]
            else:
                groups = {None: kept}
            if p.keep_images:
                arrays["images"] = np.stack([img for _, img in kept]) if kept else \
                    np.zeros((0, *want["images"][0][1:]), np.uint8)
            for b, members in groups.items():
                suffix = "" if b is None else f".{b}"
                for name in ("latents", "latents_xflip") if p.xflip else ("latents",):
                    arrays[name + suffix] = np.zeros((0, *want[name + suffix][0][1:]), np.float32)  # none kept
                if not members:
                    continue
                x = torch.from_numpy(np.stack([img for _, img in members])).permute(0, 3, 1, 2).to(device)
                names = [image_name(p, i) for i, _ in members]
                for name, view in zip(("latents", "latents_xflip"), (x, x.flip(3)) if p.xflip else (x,)):
                    mean, std = encoders.encode(enc, view.contiguous(), p.latent["encoder"], names)
                    arrays[name + suffix] = torch.cat([mean, std], 1).cpu().numpy()
            # C order: the encoder's output keeps the channels-last strides of the permuted images, and safetensors
            # writes an array's memory as it lies.
            arrays = {k: np.ascontiguousarray(v) for k, v in arrays.items()}
            io.write_bytes(chunk_path(work, c), save(arrays, metadata={"sha256": chunk_digest(p, c, arrays)}))
            progress.update(progress.done + len(span))
    logs.get().info(progress.line(final=True))


def image_name(p, index: int) -> str:
    """Source image `index` as a user finds it: a folder's file, else its index in the source."""
    return str(p.root / p.files[index][0]) if p.kind == "folder" and p.root is not None else \
        f"image {index} of {p.source}"


def join(p, work: Path, out: Path) -> tuple[list, list, list]:
    """Write the dataset's arrays into `out` from the chunks in order, one chunk in memory at a time;
    (labels, relative paths, skipped relative paths) of the images kept."""
    from safetensors import safe_open
    from safetensors.numpy import load_file

    total, rows = p.total, chunk_rows(p.resolution)
    paths = [chunk_path(work, c) for c in range(math.ceil(total / rows))]
    kept = []
    for c, path in enumerate(paths):
        kept.append(check_chunk(work, p, c))
        if kept[-1] is None:  # every rank passed the barrier after writing its chunks
            raise UserError(f"{path}: missing or unreadable after every rank finished (do all nodes see the same "
                            "folder?); rerun prepare: it encodes only the missing chunks")
    kept = np.concatenate(kept)
    count = int(kept.sum())
    names = {"images": "images.npy", "latents": latents.ENCODED, "latents_xflip": latents.FLIPPED}
    want = _shapes(p, rows)
    outs = {name: np.lib.format.open_memmap(out / file, mode="w+", shape=(count, *want[name][0][1:]),
                                            dtype={"U8": np.uint8, "F32": np.float32}[want[name][1]])
            for name, file in names.items() if name in want}
    cuts = _bucket_outputs(p, out, paths, kept) if p.buckets else None
    labels, done = [], 0
    for c, path in enumerate(paths):
        arrays = load_file(path)
        with safe_open(path, framework="np") as f:
            digest = (f.metadata() or {}).get("sha256")
        if digest != chunk_digest(p, c, arrays):  # checked when resumed: changed while the ranks encoded
            raise UserError(f"{path}: its data fail the sha256 written with it (changed after it was encoded); "
                            "rerun prepare: it encodes that chunk again")
        n = len(arrays["labels"])
        for name, array in outs.items():
            array[done:done + n] = arrays[name]
        if cuts is not None:
            cuts.add(arrays)
        labels += arrays["labels"].tolist()
        done += n
    for array in outs.values():
        array.flush()
    if cuts is not None:
        cuts.close()
    rels = [f[0] for f, k in zip(p.files, kept) if k] if p.kind == "folder" else [None] * count
    skipped = [f[0] for f, k in zip(p.files, kept) if not k] if p.kind == "folder" else []
    return labels, rels, skipped


def remove_work(work: Path) -> None:
    """Delete the work folder: only its chunks and plan are ours (the plan last: chunks without it are never
    reused, see write_plan); anything else there is left, and so is the folder then."""
    work = Path(work)
    io.remove_owned(work, [*work.glob("chunk_*.safetensors"), *work.glob(".chunk_*.safetensors.*.tmp"),
                           *work.glob(f".{PLAN}.*.tmp"), work / PLAN])


class _BucketOutputs:
    """A bucketed latent dataset's per-bucket arrays (data/bucketed.py), filled chunk by chunk in row order."""

    def __init__(self, p, out: Path, counts: np.ndarray):
        self.out, self.rows, self.meta, self.filled = out, [], [], np.zeros(len(p.buckets), dtype=np.int64)
        c, f = p.latent["channels"], p.latent["factor"]
        self.arrays = {}
        for stem in ("latents", "latents_xflip") if p.xflip else ("latents",):
            for b, ((w, h), n) in enumerate(zip(p.buckets, counts)):
                self.arrays[f"{stem}.{b}"] = np.lib.format.open_memmap(
                    out / file_name(stem, (w, h)), mode="w+", dtype=np.float32, shape=(int(n), 2 * c, h // f, w // f))

    def add(self, arrays: dict) -> None:
        for name, array in self.arrays.items():
            if name in arrays:
                b = int(name.rsplit(".", 1)[1])
                array[self.filled[b]:self.filled[b] + len(arrays[name])] = arrays[name]
        for b in arrays["bucket"]:
            self.rows.append((int(b), int(self.filled[b])))
            self.filled[b] += 1
        self.meta += arrays["sizes"].tolist()

    def close(self) -> None:
        for array in self.arrays.values():
            array.flush()
        bucketed.write_index(self.out, self.rows, self.meta)


def _bucket_outputs(p, out: Path, paths: list, kept: np.ndarray) -> _BucketOutputs:
    """The outputs sized by each bucket's kept rows (read from the chunks' "bucket" arrays)."""
    from safetensors import safe_open

    counts = np.zeros(len(p.buckets), dtype=np.int64)
    for path in paths:
        with safe_open(path, framework="np") as f:
            counts += np.bincount(f.get_tensor("bucket"), minlength=len(p.buckets))
    return _BucketOutputs(p, out, counts)
