"""Text encoders (data.text_encoders): local transformers folders, tokenised and combined as diffusers' pipelines do.

Each entry is a folder written by save_pretrained: CLIPTextModel, CLIPTextModelWithProjection, BertModel or
T5EncoderModel with its tokenizer (in the folder, or in a diffusers pipeline's sibling tokenizer[_N]/ folder), weights in
safetensors only. Nothing is downloaded (local_files_only) and no pickle is opened: a folder with .bin or .pt
weights only is refused before a byte of them is read.

Tokenisation, as diffusers 0.42's pipelines (benchmarks/checks/check_text_encoding.py compares encode with their
encode_prompt):
  CLIP  padding="max_length", max_length 77 (tokenizer.model_max_length, = CLIP's max_position_embeddings),
        truncation; the encoder gets no attention mask (its causal mask already hides the padding) and the
        network attends to every position (the SD and SDXL UNets get no encoder_attention_mask): mask all 1.
  T5    padding="max_length", max_length 256 unless set (SD3's max_sequence_length; PixArt-Sigma uses 300,
        PixArt-alpha 120), truncation. use_mask true (default): the encoder gets the attention mask, as
        PixArt's encode_prompt passes it, and the mask travels with the states (PixArt's transformer gets it
        as encoder_attention_mask). use_mask false: SD3's _get_t5_prompt_embeds, which calls the T5 with no
        mask (the padding tokens attended); the mask is then all ones, as SD3's transformer takes no mask at
        all (SD3Transformer2DModel.forward has no such argument). A CLIP ignores use_mask.
  Bert  (HunyuanDiT's bilingual CLIP text tower, text_encoder/) padding="max_length", max_length 77 unless set
        (pipeline_hunyuandit's encode_prompt, text_encoder_index 0), truncation; use_mask true (default): the
        encoder gets the attention mask and the mask travels with the states (HunyuanDiT's transformer gets it
        as text_embedding_mask), as a T5's; [0] = last_hidden_state.
  layer last = last_hidden_state (CLIP's after its final layer norm: SD 1.x, PixArt); penultimate =
        hidden_states[-2], without the final norm (SDXL's and SD3's CLIP choice, clip_skip None); none = no
        states at all, the pooled embedding only (FLUX.1's CLIP: FluxPipeline._get_clip_prompt_embeds keeps
        its pooler_output; the states are the T5's alone).
  pooled CLIPTextModelWithProjection's text_embeds (SDXL's second CLIP, both of SD3's), CLIPTextModel's
        pooler_output; a T5 has none.
Several encoders: the CLIPs' states concatenated along the features (SDXL: 768 + 1280), then a T5 after them
along the sequence, the CLIP block zero-padded to its width (SD3: 77 + 256 tokens, 4096 wide); pooled
embeddings concatenated in order (SD3: 768 + 1280). A BertModel stands where a CLIP does (HunyuanDiT: 77 Bert
tokens 1024 wide, zero-padded to the mT5's 2048, then 256 mT5 tokens), its mask in front of the T5's.

A caption's embedding does not depend on the captions encoded with it: every call encodes ROWS captions, the
last call padded by repeating a caption, so a caption lands in calls of one shape whatever the list.
"""

import hashlib
from dataclasses import dataclass
from pathlib import Path

from diffrelay import io, logs
from diffrelay.errors import UserError
from diffrelay.text import tokens
from diffrelay.text.tokens import TOKENIZER_FILES, tokenizer_folder  # noqa: F401 -- TOKENIZER_FILES: the tests'

CLASSES = ("CLIPTextModel", "CLIPTextModelWithProjection", "BertModel", "T5EncoderModel")
MODEL_TYPES = {"clip_text_model": "CLIPTextModel", "t5": "T5EncoderModel", "bert": "BertModel"}  # no architectures
T5_LENGTH = 256  # SD3's default max_sequence_length
BERT_LENGTH = 77  # pipeline_hunyuandit's max_sequence_length for its BertModel
ROWS = 16  # captions per encoder call, padded (see the docstring)
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
PROBE = "a photo"  # its ids show the special tokens' places, whatever the vocabulary spells of it
FIX = ("give data.text_encoders a folder written by transformers' save_pretrained (e.g. a diffusers pipeline's "
       "text_encoder/) with its tokenizer")
# What joins a dataset's fingerprint: what the embeddings are, not where the folder lies.
RECORD_KEYS = ("class", "sha256", "length", "layer", "pooled", "states_dim", "pooled_dim", "use_mask")


def is_t5(record: dict) -> bool:
    return record["class"] == "T5EncoderModel"


def is_bert(record: dict) -> bool:
    return record["class"] == "BertModel"


def _folder(entry: dict) -> Path:
    path = Path(entry["path"]).expanduser()
    if not path.exists():
        raise UserError(f"{path}: data.text_encoders: folder not found; text encoders load from local folders only; "
                        f"nothing is downloaded: {FIX}")
    if not path.is_dir():
        raise UserError(f"{path}: data.text_encoders: is a file, not a folder; {FIX}")
    return path


def _config(path: Path) -> dict:
    if not (path / "config.json").is_file():
        raise UserError(f"{path / 'config.json'}: data.text_encoders: no config.json; {FIX}")
    c = io.read_json(path / "config.json")
    if not isinstance(c, dict):
        raise UserError(f"{path / 'config.json'}: data.text_encoders: not a transformers config; {FIX}")
    return c


def _class(path: Path, c: dict) -> str:
    names = c.get("architectures") or [MODEL_TYPES.get(c.get("model_type"))]
    if len(names) != 1 or names[0] not in CLASSES:
        raise UserError(f"{path}: data.text_encoders: a {'/'.join(map(str, names))} (config.json); the text encoders "
                        f"supported are {', '.join(CLASSES)}; save one of them with save_pretrained")
    return names[0]


def weight_files(path: Path) -> list[Path]:
    """The *.safetensors files of the folder, sorted; refused when its weights are pickles only (none is read)."""
    files = sorted(path.glob("*.safetensors"))
    for f in files:  # each header, when the config is read: not a traceback after every image is decoded
        why = io.safetensors_problem(f) or io.shards_problem(path)
        if why:
            raise UserError(f"{f}: data.text_encoders: {why}; restore the file, or save the encoder again with "
                            "save_pretrained(folder)")
    if files:
        return files
    pickles = sorted(f for pattern in PICKLES for f in path.glob(pattern))
    if pickles:
        raise UserError(f"{pickles[0]}: data.text_encoders: pickled weights are never loaded (unpickling runs code); "
                        "convert them to safetensors where you trust the file: load the model and "
                        "save_pretrained(folder, safe_serialization=True)")
    raise UserError(f"{path}: data.text_encoders: no *.safetensors weights; {FIX}")


def weights_sha256(files: list[Path]) -> str:
    """sha256 of the weights: the file's own for a single file (as the Hub lists it), else of the sorted
    (name, sha256) lines of the shards."""
    if len(files) == 1:
        return io.sha256_file(files[0])
    lines = "".join(f"{f.name} {io.sha256_file(f)}\n" for f in files)
    return hashlib.sha256(lines.encode()).hexdigest()


def _record(entry: dict, hashed: bool = True) -> dict:
    """An entry's record from its config.json (and its weights' sha256): no weights are loaded."""
    path = _folder(entry)
    c = _config(path)
    cls, files = _class(path, c), weight_files(path)
    layer, pooled, max_length = entry.get("layer", "last"), bool(entry.get("pooled", False)), entry.get("max_length")
    if layer == "none" and not pooled:
        raise UserError(f"{path}: data.text_encoders: layer none (no states) and pooled false: this encoder would "
                        "give nothing; set pooled: true (FLUX.1's CLIP) or layer: last")
    use_mask = bool(entry.get("use_mask", True))  # records made before the setting existed: the mask was passed
    try:
        if cls == "T5EncoderModel":
            if pooled:
                raise UserError(f"{path}: data.text_encoders: pooled: true, but a T5 encoder has no pooled "
                                "embedding; set pooled: false (SD3 pools its CLIPs only)")
            width, pooled_dim, length = int(c["d_model"]), None, max_length or T5_LENGTH
        elif cls == "BertModel":
            positions, width = int(c.get("max_position_embeddings", 512)), int(c.get("hidden_size", 768))
            length, pooled_dim = max_length or BERT_LENGTH, width  # pooler_output
            if length > positions:
                raise UserError(f"{path}: data.text_encoders: max_length {length} is more than this BertModel's "
                                f"{positions} positions; set max_length to at most {positions}")
        else:
            # CLIPTextConfig's defaults, for a config.json that leaves them out.
            positions = int(c.get("max_position_embeddings", 77))
            width, length = int(c.get("hidden_size", 512)), max_length or positions
            pooled_dim = int(c.get("projection_dim", 512)) if cls == "CLIPTextModelWithProjection" else width
            if length > positions:
                raise UserError(f"{path}: data.text_encoders: max_length {length} is more than this CLIP's "
                                f"{positions} positions; set max_length to at most {positions} or null")
    except (KeyError, TypeError, ValueError) as e:
        raise UserError(f"{path / 'config.json'}: data.text_encoders: not a {cls} config ({e!r}); {FIX}") from e
    special = 1 if cls == "T5EncoderModel" else 2  # T5 ends with </s>; CLIP and BERT open and close the text
    if length <= special:
        raise UserError(f"{path}: data.text_encoders: max_length {length} leaves no token for the caption ({cls} "
                        f"spends {special} on its special token{'s' * (special > 1)}): every caption would embed "
                        f"alike; use at least {special + 1}, or null for the model's own")
    return {"class": cls, "path": str(path), "sha256": weights_sha256(files) if hashed else None,
            "max_length": max_length, "layer": layer, "pooled": pooled, "states_dim": width,
            "pooled_dim": pooled_dim if pooled else None, "length": length, "use_mask": use_mask}


def gives_states(record: dict) -> bool:
    return record["layer"] != "none"


def layout(records) -> tuple[int, int, int]:
    """(tokens L, width D, pooled width P, 0 for none) of the encoders combined; one line when they cannot be."""
    clips = [r for r in records if not is_t5(r) and gives_states(r)]
    t5s = [r for r in records if is_t5(r)]
    where = "data.text_encoders"
    if not records:
        raise UserError(f"{where}: empty; list at least one text encoder folder")
    if not any(gives_states(r) for r in records):
        raise UserError(f"{where}: every encoder has layer none; give at least one encoder's states (layer last)")
    if len(t5s) > 1 or (t5s and records[-1] is not t5s[0]):
        raise UserError(f"{where}: {', '.join(r['path'] for r in t5s)}: list the CLIP encoders first and then at "
                        "most one T5 (SD3's order: CLIP-L, CLIP-G, T5-XXL)")
    if len({r["length"] for r in clips}) > 1:
        raise UserError(f"{where}: the CLIP encoders' features are concatenated token by token (SDXL), so they "
                        f"need one length; they have {', '.join(str(r['length']) for r in clips)}: set max_length alike")
    clip_len, clip_dim = (clips[0]["length"] if clips else 0), sum(r["states_dim"] for r in clips)
    if t5s and clip_dim > t5s[0]["states_dim"]:
        raise UserError(f"{where}: the CLIP features ({clip_dim} wide) are zero-padded to the T5's width "
                        f"({t5s[0]['states_dim']}, SD3) and cannot be wider; use a wider T5 or fewer CLIPs")
    pooled = sum(r["pooled_dim"] for r in records if r["pooled"])
    if t5s:
        return clip_len + t5s[0]["length"], t5s[0]["states_dim"], pooled
    return clip_len, clip_dim, pooled


def combined_dims(records) -> dict:
    """{"states": D, "length": L, "pooled": P or 0}: what a network conditioned on these encoders is built for."""
    length, width, pooled = layout(records)
    return {"states": width, "length": length, "pooled": pooled}


def records(entries, hashed: bool = True) -> list[dict]:
    """The records of data.text_encoders from config.json and the weights' sha256, no model loaded (planning,
    `diffrelay validate`); the combination is checked too. hashed False: sha256 None, for the dims alone (the
    Snakefile's network check would read every weight file at each parse)."""
    out = [_record(dict(e), hashed=hashed) for e in entries]
    layout(out)
    return out


def fingerprint_part(recs) -> list[dict]:
    """What of each record joins a dataset's fingerprint (RECORD_KEYS). use_mask joins it only when false: true
    is what every encoder did before the setting existed, so the datasets prepared then keep their fingerprints
    (and records stored then, without the key, read as true)."""
    return [{k: r[k] for k in RECORD_KEYS if k != "use_mask"} | ({} if r.get("use_mask", True) else {"use_mask": False})
            for r in recs]


@dataclass(eq=False)
class Encoder:
    record: dict
    model: object
    tokenizer: object
    warned: bool = False  # the truncation warning is logged once per encoder


def record(encoder: Encoder) -> dict:
    """{class, path, sha256, max_length, layer, pooled, states_dim, pooled_dim, length, use_mask}."""
    return dict(encoder.record)


def _check_tokenizer(tokenizer, c: dict, rec: dict, where: Path) -> None:
    """The tokenizer must be this encoder's: a wrong one gives ids past the embedding table or meaningless
    embeddings, with no error from transformers."""
    vocab, fix = int(c.get("vocab_size", 0)), "give the folder the tokenizer saved with this encoder"
    if len(tokenizer) > vocab:
        raise UserError(f"{where}: data.text_encoders: the tokenizer has {len(tokenizer)} tokens and the encoder "
                        f"{vocab} (config.json vocab_size): they are not a pair; {fix}")
    names = ("pad", "eos") if is_t5(rec) else ("cls", "sep", "pad") if is_bert(rec) else ("bos", "eos", "pad")
    for name in names:
        i = getattr(tokenizer, f"{name}_token_id", None)
        if i is None or not 0 <= i < vocab:
            raise UserError(f"{where}: data.text_encoders: the tokenizer's {name} token id is {i}, not one of the "
                            f"encoder's {vocab}; {fix}")
    # Where the special tokens go, not how the words are spelt: a word-level T5 that lacks "photo" is fine, and
    # tokens.check refuses a vocabulary that spells nothing.
    ids = tokenizer(PROBE)["input_ids"]
    first, last = (tokenizer.cls_token_id, tokenizer.sep_token_id) if is_bert(rec) else (
        None if is_t5(rec) else tokenizer.bos_token_id, tokenizer.eos_token_id)
    if not ids or ids[-1] != last or max(ids) >= vocab or (first is not None and ids[0] != first):
        want = " and ".join(f"{w} {i}" for w, i in (("first", first), ("last", last)) if i is not None)
        raise UserError(f"{where}: data.text_encoders: the tokenizer gives {PROBE!r} the ids {ids[:8]}, where the "
                        f"encoder expects its special tokens {want} and ids below {vocab}; {fix}")
    if rec["pooled"] and not is_t5(rec) and not is_bert(rec):
        # CLIP pools at the first eos token, or, in configs with the legacy eos_token_id 2, at the largest id
        # (transformers' CLIPTextTransformer).
        legacy = c.get("eos_token_id", 49407) == 2  # (CLIPTextConfig's default is 49407)
        want = len(tokenizer) - 1 if legacy else c.get("eos_token_id")
        if tokenizer.eos_token_id != want:
            raise UserError(f"{where}: data.text_encoders: the tokenizer's eos id {tokenizer.eos_token_id} is not "
                            f"where this CLIP pools ({want}); {fix}")


def load(entry: dict, device) -> Encoder:
    """One data.text_encoders entry (defaults filled), loaded in float32 on `device` for inference. An entry that
    is a record (records()) is not hashed again."""
    import torch
    import transformers

    rec = _record(dict(entry), hashed="sha256" not in entry)
    if rec["sha256"] is None:
        rec["sha256"] = entry["sha256"]
    path = Path(rec["path"])
    c, where = _config(path), tokenizer_folder(path)
    tokens.check(where, rec["class"])  # (a damaged spiece.model or a vocabulary of special tokens: one line)
    transformers.utils.logging.disable_progress_bar()  # prepare's stderr holds its own lines
    verbosity = transformers.utils.logging.get_verbosity()
    transformers.utils.logging.set_verbosity_error()  # a failure is said in one line, below
    try:
        tokenizer = transformers.AutoTokenizer.from_pretrained(where, local_files_only=True)
    except Exception as e:  # noqa: BLE001 -- transformers raises many kinds; each is a bad folder here
        first = (str(e).strip().splitlines() or [""])[0][:200]
        fix = "save the encoder's tokenizer there with tokenizer.save_pretrained(folder)"
        raise UserError(f"{where}: data.text_encoders: cannot load the tokenizer ({type(e).__name__}: {first}); "
                        f"{fix}") from e
    finally:
        transformers.utils.logging.set_verbosity(verbosity)
    _check_tokenizer(tokenizer, c, rec, where)
    try:
        model = getattr(transformers, rec["class"]).from_pretrained(path, local_files_only=True, use_safetensors=True,
                                                                    dtype=torch.float32)
    except Exception as e:  # noqa: BLE001 -- safetensors' and transformers' errors: each a bad folder here
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise UserError(f"{path}: data.text_encoders: cannot load the {rec['class']} ({type(e).__name__}: {first}); "
                        f"{FIX}") from e
    model.eval().requires_grad_(False).to(device)
    return Encoder(rec, model, tokenizer)


def _tokens(enc: Encoder, prompts: list[str]):
    """input_ids and attention_mask (ROWS, L) as the pipelines tokenise; a truncated caption is reported once."""
    length = enc.record["length"]
    t = enc.tokenizer(prompts, padding="max_length", max_length=length, truncation=True, return_tensors="pt")
    if not enc.warned:
        # One token more than the limit tells a caption that was cut without tokenising it all.
        longer = enc.tokenizer(prompts, truncation=True, max_length=length + 1)["input_ids"]
        cut = next((p for p, ids in zip(prompts, longer) if len(ids) > length), None)
        if cut is not None:
            enc.warned = True
            logs.get().warning(f"text encoder {enc.record['path']}: captions longer than {length} tokens are cut "
                               f"to {length}, as the pipelines do (the first: {_start(cut)}); this is said once")
    return t["input_ids"], t["attention_mask"]


def _start(text: str, n: int = 60) -> str:
    return repr(text) if len(text) <= n else repr(text[:n]) + "..."


def _forward(enc: Encoder, prompts: list[str], device):
    """(states (ROWS, L, D), mask (ROWS, L) int64, pooled (ROWS, P) or None) of one encoder, float32."""
    import torch

    rec = enc.record
    ids, mask = _tokens(enc, prompts)
    ids, mask = ids.to(device), mask.to(device=device, dtype=torch.int64)
    deep = rec["layer"] == "penultimate"
    with torch.inference_mode():
        if is_t5(rec) or is_bert(rec):
            out = enc.model(input_ids=ids, attention_mask=mask if rec["use_mask"] else None, output_hidden_states=deep)
            if not rec["use_mask"]:
                mask = torch.ones_like(mask)  # every token attended, in the encoder and (SD3) in the network
        else:
            out = enc.model(input_ids=ids, output_hidden_states=deep)
            mask = torch.ones_like(mask)
    states = out.hidden_states[-2] if deep else out.last_hidden_state
    pooled = None
    if rec["pooled"]:  # (BertModel: pooler_output, as CLIPTextModel's)
        pooled = out.text_embeds if rec["class"] == "CLIPTextModelWithProjection" else out.pooler_output
    return states.float(), mask, None if pooled is None else pooled.float()


def _combine(parts: list, recs: list[dict]):
    """The encoders' outputs as SDXL (CLIPs along the features) and SD3 (then a T5 along the tokens) combine them."""
    import torch

    clips = [p for p, r in zip(parts, recs) if not is_t5(r) and gives_states(r)]
    t5 = next((p for p, r in zip(parts, recs) if is_t5(r)), None)
    pooled = [p[2] for p in parts if p[2] is not None]
    pooled = torch.cat(pooled, -1) if pooled else None
    if not clips:
        return t5[0], t5[1], pooled
    states, mask = torch.cat([p[0] for p in clips], -1), clips[0][1]
    if t5 is not None:
        states = torch.nn.functional.pad(states, (0, t5[0].shape[-1] - states.shape[-1]))
        states, mask = torch.cat([states, t5[0]], 1), torch.cat([mask, t5[1]], 1)
    return states, mask, pooled


def encode(encoders: list[Encoder], prompts: list[str], device):
    """The combined embedding (diffrelay.text.condition.Text, float32, on `device`) of each prompt."""
    import torch

    from diffrelay.text.condition import Text

    recs = [e.record for e in encoders]
    length, width, pooled_width = layout(recs)
    prompts = [str(p) for p in prompts]
    states, masks, pooled = [], [], []
    for start in range(0, len(prompts), ROWS):
        chunk = prompts[start:start + ROWS]
        padded = chunk + [chunk[-1]] * (ROWS - len(chunk))
        s, m, p = _combine([_forward(e, padded, device) for e in encoders], recs)
        states.append(s[:len(chunk)])
        masks.append(m[:len(chunk)])
        pooled.append(None if p is None else p[:len(chunk)])
    if not prompts:
        empty = torch.zeros((0, length, width), device=device)
        return Text(empty, torch.zeros((0, length), dtype=torch.int64, device=device),
                    torch.zeros((0, pooled_width), device=device) if pooled_width else None)
    return Text(torch.cat(states), torch.cat(masks), torch.cat(pooled) if pooled_width else None)
