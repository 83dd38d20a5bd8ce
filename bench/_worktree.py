"""A baseline revision's tree for the A/B benchmarks: a detached git worktree with this tree's
built native files copied in (they are git-ignored, so a checkout has none)."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def natives(tree: Path) -> list[str]:
    """The tree's built, git-ignored native files (``factory/**/*.so`` and their manifests)."""
    listed = subprocess.run(["git", "ls-files", "-o", "-i", "--exclude-standard", "factory"],
                            cwd=tree, capture_output=True, text=True, check=True).stdout
    return [p for p in listed.split() if p.endswith((".so", "_native.json"))]


@contextlib.contextmanager
def baseline_tree(rev: str, *, prefix: str = "factory-bench-baseline-") -> Iterator[Path]:
    """A detached git worktree of ``rev`` with this tree's natives, removed on exit.

    The natives are built from this tree's sources; ``factory.native`` loads them only where
    the baseline's sources hash the same, and the baseline's ``.py`` otherwise."""
    tree = Path(tempfile.mkdtemp(prefix=prefix))
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT, check=True,
                   capture_output=True)
    try:
        for rel in natives(ROOT):
            (tree / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, tree / rel)
        yield tree
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                       capture_output=True)
