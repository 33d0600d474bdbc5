"""The device suffix speculator on several devices (fake CPU devices, in a subprocess): with
a tensor-parallel mesh the engine's output and acceptance equal one device's, on the step
loop and the device loop (the corpus is replicated: every device drafts the same); under a
data-parallel ``shard_map`` each shard drafts from its own corpus exactly as that corpus
alone does."""

import suite_paths  # tests/support: where the suite's pieces are
import os
import subprocess
import sys
import textwrap

BODY = """
import os, sys, dataclasses
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2 --xla_backend_optimization_level=0"
os.environ["JAX_PLATFORMS"] = "cpu"
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, PartitionSpec as P
from specjax import SpeculativeConfig
from specjax._compat import shard_map
from specjax.engine import Engine
from specjax.proposers import make_proposer
from specjax.proposers.suffix_gpu import SuffixGPUProposer
from specjax.proposers.suffix_gpu_corpus import build_documents
from test_engine import BS, FIXED, LOOP, MML, PARAMS_B, PROMPTS_B, target

DEV = np.array(jax.devices())
assert len(DEV) == 2
for loop in ({}, dict(steps_per_sync=4)):
    kw = dict(FIXED, max_num_seqs=3, options=dataclasses.replace(LOOP, **loop))
    mk = lambda: make_proposer(SpeculativeConfig(method="suffix", num_speculative_tokens=3),
                               max_model_len=MML, block_size=BS)
    want = Engine(target(), mk(), **kw).generate(PROMPTS_B, PARAMS_B)
    got = Engine(target(), mk(), mesh=Mesh(DEV, ("tp",)), **kw).generate(PROMPTS_B, PARAMS_B)
    assert got.token_ids == want.token_ids, loop
    assert got.spec_stats.num_accepted_tokens == want.spec_stats.num_accepted_tokens > 0, loop
    print("tp ok", loop, flush=True)

impl = SuffixGPUProposer(num_speculative_tokens=4, max_model_len=32, max_depth=8,
                         corpus_tokens=64)
rng = np.random.default_rng(0)
states = []
for shard in range(2):
    docs, lens = build_documents([2, 3], [list(rng.integers(0, 6, 20)) for _ in range(2)], 64)
    states.append(impl.ingest(impl.init_state(), jnp.asarray(docs), jnp.asarray(lens)))
tok = jnp.asarray(rng.integers(0, 6, (2, 4, 32)), jnp.int32)
num = jnp.asarray(rng.integers(4, 20, (2, 4)), jnp.int32)
valid = jnp.ones((2, 4), bool)
stacked = jax.tree.map(lambda *x: jnp.stack(x), *states)
mesh = Mesh(DEV, ("dp",))
f = jax.jit(shard_map(lambda s, t, n, v: jax.tree.map(lambda x: x[None], impl.draft(
    jax.tree.map(lambda x: x[0], s), t[0], n[0], v[0])), mesh=mesh,
    in_specs=(P("dp"), P("dp"), P("dp"), P("dp")), out_specs=P("dp"), check_vma=False))
out = f(stacked, tok, num, valid)
for i in range(2):
    alone = impl.draft(states[i], tok[i], num[i], valid[i])
    np.testing.assert_array_equal(np.asarray(out.token_ids[i]), np.asarray(alone.token_ids))
    np.testing.assert_array_equal(np.asarray(out.num_drafts[i]), np.asarray(alone.num_drafts))
other = impl.draft(states[1], tok[0], num[0], valid[0])
assert not np.array_equal(np.asarray(other.token_ids), np.asarray(out.token_ids[0]))
print("dp ok", flush=True)
"""


def test_tensor_and_data_parallel_suffix():
    env = dict(os.environ)
    env["PYTHONPATH"] = suite_paths.pythonpath()
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(BODY)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert proc.stdout.count("tp ok") == 2 and "dp ok" in proc.stdout
