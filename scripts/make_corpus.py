"""Build the training corpus for the embedded tiny Qwen3.5: the source code of the Python standard library.

Source: the ``.py`` files of the running interpreter's standard library (``sysconfig.get_paths()["stdlib"]``),
distributed under the Python Software Foundation License Version 2 (PSF-2.0). Every kept file is one document:
its source text as it is (code, comments and docstrings in place), with trailing spaces removed and runs of
blank lines cut to two. The files are read as text, never imported. One file is read differently:
``pydoc_data/topics.py`` is generated (a dict holding the text of the Python Language Reference topics that
``help()`` shows); its values are taken as English prose documents, in sorted key order, cut into chunks at
paragraph boundaries.

Files left out (``classify`` says why, ``--list-skipped`` prints them):

- test suites (``test``/``tests``/``idle_test`` folders, ``test_*.py``), ``site-packages``, ``ensurepip``, the
  build-specific ``config-*`` folder and ``_sysconfigdata_*.py``;
- generated files: the charmap codecs in ``encodings/`` (``Python Character Mapping Codec``) and any file whose
  first 15 lines say it is generated (``auto-generated``, ``automatically generated``, ``DO NOT EDIT``, ...);
- two hand-maintained data tables (``DATA_TABLES``);
- every file that is not clearly under the PSF licence: a file that carries a licence grant of its own
  (``Permission to use, copy, modify``, ``Permission is hereby granted``, ``Redistribution and use``, an
  ``SPDX-License-Identifier``, the Apache or MIT licence, ...), or a copyright notice (a line with
  ``copyright`` and a year, ``(c)`` or ``all rights reserved``) that names neither the Python Software
  Foundation nor says the file is ``Licensed to (the) PSF under a Contributor Agreement``;
- files shorter than ``MIN_CHARS`` after the whitespace clean-up, and exact duplicates of an earlier file.

Documents are written one after another, each followed by the literal text ``<|endoftext|>`` (the tokenizer's
end-of-text special token, so that a model trained on it learns where a document stops).

Reproducibility: files are visited in sorted path order and the train / held-out split is a seeded shuffle of
the file list (whole files go to one split). The text depends on the Python version (the shipped corpus was built
with CPython 3.11.7); the script prints the Python version and the SHA-256 of both splits, to compare with
``data/SOURCE.md``.

Usage::

    python scripts/make_corpus.py                  # writes data/train.txt (git-ignored) and data/heldout.txt
    python scripts/make_corpus.py --out-dir /tmp/c --seed 0 --heldout-bytes 100000
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

EOS = "<|endoftext|>"

# Directory names skipped anywhere in the tree: test suites, installed third-party packages, bundled wheels,
# caches and compiled extension modules.
SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__", "_bundled", "ensurepip",
             "lib-dynload"}
MIN_CHARS = 80  # an empty __init__.py or a one-line re-export teaches nothing
DATA_TABLES = {"html/entities.py", "encodings/aliases.py"}  # large dict literals, not code
TOPICS_FILE = "pydoc_data/topics.py"
TOPIC_CHUNK = 3000  # characters per chunk of a pydoc topic

GENERATED = re.compile(
    r"auto-?generated|automatically generated|do not edit|character mapping codec|generated and used by", re.I
)
LICENCE_GRANT = re.compile(
    r"permission to use, copy, modify|permission is hereby granted|redistribution and use|spdx-license"
    r"|apache license|mit license|provided 'as-is'|under the same terms as",
    re.I,
)
NOTICE = re.compile(r"copyright", re.I)
NOTICE_MARK = re.compile(r"\b(1[89]|20)\d\d\b|\(c\)|all rights reserved", re.I)
CONTRIBUTOR = re.compile(r"licensed to (the )?psf under a contributor agreement", re.I)


def stdlib_files(root: Path) -> list[Path]:
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS or part.startswith("config-") for part in rel.parts[:-1]):
            continue
        if rel.name.startswith("test_"):
            continue
        files.append(path)
    return files


def classify(name: str, text: str) -> str | None:
    """Why a standard-library file is left out of the corpus, or None to keep it."""
    if name in DATA_TABLES:
        return "data table"
    if name.startswith("_sysconfigdata_"):
        return "build-specific"
    if GENERATED.search("\n".join(text.splitlines()[:15])):
        return "generated"
    if LICENCE_GRANT.search(text):
        return "own licence"
    contributor = CONTRIBUTOR.search(text) is not None
    for line in text.splitlines():
        if NOTICE.search(line) and NOTICE_MARK.search(line):
            if "python software foundation" not in line.lower() and not contributor:
                return "non-PSF copyright"
    return None


def clean_code(text: str) -> str:
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    text = "\n".join(lines).strip("\n")
    return re.sub(r"\n{4,}", "\n\n\n", text) + "\n"  # at most two blank lines in a row


TYPOGRAPHY = str.maketrans({"\u2018": "'", "\u2019": "'", "\u201c": '"', "\u201d": '"', "\u2013": "-",
                            "\u2014": "--", "\u2026": "...", "\u00a0": " "})


def clean_prose(doc: str) -> str | None:
    doc = inspect.cleandoc(doc).translate(TYPOGRAPHY)
    lines = [line.rstrip() for line in doc.splitlines()]
    text = "\n".join(line for line in lines if line.strip()).strip()
    if not text.isascii() or len(text) < MIN_CHARS:
        return None
    return text + "\n"


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
                text = clean_prose("\n".join(chunk)) if chunk else None
                if text:
                    out.append(text)
                chunk = []
            if para is not None:
                chunk.append(para)
    return out


def join(docs: list[str]) -> str:
    return "".join(d + EOS for d in docs)


def build(seed: int, heldout_bytes: int, root: Path | None = None) -> tuple[str, str, dict]:
    root = Path(root or sysconfig.get_paths()["stdlib"])
    per_file: dict[str, list[str]] = {}
    skipped: dict[str, str] = {}
    seen: set[str] = set()
    for path in stdlib_files(root):
        name = path.relative_to(root).as_posix()
        if name == TOPICS_FILE:
            per_file[name] = topic_chunks(path)
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            skipped[name] = "not UTF-8"
            continue
        why = classify(name, text)
        text = clean_code(text)
        if why is None and len(text) < MIN_CHARS:
            why = "too short"
        if why is None and text in seen:
            why = "duplicate"
        if why:
            skipped[name] = why
            continue
        seen.add(text)
        per_file[name] = [text]

    names = sorted(per_file)
    order = names[:]
    random.Random(seed).shuffle(order)
    heldout_names, size = [], 0
    for name in order:
        n = len(join(per_file[name]).encode())
        if size + n <= heldout_bytes:
            heldout_names.append(name)
            size += n
        if size >= heldout_bytes * 0.97:
            break
    heldout_set = set(heldout_names)
    train_names = [n for n in names if n not in heldout_set]

    train_docs = [d for n in train_names for d in per_file[n]]
    heldout_docs = [d for n in sorted(heldout_names) for d in per_file[n]]
    train, heldout = join(train_docs), join(heldout_docs)
    license_file = root / "LICENSE.txt"
    info = {
        "python": sys.version.split()[0],
        "stdlib": str(root),
        "stdlib_license_sha256": hashlib.sha256(license_file.read_bytes()).hexdigest()
        if license_file.exists() else None,
        "files_kept": len(names),
        "files_skipped": len(skipped),
        "skipped_by_reason": {r: sum(1 for v in skipped.values() if v == r) for r in sorted(set(skipped.values()))},
        "files_heldout": sorted(heldout_names),
        "train_documents": len(train_docs),
        "heldout_documents": len(heldout_docs),
        "train_bytes": len(train.encode()),
        "heldout_bytes": len(heldout.encode()),
        "train_sha256": hashlib.sha256(train.encode()).hexdigest(),
        "heldout_sha256": hashlib.sha256(heldout.encode()).hexdigest(),
        "skipped": skipped,
    }
    return train, heldout, info


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default=str(Path(__file__).resolve().parents[1] / "data"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--heldout-bytes", type=int, default=100_000)
    ap.add_argument("--stdlib", default=None, help="standard library folder (default: this interpreter's)")
    ap.add_argument("--list-skipped", action="store_true", help="print every left-out file with the reason")
    args = ap.parse_args(argv)
    train, heldout, info = build(args.seed, args.heldout_bytes, args.stdlib)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train.txt").write_text(train, encoding="utf-8")
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    for k, v in info.items():
        if k == "files_heldout":
            print(f"{k}: {len(v)} files: {', '.join(v)}")
        elif k == "skipped":
            if args.list_skipped:
                for name, why in v.items():
                    print(f"skipped: {name} ({why})")
        else:
            print(f"{k}: {v}")


if __name__ == "__main__":
    main()
