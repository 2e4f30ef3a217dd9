"""The README is the entry point: its relative links (and those of docs/) resolve, it stays short, it
keeps the two commands, and every shell block it marks runnable runs."""
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
MAX_README_LINES = 250
SETUP_COMMAND = ("sudo apt-get install -y python3.11-venv build-essential redis-server && python3.11 -m venv .venv"
                 " && . .venv/bin/activate && pip install torch==2.13.0 && pip install -e . && pagedserve serve")
TEST_COMMAND = "bash .ci/run"
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^(`{3,}|~{3,})")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def prose_lines(text: str) -> list[str]:
    """The page's lines outside fenced code blocks (a `#` in a shell block is no heading, `[x](y)` no link)."""
    lines, fence = [], None
    for line in text.splitlines():
        match = FENCE.match(line)
        if match and (fence is None or match.group(1).startswith(fence)):
            fence = None if fence else match.group(1)[:3]
        elif fence is None:
            lines.append(line)
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (word characters, '-', ' ' kept),
    spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    for line in prose_lines(page.read_text()):
        if match := HEADING.match(line):
            base = slug(match.group(1))
            count = seen.get(base, 0)
            seen[base] = count + 1
            if count:
                seen[f"{base}-{count}"] = 1
    return set(seen)


def relative_links(page: Path) -> list[str]:
    return [target for line in prose_lines(page.read_text()) for target in LINK.findall(line)
            if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_to_an_existing_file_and_heading(page: Path) -> None:
    broken = []
    for target in relative_links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)}: " + "; ".join(broken)


def test_the_readme_is_short_and_keeps_the_two_commands() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= MAX_README_LINES
    for command in (SETUP_COMMAND, TEST_COMMAND):
        assert f"```bash\n{command}\n```" in text, command
    assert (ROOT / ".ci" / "run").is_file()


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_page_names_an_issue_number(page: Path) -> None:
    assert not re.findall(r"\bissues?\s*#?\d+|(?:^|\s)#\d+\b", page.read_text(), flags=re.I)


def runnable_blocks(text: str) -> list[str]:
    """The bodies of the ```bash blocks that directly follow a `<!-- runnable -->` line."""
    lines, blocks = text.splitlines(), []
    for i, line in enumerate(lines):
        if line.strip() != RUNNABLE:
            continue
        assert lines[i + 1] == "```bash", f"README line {i + 2}: {RUNNABLE} must precede a ```bash block"
        end = lines.index("```", i + 2)
        blocks.append("\n".join(lines[i + 2:end]) + "\n")
    return blocks


BLOCKS = runnable_blocks(README.read_text())


def test_the_readme_marks_runnable_blocks() -> None:
    assert BLOCKS


@pytest.mark.parametrize("block", BLOCKS, ids=[b.splitlines()[0][:40] for b in BLOCKS])
def test_a_runnable_readme_block_runs(block: str, tmp_path: Path) -> None:
    script = tmp_path / "block.sh"
    script.write_text(block)
    # The interpreter running the tests (its venv's `python` and `pagedserve` first), this tree's code,
    # and a demo checkpoint of its own.
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
           "PAGEDSERVE_DEMO_MODEL_DIR": str(tmp_path / "demo-model")}
    done = subprocess.run(["bash", "-e", str(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=180)
    assert done.returncode == 0, f"{block}\nstdout:\n{done.stdout[-2000:]}\nstderr:\n{done.stderr[-2000:]}"
