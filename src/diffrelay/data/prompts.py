"""Prompt files (sample.prompts): what a text-conditional run samples at every checkpoint, with which seeds.

Formats, by extension:
  .txt          one prompt a line; blank lines and lines starting with '#' are skipped. A line may carry
                kohya-ss/sd-scripts' sample options after the prompt (library/train_util.py, line_to_prompt_dict:
                the line is split at " --"): --n negative prompt, --d seed, --l guidance scale, --s steps,
                --w width, --h height.
  .yaml / .yml  a list whose entries are strings or mappings, or a mapping holding such a list as `prompts:`
  .jsonl        one JSON object or string a line (blank lines skipped)
  .json         a list of objects or strings (as OneTrainer's samples.json), or {"prompts": [...]}
A mapping's keys are exactly prompt, negative_prompt, seed, guidance, steps, num_images, label (the class the
prompt asks for, by a name of fid.classifier's labels: class_accuracy's, evaluation/class_accuracy.py; it changes
no pixel), width and height (the entry's image size in pixels, diffusers' pipeline argument names: both or
neither; an entry without them takes its folder's size, sample.sizes or the data.resolution square); a string
entry is a
prompt line as in .txt (kohya treats the strings of its .json prompt lists the same way).

Bounds: seed an integer in [0, 2^63 - 1] (seed + num_images - 1 too: image j of the entry uses seed + j);
guidance a number in [0, 100] (as sample.guidance: 1 = off); steps an integer in [1, 10000] (as sample.steps);
num_images an integer in [1, 10000]; width and height integers in [8, 16384] (whether the network takes them is
checked with the config: config/preflight.py). A missing value is None: sampling then uses the sample section's.

`expand` gives every image its prompt and seed, deterministically, so every checkpoint samples the same
images with the same seeds and their grids and CLIP scores compare across training.

Imports the base modules and data (the seed range). Prompt files are read where they are checked (config), sampled
(sampling) and scored (evaluation's class_accuracy reads their labels).
"""

import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import stat
from pathlib import Path

from diffrelay import io, logs
from diffrelay.data.order import MAX_SEED
from diffrelay.errors import UserError

MAX_GUIDANCE = 100.0  # one limit for sample.guidance, --guidance and prompt files (sampling/checks.py: why)
KEYS = ("prompt", "negative_prompt", "seed", "guidance", "steps", "num_images", "label", "width", "height")
MAX_BYTES = 64 << 20  # 64 MiB: hundreds of thousands of prompts; anything bigger is a wrong path
MAX_STEPS = 10_000  # as sample.steps
MAX_IMAGES = 10_000  # per entry
MAX_TOTAL = 10_000_000  # images of a whole file, as sample.num_images
# An image's width and height in pixels, wherever a size comes in: --size, --resolution, sample.sizes (the schema's
# minimum and maximum, tests/test_sizes.py holds them equal), a prompt entry's width and height (kohya's --w, --h).
# 16384 is beyond any network's: a larger side is a typo (100000x16 sampled on for minutes before).
SIDES = (8, 16384)
FORMATS = {".txt": "txt", ".yaml": "yaml", ".yml": "yaml", ".jsonl": "jsonl", ".json": "json"}
# Other tools' names for our keys (kohya's JSON, OneTrainer's samples.json, diffusers' pipelines): named in the
# unknown-key line, since difflib cannot guess that scale means guidance.
ALIASES = {"scale": "guidance", "cfg_scale": "guidance", "guidance_scale": "guidance", "cfg": "guidance",
           "sample_steps": "steps", "diffusion_steps": "steps", "num_inference_steps": "steps",
           "negative": "negative_prompt", "num_images_per_prompt": "num_images", "text": "prompt",
           "caption": "prompt", "image_width": "width", "image_height": "height"}
# kohya's option letters (case-insensitive there too) and the key each sets; --ss, --cn are not ours: a run samples
# with its configured sampler.
OPTIONS = {"n": "negative_prompt", "d": "seed", "l": "guidance", "s": "steps", "w": "width", "h": "height"}
OPTION_HELP = "--n negative prompt, --d seed, --l guidance, --s steps, --w width, --h height"
OPTION = re.compile(r"([A-Za-z]+)(?:\s+(.*))?\Z", re.DOTALL)


def side_problem(*sides) -> str | None:
    """What is wrong with an image's sides in pixels under SIDES, else None: the one rule of every way a size comes in
    (the caller names the flag, key or entry)."""
    bad = next((x for x in sides if isinstance(x, bool) or not isinstance(x, int) or not SIDES[0] <= x <= SIDES[1]),
               None)
    return None if bad is None and sides else f"{bad!r} pixels: each side must be an integer from {SIDES[0]} to {SIDES[1]}"


@dataclasses.dataclass(frozen=True)
class Prompt:
    prompt: str
    negative_prompt: str | None
    seed: int | None
    guidance: float | None
    steps: int | None
    num_images: int = 1
    label: str | None = None  # class_accuracy's intended label; not sampled with
    width: int | None = None  # the entry's own image size in pixels (both or neither); None: its folder's
    height: int | None = None


@dataclasses.dataclass(frozen=True)
class Item:
    """One image to sample: image `index` of the file, the `prompt_index`-th entry's."""

    index: int
    prompt_index: int
    prompt: str
    negative_prompt: str | None
    seed: int
    guidance: float | None
    steps: int | None
    width: int | None = None  # the entry's own size in pixels; None: the folder's (sample.sizes or the square)
    height: int | None = None


def read(path) -> list[Prompt]:
    """The prompts of a file (formats above); one UserError line naming the file, line or entry, and the fix."""
    path = Path(path)
    kind = FORMATS.get(path.suffix.lower())
    if kind is None:
        raise UserError(f"{path}: unknown prompt file type {path.suffix or '(no extension)'!r}; "
                        "use .txt, .yaml/.yml, .jsonl or .json")
    io.check_regular_file(path, MAX_BYTES, what="prompt file", missing="give an existing prompt file (sample.prompts)")
    text = _decode(path)
    out = {"txt": _read_txt, "yaml": _read_yaml, "jsonl": _read_jsonl, "json": _read_json}[kind](path, text)
    if not out:
        raise UserError(f"{path}: no prompts in the file; write one prompt a line (or a list of entries)")
    total = sum(p.num_images for p in out)
    if total > MAX_TOTAL:
        raise UserError(f"{path}: {total} images in all, more than the {MAX_TOTAL} allowed; lower num_images")
    return out


def file_problem(path) -> str | None:
    """Why `path` cannot be read as a prompt file, said before it is opened (config.text names the key), else None: a
    FIFO or a link to /dev/zero would block or never end, and is not "no such file"."""
    p = Path(path).expanduser()
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return "a dangling symlink" if p.is_symlink() else "no such file"
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if stat.S_ISDIR(st.st_mode):
        return "a folder, not a file"
    if not stat.S_ISREG(st.st_mode):
        kind = "a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a device" if stat.S_ISCHR(st.st_mode) or \
            stat.S_ISBLK(st.st_mode) else "a socket"
        return f"{kind}, not a regular file"
    return None


def unguided_negatives(prompts) -> list[tuple[str, str]]:
    """(key, message) for a prompt file (sample.prompts) whose entry has a negative prompt and no guidance above 1:
    a negative prompt is guidance's unconditional branch, so it would never be used (config.text calls it)."""
    for f in [prompts] if isinstance(prompts, str) else prompts or []:
        try:
            entries = read(f)
        except UserError:
            continue  # the file's own problem is said when it is sampled, naming its line
        neg = next((k for k, e in enumerate(entries) if e.negative_prompt and (e.guidance or 1) == 1), None)
        if neg is not None:
            return [(f"sample.prompts={f}", f"prompt {neg + 1} has a negative prompt, and sample.guidance is 1: "
                     "unguided, a negative prompt changes nothing; set sample.guidance above 1 (or a list such as "
                     "[1, 4.5]), give the entry its own guidance, or drop the negative prompt")]
    return []


def say_cut(encoders, texts, what: str = "prompts") -> int:
    """One warning line for a run (sampling's prompts, prepare's captions) whose texts are longer than a text encoder
    takes: how many of them, and each encoder's limit. The encoders cut such a text as the pipelines do (CLIP at 77
    tokens, T5 at its max_length), so nothing else bounds a prompt's length: a 10,000-character prompt samples as its
    first 77 tokens. `encoders`: text.encoders' loaded Encoders (tokenizer, record); each is marked as warned, so its
    own first-cut line (text/encoders.py) is not said again. The number of texts cut by any encoder."""
    unique = list(dict.fromkeys(t for t in texts if t))
    if not encoders or not unique:
        return 0
    cut, per, first = set(), [], None
    for enc in encoders:
        length, n = enc.record["length"], 0
        for start in range(0, len(unique), 1024):  # one token past the limit tells a cut text, without all its tokens
            chunk = unique[start:start + 1024]
            for t, ids in zip(chunk, enc.tokenizer(chunk, truncation=True, max_length=length + 1)["input_ids"]):
                if len(ids) > length:
                    n += 1
                    cut.add(t)
                    first = first or t
        per.append(f"{enc.record['class']} ({enc.record['path']}) {length} tokens: {n}")
        enc.warned = True
    if cut:
        start = repr(first) if len(first) <= 60 else repr(first[:60]) + "..."
        logs.get().warning(f"{len(cut)} of {len(unique)} {what} are longer than a text encoder takes and are cut to "
                           f"its length, as the pipelines do ({'; '.join(per)}); the first: {start}")
    return len(cut)


def expand(prompts: list[Prompt], first_seed: int) -> list[Item]:
    """Every image of `prompts`, in order: entry k's j-th image gets seed (entry seed + j) where the entry has a
    seed, else first_seed + i for image i of the whole list."""
    if isinstance(first_seed, bool) or not isinstance(first_seed, int) or first_seed < 0:
        raise UserError(f"first seed {first_seed!r}: must be an integer >= 0")
    items = []
    for k, p in enumerate(prompts):
        for j in range(p.num_images):
            i = len(items)
            seed = p.seed + j if p.seed is not None else first_seed + i
            if seed > MAX_SEED:
                raise UserError(f"image {i} (prompt {k + 1}): seed {seed} is above {MAX_SEED}; lower sample.first_seed")
            items.append(Item(i, k, p.prompt, p.negative_prompt, seed, p.guidance, p.steps, p.width, p.height))
    return items


def fingerprint(prompts: list[Prompt]) -> str:
    """sha256 of the normalised entries: equal for files that sample the same images, whatever their format."""
    # label, width and height only where given: files without them keep the fingerprint they had
    rows = [{k: v for k, v in dataclasses.asdict(p).items() if k not in ("label", "width", "height") or v is not None}
            for p in prompts]
    return hashlib.sha256(json.dumps(rows, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
                          .encode("utf-8")).hexdigest()


# ---------------------------------------------------------------------------- reading

def _decode(path: Path) -> str:
    data = path.read_bytes()
    try:
        return data.decode("utf-8-sig")  # a byte-order mark (Windows editors write one) is not part of line 1
    except UnicodeDecodeError as e:
        line = data[:e.start].count(b"\n") + 1
        raise UserError(f"{path}: line {line}: not valid UTF-8 (byte 0x{data[e.start]:02x}); "
                        "save the file as UTF-8") from e


def _read_txt(path: Path, text: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        s = line.strip()
        if s and not s.startswith("#"):
            out.append(_from_line(s, f"{path}: line {n}"))
    return out


def _read_jsonl(path: Path, text: str) -> list[Prompt]:
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}: line {n}"
        try:
            value = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{where}: not valid JSON ({e.msg} at column {e.colno}); one object or string a line") from e
        out.append(_entry(value, where))
    return out


def _read_json(path: Path, text: str) -> list[Prompt]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: line {e.lineno}: not valid JSON ({e.msg}); fix the syntax") from e
    entries = _entries(value, path)
    return [_entry(v, f"{path}: entry {k}") for k, v in enumerate(entries, 1)]


def _read_yaml(path: Path, text: str) -> list[Prompt]:
    import yaml

    try:
        node = yaml.compose(text, Loader=yaml.SafeLoader)
        _no_repeated_keys(node, path)
        value = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f": line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}{where}: not valid YAML ({getattr(e, 'problem', None) or e}); fix the syntax") from e
    entries = _entries(value, path)
    if isinstance(node, yaml.MappingNode):
        node = next(v for k, v in node.value if k.value == "prompts")
    lines = [n.start_mark.line + 1 for n in node.value] if isinstance(node, yaml.SequenceNode) else []
    return [_entry(v, f"{path}: entry {k} (line {lines[k - 1]})" if lines else f"{path}: entry {k}")
            for k, v in enumerate(entries, 1)]


def _no_repeated_keys(node, path: Path) -> None:
    """PyYAML keeps the last of a repeated key silently: a prompt would vanish without a word."""
    import yaml

    stack = [node]
    while stack:
        n = stack.pop()
        if isinstance(n, yaml.MappingNode):
            seen = set()
            for k, v in n.value:
                if isinstance(k, yaml.ScalarNode):
                    if k.value in seen:
                        raise UserError(f"{path}: line {k.start_mark.line + 1}: key {k.value!r} appears twice in "
                                        "one entry; delete or merge the duplicate")
                    seen.add(k.value)
                stack.append(v)
        elif isinstance(n, yaml.SequenceNode):
            stack.extend(n.value)


def _entries(value, path: Path) -> list:
    if isinstance(value, dict):
        extra = sorted(map(str, set(value) - {"prompts"}))
        if extra:
            raise UserError(f"{path}: unknown top-level key {extra[0]!r}{_did_you_mean(extra[0], ['prompts'])}; the "
                            "file is a list of prompts, or a mapping with just `prompts:` (that list)")
        value = value.get("prompts")
        if not isinstance(value, list):
            raise UserError(f"{path}: `prompts:` must be a list of prompts (strings or mappings)")
    if value is None:
        raise UserError(f"{path}: no prompts in the file; write a list of prompts (strings or mappings)")
    if not isinstance(value, list):
        raise UserError(f"{path}: a {type(value).__name__}, not a list of prompts; write one entry per prompt, "
                        "each a string or a mapping with prompt:")
    return value


def _did_you_mean(key, choices) -> str:
    if isinstance(key, str) and key.lower() in ALIASES and ALIASES[key.lower()] in choices:
        return f" (did you mean {ALIASES[key.lower()]!r}?)"
    close = difflib.get_close_matches(str(key), choices, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


# ---------------------------------------------------------------------------- one entry

def _entry(value, where: str) -> Prompt:
    if isinstance(value, str):
        return _from_line(value, where)
    if not isinstance(value, dict):
        raise UserError(f"{where}: a {_type(value)}, not a prompt; write a string or a mapping with prompt:")
    for key in value:
        if key not in KEYS:
            raise UserError(f"{where}: unknown key {key!r}{_did_you_mean(key, KEYS)}; the keys are {', '.join(KEYS)}")
    if "prompt" not in value:
        raise UserError(f"{where}: no prompt; add prompt: <the text to sample>")
    return _checked(value, where)


def _from_line(line: str, where: str) -> Prompt:
    """A prompt line with kohya's options: "a cat --n blurry --d 5 --l 7.5 --s 30"."""
    text, *options = (" " + line).split(" --")  # a line that starts with an option has an empty prompt
    values = {"prompt": text}
    for opt in options:
        m = OPTION.match(opt)
        letter = m.group(1).lower() if m else None
        if letter not in OPTIONS:
            raise UserError(f"{where}: unknown option {('--' + opt)[:24]!r}; the options are {OPTION_HELP} "
                            "(a prompt that itself holds ' --' goes in a YAML or JSON file)")
        key, raw = OPTIONS[letter], (m.group(2) or "").strip()
        if key in values:
            raise UserError(f"{where}: option --{letter} given twice; keep one")
        if not raw:
            raise UserError(f"{where}: option --{letter} has no value; write e.g. --{letter} "
                            f"{ {'n': 'blurry', 'd': '42', 'l': '7.5', 's': '30', 'w': '1216', 'h': '832'}[letter] }")
        values[key] = raw if key == "negative_prompt" else _number(raw, key, where)
    return _checked(values, where)


def _number(raw: str, key: str, where: str):
    try:
        return float(raw) if key == "guidance" else int(raw)
    except ValueError as e:
        kind = "a number" if key == "guidance" else "an integer"
        raise UserError(f"{where}: {key} {raw!r} is not {kind}; {_BOUNDS[key]}") from e


_BOUNDS = {"seed": f"give an integer from 0 to {MAX_SEED}",
           "guidance": f"give a number from 0 to {MAX_GUIDANCE:g} (1 = no guidance)",
           "steps": f"give an integer from 1 to {MAX_STEPS}",
           "num_images": f"give an integer from 1 to {MAX_IMAGES}",
           "width": f"give the width in pixels, an integer from {SIDES[0]} to {SIDES[1]}",
           "height": f"give the height in pixels, an integer from {SIDES[0]} to {SIDES[1]}"}


def _type(v) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string", list: "list", dict: "mapping",
            type(None): "null"}.get(type(v), type(v).__name__)


def _checked(v: dict, where: str) -> Prompt:
    prompt = v["prompt"]
    if not isinstance(prompt, str):
        raise UserError(f"{where}: prompt is a {_type(prompt)}; write the text to sample (quote it in YAML)")
    if not prompt.strip():
        raise UserError(f"{where}: empty prompt; write the text to sample, or delete the entry")
    neg = v.get("negative_prompt")
    if neg is not None and not isinstance(neg, str):
        raise UserError(f"{where}: negative_prompt is a {_type(neg)}; write text (quote it in YAML), or leave it out")

    def integer(key, low, high):
        x = v.get(key)
        if x is None:
            return None
        if isinstance(x, bool) or not isinstance(x, int) or not low <= x <= high:
            raise UserError(f"{where}: {key} {x!r} is out of range or not an integer; {_BOUNDS[key]}")
        return x

    seed, steps = integer("seed", 0, MAX_SEED), integer("steps", 1, MAX_STEPS)
    num = integer("num_images", 1, MAX_IMAGES)
    num = 1 if num is None else num
    guidance = v.get("guidance")
    if guidance is not None:
        ok = not isinstance(guidance, bool) and isinstance(guidance, (int, float))
        if not ok or not math.isfinite(guidance) or not 0 <= guidance <= MAX_GUIDANCE:
            raise UserError(f"{where}: guidance {guidance!r} is out of range or not a number; {_BOUNDS['guidance']}")
        guidance = float(guidance)
    if seed is not None and seed + num - 1 > MAX_SEED:
        raise UserError(f"{where}: seed {seed} + num_images {num} passes {MAX_SEED}; give a smaller seed")
    width, height = integer("width", *SIDES), integer("height", *SIDES)
    if (width is None) != (height is None):
        given, missing = ("width", "height") if height is None else ("height", "width")
        raise UserError(f"{where}: {given} without {missing}; give both (the image size in pixels), or neither (the "
                        "folder's size)")
    label = v.get("label")
    if label is not None and (not isinstance(label, str) or not label.strip()):
        raise UserError(f"{where}: label {label!r} is not a name; write one of fid.classifier's label names, or "
                        "leave it out")
    return Prompt(prompt.strip(), None if neg is None else neg.strip(), seed, guidance, steps, num,
                  None if label is None else label.strip(), width, height)
