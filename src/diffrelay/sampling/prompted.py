"""Sampling a text-conditional snapshot: which prompt and seed each image gets, its Text, and what it is checked for.

Image i of a prompt file is prompts.expand's item i: its prompt, negative prompt, seed (the entry's, else
sample.first_seed + i), guidance, steps and size (the entry's width and height, else the folder's). Every checkpoint
samples the same items, so grids compare across steps, and each image's pixels depend on its own item alone: the
PNGs are byte-identical for any process count and batch size, as class-conditional samples are. The unconditional branch of guidance is the negative prompt's embedding, or
the empty caption's, the one caption dropout trained (diffusers' pipelines use "" the same way).
"""

import hashlib
import itertools
import json
from pathlib import Path

from diffrelay.errors import UserError


def items(path, first_seed: int) -> list:
    """The images of a prompt file, in order (data.prompts.expand)."""
    from diffrelay.data import prompts

    return prompts.expand(prompts.read(path), first_seed)


def held_out(dataset: Path, first_seed: int, limit: int = 0) -> list:
    """One image per held-out caption (the first of each held-out image, data.val_*): the held-out FID's prompts,
    against the held-out images' statistics; seeds first_seed + i. `limit` > 0 keeps the first `limit`."""
    from diffrelay.data import prompts

    if dataset is None:
        raise UserError("a text-conditional snapshot sampled without --config and without --prompts: give a prompt "
                        "file with --prompts, or the run's config, whose held-out captions it then samples")
    path = Path(dataset) / "val" / "captions.json"
    try:
        caps = json.loads(path.read_text(encoding="utf-8"))
        texts = [caps["texts"][row[0]] for row in caps["rows"]]
    except (OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise UserError(f"{path}: no held-out captions ({e}); set data.val_fraction or data.val_path and rerun "
                        "`diffrelay prepare`, or give sample.prompts") from e
    texts = texts[:limit] if limit else texts
    return prompts.expand([prompts.Prompt(prompt=t, negative_prompt=None, seed=None, guidance=None, steps=None)
                           for t in texts], first_seed)


def fingerprint(chosen: list) -> str:
    """The items' identity for the sample folder's key: an edited prompt file resamples, an unchanged one does not."""
    # an entry's own size only where given: folders of files without sizes keep their key
    rows = [[it.prompt, it.negative_prompt, it.seed, it.guidance, it.steps]
            + ([it.width, it.height] if it.width is not None else []) for it in chosen]
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def groups(chosen: list, indices, guidance: float, steps: int, size=None):
    """(guidance, steps, size, indices) runs of indices that share an item's guidance, steps and size (an item
    without them takes sample.guidance, sample.steps and `size`, the folder's (width, height); None: the square):
    one sampler call each, every forward batch of one shape."""
    def knobs(i):
        it = chosen[i]
        return (guidance if it.guidance is None else float(it.guidance), steps if it.steps is None else int(it.steps),
                size if it.width is None else (int(it.width), int(it.height)))
    ordered = sorted(indices, key=lambda i: (knobs(i)[:2], knobs(i)[2] or (0, 0), i))
    for (g, n, z), run in itertools.groupby(ordered, key=knobs):
        yield g, n, z, list(run)


def check(meta: dict, chosen: list, guidance: float, source) -> None:
    """Before any image: guidance needs a network trained with caption dropout. A negative prompt is the
    unconditional branch, so at guidance 1 (the unguided images of a sweep such as [1, 4.5]) it is not used: said
    once here; a run whose every scale is 1 is refused when its config is checked (config.text)."""
    from diffrelay import logs

    recorded = meta.get("config", {})
    # A pipeline's network has its unconditional model from pretraining (sampling/checks.py says why).
    dropout = recorded.get("data", {}).get("caption_dropout", 0) or recorded.get("model", {}).get("pretrained")
    unused = [it for it in chosen if it.negative_prompt and (guidance if it.guidance is None else it.guidance) == 1]
    if unused:
        logs.get().info(f"{len(unused)} prompt(s) with a negative prompt at guidance 1 (e.g. prompt "
                        f"{unused[0].prompt_index + 1}): unguided, the negative prompt is not used")
    for it in chosen:
        g = guidance if it.guidance is None else it.guidance
        if g != 1 and not dropout:
            raise UserError(f"guidance {g:g} for prompt {it.prompt_index + 1}: {source} was trained without "
                            "data.caption_dropout, so it has no unconditional model; use guidance 1 or retrain with it")


def say_cut(text, chosen: list, device, rules=None) -> int:
    """One warning line when prompts (or negative prompts) of `chosen` are longer than a text encoder takes
    (data.prompts.say_cut): loads the TextSource's encoders as its first encode would."""
    from diffrelay.data import prompts
    from diffrelay.text import encoders

    if text.encoders is None:  # as TextSource.encode loads them (each record's sha256: not hashed again)
        text.encoders = [encoders.load(r["entry"] | {"sha256": r["sha256"]}, device) for r in text.records]
    prepare = rules.text if rules is not None else str
    texts = [prepare(t) for it in chosen for t in (it.prompt, it.negative_prompt) if t]
    return prompts.say_cut(text.encoders, texts, "prompts")


def condition(text, chosen: list, device, labels=None, guided: bool = False, null_class: int = 0, rules=None,
              embedded: float | None = None):
    """The Text of the items' prompts (the sampler's conditioning); with guidance, its null rows are each item's
    negative prompt, or the empty caption, with the contract's null class when class labels ride along. `rules`:
    the pipeline's own treatment of prompts (pretrained.PromptRules): PixArt's lower-casing, and SDXL's zero
    states and pooled embedding for an item without a negative prompt. `embedded`: a guidance-distilled network's
    guidance input (FLUX.1-dev), as FluxPipeline makes it: torch.full([1], guidance_scale, dtype=float32) a row."""
    import torch

    prepare = rules.text if rules is not None else str
    cond = text.encode([prepare(it.prompt) for it in chosen], device)
    cond.labels = labels
    if embedded is not None:
        cond.guidance = torch.full((len(chosen),), float(embedded), dtype=torch.float32, device=device)
    if guided:
        null = text.encode([prepare(it.negative_prompt or "") for it in chosen], device)
        empty = [i for i, it in enumerate(chosen) if it.negative_prompt is None]
        if rules is not None and rules.zeros and empty:
            null.states[empty] = 0
            if null.pooled is not None:
                null.pooled[empty] = 0
        null.labels = None if labels is None else labels.new_full(labels.shape, null_class)
        cond.null = null
    return cond


def sidecar(png: Path) -> Path:
    """The prompt file beside an image: 000012.png -> 000012.txt (as CLIP score reads it)."""
    return png.with_suffix(".txt")


def refuse_mismatch(meta: dict, has_prompts: bool, source) -> None:
    """A text network asked to sample with class labels (no prompts), and the reverse, each in one line."""
    text = meta.get("text") is not None
    if text and not has_prompts:
        raise UserError(f"{source}: a text-conditional network; give it prompts (sample.prompts, --prompts FILE), "
                        "not class labels")
    if has_prompts and not text:
        raise UserError(f"sample.prompts (--prompts): {source} is not text-conditional (trained without captions); "
                        "drop the prompts, or sample a text run's snapshot")
