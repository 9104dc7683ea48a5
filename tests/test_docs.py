"""The documentation's examples run and its links lead somewhere.

Every ```python block of README.md and docs/*.md is read. A block right after the line ``<!-- docs-test -->`` runs
here, in the test process, in a fresh namespace: it sets up its own simulated world (``simulated_world(n)``) or
plans without ranks (``sf.explain(..., world_size=n)``). A block right after ``<!-- docs-test: own process -->``
runs as a script in a process of its own (a world of one: it calls ``sf.init()``, which a test process must not
keep). Unmarked blocks (they need torchrun or mpirun, a GPU, or files they do not make) are only compiled.
Every relative link (and image) of those pages must name a file that exists, and a link into a page a heading of
it.
"""

import linecache
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
MARKS = {"<!-- docs-test -->": "here", "<!-- docs-test: own process -->": "process"}


def _blocks():
    """Every ```python block: (page, first line of its code, the code, how it runs: "here", "process" or None)."""
    found = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        i = 0
        while i < len(lines):
            if lines[i].strip() in MARKS:
                assert i + 1 < len(lines) and lines[i + 1].strip() == "```python", \
                    f"{page.name}:{i + 1}: a docs-test mark must come right before a ```python fence"
            if lines[i].startswith("```python"):
                end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), None)
                assert end is not None, f"{page.name}:{i + 1}: a ```python fence that never closes"
                how = MARKS.get(lines[i - 1].strip()) if i else None
                found.append((page, i + 2, "\n".join(lines[i + 1:end]) + "\n", how))
                i = end
            i += 1
    return found


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if b[3]]


def _name(block) -> str:
    page, line, _, _ = block
    return f"{page.relative_to(ROOT)}:{line}"


def test_the_pages_have_examples_that_run():
    marked = {b[0].name for b in RUN}
    assert "README.md" in marked, "the README's front-page example must be marked <!-- docs-test -->"
    assert len(RUN) >= 8, [_name(b) for b in RUN]


@pytest.mark.parametrize("block", BLOCKS, ids=_name)
def test_every_python_block_compiles(block):
    compile(block[2], _name(block), "exec")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("block", RUN, ids=_name)
def test_example_runs(block, tmp_path):
    page, line, code, how = block
    name = _name(block)
    if how == "here":
        # its source where tracebacks (and capture's errors, which name a file and line) look for it
        linecache.cache[name] = (len(code), None, code.splitlines(True), name)
        try:
            exec(compile(code, name, "exec"), {"__name__": "__docs_example__"})
        finally:
            linecache.cache.pop(name, None)
        return
    script = tmp_path / "example.py"
    script.write_text(code)
    launcher = re.compile(r"(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|"
                          r"OMPI_COMM_WORLD_.*|PMI_.*|SLURM_.*)$")
    env = {k: v for k, v in os.environ.items() if not launcher.match(k)}  # a world of one, whatever runs pytest
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["MASTER_PORT"] = str(_free_port())
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"{name} ended with {done.returncode}:\n{done.stdout}\n{done.stderr[-4000:]}"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip()).lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    anchors, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", _outside_code(page.read_text()), flags=re.M):
        slug = _slug(heading)
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _outside_code(text: str) -> str:
    """The text with its fenced code blocks blanked (their lines kept, so line numbers stay)."""
    return re.sub(r"^```.*?^```", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.M | re.S)


LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(([^)\s]+)\)")


def _links():
    for page in PAGES:
        for target in LINK.findall(_outside_code(page.read_text())):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked
                yield page, target


def test_every_relative_link_names_a_file_that_exists():
    links = list(_links())
    assert len(links) > 20  # the pages link to each other
    broken = []
    for page, target in links:
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(f"{page.relative_to(ROOT)}: {target} (no heading #{anchor} in {file.name})")
    assert not broken, "\n".join(broken)


def test_the_index_lists_every_page():
    index = (ROOT / "docs" / "index.md").read_text()
    listed = {t.partition("#")[0] for t in LINK.findall(index)}
    assert {p.name for p in PAGES if p.parent.name == "docs" and p.name != "index.md"} <= listed
