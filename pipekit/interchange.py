"""Models as files: Hugging Face model dirs in and out, the models pipekit saves read back,
and `convert` between the two. The name and layout mapping itself is `pipekit.models.hf`;
this module only reads and writes.

Hugging Face: `load_hf_checkpoint(dir)` reads config.json with model.safetensors,
pytorch_model.bin or their sharded `*.index.json` forms; `save_hf_checkpoint` writes
config.json + model.safetensors, loadable offline by
`transformers.AutoModelForCausalLM.from_pretrained` (a new dir is built under a
temporary name and renamed into place; over an existing one, only those files are
replaced, each atomically). A tied `lm_head.weight` is left out of the files and not
required on reading.

pipekit: a model pipekit saved is read by `read_saved_model` from either of its forms:
a *pipekit file* `torch.save({"family", "config": asdict(cfg), "state_dict"})` (train's
model.pt, convert's output), its state dict padded, or a resumable checkpoint directory
(`checkpoints/step_N`, or the checkpoints root for its newest), whose full weights
`pipekit.checkpoint` reads. A file whose config predates `vocab_pad_multiple` (unpadded
tables) is read with the default multiple and padded with zero rows.

PEFT: `save_peft_adapter` writes a model's LoRA/DoRA adapters alone as PEFT saves them
(adapter_config.json + adapter_model.safetensors, names and fused modules mapped by
`pipekit.models.peft`), for `peft.PeftModel.from_pretrained` on the transformers model.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from collections.abc import Mapping
from dataclasses import asdict

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .atomic import publish, publish_dir, remove, torch_save_atomic, write_atomic
from .checkpoint import META, CheckpointError, latest_checkpoint, load_full_weights, read_meta, skipped_note
from .layers.lora import merge_adapters
from .models import config_from_dict, family_of
from .models.hf import (
    check_hf_form,
    config_from_hf,
    from_hf_state_dict,
    hf_adapter,
    hf_config_from,
    pad_vocab,
    to_hf_state_dict,
)
from .models.peft import to_peft


# ---- Hugging Face model dirs ---------------------------------------------------
def _weight_files(path: str) -> list[str]:
    """The weights files of a HF model dir, relative to it: model.safetensors or its sharded
    form (the files its .index.json names) preferred, else (sharded) pytorch_model.bin."""
    for single, index in (("model.safetensors", "model.safetensors.index.json"),
                          ("pytorch_model.bin", "pytorch_model.bin.index.json")):
        if os.path.exists(os.path.join(path, single)):
            return [single]
        if os.path.exists(os.path.join(path, index)):
            files = sorted(set(_read_json(os.path.join(path, index), "weight_map")["weight_map"].values()))
            if files:
                return files
    raise FileNotFoundError(f"{path} holds no model.safetensors, pytorch_model.bin or their .index.json")


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a HF model dir (`_weight_files`), read whole."""
    out: dict[str, torch.Tensor] = {}
    for name in _weight_files(path):
        out.update(_read_file(os.path.join(path, name)))
    return out


def _read_file(path: str) -> dict[str, torch.Tensor]:
    """The tensors of one weights file; a missing, truncated or foreign file is a one-line error."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"weights file {path} is missing (named by the model dir's .index.json)")
    try:
        if path.endswith(".safetensors"):
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
        raise ValueError(f"weights file {path} is not readable: truncated, corrupt or not a weights file "
                         f"({type(e).__name__} while reading it)") from e


def _read_json(path: str, *keys: str) -> dict:
    """A JSON object file that has `keys`; anything else is a one-line error naming the file."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
        raise ValueError(f"{path} is not valid JSON ({e})") from e
    if not isinstance(obj, dict):
        raise ValueError(f"{path} holds a JSON {type(obj).__name__}, not an object")
    missing = [k for k in keys if k not in obj]
    if missing:
        raise ValueError(f"{path} lacks {missing}")
    return obj


def load_hf_checkpoint(path: str):
    """Read a HF model dir -> (family, config, pipekit full state dict)."""
    if not os.path.isdir(path):
        what = "is a file" if os.path.exists(path) else "does not exist"
        raise FileNotFoundError(f"{path} {what}; give a Hugging Face model dir (config.json and weights)")
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        raise FileNotFoundError(f"{path} is not a Hugging Face model dir: it has no config.json")
    cfg = config_from_hf(_read_json(config_path))
    family = family_of(cfg)
    return family, cfg, from_hf_state_dict(family, _read_weights(path), cfg)


def _unshared(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Contiguous tensors that share no storage (what safetensors requires)."""
    seen: set[int] = set()
    out = {}
    for name, t in sd.items():
        t = t.detach().cpu().contiguous()
        ptr = t.untyped_storage().data_ptr()
        if ptr in seen:
            t = t.clone()
        seen.add(t.untyped_storage().data_ptr())
        out[name] = t
    return out


_SHARD = re.compile(r"^model-\d+-of-\d+\.safetensors$")  # transformers' names for a sharded export
_INDEX = "model.safetensors.index.json"


def save_hf_checkpoint(family: str, full_sd: dict, cfg, out_dir: str, *, overwrite: bool = False,
                       dtype: torch.dtype | None = None) -> None:
    """Write config.json + model.safetensors for `full_sd` into `out_dir`.

    A new `out_dir` is built under a temporary name and renamed into place whole. An
    existing non-empty one is refused unless `overwrite`; then only the files written
    here are replaced, each atomically (model.safetensors, then config.json), and the
    index and shards of an earlier sharded export are removed, so the dir holds one
    set of weights; every other file (a README, tokenizer files) is left as it is. A
    crash between two files can leave new weights beside the old config.json: a rerun
    completes it. `dtype` casts floating tensors (None: keep)."""
    hf_sd = to_hf_state_dict(family, full_sd, cfg)
    if cfg.tie_embeddings:
        hf_sd.pop("lm_head.weight")  # tied to the token table; transformers re-ties it on loading
    if dtype is not None:
        hf_sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in hf_sd.items()}
    out_dir = os.path.abspath(out_dir)
    check_hf_out_dir(out_dir, overwrite)
    hf_config = hf_config_from(cfg)
    floats = [v.dtype for v in hf_sd.values() if v.is_floating_point()]
    if floats:
        hf_config.dtype = str(floats[0]).removeprefix("torch.")
    _write_dir(out_dir, lambda d: _write_hf_files(d, hf_config, hf_sd))


def _write_dir(out_dir: str, write) -> None:
    """Run `write(dir)` on `out_dir` itself when it exists (each file it writes replaced
    atomically), else on a new dir under a temporary name, renamed into place when complete."""
    if os.path.isdir(out_dir):
        write(out_dir)
        return
    parent, name = os.path.split(out_dir)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed process of the same id
    os.mkdir(tmp)
    try:
        write(tmp)
        publish_dir(tmp, out_dir)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_hf_out_dir(out_dir: str, overwrite: bool, what: str = "Hugging Face model",
                     files: str = "config.json, model.safetensors") -> None:
    """Refuse an `out_dir` that is a file, or a non-empty dir without `overwrite` (`what` it is
    for and the `files` written in it name the refusal)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise FileExistsError(f"{out_dir} is a file; give a directory for the {what}")
    if os.path.isdir(out_dir) and os.listdir(out_dir) and not overwrite:
        raise FileExistsError(f"{out_dir} exists and is not empty; pass overwrite=True (--overwrite) to replace "
                              f"the {what} files in it ({files}; other files are kept)")


def _write_hf_files(out_dir: str, hf_config, hf_sd: dict) -> None:
    _save_safetensors(_unshared(hf_sd), os.path.join(out_dir, "model.safetensors"))
    _remove_sharded_weights(out_dir)
    write_atomic(os.path.join(out_dir, "config.json"), hf_config.to_json_string())


def _save_safetensors(sd: dict[str, torch.Tensor], path: str) -> None:
    """safetensors' save_file, atomically. It writes only to a file name (its in-memory `save`
    would hold a second copy of the weights), so it writes a temporary name beside `path`,
    which `pipekit.atomic.publish` renames into place."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        save_file(sd, tmp, metadata={"format": "pt"})
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        publish(tmp, path)
    finally:
        remove(tmp)


def _remove_sharded_weights(out_dir: str) -> None:
    """Remove an earlier sharded export from `out_dir`: model.safetensors.index.json (first, so
    no reader follows it to a missing shard), then the shards it names and any
    model-NNNNN-of-NNNNN.safetensors. Only safetensors files directly in `out_dir` go."""
    index = os.path.join(out_dir, _INDEX)
    shards = {n for n in os.listdir(out_dir) if _SHARD.match(n)}
    if os.path.isfile(index):
        try:
            named = _read_json(index, "weight_map")["weight_map"].values()
        except (OSError, ValueError):
            named = []
        shards |= {n for n in named if isinstance(n, str) and n == os.path.basename(n) and n.endswith(".safetensors")}
        remove(index)
    for n in sorted(shards - {"model.safetensors"}):
        remove(os.path.join(out_dir, n))


# ---- a model pipekit saved: model.pt, or a resumable checkpoint --------------------------
def save_pipekit_file(family: str, cfg, full_sd: dict, path: str) -> None:
    """torch.save({"family", "config", "state_dict"}) to `path`, atomically."""
    torch_save_atomic({"family": family, "config": asdict(cfg), "state_dict": full_sd}, path)


def read_saved_model(path: str) -> dict:
    """A model pipekit saved, as the dict of a model.pt ("family", "config", "state_dict",
    "tokenizer" where train wrote it), read from any of its forms:

    a file           a pipekit file (train's model.pt, `convert --from-hf`'s output);
    a checkpoint     a resumable checkpoint dir (`checkpoints/step_N`): its full weights,
                     its pipekit.json under "checkpoint" and its path under "path";
    a root           a dir of checkpoints: its newest complete one, as above.

    Anything else is a one-line error (ValueError or OSError). Checkpoints are read by
    `pipekit.checkpoint`."""
    if not os.path.isdir(path):
        return read_model_file(path)
    ckpt = checkpoint_dir(path)
    meta, sd = load_full_weights(ckpt)
    _check_model_record(meta, ckpt)
    return {"family": meta["family"], "config": meta["model_config"], "state_dict": sd, "checkpoint": meta,
            "path": ckpt}


def _check_model_record(meta: dict, ckpt: str) -> None:
    """A checkpoint's pipekit.json names the model it holds (its family and model_config)."""
    if not isinstance(meta.get("family"), str) or not isinstance(meta.get("model_config"), dict):
        raise CheckpointError(f"{ckpt}/pipekit.json lacks the model's family and model_config (it was not "
                              f"written by pipekit train)")


def checkpoint_dir(path: str, say: bool = True) -> str:
    """The checkpoint the directory `path` names: itself, when it is one (an incomplete one
    is a CheckpointError saying what it lacks), or the newest complete checkpoint in it,
    when it is a checkpoints root (`say`: a line on stderr naming newer, damaged step
    directories it passed over). Any other directory is an IsADirectoryError."""
    names = os.listdir(path)
    if META in names or ".metadata" in names or re.match(r"step_\d+", os.path.basename(os.path.normpath(path))):
        read_meta(path)  # raises for an incomplete or unreadable one
        return path
    steps = [n for n in names if n.startswith("step_")]
    if steps:
        newest = latest_checkpoint(path)
        note = skipped_note(path, newest) if newest and say else None
        if note:
            print(note, file=sys.stderr, flush=True)
        if newest is None:
            raise CheckpointError(f"{path} holds no complete checkpoint ({len(steps)} incomplete: "
                                  f"{', '.join(sorted(steps)[:3])}); an interrupted save leaves such a directory")
        return newest
    run = [os.path.join(path, n) for n in ("model.pt", "checkpoints") if n in names]
    if run:
        raise IsADirectoryError(f"{path} is a directory, but not a checkpoint: it holds a run; give {' or '.join(run)}")
    raise IsADirectoryError(f"{path} is a directory, but neither a pipekit checkpoint (a directory holding {META}, "
                            f"such as checkpoints/step_00000100) nor a checkpoints root; give one, or a model.pt")


def read_model_file(path: str) -> dict:
    """The dict of a pipekit model file (`model.pt`: family, config, state_dict, ...), read
    safely (weights only); a missing, truncated or foreign file is a one-line error."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such pipekit file or checkpoint: {path}")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path} is a directory; give a model.pt written by pipekit train or convert")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except PermissionError:
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:  # a cut zip: EINVAL
        raise ValueError(f"{path} is not a readable pipekit model file: truncated, corrupt or not written by "
                         f"pipekit ({type(e).__name__} while reading it)") from e
    if not isinstance(obj, dict) or not {"family", "config", "state_dict"} <= set(obj):
        raise ValueError(f"{path} is not a pipekit model file (a dict with 'family', 'config', 'state_dict')")
    return obj


def load_pipekit_file(path: str):
    """Read a model pipekit saved (`read_saved_model`: a model.pt or a checkpoint) ->
    (family, config, full state dict)."""
    obj = read_saved_model(path)
    check_hf_form(obj["family"], f"{obj.get('path', path)} holds a")
    cfg = config_from_dict(obj["family"], obj["config"])
    sd = _merged(obj["state_dict"], obj, path)
    if "vocab_pad_multiple" not in obj["config"]:  # written before vocab padding: tables of vocab_size rows
        sd = pad_vocab(sd, cfg)
    return obj["family"], cfg, sd


def _merged(sd: dict, obj: dict, path: str) -> dict:
    """`sd` with its LoRA/DoRA adapters folded into the weights they adapt (none: `sd` itself).
    Their scale alpha / rank comes from the file's "lora" record (train's model.pt) or the
    checkpoint's config."""
    if not any(".lora." in k for k in sd):
        return sd
    lora = _lora_settings(obj, path, "merged")
    return merge_adapters(sd, lora["alpha"] / lora["rank"])


def _lora_settings(obj: dict, path: str, done: str) -> dict:
    """The model.lora settings of a saved model's adapters: the file's "lora" record (train's
    model.pt) or the checkpoint's config; their absence is a one-line error (they cannot be `done`)."""
    lora = obj.get("lora") or _run_config(obj).get("model", {}).get("lora")
    if not lora or not lora.get("rank"):
        raise ValueError(f"{obj.get('path', path)} holds LoRA adapters but not their settings (model.lora: rank and "
                         f"alpha), so they cannot be {done}; it was not written by this pipekit's train")
    return lora


def _run_config(obj: dict) -> dict:
    """The run config a checkpoint was saved with ({} for a model file)."""
    return (obj.get("checkpoint") or {}).get("config") or {}


# ---- adapters alone, in PEFT's form --------------------------------------------
PEFT_FILES = "adapter_config.json, adapter_model.safetensors"


def save_peft_adapter(family: str, cfg, full_sd: dict, lora: dict, out_dir: str, *, base: str | None = None,
                      overwrite: bool = False, dtype: torch.dtype | None = None) -> None:
    """Write the LoRA/DoRA adapters of `full_sd` (a pipekit full state dict; `lora`: the run's
    model.lora settings) alone, as PEFT saves them: out_dir/adapter_model.safetensors (PEFT's
    names, `pipekit.models.peft.to_peft`) and adapter_config.json, loadable by
    `peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out_dir)`.
    `base`: the base model's name or dir, written as base_model_name_or_path (None: unknown).
    The dir is written as `save_hf_checkpoint` writes its model dir; `dtype` casts the factors."""
    tensors, config = to_peft(family, cfg, full_sd, lora["rank"], lora["alpha"], lora.get("dropout", 0.0))
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    config["base_model_name_or_path"] = base
    out_dir = os.path.abspath(out_dir)
    check_hf_out_dir(out_dir, overwrite, "PEFT adapter", PEFT_FILES)

    def write(d: str) -> None:
        _save_safetensors(_unshared(tensors), os.path.join(d, "adapter_model.safetensors"))
        write_atomic(os.path.join(d, "adapter_config.json"), json.dumps(config, indent=2, sort_keys=True) + "\n")

    _write_dir(out_dir, write)


def export_peft_adapter(src: str, out_dir: str, *, overwrite: bool = False, dtype: torch.dtype | None = None) -> None:
    """The adapters of a model pipekit saved (`read_saved_model`: a model.pt or a checkpoint)
    -> a PEFT adapter dir (`save_peft_adapter`). base_model_name_or_path is the run's
    model.init where that is a Hugging Face model dir (a checkpoint's config records it)."""
    obj = read_saved_model(src)
    check_hf_form(obj["family"], f"{obj.get('path', src)} holds a")
    sd = obj["state_dict"]
    if not any(".lora." in k for k in sd):
        raise ValueError(f"{obj.get('path', src)} holds no LoRA adapters: --to-peft exports adapters alone (train "
                         f"with model.lora.rank > 0); export the whole model with --to-hf")
    cfg = config_from_dict(obj["family"], obj["config"])
    if "vocab_pad_multiple" not in obj["config"]:
        sd = pad_vocab(sd, cfg)
    init = _run_config(obj).get("model", {}).get("init")
    base = init if isinstance(init, str) and os.path.isfile(os.path.join(init, "config.json")) else None
    save_peft_adapter(obj["family"], cfg, sd, _lora_settings(obj, src, "exported"), out_dir, base=base,
                      overwrite=overwrite, dtype=dtype)


# ---- both ways -----------------------------------------------------------------
def convert(src: str, dst: str, direction: str, *, overwrite: bool = False, dtype: torch.dtype | None = None) -> None:
    """`direction="from_hf"`: HF model dir `src` -> pipekit file `dst`;
    `"to_hf"`: a model pipekit saved (`read_saved_model`: a model.pt, a checkpoint dir or a
    checkpoints root) `src` -> HF model dir `dst` (`save_hf_checkpoint`), adapters merged;
    `"to_peft"`: its adapters alone -> PEFT adapter dir `dst` (`export_peft_adapter`)."""
    if direction == "from_hf":
        if os.path.isdir(dst):
            raise IsADirectoryError(f"{dst} is a directory; give the pipekit file to write, e.g. {dst}/model.pt")
        if os.path.exists(dst) and not overwrite:
            raise FileExistsError(f"{dst} exists; pass overwrite=True (--overwrite) to replace it")
        family, cfg, sd = load_hf_checkpoint(src)
        if dtype is not None:
            sd = {k: v.to(dtype) if v.is_floating_point() else v for k, v in sd.items()}
        save_pipekit_file(family, cfg, sd, dst)
    elif direction == "to_hf":
        check_hf_out_dir(dst, overwrite)  # before reading what may be a large checkpoint
        family, cfg, sd = load_pipekit_file(src)
        save_hf_checkpoint(family, sd, cfg, dst, overwrite=overwrite, dtype=dtype)
    elif direction == "to_peft":
        check_hf_out_dir(dst, overwrite, "PEFT adapter", PEFT_FILES)
        export_peft_adapter(src, dst, overwrite=overwrite, dtype=dtype)
    else:
        raise ValueError(f"unknown conversion direction {direction!r}; valid: 'from_hf', 'to_hf', 'to_peft'")


# ---- a run that starts from weights: each rank reads its own tensors -----------------
def pretrained_config(path: str) -> tuple[str, object]:
    """(family, model config) of the weights at `path`, read without reading the weights: a
    Hugging Face model dir (its config.json), a pipekit model file (memory-mapped, so only
    its small config record is read) or a pipekit checkpoint (its pipekit.json). Anything
    else is a one-line error (OSError or ValueError) naming `path`."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"model.init={path} does not exist; give a Hugging Face model dir (config.json and "
                                "weights), a pipekit model.pt or a pipekit checkpoint")
    if os.path.isdir(path) and os.path.exists(os.path.join(path, "config.json")):
        cfg = config_from_hf(_read_json(os.path.join(path, "config.json")))
        return family_of(cfg), cfg
    if os.path.isdir(path):
        ckpt = checkpoint_dir(path)
        meta = read_meta(ckpt)
        _check_model_record(meta, ckpt)
        return meta["family"], config_from_dict(meta["family"], meta["model_config"])
    return _model_of(_mapped_model_file(path))


def _model_of(obj: dict) -> tuple[str, object]:
    """(family, model config) of a pipekit model file's dict."""
    return obj["family"], config_from_dict(obj["family"], obj["config"])


def _mapped_model_file(path: str) -> dict:
    """A pipekit model file memory-mapped: its tensors are read from disk only where touched."""
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as e:
        raise ValueError(f"model.init={path} is not a Hugging Face model dir, a pipekit model file or a checkpoint "
                         f"({type(e).__name__} while reading it as a pipekit model file)") from e
    if not isinstance(obj, dict) or not {"family", "config", "state_dict"} <= set(obj):
        raise ValueError(f"{path} is not a pipekit model file (a dict with 'family', 'config', 'state_dict')")
    return obj


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}  # safetensors' dtype names


class SafetensorsReader:
    """One .safetensors file, read with plain reads at the offsets its header gives.

    A tensor, or a block of its rows and columns, is read into memory this process owns
    only while it is copied on, so a rank's resident memory holds its own tensors and one
    block, never the file: a memory map (safetensors' `safe_open`) would keep every page it
    touched resident until the file is closed. The format is a little-endian u64 header
    length, a JSON header {name: {dtype, shape, data_offsets}}, then the bytes."""

    def __init__(self, path: str):
        self.path = path
        try:
            size = os.path.getsize(path)
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if not 2 <= n <= size - 8:
                    raise ValueError(f"header length {n} in a file of {size} bytes")
                header = json.loads(fh.read(n))
            self.base = 8 + n
            self.meta = {k: v for k, v in header.items() if k != "__metadata__"}
            for name, m in self.meta.items():
                begin, end = m["data_offsets"]
                want = _ST_DTYPES[m["dtype"]].itemsize * _numel(m["shape"])
                if end - begin != want or self.base + end > size:
                    raise ValueError(f"{name}: {end - begin} bytes at {begin} for {want}, in {size}")
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"weights file {path} is not readable: truncated, corrupt or not a weights file "
                             f"({type(e).__name__} while reading it)") from e

    def keys(self):
        return self.meta.keys()

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.meta[name]["shape"])

    def get_tensor(self, name: str) -> torch.Tensor:
        """The whole tensor `name`, in the file's dtype."""
        m = self.meta[name]
        out = torch.empty(m["shape"], dtype=_ST_DTYPES[m["dtype"]])
        self.read_into(name, out, [(0, n) for n in m["shape"]])
        return out

    def read_into(self, name: str, dst: torch.Tensor, ranges: list[tuple[int, int]],
                  block_bytes: int = 8 << 20) -> int:
        """Copy rows ranges[0] (and, of a 2-d tensor, columns ranges[1]) of tensor `name` into
        `dst` (of the slice's shape, any dtype and strides: cast on the copy), `block_bytes` of
        whole rows at a time; returns the bytes read."""
        m = self.meta[name]
        shape, dtype = m["shape"], _ST_DTYPES[m["dtype"]]
        if not shape:  # a scalar: one row of one element
            shape, dst, ranges = [1], dst.reshape(1), [(0, 1)]
        row_numel = _numel(shape[1:])
        row_bytes = row_numel * dtype.itemsize
        (r0, r1), cols = ranges[0], (ranges[1] if len(ranges) > 1 and len(shape) == 2 else None)
        step = max(1, min(r1 - r0, block_bytes // max(1, row_bytes)))
        done = 0
        whole = torch.empty(step * row_bytes, dtype=torch.uint8)  # one buffer for every block
        with open(self.path, "rb", buffering=0) as fh:
            for r in range(r0, r1, step):
                rr = min(r1, r + step)
                buf = whole[: (rr - r) * row_bytes]
                fh.seek(self.base + m["data_offsets"][0] + r * row_bytes)
                if fh.readinto(buf.numpy()) != buf.numel():  # type: ignore[arg-type]  # an ndarray is a buffer
                    raise ValueError(f"weights file {self.path} is truncated in {name}")
                block = buf.view(dtype).reshape(rr - r, *shape[1:])
                if cols is not None:
                    block = block[:, cols[0]:cols[1]]
                dst[r - r0:rr - r0].copy_(block)
                done += buf.numel()
        return done


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


class LazyWeights(Mapping):
    """The tensors of a Hugging Face model dir by name, each read from its file when it is asked
    for (safetensors: that tensor alone, by `SafetensorsReader`; a pytorch_model.bin:
    memory-mapped), never all at once. The names are the files' own (`_weight_files`, each
    opened once); `bytes_read` counts what was read."""

    def __init__(self, path: str):
        self.path, self.bytes_read = path, 0
        self._open: dict[str, object] = {}
        self._file_of = {n: f for f in _weight_files(path) for n in self._handle(f).keys()}

    def _handle(self, name: str):
        """The open file `name` (relative to the dir) — a safetensors reader or a mapped state dict."""
        if name not in self._open:
            full = os.path.join(self.path, name)
            if not os.path.isfile(full):
                raise FileNotFoundError(f"weights file {full} is missing (named by the model dir's .index.json)")
            if name.endswith(".safetensors"):
                self._open[name] = SafetensorsReader(full)
                return self._open[name]
            try:
                self._open[name] = torch.load(full, map_location="cpu", weights_only=True, mmap=True)
            except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError) as e:
                raise ValueError(f"weights file {full} is not readable: truncated, corrupt or not a weights file "
                                 f"({type(e).__name__} while reading it)") from e
        return self._open[name]

    def reader(self, name: str) -> SafetensorsReader | None:
        """The safetensors reader of the file holding `name` (None: not a safetensors file)."""
        h = self._handle(self._file_of[name])
        return h if isinstance(h, SafetensorsReader) else None

    def __getitem__(self, name: str) -> torch.Tensor:
        h = self._handle(self._file_of[name])
        t = h.get_tensor(name) if isinstance(h, SafetensorsReader) else h[name]
        self.bytes_read += t.numel() * t.element_size()
        return t

    def __iter__(self):
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name) -> bool:
        return name in self._file_of


def _region(module, name: str, t: torch.Tensor, full_shape: tuple[int, ...]):
    """(the tensor to write, the (start, stop) of each dim of the full tensor it holds) of this
    rank's `t`: its tp and ep slices (torch.chunk's), and under ZeRO-3 its own dim-0 rows
    of those (FSDP's local tensor)."""
    from .checkpoint import _axis, _shard_dim
    from .optim.fsdp import _rows, shard_group, sharded

    ranges = [(0, n) for n in full_shape]
    for dim, axis in _shard_dim(t):
        size, index, _ = _axis(module, axis)
        a, b = ranges[dim]
        c = -(-(b - a) // size)
        ranges[dim] = (a + min(index * c, b - a), a + min((index + 1) * c, b - a))
    dst = t.data
    if sharded(t):
        group = shard_group(t)
        a, b = ranges[0]
        lo, hi = _rows(b - a, torch.distributed.get_world_size(group), torch.distributed.get_rank(group))
        ranges[0] = (a + lo, a + hi)
        dst = t.to_local()  # type: ignore[attr-defined]  # a DTensor
    return dst, ranges


def _read_direct(module, adapter, weights: LazyWeights, local: dict) -> set[str]:
    """Read straight into this rank's tensors those that are one Hugging Face tensor under another
    name (or transposed: GPT-2's Conv1D) in a safetensors file: only the rows and columns this
    rank holds, a block at a time, cast on the copy, padded vocabulary rows zero. Returns the
    names set; the others (fused or stacked in Hugging Face, shapes that disagree) are left
    to `adapter.from_hf`."""
    done = set()
    expected = adapter.shapes()
    with torch.no_grad():
        for ours, (theirs, transposed) in adapter.renamed(weights).items():
            t = local.get(ours)
            reader = weights.reader(theirs) if t is not None and theirs in weights else None
            if t is None or reader is None or ours not in expected or len(expected[ours]) > 2:
                continue
            full = tuple(expected[ours])
            hf_shape = reader.shape(theirs)
            pipekit_rows = hf_shape[::-1] if transposed else hf_shape
            vocab_rows = ours in adapter.vocab_names(adapter.cfg) and hf_shape[0] == adapter.cfg.vocab_size
            if tuple(pipekit_rows) != full and not (vocab_rows and tuple(hf_shape[1:]) == full[1:]):
                continue  # left to from_hf, which names the shapes in its error
            dst, ranges = _region(module, ours, t, full)
            if dst.shape != tuple(b - a for a, b in ranges):
                continue
            if transposed:
                dst, ranges = dst.t(), ranges[::-1]
            (r0, r1) = ranges[0]
            have = min(r1, hf_shape[0])  # rows past the file's: the padded vocabulary, zero
            if have > r0:
                weights.bytes_read += reader.read_into(theirs, dst[: have - r0], [(r0, have), *ranges[1:]])
            dst[max(0, have - r0):].zero_()
            done.add(ours)
    return done


def load_pretrained(module, path: str) -> dict:
    """Copy the weights at `path` into `module`, a PipelineModule at any layout: this rank's
    stages, its tensor- and expert-parallel shards (and, under ZeRO-3, its own rows), cast
    to each parameter's dtype. `path`: a Hugging Face model dir (model.safetensors, sharded
    safetensors with their index, or pytorch_model.bin), a pipekit model file or a pipekit
    checkpoint. No communication, except for a checkpoint (read collectively, as a resume is).

    Memory: from a Hugging Face dir, a tensor that is one of the files' under another name
    is read straight into this rank's tensor, only the rows and columns it holds, a block
    of 8 MB at a time (`_read_direct`); the others (GPT-2's fused q/k/v, Mixtral's stacked
    experts, pytorch_model.bin files) a layer at a time, only this rank's layers. So a rank
    holds its own shard plus one block or one such layer. A model file is memory-mapped.
    Returns {"tensors": how many were set, "bytes_read": from the files}.
    A tensor this rank needs and `path` lacks, or one of another shape, is a one-line error."""
    from .checkpoint import _local_tensors, load_checkpoint, load_full_state_dict

    local = _local_tensors(module)
    if os.path.isdir(path) and not os.path.exists(os.path.join(path, "config.json")):
        load_checkpoint(checkpoint_dir(path), module)
        return {"tensors": len(local), "bytes_read": None}
    if os.path.isdir(path):
        family, cfg = pretrained_config(path)
        weights, adapter = LazyWeights(path), hf_adapter(cfg, family)
        done = _read_direct(module, adapter, weights, local)
        for names in _by_layer({n: t for n, t in local.items() if n not in done}):
            part = adapter.from_hf(weights, names=names)
            load_full_state_dict(module, part, strict=False)
            done |= set(part) & names
        unset = sorted(set(local) - done)
        if unset:  # every weight must come from the files (the module may have been built without drawing)
            raise KeyError(f"{path} gives no value for {len(unset)} tensors this rank holds, e.g. {unset[:3]}")
        return {"tensors": len(local), "bytes_read": weights.bytes_read}
    if not os.path.exists(path):
        pretrained_config(path)  # the one-line error for a missing path
    obj = _mapped_model_file(path)
    _, cfg = _model_of(obj)
    sd = obj["state_dict"] if "vocab_pad_multiple" in obj["config"] else pad_vocab(obj["state_dict"], cfg)
    missing = sorted(set(local) - set(sd))
    if missing:
        raise KeyError(f"{path} lacks {len(missing)} tensors this rank needs, e.g. {missing[:3]}")
    load_full_state_dict(module, {n: sd[n] for n in local})
    return {"tensors": len(local), "bytes_read": sum(sd[n].numel() * sd[n].element_size() for n in local)}


def _by_layer(local: dict) -> list[set[str]]:
    """This rank's tensor names grouped by layer (`layers.7.`, `tied.embed.`), in order."""
    groups: dict[str, set[str]] = {}
    for name in local:
        head, rest = name.split(".", 1)
        key = f"{head}.{rest.split('.', 1)[0]}"
        groups.setdefault(key, set()).add(name)
    return list(groups.values())
