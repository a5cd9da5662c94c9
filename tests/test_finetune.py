"""Fine-tuning at any layout: a run that starts from Hugging Face weights (`model.init`), and LoRA.

Hugging Face models are built by transformers from config objects (random weights, offline) and
saved in several shards: a Llama (untied head, grouped-query attention, a vocabulary that pads,
sharded safetensors) and a GPT-2 (tied head, sharded pytorch_model.bin). One group of 4 gloo
workers runs every case, each layout against the same run in one process:

- loading at pp=2 x tp=2 and at pp=2 x dp=2 with ZeRO-3: the gathered weights equal the Hugging
  Face weights exactly, and the first loss equals transformers' loss on the same batch;
- LoRA (and DoRA) in float64, 3 AdamW steps at pp=2 x dp=2 (ZeRO-1), pp=2 x tp=2 (ZBV),
  pp=4 (a stage with nothing to train), pp=2 x dp=2 (ZeRO-3) and tp=2 x dp=2 (DoRA), and a
  Mixtral with an adapter on every expert's weights at pp=2 x dp=2 x ep=2 (ZeRO-1) and tp=2 x
  dp=2 x ep=2 with expert tensor parallelism or sequence parallelism: every loss and every weight equals one process
  within 1e-10, and the frozen weights are bitwise the pretrained ones.
"""

from __future__ import annotations

import math

import pytest
import torch

from pipekit.testing import run_distributed

transformers = pytest.importorskip("transformers")

SEQ, ROWS, STEPS = 16, 8, 3


def _llama(path: str) -> None:
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                   tie_word_embeddings=False)
    transformers.LlamaForCausalLM(cfg).save_pretrained(path, max_shard_size="60KB")


def _gpt2(path: str, bin_shards: bool = True) -> None:
    """Saved as transformers' older sharded pytorch_model-0000k-of-0000n.bin with its index
    (transformers 5 writes only safetensors: the .bin shards are written here), or as
    sharded safetensors (its Conv1D weights read transposed, straight into place)."""
    import json
    import os

    torch.manual_seed(1)
    cfg = transformers.GPT2Config(vocab_size=300, n_embd=64, n_layer=3, n_head=4, n_positions=64)
    model = transformers.GPT2LMHeadModel(cfg)
    if not bin_shards:
        model.save_pretrained(path, max_shard_size="60KB")
        return
    model.save_pretrained(path)
    os.remove(os.path.join(path, "model.safetensors"))
    sd = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    names, n = sorted(sd), 3
    weight_map = {}
    for i in range(n):
        file = f"pytorch_model-{i + 1:05d}-of-{n:05d}.bin"
        part = {k: sd[k] for k in names[i::n]}
        torch.save(part, os.path.join(path, file))
        weight_map.update(dict.fromkeys(part, file))
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _batch(vocab: int = 300, seed: int = 5) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (ROWS, SEQ), generator=g)
    y = torch.cat([x[:, 1:], torch.full((ROWS, 1), -100)], dim=1)
    return x, y


def _hf_loss(path: str) -> float:
    model = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
    x, _ = _batch()
    with torch.no_grad():
        return model(x, labels=x).loss.item()


def _expected(path: str) -> dict[str, torch.Tensor]:
    from pipekit.interchange import load_hf_checkpoint

    return load_hf_checkpoint(path)[2]


LOADS = {  # name -> (model dir, overrides)
    "llama-pp2-tp2": ("llama", ["parallel.pp=2", "parallel.tp=2"]),
    "gpt2-pp2-tp2": ("gpt2", ["parallel.pp=2", "parallel.tp=2"]),
    "llama-pp2-dp2-zero3": ("llama", ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=3"]),
    "gpt2-pp2-dp2-zero3": ("gpt2", ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=3"]),
    "gpt2-safetensors-pp2-tp2": ("gpt2-safetensors", ["parallel.pp=2", "parallel.tp=2"]),
    "gpt2-safetensors-tp2-dp2-zero3": ("gpt2-safetensors", ["parallel.tp=2", "parallel.dp=2",
                                                            "optimizer.zero_stage=3"]),
}
LORA = r"attn\.(q|k|v|o)$|mlp\.(gate|up|down)$"
GPT2_LORA = r"attn\.(q|k|v|o)$|mlp\.(fc|proj)$"
# the balancing loss on the step's loads (the same in every layout); 2 blocks x (2 + 3) adapters
MOE = ["model.family=mixtral", "model.global_balance=true", r"model.lora.targets=attn\.(q|v)$|experts\.w_"]
TUNES = {  # name -> overrides beside model.init=llama and LoRA
    "pp2-dp2-zero1": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=1"],
    "pp2-tp2-zbv": ["parallel.pp=2", "parallel.tp=2", "schedule.name=zbv", "schedule.microbatches=4"],
    "pp4-a-stage-without-adapters": ["parallel.pp=4", "schedule.partition=0,1,2,3,6"],
    "pp2-dp2-zero3": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=3"],
    # the frozen base sharded and offloaded too; ZBV's weight pass over layers FSDP gathers
    "pp2-dp2-zero3-offload-zbv": ["parallel.pp=2", "parallel.dp=2", "optimizer.zero_stage=3",
                                  "optimizer.offload_params=cpu", "schedule.name=zbv", "schedule.microbatches=4"],
    "tp2-dp2-dora": ["parallel.tp=2", "parallel.dp=2", "model.lora.dora=true"],
    # GPT-2 from its HF weights: the tied embedding and head, frozen, one layer FSDP shards on two stages
    "gpt2-pp2-dp2-zero3-offload": ["model.init=gpt2", f"model.lora.targets={GPT2_LORA}", "parallel.pp=2",
                                   "parallel.dp=2", "optimizer.zero_stage=3", "optimizer.offload_params=cpu"],
    # Mixtral from its own seeded weights (no model.init), LoRA on attention and on every expert's weights
    "mixtral-pp2-dp2-ep2-zero1": [*MOE, "parallel.pp=2", "parallel.dp=2", "parallel.ep=2", "optimizer.zero_stage=1"],
    # frozen experts sharded over their edp replicas (dp 4 / ep 2), the frozen dense weights over dp
    "mixtral-dp4-ep2-zero3": [*MOE, "parallel.dp=4", "parallel.ep=2", "optimizer.zero_stage=3"],
    "mixtral-tp2-dp2-ep2-expert-tp": [*MOE, "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                      "parallel.expert_tp=true"],
    "mixtral-tp2-dp2-ep2-sequence-parallel": [*MOE, "parallel.tp=2", "parallel.dp=2", "parallel.ep=2",
                                              "parallel.sequence_parallel=true"],
}
BASE = [f"train.seq_len={SEQ}", "schedule.microbatches=2", "train.device=cpu"]


def _dp(overrides: list[str]) -> int:
    return int(next((o.split("=")[1] for o in overrides if o.startswith("parallel.dp=")), 1))


def _engine(overrides: list[str], alone: bool = False):
    from pipekit.config import load_run
    from pipekit.run.loop import build
    from pipekit.topology import Topology

    run = load_run(None, [*BASE, *overrides])
    if alone:
        return run, build(run, Topology(alone=True))
    p = run.config.parallel
    topo = Topology(pp=p.pp, dp=p.dp, tp=p.tp, device="cpu")
    return run, build(run, topo)


def _load_case(model_dir: str, overrides: list[str], expected: dict) -> dict:
    from pipekit.checkpoint import full_state_dict
    from pipekit.testing import Reference

    run, engine = _engine([f"model.init={model_dir}", "train.dtype=float32",
                           f"train.micro_batch={ROWS // 2 // _dp(overrides)}", *overrides])
    sd = full_state_dict(engine.module)
    worst = max(((sd[k] - v).abs().max().item() if sd[k].shape == v.shape else math.inf) for k, v in expected.items())
    x, y = _batch()
    loss = engine.eval_batch(iter([Reference.rows((x, y), engine.module.topology)]), reduce_loss=True)
    return {"weights": worst, "names": sorted(set(sd) ^ set(expected)), "loss": float(loss)}


def _tune_case(model_dir: str, overrides: list[str], gpt2_dir: str | None = None) -> dict:
    from pipekit.checkpoint import full_state_dict
    from pipekit.precision import default_dtype
    from pipekit.testing import Reference

    moe = "model.family=mixtral" in overrides
    common = [f"model.init={model_dir}" if not moe else "model.family=mixtral", "train.dtype=float64",
              "model.lora.rank=4", "model.lora.alpha=8", f"model.lora.targets={LORA}", "optimizer.lr=0.02",
              "optimizer.warmup_steps=0", "optimizer.clip_grad_norm=1.0", f"train.steps={STEPS}"]
    if "model.init=gpt2" in overrides:  # (the name of a model dir in `dirs`)
        overrides = [o for o in overrides if o != "model.init=gpt2"]
        common[0] = f"model.init={gpt2_dir}"
    dora, dp = [o for o in overrides if o.startswith("model.")], _dp(overrides)  # the model: the same on both sides
    with default_dtype(torch.float64):
        _, ref = _engine([*common, *dora, f"train.micro_batch={ROWS // 2}"], alone=True)
        before = full_state_dict(ref.module)
        _, engine = _engine([*common, *overrides, f"train.micro_batch={ROWS // 2 // dp}"])
        losses = []
        for step in range(STEPS):
            batch = _batch(vocab=256 if moe else 300, seed=10 + step)
            mine = engine.train_batch(iter([Reference.rows(batch, engine.module.topology)]), reduce_loss=True)
            theirs = ref.train_batch(iter([batch]), reduce_loss=True)
            losses.append(abs(mine - theirs))
        got, want = full_state_dict(engine.module), full_state_dict(ref.module)
    from pipekit.optim.fsdp import host_shard, sharded

    base = [p for p in engine.module.parameters() if not p.requires_grad]
    adapters = [k for k in want if ".lora." in k]
    frozen = [k for k in want if ".lora." not in k]
    return {"loss": max(losses), "names": sorted(set(got) ^ set(want)),
            "adapters": max((got[k] - want[k]).abs().max().item() for k in adapters),
            "moved": max((want[k] - before[k]).abs().max().item() for k in adapters),
            "frozen_bitwise": all(torch.equal(got[k], before[k]) for k in frozen),
            "n_adapters": len(adapters), "base sharded": all(sharded(p) for p in base) and bool(base),
            "base on host": all(host_shard(p) for p in base) and bool(base)}


def _worker(dirs: dict, expected: dict) -> dict:
    out = {}
    for name, (family, overrides) in LOADS.items():
        out[name] = _load_case(dirs[family], overrides, expected[family])
    for name, overrides in TUNES.items():
        out[name] = _tune_case(dirs["llama"], overrides, dirs["gpt2"])
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    dirs = {"llama": str(root / "llama"), "gpt2": str(root / "gpt2"), "gpt2-safetensors": str(root / "gpt2st")}
    _llama(dirs["llama"])
    _gpt2(dirs["gpt2"])
    _gpt2(dirs["gpt2-safetensors"], bin_shards=False)
    expected = {f: _expected(d) for f, d in dirs.items()}
    hf_loss = {f: _hf_loss(d) for f, d in dirs.items()}
    return run_distributed(_worker, 4, dirs, expected, timeout=600, op_timeout=120), hf_loss, dirs


def test_the_models_are_saved_in_several_shards(results):
    import os

    _, _, dirs = results
    assert sum(n.endswith(".safetensors") for n in os.listdir(dirs["llama"])) > 2
    assert sum(n.endswith(".bin") for n in os.listdir(dirs["gpt2"])) > 2


@pytest.mark.parametrize("case", LOADS)
def test_loaded_weights_equal_hugging_face_and_so_does_the_first_loss(results, case):
    per_rank, hf_loss, _ = results
    family = LOADS[case][0]  # (a model dir's name)
    for rank, out in enumerate(per_rank):
        got = out[case]
        assert got["names"] == [], (rank, got["names"])
        assert got["weights"] == 0.0, (rank, got["weights"])
        assert got["loss"] == pytest.approx(hf_loss[family], abs=1e-5), (rank, got["loss"], hf_loss[family])


@pytest.mark.parametrize("case", TUNES)
def test_lora_equals_one_process_and_the_frozen_weights_stay_bitwise(results, case):
    per_rank, _, _ = results
    for rank, out in enumerate(per_rank):
        got = out[case]
        assert got["names"] == [], (rank, got["names"])
        want = (2 * 5 * 2 if "mixtral" in case else 3 * 6 * 2 if "gpt2" in case
                else 3 * 7 * 2 + (3 * 7 if "dora" in case else 0))
        assert got["n_adapters"] == want, got["n_adapters"]
        assert got["moved"] > 1e-3, got  # the adapters trained
        assert got["loss"] < 1e-10 and got["adapters"] < 1e-10, (rank, got)
        assert got["frozen_bitwise"], rank
        # ZeRO-3 shards the frozen base as DeepSpeed's does (and offloads it with the parameters)
        assert got["base sharded"] == ("zero_stage=3" in " ".join(TUNES[case])), (rank, got)
        assert got["base on host"] == ("offload_params=cpu" in " ".join(TUNES[case])), (rank, got)


def test_expert_adapters_merge_into_their_experts_exactly(float64):
    """Every expert's own adapter (A (E, in, r), B (E, r, out)) folds into its grouped weight:
    the merged model's logits are the adapted model's."""
    from pipekit import auxloss
    from pipekit.checkpoint import full_state_dict, load_full_state_dict
    from pipekit.layers.lora import add_adapters, merge_adapters
    from pipekit.models import get_model, model_specs
    from pipekit.pipeline import PipelineModule

    specs = model_specs(get_model("mixtral", "tiny"))
    adapted = PipelineModule(specs, seed=3).eval()
    names = add_adapters(adapted, r"experts\.w_(gate|down)", rank=4, alpha=8.0, seed=1)
    assert names == [f"layers.{i}.mlp.experts.w_{w}" for i in (1, 2) for w in ("gate", "down")]
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, p in adapted.named_parameters():
            if n.endswith("_lora_B"):
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.1)  # B starts at zero: make it count
    assert all(p.requires_grad == (".lora." in n) for n, p in adapted.named_parameters())
    x = torch.randint(0, 256, (2, 12), generator=g)
    merged = PipelineModule(specs, seed=3).eval()
    load_full_state_dict(merged, merge_adapters(full_state_dict(adapted), 2.0))
    plain = PipelineModule(specs, seed=3).eval()
    assert (merged(x) - adapted(x)).abs().max().item() < 1e-12
    assert (plain(x) - adapted(x)).abs().max().item() > 1e-3  # the adapters changed the model
    auxloss.metrics.pop()  # the forwards' MoE metrics: not for the tests that run after this one


def test_what_expert_adapters_refuse():
    from pipekit.config import ConfigError, load_run

    with pytest.raises(ConfigError, match=r"dora=true is not supported on MoE experts.*layers\.1\.mlp\.experts\.w_"):
        load_run(None, ["model.family=mixtral", "model.lora.rank=4", "model.lora.dora=true",
                        r"model.lora.targets=experts"])
    with pytest.raises(ConfigError, match=r"matches no linear layer .*mlp\.experts\.w_gate"):
        load_run(None, ["model.family=mixtral", "model.lora.rank=4", "model.lora.targets=nothing_here"])
    run = load_run(None, ["model.family=mixtral", "model.lora.rank=4", r"model.lora.targets=experts\.w_up"])
    assert run.config.model.lora.targets == r"experts\.w_up"


def test_the_safetensors_reader_reads_slices_casts_and_refuses_a_truncated_file(tmp_path):
    """`SafetensorsReader` (plain reads, no memory map): any block of rows and columns equals
    the tensor's slice, cast on the copy, in blocks smaller than a row too; a cut file is a
    one-line error."""
    from safetensors.torch import save_file

    from pipekit.interchange import SafetensorsReader

    g = torch.Generator().manual_seed(0)
    tensors = {"w": torch.randn(37, 11, generator=g).to(torch.bfloat16), "b": torch.randn(5, generator=g),
               "s": torch.tensor(3.0, dtype=torch.float64)}
    save_file(tensors, str(tmp_path / "m.safetensors"))
    r = SafetensorsReader(str(tmp_path / "m.safetensors"))
    assert set(r.keys()) == set(tensors) and r.shape("w") == (37, 11)
    for name, t in tensors.items():
        assert torch.equal(r.get_tensor(name), t) and r.get_tensor(name).dtype == t.dtype
    for rows, cols, block in [((0, 37), (0, 11), 1), ((5, 30), (3, 9), 64), ((36, 37), (10, 11), 1 << 20)]:
        dst = torch.empty(rows[1] - rows[0], cols[1] - cols[0], dtype=torch.float64)
        r.read_into("w", dst, [rows, cols], block_bytes=block)
        assert torch.equal(dst, tensors["w"][rows[0]:rows[1], cols[0]:cols[1]].double())
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(data[:-7])
    with pytest.raises(ValueError, match=r"cut\.safetensors is not readable: truncated, corrupt"):
        SafetensorsReader(str(tmp_path / "cut.safetensors"))
    (tmp_path / "junk.safetensors").write_bytes(b"\x05" * 64)
    with pytest.raises(ValueError, match=r"junk\.safetensors is not readable"):
        SafetensorsReader(str(tmp_path / "junk.safetensors"))
