"""Push a folder built by scripts/build_repo.py to the Hugging Face Hub, in one commit, only once it is verified.

    python scripts/push_to_hub.py out/my-model org/my-model --dry-run      # print the exact operations, call nothing
    python scripts/push_to_hub.py out/my-model org/my-model --private
    python scripts/push_to_hub.py out/my-model org/my-model --branch fused-v2   # created when missing

- Only an allowlist is uploaded: the code files, config.json, generation_config.json, *.safetensors and their
  index, tokenizer / chat-template / processor files, README.md, verification.json, and PNG charts that README.md
  shows. Everything else (hidden files, folders, caches, tokens, stray files) is skipped and listed.
- The push is refused when verification.json is missing or failed, or when a file it vouches for (weights, config,
  code, tokenizer) was changed, added or removed since.
- The commit message carries the verification summary.
- The token comes from huggingface_hub's usual sources (``HF_TOKEN``, ``hf auth login``); it is never an argument
  and never printed.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

CODE_FILES = ("configuration_qwen3_5_fused.py", "modeling_qwen3_5_fused.py", "fused_ops.py", "fused_ops_runtime.py",
              "fused_ops_norm.py", "fused_ops_attention.py", "fused_ops_deltanet.py", "fused_ops_gemv.py")
CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
CARD_FILE = "README.md"
VERIFICATION_FILE = "verification.json"
# Without these a push makes no usable, checked repo.
REQUIRED_FILES = CODE_FILES + ("config.json", CARD_FILE, VERIFICATION_FILE)
HASH_CHUNK = 1 << 24


class PushRefused(RuntimeError):
    """The folder may not be pushed (verification missing / failed / stale, or a required file absent)."""


def _vouched(name: str) -> bool:
    """Files whose content verification.json vouches for (by hash)."""
    return (name in CODE_FILES or name in CONFIG_FILES or name == WEIGHT_INDEX or name.endswith(".safetensors")
            or name in TOKENIZER_FILES or name in PROCESSOR_FILES)


def hashed_files(folder) -> list[str]:
    """The vouched-for files present in ``folder`` (README.md, verification.json and charts may change later)."""
    return sorted(e.name for e in os.scandir(folder)
                  if e.is_file(follow_symlinks=False) and not e.name.startswith(".") and _vouched(e.name))


def sha256_files(folder, names) -> dict[str, str]:
    """``{name: sha256 hex}``, with one progress bar over all bytes."""
    folder = Path(folder)
    total = sum((folder / n).stat().st_size for n in names)
    out = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="Hashing files") as bar:
        for name in names:
            digest = hashlib.sha256()
            with open(folder / name, "rb") as f:
                while chunk := f.read(HASH_CHUNK):
                    digest.update(chunk)
                    bar.update(len(chunk))
            out[name] = digest.hexdigest()
    return out


def select_files(folder) -> tuple[list[str], list[tuple[str, str]]]:
    """Split the top level of ``folder`` into (files to upload, [(skipped name, why)])."""
    folder = Path(folder)
    card = (folder / CARD_FILE).read_text() if (folder / CARD_FILE).is_file() else ""
    upload, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        name = entry.name
        if name.startswith("."):
            skipped.append((name, "hidden"))
        elif entry.is_symlink():
            skipped.append((name, "symbolic link"))
        elif entry.is_dir():
            skipped.append((name, "folder"))
        elif _vouched(name) or name in (CARD_FILE, VERIFICATION_FILE):
            upload.append(name)
        elif name.lower().endswith(".png") and f"({name})" in card:
            upload.append(name)
        elif name.lower().endswith(".png"):
            skipped.append((name, "chart not shown in README.md"))
        else:
            skipped.append((name, "not in the allowlist"))
    return upload, skipped


def check_verification(folder) -> dict:
    """The verification result of ``folder``, or ``PushRefused`` when it is missing, failed or stale."""
    folder = Path(folder)
    missing = [n for n in REQUIRED_FILES if not (folder / n).is_file()]
    if VERIFICATION_FILE in missing:
        raise PushRefused(f"{folder} has no {VERIFICATION_FILE}: build it with scripts/build_repo.py (or re-check it "
                          "with `build_repo.py --verify`) first")
    if missing:
        raise PushRefused(f"{folder} lacks required files: {missing}")
    result = json.loads((folder / VERIFICATION_FILE).read_text())
    if result.get("passed") is not True:
        raise PushRefused(f"verification failed ({', '.join(result.get('failed') or ['?'])}): "
                          f"{summary_line(result) if 'checks' in result else result}")
    recorded = result.get("files") or {}
    present = hashed_files(folder)
    if not any(n.endswith(".safetensors") for n in recorded):
        raise PushRefused(f"{VERIFICATION_FILE} vouches for no weight file")
    added, removed = sorted(set(present) - set(recorded)), sorted(set(recorded) - set(present))
    if added or removed:
        raise PushRefused(f"files changed since verification: added {added}, removed {removed}; re-run "
                          "`build_repo.py --verify`")
    current = sha256_files(folder, present)
    changed = sorted(n for n in present if current[n] != recorded[n])
    if changed:
        raise PushRefused(f"files modified since verification (sha256 differs): {changed}; re-run "
                          "`build_repo.py --verify`")
    return result


def fmt_err(value) -> str:
    """A relative error for people: ``1.23e-04``, or ``n/a`` where the check could not run."""
    return "n/a" if value is None else f"{value:.2e}"


def summary_line(result: dict) -> str:
    """The verification in one line (logs, the model card, commit messages)."""
    checks = result["checks"]
    ref, fvs, greedy = checks["vs_reference"], checks["fused_vs_stock"], checks["greedy"]
    status = "passed" if result["passed"] else "FAILED (" + ", ".join(result["failed"]) + ")"
    return (f"verification {status}: logits vs {ref['reference']} rel err {fmt_err(ref['rel_err'])} "
            f"(bound {fmt_err(ref['bound'])}); fused vs stock {fmt_err(fvs['rel_err'])} (bound {fvs['bound']:.0e}); "
            f"greedy {greedy['new_tokens']} tokens {'equal' if greedy['passed'] else 'DIFFER'}; "
            f"{result['dtype']}, {result['device']}, transformers {result['versions']['transformers']}")


def commit_text(folder, result: dict) -> tuple[str, str]:
    """(commit message, commit description) for the upload."""
    name = Path(folder).name
    ref = result["checks"]["vs_reference"]
    message = (f"Upload {name} ({result['layout']}, {result['dtype']}): verified, logits rel err "
               f"{fmt_err(ref['rel_err'])} <= {fmt_err(ref['bound'])}, greedy {result['checks']['greedy']['new_tokens']} "
               "tokens equal")
    versions = ", ".join(f"{k} {v}" for k, v in result["versions"].items() if v)
    sources = result["sources"]
    lines = [summary_line(result), "", f"verified {result['timestamp']} on {result['device']} ({versions})",
             f"base: {_source_text(sources['base'])}"]
    if sources.get("adapter"):
        lines.append(f"adapter (merged in float32, cast once): {_source_text(sources['adapter'])}")
    weights = {n: h for n, h in result["files"].items() if n.endswith(".safetensors")}
    lines += ["", "weights (sha256):"] + [f"  {n} {h}" for n, h in weights.items()]
    return message, "\n".join(lines)


def _source_text(source: dict) -> str:
    if source.get("hub_id"):
        return source["hub_id"] + (f"@{source['revision']}" if source.get("revision") else "")
    return Path(source["path"]).name


def push(folder, repo_id: str, *, private: bool = False, branch: str | None = None, dry_run: bool = False) -> dict:
    """Check ``folder`` and upload its allowlisted files to ``repo_id`` in one commit; returns the plan (and, when
    not a dry run, the commit url). ``branch`` (default main) is created from main when missing."""
    folder = Path(folder)
    upload, skipped = select_files(folder)
    result = check_verification(folder)
    message, description = commit_text(folder, result)
    revision = branch if branch and branch != "main" else None
    plan = {
        "create_repo": {"repo_id": repo_id, "repo_type": "model", "private": private, "exist_ok": True},
        "create_branch": {"repo_id": repo_id, "repo_type": "model", "branch": revision, "exist_ok": True}
        if revision else None,
        "create_commit": {"repo_id": repo_id, "repo_type": "model", "revision": revision, "commit_message": message,
                          "commit_description": description, "operations": upload},
        "skipped": skipped,
    }
    _print_plan(folder, plan)
    if dry_run:
        print("dry run: nothing was sent")
        return plan

    from huggingface_hub import CommitOperationAdd, HfApi

    api = HfApi()  # token: HF_TOKEN or the stored login, as huggingface_hub resolves it
    api.create_repo(**plan["create_repo"])
    if revision:
        api.create_branch(**plan["create_branch"])
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(folder / name)) for name in upload]
    commit = {k: v for k, v in plan["create_commit"].items() if k != "operations"}
    info = api.create_commit(operations=operations, **commit)
    plan["commit_url"] = getattr(info, "commit_url", None)
    print(f"pushed: {plan['commit_url']}")
    return plan


def _print_plan(folder: Path, plan: dict) -> None:
    fmt = lambda call: ", ".join(f"{k}={v!r}" for k, v in call.items() if k not in ("operations",
                                                                                   "commit_description"))
    print(f"create_repo({fmt(plan['create_repo'])})")
    if plan["create_branch"]:
        print(f"create_branch({fmt(plan['create_branch'])})")
    print(f"create_commit({fmt(plan['create_commit'])}) with {len(plan['create_commit']['operations'])} operations:")
    for name in plan["create_commit"]["operations"]:
        print(f"  CommitOperationAdd(path_in_repo={name!r})  {(folder / name).stat().st_size:,} bytes")
    print("commit description:\n  " + plan["create_commit"]["commit_description"].replace("\n", "\n  "))
    if plan["skipped"]:
        print("skipped: " + ", ".join(f"{name} ({why})" for name, why in plan["skipped"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder written by scripts/build_repo.py")
    parser.add_argument("repo_id", help="the Hub repo, org/name (created when missing)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--branch", "--revision", dest="branch", help="branch to commit to (created from main when "
                        "missing; default main)")
    parser.add_argument("--dry-run", action="store_true", help="print the exact operations and call nothing")
    args = parser.parse_args(argv)
    try:
        push(args.folder, args.repo_id, private=args.private, branch=args.branch, dry_run=args.dry_run)
    except PushRefused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
