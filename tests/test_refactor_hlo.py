"""A refactor that moves code changes no program: the CPU-lowered StableHLO of the fused
step and of the device loop (the demo target, B = 8, plain and EAGLE-3) equals the golden
copies made on the commit before the move (``tests/support/fixtures/hlo/``, written by
``tests/support/hlo_programs.py``), apart from names and source locations. JAX's lowering
differs between JAX versions, so the comparison runs on the version the copies were made
with (CI's newest pins) and is skipped elsewhere."""

from __future__ import annotations

import difflib
import gzip

import jax
import pytest

import hlo_programs
import suite_paths

GOLDEN = suite_paths.ROOT / "tests" / "support" / "fixtures" / "hlo"
MADE_WITH = (GOLDEN / "jax_version").read_text().strip()


@pytest.mark.skipif(jax.__version__ != MADE_WITH,
                    reason=f"the golden programs were lowered by jax {MADE_WITH}")
def test_step_and_loop_lower_to_the_golden_programs():
    got = hlo_programs.programs()
    assert sorted(got) == sorted(p.name.removesuffix(".mlir.gz") for p in GOLDEN.glob("*.mlir.gz"))
    for name, text in got.items():
        want = gzip.decompress((GOLDEN / f"{name}.mlir.gz").read_bytes()).decode()
        if text != want:
            diff = "".join(list(difflib.unified_diff(want.splitlines(True), text.splitlines(True),
                                                     "golden", "now", n=1))[:60])
            pytest.fail(f"{name}: the lowered program changed\n{diff}")


def test_normalize_keeps_what_matters():
    """The comparison can fail: normalizing drops names and locations, not operations."""
    a = 'module @jit_f {\n  func.func public @main(%arg0: tensor<2xf32> loc("x")) {\n' \
        '    %0 = stablehlo.add %arg0, %arg0 : tensor<2xf32> loc(#loc3)\n  }\n}\n#loc3 = loc("y")'
    b = a.replace("@main", "@other").replace('loc("x")', 'loc("z")')
    assert hlo_programs.normalize(a) == hlo_programs.normalize(b)
    assert hlo_programs.normalize(a) != hlo_programs.normalize(a.replace("add", "multiply"))
