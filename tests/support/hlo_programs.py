"""The CPU-lowered StableHLO of the fused step and of the device loop on the shipped demo
target (B = 8, plain and EAGLE-3 k = 3), normalized so that a pure move of code compares
equal: source locations and symbol names are dropped.

``python tests/support/hlo_programs.py DIR`` writes one ``<name>.mlir`` per program and a
``jax_version`` file: the golden copies ``tests/test_refactor_hlo.py`` compares with, made
on the commit before a refactor."""

from __future__ import annotations

import re
import sys
from pathlib import Path

B, K, BLOCK, MML, BLOCKS_PER_REQ = 8, 3, 16, 256, 4


def _models():
    import specjax

    target = specjax.load_demo_model("target")
    draft = specjax.load_demo_model("eagle3")
    spec = specjax.SpeculativeConfig(method="eagle3", num_speculative_tokens=K)
    prop = specjax.make_proposer(spec, target=target, draft=draft, max_model_len=MML,
                                 block_size=BLOCK)
    return target, {"plain": None, "eagle3": prop}


def normalize(text: str) -> str:
    """``text`` without location attributes, ``#loc`` lines and symbol names (each
    ``@name`` becomes ``@f<i>`` in order of first appearance)."""
    text = re.sub(r"\s*loc\((?:[^()]|\([^()]*\))*\)", "", text)
    lines = [ln for ln in text.splitlines() if not ln.startswith("#loc")]
    text = "\n".join(lines)
    names: dict[str, str] = {}
    text = re.sub(r"@[\w.$-]+", lambda m: names.setdefault(m.group(0), f"@f{len(names)}"), text)
    text = re.sub(r'sym_name = "[^"]*"', 'sym_name = "m"', text)
    text = re.sub(r"module @\S+", "module @m", text)
    return text + "\n"


def programs() -> dict[str, str]:
    """name -> normalized StableHLO: ``step_<method>`` (the fused step, every request
    verifying k drafts) and ``loop_<method>`` (8 device-loop iterations, fixed trip count)."""
    import jax
    import numpy as np

    from specjax.runtime.batch import build_batch
    from specjax.runtime.decode_loop import _loop_jit, make_loop_state
    from specjax.runtime.step import make_step

    target, props = _models()
    out = {}
    num_blocks = 1 + B * BLOCKS_PER_REQ
    for name, prop in props.items():
        step = make_step(target.model, prop)
        k = step.k
        tparams = step.place_target_params(target.params)
        kv, dstate = step.init_caches(num_blocks, BLOCK, kv_dtype=np.float32)
        blocks = [[1 + i * BLOCKS_PER_REQ + j for j in range(BLOCKS_PER_REQ)] for i in range(B)]
        toks = [[7 + i] + [9] * k for i in range(B)]
        batch = build_batch(toks, num_computed=[20] * B, num_drafts=[k] * B, block_ids=blocks,
                            block_size=BLOCK, num_reqs_pad=B, query_len_pad=k + 1,
                            blocks_per_req_pad=BLOCKS_PER_REQ, max_spec_len=k)
        out[f"step_{name}"] = normalize(
            step.lower(tparams, step.draft_params, kv, dstate, batch).as_text())
        state = make_loop_state(last_token=[7 + i for i in range(B)], num_computed=[20] * B,
                                drafts=[[9] * k] * B, max_tokens=[64] * B, num_output=[1] * B,
                                block_ids=blocks, k=k, num_reqs_pad=B,
                                blocks_per_req_pad=BLOCKS_PER_REQ, query_len_pad=k + 1,
                                max_model_len=MML, block_size=BLOCK)
        spec = step._spec
        dparams = step.draft_params if spec.impl is not None else None
        lowered = _loop_jit.lower(spec, 8, None, False, False, tparams, dparams, kv, dstate,
                                  jax.device_put(state), jax.numpy.asarray(False))
        out[f"loop_{name}"] = normalize(lowered.as_text())
    return out


def main(argv: list[str]) -> int:
    import jax

    dst = Path(argv[1])
    dst.mkdir(parents=True, exist_ok=True)
    for name, text in programs().items():
        (dst / f"{name}.mlir").write_text(text)
    (dst / "jax_version").write_text(jax.__version__ + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
