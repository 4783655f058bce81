"""Where a text run's embeddings come from: prepare's cache (data.text_cache), or the encoders themselves.

Training asks a TextSource for the Text of a batch's caption ids (loader.BatchMaker); sampling asks it for the Text
of prompts. Both read the same record: the encoders' records (encoders.records: class, sha256, length, widths) and
the combined dims the network is built for, written into every checkpoint and snapshot as meta["text"], so a
snapshot samples with exactly the encoders it was trained with (or refuses, in one line).
"""

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from diffrelay.errors import UserError


@dataclass
class TextSource:
    records: list  # encoders.record of each encoder, in data.text_encoders order
    dims: dict  # {"states": D, "length": L, "pooled": P or 0}: what the network is built for
    cache: object = None  # cache.Cache of the dataset's texts, or None: encode live
    encoders: list | None = None
    texts: list | None = None  # the dataset's texts (Prepared.captions.texts), for live encoding by id

    def take(self, ids: np.ndarray, device, labels=None):
        """The Text of the dataset's texts `ids` (training), on `device`, carrying the class labels."""
        if self.cache is not None:
            text = self.cache.take(np.asarray(ids), device)
        else:
            text = self.encode([self.texts[i] for i in ids], device)
        text.labels = labels
        return text

    def encode(self, prompts: list[str], device):
        """The Text of prompts, encoded now (sampling, and training with data.text_cache false)."""
        from diffrelay.text import encoders

        if self.encoders is None:
            # with each record's sha256, so load does not hash the weights again
            self.encoders = [encoders.load(r["entry"] | {"sha256": r["sha256"]}, device) for r in self.records]
        return encoders.encode(self.encoders, list(prompts), device)


def record(source: TextSource) -> dict:
    """meta["text"] of checkpoints and snapshots."""
    return {"encoders": source.records, "dims": source.dims}


def for_training(cfg_data, data, device) -> TextSource | None:
    """The TextSource of a run on a prepared dataset, None when it has no captions. The config's encoders must be
    the ones the dataset's cache was made with (by sha256); without a cache they are loaded to encode live."""
    from diffrelay.text import cache, encoders

    if data.captions is None:
        return None
    entries = [dict(e) for e in cfg_data.to_dict()["text_encoders"]]
    if not entries:
        raise UserError(f"{data.path}: a captioned dataset; data.text_encoders is empty: name the text encoders "
                        "(local folders) the captions are encoded with")
    records = encoders.records(entries)
    dims = encoders.combined_dims(records)
    use_cache = cfg_data.text_cache
    if not use_cache:
        return TextSource(_with_entries(records, entries), dims, texts=list(data.captions.texts))
    opened = cache.open(data.path)
    if opened is None:
        raise UserError(f"{data.path}: no text cache (text_states.npy); data.text_cache is true: rerun `diffrelay "
                        "prepare --config <your config>`, or set data.text_cache: false to encode in the step")
    made = [r["sha256"] for r in opened.records]
    if made != [r["sha256"] for r in records]:
        raise UserError(f"{Path(data.path) / 'text.json'}: captions encoded by other text encoders (sha256 "
                        f"{', '.join(m[:12] for m in made)}; data.text_encoders has "
                        f"{', '.join(r['sha256'][:12] for r in records)}); rerun `diffrelay prepare` into a new folder")
    key = _differs(opened.records, records)
    if key:  # the same weights, other settings (layer, length, pooled, mask): other embeddings
        raise UserError(f"{Path(data.path) / 'text.json'}: captions encoded with {key}; data.text_encoders says "
                        "otherwise; set it as the dataset was made, or rerun `diffrelay prepare` into a new folder")
    dtype = cfg_data.text_dtype
    if opened.info.get("dtype", dtype) != dtype:
        raise UserError(f"{Path(data.path) / 'text.json'}: embeddings stored as {opened.info.get('dtype')}; "
                        f"data.text_dtype is {dtype}; set it as the dataset was made, or rerun `diffrelay prepare`")
    return TextSource(_with_entries(records, entries), dims, cache=opened)


def for_sampling(meta: dict, data_cfg: dict | None, snapshot) -> TextSource | None:
    """The TextSource a snapshot samples prompts with: the encoders it was trained with, found at the config's
    data.text_encoders paths (or the recorded ones) and checked by sha256."""
    from diffrelay.text import encoders

    rec = meta.get("text")
    if rec is None:
        return None
    recorded = rec["encoders"]
    entries = [dict(r["entry"]) for r in recorded]
    if data_cfg is not None and data_cfg.get("text_encoders"):
        given = [dict(e) for e in data_cfg["text_encoders"]]
        if len(given) != len(entries):
            raise UserError(f"{snapshot}: trained with {len(entries)} text encoder(s); the config's data.text_encoders "
                            f"names {len(given)}; name the encoders it was trained with")
        entries = [r | {"path": g["path"]} for r, g in zip(entries, given)]
    now = encoders.records(entries)
    for want, got in zip(recorded, now):
        if want["sha256"] != got["sha256"]:
            raise UserError(f"{snapshot}: trained with the text encoder of sha256 {want['sha256'][:12]} "
                            f"({want['path']}); {got['path']} is another ({got['sha256'][:12]}); point "
                            "data.text_encoders at the encoders it was trained with")
    return TextSource(_with_entries(now, entries), rec["dims"])


def _differs(made: list, wanted: list) -> str | None:
    """'encoder k: key=value' of the first setting by which two lists of encoder records differ, else None."""
    from diffrelay.text import encoders

    for k, (a, b) in enumerate(zip(encoders.fingerprint_part(made), encoders.fingerprint_part(wanted))):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return f"encoder {k + 1}: {key}={a.get(key)!r}"
    return None


def check_resume(path, meta: dict, source: "TextSource | None") -> None:
    """A checkpoint continues only with the text encoders it was trained with (by sha256 and settings): with
    data.text_cache false nothing else would notice a folder replaced by other weights."""
    made = (meta.get("text") or {}).get("encoders")
    if source is None or made is None:
        if (made is None) != (source is None):
            raise UserError(f"{path}: trained {'with' if made else 'without'} text encoders; this config is "
                            f"{'not ' if made else ''}a text run; resume it with the config it was trained with")
        return
    shas = [r["sha256"] for r in made] != [r["sha256"] for r in source.records]
    key = "sha256" if shas else _differs(made, source.records)
    if key:
        raise UserError(f"{path}: trained with other text encoders ({key} differs from data.text_encoders: "
                        f"{', '.join(r['sha256'][:12] for r in made)}); point data.text_encoders at the encoders "
                        "it was trained with, or start a new run.name")


def _with_entries(records: list, entries: list) -> list:
    """Each record with the config entry that loads it (path, max_length, layer, pooled)."""
    return [dict(r) | {"entry": dict(e)} for r, e in zip(records, entries)]
