"""The KV block pool sized from ``gpu_memory_utilization`` (``specjax.engine.memory``): the
pure rule against hand-computed numbers, the bytes per block against the leaves of real
caches, and the device reading with fake devices (CPU devices report no memory)."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import suite_paths
from specjax import LoopOptions, demo_models, make_proposer
from specjax.engine import memory
from specjax.models import registry
from specjax.runtime.step import make_step

GiB, MiB = 2**30, 2**20
BS = 16


def rule(**kw):
    args = dict(device_memory={"bytes_limit": 64 * GiB, "bytes_in_use": 16 * GiB},
                fraction=0.75, bytes_per_block=2 * MiB, fixed_bytes=MiB,
                activation_bytes=2 * GiB, min_blocks=9)
    args.update(kw)
    return memory.blocks_for_memory(**args)


# --- the rule -------------------------------------------------------------------------


def test_blocks_for_memory_hand_computed():
    # 0.75 x 64 GiB = 48 GiB; - 16 GiB weights - 2 GiB activations - 1 MiB = 30719 MiB
    assert rule() == 30719 // 2
    # 1.0 x 1000 B - 100 - 50 = 850 B: 13 blocks of 64 B (832 B)
    assert rule(device_memory={"bytes_limit": 1000, "bytes_in_use": 100}, fraction=1.0,
                bytes_per_block=64, fixed_bytes=0, activation_bytes=50, min_blocks=2) == 13
    # an exact fit: 0.5 x 1024 B = 512 B = 4 blocks of 128 B, min_blocks 4 holds
    exact = dict(device_memory={"bytes_limit": 1024, "bytes_in_use": 0}, fraction=0.5,
                 bytes_per_block=128, fixed_bytes=0, activation_bytes=0)
    assert rule(min_blocks=4, **exact) == 4
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        rule(min_blocks=5, **exact)
    # 0.9 x 80 GiB = 72 GiB (floored to a byte); - 10 GiB = 63488 MiB: 21162 blocks of 3 MiB
    assert rule(device_memory={"bytes_limit": 80 * GiB, "bytes_in_use": 10 * GiB,
                               "peak_bytes_in_use": 11 * GiB}, fraction=0.9,
                bytes_per_block=3 * MiB, fixed_bytes=0, activation_bytes=0) == 21162
    # no bytes_in_use: nothing placed yet
    assert rule(device_memory={"bytes_limit": 4 * GiB}, fraction=0.5, fixed_bytes=0,
                activation_bytes=0) == 1024


def test_blocks_for_memory_too_little_names_the_numbers():
    # 0.5 x 16 GiB = 8 GiB; 7 GiB in use + 512 MiB of activations leave 512 blocks of 1 MiB
    with pytest.raises(ValueError) as e:
        rule(device_memory={"bytes_limit": 16 * GiB, "bytes_in_use": 7 * GiB}, fraction=0.5,
             bytes_per_block=MiB, fixed_bytes=0, activation_bytes=512 * MiB, min_blocks=1000)
    msg = str(e.value)
    for part in ("gpu_memory_utilization=0.5", "allows 8 GiB", "16 GiB", "needs 8.48 GiB",
                 "7 GiB in use", "512 MiB of activations", "min_blocks=1000",
                 "1000 MiB", "only 512 blocks fit", "num_blocks"):
        assert part in msg, (part, msg)
    with pytest.raises(ValueError, match="only 0 blocks fit"):    # weights past the fraction
        rule(device_memory={"bytes_limit": 16 * GiB, "bytes_in_use": 15 * GiB}, fraction=0.5)


@pytest.mark.parametrize("fraction", [0, 0.0, 1.5, -0.1, float("nan"), True, False, "0.9",
                                      None])
def test_fraction_refused_by_name(fraction):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        rule(fraction=fraction)


def test_other_arguments_checked():
    with pytest.raises(ValueError, match="gpu_memory_utilization.*bytes_limit"):
        rule(device_memory={"bytes_in_use": 0})
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        rule(device_memory=None)
    for name, bad in (("bytes_per_block", 0), ("fixed_bytes", -1), ("activation_bytes", -1),
                      ("min_blocks", 0), ("bytes_per_block", 1.5)):
        with pytest.raises(ValueError, match=name):
            rule(**{name: bad})


# --- bytes per block ------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def demo_target():
    kind, cfg, params = demo_models.load("target")
    return registry.make_model(kind, cfg), params


@functools.lru_cache(maxsize=None)
def demo_step(with_eagle3: bool):
    tgt, params = demo_target()
    prop = None
    if with_eagle3:
        prop = make_proposer({"model": str(demo_models.path("eagle3")),
                              "num_speculative_tokens": 3},
                             target=tgt, target_params=params, max_model_len=128, block_size=BS)
    return make_step(tgt, prop)


def leaf_bytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


@pytest.mark.parametrize("with_eagle3", [False, True])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_kv_bytes_per_block_is_one_more_block_of_the_caches(with_eagle3, dtype):
    step = demo_step(with_eagle3)
    n = 5
    small, big = step.init_caches(n, BS, dtype), step.init_caches(n + 1, BS, dtype)
    want = leaf_bytes(big) - leaf_bytes(small)
    assert memory.kv_bytes_per_block(step, BS, dtype) == want > 0
    per_block, fixed = memory.kv_cache_bytes(step, BS, dtype)
    assert per_block == want and fixed == leaf_bytes(small) - n * want
    tgt = step.target
    drafter = step.proposer.kv_bytes_per_block(BS, dtype) if with_eagle3 else 0
    assert want == tgt.kv_bytes_per_block(BS, dtype) + drafter
    if with_eagle3:
        assert drafter > 0


def test_kv_cache_bytes_allocates_nothing_and_keeps_the_pool_record():
    step = demo_step(True)
    step.init_caches(7, BS, jnp.float32)
    before = dict(step.__dict__["_kv_pools"])
    memory.kv_cache_bytes(step, BS, jnp.float32)
    assert step.__dict__["_kv_pools"] == before
    with pytest.raises(ValueError, match="block_size"):      # the proposer's is 16
        memory.kv_bytes_per_block(step, 8, jnp.float32)


def test_kv_cache_bytes_per_device_on_a_mesh():
    """On a 2-device mesh the KV is sharded by kv head: one device holds half a block; the
    step compiled on the mesh reports one device's temp, below the single device's."""
    body = """
        import os
        os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
        os.environ["JAX_PLATFORMS"] = "cpu"
        import jax, numpy as np
        from jax.sharding import Mesh
        from specjax import LoopOptions, demo_models, make_proposer
        from specjax.engine import memory
        from specjax.models import registry
        from specjax.runtime.step import make_step
        kind, cfg, params = demo_models.load("target")
        tgt = registry.make_model(kind, cfg)
        mesh = Mesh(np.array(jax.devices()[:2]), ("tp",))
        prop = make_proposer({"model": str(demo_models.path("eagle3")),
                              "num_speculative_tokens": 3}, target=tgt, target_params=params,
                             max_model_len=128, block_size=16)
        for p in (None, prop):
            one, two = make_step(tgt, p), make_step(tgt, p, mesh=mesh)
            whole = memory.kv_cache_bytes(one, 16, np.float32)
            assert memory.kv_cache_bytes(two, 16, np.float32) == whole
            shard = memory.kv_cache_bytes(two, 16, np.float32, per_device=True)
            assert 2 * shard[0] == whole[0] > 0, (shard, whole)
            temp = [memory.compiled_temp_bytes(s, s.place_target_params(params), block_size=16,
                                               kv_dtype=np.float32, tokens=256, requests=4,
                                               blocks=8) for s in (one, two)]
            assert 0 < temp[1] < 0.75 * temp[0], temp
            work = memory.step_workspace_bytes(two, two.place_target_params(params),
                                               block_size=16, kv_dtype=np.float32,
                                               max_model_len=128, max_num_batched_tokens=256,
                                               max_num_seqs=4)
            assert work >= temp[1] + memory.RUNTIME_SLACK_BYTES, (work, temp)
        print("ok")
    """
    env = dict(os.environ, PYTHONPATH=suite_paths.pythonpath())
    env.pop("XLA_FLAGS", None)
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(body)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stderr[-4000:]


# --- activations and the devices ------------------------------------------------------


def test_activation_estimate_formula():
    step = demo_step(False)
    _, params = demo_target()       # fp32; H 256, I 768, V 260, no aux layers
    t = 64
    hidden = t * 4 * (8 * 256 + 3 * 768)
    got = memory.activation_bytes_estimate(step, params, max_num_batched_tokens=t)
    assert got == hidden + t * 260 * 4 * memory.LOGITS_COPIES + memory.RUNTIME_SLACK_BYTES
    # logits rows bounded by max_num_seqs x (k + 1): 2 rows (k = 0)
    got = memory.activation_bytes_estimate(step, params, max_num_batched_tokens=t, max_num_seqs=2)
    assert got == hidden + 2 * 260 * 4 * memory.LOGITS_COPIES + memory.RUNTIME_SLACK_BYTES
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        memory.activation_bytes_estimate(step, params, max_num_batched_tokens=0)


class FakeDevice:
    platform = "gpu"

    def __init__(self, stats, id=0):
        self.stats, self.id = stats, id

    def memory_stats(self):
        return self.stats

    def __repr__(self):
        return f"FakeDevice({self.id})"


def expected_blocks(step, params, limit, in_use, fraction=0.5, tokens=256, extra_fixed=0):
    per_block, fixed = memory.kv_cache_bytes(step, BS, jnp.float32)
    act = max(memory.activation_bytes_estimate(step, params, max_num_batched_tokens=tokens),
              memory.RUNTIME_SLACK_BYTES + memory.compiled_temp_bytes(
                  step, params, block_size=BS, kv_dtype=jnp.float32, tokens=tokens, requests=1,
                  blocks=128 // BS))
    return (int(fraction * limit) - in_use - act - fixed - extra_fixed) // per_block


def test_compiled_temp_bytes_sizes_the_workspace(monkeypatch):
    """The step's compiled temp grows with the token budget; where it exceeds the analytic
    bound it sizes the pool's free share (vLLM's profile run), and compiled=False keeps
    the bound alone."""
    step = demo_step(True)
    _, params = demo_target()
    temp = functools.partial(memory.compiled_temp_bytes, step, params, block_size=BS,
                             kv_dtype=jnp.float32, requests=4, blocks=8)
    assert 0 < temp(tokens=64) < temp(tokens=1024)
    dev = FakeDevice({"bytes_limit": 4 * GiB, "bytes_in_use": 100 * MiB})
    per_block, fixed = memory.kv_cache_bytes(step, BS, jnp.float32)
    room = int(0.5 * 4 * GiB) - 100 * MiB - fixed
    act = memory.activation_bytes_estimate(step, params, max_num_batched_tokens=256)
    plain = memory.num_blocks_from_memory(step, params, device=dev, compiled=False, **CALL)
    assert plain == (room - act) // per_block
    assert memory.num_blocks_from_memory(step, params, device=dev, activation_bytes=0,
                                         **CALL) == room // per_block
    monkeypatch.setattr(memory, "compiled_temp_bytes", lambda *a, **k: GiB)
    big = memory.num_blocks_from_memory(step, params, device=dev, **CALL)
    assert big == (room - GiB - memory.RUNTIME_SLACK_BYTES) // per_block < plain


def test_compiled_temp_bytes_of_a_foreign_target():
    """A target written against ``specjax.Target`` alone (its own attention and KV layout)
    goes through the same compile: its temp grows with the token budget, it sizes the pool
    of an ``Engine`` built with ``gpu_memory_utilization``, and that engine decodes."""
    from foreign_target import ForeignGPT, full_recompute_greedy, init_params

    from specjax import Engine, SamplingParams, TargetModel

    tgt, params = ForeignGPT(block_size=8), init_params(0)
    step = make_step(tgt, None)
    temp = functools.partial(memory.compiled_temp_bytes, step, params, block_size=8,
                             kv_dtype=jnp.float32, requests=2, blocks=8)
    small, big = temp(tokens=32), temp(tokens=512)
    assert 0 < small < big
    dev = FakeDevice({"bytes_limit": GiB, "bytes_in_use": MiB})
    monkey = pytest.MonkeyPatch()
    monkey.setattr(memory, "_devices", lambda params, step, device: [dev])
    try:
        eng = Engine(TargetModel(tgt, params), None, max_model_len=64, block_size=8,
                     max_num_seqs=2, gpu_memory_utilization=0.5,
                     options=LoopOptions(max_num_batched_tokens=512))
    finally:
        monkey.undo()
    assert eng.workspace_bytes == max(
        big + memory.RUNTIME_SLACK_BYTES,
        memory.activation_bytes_estimate(eng.step, params, max_num_batched_tokens=512,
                                         max_num_seqs=2))
    per_block, fixed = memory.kv_cache_bytes(eng.step, 8, jnp.float32)
    assert eng.num_blocks == (GiB // 2 - MiB - eng.workspace_bytes - fixed) // per_block
    prompt = [5, 6, 7, 8, 5, 6]
    out = eng.generate([prompt], SamplingParams(max_tokens=6)).token_ids
    assert out == [full_recompute_greedy(params, prompt, 6)]


CALL = dict(fraction=0.5, block_size=BS, kv_dtype=None, max_model_len=128,
            max_num_batched_tokens=256)


@pytest.mark.parametrize("with_eagle3", [False, True])
def test_num_blocks_from_memory_on_a_fake_device(with_eagle3):
    step = demo_step(with_eagle3)
    _, params = demo_target()
    dev = FakeDevice({"bytes_limit": 4 * GiB, "bytes_in_use": 100 * MiB})
    got = memory.num_blocks_from_memory(step, params, device=dev, **CALL)
    assert got == expected_blocks(step, params, 4 * GiB, 100 * MiB) > 1000
    # weights still on the host are counted as fixed bytes
    host = jax.tree.map(np.asarray, params)
    got = memory.num_blocks_from_memory(step, host, device=dev, **CALL)
    assert got == expected_blocks(step, params, 4 * GiB, 100 * MiB, extra_fixed=leaf_bytes(host))


def test_num_blocks_from_memory_takes_the_smallest_device(monkeypatch):
    step = demo_step(False)
    _, params = demo_target()
    devs = [FakeDevice({"bytes_limit": 4 * GiB, "bytes_in_use": u}, i)
            for i, u in enumerate((100 * MiB, 900 * MiB))]
    monkeypatch.setattr(memory, "_devices", lambda params, step, device: devs)
    got = memory.num_blocks_from_memory(step, params, **CALL)
    assert got == expected_blocks(step, params, 4 * GiB, 900 * MiB)
    # too little on the second device: refused by name
    devs[1] = FakeDevice({"bytes_limit": 4 * GiB, "bytes_in_use": 2 * GiB - 200 * MiB}, 1)
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.5 .*min_blocks=9"):
        memory.num_blocks_from_memory(step, params, **CALL)


def test_num_blocks_from_memory_refuses_a_device_without_memory_stats():
    step = demo_step(False)
    _, params = demo_target()       # on the CPU device: memory_stats() is None
    with pytest.raises(ValueError, match="gpu_memory_utilization.*give num_blocks"):
        memory.num_blocks_from_memory(step, params, **CALL)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.num_blocks_from_memory(step, params, device=FakeDevice(None), **CALL)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        memory.num_blocks_from_memory(step, params, **dict(CALL, fraction=1.5))
