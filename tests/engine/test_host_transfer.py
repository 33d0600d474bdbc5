"""``specjax.runtime.host_transfer``: a step's host batch sent as one int32 buffer, exactly."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.runtime import host_transfer as ht


@pytest.mark.smoke
def test_pack_unpack_is_exact_for_every_carried_dtype():
    rng = np.random.default_rng(0)
    tree = {
        "i": rng.integers(-2**31, 2**31 - 1, (3, 5), dtype=np.int64).astype(np.int32),
        "u": rng.integers(0, 2**32 - 1, (4,), dtype=np.uint64).astype(np.uint32),
        "f": np.array([0.0, -0.0, np.inf, -np.inf, np.nan, 1e-45, 3.4e38, -1.5], np.float32),
        "b": np.array([[True, False], [False, True]]),
        "s": np.int32(7), "n": 3, "x": 0.25, "t": True,
        "empty": np.zeros((0, 4), np.int32),
        "nested": ({"a": np.arange(6, dtype=np.int32).reshape(2, 3)}, None),
    }
    assert ht.packable(tree)
    words, layout = ht.pack(tree)
    assert words.dtype == np.int32 and words.ndim == 1
    assert words.size == 15 + 4 + 8 + 4 + 4 + 0 + 6
    got = jax.jit(ht.unpack, static_argnums=1)(jnp.asarray(words), layout)
    flat_w, tdef_w = jax.tree_util.tree_flatten(tree)
    flat_g, tdef_g = jax.tree_util.tree_flatten(got)
    assert tdef_w == tdef_g
    for w, g in zip(flat_w, flat_g):
        w = np.asarray(w) if not isinstance(w, (bool, int, float)) else np.asarray(
            w, {bool: np.bool_, int: np.int32, float: np.float32}[type(w)])
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape
        # bit for bit (NaN payloads and -0.0 included)
        assert g.tobytes() == w.tobytes()
    # the layout is static and hashable: the same shapes give an equal layout
    assert hash(layout) == hash(ht.pack(tree)[1]) and layout == ht.pack(tree)[1]


@pytest.mark.smoke
def test_packable_refuses_device_arrays_and_other_dtypes():
    assert not ht.packable({"a": jnp.zeros(3, jnp.int32)})
    assert not ht.packable({"a": np.zeros(3, np.int64)})
    assert not ht.packable({"a": np.zeros(3, np.float16)})
    assert not ht.packable({"a": 2**40})
    assert ht.packable({"a": np.zeros(3, np.float32), "b": None})


def test_the_step_sends_one_buffer_and_gives_the_same_tokens():
    """The public step packs a host batch (one transfer) and its outputs equal the
    unpacked program's on the same batch, chain and plain; a device batch takes the
    unpacked path."""
    from test_engine import BS, MML, build, target

    import specjax.runtime.step as S
    from specjax.engine import Engine, LoopOptions

    for prop in (None, build("ngram", 3), build("eagle3", 3)):
        eng = Engine(target(), prop, max_model_len=MML, block_size=BS, max_num_seqs=2,
                     options=LoopOptions(batch_buckets=(2,), context_buckets=(MML // BS,)))
        reqs = eng.diagnostics._bench_requests(2, 20, 0)
        batch, _, _ = eng.scheduler.build_batch(reqs, tree_verify=False)
        assert ht.packable(batch)
        before = S._packed_step_jit._cache_size()
        kv = jax.tree.map(jnp.copy, eng.target_kv)
        ds = jax.tree.map(jnp.copy, eng.draft_state)
        out_packed, kv_p, _ = eng.step(eng.target.params, eng.step.draft_params, kv, ds, batch)
        assert S._packed_step_jit._cache_size() == before + 1
        spec = eng.step._spec
        dparams = eng.step.draft_params if spec.impl is not None else None
        out_plain, kv_u, _, _ = S._step_jit(spec, eng.target.params, dparams,
                                            jax.tree.map(jnp.copy, eng.target_kv),
                                            jax.tree.map(jnp.copy, eng.draft_state), batch)
        np.testing.assert_array_equal(np.asarray(out_packed.packed), np.asarray(out_plain.packed))
        for a, b in zip(jax.tree.leaves(kv_p), jax.tree.leaves(kv_u)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        dev = jax.tree.map(jnp.asarray, batch)
        assert not ht.packable(dev)
        for r in reqs:
            eng.scheduler.release(r)
