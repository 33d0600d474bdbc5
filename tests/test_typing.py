"""Type checkers see the package: ``py.typed`` is installed, and the pinned mypy checks a
snippet using every name in ``specjax.__all__`` and the docs' examples
(``make_proposer``, ``generate``, ``load_pretrained``, a kernel call, the public step) with
0 errors. mypy cannot follow setuptools' default editable finder (the top-level
``kernels/``, ``models/``, ``converters/`` are mapped into ``specjax``), so the test gives it
the installed layout as a tree of links (``MYPYPATH``): what a wheel or
``editable_mode=strict`` install puts on the path."""

from __future__ import annotations

import importlib.resources
import os
import subprocess
import sys
import textwrap

import pytest

import specjax

from test_layout import PACKAGES, ROOT

SNIPPET = '''
from typing import Any

import numpy as np

import specjax
import specjax.kernels as K
from specjax.runtime.batch import build_batch
from specjax.config import SpeculativeConfig
from specjax.engine import Engine, GenerateResult, SamplingParams, TargetModel, generate
from specjax.proposers import Feed, Proposer, make_proposer
from specjax.runtime.output import StepOutput
from specjax.runtime.step import Step, StepBatch, make_step

EVERY_NAME = [{names}]


def readme(model: Any, params: dict, head_config: Any, head_params: dict,
           prompts: list[list[int]]) -> None:
    prop: Proposer = make_proposer(SpeculativeConfig(method="eagle3", num_speculative_tokens=3),
                                   target=model, target_params=params, draft=head_config,
                                   draft_params=head_params, max_model_len=4096, block_size=16)
    out: GenerateResult = generate(TargetModel(model, params), prop, prompts,
                                   SamplingParams(max_tokens=128))
    ids: list[list[int]] = out.token_ids
    tau: float = out.mean_acceptance_length
    kind, cfg, loaded = specjax.load_pretrained("eagle3_dir")
    clamped, slots, seq_lens = K.eagle_step_update_slot_mapping_and_metadata(
        np.zeros(4, np.int32), np.zeros((4, 8), np.int32), np.ones(4, np.int32),
        block_size=16, max_model_len=4096, backend="auto")
    step: Step = make_step(model, prop)
    feed: Feed | None = step.feed
    target_kv, draft_state = step.init_caches(64, block_size=16)
    batch: StepBatch = build_batch([[1, 2, 3]], num_computed=[0], num_drafts=[0],
                                   block_ids=[[1]], block_size=16, num_reqs_pad=1,
                                   query_len_pad=4, blocks_per_req_pad=1, max_spec_len=step.k)
    res, target_kv, draft_state = step(params, step.draft_params, target_kv, draft_state, batch)
    so: StepOutput = res
    print(ids, tau, kind, cfg, loaded, clamped, slots, seq_lens, feed, so.sampled,
          so.num_accepted, so.drafts, so.num_drafts, Engine, EVERY_NAME)
'''


def test_py_typed_is_installed():
    assert importlib.resources.files("specjax").joinpath("py.typed").is_file()


def _installed_layout(where):
    """``where/specjax``: links laid out as the package installs (pyproject's package-dir)."""
    pkg = where / "specjax"
    for top, name in PACKAGES.items():
        dst = pkg.joinpath(*name.split(".")[1:])
        dst.mkdir(parents=True, exist_ok=True)
        for src in (ROOT / top).iterdir():
            if src.name != "__pycache__" and not (dst / src.name).exists() and \
                    src.name not in PACKAGES:
                (dst / src.name).symlink_to(src)
    return where


def _mypy(f, env):
    return subprocess.run([sys.executable, "-m", "mypy", "--follow-imports=silent",
                           "--no-incremental", "--python-version", "3.12", str(f)],
                          capture_output=True, text=True, timeout=900, cwd=f.parent, env=env)


@pytest.mark.slow
def test_mypy_checks_the_public_api(tmp_path):
    names = ", ".join(f"specjax.{n}" for n in specjax.__all__ if n != "__version__")
    env = {**os.environ, "MYPYPATH": str(_installed_layout(tmp_path / "site"))}
    f = tmp_path / "snippet.py"
    f.write_text(textwrap.dedent(SNIPPET.format(names=names)))
    r = _mypy(f, env)
    assert r.returncode == 0 and "Success: no issues found" in r.stdout, r.stdout + r.stderr
    # the check can fail: a wrong type on a public signature is reported
    f.write_text(textwrap.dedent(SNIPPET.format(names=names)) +
                 "\nbad: int = make_step\n")
    r = _mypy(f, env)
    assert r.returncode == 1 and "Incompatible types in assignment" in r.stdout, r.stdout
