"""The `pipekit` command.

    pipekit train [CONFIG.yaml] [key=value ...] [--show]   train (--show: print the merged config and exit)
    pipekit plan --schedule 1f1b --pp 4 --microbatches 8 [--virtual 2] [--json] [--trace F.json] [--png F.png]
    pipekit prepare-data FILES_OR_DIRS --out DIR [--tokenizer tokenizer.json|TOKENIZER_DIR]
    pipekit convert --from-hf HF_DIR --out model.pt | --to-hf model.pt|CHECKPOINT --out HF_DIR
                    | --to-peft model.pt|CHECKPOINT --out ADAPTER_DIR
    pipekit generate runs/x[/model.pt|/checkpoints[/step_N]]|HF_DIR --prompt "def " [--chat] [--tokenizer T]
    pipekit env
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from . import __version__
from .data import prepare_data
from .plan.command import plan_command
from .run import launch
from .run import reports as told
from .run.env import format_report, report
from .run.generate import generate_text
from .run.start import train_command


def _prepare_data(args: argparse.Namespace) -> int:
    try:
        meta = prepare_data(args.inputs, args.out, tokenizer=args.tokenizer, val_fraction=args.val_fraction,
                            seed=args.seed, overwrite=args.overwrite)
    except ImportError as e:  # --tokenizer needs the optional tokenizers package (chat lines: transformers)
        if e.name not in ("tokenizers", "transformers"):
            raise
        print(f"pipekit prepare-data: {e}", file=sys.stderr)
        return 2
    print(json.dumps(meta, indent=2))
    return 0


def _generate(args: argparse.Namespace) -> int:
    try:
        text = generate_text(args.checkpoint, args.prompt, args.max_new_tokens, args.temperature, args.top_k,
                             args.seed, chat=args.chat, tokenizer=args.tokenizer)
    except ImportError as e:  # the model's tokenizer.json needs the optional tokenizers package (--chat: transformers)
        if e.name not in ("tokenizers", "transformers"):
            raise
        print(f"pipekit generate: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _env(args: argparse.Namespace) -> int:
    print(format_report(report()))
    return 0


_DTYPES = ("bfloat16", "float16", "float32")  # convert --dtype: torch dtypes by name


def _add_convert_args(parser: argparse.ArgumentParser) -> None:
    """Arguments of `pipekit convert`."""
    src = parser.add_mutually_exclusive_group(required=True)
    src.add_argument("--from-hf", metavar="HF_DIR", help="a Hugging Face model dir (config.json + weights)")
    src.add_argument("--to-hf", metavar="MODEL", help="a model pipekit saved: a model.pt, a checkpoint dir "
                     "(checkpoints/step_N) or a checkpoints root (its newest complete checkpoint); LoRA/DoRA "
                     "adapters are merged into the weights")
    src.add_argument("--to-peft", metavar="MODEL", help="a model pipekit saved with LoRA/DoRA adapters (as "
                     "--to-hf): its adapters alone, in PEFT's form (adapter_config.json, adapter_model.safetensors), "
                     "for peft.PeftModel.from_pretrained on the Hugging Face model")
    parser.add_argument("--out", required=True, help="the pipekit file (--from-hf), HF model dir (--to-hf) or PEFT "
                        "adapter dir (--to-peft) to write")
    parser.add_argument("--dtype", choices=_DTYPES, default=None, help="cast floating weights (default: keep)")
    parser.add_argument("--overwrite", action="store_true",
                        help="replace an existing --out file, or the model files in an existing --out dir "
                             "(other files in it are kept)")


def _convert(args: argparse.Namespace) -> int:
    """Run `pipekit convert`; 0 on success, 2 with a message on stderr for bad input."""
    import torch

    from .interchange import convert

    direction, src = next((d, s) for d, s in (("from_hf", args.from_hf), ("to_hf", args.to_hf),
                                              ("to_peft", args.to_peft)) if s)
    dtype = getattr(torch, args.dtype) if args.dtype else None
    try:
        convert(src, args.out, direction, overwrite=args.overwrite, dtype=dtype)
    except ImportError as e:
        if e.name != "transformers":
            raise
        print(f"pipekit convert: {e}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as e:
        said = e.args[0] if isinstance(e, KeyError) and e.args else e  # str(KeyError) quotes its message
        print(f"pipekit convert: {said}", file=sys.stderr)
        return 2
    print(f"pipekit convert: wrote {args.out}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake said in one line (and where to find the usage)."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: {message} (see {self.prog} --help)\n")


def _count(text: str) -> int:
    """An argparse type: an int >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def parser() -> argparse.ArgumentParser:
    p = _Parser(prog="pipekit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"pipekit {__version__}")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model from a config")
    t.add_argument("config", nargs="?", help="YAML config (see configs/)")
    t.add_argument("overrides", nargs="*", help="key=value overrides, e.g. parallel.pp=2")
    t.add_argument("--show", action="store_true", help="print the merged, checked config (every key) and exit")
    t.add_argument("--deepspeed", metavar="DS_CONFIG", default=None,
                   help="a DeepSpeed ds_config.json: its keys as overrides (before the key=value ones, which win)")
    t.add_argument("--max-restarts", type=_count, default=0, metavar="N",
                   help="restart failed workers up to N times (torchrun's --max-restarts); each restart resumes "
                        "from the newest checkpoint")
    t.set_defaults(fn=train_command)

    q = sub.add_parser("plan", help="predict a config's step for every schedule and recommend one; or simulate "
                                    "one schedule under unit costs (--pp, --microbatches)")
    q.add_argument("config", nargs="?", help="YAML training config: profile its layers and plan it")
    q.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    q.add_argument("--no-profile", action="store_true",
                   help="with CONFIG: FLOP counts on the meta device instead of timing the layers")
    q.add_argument("--memory-budget-gb", type=float, default=None, metavar="GIB",
                   help="with CONFIG: memory per rank to fit in (GiB); also predicts each rank's parameters, "
                        "gradients, master weights, optimizer state and activations for every schedule x ZeRO "
                        "stage x sequence parallelism x activation checkpointing, and recommends the fastest "
                        "that fits")
    q.add_argument("--memory-gb", type=float, default=None, metavar="GIB", help="the same as --memory-budget-gb")
    q.add_argument("--latency", type=float, default=None, metavar="SECONDS",
                   help="with CONFIG: message latency instead of measuring it")
    q.add_argument("--top", type=int, default=12, help="with CONFIG: candidates to list")
    q.add_argument("--schedule", default=None,
                   help="gpipe | 1f1b | interleaved_1f1b | zb_h1 | zbv | dualpipe_v (default 1f1b; with CONFIG: "
                        "plan only this schedule)")
    q.add_argument("--pp", type=int, default=None, help="without CONFIG (with one, parallel.pp=N)")
    q.add_argument("--microbatches", type=int, default=None, help="(with CONFIG: plan only this count)")
    q.add_argument("--virtual", type=int, default=None,
                   help="virtual stages per rank (interleaved_1f1b; default: the schedule's own)")
    q.add_argument("--f-cost", type=float, default=None, help="without CONFIG: a forward's cost (default 1)")
    q.add_argument("--b-cost", type=float, default=None, help="without CONFIG: a backward's cost (default 2)")
    q.add_argument("--json", action="store_true", help="print one JSON object")
    q.add_argument("--trace", metavar="FILE", help="also write the timeline as Chrome-trace JSON (Perfetto)")
    q.add_argument("--png", metavar="FILE", help="also draw the timeline as a PNG (needs matplotlib)")
    q.set_defaults(fn=plan_command)

    d = sub.add_parser("prepare-data", help="tokenise text and JSONL files into a memory-mapped dataset")
    d.add_argument("inputs", nargs="+", help="files or directories (*.py, *.txt, *.md, *.jsonl below a directory); "
                   'a .jsonl file holds one document a line: {"text"}, {"prompt", "response"} or {"messages"} '
                   "(a chat, rendered by the tokenizer's chat template; prompts and other turns than the "
                   "assistant's get loss mask 0)")
    d.add_argument("--out", required=True,
                   help="output directory (train.bin, val.bin, their .docs.bin and .mask.bin, meta.json)")
    d.add_argument("--tokenizer", default=None,
                   help="a HuggingFace tokenizer.json, or a tokenizer directory (tokenizer.json + "
                        "tokenizer_config.json with chat_template, for chat lines); default: bytes")
    d.add_argument("--val-fraction", type=float, default=0.01)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    d.set_defaults(fn=_prepare_data)

    c = sub.add_parser("convert", help="import weights from / export to HuggingFace transformers")
    _add_convert_args(c)
    c.set_defaults(fn=_convert)

    g = sub.add_parser("generate", help="sample text from a trained model (model.pt, a checkpoint, a run dir) "
                                        "or a Hugging Face model dir, with a KV cache")
    g.add_argument("checkpoint", metavar="MODEL",
                   help="runs/x/model.pt, a checkpoint (checkpoints/step_N, or checkpoints/ for the newest), a run "
                        "dir runs/x (its model.pt, else its checkpoints), or a Hugging Face model dir (config.json "
                        "+ safetensors/bin, its tokenizer.json beside them)")
    g.add_argument("--prompt", default="")
    g.add_argument("--max-new-tokens", type=int, default=None,
                   help="at most this many new tokens (fewer at the tokenizer's end-of-text token); prompt + new "
                        "tokens must fit in the model's max_seq_len (default: 200, or as many as fit)")
    g.add_argument("--temperature", type=float, default=0.8, help="0: greedy (default: 0.8)")
    g.add_argument("--top-k", type=int, default=50, help="0: no top-k cut (default: 50)")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--chat", action="store_true",
                   help="render the prompt as one user message with the tokenizer's chat template "
                        "(generation prompt added) and print the reply alone")
    g.add_argument("--tokenizer", default=None,
                   help="a tokenizer.json or tokenizer dir instead of the model's own (the one it was trained with, "
                        "or the HF dir's)")
    g.set_defaults(fn=_generate)

    e = sub.add_parser("env", help="report versions and usable backends")
    e.set_defaults(fn=_env)
    return p


def main(argv: list[str] | None = None) -> int:
    command = None
    try:
        p = parser()
        args, extra = p.parse_known_args(argv)  # `train CONFIG --max-restarts 1 key=value`: overrides after a flag
        command = args.command
        if extra:
            unknown = [w for w in extra if w.startswith("-")] if args.command in ("train", "plan") else extra
            if unknown:
                p.exit(2, f"pipekit {args.command}: unrecognized arguments: {' '.join(unknown)} "
                          f"(see pipekit {args.command} --help)\n")
            args.overrides = [*args.overrides, *extra]
        return args.fn(args)
    except KeyboardInterrupt:  # before a stop handler was in place (or the second, "stop now", Ctrl-C); one held
        # while the command imported (pipekit.HELD_INTERRUPTS) arrives here too, once the import is done
        if not told.directory():  # a worker of pipekit's launcher: the launcher says it
            print(f"pipekit {command or ''}".rstrip() + ": interrupted", file=sys.stderr)
        return launch.INTERRUPTED
    except launch.USER_ERRORS as e:
        if os.environ.get("PIPEKIT_DEBUG") == "1":
            raise
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        print(f"pipekit {command}: {first}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    status = main()
    if launch.trained_in_a_group():
        launch.exit_worker(status)
    sys.exit(status)
