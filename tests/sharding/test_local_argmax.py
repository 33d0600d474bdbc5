"""``use_local_argmax_reduction``: greedy drafting under a vocab-sharded mesh takes the
argmax per shard and reduces (value, index) pairs; the result must equal ``jnp.argmax``.
Tree levels with c > 1 children take each shard's top-c and gather only those candidates
(``greedy_top_k``); the result must equal ``jax.lax.top_k``.

The multi-device cases run in a subprocess with 4 fake CPU devices (this process has
already initialised JAX with one)."""

import suite_paths  # tests/support: where the suite's pieces are
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from specjax.config import SpeculativeConfig
from specjax.sharding.vocab import greedy_argmax, greedy_top_k


PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"
import dataclasses
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from specjax.config import SpeculativeConfig
from specjax.sharding.vocab import greedy_argmax, greedy_top_k
assert len(jax.devices()) == 4, jax.devices()
DEV = np.array(jax.devices())
MESH = Mesh(DEV, ("tp",))
MESH2 = Mesh(DEV.reshape(2, 2), ("dp", "tp"))
"""


def run_with_4_devices(body: str) -> str:
    """Run ``PRELUDE + body`` in a fresh Python with 4 fake CPU devices; fail with its
    output if it fails. Returns its stdout."""
    env = dict(os.environ)
    env["PYTHONPATH"] = suite_paths.pythonpath()
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", PRELUDE + textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"subprocess failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return proc.stdout


@pytest.mark.smoke
def test_local_reduction_equals_argmax_on_4_shards():
    out = run_with_4_devices("""
        rng = np.random.default_rng(0)
        checked = 0
        for mesh in (MESH, MESH2):
            n = mesh.shape["tp"]
            f = jax.jit(lambda x: greedy_argmax(x, mesh=mesh, vocab_axis="tp", local_reduction=True))
            for V in (n, 2 * n, 64, 80, 1024):
                x = rng.standard_normal((12, V)).astype(np.float32)
                x[1] = 0.5                                   # all tied
                x[2, [V - 1, 0]] = 9.0                       # tie across the first and last shard
                x[3] = -np.inf                               # all -inf
                x[4] = -np.inf; x[4, V - 1] = -1e30          # one finite value, in the last shard
                x[5, [V // 2, V - 1]] = np.nan               # NaN ranks above everything
                x[6] = np.round(x[6])                        # many ties among small integers
                x[7, V // n:] = -np.inf                      # only the first shard finite
                x[8, : V - 1] = -np.inf                      # only the last entry finite
                x[9, [V - 1, V // 2]] = np.inf               # +inf in two shards
                x[10] = np.float32(3.0); x[10, ::2] = -np.inf
                for arr in (x, x.astype(jnp.bfloat16)):
                    want = np.asarray(jnp.argmax(jnp.asarray(arr), axis=-1))
                    got = np.asarray(f(jnp.asarray(arr)))
                    assert got.dtype == np.int32, got.dtype
                    np.testing.assert_array_equal(got, want, err_msg=f"V={V} mesh={mesh.shape}")
                    sharded = jax.device_put(arr, NamedSharding(mesh, P(None, "tp")))
                    np.testing.assert_array_equal(f(sharded), want)
                    checked += 1
            # leading dims [k, B, V] (Medusa-shaped) reduce the same way
            x = rng.standard_normal((3, 5, 64)).astype(np.float32)
            np.testing.assert_array_equal(f(jnp.asarray(x)), np.argmax(x, -1))
        # the sharded logits are never gathered: only scalars per row cross devices
        x = jax.device_put(jnp.zeros((8, 1024)), NamedSharding(MESH, P(None, "tp")))
        hlo = jax.jit(lambda x: greedy_argmax(x, mesh=MESH, vocab_axis="tp",
                                              local_reduction=True)).lower(x).compile().as_text()
        assert "all-gather" not in hlo and "all-reduce" in hlo, hlo
        # without the flag (or without a mesh) it is a plain argmax
        np.testing.assert_array_equal(greedy_argmax(x, mesh=MESH, vocab_axis="tp"), np.zeros(8))
        print("checked", checked)
    """)
    assert "checked 20" in out


def test_local_top_k_equals_lax_top_k_on_2_and_4_shards():
    """``greedy_top_k`` per shard + (value, index) candidates equals ``lax.top_k`` on the
    full rows: many ties (small integers), NaN (both signs), +-inf, -0.0 / 0.0, all -inf
    and all NaN rows, c in {1, 2, 3, shard width, shard width + 1, V}."""
    out = run_with_4_devices("""
        import re
        rng = np.random.default_rng(3)
        checked = 0
        for mesh in (MESH, MESH2):                   # 4 and 2 shards of "tp"
            n = mesh.shape["tp"]
            for V in (8, 24):
                w = V // n
                cs = sorted({1, 2, 3, w, w + 1, V})
                # one compilation per (mesh, V, dtype): every c in one program
                f = jax.jit(lambda x: [greedy_top_k(x, c, mesh=mesh, vocab_axis="tp",
                                                    local_reduction=True) for c in cs])
                x = rng.integers(-2, 3, (24, V)).astype(np.float32)   # many ties
                x[rng.random(x.shape) < 0.08] = np.nan
                x[rng.random(x.shape) < 0.08] = -np.nan
                x[rng.random(x.shape) < 0.1] = np.inf
                x[rng.random(x.shape) < 0.1] = -np.inf
                x[0] = -np.inf                                 # all -inf
                x[1] = np.nan                                  # all NaN
                x[2] = 0.0; x[2, ::3] = -0.0                   # signed zeros
                x[3] = 1.0                                     # all tied
                x[4] = -np.inf; x[4, V - 1] = 1.0              # one finite, the last shard
                x[5] = np.inf; x[5, :w] = np.nan               # NaN in the first shard only
                for arr in (x, x.astype(jnp.bfloat16)):
                    for c, got in zip(cs, f(jnp.asarray(arr)), strict=True):
                        want = np.asarray(jax.lax.top_k(jnp.asarray(arr), c)[1])
                        assert got.dtype == jnp.int32 and got.shape == (24, c), (got.dtype, got.shape)
                        np.testing.assert_array_equal(got, want, err_msg=f"V={V} c={c} tp={n}")
                        checked += 1
            # leading dims [k, B, V] reduce the same way, sharded input too
            x = jax.device_put(rng.integers(-3, 3, (2, 5, 32)).astype(np.float32),
                               NamedSharding(mesh, P(None, None, "tp")))
            got = greedy_top_k(x, 3, mesh=mesh, vocab_axis="tp", local_reduction=True)
            np.testing.assert_array_equal(got, jax.lax.top_k(x, 3)[1])
        # only the c x shards candidates per row cross devices, never the [8, 1024] logits
        x = jax.device_put(jnp.zeros((8, 1024)), NamedSharding(MESH, P(None, "tp")))
        hlo = jax.jit(lambda x: greedy_top_k(x, 3, mesh=MESH, vocab_axis="tp",
                                             local_reduction=True)).lower(x).compile().as_text()
        gathers = re.findall(r"= (\\w+)\\[([\\d,]*)\\][^ ]* all-gather", hlo)
        assert sorted(gathers) == [("f32", "8,12"), ("s32", "8,12")], gathers
        # without the flag, a mesh, or with c out of range
        np.testing.assert_array_equal(greedy_top_k(x, 2, mesh=MESH, vocab_axis="tp"),
                                      jax.lax.top_k(x, 2)[1])
        import pytest
        for bad in (0, 1025, 2.0):
            with pytest.raises(ValueError, match="c must be an int"):
                greedy_top_k(x, bad, mesh=MESH, vocab_axis="tp", local_reduction=True)
        with pytest.raises(ValueError, match="divisible"):
            greedy_top_k(jnp.zeros((2, 10)), 2, mesh=MESH, vocab_axis="tp", local_reduction=True)
        print("checked", checked)
    """)
    assert "checked 44" in out, out


def test_eagle_proposers_draft_the_same_with_the_flag():
    out = run_with_4_devices("""
        from test_proposers_warmup import BUCKETS, build, make_inputs, _tuple, NUM_BLOCKS
        rng = np.random.default_rng(1)
        for method in ("eagle", "eagle3", "dflash", "draft_model"):
            prop, params = build(method)
            flagged = dataclasses.replace(
                prop, config=dataclasses.replace(prop.config, use_local_argmax_reduction=True),
                mesh=MESH, vocab_axis="tp")
            for n in (1, 4):     # one bucket: two compilations per method, not more
                inp = make_inputs(method, _tuple(BUCKETS[1]), n, rng)
                want, _ = prop.propose(params, prop.init_state(NUM_BLOCKS), inp)
                got, _ = flagged.propose(params, flagged.init_state(NUM_BLOCKS), inp)
                np.testing.assert_array_equal(got.token_ids, want.token_ids, err_msg=method)
                np.testing.assert_array_equal(got.num_drafts, want.num_drafts)
                assert (np.asarray(want.token_ids)[:n] >= 0).all()
            # the lowered step really reduces per shard
            hlo = type(flagged).propose.lower(flagged, params, flagged.init_state(NUM_BLOCKS),
                                              inp).as_text()
            assert "all_reduce" in hlo or "all-reduce" in hlo, method
            print("same", method)
    """)
    for method in ("eagle", "eagle3", "dflash", "draft_model"):
        assert f"same {method}" in out


def test_vocab_not_divisible_is_refused_at_construction():
    out = run_with_4_devices("""
        import pytest
        from specjax import make_proposer
        from test_proposers_warmup import build, BS, MML
        mesh3 = Mesh(DEV[:3], ("tp",))
        for method, what in (("eagle", r"vocab_size \\(64\\)"), ("eagle3", r"draft_vocab_size \\(32\\)"),
                             ("dflash", r"vocab_size \\(64\\)"), ("draft_model", r"vocab_size \\(64\\)")):
            prop, params = build(method)
            cfg = dataclasses.replace(prop.config, use_local_argmax_reduction=True)
            with pytest.raises(ValueError, match=what + ".*divisible.*'tp' \\\\(3\\\\)"):
                dataclasses.replace(prop, config=cfg, mesh=mesh3)
            with pytest.raises(ValueError, match="vocab_axis must be one of"):
                dataclasses.replace(prop, config=cfg, mesh=MESH, vocab_axis="model")
            # 4 shards divide it; without the flag the mesh is not checked against the vocab
            dataclasses.replace(prop, config=cfg, mesh=MESH2)
            dataclasses.replace(prop, mesh=mesh3)
        # through make_proposer's options
        prop, params = build("eagle")
        cfg = dataclasses.replace(prop.config, use_local_argmax_reduction=True)
        p = make_proposer(cfg, draft=prop.model, draft_params=params, block_size=BS,
                          max_model_len=MML, mesh=MESH, vocab_axis="tp")
        assert p.impl.mesh is MESH and p.impl.vocab_axis == "tp"
        with pytest.raises(ValueError, match="divisible"):
            make_proposer(cfg, draft=prop.model, draft_params=params, block_size=BS,
                          max_model_len=MML, mesh=mesh3)
        print("refused")
    """)
    assert "refused" in out


# -- one device (this process) -----------------------------------------------------------


def test_plain_argmax_without_a_sharded_mesh():
    rng = np.random.default_rng(2)
    x = jnp.asarray(rng.standard_normal((6, 50)).astype(np.float32)).at[0].set(-jnp.inf)
    want = np.asarray(jnp.argmax(x, -1))
    mesh1 = Mesh(np.array(jax.devices()[:1]), ("tp",))
    for kw in ({}, dict(local_reduction=True), dict(mesh=mesh1, vocab_axis="tp", local_reduction=True)):
        got = greedy_argmax(x, **kw)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="vocab_axis"):
        greedy_argmax(x, mesh=mesh1, vocab_axis="model", local_reduction=True)
    for c in (1, 3, 50):
        want_k = np.asarray(jax.lax.top_k(x, c)[1])
        for kw in ({}, dict(local_reduction=True), dict(mesh=mesh1, vocab_axis="tp", local_reduction=True)):
            got = greedy_top_k(x, c, **kw)
            assert got.dtype == jnp.int32
            np.testing.assert_array_equal(got, want_k)
    with pytest.raises(ValueError, match="vocab_axis"):
        greedy_top_k(x, 2, mesh=mesh1, vocab_axis="model", local_reduction=True)


def test_mesh_option_checks_on_one_device():
    from test_proposers_warmup import build

    import dataclasses

    prop, _ = build("eagle")
    flag = dataclasses.replace(prop.config, use_local_argmax_reduction=True)
    with pytest.raises(ValueError, match="mesh must be None or a jax.sharding.Mesh"):
        dataclasses.replace(prop, mesh="tp")
    with pytest.raises(ValueError, match="vocab_axis must be one of"):
        dataclasses.replace(prop, config=flag, mesh=Mesh(np.array(jax.devices()[:1]), ("x",)))
    # defaults unchanged: no mesh, flag off
    assert prop.mesh is None and prop.vocab_axis == "tp"
    assert not SpeculativeConfig(method="eagle", num_speculative_tokens=2).use_local_argmax_reduction
