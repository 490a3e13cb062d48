"""README.md's "Layout" section lists every tracked file, by folder: its counts are those of `git ls-files`."""
from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def layout_block(readme: str) -> list[str]:
    """The lines of the code block in the README's "## Layout" section."""
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```\n", 2)[1].rstrip("\n").splitlines()


def folder_counts(files: list[str], folders: list[str]) -> Counter[str]:
    """Files per listed folder: each file counts for the deepest listed folder it is in ("." for the rest)."""
    deepest_first = sorted((f for f in folders if f != "."), key=len, reverse=True)
    return Counter(next((f for f in deepest_first if path.startswith(f)), ".") for path in files)


def tracked_files() -> list[str]:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (or no git here): nothing to count the README's layout against")
    return subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()


def test_readme_layout_matches_the_tracked_files() -> None:
    files = tracked_files()
    lines = layout_block((ROOT / "README.md").read_text())
    total = re.fullmatch(r"(\d+) files \(git ls-files\)", lines[0])
    rows = [re.match(r"(\S+)\s+(\d+)\b", line) for line in lines[1:]]
    assert total and all(rows), "the layout block: a total line, then one 'folder count what' line per folder"
    listed = {m.group(1): int(m.group(2)) for m in rows if m}
    counts = folder_counts(files, list(listed))
    expected = "\n".join([f"{len(files)} files (git ls-files)"] + [f"{f} {counts[f]}" for f in listed]
                         + [f"(not listed: {f})" for f in counts if f not in listed])
    assert int(total.group(1)) == len(files) and listed == dict(counts), f"README's layout should read:\n{expected}"


def test_a_file_counts_for_the_deepest_folder_listed() -> None:
    files = ["README.md", "mla_verify/a.py", "mla_verify/backends/b.py", "results/x/y/z.json", "archive/old.py"]
    counts = folder_counts(files, [".", "mla_verify/", "mla_verify/backends/", "results/x/"])
    assert counts == {".": 2, "mla_verify/": 1, "mla_verify/backends/": 1, "results/x/": 1}  # archive/ lands in "."
