"""SpecDecodeMetadata against the worked example of vLLM's gpu_model_runner comment."""

import numpy as np
import pytest

from specjax.metadata import SpecDecodeMetadata


def test_worked_example():
    drafts = [[11, 12, 13], [], [21, 22], [], [31]]
    m = SpecDecodeMetadata.from_draft_lists(drafts, [4, 104, 107, 207, 209])
    np.testing.assert_array_equal(m.cu_num_draft_tokens, [3, 3, 5, 5, 6])
    np.testing.assert_array_equal(m.cu_num_sampled_tokens, [4, 5, 8, 9, 11])
    np.testing.assert_array_equal(m.logits_indices, [0, 1, 2, 3, 103, 104, 105, 106, 206, 207, 208])
    np.testing.assert_array_equal(m.target_logits_indices, [0, 1, 2, 5, 6, 9])
    np.testing.assert_array_equal(m.bonus_logits_indices, [3, 4, 7, 8, 10])
    # draft token positions in input_ids = the logits row of each draft, plus one
    np.testing.assert_array_equal(np.asarray(m.logits_indices)[np.asarray(m.target_logits_indices)] + 1,
                                  [1, 2, 3, 105, 106, 208])
    np.testing.assert_array_equal(m.draft_token_ids, [11, 12, 13, 21, 22, 31])
    assert m.max_spec_len == 3 and int(m.num_reqs) == 5
    assert all(np.asarray(getattr(m, f)).dtype == np.int32 for f in
               ("draft_token_ids", "cu_num_draft_tokens", "logits_indices"))


def test_padding_and_dummy():
    m = SpecDecodeMetadata.from_draft_lists([[1, 2], [3]], num_reqs_pad=4, num_drafts_pad=5, max_spec_len=4)
    np.testing.assert_array_equal(m.num_draft_tokens, [2, 1, 0, 0])
    np.testing.assert_array_equal(m.cu_num_draft_tokens, [2, 3, 3, 3])
    np.testing.assert_array_equal(m.draft_token_ids, [1, 2, 3, -1, -1])
    assert m.logits_indices.shape == (9,) and m.max_spec_len == 4
    d = SpecDecodeMetadata.make_dummy([[5, 6, 7], [8]])
    np.testing.assert_array_equal(d.cu_num_sampled_tokens, [4, 6])
    assert not np.asarray(d.logits_indices).any() and d.logits_indices.shape == (6,)


def test_is_a_pytree_with_static_k():
    import jax
    m = SpecDecodeMetadata.from_draft_lists([[1, 2], [3]])
    leaves, tree = jax.tree_util.tree_flatten(m)
    assert len(leaves) == 8
    m2 = jax.tree_util.tree_unflatten(tree, leaves)
    assert m2.max_spec_len == 2
    out = jax.jit(lambda x: x.cu_num_draft_tokens * x.max_spec_len)(m)
    np.testing.assert_array_equal(out, [4, 6])


def test_errors():
    with pytest.raises(ValueError, match="cu_num_scheduled_tokens"):
        SpecDecodeMetadata.from_draft_lists([[1, 2]], [1])
    with pytest.raises(ValueError, match="max_spec_len"):
        SpecDecodeMetadata.from_draft_lists([[1, 2]], max_spec_len=1)
    with pytest.raises(ValueError, match="num_reqs_pad"):
        SpecDecodeMetadata.from_draft_lists([[1], [2]], num_reqs_pad=1)
