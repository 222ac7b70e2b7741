"""Push a folder built by scripts/build_repo.py to the Hugging Face Hub, in one commit, only once it is verified.

    python scripts/push_to_hub.py out/my-model org/my-model --dry-run      # print the exact operations, write nothing
    python scripts/push_to_hub.py out/my-model org/my-model --private
    python scripts/push_to_hub.py out/my-model org/my-model --branch fused-v2   # created when missing

- Only an allowlist is uploaded: the code files (the two files ``auto_map`` names and what they import relatively,
  see ``scripts.common.code_files``), config.json, generation_config.json, *.safetensors and their
  index, tokenizer / chat-template / processor files, README.md, verification.json, and PNG charts that README.md
  shows. Everything else (hidden files, folders, caches, tokens, stray files) is skipped and listed.
- A push replaces what builds write, and keeps everything else: a top-level file of the Hub repo (at the branch) of a
  kind a build writes (weights ``*.safetensors`` / ``*.bin`` / ``*.pt`` / ``*.pth`` and their ``*.index.json``,
  ``*.py``, config.json, generation_config.json, tokenizer / chat-template / processor files, README.md,
  verification.json) that this build does not hold is deleted in the same commit, so a sharded build pushed over a
  single-file one (or over another sharding) leaves no stale weights behind. Every other remote file (a LICENSE,
  images, notebooks, anything in a folder, ``.gitattributes``, GGUF conversions) is kept, and listed as kept.
  ``--dry-run`` lists the deletions and the kept files (it reads the remote file list, and writes nothing).
- The push is refused when verification.json is missing or failed, when a file it vouches for (weights, config,
  code, tokenizer) was changed, added or removed since, and when the fused kernels were not verified (a build on a
  machine without a CUDA GPU checks only the stock path) unless ``--allow-unverified-kernels`` is given.
- verification.json names no local path: builds record a local source by its folder name and content hash;
  in a folder verified before they did, each source path is replaced by the folder's name on upload.
- The commit message carries the verification summary.
- The token comes from huggingface_hub's usual sources (``HF_TOKEN``, ``hf auth login``); it is never an argument
  and never printed, and it is checked before any file is hashed.
"""

import argparse
import hashlib
import json
import os
import sys
from pathlib import Path

from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.common import ENTRY_FILES, code_files  # noqa: E402

CONFIG_FILES = ("config.json", "generation_config.json")
WEIGHT_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json")
PROCESSOR_FILES = ("preprocessor_config.json", "video_preprocessor_config.json", "processor_config.json")
CARD_FILE = "README.md"
VERIFICATION_FILE = "verification.json"
# Without these a push makes no usable, checked repo.
REQUIRED_FILES = ENTRY_FILES + ("config.json", CARD_FILE, VERIFICATION_FILE)
# Weight files a build (or an older tool) may have written; with their index (``<name>.index.json``). GGUF files are
# not among them: builds never write one, so a GGUF on the Hub is a user's conversion, and transformers does not load
# it in place of the safetensors.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")
HASH_CHUNK = 1 << 24


class PushRefused(RuntimeError):
    """The folder may not be pushed (verification missing / failed / stale, or a required file absent)."""


def _code_files(folder) -> set[str]:
    """The folder's code files (see ``scripts.common.code_files``); none when an entry file is missing (the push is
    refused for that elsewhere) or an imported file is."""
    try:
        return set(code_files(folder))
    except FileNotFoundError:
        return {n for n in ENTRY_FILES if (Path(folder) / n).is_file()}


def _vouched(name: str, code: set[str]) -> bool:
    """Files whose content verification.json vouches for (by hash)."""
    return (name in code or name in CONFIG_FILES or name == WEIGHT_INDEX or name.endswith(".safetensors")
            or name in TOKENIZER_FILES or name in PROCESSOR_FILES)


def hashed_files(folder) -> list[str]:
    """The vouched-for files present in ``folder`` (README.md, verification.json and charts may change later)."""
    code = _code_files(folder)
    return sorted(e.name for e in os.scandir(folder)
                  if e.is_file(follow_symlinks=False) and not e.name.startswith(".") and _vouched(e.name, code))


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
    code = _code_files(folder)
    upload, skipped = [], []
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        name = entry.name
        if name.startswith("."):
            skipped.append((name, "hidden"))
        elif entry.is_symlink():
            skipped.append((name, "symbolic link"))
        elif entry.is_dir():
            skipped.append((name, "folder"))
        elif _vouched(name, code) or name in (CARD_FILE, VERIFICATION_FILE):
            upload.append(name)
        elif name.lower().endswith(".png") and f"({name})" in card:
            upload.append(name)
        elif name.lower().endswith(".png"):
            skipped.append((name, "chart not shown in README.md"))
        else:
            skipped.append((name, "not in the allowlist"))
    return upload, skipped


def check_verification(folder, allow_unverified_kernels: bool = False) -> dict:
    """The verification result of ``folder``, or ``PushRefused`` when it is missing, failed or stale, or when the
    fused kernels were not verified and ``allow_unverified_kernels`` is not set."""
    folder = Path(folder)
    missing = [n for n in REQUIRED_FILES if not (folder / n).is_file()]
    try:
        code_files(folder)
    except FileNotFoundError as exc:
        missing.append(str(exc))
    if VERIFICATION_FILE in missing:
        raise PushRefused(f"{folder} has no {VERIFICATION_FILE}: build it with scripts/build_repo.py (or re-check it "
                          "with `build_repo.py --verify`) first")
    if missing:
        raise PushRefused(f"{folder} lacks required files: {missing}")
    result = json.loads((folder / VERIFICATION_FILE).read_text())
    if result.get("passed") is not True:
        raise PushRefused(f"verification failed ({', '.join(result.get('failed') or ['?'])}): "
                          f"{summary_line(result) if 'checks' in result else result}")
    if result.get("fused_kernels_verified") is not True and not allow_unverified_kernels:
        raise PushRefused(f"the fused kernels of {folder} were not verified (built on {result.get('device', '?')}: "
                          "only the stock path ran); re-verify on a GPU (`build_repo.py --verify FOLDER --device "
                          "cuda`) or pass --allow-unverified-kernels to push it as it is")
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
    if result.get("fused_kernels_verified"):
        kernels = (f"fused vs stock {fmt_err(fvs['rel_err'])} (bound {fvs['bound']:.0e}); greedy "
                   f"{greedy['new_tokens']} tokens {'equal' if greedy['passed'] else 'DIFFER'}")
    else:
        kernels = "fused kernels NOT verified (only the stock path ran)"
    return (f"verification {status}: logits vs {ref['reference']} rel err {fmt_err(ref['rel_err'])} "
            f"(bound {fmt_err(ref['bound'])}); {kernels}; "
            f"{result['dtype']}, {result['device']}, transformers {result['versions']['transformers']}")


def commit_text(folder, result: dict) -> tuple[str, str]:
    """(commit message, commit description) for the upload."""
    name = Path(folder).name
    ref = result["checks"]["vs_reference"]
    message = (f"Upload {name} ({result['layout']}, {result['dtype']}): verified, logits rel err "
               f"{fmt_err(ref['rel_err'])} <= {fmt_err(ref['bound'])}, "
               + (f"greedy {result['checks']['greedy']['new_tokens']} tokens equal"
                  if result.get("fused_kernels_verified") else "fused kernels not verified"))
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
    """A recorded source for the commit text: a Hub id and commit, or a local folder by name (with the Hub id it is a
    copy of and its content hash, where recorded; a folder verified before these were recorded names its path)."""
    if source.get("kind") == "local":
        about = [f"a copy of {source['copy_of']}"] if source.get("copy_of") else []
        about += [f"sha256 {source['sha256']}"] if source.get("sha256") else []
        return f"local folder {source['name']}" + (f" ({', '.join(about)})" if about else "")
    if source.get("hub_id"):
        return source["hub_id"] + (f"@{source['revision']}" if source.get("revision") else "")
    return f"local folder {Path(source['path']).name}"


def replace_paths(value, paths: dict[str, str]):
    """``value`` (JSON data) with each path of ``paths`` replaced by its stand-in in every string, longest first."""
    if isinstance(value, dict):
        return {k: replace_paths(v, paths) for k, v in value.items()}
    if isinstance(value, list):
        return [replace_paths(v, paths) for v in value]
    if isinstance(value, str):
        for path, name in sorted(paths.items(), key=lambda item: -len(item[0])):
            value = value.replace(path, name)
    return value


def public_verification(result: dict) -> dict:
    """``result`` as it may be uploaded. Builds record a local source by name and content hash, never by path; a
    folder verified before (its verification.json names the source folders) has each path replaced by the folder's
    name, in the sources and in every other string (a load error, say)."""
    paths = {}
    sources = {}
    for role, source in result.get("sources", {}).items():
        if source and source.get("path"):
            name = Path(source["path"]).name
            paths[source["path"]] = name
            sources[role] = {"path": name, "local": True}
        else:
            sources[role] = source
    return {**replace_paths(result, paths), "sources": sources}


def written_by_builds(name: str) -> bool:
    """Whether a remote file (path in the repo) is of a kind a build writes, so that a push may delete it when the
    build no longer holds it: top-level weights and their index, code (``*.py``), configs, tokenizer / chat-template /
    processor files, the card and verification.json. Everything else on the Hub is the user's and is kept."""
    if "/" in name:
        return False
    lower = name.lower()
    return (lower.endswith(WEIGHT_SUFFIXES) or lower.endswith(tuple(s + ".index.json" for s in WEIGHT_SUFFIXES))
            or lower.endswith(".py") or name in CONFIG_FILES or name in TOKENIZER_FILES or name in PROCESSOR_FILES
            or name in (CARD_FILE, VERIFICATION_FILE))


def remote_plan(remote: list[str], upload: list[str]) -> tuple[list[str], list[str]]:
    """(remote files to delete, remote files kept): of the remote files this build does not upload, those of a kind
    builds write are deleted and all others are kept."""
    stale = sorted(set(remote) - set(upload))
    return [n for n in stale if written_by_builds(n)], [n for n in stale if not written_by_builds(n)]


def remote_files(api, repo_id: str, revision: str | None) -> list[str]:
    """The files of ``repo_id`` at ``revision`` (a branch not yet there: main, which it will be created from); none
    for a repo not yet there."""
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        return api.list_repo_files(repo_id, revision=revision, repo_type="model")
    except RevisionNotFoundError:
        return api.list_repo_files(repo_id, repo_type="model")
    except RepositoryNotFoundError:
        return []


def require_token() -> None:
    """``PushRefused`` when huggingface_hub finds no token (``HF_TOKEN``, ``hf auth login``); read locally, sent
    nowhere."""
    from huggingface_hub import get_token

    if not get_token():
        raise PushRefused("no Hugging Face token: set HF_TOKEN or run `hf auth login`, then push again")


def push(folder, repo_id: str, *, private: bool = False, branch: str | None = None, dry_run: bool = False,
         allow_unverified_kernels: bool = False) -> dict:
    """Check ``folder`` and upload its allowlisted files to ``repo_id`` (at ``branch``, default main, created from main
    when missing) in one commit, which also deletes the remote files of the kinds builds write that the folder does
    not hold (see :func:`remote_plan`); other remote files are kept (``plan["kept"]``). Returns the plan (and, when
    not a dry run, the commit url). The token is checked first (not for a dry run)."""
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete, HfApi

    folder = Path(folder)
    if not folder.is_dir():
        raise PushRefused(f"{folder} is not a folder: pass the --out folder of scripts/build_repo.py")
    if not dry_run:
        require_token()
    upload, skipped = select_files(folder)
    result = check_verification(folder, allow_unverified_kernels)
    message, description = commit_text(folder, result)
    revision = branch if branch and branch != "main" else None
    api = HfApi()  # token: HF_TOKEN or the stored login, as huggingface_hub resolves it
    delete, kept = remote_plan(remote_files(api, repo_id, revision), upload)
    plan = {
        "create_repo": {"repo_id": repo_id, "repo_type": "model", "private": private, "exist_ok": True},
        "create_branch": {"repo_id": repo_id, "repo_type": "model", "branch": revision, "exist_ok": True}
        if revision else None,
        "create_commit": {"repo_id": repo_id, "repo_type": "model", "revision": revision, "commit_message": message,
                          "commit_description": description, "operations": upload, "deletions": delete},
        "kept": kept,
        "skipped": skipped,
    }
    _print_plan(folder, plan)
    if dry_run:
        print("dry run: nothing was sent")
        return plan

    api.create_repo(**plan["create_repo"])
    if revision:
        api.create_branch(**plan["create_branch"])
    public = json.dumps(public_verification(result), indent=2).encode() + b"\n"
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=public if name == VERIFICATION_FILE
                                     else str(folder / name)) for name in upload]
    operations += [CommitOperationDelete(path_in_repo=name) for name in delete]
    commit = {k: v for k, v in plan["create_commit"].items() if k not in ("operations", "deletions")}
    info = api.create_commit(operations=operations, **commit)
    plan["commit_url"] = getattr(info, "commit_url", None)
    print(f"pushed: {plan['commit_url']}")
    return plan


def _print_plan(folder: Path, plan: dict) -> None:
    fmt = lambda call: ", ".join(f"{k}={v!r}" for k, v in call.items()
                                 if k not in ("operations", "deletions", "commit_description"))
    print(f"create_repo({fmt(plan['create_repo'])})")
    if plan["create_branch"]:
        print(f"create_branch({fmt(plan['create_branch'])})")
    commit = plan["create_commit"]
    print(f"create_commit({fmt(commit)}) with {len(commit['operations']) + len(commit['deletions'])} operations:")
    for name in commit["operations"]:
        print(f"  CommitOperationAdd(path_in_repo={name!r})  {(folder / name).stat().st_size:,} bytes")
    for name in commit["deletions"]:
        print(f"  CommitOperationDelete(path_in_repo={name!r})  on the Hub, not in this build")
    print("commit description:\n  " + plan["create_commit"]["commit_description"].replace("\n", "\n  "))
    if plan["kept"]:
        print("kept (not written by builds): " + ", ".join(plan["kept"]))
    if plan["skipped"]:
        print("skipped: " + ", ".join(f"{name} ({why})" for name, why in plan["skipped"]))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a folder written by scripts/build_repo.py")
    parser.add_argument("repo_id", help="the Hub repo, org/name (created when missing)")
    parser.add_argument("--private", action="store_true", help="create the repo private")
    parser.add_argument("--branch", "--revision", dest="branch", help="branch to commit to (created from main when "
                        "missing; default main)")
    parser.add_argument("--dry-run", action="store_true", help="print the exact operations (uploads, deletions) and "
                        "the remote files kept; reads the remote file list, writes nothing")
    parser.add_argument("--allow-unverified-kernels", action="store_true", help="push a folder whose fused kernels "
                        "were not verified (built without a CUDA GPU: only the stock path was checked)")
    args = parser.parse_args(argv)
    from huggingface_hub.errors import HfHubHTTPError

    try:
        push(args.folder, args.repo_id, private=args.private, branch=args.branch, dry_run=args.dry_run,
             allow_unverified_kernels=args.allow_unverified_kernels)
    except PushRefused as exc:
        print(f"refused: {exc}", file=sys.stderr)
        return 1
    except (HfHubHTTPError, OSError) as exc:  # the Hub said no, or was not reached: one line, no traceback
        print(f"push failed: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
