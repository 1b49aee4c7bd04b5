"""The docs name only what exists: repository paths, and methods of moetrace's classes.

docs/contributing.md pointed at ``ModelRunner._set_kernel_paths`` and
docs/distributed.md at ``tests/test_shards.py`` after both were renamed.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
# Paths in other projects' repositories that the docs cite as such.
ELSEWHERE = {"tests/entrypoints/openai/test_return_routed_experts.py"}
PATH = re.compile(r"(?<![\w/.])((?:moetrace|tests|benchmarks|tools|docs|examples)/[\w./*-]*[\w*])")
DOTTED = re.compile(r"`([A-Z]\w*)\.(\w+)(?:\(\))?`")


def _classes() -> dict[str, set[str]]:
    """Every class of the package with the names its body defines or assigns on self."""
    out: dict[str, set[str]] = {}
    for py in (ROOT / "moetrace").rglob("*.py"):
        for node in ast.walk(ast.parse(py.read_text())):
            if isinstance(node, ast.ClassDef):
                names = out.setdefault(node.name, set())
                for sub in ast.walk(node):
                    if isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef):
                        names.add(sub.name)
                    elif isinstance(sub, ast.Name):
                        names.add(sub.id)
                    elif isinstance(sub, ast.Attribute):
                        names.add(sub.attr)
    return out


def test_every_repository_path_in_the_docs_exists():
    missing = []
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for match in PATH.finditer(line):
                path = match.group(1)
                if path in ELSEWHERE or "<" in line[match.end() : match.end() + 1]:
                    continue  # a placeholder: tests/test_parity_<family>.py
                if not (ROOT / path).exists() and not list(ROOT.glob(path)):
                    missing.append(f"{doc.name}:{lineno}: {path}")
    assert missing == []


def test_every_method_named_on_a_moetrace_class_exists():
    classes = _classes()
    missing = []
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for cls, attr in DOTTED.findall(line):
                if cls in classes and attr not in classes[cls]:
                    missing.append(f"{doc.name}:{lineno}: {cls}.{attr}")
    assert missing == []


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _headings(doc: Path) -> set[str]:
    """The anchors of a doc's headings (lines in code fences are not headings)."""
    out, fenced = set(), False
    for line in doc.read_text().splitlines():
        fenced ^= line.startswith("```")
        if not fenced and (match := re.match(r"#+ (.+)$", line)):
            out.add(_anchor(match.group(1)))
    return out


def test_every_link_into_a_doc_names_one_of_its_headings():
    anchors = {doc.name: _headings(doc) for doc in DOCS}
    missing = []
    for doc in DOCS:
        for lineno, line in enumerate(doc.read_text().splitlines(), 1):
            for target, anchor in re.findall(r"\]\(((?:docs/)?[\w-]+\.md)?#([\w-]+)\)", line):
                name = Path(target).name if target else doc.name
                if anchor not in anchors.get(name, set()):
                    missing.append(f"{doc.name}:{lineno}: {target}#{anchor}")
    assert missing == []
