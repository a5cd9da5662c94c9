"""Hugging Face interchange: tiny random GPT2LMHeadModel / LlamaForCausalLM, float32,
and the Llama variants a user brings: Llama 3.1's scaled rope, Qwen2 (q/k/v biases, tied),
Qwen3 (q/k head norms, head_dim twice dim / n_heads), Mistral (a sliding window of 5
tokens over sequences of 16) and Phi-3 (Mistral's with q/k/v and gate/up fused).

Each case builds a transformers model from a config object (random weights,
every parameter perturbed so biases and norm weights are not at their
defaults), converts it, loads it into a PipelineModule and must reproduce
HF's logits (gathered over the tp vocab shards) within 1e-5 and HF's loss;
then `full_state_dict` -> `to_hf_state_dict` must give back HF's state dict
exactly and a fresh HF model loaded from it the same logits; and two SGD steps
must follow HF's own training (losses and weights within 1e-5). pp=tp=1 runs in
this process; one spawned world of 4 ranks runs (pp, dp, tp) = (1, 2, 2),
(2, 1, 2) and (2, 2, 1) for every case.

Every case pads the vocabulary: VOCAB=64 to the default multiple 128 (at tp=2
rank 1's shard is all padding), and two cases with ODD=61 ids to a multiple of
8 (64 rows, 3 of them padding). The padded logits must be -inf and the padded
rows, zero on import, must still be zero after training (zero gradient).
"""

from __future__ import annotations

import io
from dataclasses import asdict

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

import pipekit  # noqa: E402
from pipekit import interchange  # noqa: E402
from pipekit.checkpoint import full_state_dict, load_full_state_dict  # noqa: E402
from pipekit.cli import main  # noqa: E402
from pipekit.layers import gather_from_tp  # noqa: E402
from pipekit.models import get_model, hf, model_loss, model_specs, with_overrides  # noqa: E402
from pipekit.testing import run_distributed  # noqa: E402

TOL = 1e-5
VOCAB, SEQ, BATCH = 64, 16, 4
ODD, ODD_PAD_MULTIPLE = 61, 8  # 61 ids padded to 64 rows
WINDOW = 5  # Mistral's sliding window, shorter than the sequence
TRAIN_STEPS, LR = 2, 0.5
LAYOUTS = [(1, 2, 2), (2, 1, 2), (2, 2, 1)]  # (pp, dp, tp) on 4 ranks


# the Llama variants: (transformers config class, model class, extra config keys)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}  # head_dim 8, theta 1e4: one frequency of each kind


def _variants() -> dict:
    return {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, {}),
        "llama3rope": (transformers.LlamaConfig, transformers.LlamaForCausalLM,
                       {"rope_scaling": dict(LLAMA3_ROPE), "max_position_embeddings": 128}),  # a copy: HF adds to it
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, {"use_sliding_window": False}),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM, {"head_dim": 16}),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM, {"sliding_window": WINDOW}),
        # fused q/k/v and gate/up; grouped-query heads (Phi-3-medium's, Phi-4's), a window
        "phi3": (transformers.Phi3Config, transformers.Phi3ForCausalLM, {"sliding_window": WINDOW,
                                                                          "pad_token_id": None}),
    }


def hf_config(family: str, tied: bool, vocab: int = VOCAB):
    if family == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                       tie_word_embeddings=tied, bos_token_id=None, eos_token_id=None,
                                       attn_implementation="eager")
    # theta 10000 and head_dim 8: every rotary frequency turns noticeably over 16 positions
    config_cls, _, extra = _variants()[family]
    keys = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied, attn_implementation="eager")
    return config_cls(**{**keys, **extra})


def hf_class(family: str):
    return transformers.GPT2LMHeadModel if family == "gpt2" else _variants()[family][1]


def hf_model(family: str, tied: bool, vocab: int = VOCAB, seed: int = 0):
    torch.manual_seed(seed)
    model = hf_class(family)(hf_config(family, tied, vocab)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def fresh_hf_model(family: str, tied: bool, hf_sd: dict, vocab: int = VOCAB):
    model = hf_class(family)(hf_config(family, tied, vocab)).eval()
    model.load_state_dict(hf_sd, strict=True)
    return model


CASES = [("gpt2", True, VOCAB), ("gpt2", False, VOCAB), ("llama", False, VOCAB), ("llama", True, VOCAB),
         ("gpt2", True, ODD), ("llama", False, ODD), ("llama3rope", False, VOCAB), ("qwen2", True, VOCAB),
         ("qwen3", False, VOCAB), ("mistral", False, VOCAB), ("phi3", False, VOCAB)]
CASE_IDS = [f"{f}-{'tied' if t else 'untied'}" + ("" if v == VOCAB else f"-v{v}") for f, t, v in CASES]
ODD_IDS = [i for i in CASE_IDS if i.endswith(f"-v{ODD}")]


class Case:
    """An HF model, its pipekit config and full state dict, a batch and HF's answers:
    logits and loss, then the losses and weights of TRAIN_STEPS SGD steps."""

    def __init__(self, kind: str, tied: bool, vocab: int):
        self.kind, self.tied, self.vocab = kind, tied, vocab  # kind: the HF model (a Llama variant's name)
        self.family = "gpt2" if kind == "gpt2" else "llama"
        self.model = hf_model(kind, tied, vocab)
        self.hf_sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.cfg = hf.config_from_hf(self.model.config)
        if vocab == ODD:
            self.cfg = with_overrides(self.cfg, vocab_pad_multiple=ODD_PAD_MULTIPLE)
        family = self.family
        self.full = hf.from_hf_state_dict(family, self.hf_sd, self.cfg)
        gen = torch.Generator().manual_seed(1)
        self.ids = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        self.labels = torch.randint(0, vocab, (BATCH, SEQ), generator=gen)
        self.logits = hf_logits(self.model, self.ids)
        self.loss = F.cross_entropy(self.logits.flatten(0, 1), self.labels.flatten()).item()
        fresh = fresh_hf_model(kind, tied, self.hf_sd, vocab)
        self.train_losses, self.trained_sd = hf_train(fresh, self.ids, self.labels)

    def payload(self) -> tuple:
        """What a spawned worker needs (no transformers objects)."""
        return (self.family, self.cfg, self.full, self.hf_sd, self.ids, self.labels, self.logits, self.loss,
                self.train_losses, self.trained_sd)


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hf_train(model, ids, labels) -> tuple[list[float], dict]:
    """TRAIN_STEPS of plain SGD on the mean token cross-entropy (dropout off)."""
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for _ in range(TRAIN_STEPS):
        opt.zero_grad()
        loss = F.cross_entropy(model(ids).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def cases() -> dict:
    return {case_id: Case(*c) for case_id, c in zip(CASE_IDS, CASES)}


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a - b).abs().max().item()


def same_state(a: dict, b: dict) -> bool:
    return set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


# ---- one layout, run on every rank (or in this process) ------------------------
def run_case(payload: tuple, topo) -> dict:
    """Load the converted weights into `topo`'s layout, compare logits and loss
    with HF, convert back, then train TRAIN_STEPS and compare with HF's training.
    Returns the differences and (first rank) the converted-back HF state dict."""
    family, cfg, full, hf_sd, ids, labels, ref_logits, ref_loss, ref_train_losses, ref_trained = payload
    V, Vp = cfg.vocab_size, cfg.padded_vocab
    module = pipekit.PipelineModule(model_specs(cfg), loss_fn=model_loss(cfg), topology=topo, schedule="1f1b",
                                    microbatches=2)
    load_full_state_dict(module, full)
    opt = torch.optim.SGD(module.parameters(), lr=LR)
    engine = pipekit.PipelineEngine(module, optimizer=opt)
    shard = BATCH // topo.dp
    mine = slice(topo.dp_rank * shard, (topo.dp_rank + 1) * shard)
    batch = (ids[mine], labels[mine])
    loss, out = engine.eval_batch(iter([batch]), return_outputs=True, reduce_loss=True)
    result = {"loss": abs(loss - ref_loss), "logits": None, "padded_logits": True}
    if out is not None:
        assert out.shape == (shard, SEQ, Vp // topo.tp), out.shape
        logits = gather_from_tp(out, topo.tp_group)  # (shard, SEQ, Vp)
        result["logits"] = max_diff(logits[..., :V], ref_logits[mine])
        result["padded_logits"] = bool((logits[..., V:] == float("-inf")).all())
    gathered = full_state_dict(module)
    result["full_exact"] = same_state(gathered, full)
    back = hf.to_hf_state_dict(family, gathered, cfg)
    result["hf_exact"] = same_state(back, hf_sd)
    result["hf_sd"] = to_bytes(back) if topo.rank == 0 else None  # a copy: training changes the parameters

    losses = [engine.train_batch(iter([batch]), reduce_loss=True) for _ in range(TRAIN_STEPS)]
    result["train_loss"] = max(abs(a - b) for a, b in zip(losses, ref_train_losses))
    trained_full = full_state_dict(module)
    result["padded_rows"] = max(trained_full[n][V:].abs().max().item() if Vp > V else 0.0
                                for n in hf.vocab_tensor_names(cfg))  # zero on import, zero gradient since
    trained = hf.to_hf_state_dict(family, trained_full, cfg)
    result["trained"] = max(max_diff(trained[k], ref_trained[k]) for k in ref_trained)
    return result


def to_bytes(sd: dict) -> bytes:
    """A state dict as plain bytes: tensors returned from a spawned worker travel
    by shared-memory file descriptor, which fails when the worker exits first."""
    buf = io.BytesIO()
    torch.save(sd, buf)
    return buf.getvalue()


def run_layouts(payloads: list, layouts: list, which: list) -> list:
    """Per layout, per case it runs (`which[layout index]`: indices into `payloads`): the results
    of `run_case` on this rank."""
    results = []
    for (pp, dp, tp), cases in zip(layouts, which):
        topo = pipekit.Topology(pp=pp, dp=dp, tp=tp)
        results.append([run_case(payloads[i], topo) for i in cases])
    return results


def check_result(case: Case, result: dict, where: str) -> None:
    assert result["loss"] <= TOL, f"{where}: loss differs from HF by {result['loss']:.3g}"
    if result["logits"] is not None:
        assert result["logits"] <= TOL, f"{where}: logits differ from HF by {result['logits']:.3g}"
    assert result["padded_logits"], f"{where}: the logits of padded ids are not all -inf"
    assert result["full_exact"], f"{where}: full_state_dict does not give back the loaded weights exactly"
    assert result["hf_exact"], f"{where}: to_hf_state_dict does not give back HF's state dict exactly"
    if result["hf_sd"] is not None:
        again = fresh_hf_model(case.kind, case.tied, torch.load(io.BytesIO(result["hf_sd"])), case.vocab)
        assert max_diff(hf_logits(again, case.ids), case.logits) == 0.0, f"{where}: the round-tripped HF model differs"
    assert result["train_loss"] <= TOL, f"{where}: training losses differ from HF's by {result['train_loss']:.3g}"
    assert result["trained"] <= TOL, f"{where}: weights after training differ from HF's by {result['trained']:.3g}"
    assert result["padded_rows"] == 0.0, f"{where}: padded vocab rows moved in training by {result['padded_rows']:.3g}"


@pytest.mark.parametrize("case_id", CASE_IDS)
def test_single_process_matches_hf(cases, case_id):
    case = cases[case_id]
    result = run_case(case.payload(), pipekit.Topology())
    assert result["logits"] is not None
    check_result(case, result, f"{case_id} pp=1 tp=1")


# The Llama variants at the layout that splits both their heads (tp) and their layers (pp),
# Qwen3 (its head norms' gradient summed over tp) at tp=2 x dp=2 too; the rest at every layout.
VARIANT_LAYOUTS = {"llama3rope-untied": [(2, 1, 2)], "qwen2-tied": [(2, 1, 2)], "mistral-untied": [(2, 1, 2)],
                   "phi3-untied": [(2, 1, 2)], "qwen3-untied": [(1, 2, 2), (2, 1, 2)]}


def test_parallel_layouts_match_hf(cases):
    """One world of 4 ranks: every case at (pp, dp, tp) in LAYOUTS (the variants: VARIANT_LAYOUTS)."""
    payloads = [cases[c].payload() for c in CASE_IDS]
    which = [[i for i, c in enumerate(CASE_IDS) if layout in VARIANT_LAYOUTS.get(c, LAYOUTS)] for layout in LAYOUTS]
    per_rank = run_distributed(run_layouts, 4, payloads, LAYOUTS, which, timeout=240)
    for rank, per_layout in enumerate(per_rank):
        for layout, cases_here, per_case in zip(LAYOUTS, which, per_layout):
            for i, result in zip(cases_here, per_case):
                check_result(cases[CASE_IDS[i]], result, f"{CASE_IDS[i]} (pp, dp, tp)={layout} rank {rank}")
    last_stage_ranks = [r for r in range(4) if per_rank[r][1][0]["logits"] is not None]
    assert last_stage_ranks == [2, 3], "with pp=2 the last stage is ranks 2 and 3"
    assert all(any(layout in VARIANT_LAYOUTS.get(c, LAYOUTS) for layout in LAYOUTS) for c in CASE_IDS)


# ---- rotary convention -------------------------------------------------------------
def meta_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's convert_llama_weights_to_hf permutation (interleaved pairs -> rotate_half halves)."""
    rows, cols = w.shape
    return w.view(n_heads, rows // n_heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def test_llama_rotary_needs_no_permutation(cases):
    """q_proj/k_proj are copied as they are (matching HF within 1e-5, above); the
    same weights with the q/k rows permuted give clearly different logits, so
    the test would catch a convention mismatch."""
    case = cases["llama-untied"]
    full = dict(case.full)
    for i in range(1, case.cfg.n_layers + 1):
        full[f"layers.{i}.attn.q.weight"] = meta_permute(full[f"layers.{i}.attn.q.weight"], case.cfg.n_heads)
        full[f"layers.{i}.attn.k.weight"] = meta_permute(full[f"layers.{i}.attn.k.weight"], case.cfg.n_kv_heads)
    module = pipekit.PipelineModule(model_specs(case.cfg))
    load_full_state_dict(module, full)
    with torch.no_grad():
        assert max_diff(module(case.ids)[..., :VOCAB], case.logits) > 1e-3


# ---- files and the CLI ---------------------------------------------------------------
@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


@pytest.mark.parametrize("case_id", ["gpt2-tied", "llama-untied", "llama-tied", "llama3rope-untied",
                                     "qwen2-tied", "qwen3-untied", "mistral-untied", "phi3-untied"])
def test_save_hf_checkpoint_loads_in_transformers(cases, case_id, tmp_path, offline):
    case = cases[case_id]
    out = tmp_path / "hf"
    interchange.save_hf_checkpoint(case.family, case.full, case.cfg, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == ["hf"], "no temporary dir may be left behind"
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded) is type(case.model)
    assert same_state(loaded.state_dict(), case.hf_sd)
    assert max_diff(hf_logits(loaded, case.ids), case.logits) == 0.0
    family, cfg, full = interchange.load_hf_checkpoint(str(out))
    assert (family, cfg) == (case.family, case.cfg)
    assert same_state(full, case.full)
    with pytest.raises(FileExistsError, match="overwrite"):
        interchange.save_hf_checkpoint(case.family, case.full, case.cfg, str(out))
    interchange.save_hf_checkpoint(case.family, case.full, case.cfg, str(out), overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def convert_cli(*argv: str) -> int:
    return main(["convert", *argv])


@pytest.mark.parametrize("case_id", ["gpt2-tied", "llama-untied"])
def test_convert_round_trip_from_transformers_files(cases, case_id, tmp_path, offline, capsys):
    """HF's own save_pretrained -> pipekit file -> HF dir -> from_pretrained: same logits."""
    case = cases[case_id]
    case.model.save_pretrained(str(tmp_path / "src"))
    pk = str(tmp_path / "model.pt")
    assert convert_cli("--from-hf", str(tmp_path / "src"), "--out", pk) == 0
    family, cfg, full = interchange.load_pipekit_file(pk)
    assert (family, cfg) == (case.family, case.cfg) and same_state(full, case.full)
    assert convert_cli("--to-hf", pk, "--out", str(tmp_path / "dst")) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"), attn_implementation="eager")
    assert same_state(loaded.state_dict(), case.hf_sd)
    assert max_diff(hf_logits(loaded.eval(), case.ids), case.logits) == 0.0
    assert convert_cli("--to-hf", pk, "--out", str(tmp_path / "dst")) == 2
    assert "overwrite" in capsys.readouterr().err
    assert convert_cli("--from-hf", str(tmp_path / "nowhere"), "--out", pk + "2") == 2
    assert "config.json" in capsys.readouterr().err


def test_convert_to_bfloat16(cases, tmp_path, offline):
    case = cases["llama-untied"]
    pk = str(tmp_path / "model.pt")
    interchange.save_pipekit_file(case.family, case.cfg, case.full, pk)
    interchange.convert(pk, str(tmp_path / "bf16"), "to_hf", dtype=torch.bfloat16)
    _, _, full = interchange.load_hf_checkpoint(str(tmp_path / "bf16"))
    assert all(t.dtype == torch.bfloat16 for t in full.values())
    assert all(torch.equal(full[k], case.full[k].to(torch.bfloat16)) for k in full)
    with pytest.raises(ValueError, match="from_hf"):
        interchange.convert(pk, str(tmp_path / "x"), "sideways")


def test_padded_vocab_files(cases, tmp_path, offline):
    """61 ids in 64 rows: the pipekit tables carry 3 zero rows, HF's files and
    from_pretrained see 61; a pipekit file keeps the multiple; a file from before
    padding (no vocab_pad_multiple, 61-row tables) reads with the default multiple,
    its tables padded with zero rows."""
    for case_id in ODD_IDS:
        case = cases[case_id]
        assert case.cfg.padded_vocab == 64
        for name in hf.vocab_tensor_names(case.cfg):
            assert case.full[name].shape[0] == 64 and not case.full[name][ODD:].any(), name
        out = tmp_path / case_id
        interchange.save_hf_checkpoint(case.family, case.full, case.cfg, str(out))
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
        assert loaded.config.vocab_size == ODD and same_state(loaded.state_dict(), case.hf_sd)
        assert max_diff(hf_logits(loaded, case.ids), case.logits) == 0.0

        pk = str(tmp_path / f"{case_id}.pt")
        interchange.save_pipekit_file(case.family, case.cfg, case.full, pk)
        family, cfg, full = interchange.load_pipekit_file(pk)
        assert (family, cfg) == (case.family, case.cfg) and same_state(full, case.full)

        old = asdict(case.cfg)
        old.pop("vocab_pad_multiple")
        unpadded = {k: v[:ODD].clone() if k in hf.vocab_tensor_names(case.cfg) else v for k, v in case.full.items()}
        torch.save({"family": case.family, "config": old, "state_dict": unpadded}, pk)
        family, cfg, full = interchange.load_pipekit_file(pk)
        assert cfg == with_overrides(case.cfg, vocab_pad_multiple=128) and cfg.padded_vocab == 128
        assert all(full[n].shape[0] == 128 and not full[n][ODD:].any() for n in hf.vocab_tensor_names(cfg))
        assert same_state(hf.to_hf_state_dict(family, full, cfg), case.hf_sd)


def test_reads_hub_style_gpt2_checkpoint(cases):
    """The hub's GPT-2 files are saved from GPT2Model (no `transformer.` prefix,
    no lm_head) and hold causal-mask buffers `attn.bias`."""
    case = cases["gpt2-tied"]
    hub = {k.removeprefix("transformer."): v for k, v in case.hf_sd.items() if k != "lm_head.weight"}
    for i in range(case.cfg.n_layers):
        hub[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, 32, 32))
    assert same_state(hf.from_hf_state_dict("gpt2", hub, case.cfg), case.full)


# ---- configs and errors --------------------------------------------------------------
@pytest.mark.parametrize("family,flavour", [("gpt2", "tiny"), ("gpt2", "124m"), ("gpt2", "1.5b"),
                                            ("llama", "tiny"), ("llama", "3-8b"), ("llama", "3-70b")])
def test_config_round_trip(family, flavour):
    cfg = get_model(family, flavour)
    hf_cfg = hf.hf_config_from(cfg)
    assert hf.config_from_hf(hf_cfg) == cfg
    assert hf.config_from_hf(hf_cfg.to_dict()) == cfg  # config.json as a dict


def test_untied_gpt2_round_trip_config():
    cfg = get_model("gpt2", tie_embeddings=False)
    assert hf.config_from_hf(hf.hf_config_from(cfg)) == cfg


@pytest.mark.parametrize("change,match", [
    ({"activation_function": "relu"}, "activation_function"),
    ({"scale_attn_by_inverse_layer_idx": True}, "scale_attn_by_inverse_layer_idx"),
    ({"n_inner": 100}, "n_inner"),
])
def test_unsupported_gpt2_options(change, match):
    d = hf_config("gpt2", True).to_dict() | change
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(d)


@pytest.mark.parametrize("change,match", [
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0}}, "llama3.*low_freq_factor"),
    ({"rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                          "high_freq_factor": 4.0, "beta": 1}}, "unknown key.*beta"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 500000.0, "factor": 4.0}}, "yarn.*valid.*linear"),
    ({"rope_parameters": None, "rope_scaling": {"type": "dynamic", "factor": 2.0}}, "dynamic"),
    ({"rope_parameters": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0.5}}, "factor must be"),
    ({"attention_bias": True}, "attention_bias"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"head_dim": 7}, "head dim 7 must be even"),
    ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.75}}, "0.75"),
    ({"model_type": "bert"}, "model_type.*qwen3"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8}, "sliding"),
    ({"model_type": "qwen3", "attention_bias": True}, "attention_bias"),
])
def test_unsupported_llama_options(change, match):
    d = hf_config("llama", False).to_dict() | change
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(d)


def test_llama_variant_configs():
    """What each variant's config.json becomes, and back: the scaled rope, head_dim, the biases,
    the head norms; Mistral's window bounds max_seq_len (only there does it mask nothing)."""
    cfg = hf.config_from_hf(hf_config("llama3rope", False))
    assert cfg.rope_scaling == LLAMA3_ROPE and cfg.head_dim is None and not (cfg.qkv_bias or cfg.qk_norm)
    back = hf.hf_config_from(cfg)
    assert type(back) is transformers.LlamaConfig and back.rope_parameters["rope_type"] == "llama3"
    assert hf.config_from_hf(back) == cfg
    short = {k: v for k, v in LLAMA3_ROPE.items() if k != "original_max_position_embeddings"}
    assert hf.config_from_hf(hf_config("llama", False).to_dict() | {"rope_parameters": {
        **short, "rope_theta": 1e4}}).rope_scaling["original_max_position_embeddings"] == 32  # HF's fallback
    linear = hf.config_from_hf(hf_config("llama", False).to_dict() | {
        "rope_parameters": None, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert linear.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    q3 = hf.config_from_hf(hf_config("qwen3", False))
    assert (q3.head_dim, q3.qk_norm, q3.qkv_bias, q3.attn_head_dim) == (16, True, False, 16)
    assert type(hf.hf_config_from(q3)) is transformers.Qwen3Config and hf.config_from_hf(hf.hf_config_from(q3)) == q3
    q2 = hf.config_from_hf(hf_config("qwen2", True))
    assert (q2.qkv_bias, q2.qk_norm, q2.tie_embeddings) == (True, False, True)
    assert type(hf.hf_config_from(q2)) is transformers.Qwen2Config and hf.config_from_hf(hf.hf_config_from(q2)) == q2
    mistral = hf.config_from_hf(hf_config("mistral", False))
    assert (mistral.sliding_window, mistral.max_seq_len) == (WINDOW, 32)
    assert type(hf.hf_config_from(mistral)) is transformers.MistralConfig
    assert hf.config_from_hf(hf.hf_config_from(mistral)) == mistral
    for covering in (None, 32, 4096):  # a window over every position masks nothing: plain Llama
        d = hf_config("mistral", False).to_dict() | {"sliding_window": covering}
        assert hf.config_from_hf(d).sliding_window is None
    with pytest.raises(ValueError, match="qkv_bias, sliding_window has no Hugging Face qwen2 form nor any"):
        hf.hf_config_from(with_overrides(mistral, qkv_bias=True))
    no_window = hf.config_from_hf(hf_config("mistral", False).to_dict() | {"sliding_window": None})
    assert no_window.hf_model_type == "mistral" and type(hf.hf_config_from(no_window)) is transformers.MistralConfig
    phi3 = hf.config_from_hf(hf_config("phi3", False))
    assert (phi3.hf_model_type, phi3.sliding_window) == ("phi3", WINDOW)
    assert type(hf.hf_config_from(phi3)) is transformers.Phi3Config
    assert hf.config_from_hf(hf.hf_config_from(phi3)) == phi3
    with pytest.raises(ValueError, match="has no Hugging Face llama form .it fits mistral, phi3"):
        hf.hf_config_from(with_overrides(mistral, hf_model_type="llama"))
    with pytest.raises(ValueError, match="qk_norm, qkv_bias has no Hugging Face qwen3 form nor any other"):
        hf.hf_config_from(with_overrides(q3, qkv_bias=True))
    from pipekit.models import mixtral
    with pytest.raises(ValueError, match="qkv_bias=True"):
        hf.hf_config_from(mixtral.MixtralConfig(**{**asdict(get_model("mixtral", "tiny")), "qkv_bias": True}))


def test_old_llama_config_json_keys():
    """config.json files written before transformers 5 carry rope_theta at the top level."""
    d = hf_config("llama", False).to_dict()
    d.pop("rope_parameters")
    d |= {"rope_theta": 123.0, "rope_scaling": None}
    assert hf.config_from_hf(d).rope_theta == 123.0


def test_state_dict_mismatches_are_named(cases):
    case = cases["llama-untied"]
    sd = dict(case.hf_sd)
    sd.pop("model.layers.1.mlp.up_proj.weight")
    with pytest.raises(KeyError, match="up_proj"):
        hf.from_hf_state_dict("llama", sd, case.cfg)
    with pytest.raises(ValueError, match="does not use"):
        hf.from_hf_state_dict("llama", {**case.hf_sd, "model.layers.2.mlp.up_proj.weight": torch.zeros(1)}, case.cfg)
    with pytest.raises(ValueError, match="mlp.gate.weight"):
        hf.from_hf_state_dict("llama", case.hf_sd, with_overrides(case.cfg, hidden=64))
    with pytest.raises(ValueError, match="does not match the config"):
        hf.to_hf_state_dict("gpt2", case.full, get_model("gpt2"))
    with pytest.raises(ValueError, match="must agree"):
        hf.to_hf_state_dict("gpt2", case.full, case.cfg)
    with pytest.raises(ValueError, match="valid families"):
        hf.from_hf_state_dict("bert", case.hf_sd, case.cfg)


def test_the_toy_family_has_no_hf_form():
    """A family without a Hugging Face adapter (`hf.ADAPTERS`) is refused in one line, wherever it is asked."""
    toy = get_model("toy")
    said = "'toy' model, which has no Hugging Face form; only gpt2, llama and mixtral models convert"
    for call in (lambda: hf.hf_config_from(toy), lambda: hf.to_hf_state_dict("toy", {}, toy),
                 lambda: hf.from_hf_state_dict("toy", {}, toy)):
        with pytest.raises(ValueError, match=said):
            call()


@pytest.mark.parametrize("scaling", [dict(LLAMA3_ROPE), {"rope_type": "linear", "factor": 4.0},
                                     {**LLAMA3_ROPE, "factor": 32.0, "original_max_position_embeddings": 8192}])
def test_scaled_rope_frequencies_are_transformers(scaling):
    """pipekit's scaled rotary frequencies are transformers' own (its rope init functions), bitwise
    in float32, at a Llama-3.1 head (128 wide, theta 500000) and at the tests' tiny one."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from pipekit.layers.rotary import inv_frequencies, rope_scaling_of
    for dim, heads, theta in ((4096, 32, 500000.0), (32, 4, 10000.0)):
        config = transformers.LlamaConfig(hidden_size=dim, num_attention_heads=heads, rope_theta=theta,
                                          max_position_embeddings=131072, rope_scaling=dict(scaling))
        theirs, _ = ROPE_INIT_FUNCTIONS[scaling["rope_type"]](config, "cpu")
        ours = inv_frequencies(dim // heads, theta, rope_scaling_of(scaling))
        assert ours.dtype == theirs.dtype == torch.float32 and torch.equal(ours, theirs), (dim, scaling)
        assert not torch.equal(ours, inv_frequencies(dim // heads, theta)), "the scaling must change something"


def test_a_qwen3_dir_sets_the_run_model(cases, tmp_path, offline):
    """`pipekit train model.init=<a Qwen3 dir>`: the run's model takes the head norms and the head
    width from the weights; a key that contradicts them is refused naming both values, one that
    does not shape them (the rope scaling, for a longer context) may change."""
    from pipekit.config import ConfigError, load_run

    case = cases["qwen3-untied"]
    case.model.save_pretrained(str(tmp_path / "q3"))
    init = f"model.init={tmp_path / 'q3'}"
    run = load_run(None, [init, "data.source=synthetic", "train.seq_len=16", "train.steps=1"])
    assert run.model == case.cfg and (run.model.qk_norm, run.model.head_dim) == (True, 16)
    with pytest.raises(ConfigError, match="model.qk_norm=False contradicts"):
        load_run(None, [init, "data.source=synthetic", "train.seq_len=16", "model.qk_norm=false"])
    longer = load_run(None, [init, "data.source=synthetic", "train.seq_len=16",
                             "model.rope_scaling={rope_type: linear, factor: 2.0}"])
    assert longer.model.rope_scaling == {"rope_type": "linear", "factor": 2.0}
