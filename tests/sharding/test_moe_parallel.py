"""MoE experts on a mesh: split over an ``"ep"`` axis (expert parallel), their FFN width
over ``"tp"`` (tensor parallel), and both, on 4 and 8 fake CPU devices, give one device's
outputs; the sharding rules' refusals need no devices.

The multi-device cases run in subprocesses started together (test_multi_device.py's
pattern). Float32; each shard sums its own experts / FFN slice and a ``psum`` adds the
partial outputs, a different summation order than one device: compared with rtol = atol =
1e-5. Greedy tokens of the Engine must be equal.
"""

import suite_paths  # tests/support: where the suite's pieces are

import jax
import pytest
from jax.sharding import PartitionSpec as P

from specjax.models import registry
from specjax.sharding import param_specs
from test_multi_device import _start, _wait

HF = dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
          num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
          num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
          mlp_only_layers=[1])
GPT_OSS = dict(vocab_size=128, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=8,
               num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
               sliding_window=8)

#: (ep, tp) mesh shapes per device count (the Engine runs on the one with both); ("ep",)
#: alone once.
LAYOUTS = {4: [(4, 1), (1, 4), (2, 2)], 8: [(8, 1), (1, 8), (2, 4)]}

BODY = """
from specjax.attention_metadata import CommonAttentionMetadata
from specjax.engine import Engine, SamplingParams, TargetModel
from specjax.models import registry
from specjax.models.moe import SparseMoeBlock, sharded_experts
from specjax.models import params as mp
from specjax.sharding import param_shardings, state_shardings
from test_engine import FIXED

def close(got, want, what):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5,
                               err_msg=what)

def gathers(compiled):
    return re.findall(r"= \\w+\\[([\\d,]*)\\][^ ]* all-gather(?:-start)?\\(", compiled.as_text())

cfg = registry.config_from_hf("qwen3_moe", HF)
params = registry.init_params("qwen3_moe", cfg, 0)
model = registry.make_model("qwen3_moe", cfg)
E, H, I = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
rng = np.random.default_rng(0)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
x, ids = f32(11, H), jnp.asarray(rng.integers(0, E, (11, 2)), jnp.int32)
w, gu, dn = jnp.asarray(rng.random((11, 2)), jnp.float32), f32(E, H, 2 * I) / 3, f32(E, I, H) / 3
bgu, bd = f32(E, 2 * I), f32(E, H)
experts = jax.jit(lambda *a: sharded_experts(*a[:5], gate_up_bias=a[5], down_bias=a[6]))
want_experts = experts(x, w, ids, gu, dn, bgu, bd)

BS, T = 4, 16
table = np.array([[3, 1, 5, 0], [2, 6, 4, 7]], np.int32)
md = CommonAttentionMetadata.from_query_lens([7, 5], [7, 5], table, block_size=BS,
                                             num_reqs_pad=2, num_tokens_pad=T, max_query_len=T)
tok = jnp.asarray(rng.integers(0, cfg.vocab_size, T), jnp.int32)
pos = jnp.asarray(np.r_[np.arange(7), np.arange(5), np.zeros(4)], jnp.int32)
forward = jax.jit(lambda p, kv: model.compute_logits(p, model.forward(p, tok, pos, kv, md)[0]))
kv0 = model.init_kv_caches(8, BS, jnp.float32)
want_logits = forward(params, kv0)[:12]

prompts = [[5, 9, 17, 3, 88], [1, 2, 3, 4, 5, 6, 7]]
sp = SamplingParams(max_tokens=6)
fixed = dict(FIXED, max_num_seqs=2)
want_tokens = Engine(TargetModel(model, params), None, **fixed).generate(prompts, sp).token_ids

for ep, tp in LAYOUTS:
    what = f"ep={ep} tp={tp}"
    mesh = Mesh(DEV[:ep * tp].reshape(ep, tp), ("ep", "tp"))
    S = lambda *s: NamedSharding(mesh, P(*s))
    # the experts alone (with gpt-oss's biases): one psum, no gather of expert weights
    args = (x, w, ids, jax.device_put(gu, S("ep", None, "tp")),
            jax.device_put(dn, S("ep", "tp", None)), jax.device_put(bgu, S("ep", "tp")),
            jax.device_put(bd, S("ep")))
    with jax.set_mesh(mesh):
        compiled = experts.lower(*args).compile()
    close(compiled(*args), want_experts, what)
    assert not gathers(compiled), (what, gathers(compiled))
    reduces = re.findall(r"all-reduce(?:-start)?\\(", compiled.as_text())
    assert len(reduces) == 1, (what, reduces)
    # the whole Qwen3-MoE forward, params placed by the rules
    sp_params = jax.device_put(params, param_shardings(params, mesh, cfg))
    ex = sp_params["layers"][0]["mlp"]["experts"]
    assert ex["gate_up"].addressable_shards[0].data.shape == (E // ep, H, 2 * I // tp), what
    assert ex["down"].addressable_shards[0].data.shape == (E // ep, I // tp, H), what
    kv = jax.device_put(kv0, state_shardings(kv0, mesh))
    with jax.set_mesh(mesh):
        compiled = forward.lower(sp_params, kv).compile()
    close(compiled(sp_params, kv)[:12], want_logits, what)
    local = min(a.addressable_shards[0].data.size for a in jax.tree.leaves(ex))
    big = [g for g in gathers(compiled) if np.prod([int(d) for d in g.split(",") if d]) >= local]
    assert not big, (what, big)
    if ep > 1 < tp:   # the reference loop on the mesh: the one-device greedy tokens
        eng = Engine(TargetModel(model, params), None, mesh=mesh, **fixed)
        assert eng.generate(prompts, sp).token_ids == want_tokens, what
    print("moe ok", what, flush=True)

# gpt-oss (expert biases; attention sinks split with the heads at tp = 2) on the last mesh
gcfg = registry.config_from_hf("gpt_oss", GPT_OSS)
gmodel = registry.make_model("gpt_oss", gcfg)
leaves, tdef = jax.tree.flatten(registry.init_params("gpt_oss", gcfg, 0))   # biases != 0:
gparams = tdef.unflatten([a + 0.1 * jax.random.normal(jax.random.key(i), a.shape)
                          for i, a in enumerate(leaves)])
gforward = jax.jit(lambda p, kv: gmodel.compute_logits(p, gmodel.forward(p, tok, pos, kv, md)[0]))
gkv = gmodel.init_kv_caches(8, BS, jnp.float32)
want = gforward(gparams, gkv)[:12]
sp_params = jax.device_put(gparams, param_shardings(gparams, mesh, gcfg))
gkv = jax.device_put(gkv, state_shardings(gkv, mesh))
with jax.set_mesh(mesh):
    close(gforward.lower(sp_params, gkv).compile()(sp_params, gkv)[:12], want, "gpt-oss " + what)
print("gpt-oss ok", what, flush=True)

# a mesh of "ep" alone: only the experts are split
mesh = Mesh(DEV[:4], ("ep",))
sp_params = jax.device_put(params, param_shardings(params, mesh, cfg))
assert sp_params["layers"][0]["mlp"]["experts"]["down"].sharding.spec == P("ep", None, None)
assert sp_params["lm_head"]["kernel"].sharding.is_fully_replicated
with jax.set_mesh(mesh):
    close(forward(sp_params, kv0)[:12], want_logits, "ep alone")
# the experts' own refusal: 8 experts over 3 shards
try:
    with jax.set_mesh(Mesh(DEV[:3], ("ep",))):
        experts(x, w, ids, gu, dn, bgu, bd)
    raise SystemExit("no error")
except ValueError as e:
    assert "cannot split experts (8) over mesh axis 'ep' of size 3" in str(e), e
print("moe ep alone ok", flush=True)
"""


@pytest.fixture(scope="module")
def jobs():
    procs = {n: _start(f"HF = {HF!r}\nGPT_OSS = {GPT_OSS!r}\nLAYOUTS = {LAYOUTS[n]!r}\n" + BODY, n)
             for n in LAYOUTS}
    yield procs
    for p in procs.values():
        if p.poll() is None:
            p.kill()
            p.communicate()


@pytest.mark.parametrize("n", sorted(LAYOUTS))
def test_expert_and_tensor_parallel_match_one_device(jobs, n):
    out = _wait(jobs[n])
    for ep, tp in LAYOUTS[n]:
        assert f"moe ok ep={ep} tp={tp}" in out, out
    assert "moe ep alone ok" in out and "gpt-oss ok" in out, out


def abstract_params(**kw):
    cfg = registry.config_from_hf("qwen3_moe", dict(HF, **kw))
    return cfg, jax.eval_shape(lambda: registry.init_params("qwen3_moe", cfg))


def test_rules_split_experts_and_replicate_the_router():
    cfg, params = abstract_params()
    specs = param_specs(params, cfg, 2, ep_size=4)
    assert specs["layers"][0]["mlp"] == {"gate": {"kernel": P()},
                                         "experts": {"gate_up": P("ep", None, "tp"),
                                                     "down": P("ep", "tp", None)}}
    assert specs["layers"][1]["mlp"]["down_proj"]["kernel"] == P("tp", None)   # dense layer
    plain = param_specs(params, cfg, 4)["layers"][0]["mlp"]["experts"]
    assert plain == {"gate_up": P(None, None, "tp"), "down": P(None, "tp", None)}
    biased = {"layers": {0: {"mlp": {
        "router": {"kernel": jax.ShapeDtypeStruct((32, 8), "float32"),
                   "bias": jax.ShapeDtypeStruct((8,), "float32")},
        "experts": {"gate_up_bias": jax.ShapeDtypeStruct((8, 32), "float32"),
                    "down_bias": jax.ShapeDtypeStruct((8, 32), "float32")}}}}}
    got = param_specs(biased, cfg, 2, ep_size=2)["layers"][0]["mlp"]
    assert got == {"router": {"kernel": P(), "bias": P()},
                   "experts": {"gate_up_bias": P("ep", "tp"), "down_bias": P("ep")}}


@pytest.mark.parametrize("n, ep, match", [
    (1, 3, r"'layers\.0\.mlp\.experts\.\w+' over mesh axis 'ep' of size 3: number of experts"),
    (3, None, r"'layers\.0\.mlp\.experts\.down' over mesh axis 'tp' of size 3: expert FFN width"),
    (32, None, r"'layers\.0\.mlp\.experts\.down' over mesh axis 'tp' of size 32: expert FFN"),
])
def test_indivisible_experts_or_ffn_name_the_parameter(n, ep, match):
    cfg, params = abstract_params(intermediate_size=96 if n == 3 else 64)
    with pytest.raises(ValueError, match=match):
        param_specs(params, cfg, n, ep_size=ep)


def test_split_gate_up_pairs_and_axis_clash_are_refused():
    cfg, params = abstract_params()
    gate_up = {"layers": {0: {"mlp": {"experts": {
        "gate_up": jax.ShapeDtypeStruct((8, 32, 12), "float32")}}}}}    # I = 6 over 4: 1.5
    with pytest.raises(ValueError, match=r"experts\.gate_up' .*\(interleaved gate/up pairs\)"):
        param_specs(gate_up, cfg, 4)
    with pytest.raises(ValueError, match="'ep' is the expert axis"):
        param_specs(params, cfg, 2, axis="ep", ep_size=2)
