"""README.md is the front door: short (caps on lines and characters), its install and test
commands the ones CI runs (``.ci/run``), its Python quickstart runs as written and prints
what it says, and every relative link in it leads somewhere that exists."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

import specjax
import suite_paths

README = suite_paths.ROOT / "README.md"
CI = suite_paths.ROOT / ".ci" / "run"

MAX_LINES = 150
MAX_CHARS = 12_000
MAX_LINE = 160

INSTALL = 'pip install -e ".[test]"'
TEST_COMMAND = "python -m pytest -n 2 --dist loadfile"
SMOKE_COMMAND = "python -m pytest -m smoke -n 2 --dist loadfile"


def _text() -> str:
    return README.read_text(encoding="utf-8")


def _blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", _text(), re.S | re.M)


def _section(title: str) -> str:
    m = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", _text(), re.S | re.M)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def _quickstart() -> str:
    found = [b for b in _blocks("python") if b.startswith("import specjax\n")]
    assert len(found) == 1, "README.md needs exactly one ```python block starting with 'import specjax'"
    return found[0]


@pytest.mark.smoke
def test_readme_is_short():
    text = _text()
    lines = text.splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines (at most {MAX_LINES})"
    assert len(text) <= MAX_CHARS, f"README.md has {len(text)} characters (at most {MAX_CHARS})"
    long = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > MAX_LINE]
    assert not long, f"README.md lines over {MAX_LINE} characters (line, length): {long}"


@pytest.mark.smoke
def test_install_and_test_commands_are_the_ones_ci_runs():
    install = re.findall(r"^```bash\n(.*?)^```", _section("Install"), re.S | re.M)
    assert install and INSTALL in install[0], f"the Install block lost {INSTALL!r}: {install}"
    assert [b for b in _blocks("bash") if b.strip() == TEST_COMMAND], \
        f"README.md needs a ```bash block that is exactly {TEST_COMMAND!r}"
    assert SMOKE_COMMAND in _text()
    ci = CI.read_text()
    for command in (INSTALL, TEST_COMMAND, SMOKE_COMMAND):
        assert command in ci, f".ci/run no longer runs the README's {command!r}"


@pytest.mark.smoke
def test_quickstart_uses_only_public_names():
    used = set(re.findall(r"\bspecjax\.(\w+)", _quickstart()))
    assert used, "the quickstart uses no specjax name?"
    missing = sorted(used - set(specjax.__all__))
    assert not missing, f"the quickstart uses names not in specjax.__all__: {missing}"


@pytest.mark.smoke
def test_quickstart_runs_as_written():
    """The quickstart, exec'd in a fresh namespace on the CPU (~12 s), prints the decoded text
    and a mean acceptance length above 1 (the trained EAGLE-3 demo head drafts, and some of
    its drafts are accepted)."""
    import jax

    code = _quickstart()
    out = io.StringIO()
    with jax.default_device(jax.devices("cpu")[0]), contextlib.redirect_stdout(out):
        exec(compile(code, str(README), "exec"), {"__name__": "__readme__"})  # noqa: S102 (our own README)
    printed = out.getvalue()
    m = re.search(r"^tokens per target forward:\s*(\S+)\s*\Z", printed, re.M)
    assert m, f"the quickstart did not end with its acceptance line: {printed!r}"
    assert printed[: m.start()].strip(), f"the quickstart printed no decoded text: {printed!r}"
    tau = float(m.group(1))
    assert tau > 1.0, f"mean acceptance length {tau} (the EAGLE-3 demo head should be accepted)"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    s = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return s.replace(" ", "-")


def _anchors(path) -> set[str]:
    text = path.read_text(encoding="utf-8")
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)   # no headings in code
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", text, re.M)}


@pytest.mark.smoke
def test_every_relative_link_exists():
    text = re.sub(r"^```.*?^```", "", _text(), flags=re.S | re.M)
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links, "README.md links nowhere?"
    broken = []
    for link in links:
        if re.match(r"[a-z][a-z0-9+.-]*:", link):       # http(s):, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (README.parent / target) if target else README
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{link} (no heading with that anchor)")
    assert not broken, f"README.md links that lead nowhere: {broken}"
