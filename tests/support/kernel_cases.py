"""Random ragged batches for the five kernel ops, shared by the CPU and GPU tests.

A *config* fixes everything that shapes a compilation: the padded row count (``rows``), the
padded token count (``tokens``) and the static arguments. A *case* is one batch drawn inside a
config: ``make_case(op, rng, config, num_real)`` returns the keyword arguments of the public op
(minus ``backend``) as NumPy arrays and Python scalars. Tests draw many cases from a few
configs, so each backend compiles a handful of programs and then reuses its jit cache.

``num_reqs`` is a 0-d int32 array (the real row count; rows past it hold garbage the op must
ignore), or None (then every row is real). Real rows respect the op's documented
preconditions and mix in the edges the specification names: positions at
``max_model_len - 2``, ``- 1`` and past it, block numbers past the last block-table column,
all-rejected / none-rejected / discarded requests, ``-1``, other negative and out-of-vocabulary
tokens, empty and long queries, slot values near ``2**31``, ``input_batch_size > B``, and
output buffers too small (dropped writes) or larger than needed.
"""

from __future__ import annotations

import numpy as np

INT32_MAX = 2**31 - 1
INT32_MIN = -(2**31)


def bucket(n: int) -> int:
    """Next power of two >= max(n, 1)."""
    n = max(int(n), 1)
    return 1 << (n - 1).bit_length()


# ----------------------------------------------------------------------------- configs
# Hand-picked configs for the CPU tests: together they cover every static value of interest
# with few compilations. "rows" is the padded row count (a power of two).

CPU_CONFIGS = {
    "eagle_step_update_slot_mapping_and_metadata": [
        dict(rows=1, block_size=1, num_block_columns=1, max_model_len=5, input_batch_size=1),
        dict(rows=4, block_size=4, num_block_columns=3, max_model_len=64, input_batch_size=8),
        dict(rows=16, block_size=16, num_block_columns=128, max_model_len=4096,
             input_batch_size=16),
        dict(rows=16, block_size=1, num_block_columns=16, max_model_len=5, input_batch_size=32),
        dict(rows=64, block_size=4, num_block_columns=16, max_model_len=64, input_batch_size=64),
        dict(rows=256, block_size=16, num_block_columns=3, max_model_len=4096,
             input_batch_size=512),
    ],
    "eagle_prepare_inputs_padded": [
        dict(rows=1), dict(rows=4), dict(rows=16), dict(rows=64), dict(rows=256),
    ],
    "eagle_prepare_next_token_padded": [
        dict(rows=1, num_sampled=1, vocab_size=1),
        dict(rows=4, num_sampled=2, vocab_size=8),
        dict(rows=16, num_sampled=4, vocab_size=32000),
        dict(rows=16, num_sampled=8, vocab_size=1),
        dict(rows=64, num_sampled=8, vocab_size=INT32_MAX),
        dict(rows=256, num_sampled=4, vocab_size=8),
    ],
    "copy_and_expand_eagle_inputs": [
        dict(rows=1, tokens=16, num_padding_slots_per_request=1, shift_input_ids=True,
             padding_token_id=0, parallel_drafting_token_id=1, num_output_tokens=32),
        dict(rows=4, tokens=32, num_padding_slots_per_request=2, shift_input_ids=False,
             padding_token_id=-1, parallel_drafting_token_id=151643, num_output_tokens=64),
        dict(rows=4, tokens=512, num_padding_slots_per_request=4, shift_input_ids=True,
             padding_token_id=-1, parallel_drafting_token_id=151643, num_output_tokens=1024),
        # output buffers smaller than the expanded batch: writes past the end are dropped
        dict(rows=16, tokens=128, num_padding_slots_per_request=4, shift_input_ids=True,
             padding_token_id=0, parallel_drafting_token_id=1, num_output_tokens=64),
        dict(rows=16, tokens=64, num_padding_slots_per_request=2, shift_input_ids=False,
             padding_token_id=0, parallel_drafting_token_id=1, num_output_tokens=32),
        dict(rows=64, tokens=512, num_padding_slots_per_request=2, shift_input_ids=True,
             padding_token_id=-1, parallel_drafting_token_id=151643, num_output_tokens=1024),
        dict(rows=256, tokens=1024, num_padding_slots_per_request=1, shift_input_ids=False,
             padding_token_id=0, parallel_drafting_token_id=1, num_output_tokens=2048),
    ],
    "copy_and_expand_dflash_inputs": [
        dict(rows=1, tokens=16, num_speculative_tokens=1, block_size=1, num_block_columns=1,
             parallel_drafting_token_id=1, has_rejected=True),
        dict(rows=4, tokens=32, num_speculative_tokens=3, block_size=4, num_block_columns=3,
             parallel_drafting_token_id=151643, has_rejected=False),
        dict(rows=4, tokens=512, num_speculative_tokens=7, block_size=1, num_block_columns=128,
             parallel_drafting_token_id=1, has_rejected=True),
        dict(rows=16, tokens=128, num_speculative_tokens=7, block_size=16, num_block_columns=128,
             parallel_drafting_token_id=1, has_rejected=True),
        dict(rows=64, tokens=512, num_speculative_tokens=3, block_size=4, num_block_columns=16,
             parallel_drafting_token_id=151643, has_rejected=True),
        dict(rows=256, tokens=1024, num_speculative_tokens=1, block_size=16,
             num_block_columns=3, parallel_drafting_token_id=1, has_rejected=False),
    ],
}


def random_config(op: str, rng: np.random.Generator, *, rows: int | None = None,
                  max_reqs: int = 256) -> dict:
    """A config drawn freely (power-of-two buckets), for tests that can afford compilations."""
    if rows is None:
        rows = bucket(int(rng.integers(0, max_reqs + 1)))
    if op == "eagle_step_update_slot_mapping_and_metadata":
        return dict(rows=rows, block_size=int(rng.choice((1, 4, 16))),
                    num_block_columns=int(rng.choice((1, 3, 16, 128))),
                    max_model_len=int(rng.choice((5, 64, 4096))),
                    input_batch_size=rows * int(rng.choice((1, 2))))
    if op == "eagle_prepare_inputs_padded":
        return dict(rows=rows)
    if op == "eagle_prepare_next_token_padded":
        return dict(rows=rows, num_sampled=int(rng.choice((1, 2, 4, 8))),
                    vocab_size=int(rng.choice((1, 8, 32000, INT32_MAX))))
    if op == "copy_and_expand_eagle_inputs":
        p = int(rng.choice((1, 2, 4)))
        tokens = bucket(rows * int(rng.choice((2, 8))))
        pad, pd = ((0, 1), (-1, 151643))[int(rng.integers(0, 2))]
        full = bucket(tokens + rows * p)
        return dict(rows=rows, tokens=tokens, num_padding_slots_per_request=p,
                    shift_input_ids=bool(rng.integers(0, 2)), padding_token_id=pad,
                    parallel_drafting_token_id=pd,
                    num_output_tokens=(full, full // 2, full // 4)[int(rng.choice(3, p=[.6, .25, .15]))])
    if op == "copy_and_expand_dflash_inputs":
        return dict(rows=rows, tokens=bucket(rows * int(rng.choice((2, 8)))),
                    num_speculative_tokens=int(rng.choice((1, 3, 7))),
                    block_size=int(rng.choice((1, 4, 16))),
                    num_block_columns=int(rng.choice((1, 3, 16, 128))),
                    parallel_drafting_token_id=int(rng.choice((1, 151643))),
                    has_rejected=bool(rng.random() < 0.7))
    raise KeyError(op)


# ----------------------------------------------------------------------------- helpers


def _rows(rng, config, num_real, none_prob=0.2):
    """(real rows, padded rows, num_reqs argument)."""
    rows = config["rows"]
    if num_real is None:
        if rng.random() < none_prob:
            return rows, rows, None  # every row is real
        u = rng.random()
        num_real = 0 if u < 0.1 else rows if u < 0.3 else int(rng.integers(0, rows + 1))
    assert 0 <= num_real <= rows, (num_real, rows)
    return num_real, rows, np.asarray(num_real, dtype=np.int32)


def _garbage(rng, shape, lo=INT32_MIN, hi=INT32_MAX):
    return rng.integers(lo, hi, size=shape, endpoint=True, dtype=np.int64).astype(np.int32)


def _block_table(rng, rows, columns, block_size):
    """Block ids; sometimes the largest ones whose slots still fit int32."""
    top = (INT32_MAX - (block_size - 1)) // block_size  # top * bs + (bs - 1) <= INT32_MAX
    if rng.random() < 0.3:
        ids = rng.integers(max(top - 8, 0), top, size=(rows, columns), endpoint=True)
    else:
        ids = rng.integers(0, 4096, size=(rows, columns))
    return ids.astype(np.int32)


def _edge_tokens(rng, n, vocab_size):
    """Token ids around the vocabulary's edges (-1, other negatives, vocab_size +- 1, ...)."""
    edges = np.array([-1, -1, -2, INT32_MIN, 0, vocab_size - 1, vocab_size, vocab_size + 1,
                      INT32_MAX], dtype=np.int64)
    return rng.choice(np.clip(edges, INT32_MIN, INT32_MAX), size=n)


def _query_lens(rng, n, tokens, *, min_len):
    """``n`` query lengths >= min_len summing to at most ``tokens``: mostly short, a few long,
    and sometimes one request that takes every remaining token."""
    assert n * min_len <= tokens, (n, min_len, tokens)
    lens = np.where(rng.random(n) < 0.05,
                    rng.integers(max(min_len, 1), 301, size=n),
                    rng.integers(min_len, 9, size=n)).astype(np.int64)
    budget = tokens - n * min_len  # tokens left above the minimum
    for r in rng.permutation(n):
        extra = min(int(lens[r]) - min_len, budget)
        lens[r] = min_len + extra
        budget -= extra
    if n and rng.random() < 0.2:
        lens[int(rng.integers(0, n))] += budget  # no padding token left
    return lens


def _query_start_loc(rng, lens, rows):
    """``[rows + 1]`` query_start_loc: the real cumsum, then padding rows that repeat the last
    value or hold garbage."""
    n = len(lens)
    qsl = np.zeros(rows + 1, dtype=np.int64)
    qsl[1 : n + 1] = np.cumsum(lens)
    total = int(qsl[n])
    if rng.random() < 0.5:
        qsl[n + 1 :] = total
    else:
        qsl[n + 1 :] = rng.integers(0, bucket(total) + 1, size=rows - n)
    return qsl.astype(np.int32), total


# ----------------------------------------------------------------------------- op 1


def eagle_step_case(rng, config, num_real=None):
    n, b, num_reqs = _rows(rng, config, num_real)
    block_size = config["block_size"]
    max_model_len = config["max_model_len"]
    positions = _garbage(rng, b, 0, 2 * max_model_len)
    seq_lens = _garbage(rng, b, 0, 2 * max_model_len)
    for r in range(n):
        kind = int(rng.integers(0, 8))
        if kind == 0:
            p = max_model_len - 1  # new == max_model_len: clamped
        elif kind == 1:
            p = max_model_len - 2  # new == max_model_len - 1: the last position kept
        elif kind == 2:
            p = max_model_len + int(rng.integers(0, 3))  # already past the end
        elif kind == 3:
            p = 0
        elif kind == 4:  # one before a block boundary
            p = max(int(rng.integers(0, max_model_len)) // block_size * block_size - 1, 0)
        else:
            p = int(rng.integers(0, max_model_len))
        positions[r] = p
        seq_lens[r] = max((p + 1 - int(rng.integers(0, 4)), max_model_len, max_model_len - 1,
                           p + 1, 0)[int(rng.integers(0, 5))], 0)
    return dict(
        positions=positions,
        block_table=_block_table(rng, b, config["num_block_columns"], block_size),
        seq_lens=seq_lens, block_size=block_size, max_model_len=max_model_len,
        input_batch_size=config["input_batch_size"], num_reqs=num_reqs,
    )


# ----------------------------------------------------------------------------- op 2


def eagle_prepare_inputs_case(rng, config, num_real=None):
    n, rows, num_reqs = _rows(rng, config, num_real)
    k = int(rng.integers(1, 8))
    n_draft = rng.integers(0, k + 1, size=rows)  # padding rows keep garbage counts
    valid = _garbage(rng, rows, 0, k + 1).astype(np.int64)
    lens = np.zeros(n, dtype=np.int64)
    mode = int(rng.integers(0, 4))  # batch flavour: mixed, all-rejected, none-, discarded
    for r in range(n):
        d = k if rng.random() < 0.2 else int(rng.integers(0, k + 1))
        if rng.random() < 0.1:
            d = 0  # a prefill or no-draft request
        n_draft[r] = d
        m = mode or int(rng.integers(1, 5))
        if m == 1:
            valid[r] = 1  # every draft rejected
        elif m == 2:
            valid[r] = d + 1  # every draft accepted
        elif m == 3:
            valid[r] = 0  # discarded request
        else:
            valid[r] = int(rng.integers(0, d + 2))
        if d == 0:  # an empty, decode or long (chunked prefill) query
            lens[r] = (0, 1, int(rng.integers(2, 300)))[int(rng.integers(0, 3))]
        else:
            lens[r] = d + 1
    qsl, _ = _query_start_loc(rng, lens, rows)
    return dict(
        cu_num_draft_tokens=np.cumsum(n_draft).astype(np.int32),
        valid_sampled_tokens_count=valid.astype(np.int32), query_start_loc=qsl,
        num_reqs=num_reqs,
    )


# ----------------------------------------------------------------------------- op 3


def eagle_prepare_next_token_case(rng, config, num_real=None):
    n, rows, num_reqs = _rows(rng, config, num_real)
    s = config["num_sampled"]
    vocab_size = config["vocab_size"]
    sampled = _garbage(rng, (rows, s)).astype(np.int64)
    mode = int(rng.integers(0, 4))
    for r in range(n):
        m = mode or int(rng.integers(1, 4))
        row = np.full(s, -1, dtype=np.int64)
        if m == 1:  # rejection-sampler output: accepted + 1 valid tokens, then -1
            a = int(rng.integers(0, s + 1))  # a == 0: nothing valid
            row[:a] = rng.integers(0, vocab_size, size=a)
        elif m == 2:  # all -1 or all valid
            if rng.random() < 0.5:
                row[:] = rng.integers(0, vocab_size, size=s)
        else:  # anything: -1, other negatives, vocabulary edges, in-vocabulary tokens
            row[:] = _edge_tokens(rng, s, vocab_size)
            inv = rng.random(s) < 0.3
            row[inv] = rng.integers(0, vocab_size, size=int(inv.sum()))
        sampled[r] = row
    discard = rng.random(rows) < (0.2, 0.0, 1.0)[int(rng.choice(3, p=[.8, .1, .1]))]
    return dict(
        sampled_token_ids=sampled.astype(np.int32), discard_request_mask=discard,
        backup_next_token_ids=_garbage(rng, rows, 0, vocab_size - 1), vocab_size=vocab_size,
        num_reqs=num_reqs,
    )


# ----------------------------------------------------------------------------- op 4


def _rejected_counts(rng, lens):
    """Rejected tokens per request in [0, len - 1]: none, all, or mixed, batch-wide or not."""
    rejected = np.zeros(len(lens), dtype=np.int64)
    mode = int(rng.integers(0, 4))
    for r, ln in enumerate(lens):
        m = mode or int(rng.integers(1, 4))
        if m == 2:
            rejected[r] = ln - 1  # all rejected: end == start
        elif m == 3:
            rejected[r] = int(rng.integers(0, ln))
    return rejected


def copy_and_expand_eagle_case(rng, config, num_real=None):
    n, rows, num_reqs = _rows(rng, config, num_real)
    t = config["tokens"]
    lens = _query_lens(rng, n, t, min_len=1)  # start <= end < next_start
    qsl, _ = _query_start_loc(rng, lens, rows)
    qel = _garbage(rng, rows, 0, t)
    qel[:n] = qsl[1 : n + 1] - 1 - _rejected_counts(rng, lens)
    ids = _edge_tokens(rng, t, 32000)
    inv = rng.random(t) < 0.7
    ids[inv] = rng.integers(0, 32000, size=int(inv.sum()))
    positions = _garbage(rng, t, 0, 1 << 20)
    for r in range(n):  # consecutive positions inside a request
        a, b = int(qsl[r]), int(qsl[r + 1])
        base = int(rng.integers(0, 1 << 20)) if rng.random() < 0.7 else int(rng.integers(0, 4))
        positions[a:b] = base + np.arange(b - a)
    statics = {k: config[k] for k in (
        "padding_token_id", "parallel_drafting_token_id", "num_padding_slots_per_request",
        "shift_input_ids", "num_output_tokens")}
    return dict(
        target_token_ids=ids.astype(np.int32), target_positions=positions,
        next_token_ids=_garbage(rng, rows, 0, 31999), query_start_loc=qsl, query_end_loc=qel,
        num_reqs=num_reqs, **statics,
    )


# ----------------------------------------------------------------------------- op 5


def copy_and_expand_dflash_case(rng, config, num_real=None):
    n, rows, num_reqs = _rows(rng, config, num_real)
    t = config["tokens"]
    k = config["num_speculative_tokens"]
    block_size = config["block_size"]
    lens = _query_lens(rng, n, t, min_len=0)  # an empty context is allowed
    qsl, _ = _query_start_loc(rng, lens, rows)
    positions = _garbage(rng, t, 0, 1 << 20)
    cover = config["num_block_columns"] * block_size  # positions the block table reaches
    for r in range(n):
        a, b = int(qsl[r]), int(qsl[r + 1])
        u = rng.random()
        if u < 0.3:
            base = int(rng.integers(0, 4))
        elif u < 0.6:  # around the end of the block table: capped block numbers
            base = max(cover - (b - a) - int(rng.integers(-3, 4)), 0)
        else:
            base = int(rng.integers(0, 1 << 20))
        positions[a:b] = base + np.arange(b - a)
    rej = None
    if config["has_rejected"]:
        rej = rng.integers(0, k + 1, size=rows)  # padding rows: garbage
        for r in range(n):
            ln = int(lens[r])
            u = rng.random()
            if u < 0.3:
                rej[r] = 0
            elif u < 0.5:
                rej[r] = min(ln, k)  # all k drafts rejected (or the whole short context)
            elif u < 0.6:
                rej[r] = ln + int(rng.integers(0, 3))  # before the context: index clipped
            else:
                rej[r] = int(rng.integers(0, max(min(ln, k + 1), 1)))
        rej = rej.astype(np.int32)
    return dict(
        next_token_ids=_garbage(rng, rows, 0, 31999), target_positions=positions,
        block_table=_block_table(rng, rows, config["num_block_columns"], block_size),
        query_start_loc=qsl, num_rejected_tokens=rej,
        parallel_drafting_token_id=config["parallel_drafting_token_id"],
        block_size=block_size, num_speculative_tokens=k, num_reqs=num_reqs,
    )


CASES = {
    "eagle_step_update_slot_mapping_and_metadata": eagle_step_case,
    "eagle_prepare_inputs_padded": eagle_prepare_inputs_case,
    "eagle_prepare_next_token_padded": eagle_prepare_next_token_case,
    "copy_and_expand_eagle_inputs": copy_and_expand_eagle_case,
    "copy_and_expand_dflash_inputs": copy_and_expand_dflash_case,
}

OP_NAMES = tuple(CASES)


def make_case(op: str, rng: np.random.Generator, config: dict, num_real: int | None = None):
    """One batch of ``op`` inside ``config``; ``num_real`` None lets ``rng`` choose (including
    the num_reqs=None form), an int gives ``num_reqs = np.int32(num_real)``."""
    return CASES[op](rng, config, num_real)


#: Names of each op's outputs, in order (for error messages).
#: The kernels/ folder of each op.
FAMILY = {
    "eagle_step_update_slot_mapping_and_metadata": "eagle_step",
    "eagle_prepare_inputs_padded": "prepare",
    "eagle_prepare_next_token_padded": "prepare",
    "copy_and_expand_eagle_inputs": "copy_expand",
    "copy_and_expand_dflash_inputs": "copy_expand",
}

OUTPUT_NAMES = {
    "eagle_step_update_slot_mapping_and_metadata": (
        "clamped_positions", "slot_mapping", "seq_lens"),
    "eagle_prepare_inputs_padded": ("token_indices_to_sample", "num_rejected_tokens"),
    "eagle_prepare_next_token_padded": ("next_token_ids", "valid_sampled_tokens_count"),
    "copy_and_expand_eagle_inputs": (
        "input_ids", "positions", "is_rejected_token_mask", "is_masked_token_mask",
        "new_token_indices", "hidden_state_mapping"),
    "copy_and_expand_dflash_inputs": (
        "input_ids", "context_positions", "query_positions", "context_slot_mapping",
        "query_slot_mapping", "token_indices_to_sample"),
}
