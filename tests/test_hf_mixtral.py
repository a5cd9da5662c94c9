"""Hugging Face interchange for the Mixtral family: tiny random MixtralForCausalLM, float32.

Each case builds a transformers Mixtral from a config object (vocab 64, padded
to 128 in pipekit; hidden 32, 4 heads, 2 kv heads, 4 experts of width 16,
top-2; every parameter perturbed), converts it, loads it into a
PipelineModule built in this process and must reproduce HF's logits within
1e-5; converting back must give HF's state dict exactly, and so must both
on-disk forms: the fused one pipekit exports (loaded by from_pretrained) and
the per-expert w1/w2/w3 one (what transformers' own save_pretrained writes).

The router losses. pipekit's block l records (under "moe/{l}/aux_loss")
    aux_l = E * sum_i f_li * P_li,   f_li = slots routed to expert i / (T * top_k)
(T tokens, P_li the mean softmax probability of expert i), while HF's
`load_balancing_loss_func` counts top-k assignments per token (F_li = top_k *
f_li) and, over several layers, multiplies the layer MEANS:
    aux_HF = E * sum_i mean_l(F_li) * mean_l(P_li) = top_k * mean_{l,m} A_lm,
    A_lm = E * sum_i f_li * P_mi,   so A_ll = aux_l.
For one layer that is exactly aux_HF = top_k * aux_1 (measured on the 1-layer
case: 2.0 times pipekit's value); with two, HF's value mixes the layers' loads
and probabilities, and the test checks the formula term by term with pipekit's
recorded loads. The coefficients convert as aux_loss_coef = router_aux_loss_coef
* top_k / n_layers (hf.hf_config_from), which makes the two loss terms equal
for one layer.
"""

from __future__ import annotations

from dataclasses import asdict

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_hf import TOL, hf_logits, max_diff, same_state  # noqa: E402
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func  # noqa: E402

import pipekit  # noqa: E402
from pipekit import auxloss, interchange  # noqa: E402
from pipekit.checkpoint import full_state_dict, load_full_state_dict, save_checkpoint  # noqa: E402
from pipekit.cli import main  # noqa: E402
from pipekit.models import get_model, hf, model_specs, with_overrides  # noqa: E402

VOCAB, SEQ, BATCH = 64, 16, 4
N_EXPERTS, TOP_K, HIDDEN = 4, 2, 16
HF_AUX_COEF = 0.02


def hf_config(n_layers: int, tied: bool):
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=HIDDEN, num_hidden_layers=n_layers,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=N_EXPERTS, num_experts_per_tok=TOP_K,
        max_position_embeddings=32, rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=tied,
        router_aux_loss_coef=HF_AUX_COEF, attn_implementation="eager")


CASES = {"2-layers": (2, False), "1-layer-tied": (1, True)}


class Case:
    """An HF Mixtral, its pipekit config and full state dict, a batch, HF's logits and router
    logits, and pipekit's logits and router metrics from a train-mode forward."""

    def __init__(self, n_layers: int, tied: bool):
        torch.manual_seed(0)
        self.model = transformers.MixtralForCausalLM(hf_config(n_layers, tied)).eval()
        with torch.no_grad():
            for p in self.model.parameters():
                p.add_(0.05 * torch.randn_like(p))
        self.hf_sd = {k: v.detach().clone() for k, v in self.model.state_dict().items()}
        self.cfg = hf.config_from_hf(self.model.config)
        self.full = hf.from_hf_state_dict("mixtral", self.hf_sd, self.cfg)
        self.ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            self.out = self.model(self.ids, output_router_logits=True)
        self.module = pipekit.PipelineModule(model_specs(self.cfg), seed=0)
        load_full_state_dict(self.module, self.full)
        auxloss.metrics.pop()  # whatever an earlier test left
        with torch.no_grad():
            self.logits = self.module.train()(self.ids)  # (B, T, padded vocab)
        self.metrics = auxloss.metrics.pop()


@pytest.fixture(scope="module")
def cases() -> dict:
    return {name: Case(*args) for name, args in CASES.items()}


@pytest.fixture
def offline(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")


def per_expert_form(hf_sd: dict, n_layers: int) -> dict:
    """`hf_sd` (fused) in the per-expert names and layouts of transformers < 5."""
    out = {k: v for k, v in hf_sd.items() if ".mlp." not in k}
    for i in range(n_layers):
        p, q = f"model.layers.{i}.mlp.", f"model.layers.{i}.block_sparse_moe."
        out[q + "gate.weight"] = hf_sd[p + "gate.weight"]
        gate_up, down = hf_sd[p + "experts.gate_up_proj"], hf_sd[p + "experts.down_proj"]
        for e in range(N_EXPERTS):
            out[f"{q}experts.{e}.w1.weight"] = gate_up[e, :HIDDEN].clone()  # (H, D)
            out[f"{q}experts.{e}.w3.weight"] = gate_up[e, HIDDEN:].clone()
            out[f"{q}experts.{e}.w2.weight"] = down[e].clone()  # (D, H)
    return out


def convert_cli(*argv: str) -> int:
    return main(["convert", *argv])


# ---- weights and logits --------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_converted_model_gives_transformers_logits_and_converts_back_exactly(cases, name):
    case = cases[name]
    assert case.cfg.padded_vocab == 128 and case.logits.shape == (BATCH, SEQ, 128)
    assert max_diff(case.logits[..., :VOCAB], case.out.logits) <= TOL
    assert bool((case.logits[..., VOCAB:] == float("-inf")).all()), "padded ids must get -inf logits"
    assert same_state(full_state_dict(case.module), case.full)
    back = hf.to_hf_state_dict("mixtral", full_state_dict(case.module), case.cfg)
    assert same_state(back, case.hf_sd)


def test_expert_layouts_are_transposes_of_hfs(cases):
    case = cases["2-layers"]
    gate_up = case.hf_sd["model.layers.1.mlp.experts.gate_up_proj"]  # (E, 2H, D)
    assert torch.equal(case.full["layers.2.mlp.experts.w_gate"][3], gate_up[3, :HIDDEN].t())
    assert torch.equal(case.full["layers.2.mlp.experts.w_up"][3], gate_up[3, HIDDEN:].t())
    assert torch.equal(case.full["layers.2.mlp.experts.w_down"][3],
                       case.hf_sd["model.layers.1.mlp.experts.down_proj"][3].t())
    assert torch.equal(case.full["layers.2.mlp.router.weight"], case.hf_sd["model.layers.1.mlp.gate.weight"])


# ---- router losses -------------------------------------------------------------------
def test_one_layer_hf_aux_loss_is_top_k_times_pipekits(cases):
    case = cases["1-layer-tied"]
    ours, count = case.metrics["moe/1/aux_loss"]
    assert count == 1
    theirs = case.out.aux_loss
    assert torch.allclose(theirs, TOP_K * ours, rtol=1e-6), (theirs.item(), ours.item())
    # the converted coefficient makes the loss terms equal
    assert case.cfg.aux_loss_coef == HF_AUX_COEF * TOP_K
    assert torch.allclose(case.cfg.aux_loss_coef * ours, HF_AUX_COEF * theirs, rtol=1e-6)


def test_hf_aux_loss_over_layers_is_top_k_times_the_mean_of_cross_layer_terms(cases):
    """Per block, HF's function on that block's router logits alone is top_k * pipekit's
    aux; over the model it is top_k * mean_{l,m} E * sum_i f_li P_mi, f from pipekit's loads."""
    case = cases["2-layers"]
    L, T = case.cfg.n_layers, BATCH * SEQ
    f, P = [], []
    for layer, logits in enumerate(case.out.router_logits, start=1):
        ours, count = case.metrics[f"moe/{layer}/aux_loss"]
        assert count == 1
        alone = load_balancing_loss_func((logits,), N_EXPERTS, TOP_K)
        assert torch.allclose(alone, TOP_K * ours, rtol=1e-6), (layer, alone.item(), ours.item())
        loads, _ = case.metrics[f"moe/{layer}/tokens_per_expert"]
        hf_loads = torch.bincount(logits.topk(TOP_K, dim=-1).indices.flatten(), minlength=N_EXPERTS)
        assert torch.equal(loads, hf_loads.float()), "pipekit and HF route the same tokens to the same experts"
        f.append(loads / (T * TOP_K))
        P.append(logits.softmax(-1).mean(0))
    cross = torch.stack([torch.stack([N_EXPERTS * (f[i] * P[j]).sum() for j in range(L)]) for i in range(L)])
    assert torch.allclose(torch.diagonal(cross), torch.stack([case.metrics[f"moe/{i}/aux_loss"][0]
                                                              for i in range(1, L + 1)]), rtol=1e-6)
    assert torch.allclose(case.out.aux_loss, TOP_K * cross.mean(), rtol=1e-6)


# ---- files and the CLI ---------------------------------------------------------------
@pytest.mark.parametrize("name", CASES)
def test_saved_export_is_fused_and_loads_in_transformers(cases, name, tmp_path, offline):
    from safetensors.torch import load_file

    case = cases[name]
    out = tmp_path / "hf"
    interchange.save_hf_checkpoint("mixtral", case.full, case.cfg, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert "model.layers.0.mlp.experts.gate_up_proj" in load_file(str(out / "model.safetensors"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded) is transformers.MixtralForCausalLM
    assert same_state(loaded.state_dict(), case.hf_sd)
    assert max_diff(hf_logits(loaded, case.ids), case.out.logits) == 0.0
    assert loaded.config.router_aux_loss_coef == HF_AUX_COEF
    family, cfg, full = interchange.load_hf_checkpoint(str(out))
    assert (family, cfg) == ("mixtral", case.cfg) and same_state(full, case.full)


def test_per_expert_w1_w2_w3_form_imports_to_the_same_weights(cases):
    case = cases["2-layers"]
    old = per_expert_form(case.hf_sd, case.cfg.n_layers)
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in old
    assert same_state(hf.from_hf_state_dict("mixtral", old, case.cfg), case.full)


def test_convert_round_trip_from_transformers_save_pretrained(cases, tmp_path, offline):
    """transformers' save_pretrained writes the per-expert form; convert reads it, and
    its export (fused) loads back into the same model."""
    case = cases["2-layers"]
    case.model.save_pretrained(str(tmp_path / "src"))
    pk = str(tmp_path / "model.pt")
    assert convert_cli("--from-hf", str(tmp_path / "src"), "--out", pk) == 0
    family, cfg, full = interchange.load_pipekit_file(pk)
    assert (family, cfg) == ("mixtral", case.cfg) and same_state(full, case.full)
    assert convert_cli("--to-hf", pk, "--out", str(tmp_path / "dst")) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "dst"), attn_implementation="eager")
    assert same_state(loaded.state_dict(), case.hf_sd)
    assert max_diff(hf_logits(loaded.eval(), case.ids), case.out.logits) == 0.0


def test_a_checkpoint_converts_to_transformers(cases, tmp_path, offline):
    case = cases["2-layers"]
    ckpt = save_checkpoint(str(tmp_path / "checkpoints" / "step_00000001"), case.module,
                           meta={"family": "mixtral", "model_config": asdict(case.cfg)})
    assert convert_cli("--to-hf", ckpt, "--out", str(tmp_path / "hf")) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    assert same_state(loaded.state_dict(), case.hf_sd)


# ---- configs and errors --------------------------------------------------------------
@pytest.mark.parametrize("flavour", ["tiny", "8x7b"])
def test_config_round_trip(flavour):
    cfg = get_model("mixtral", flavour)
    hf_cfg = hf.hf_config_from(cfg)
    assert hf_cfg.router_aux_loss_coef == pytest.approx(cfg.aux_loss_coef * cfg.n_layers / cfg.top_k)
    assert hf.config_from_hf(hf_cfg) == cfg
    assert hf.config_from_hf(hf_cfg.to_dict()) == cfg  # config.json as a dict
    odd = with_overrides(cfg, n_layers=3, aux_loss_coef=0.001)  # 0.0015 and back, exactly
    assert hf.config_from_hf(hf.hf_config_from(odd)) == odd


@pytest.mark.parametrize("overrides", [{"n_shared_experts": 1}, {"score": "sigmoid"}, {"n_groups": 4, "topk_groups": 2},
                                       {"bias_update_rate": 0.01}, "deepseek_tiny"])
def test_configs_without_a_hf_form_are_refused_in_one_line(cases, overrides, tmp_path, capsys):
    if overrides == "deepseek_tiny":
        cfg = get_model("mixtral", "deepseek_tiny")
        full = full_state_dict(pipekit.PipelineModule(model_specs(cfg), seed=0))
    else:
        cfg, full = with_overrides(cases["2-layers"].cfg, **overrides), cases["2-layers"].full
    for call in (lambda: hf.hf_config_from(cfg), lambda: hf.to_hf_state_dict("mixtral", full, cfg),
                 lambda: hf.from_hf_state_dict("mixtral", cases["2-layers"].hf_sd, cfg),
                 lambda: interchange.save_hf_checkpoint("mixtral", full, cfg, str(tmp_path / "hf"))):
        with pytest.raises(ValueError, match="Hugging Face's Mixtral lacks") as e:
            call()
        assert "\n" not in str(e.value)
    assert not (tmp_path / "hf").exists()
    pk = str(tmp_path / "model.pt")
    interchange.save_pipekit_file("mixtral", cfg, full, pk)
    assert convert_cli("--to-hf", pk, "--out", str(tmp_path / "hf")) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Hugging Face's Mixtral lacks" in err


@pytest.mark.parametrize("change,match", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ({"hidden_act": "gelu"}, "hidden_act"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0}}, "yarn"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_mixtral_options(change, match):
    d = hf_config(2, False).to_dict() | change
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(d)


def test_a_config_without_its_experts_is_named():
    d = hf_config(2, False).to_dict()
    d.pop("num_local_experts")
    with pytest.raises(ValueError, match="lacks 'num_local_experts'"):
        hf.config_from_hf(d)


def test_old_mixtral_config_json_keys():
    """Before transformers 5: rope_theta at the top level (Mixtral's default 1e6)."""
    d = hf_config(2, False).to_dict()
    d.pop("rope_parameters")
    assert hf.config_from_hf(d).rope_theta == 1e6
    assert hf.config_from_hf(d | {"rope_theta": 123.0}).rope_theta == 123.0


def test_state_dict_mismatches_are_named(cases):
    case = cases["2-layers"]
    old = per_expert_form(case.hf_sd, 2)
    with pytest.raises(KeyError, match="experts.3.w3"):
        hf.from_hf_state_dict("mixtral", {k: v for k, v in old.items() if "1.block_sparse_moe.experts.3.w3" not in k},
                              case.cfg)
    extra = {**old, "model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(HIDDEN, 32)}
    with pytest.raises(ValueError, match="does not use"):
        hf.from_hf_state_dict("mixtral", extra, case.cfg)
    with pytest.raises(ValueError, match="gate_up_proj has shape"):
        hf.from_hf_state_dict("mixtral", case.hf_sd, with_overrides(case.cfg, hidden=32))
    with pytest.raises(ValueError, match="mlp.router.weight"):
        hf.from_hf_state_dict("mixtral", case.hf_sd, with_overrides(case.cfg, n_experts=8))


# ---- Qwen3-MoE: the Mixtral family with q/k head norms, wide heads and its own top-k rescaling ----------
def qwen3_moe(norm_topk_prob: bool):
    torch.manual_seed(0)
    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=HIDDEN, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=N_EXPERTS,
        num_experts_per_tok=TOP_K, norm_topk_prob=norm_topk_prob, max_position_embeddings=32, rope_theta=10000.0,
        rms_norm_eps=1e-5, router_aux_loss_coef=HF_AUX_COEF, attn_implementation="eager")
    model = transformers.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model


def pipekit_logits(cfg, full: dict, ids: torch.Tensor) -> torch.Tensor:
    module = pipekit.PipelineModule(model_specs(cfg), seed=0)
    load_full_state_dict(module, full)
    auxloss.metrics.pop()
    with torch.no_grad():
        out = module.train()(ids)[..., :VOCAB]
    auxloss.metrics.pop()
    return out


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_qwen3_moe_gives_transformers_logits_both_ways(norm_topk_prob, tmp_path, offline):
    """Qwen3-MoE (Qwen3-30B-A3B's architecture): the logits of transformers' model within 1e-5 with
    the top-k weights rescaled or not; HF's state dict back exactly; what save_pretrained writes
    (one tensor per expert) imports to the same weights; the export loads as a Qwen3MoeForCausalLM
    with the same logits, and its config comes back as the same pipekit config."""
    model = qwen3_moe(norm_topk_prob)
    hf_sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    cfg = hf.config_from_hf(model.config)
    assert (cfg.qk_norm, cfg.head_dim, cfg.hidden) == (True, 16, HIDDEN)
    assert cfg.renormalize == (None if norm_topk_prob else False)  # None: rescaled, the default at top_k > 1
    full = hf.from_hf_state_dict("mixtral", hf_sd, cfg)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    theirs = hf_logits(model, ids)
    assert max_diff(pipekit_logits(cfg, full, ids), theirs) <= TOL
    other = with_overrides(cfg, renormalize=not norm_topk_prob)
    assert max_diff(pipekit_logits(other, full, ids), theirs) > 1e-3, "the rescaling must show in the logits"
    assert same_state(hf.to_hf_state_dict("mixtral", full, cfg), hf_sd)
    model.save_pretrained(str(tmp_path / "saved"))
    family, again, from_disk = interchange.load_hf_checkpoint(str(tmp_path / "saved"))
    assert (family, again) == ("mixtral", cfg) and same_state(from_disk, full)
    interchange.save_hf_checkpoint("mixtral", full, cfg, str(tmp_path / "out"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), attn_implementation="eager")
    assert type(loaded) is transformers.Qwen3MoeForCausalLM and loaded.config.norm_topk_prob is norm_topk_prob
    assert max_diff(hf_logits(loaded.eval(), ids), theirs) == 0.0
    assert interchange.load_hf_checkpoint(str(tmp_path / "out"))[1] == cfg


@pytest.mark.parametrize("change,match", [
    ({"mlp_only_layers": [1]}, "mlp_only_layers"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step"),
    ({"use_sliding_window": True, "sliding_window": 8}, "sliding"),
    ({"attention_bias": True}, "attention_bias"),
])
def test_unsupported_qwen3_moe_options(change, match):
    d = qwen3_moe(True).config.to_dict() | change
    with pytest.raises(ValueError, match=match):
        hf.config_from_hf(d)


def test_a_mixtral_sliding_window_is_kept_where_it_masks_something():
    d = hf_config(1, False).to_dict()
    assert hf.config_from_hf(d | {"sliding_window": 4096}).sliding_window is None  # over 32 positions: nothing
    cfg = hf.config_from_hf(d | {"sliding_window": 8})
    assert cfg.sliding_window == 8 and hf.hf_config_from(cfg).sliding_window == 8


def test_a_mixtral_config_that_does_not_rescale_has_no_mixtral_form():
    """HF's Mixtral rescales every token's top-k weights (even one: to 1.0), so a config that does
    not is refused, naming the key; importing a Mixtral says renormalize=True, whatever its top_k."""
    cfg = get_model("mixtral", "tiny", renormalize=False)
    with pytest.raises(ValueError, match="renormalize=False"):
        hf.hf_config_from(cfg)
    with pytest.raises(ValueError, match="renormalize=None"):
        hf.hf_config_from(get_model("mixtral", "tiny", top_k=1))
    one = hf.config_from_hf(hf_config(1, False).to_dict() | {"num_experts_per_tok": 1})
    assert (one.top_k, one.renormalize) == (1, True)
    assert hf.config_from_hf(hf_config(1, False)).renormalize is None  # top_k=2: rescaled by default
