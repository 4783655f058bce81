"""Prepare's cache of the captions' embeddings: every text of captions.json encoded once, memory-mapped.

A captioned dataset folder made with data.text_encoders and data.text_cache holds, row t for texts[t]:
  text_states.npy  (T, L, D) the combined states (encoders.py), in data.text_dtype (bfloat16 as its uint16 bits:
                   numpy has no bfloat16)
  text_mask.npy    (T, L) uint8, 1 for a token and 0 for padding
  text_pooled.npy  (T, P) the pooled embeddings, when an encoder is pooled
  text.json        the encoders' records, dtype and shapes
Made as data/encoding.py makes latents: the texts are cut into chunks of chunk_rows() texts; rank r of w encodes
chunks r, r + w, ...; each chunk is one file in a work folder beside the dataset (.<dataset>.text/), renamed
into place when whole, tagged with the digest of its texts, the encoders, the dtype and the kind of device (a GPU
rounds otherwise than a CPU). A killed prepare keeps every finished chunk and the next one encodes only the
missing ones; rank 0 then joins them into the dataset folder row by row (never the whole cache in memory). Every
chunk is encoded in the same ROWS-caption calls, so the bytes do not depend on the process count.
"""

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffrelay import io, logs
from diffrelay.errors import UserError
from diffrelay.runtime import mapped
from diffrelay.text import encoders

FORMAT = "diffrelay-text-cache/1"
STATES, MASK, POOLED, INFO = "text_states.npy", "text_mask.npy", "text_pooled.npy", "text.json"
PLAN = "plan.json"
CHUNK_BYTES = 64 << 20  # float32 states of one chunk in memory: 16 captions of T5-XXL at 256 tokens
STORAGE = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2")}
FIX = "rerun `diffrelay prepare --config <your config>`"
PROGRESS_SECONDS = 10


def chunk_rows(recs) -> int:
    """Texts per chunk file: a multiple of encoders.ROWS fixed by the encoders alone."""
    length, width, _ = encoders.layout(recs)
    per_call = encoders.ROWS * length * width * 4
    return encoders.ROWS * max(1, min(64, CHUNK_BYTES // per_call))


def size_bytes(count: int, recs, dtype: str) -> int:
    """Bytes of the cache of `count` texts (for `diffrelay validate`): T5-XXL at 256 tokens, 4096 wide, in
    float16 is about 2 MB a caption (256 x 4096 x 2 bytes): 2 TB for a million captions, where data.text_cache
    false (encoding in the step) is the way."""
    length, width, pooled = encoders.layout(recs)
    item = STORAGE[dtype].itemsize
    return count * (length * width * item + length + pooled * item)


def work_dir(out: Path) -> Path:
    return Path(out).parent / f".{Path(out).name}.text"


def chunk_path(work: Path, index: int) -> Path:
    return work / f"chunk_{index:06d}.safetensors"


def _digest(texts, recs, dtype: str, device_type: str) -> str:
    d = {"texts": list(texts), "encoders": encoders.fingerprint_part(recs), "dtype": dtype, "device": device_type}
    return hashlib.sha256(json.dumps(d, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def write_plan(work: Path, texts, recs, dtype: str) -> None:
    """Rank 0's texts and records, for the other ranks (JSON: no pickle crosses between processes). Chunks of
    other inputs need no removal: each names its inputs (its digest) and is made anew when they differ."""
    try:
        Path(work).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{work}: cannot make prepare's work folder beside the dataset ({e.strerror}); check the "
                        "permissions of --out's parent folder, and that nothing else is named so") from e
    io.write_text(Path(work) / PLAN, json.dumps({"texts": list(texts), "encoders": list(recs), "dtype": dtype},
                                                separators=(",", ":")))


def read_plan(work: Path) -> tuple[list, list, str]:
    d = io.read_json(Path(work) / PLAN, max_bytes=1 << 36)
    return d["texts"], d["encoders"], d["dtype"]


def _spans(count: int, rows: int) -> list[range]:
    return [range(i, min(count, i + rows)) for i in range(0, count, rows)]


def _want(recs, dtype: str, rows: int) -> dict:
    """name: (shape, safetensors dtype) of a chunk of `rows` texts."""
    length, width, pooled = encoders.layout(recs)
    kind = {"float32": "F32", "float16": "F16", "bfloat16": "U16"}[dtype]
    want = {"states": ((rows, length, width), kind), "mask": ((rows, length), "U8")}
    if pooled:
        want["pooled"] = ((rows, pooled), kind)
    return want


def check_chunk(path: Path, digest: str, want: dict) -> bool:
    """A whole chunk made from these inputs (its header only is read)."""
    from safetensors import SafetensorError, safe_open

    if not path.is_file():
        return False
    try:
        with safe_open(path, framework="np") as f:
            if (f.metadata() or {}).get("digest") != digest or set(f.keys()) != set(want):
                return False
            for name, (shape, kind) in want.items():
                s = f.get_slice(name)
                if s.get_dtype() != kind or tuple(s.get_shape()) != shape:
                    return False
    except (OSError, SafetensorError, ValueError):
        return False
    return True


def _stored(t, dtype: str) -> np.ndarray:
    """A float32 tensor as the cache keeps it."""
    import torch

    if dtype == "bfloat16":
        return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)
    return t.to({"float32": torch.float32, "float16": torch.float16}[dtype]).cpu().numpy()


def _entries(entries) -> list[dict]:
    """Records as given (prepare's plan holds them, hashed once) or made from config entries."""
    entries = [dict(e) for e in entries]
    return entries if all(e.get("sha256") for e in entries) else encoders.records(entries)


def load_encoders(entries, device) -> list:
    """The text encoders of `entries` (data.text_encoders or their records), loaded on `device`: prepare loads
    them before its images, so a bad encoder is its first line."""
    import torch

    return [encoders.load(r, torch.device(device)) for r in _entries(entries)]


def build(texts, entries, work: Path, rank: int, world: int, device, dtype: str, loaded=None) -> None:
    """Encode this rank's chunks of `texts` that are not in `work` yet. `entries`: data.text_encoders or their
    records; `loaded`: their encoders, when load_encoders has loaded them already."""
    import torch

    recs, work = _entries(entries), Path(work)
    rows, device = chunk_rows(recs), torch.device(device)
    spans = _spans(len(texts), rows)
    mine = range(rank, len(spans), world)
    todo = []
    for c in mine:
        digest = _digest(texts[spans[c].start:spans[c].stop], recs, dtype, device.type)
        if not check_chunk(chunk_path(work, c), digest, _want(recs, dtype, len(spans[c]))):
            todo.append((c, digest))
    log = logs.get()
    if len(todo) < len(mine):
        log.info(f"prepare: rank {rank} of {world} resumes: {len(mine) - len(todo)} of its {len(mine)} text chunks "
                 f"are already encoded in {work}")
    if not todo:
        return
    # The cache makes the dataset's bytes: no TF32, no kernels picked by a benchmark (data/encoding.py).
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = False, True
    encs = loaded if loaded is not None else [encoders.load(r, device) for r in recs]
    from safetensors.numpy import save

    total, done, t0 = sum(len(spans[c]) for c, _ in todo), 0, time.monotonic()
    last = t0
    for c, digest in todo:
        text = encoders.encode(encs, list(texts[spans[c].start:spans[c].stop]), device)
        arrays = {"states": _stored(text.states, dtype), "mask": text.mask.to(torch.uint8).cpu().numpy()}
        if text.pooled is not None:
            arrays["pooled"] = _stored(text.pooled, dtype)
        io.write_bytes(chunk_path(work, c), save({k: np.ascontiguousarray(v) for k, v in arrays.items()},
                                                 metadata={"digest": digest}))
        done += len(spans[c])
        if time.monotonic() - last >= PROGRESS_SECONDS or done == total:
            last = time.monotonic()
            log.info(f"prepare: rank {rank} of {world} encoded {done}/{total} captions "
                     f"in {logs.fmt_duration(last - t0)}")


def join(work: Path, out: Path, texts, entries, dtype: str, device) -> dict:
    """Write the cache into `out` from the chunks in order, one chunk in memory at a time (rank 0, after every
    rank's build); text.json's content."""
    import torch
    from safetensors.numpy import load_file

    recs, work, out = _entries(entries), Path(work), Path(out)
    device = torch.device(device)
    length, width, pooled = encoders.layout(recs)
    spans, store = _spans(len(texts), chunk_rows(recs)), STORAGE[dtype]
    for c, span in enumerate(spans):
        digest = _digest(texts[span.start:span.stop], recs, dtype, device.type)
        if not check_chunk(chunk_path(work, c), digest, _want(recs, dtype, len(span))):
            raise UserError(f"{chunk_path(work, c)}: missing or unreadable after every rank finished (do all nodes "
                            "see the same folder?); rerun prepare: it encodes only the missing chunks")
    outs = {"states": np.lib.format.open_memmap(out / STATES, "w+", store, (len(texts), length, width)),
            "mask": np.lib.format.open_memmap(out / MASK, "w+", np.uint8, (len(texts), length))}
    if pooled:
        outs["pooled"] = np.lib.format.open_memmap(out / POOLED, "w+", store, (len(texts), pooled))
    for c, span in enumerate(spans):
        arrays = load_file(chunk_path(work, c))
        for name, array in outs.items():
            array[span.start:span.stop] = arrays[name]
    for array in outs.values():
        array.flush()
    del outs
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    info = {"format": FORMAT, "count": len(texts), "length": length, "width": width, "pooled_width": pooled,
            "dtype": dtype, "encoders": recs, "encoded_on": {"device": device.type, "name": name,
                                                             "torch": torch.__version__}}
    io.write_json(out / INFO, info)
    return info


def remove_work(work: Path) -> None:
    """Delete the work folder: only its chunks and plan are ours; anything else there is left, and the folder."""
    work = Path(work)
    io.remove_owned(work, [*work.glob("chunk_*.safetensors"), *work.glob(".chunk_*.safetensors.*.tmp"),
                           *work.glob(f".{PLAN}.*.tmp"), work / PLAN])


@dataclass(frozen=True)
class Cache:
    """An opened cache; the arrays are memory-mapped."""

    path: Path
    info: dict
    states: np.ndarray
    mask: np.ndarray
    pooled: np.ndarray | None

    @property
    def records(self) -> list[dict]:
        return self.info["encoders"]

    def __len__(self) -> int:
        return self.info["count"]

    def take(self, ids, device):
        """The rows `ids` (texts' indices) as a Text on `device`, float32 (copied to it in the stored dtype)."""
        import torch

        from diffrelay.text.condition import Text

        ids = np.asarray(ids, dtype=np.int64)
        for array in (self.states, self.mask, self.pooled):  # one fstat each: a truncated file is one line, not a SIGBUS
            if array is not None:
                mapped.check_intact(array, "its captions' embeddings were read", FIX)

        def load(array):
            a = np.ascontiguousarray(array[ids])
            t = torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else \
                torch.from_numpy(a)
            return t.to(device).float()

        mask = torch.from_numpy(np.ascontiguousarray(self.mask[ids])).to(device).long()
        return Text(load(self.states), mask, None if self.pooled is None else load(self.pooled))


def open(path) -> Cache | None:
    """The cache of a dataset folder, memory-mapped and checked against text.json; None when it has none."""
    path = Path(path)
    if not (path / INFO).exists():
        return None
    info = io.read_json(path / INFO)
    keys = ("format", "count", "length", "width", "pooled_width", "dtype", "encoders")
    if not isinstance(info, dict) or info.get("format") != FORMAT or any(k not in info for k in keys) or \
            info["dtype"] not in STORAGE:
        raise UserError(f"{path / INFO}: not a {FORMAT} file; {FIX}")
    n, store = info["count"], STORAGE[info["dtype"]]
    want = {STATES: ((n, info["length"], info["width"]), store), MASK: ((n, info["length"]), np.dtype(np.uint8))}
    if info["pooled_width"]:
        want[POOLED] = ((n, info["pooled_width"]), store)
    arrays = {}
    for name, (shape, dtype) in want.items():
        io.check_regular_file(path / name, 1 << 46, "text cache array", FIX)  # a FIFO would block np.load
        try:
            arrays[name] = np.load(path / name, mmap_mode="r")
        except (OSError, ValueError) as e:
            raise UserError(f"{path / name}: unreadable ({e}); {FIX}") from e
        if arrays[name].shape != shape or arrays[name].dtype != dtype:
            raise UserError(f"{path / name}: shape {arrays[name].shape} {arrays[name].dtype} does not match {INFO} "
                            f"({shape}, {dtype}); {FIX}")
    return Cache(path, info, arrays[STATES], arrays[MASK], arrays.get(POOLED))

