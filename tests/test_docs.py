"""The examples in README.md, docs/ and the public docstrings run.

Every ```python block of a Markdown page runs, in page order, in one namespace
per page (a page may build on its earlier blocks). A block that is only a
fragment is marked with an HTML comment on the line before it, which the built
site does not show:

    <!-- skip -->
    ```python
    def handler(interpreter, ctx, eqn, invals) -> HandlerResult(ctx, outvals)
    ```

Code that a page's fragments need but that would distract the reader (a sample
`f` and `x`) goes in a hidden setup comment, which runs where it stands:

    <!-- test-setup
    x = jnp.ones(3)
    -->

A block that uses a library of the `ecosystem` extra says so on the line
before it, `<!-- needs diffrax -->`, and runs where that library is installed.

A block that is a whole program for several processes says so on its first
line, `# NAME.py: run as `python NAME.py PROCESS_ID PORT``; it runs as two local
processes that must agree on what they print (a `multiprocess` test).

Tracebacks point at the Markdown file and line. Docstring examples (the
```python blocks that the API reference renders) run one by one.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
PUBLIC_MODULES = [
    "kups.effects",
    "kups.effects.handlers",
    "kups.harvest",
    "kups.instrument",
    "kups.checks",
    "kups.debug",
]
# Docstring examples that are fragments (they use names they do not define).
FRAGMENTS: set[str] = set()


@dataclasses.dataclass
class Block:
    line: int  # 1-based line of the first line of code
    code: str
    kind: str  # "python", "setup", "skip" or "script"


_FENCE = re.compile(r"^(?P<indent>\s*)```(?P<info>[^\n`]*)$")
_NEEDS = re.compile(r"^<!-- needs (?P<module>[\w.]+) -->$")
_SCRIPT = re.compile(r"^# (?P<name>\w+\.py): run as `python (?P=name) PROCESS_ID PORT`")


def blocks_of(text: str) -> list[Block]:
    """The code blocks and hidden setup comments of a Markdown page, in order."""
    lines = text.splitlines()
    blocks: list[Block] = []
    previous = ""  # the last non-blank line before the current one
    i = 0
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if stripped.startswith("<!-- test-setup"):
            end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "-->")
            blocks.append(Block(i + 2, textwrap.dedent("\n".join(lines[i + 1 : end])), "setup"))
            i = end + 1
            continue
        fence = _FENCE.match(line)
        if fence:
            indent, info = fence["indent"], fence["info"].strip()
            end = next(
                j for j in range(i + 1, len(lines)) if lines[j].strip() == "```"
            )  # a fence without its end is a broken page: StopIteration fails the test
            if info == "python":
                body = [
                    body_line[len(indent) :] if body_line.startswith(indent) else body_line
                    for body_line in lines[i + 1 : end]
                ]
                kind = "skip" if previous == "<!-- skip -->" else "python"
                needs = _NEEDS.match(previous)
                if needs:
                    kind = f"needs {needs['module']}"
                if body and _SCRIPT.match(body[0]):
                    kind = "script"
                blocks.append(Block(i + 2, "\n".join(body), kind))
            previous = "```"
            i = end + 1
            continue
        if stripped:
            previous = stripped
        i += 1
    return blocks


def run_blocks(path: Path, blocks: list[Block]) -> None:
    namespace: dict[str, object] = {"__name__": f"docs_{path.stem}"}
    for block in blocks:
        if block.kind in ("skip", "script"):
            continue
        # An example of a library of the ecosystem extra runs where the library
        # is installed (CI's newest-JAX stage installs them all).
        needs = block.kind.removeprefix("needs ")
        if needs != block.kind and importlib.util.find_spec(needs) is None:
            continue
        # Padding makes tracebacks show the Markdown file's own line numbers.
        source = "\n" * (block.line - 1) + block.code
        exec(compile(source, str(path), "exec", dont_inherit=True), namespace)


def page_id(path: Path) -> str:
    return str(path.relative_to(ROOT))


@pytest.mark.parametrize("path", PAGES, ids=page_id)
def test_page_examples_run(path):
    run_blocks(path, blocks_of(path.read_text(encoding="utf-8")))


def test_pages_have_examples():
    runnable = {
        page_id(path): sum(b.kind == "python" for b in blocks_of(path.read_text(encoding="utf-8")))
        for path in PAGES
    }
    for page in ["README.md", "docs/tour.md", "docs/sharp-bits.md", "docs/effects/harvest.md"]:
        assert runnable[page] > 0, f"{page} has no runnable example"
    assert sum(runnable.values()) >= 40


def test_readme_starts_with_the_two_quick_start_commands():
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    commands = re.findall(r"```bash\n(.*?)\n```", text, re.S)
    assert commands[:2] == [
        "python3.11 -m venv .venv && . .venv/bin/activate && pip install -e . && python -m kups",
        'python3.11 -m venv .venv && . .venv/bin/activate && pip install -e ".[dev]" && bash .ci/test',
    ]
    assert text.index(commands[0]) < text.index("```python")


def test_blocks_of_reads_skips_setups_and_indented_fences():
    page = textwrap.dedent(
        """\
        Text.
        <!-- skip -->
        ```python
        not python
        ```

        <!-- test-setup
        x = 1
        -->
        - item

            ```python
            y = x + 1
            ```
        ```bash
        echo hi
        ```
        ```python
        z = y
        ```
        <!-- needs diffrax -->
        ```python
        import diffrax
        ```
        """
    )
    blocks = blocks_of(page)
    assert [(b.kind, b.code) for b in blocks] == [
        ("skip", "not python"),
        ("setup", "x = 1"),
        ("python", "y = x + 1"),
        ("python", "z = y"),
        ("needs diffrax", "import diffrax"),
    ]
    assert blocks[2].line == 13


def _docstring_examples() -> list[tuple[str, str]]:
    examples: dict[str, str] = {}
    seen: set[int] = set()
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        objects = [(module_name, module)]
        objects += [(f"{module_name}.{name}", getattr(module, name)) for name in module.__all__]
        for name, obj in list(objects):
            if inspect.isclass(obj):
                objects += [
                    (f"{name}.{attr}", value)
                    for attr, value in vars(obj).items()
                    if not attr.startswith("_")
                    and (inspect.isfunction(value) or isinstance(value, property))
                ]
        for name, obj in objects:
            target = obj.fget if isinstance(obj, property) else obj
            doc = inspect.getdoc(target)
            if not doc or id(target) in seen:
                continue
            seen.add(id(target))
            found = re.findall(r"^( *)```python\n(.*?)^\1```", doc, re.S | re.M)
            for i, (_, code) in enumerate(found):
                examples[name if i == 0 else f"{name}#{i}"] = textwrap.dedent(code)
    return sorted(examples.items())


DOCSTRING_EXAMPLES = _docstring_examples()


@pytest.mark.parametrize(
    ("name", "code"),
    [
        pytest.param(
            name,
            code,
            marks=pytest.mark.xfail(strict=True, reason="a fragment: uses names it does not define")
            if name in FRAGMENTS
            else (),
        )
        for name, code in DOCSTRING_EXAMPLES
    ],
    ids=[name for name, _ in DOCSTRING_EXAMPLES],
)
def test_docstring_examples_run(name, code):
    exec(
        compile(code, f"<docstring of {name}>", "exec", dont_inherit=True),
        {"__name__": "docstring_example"},
    )


def test_docstring_examples_found():
    assert len(DOCSTRING_EXAMPLES) >= 10


SCRIPTS = [
    (path, block)
    for path in PAGES
    for block in blocks_of(path.read_text(encoding="utf-8"))
    if block.kind == "script"
]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "block"), SCRIPTS, ids=[f"{page_id(p)}:{b.line}" for p, b in SCRIPTS]
)
def test_multiprocess_scripts_run(path, block, tmp_path):
    script = tmp_path / _SCRIPT.match(block.code)["name"]  # pyright: ignore[reportOptionalSubscript]
    script.write_text(block.code, encoding="utf-8")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
    logs = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(2)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with out.open("w") as out_file, err.open("w") as err_file:
            procs.append(
                subprocess.Popen(
                    [sys.executable, str(script), str(i), str(port)],
                    stdout=out_file,
                    stderr=err_file,
                    env=env,
                    cwd=tmp_path,
                )
            )
    try:
        codes = [proc.wait(timeout=150) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    outputs = [out.read_text() for out, _ in logs]
    report = "\n".join(
        f"--- process {i}: {out}{err.read_text()[-4000:]}"
        for i, ((_, err), out) in enumerate(zip(logs, outputs))
    )
    assert codes == [0, 0], report
    # Every process prints its id first, then what must be the same everywhere.
    lines = [out.strip().splitlines()[-1].split(maxsplit=1) for out in outputs]
    assert [line[0] for line in lines] == ["0", "1"], report
    assert lines[0][1] == lines[1][1], report


def _heading_anchors(path: Path) -> set[str]:
    """The ids mkdocs' toc gives the headings of a page (Python-Markdown's slugify)."""
    anchors = set()
    for block in re.split(r"^```.*?^```", path.read_text(encoding="utf-8"), flags=re.S | re.M):
        for heading in re.findall(r"^#{1,6} (.+)$", block, re.M):
            text = re.sub(r"[^\w\s-]", "", heading.replace("`", "")).strip().lower()
            anchors.add(re.sub(r"[-\s]+", "-", text))
    return anchors


def test_links_to_a_section_find_its_heading():
    links = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        links += [
            (page, target, anchor)
            for target, anchor in re.findall(r"\]\(([\w/.-]+\.md)#([\w-]+)\)", text)
        ]
    assert any(anchor == "jax-releases" for _, _, anchor in links)
    for page, target, anchor in links:
        assert anchor in _heading_anchors(page.parent / target), (
            f"{page_id(page)} links {target}#{anchor}"
        )


def test_define_effect_tutorial_builds_a_short_checkify_class_effect_from_public_names():
    """docs/concepts/define-effect.md: its effect is at most 50 lines of code, uses
    only public kups names, links the cookbook's gradient tap, and (run by
    test_page_examples_run) reports what kups.checks reports."""
    text = (ROOT / "docs" / "concepts" / "define-effect.md").read_text(encoding="utf-8")
    (effect,) = [b for b in blocks_of(text) if b.kind == "python" and "def my_checked" in b.code]
    code_lines = [line for line in effect.code.splitlines() if line.strip()]
    assert len(code_lines) <= 50, len(code_lines)
    assert not re.search(r"kups[.\w]*\._|import _|\._compat", effect.code)
    assert "../cookbook.md#a-gradient-tap" in text


def test_sharp_bits_counts_of_the_demo_are_the_running_releases():
    """docs/sharp-bits.md gives the demo's `convert_element_type` per shard and step
    and its total for two JAX releases; on those releases the demo prints them."""
    text = (ROOT / "docs" / "sharp-bits.md").read_text(encoding="utf-8")
    said = re.search(
        r"runs (\d+)\s+`convert_element_type` on JAX ([\d.]+) and (\d+) on JAX ([\d.]+)\s+"
        r"\(([\d,]+) primitives in\s+all against ([\d,]+)\)",
        text,
    )
    assert said, "sharp-bits.md no longer says the demo's counts in the form this test reads"
    casts = {said[2]: int(said[1]), said[4]: int(said[3])}
    totals = {said[2]: int(said[5].replace(",", "")), said[4]: int(said[6].replace(",", ""))}
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}
    demo = subprocess.run(
        [sys.executable, "-m", "kups", "--section", "counts", "--no-color"],
        capture_output=True,
        text=True,
        env=env,
        timeout=240,
        check=False,
    )
    assert demo.returncode == 0, demo.stdout + demo.stderr
    version = re.search(r"\(jax ([\d.]+),", demo.stdout)
    cast_row = re.search(r"^\s+convert_element_type\s+(\d+)\s", demo.stdout, re.M)
    total = re.search(r"^\s+(\d+) primitives ran:", demo.stdout, re.M)
    assert version and cast_row and total, demo.stdout
    if version[1] in casts:  # the releases the page names
        assert int(cast_row[1]) == casts[version[1]], demo.stdout
        assert int(total[1]) == totals[version[1]], demo.stdout
    else:
        assert int(cast_row[1]) > 0 and int(total[1]) > 0, demo.stdout
