"""A diffusers pipeline folder (model.pretrained) read without torch: model_index.json, the parts diffrelay uses and
their classes, pickled weights refused before anything opens them, and the sha256 of every file of those parts
(and of a single-file network checkpoint given with the folder as its config).

Raises UserError with the message alone; pretrained.expand puts the config key in front.
"""

import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from diffrelay import families, io
from diffrelay.errors import UserError

PIPELINES = families.PIPELINES  # model_index.json's _class_name: a family's pipeline
NETWORKS = families.NETWORK_CLASSES  # the unet/ or transformer/ class: a family's network
VAES = ("AutoencoderKL",)
TEXT = ("CLIPTextModel", "CLIPTextModelWithProjection", "BertModel", "T5EncoderModel")
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
FIX = ("give model.pretrained a local folder written by DiffusionPipeline.save_pretrained(folder, "
       "safe_serialization=True); nothing is downloaded")
_SHA: dict = {}  # (path, size, mtime_ns) -> sha256: each file is hashed once a process


# Networks diffusers' from_single_file loads (diffusers.loaders.single_file_model.SINGLE_FILE_LOADABLE_CLASSES), of
# the families that say so.
SINGLE_FILE = tuple(dict.fromkeys(f.network_class for f in families.FAMILIES if f.single_file))
SINGLE_KEY = "single-file/"  # the manifest's key of model.pretrained.path when it is a single file


@dataclass
class Pipeline:
    root: Path
    cls: str  # model_index.json's _class_name
    parts: dict = field(default_factory=dict)  # component name -> class, those present (unet, vae, text_encoder...)
    single: Path | None = None  # the network's single-file checkpoint (model.pretrained {path: file, config: root})

    @property
    def net(self) -> str:
        return "unet" if "unet" in self.parts else "transformer"


def sha256(path: Path) -> str:
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _SHA:
        _SHA[key] = io.sha256_file(path)
    return _SHA[key]


def _single(spec) -> Path | None:
    """model.pretrained.path when it is a single-file checkpoint given with a config folder; pickles refused
    before they are opened."""
    if not (isinstance(spec, dict) and spec.get("config") is not None):
        return None
    path = Path(spec["path"]).expanduser()
    if not path.is_file():
        raise UserError(f"{path}: no such file; with model.pretrained.config, model.pretrained.path is the network's "
                        "single-file checkpoint (.safetensors)")
    if path.suffix != ".safetensors":
        raise UserError(f"{path}: a single-file checkpoint is loaded from .safetensors only (a {path.suffix or 'file'} "
                        "may hold a pickle, which is never loaded); convert it where you trust it, e.g. "
                        "safetensors.torch.save_file(state_dict, 'model.safetensors')")
    why = io.safetensors_problem(path)
    if why:
        raise UserError(f"{path}: model.pretrained.path: {why}; restore the single-file checkpoint")
    return path


def _root(spec) -> Path:
    path = (spec.get("config") or spec["path"]) if isinstance(spec, dict) else spec
    root = Path(path).expanduser()
    if root.is_file():
        raise UserError(f"{root}: a single file; give model.pretrained {{path: {root}, config: <its pipeline "
                        "folder>}} (diffusers' from_single_file(file, config=folder)), or a pipeline folder")
    if not root.is_dir():
        raise UserError(f"{root}: no such folder; model.pretrained must be a local folder written by "
                        "DiffusionPipeline.save_pretrained (not a Hub id: nothing is downloaded)")
    if not (root / "model_index.json").is_file():
        raise UserError(f"{root / 'model_index.json'}: not found, so {root} is no pipeline folder; {FIX}")
    return root


def read(spec) -> Pipeline:
    """The pipeline at model.pretrained (a folder, or {path: a single-file network, config: the folder}); refused
    in one line when diffrelay cannot use it. Reads JSON files only (and hashes nothing)."""
    root = _root(spec)
    index = io.read_json(root / "model_index.json")
    cls = index.get("_class_name") if isinstance(index, dict) else None
    if cls not in PIPELINES:
        raise UserError(f"{root / 'model_index.json'}: _class_name {cls}: not supported; diffrelay fine-tunes "
                        f"{', '.join(PIPELINES)}")
    pipe = Pipeline(root, cls)
    for name, value in index.items():
        if isinstance(value, list) and len(value) == 2 and value[1] is not None and (
                name in ("unet", "transformer", "vae", "scheduler") or name.startswith(("text_encoder", "tokenizer"))):
            pipe.parts[name] = str(value[1])
    for name, allowed in (("vae", VAES), ("scheduler", None)):
        if name not in pipe.parts:
            raise UserError(f"{root / 'model_index.json'}: no {name}; {FIX}")
    if pipe.net not in pipe.parts:
        raise UserError(f"{root / 'model_index.json'}: neither unet nor transformer; {FIX}")
    for name, c in pipe.parts.items():
        allowed = NETWORKS if name == pipe.net else VAES if name == "vae" else TEXT \
            if name.startswith("text_encoder") else None
        if allowed is not None and c not in allowed:
            raise UserError(f"{root / 'model_index.json'}: {name} is a {c}, not supported; diffrelay loads "
                            f"{', '.join(allowed)} there")
        if not (root / name).is_dir():
            raise UserError(f"{root / name}: model_index.json names it ({c}), but the folder is missing; {FIX}")
    for name in pipe.parts:
        _safetensors_only(root / name)
    pipe.single = _single(spec)
    if pipe.single is not None and pipe.parts[pipe.net] not in SINGLE_FILE:
        raise UserError(f"{pipe.single}: a single-file {pipe.parts[pipe.net]} is not loaded (diffusers' from_single_file "
                        f"takes {', '.join(SINGLE_FILE)} here); give model.pretrained a pipeline folder")
    return pipe


def _safetensors_only(folder: Path) -> None:
    """A part whose weights are pickles only is refused; none of them is opened (diffusers and transformers
    are called with use_safetensors=True, so a folder holding both reads its safetensors)."""
    names = os.listdir(folder)
    pickles = sorted(n for n in names if n.endswith(PICKLES))
    if pickles and not any(n.endswith(".safetensors") for n in names):
        raise UserError(f"{folder / pickles[0]}: pickled weights are never loaded (unpickling runs code); convert "
                        "the pipeline where you trust it: DiffusionPipeline.from_pretrained(folder)"
                        ".save_pretrained(out, safe_serialization=True)")


# A part's own weights, as save_pretrained names them (diffusers' and transformers', one file or shards); a variant
# (save_pretrained(variant="fp16"): diffusion_pytorch_model.fp16.safetensors, model.fp16-00001-of-00002...) is not.
PLAIN = re.compile(r"^(diffusion_pytorch_model|model)(-\d+-of-\d+)?\.safetensors\Z")
VARIANT = re.compile(r"^(diffusion_pytorch_model|model)(-\d+-of-\d+)?\.(\w+)(-\d+-of-\d+)?\.safetensors\Z")


def weights_problem(pipe: Pipeline, name: str) -> str | None:
    """Why the part `name` has no weights diffrelay loads (diffusers' and transformers' from_pretrained without a
    variant, as the training scripts call them by default), else None: checked when the config is read, not at
    the first step or in prepare."""
    folder = pipe.root / name
    names = sorted(os.listdir(folder))
    plain = [n for n in names if PLAIN.match(n)]
    for n in plain:  # each header, before an hour of prepare or a training job's start (no tensor is read)
        why = io.safetensors_problem(folder / n)
        if why:
            return f"{folder / n}: {why}; restore the file (copy the pipeline folder again)"
    why = io.shards_problem(folder)
    if why:
        return f"{why}; copy the pipeline folder again"
    if plain:
        return None
    variants = [n for n in names if VARIANT.match(n)]
    if variants:
        v = VARIANT.match(variants[0]).group(3)
        return (f"{folder / variants[0]}: {name}/ holds only the {v} variant's weights (save_pretrained(variant="
                f"{v!r})); diffrelay reads a folder's plain weights, in float32: convert the pipeline once, "
                f"DiffusionPipeline.from_pretrained(folder, variant={v!r}, torch_dtype=torch.float32)"
                ".save_pretrained(out, safe_serialization=True), and give model.pretrained out")
    return f"{folder}: no weights (*.safetensors) in {name}/; {FIX}"


def files(pipe: Pipeline, parts=None) -> list[Path]:
    """model_index.json and every file of the parts (all by default), sorted; hidden files (a Hub cache's
    .cache/) are no part of the pipeline."""
    out = [pipe.root / "model_index.json"]
    for name in sorted(parts if parts is not None else pipe.parts):
        out += sorted(p for p in (pipe.root / name).rglob("*") if p.is_file() and not any(
            s.startswith(".") for s in p.relative_to(pipe.root).parts))
    return out


def manifest(pipe: Pipeline, parts=None) -> dict:
    """{relative path: sha256} of files(pipe, parts), and the single-file checkpoint's under SINGLE_KEY + its name."""
    out = {p.relative_to(pipe.root).as_posix(): sha256(p) for p in files(pipe, parts)}
    if pipe.single is not None:
        out[SINGLE_KEY + pipe.single.name] = sha256(pipe.single)
    return out


def digest(sums: dict) -> str:
    """One sha256 of a manifest (its sorted 'path sha256' lines)."""
    return hashlib.sha256("".join(f"{k} {v}\n" for k, v in sorted(sums.items())).encode()).hexdigest()


def config(pipe: Pipeline, part: str, name: str = "config.json") -> dict:
    path = pipe.root / part / name
    c = io.read_json(path) if path.is_file() else None
    if not isinstance(c, dict):
        raise UserError(f"{path}: missing or not a JSON object; {FIX}")
    return c
