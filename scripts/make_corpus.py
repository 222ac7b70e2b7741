"""Build the training corpus for the embedded tiny Qwen3.5: docstrings of the Python standard library.

Source: the ``.py`` files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
distributed under the Python Software Foundation License Version 2 (PSF-2.0). The files are parsed with ``ast``
(never imported), and the module, class and function docstrings are taken in source order. One file is read
differently: ``pydoc_data/topics.py`` holds the text of the Python Language Reference topics that ``help()``
shows (a dict of strings, same licence); its values are taken in sorted key order, cut into chunks at paragraph
boundaries.

Reproducibility: files are visited in sorted path order, the train / held-out split is a seeded shuffle of the
file list, and docstrings are de-duplicated exactly (a docstring already seen is dropped; held-out files never
repeat a docstring that also occurs in a train file). The text depends on the Python version (the shipped corpus
was built with CPython 3.11.7); the script prints the Python version and the SHA-256 of both splits, to compare
with ``data/SOURCE.md``.

Usage::

    python scripts/make_corpus.py                  # writes data/train.txt (git-ignored) and data/heldout.txt
    python scripts/make_corpus.py --out-dir /tmp/c --seed 0 --heldout-bytes 100000

Output format: UTF-8 plain text, one docstring after another, separated by one blank line; blank lines inside a
docstring are removed so that the blank line only ever separates docstrings.
"""

import argparse
import ast
import hashlib
import inspect
import random
import re
import sys
import sysconfig
from pathlib import Path

# Directory names skipped anywhere in the tree: test suites (mostly code fragments and fixtures), installed
# third-party packages, bundled wheels and caches.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled", "ensurepip"}
MIN_CHARS = 40  # shorter docstrings ("Return self.") are mostly boilerplate
MAX_CHARS = 6000  # a few huge module docstrings (tables, long licences) would dominate a split


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


TYPOGRAPHY = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                            "\u2014": "--", "\u2026": "...", "\u00a0": " "})
TOPICS_FILE = "pydoc_data/topics.py"
TOPIC_CHUNK = 3000  # characters per chunk of a pydoc topic


def clean(doc: str) -> str | None:
    doc = inspect.cleandoc(doc).translate(TYPOGRAPHY)
    lines = [line.rstrip() for line in doc.splitlines()]
    text = "\n".join(line for line in lines if line.strip())
    if not text.isascii():
        # keep the corpus to English/ASCII; drops a handful of docstrings with non-ASCII examples
        return None
    text = re.sub(r"[ \t]+\n", "\n", text).strip()
    if len(text) < MIN_CHARS or len(text) > MAX_CHARS:
        return None
    if "copyright" in text.lower() or "licen" in text.lower()[:200]:
        return None  # leave licence boilerplate out of the prose
    return text


def docstrings(path: Path) -> list[str]:
    try:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    except (SyntaxError, UnicodeDecodeError, ValueError):
        return []
    out = []
    nodes = [tree] + [
        n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
    ]
    # ast.walk is breadth-first; order by position in the file so the text reads in source order
    nodes.sort(key=lambda n: (getattr(n, "lineno", 0), getattr(n, "col_offset", 0)))
    for node in nodes:
        doc = ast.get_docstring(node, clean=False)
        if doc:
            text = clean(doc)
            if text:
                out.append(text)
    return out


def topic_chunks(path: Path) -> list[str]:
    """The pydoc topics (``topics = {...}`` in ``pydoc_data/topics.py``), read with ``ast.literal_eval``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    topics = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "topics" for t in node.targets):
            topics = ast.literal_eval(node.value)
    out = []
    seen: set[str] = set()  # several topics repeat whole sections of others; keep each paragraph once
    for key in sorted(topics):
        paragraphs = []
        for p in re.split(r"\n\s*\n", topics[key]):
            if p.strip() and p.strip() not in seen:
                seen.add(p.strip())
                paragraphs.append(p)
        chunk: list[str] = []
        for para in paragraphs + [None]:
            if para is None or (chunk and sum(len(c) for c in chunk) + len(para) > TOPIC_CHUNK):
                text = clean("\n".join(chunk)) if chunk else None
                if text:
                    out.append(text)
                chunk = []
            if para is not None:
                chunk.append(para)
    return out


def build(seed: int, heldout_bytes: int, root: Path | None = None) -> tuple[str, str, dict]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    per_file = {}
    for p in files:
        name = p.relative_to(root).as_posix()
        per_file[name] = topic_chunks(p) if name == TOPICS_FILE else docstrings(p)
    names = sorted(n for n, d in per_file.items() if d)
    order = names[:]
    random.Random(seed).shuffle(order)

    heldout_names, size = [], 0
    for name in order:
        n = sum(len(d) + 2 for d in per_file[name])
        if size + n <= heldout_bytes:
            heldout_names.append(name)
            size += n
        if size >= heldout_bytes * 0.97:
            break
    heldout_set = set(heldout_names)
    train_names = [n for n in names if n not in heldout_set]

    seen: set[str] = set()
    train_docs = []
    for name in train_names:  # sorted path order
        for d in per_file[name]:
            if d not in seen:
                seen.add(d)
                train_docs.append(d)
    heldout_docs = []
    for name in sorted(heldout_names):
        for d in per_file[name]:
            if d not in seen:
                seen.add(d)
                heldout_docs.append(d)

    train = "\n\n".join(train_docs) + "\n"
    heldout = "\n\n".join(heldout_docs) + "\n"
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "files_total": len(names),
        "files_heldout": sorted(heldout_names),
        "train_docstrings": len(train_docs),
        "heldout_docstrings": len(heldout_docs),
        "train_bytes": len(train.encode()),
        "heldout_bytes": len(heldout.encode()),
        "train_sha256": hashlib.sha256(train.encode()).hexdigest(),
        "heldout_sha256": hashlib.sha256(heldout.encode()).hexdigest(),
    }
    return train, heldout, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "data"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-bytes", type=int, default=100_000)
    ap.add_argument("--stdlib", default=None, help="standard library folder (default: this interpreter's)")
    args = ap.parse_args(argv)
    train, heldout, info = build(args.seed, args.heldout_bytes, args.stdlib)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(train, encoding="utf-8")
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    for k, v in info.items():
        if k == "files_heldout":
            print(f"{k}: {len(v)} files: {', '.join(v)}")
        else:
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
