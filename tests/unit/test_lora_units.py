"""LoRA (``dsrl.model.lora``, dsrl/rl/policy/lora.py) in one process: the config and its refusals, the adapters as
the only
trainable parameters (identical on every build, the caller's RNG untouched), the merged weights a generator gets
(equal outputs, trained tensors untouched, modules_to_save, disabled adapters), the KL reference with adapters
disabled, and the check's comparison against a float64 reference of the same PEFT model with planted bugs that it
must catch. The multi-rank halves (ZeRO 0-3, resume, export) are tests/distributed/test_lora.py."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

pytest.importorskip("peft", reason="PEFT is not installed (in the dsrl checkout: pip install -e '.[lora]')")

from dsrl.cli import check as C  # noqa: E402
from dsrl.cli.check_lora import adapter_parameters, lora_model_for, with_adapters  # noqa: E402
from dsrl.config import ConfigError, LoraConfig, ModelConfig, load_config  # noqa: E402
from dsrl.rl.policy.lora import INSTALL_HINT, AdaptersDisabled, import_peft, is_lora_model  # noqa: E402
from dsrl.rl.policy.model import build_model  # noqa: E402
from dsrl.rollout.policy import generation_weights, peft_inner, unwrap  # noqa: E402

PAD, BOS, EOS, VOCAB = 0, 1, 2, 32
TOL = 1e-6


def tiny(lora: LoraConfig | None = None, seed: int = 0, **tiny_overrides) -> torch.nn.Module:
    return build_model(ModelConfig(arch="qwen2", tiny=tiny_overrides, lora=lora), VOCAB, PAD, BOS, EOS,
                       on_gpu=False, seed=seed)


def randomize_b(model: torch.nn.Module, seed: int = 1, std: float = 0.3) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * std)


def test_config_section_and_its_errors():
    assert ModelConfig().lora is None
    batch = {"micro_batch_size_per_rank": 1}
    lora = {"r": 4, "target_modules": ["q_proj", "v_proj"]}
    lora = load_config({"dsrl": {"batch": batch, "run": {"rollouts": 1}, "model": {"lora": lora}}}).dsrl.model.lora
    assert (lora.r, lora.alpha, lora.dropout, lora.target_modules) == (4, 16.0, 0.0, ["q_proj", "v_proj"])
    empty = load_config({"dsrl": {"batch": batch, "run": {"rollouts": 1}, "model": {"lora": {}}}}).dsrl.model.lora
    assert empty.target_modules == "all-linear"
    for bad, words in (({"r": 0}, "dsrl.model.lora.r"), ({"target_modules": []}, "at least one module"),
                       ({"modules_to_save": [""]}, "dsrl.model.lora.modules_to_save"),
                       ({"dropout": 1.0}, "dsrl.model.lora.dropout"), ({"rr": 4}, "did you mean dsrl.model.lora.r")):
        with pytest.raises(ConfigError, match=words):
            ModelConfig(lora=bad)


def test_missing_peft_names_the_extra(monkeypatch):
    from dsrl.backends.deepspeed import validation

    monkeypatch.setitem(sys.modules, "peft", None)
    with pytest.raises(ImportError) as e:
        import_peft()
    assert str(e.value) == INSTALL_HINT and "pip install -e '.[lora]'" in INSTALL_HINT
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)  # the run-file check, before any work
    with pytest.raises(ConfigError, match=r"pip install -e '.\[lora\]'"):
        validation.check_lora_run({})


def test_only_adapters_train_identical_builds_and_rng_untouched():
    torch.manual_seed(5)
    state = torch.get_rng_state()
    a, b = tiny(LoraConfig(r=4)), tiny(LoraConfig(r=4))
    assert torch.equal(torch.get_rng_state(), state)
    assert is_lora_model(a) and a.training
    trainable = [n for n, p in a.named_parameters() if p.requires_grad]
    assert trainable and trainable == adapter_parameters(dict(a.named_parameters()))
    sa, sb = a.state_dict(), b.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    # B starts at zero: the adapted model is the base model until the first update.
    base = tiny()
    ids = torch.randint(3, VOCAB, (2, 7))
    with torch.no_grad():
        torch.testing.assert_close(a.eval()(input_ids=ids).logits, base.eval()(input_ids=ids).logits, atol=0, rtol=0)


def test_refusals_before_any_work():
    with pytest.raises(ConfigError, match="tied word embeddings"):
        tiny(LoraConfig(target_modules=["q_proj", "embed_tokens"]))
    with pytest.raises(ConfigError, match="tied word embeddings"):
        tiny(LoraConfig(modules_to_save=["lm_head"]))
    with pytest.raises(ConfigError, match="target_modules"):
        tiny(LoraConfig(target_modules=["no_such_layer"]))
    from dsrl.backends.deepspeed.engine import prepare

    run = {"tensor_parallel": {"autotp_size": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "dsrl": {"batch": {"prompts_per_rollout": 2, "samples_per_prompt": 2, "mini_batch_size": 2,
                              "micro_batch_size_per_rank": 1}, "run": {"rollouts": 1},
                    "model": {"lora": {"r": 4}}}}
    with pytest.raises(ConfigError, match="AutoTP replaces the linear layers"):
        prepare(run, world_size=2, on_gpu=False)
    run["dsrl"]["model"] = {}
    prepare(run, world_size=2, on_gpu=False)  # the same layout without LoRA is fine


@pytest.mark.parametrize("tied", [True, False])
def test_merged_weights_reproduce_the_adapted_model_without_touching_it(tied):
    model = tiny(LoraConfig(r=4, alpha=8.0, modules_to_save=None if tied else ["lm_head"]), tie_word_embeddings=tied)
    randomize_b(model)
    if not tied:
        with torch.no_grad():  # the trained copy of the head differs from the frozen original
            model.base_model.model.lm_head.modules_to_save["default"].weight.mul_(1.5)
    before = {k: t.clone() for k, t in model.state_dict().items()}
    inner, engine = unwrap(model)
    assert engine is None and inner is peft_inner(model) and inner is model.get_base_model()
    merged = dict(generation_weights(inner))
    assert all(torch.equal(before[k], t) for k, t in model.state_dict().items())  # nothing modified in place
    plain = tiny(seed=9, tie_word_embeddings=tied)
    assert sorted(merged) == sorted(plain.state_dict())
    assert "lm_head.weight" in merged  # vLLM's CPU backend refreshes its packed head from this name
    plain.load_state_dict(merged, strict=True)
    ids = torch.randint(3, VOCAB, (3, 9))
    with torch.no_grad():
        want = model.eval()(input_ids=ids).logits
        got = plain.eval()(input_ids=ids).logits
        torch.testing.assert_close(got, want, atol=2e-6, rtol=0)
        # adapters off: the base weights themselves
        with model.disable_adapter():
            off = dict(generation_weights(inner))
            base_logits = model(input_ids=ids).logits
    plain.load_state_dict(off, strict=True)
    with torch.no_grad():
        torch.testing.assert_close(plain(input_ids=ids).logits, base_logits, atol=0, rtol=0)
    # a model without adapters: its own state_dict, unchanged
    other = tiny()
    assert [n for n, _ in generation_weights(other)] == list(other.state_dict())


def test_reference_is_the_base_model_and_adapters_come_back():
    model = tiny(LoraConfig(r=4))
    base = copy.deepcopy(model.get_base_model())  # before B moves: the base weights, still wrapped by no-op layers
    randomize_b(model)

    class Policy:  # RLEngine's surface that AdaptersDisabled uses
        module = model

        @staticmethod
        def forward_no_grad(micros, fn):
            model.eval()
            return [fn(model, m) for m in micros]

    ids = torch.randint(3, VOCAB, (2, 6))

    def fn(m, micro):
        return m(input_ids=micro).logits

    ref = AdaptersDisabled(Policy).forward_no_grad([ids], fn)[0]
    with torch.no_grad():
        torch.testing.assert_close(ref, base.eval()(input_ids=ids).logits, atol=0, rtol=0)
        assert (fn(model, ids) - ref).abs().max() > 1e-2  # the adapters are on again
    assert [n for n, p in model.named_parameters() if p.requires_grad] == adapter_parameters(
        dict(model.named_parameters()))
    with pytest.raises(TypeError):
        AdaptersDisabled(type("P", (), {"module": tiny()}))


def _sgd_update(model: torch.nn.Module, seqs: list[dict], lr: float = 2.0 ** 20) -> dict[str, torch.Tensor]:
    """The applied update of one float32 SGD step on the token-mean policy loss (one process, one batch)."""
    before = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    batch = C.collate(seqs)
    lt = C.per_token_loss(model, batch)
    mask = batch["loss_mask"].to(lt.dtype)
    ((lt * mask).sum() / mask.sum()).backward()
    opt.step()
    return {n: (before[n] - p.detach().double()) / lr for n, p in model.named_parameters()}


def test_check_comparison_and_planted_bugs():
    """The check's comparison on a PEFT model: a correct float32 step matches the float64 reference of the same
    adapters (<= 1e-6), while a wrong adapter scaling, a base weight that trains and a dropped micro-batch are
    each caught by orders of magnitude."""
    lora = LoraConfig(r=4, alpha=8.0)
    torch.manual_seed(0)
    model = with_adapters(C.build_model("qwen2"), lora, seed=0)
    seqs = C.make_sequences(8, 0)
    ref = C.reference_gradient(model, seqs, "token-mean", C.MAX_LEN)
    assert all(not ref[n].any() for n, p in model.named_parameters() if not p.requires_grad)
    good = _sgd_update(copy.deepcopy(model), seqs)
    assert C.relative_error(good, ref) <= TOL
    # planted: the trainer's adapters scaled differently from the reference's (alpha 16 instead of 8)
    scaled = copy.deepcopy(model)
    for m in scaled.modules():
        if hasattr(m, "scaling") and isinstance(m.scaling, dict):
            m.scaling = {k: 2 * v for k, v in m.scaling.items()}
    assert C.relative_error(_sgd_update(scaled, seqs), ref) > 1e-2
    # planted: a frozen base weight trains too (its reference gradient is 0: any movement is an error)
    leaky = copy.deepcopy(model)
    leaky.get_base_model().model.norm.weight.requires_grad_(True)
    assert C.relative_error(_sgd_update(leaky, seqs), ref) > 1e-2
    # planted: a micro-batch left out of the step
    assert C.relative_error(_sgd_update(copy.deepcopy(model), seqs[:-2]), ref) > 1e-2


def test_check_models_under_lora():
    assert lora_model_for("auto", "policy") == "qwen2" and lora_model_for("llama", "policy,gspo") == "llama"
    with pytest.raises(ConfigError, match="--model qwen2 or llama"):
        lora_model_for("tiny", "policy")
    with pytest.raises(ConfigError, match="critic trains all its parameters"):
        lora_model_for("auto", "value")


def test_lora_config_file_is_valid():
    from conftest import REPO

    raw = json.loads((REPO / "configs" / "tiny_grpo_lora_cpu.json").read_text())
    cfg = load_config(raw)
    assert cfg.dsrl.model.lora is not None and cfg.dsrl.sft.steps > 0
    # derived from the default: the same task, batch and algorithm
    default = json.loads((REPO / "configs" / "tiny_grpo_cpu.json").read_text())
    assert raw["dsrl"]["batch"] == default["dsrl"]["batch"] and raw["dsrl"]["data"] == default["dsrl"]["data"]


def test_checkpoint_estimate_counts_optimizer_state_for_adapters_only():
    """The free-space check before a run: 12 bytes of optimizer state per trainable parameter only, the frozen
    base counted twice (ZeRO 2-3 record frozen weights again for the consolidation)."""
    from dsrl.checkpoint.run_dir import estimate_checkpoint_bytes

    full, lora = tiny(), tiny(LoraConfig(r=4))
    n = sum(p.numel() for p in full.parameters())
    t = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert estimate_checkpoint_bytes(full) == n * (4 + 12)
    assert estimate_checkpoint_bytes(lora) == (n + t) * 4 + t * 12 + n * 4 < estimate_checkpoint_bytes(full)


def test_resume_check_of_the_checkpoints_adapters():
    """dsrl.checkpoint.adapters.check_resume: what a checkpoint recorded against this run's dsrl.model.lora (the
    real jobs: tests/distributed/test_lora.py::test_resume_with_model_lora_changed_is_refused_naming_it)."""
    from dsrl.checkpoint.adapters import NOT_KNOWN, ON, check_resume, record

    saved = record(LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "v_proj"]))["lora"]
    check_resume("ckpt", saved, LoraConfig(r=8, alpha=16.0, target_modules=["q_proj", "v_proj"], dropout=0.1))
    check_resume("ckpt", None, None)
    check_resume("ckpt", NOT_KNOWN, LoraConfig())  # nothing recorded, no hf/: not checked
    check_resume("ckpt", ON, LoraConfig(r=2))  # on, settings unknown: on/off only
    for lora, words in ((LoraConfig(r=8, alpha=8.0, target_modules=["q_proj", "v_proj"]),
                         "dsrl.model.lora.alpha = 8.0 where it was 16.0"),
                        (LoraConfig(r=8, alpha=16.0), 'dsrl.model.lora.target_modules = "all-linear" where it was '
                                                      '["q_proj", "v_proj"]'),
                        (None, "dsrl.model.lora is not set"), ):
        with pytest.raises(ConfigError) as e:
            check_resume("ckpt", saved, lora)
        assert words in str(e.value)
    with pytest.raises(ConfigError, match="was trained without it"):
        check_resume("ckpt", None, LoraConfig())
