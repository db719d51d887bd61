"""Mixture-of-experts policies without a process group: the tiny MoE model, recording and replaying routes
(dsrl.rollout.routes) on transformers' routers, the router's load-balancing term against its definition, the hf
backend's routes and the replayed recompute of its behavior log-probs, the run-file refusals and `dsrl plan`.

Planted bugs: routes shifted by one token make the recompute miss the behavior log-probs by orders of magnitude
more than the aligned routes do; a forward whose forced routes are ignored (replay off while claimed on) differs
from the float64 reference of the forced routes."""

from __future__ import annotations

import json
import types

import pytest
import torch

from dsrl.cli.check_moe import moe_model, reference_aux, reference_routing, shifted
from dsrl.config import ConfigError, ModelConfig, RolloutConfig, load_config
from dsrl.core.logprobs import token_logprobs
from dsrl.core.routes import FREE, RouteShapeError, config_layout, differing_pairs, sequence_routes
from dsrl.rl.data.batching import Sample, collate, collate_packed
from dsrl.rl.policy.model import build_model
from dsrl.rollout.hf import HFRolloutBackend
from dsrl.rollout.routes import MoERouting

PAD, BOS, EOS = 0, 1, 2
TOK = types.SimpleNamespace(eos_token_id=EOS, pad_token_id=PAD)
PROMPTS = [[BOS, 5, 6, 7, 3, 4], [BOS, 4], [BOS, 3, 5, 3]]


def tiny_moe(seed: int = 0, **overrides) -> torch.nn.Module:
    return build_model(ModelConfig(arch="qwen3_moe", tiny=overrides), 16, PAD, BOS, EOS, on_gpu=False, seed=seed)


def random_routes(rows: int, layers: int, experts: int, top_k: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(rows, layers, experts, generator=g).argsort(-1)[..., :top_k]


def qwen2_moe() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(vocab_size=16, hidden_size=16, intermediate_size=32, moe_intermediate_size=16,
                            shared_expert_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    return AutoModelForCausalLM.from_config(config)


MODELS = {"qwen3_moe": tiny_moe, "mixtral": lambda: moe_model("mixtral", layers=2), "qwen2_moe": qwen2_moe}


def test_tiny_moe_model_and_layout():
    m = tiny_moe()
    lay = config_layout(m.config)
    assert (lay.layers, lay.experts, lay.top_k) == (2, 4, 2) and m.config.norm_topk_prob
    assert MoERouting.of(m).layout == lay and MoERouting.of(m) is MoERouting.of(m)  # one routing per model
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), tiny_moe().state_dict().values()))
    assert MoERouting.of(build_model(ModelConfig(arch="qwen2"), 16, PAD, BOS, EOS, on_gpu=False)) is None
    assert config_layout(types.SimpleNamespace(num_experts=8, num_experts_per_tok=2, num_hidden_layers=6,
                                               mlp_only_layers=[0], decoder_sparse_step=2)).layers == 3


@pytest.mark.parametrize("arch", sorted(MODELS))
def test_replaying_own_routes_is_bitwise_and_forced_routes_are_used(arch):
    """A forward's own routes replayed give the same logits bit for bit; random forced routes are the experts the
    forward records, change the output, and the router's gradient flows."""
    torch.manual_seed(0)
    m = MODELS[arch]()
    routing = MoERouting.of(m)
    lay = routing.layout
    ids = torch.randint(0, 16, (3, 7))
    with routing.recording() as log:
        natural = m(ids).logits
    assert log.forwards == 1 and log.call(0).shape == (21, lay.layers, lay.top_k)
    with routing.forcing(log.call(0)):
        assert torch.equal(m(ids).logits, natural)
    forced = random_routes(21, lay.layers, lay.experts, lay.top_k)
    forced[3] = FREE  # a position routed freely
    m.zero_grad()
    with routing.forcing(forced.view(3, 7, lay.layers, lay.top_k)), routing.recording() as log2:
        out = m(ids).logits
        out.square().sum().backward()
    got = log2.call(0).long()
    assert torch.equal(got[3], log.call(0)[3].long()) and torch.equal(torch.cat([got[:3], got[4:]]),
                                                                       torch.cat([forced[:3], forced[4:]]))
    assert not torch.allclose(out, natural)
    gates = [p.grad for n, p in m.named_parameters() if n.endswith("mlp.gate.weight")]
    assert len(gates) == lay.layers and all(g is not None and g.norm() > 0 for g in gates)
    assert torch.equal(m(ids).logits, natural)  # forcing ended with the block


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_forced_routes_match_the_float64_definition(arch):
    """The hooks' forced forward equals the MoE block written from its definition (dsrl.cli.check_moe) with the
    same routes, in a float64 model; the planted bug (forcing ignored) does not."""
    torch.manual_seed(1)
    m = moe_model(arch, layers=2).double()  # the eager expert loop: grouped_mm has no float64
    routing = MoERouting.of(m)
    lay = routing.layout
    ids = torch.randint(0, 16, (2, 6))
    forced = random_routes(12, lay.layers, lay.experts, lay.top_k, seed=3).view(2, 6, lay.layers, lay.top_k)
    with routing.forcing(forced):
        hooked = m(ids).logits
    ref = type(m)(m.config).double()
    ref.load_state_dict(m.state_dict())
    with reference_routing(ref, {"input_ids": ids, "routes": forced}, forced=True):
        expected = ref(ids).logits
    assert (hooked - expected).abs().max() < 1e-7  # transformers' routers take their softmax in float32
    assert (m(ids).logits - expected).abs().max() > 1e-4  # replay off while claimed on: visibly different


def test_shape_errors_name_the_layout():
    m = tiny_moe()
    routing = MoERouting.of(m)
    with pytest.raises(RouteShapeError, match=r"2 MoE layers to 2 experts \(\[\.\.\., 2, 2\] expected\)"):
        routing.force(torch.zeros(5, 3, 2, dtype=torch.long))
    with pytest.raises(RouteShapeError, match="outside 0..3"):
        routing.check_routes(torch.full((5, 2, 2), 4), "the routes of a sample")
    routing.force(torch.zeros(5, 2, 2, dtype=torch.long))
    with pytest.raises(RouteShapeError, match="cover 5 token rows but MoE layer 0's router sees 6"):
        m(torch.ones(1, 6, dtype=torch.long))
    routing.force(None)
    assert sequence_routes(torch.zeros(3, 2, 2), 5)[3:].eq(FREE).all() and sequence_routes(torch.zeros(3, 2, 2),
                                                                                           2).shape[0] == 2
    a = torch.tensor([[[0, 1]], [[2, 3]], [[FREE, FREE]]])
    b = torch.tensor([[[1, 0]], [[2, 1]], [[0, 1]]])
    assert differing_pairs(a, b) == (1, 2)  # order within a top-k does not matter; FREE rows are not compared


def test_hf_backend_routes_and_replayed_recompute_of_behavior_logprobs():
    """hf records [prompt + completion - 1, layers, top_k] routes per completion from generate's own forwards; the
    trainer's float32 recompute of the behavior log-probs with them replayed matches to <= 1e-6 (not bit for bit:
    generate decodes with a KV cache, the recompute runs the whole sequence at once) and the trainer's own routers
    choose the same experts here; routes shifted by one token (planted) miss by far more."""
    m = tiny_moe()
    backend = HFRolloutBackend(m, TOK, RolloutConfig(max_new_tokens=10, generation_batch_size=2))
    assert backend.returns_routes()
    cs = backend.generate(PROMPTS, 3, seed=0)
    routing = MoERouting.of(m)
    m.eval()
    worst = worst_shifted = 0.0
    for c in cs:
        toks = torch.tensor(c.prompt_ids + c.completion_ids)
        assert c.routes.shape == (len(toks) - 1, 2, 2) and c.routes.dtype == torch.int16
        inp, tgt = toks[:-1].unsqueeze(0), toks[1:].unsqueeze(0)
        mu = torch.tensor(c.behavior_logprobs)
        with torch.no_grad(), routing.recording() as log:
            m(inp)
        assert differing_pairs(log.call(0), c.routes)[0] == 0
        sl = slice(len(c.prompt_ids) - 1, None)
        with torch.no_grad(), routing.forcing(c.routes.unsqueeze(0)):
            lp = token_logprobs(m(inp).logits, tgt, 1.0)[0, sl]
        with torch.no_grad(), routing.forcing(shifted(c.routes.unsqueeze(0))):
            lp_shifted = token_logprobs(m(inp).logits, tgt, 1.0)[0, sl]
        worst = max(worst, float((lp - mu).abs().max()))
        worst_shifted = max(worst_shifted, float((lp_shifted - mu).abs().max()))
    assert worst <= 1e-6, worst
    assert worst_shifted > 1e-3, worst_shifted
    assert not HFRolloutBackend(build_model(ModelConfig(), 16, PAD, BOS, EOS, on_gpu=False), TOK,
                                RolloutConfig()).returns_routes()


def test_routes_collate_padded_and_packed():
    s1 = Sample(tokens=[1, 5, 6, 2], prompt_len=2, group=0, reward=1.0, routes=torch.arange(12).view(3, 2, 2) % 4)
    s2 = Sample(tokens=[1, 5, 2], prompt_len=2, group=0, reward=0.0)
    padded = collate([s1, s2], PAD)
    assert padded["routes"].shape == (2, 3, 2, 2) and torch.equal(padded["routes"][0], s1.routes.to(torch.int16))
    assert padded["routes"][1].eq(FREE).all()
    packed = collate_packed([s1, s2], PAD)
    assert packed["routes"].shape == (1, 5, 2, 2) and torch.equal(packed["routes"][0, :3], padded["routes"][0])
    assert "routes" not in collate([s2], PAD)


def test_balance_term_against_its_definition():
    """a_t of dsrl.algos.router_balance from the global load f equals the float64 definition, uniform routing
    gives exactly 1, and its token mean is Switch's E * sum_e f_e P_e per layer."""
    from dsrl.algos.router_balance import balance_per_token, expert_load, load_fraction, mini_batch_load

    g = torch.Generator().manual_seed(0)
    b, t, layers, experts, top_k = 3, 5, 2, 4, 2
    routes = torch.rand(b, t, layers, experts, generator=g).argsort(-1)[..., :top_k]
    mask = (torch.rand(b, t, generator=g) > 0.3).long()
    probs = [torch.softmax(torch.randn(b * t, experts, generator=g, dtype=torch.float64), -1) for _ in range(layers)]
    micros = [{"routes": routes[:2], "loss_mask": mask[:2]}, {"routes": routes[2:], "loss_mask": mask[2:]}]
    f = mini_batch_load(micros, layers, experts, top_k, lambda v: v)
    assert torch.allclose(f, load_fraction(expert_load(routes, mask, experts), int(mask.sum()), top_k))
    a = balance_per_token(probs, f, torch.Size([b, t]))
    batch = {"routes": routes}
    assert torch.allclose(a, reference_aux(probs, batch, mask.double(), experts, top_k), atol=1e-12)
    n = int(mask.sum())
    switch = sum(experts * (f[layer] * (probs[layer][mask.reshape(-1) > 0].sum(0) / n)).sum()
                 for layer in range(layers)) / layers
    assert abs(float((a.reshape(-1)[mask.reshape(-1) > 0]).sum() / n) - float(switch)) < 1e-12
    uniform = [torch.full((b * t, experts), 1 / experts, dtype=torch.float64)] * layers
    flat = torch.full((layers, experts), 1 / experts, dtype=torch.float64)
    assert torch.allclose(balance_per_token(uniform, flat, torch.Size([b, t])), torch.ones(b, t, dtype=torch.float64))
    with pytest.raises(ValueError, match="counted token has no route"):
        expert_load(torch.full((1, 2, layers, top_k), FREE), torch.ones(1, 2), experts)


def _run_file(tmp_path, **model) -> str:
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 0},
                                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
                                "dsrl": {
        "batch": {"prompts_per_rollout": 4, "samples_per_prompt": 2, "mini_batch_size": 8,
                  "micro_batch_size_per_rank": 2}, "run": {"rollouts": 2}, "model": model}}))
    return str(path)


@pytest.mark.parametrize("model, rollout, ds, match", [
    ({"routing_replay": "rollout"}, {}, {}, r"routing_replay = 'rollout' with a dense model \(model.arch 'qwen2'"),
    ({"router_aux_loss_coef": 0.1}, {}, {}, r"router_aux_loss_coef = 0.1 with a dense model"),
    ({"arch": "qwen3_moe", "routing_replay": "rollout"}, {"backend": "vllm"}, {},
     r"routing_replay = 'rollout' with rollout.backend = 'vllm': vLLM's CPU build cannot return routes"),
])
def test_moe_refusals_before_any_work(tmp_path, model, rollout, ds, match):
    from dsrl.rl.policy.moe import check_moe_run

    cfg = load_config(_run_file(tmp_path, **model), {"dsrl.rollout." + k: v for k, v in rollout.items()})
    cfg.ds_config.update(ds)
    with pytest.raises(ConfigError, match=match) as e:
        check_moe_run(cfg.dsrl.model, cfg.dsrl.rollout, on_gpu=False)
    assert "Fix:" in str(e.value)


def test_moe_checkpoint_architecture_not_routable(tmp_path):
    from transformers import AutoConfig

    from dsrl.rl.policy.moe import check_moe_run

    AutoConfig.for_model("olmoe", num_experts=4, num_experts_per_tok=2, num_hidden_layers=1).save_pretrained(
        tmp_path / "olmoe")
    cfg = load_config(_run_file(tmp_path, path=str(tmp_path / "olmoe"), routing_replay="rollout"))
    with pytest.raises(ConfigError, match="'olmoe' mixture of experts: dsrl records and replays the routers of"):
        check_moe_run(cfg.dsrl.model, cfg.dsrl.rollout, on_gpu=False)


def test_plan_shows_the_expert_layout(tmp_path, capsys):
    from dsrl.cli.main import main

    run = _run_file(tmp_path, arch="qwen3_moe", routing_replay="rollout")
    cfg = json.loads(open(run).read())
    cfg["expert_parallel"] = {"enabled": True, "autoep_size": 2}
    (tmp_path / "ep.json").write_text(json.dumps(cfg))
    assert main(["plan", "--ds_config", str(tmp_path / "ep.json"), "--world_size", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert (out["moe_layers"], out["experts"], out["top_k"], out["expert_parallel_size"], out["experts_per_rank"]) \
        == (2, 4, 2, 2, 2) and out["routing_replay"] == "rollout"
    assert main(["plan", "--ds_config", str(tmp_path / "ep.json"), "--world_size", "2"]) == 0
    text = capsys.readouterr().out
    assert "2 MoE layers x 4 experts, top-2 per token" in text and "2 experts of each layer per rank" in text
    assert main(["plan", "--ds_config", _run_file(tmp_path), "--json"]) == 0
    assert "experts" not in json.loads(capsys.readouterr().out)  # a dense plan is unchanged


def test_cb_backend_records_the_routes_its_packed_forwards_chose():
    """Continuous batching's packed forwards (requests mixed in one row, prefills and decodes together): every
    completion's routes, stitched per request, are the experts the trainer's own float32 routers choose on the whole
    sequence, and the replayed recompute matches the behavior log-probs to <= 1e-6."""
    from dsrl.rollout.cb import ContinuousBatchingBackend

    m = tiny_moe()
    backend = ContinuousBatchingBackend(m, TOK, RolloutConfig(max_new_tokens=8, generation_batch_size=2,
                                                              backend="cb"))
    assert backend.returns_routes()
    cs = backend.generate(PROMPTS + [[BOS] + [5, 6, 7, 3] * 5], 3, seed=0)
    routing = MoERouting.of(m)
    m.eval()
    for c in cs:
        toks = torch.tensor(c.prompt_ids + c.completion_ids)
        assert c.routes.shape == (len(toks) - 1, 2, 2) and bool((c.routes >= 0).all())
        inp, tgt = toks[:-1].unsqueeze(0), toks[1:].unsqueeze(0)
        with torch.no_grad(), routing.recording() as log:
            m(inp)
        assert differing_pairs(log.call(0), c.routes)[0] == 0
        with torch.no_grad(), routing.forcing(c.routes.unsqueeze(0)):
            lp = token_logprobs(m(inp).logits, tgt, 1.0)[0, len(c.prompt_ids) - 1:]
        assert float((lp - torch.tensor(c.behavior_logprobs)).abs().max()) <= 1e-6


def test_multi_turn_routes_cover_model_tokens_only():
    """A trajectory keeps from each turn's routes the positions that predicted that turn's tokens (and the prompt's
    from the first); environment tokens are FREE; a turn without routes leaves none."""
    from dsrl.rl.episodes.trajectory import Trajectory

    t = Trajectory(0, [1, 5, 6])
    turn0 = torch.arange(4 * 2).view(4, 1, 2) % 4  # generate on the 3-token prompt, 2 tokens: 3 + 2 - 1 positions
    t.add_model_turn([7, 8], [-0.1, -0.2], turn0)
    t.add_observation([9, 10])
    turn1 = torch.full((8, 1, 2), 3)  # generate on the 7-token prefix, 2 tokens
    t.add_model_turn([11, 2], [-0.3, -0.4], turn1)
    s = t.sample(group=0, reward=1.0)
    assert s.routes.shape == (8, 1, 2)
    assert torch.equal(s.routes[:4], turn0.to(torch.int16))  # prompt + the first turn's predicting positions
    assert s.routes[4:6].eq(FREE).all()  # the first observation token and the one after it: routed fresh
    assert s.routes[6:].eq(3).all()  # the last observation token (predicts turn 1's first token) and turn 1's
    # the positions whose targets are model tokens (the loss's) all carry a route
    mask = collate([s], PAD)["loss_mask"][0]
    assert bool((collate([s], PAD)["routes"][0][mask > 0] >= 0).all())
    u = Trajectory(0, [1, 5])
    u.add_model_turn([7], [-0.1], None)
    u.add_model_turn([8], [-0.1], torch.zeros(3, 1, 2))
    assert u.sample(group=0, reward=0.0).routes is None


def test_routes_travel_through_the_codec_and_the_wire_bit_for_bit():
    """A sample's and a completion's routes survive the data path's codec and the async path's wire exactly."""
    from dsrl.rl.data.codec import decode_sample, encode_sample
    from dsrl.rl.disagg.wire import decode_completions, encode_completions
    from dsrl.rollout.base import Completion

    routes = torch.randint(-1, 4, (5, 2, 2), dtype=torch.int16)
    s = decode_sample(encode_sample(Sample(tokens=[1, 5, 6, 7, 2, 3], prompt_len=2, group=0, reward=1.0,
                                           routes=routes)))
    assert s.routes.dtype == torch.int16 and torch.equal(s.routes, routes)
    c = Completion(prompt_index=0, prompt_ids=[1, 5], completion_ids=[6, 7, 2, 3], finished=True,
                   behavior_logprobs=[-0.5] * 4, routes=routes)
    (back,) = decode_completions(encode_completions([c]))
    assert torch.equal(back.routes, routes) and back.completion_ids == c.completion_ids


def test_resume_with_another_routing_layout_refused():
    from dsrl.rl.policy.moe import PolicyRouting

    routing = PolicyRouting(ModelConfig(arch="qwen3_moe", routing_replay="rollout"), tiny_moe())
    saved = routing.checkpoint_state()
    assert saved == {"layers": 2, "experts": 4, "top_k": 2, "routing_replay": "rollout"}
    routing.check_resumed(saved, "ckpt")
    routing.check_resumed(None, "ckpt")  # a checkpoint from before MoE support, or of a dense run
    with pytest.raises(ConfigError, match=r"ckpt was written by a mixture-of-experts policy routing 2 layers x 4 "
                                          r"experts, top-1.*Fix: resume with the dsrl.model settings"):
        routing.check_resumed({**saved, "top_k": 1}, "ckpt")


def test_reference_forwards_force_routes_on_the_reference_copy():
    """Under replay the KL reference (a frozen copy) runs the rollout's routes through its own routers."""
    from dsrl.rl.policy.model import frozen_copy
    from dsrl.rl.policy.moe import PolicyRouting

    policy = tiny_moe()
    ref = frozen_copy(policy)
    routing = PolicyRouting(ModelConfig(arch="qwen3_moe", routing_replay="rollout"), policy, ref)
    assert routing.ref_routing is MoERouting.of(ref) and routing.ref_routing is not routing.routing
    ids = torch.randint(0, 16, (1, 5))
    forced = random_routes(5, 2, 4, 2, seed=4).view(1, 5, 2, 2)
    with torch.no_grad():
        natural = ref(ids).logits
        out = routing.forcing(lambda m, micro: m(micro["input_ids"]).logits, routing.ref_routing)(
            ref, {"input_ids": ids, "routes": forced})
        routing.release()
        with routing.routing.forcing(forced.view(5, 2, 2)):
            expected = policy.eval()(ids).logits  # same weights, routes forced on the policy
    assert torch.equal(out, expected) and not torch.equal(out, natural)
    assert PolicyRouting(ModelConfig(arch="qwen3_moe"), policy).ref_routing is routing.routing  # LoRA / no copy


@pytest.mark.parametrize("model, rollout, ds, rule", [
    ({"arch": "qwen3_moe", "routing_replay": "rollout"}, {}, {"tensor_parallel": {"autotp_size": 2}}, "replay-autotp"),
    ({"arch": "qwen3_moe", "router_aux_loss_coef": 0.1}, {}, {"sequence_parallel_size": 2},
     "router-aux-sequence-parallel"),
    ({"arch": "qwen3_moe"}, {"backend": "cb"}, {"expert_parallel": {"enabled": True, "autoep_size": 2}}, "autoep-cb"),
])
def test_run_file_rules_refuse_moe_combinations_when_loaded(tmp_path, model, rollout, ds, rule):
    """The refusals a run file alone decides are rules of dsrl.config.support, raised by load_config itself."""
    from dsrl.config.root import DsrlConfig
    from dsrl.config.support import RULES, Setup

    raw = json.loads(open(_run_file(tmp_path, **model)).read())
    raw.update(ds)
    raw["dsrl"]["rollout"] = rollout
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    want = next(r for r in RULES if r.name == rule)
    assert str(e.value) == want.message(Setup.of(DsrlConfig(**raw["dsrl"]), ds))
