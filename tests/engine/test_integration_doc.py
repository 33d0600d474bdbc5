"""docs/integration.md's complete serving loop, run as written: built from the public step
(``specjax.make_step``, ``specjax.build_batch``, ``proposer.feed``) only, it must give
``specjax.generate``'s tokens for a chain method (EAGLE-3), a tree method (EAGLE-3 with a
branching ``speculative_token_tree``) and a token-history method (n-gram), greedy and with
seeded sampling, and plain decoding's tokens without a proposer."""

from __future__ import annotations

import suite_paths  # tests/support: where the suite's pieces are
import re
from pathlib import Path

import pytest

import specjax
from specjax.engine import SamplingParams, generate

from test_engine import BS, METHODS, MML, build, target

DOC = suite_paths.DOCS / "integration.md"


def _serve():
    text = DOC.read_text()
    m = re.search(r"<!-- serving-loop -->\s*```python\n(.*?)```", text, re.S)
    assert m, "docs/integration.md lost its serving-loop block"
    ns: dict = {}
    exec(compile(m.group(1), str(DOC), "exec"), ns)  # noqa: S102 (our own documentation)
    return ns["serve"]




PROMPTS = [[5, 9, 2, 17] * 3, [3, 3, 7], list(range(1, 14)), [40, 41, 40, 41, 40]]
TREE = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0), (1, 0, 0)]
#: ``-m smoke``: a tree method greedy, a history method sampled
SMOKE = {("eagle3-tree", 0.0), ("ngram", 0.8)}
CASES = {
    "eagle3": lambda: build("eagle3", 3),
    "eagle3-tree": lambda: build("eagle3", len(TREE), speculative_token_tree=str(TREE)),
    "ngram": lambda: build("ngram", 3),
    # a drafter limit (speculative_config.max_model_len) shorter than the loop's: seeded
    # sampling only matches generate's tokens when the loop stops drafting where it does
    "ngram-short": lambda: specjax.make_proposer(
        specjax.SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_min=1,
                                  prompt_lookup_max=3, max_model_len=24),
        max_model_len=MML, block_size=BS),
    "plain": lambda: None,
}


@pytest.mark.parametrize("case, temperature", [
    pytest.param(c, t, id=f"{c}-{'greedy' if t == 0 else 'seeded'}",
                 marks=[pytest.mark.smoke] if (c, t) in SMOKE else [])
    for c in sorted(CASES) for t in (0.0, 0.8)])
def test_documented_loop_gets_generates_tokens(case, temperature):
    if case.split("-")[0] not in METHODS + ("plain",):
        pytest.skip(f"{case} is not available in this install")
    serve = _serve()
    tgt = target(4.0)                      # a peaked target: drafts get accepted
    seeds = [11, 12, 13, 14]
    sps = [SamplingParams(max_tokens=m, temperature=temperature, seed=s)
           for m, s in zip((12, 20, 30, 9), seeds)]
    want = generate(tgt, CASES[case](), PROMPTS, sps, max_model_len=MML, block_size=BS)
    prop = CASES[case]()
    if prop is not None and prop.feed.token_tree is not None and case.endswith("tree"):
        assert specjax.make_step(tgt.model, prop).tree is not None     # trees are verified
    got = serve(tgt.model, tgt.params, prop, PROMPTS, max_tokens=[sp.max_tokens for sp in sps],
                max_model_len=MML, block_size=BS, temperature=temperature, seeds=seeds)
    assert got == want.token_ids
    if prop is not None:
        assert want.spec_stats.num_drafts > 0
