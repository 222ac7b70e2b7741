"""scripts/push_to_hub.py on small hand-made folders (no model is built): a push replaces the files an older build
left on the Hub and keeps the user's own, refuses unverified fused kernels unless told, uploads no local path, checks
the token before any hashing and reports Hub errors in one line; and scripts.common.code_files, which decides which
code files a repo ships. The Hub is a fake HfApi that records the calls: tests never reach the network."""

import json
import shutil
from pathlib import Path

import pytest

from helpers import CODE_FILES
from scripts import push_to_hub
from scripts.common import code_files

REPO = Path(__file__).resolve().parents[2]


class FakeHub:
    """HfApi's network methods replaced: `remote` is what the repo holds; write calls are recorded (or fail the test
    when `writes=False`)."""

    def __init__(self, monkeypatch, remote=(), writes=True, fail_commit=None):
        from huggingface_hub import HfApi

        self.calls, self.remote = [], list(remote)
        monkeypatch.setattr(HfApi, "list_repo_files", lambda api, repo_id, **kw: list(self.remote))
        for name in ("create_repo", "create_branch", "create_commit"):
            monkeypatch.setattr(HfApi, name, self._write(name, writes, fail_commit if name == "create_commit" else None))

    def _write(self, name, allowed, error):
        def call(api, **kwargs):
            assert allowed, f"HfApi.{name} was called"
            if error is not None:
                raise error
            self.calls.append((name, kwargs))
            return type("CommitInfo", (), {"commit_url": "https://example.invalid/commit/1"})()
        return call

    def commit_operations(self):
        (commit,) = [kw for name, kw in self.calls if name == "create_commit"]
        return commit["operations"]


def verified_folder(root: Path, *, shards=2, kernels_verified=True, source_path=None) -> Path:
    """A folder as build_repo writes one (code, config, sharded weights, card) with a passing verification.json
    whose hashes match; `source_path` records a local base folder."""
    folder = root / "tiny-fused"
    folder.mkdir()
    for name in code_files(REPO):
        shutil.copy2(REPO / name, folder / name)
    (folder / "config.json").write_text(json.dumps({"model_type": "qwen3_5_text"}))
    (folder / "README.md").write_text("# tiny\n")
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 else \
        ["model.safetensors"]
    for i, name in enumerate(names):
        (folder / name).write_bytes(bytes([i]) * 64)
    if shards > 1:
        (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    base = {"path": str(source_path)} if source_path else {"hub_id": "test-org/tiny-base", "revision": "0" * 40}
    check = lambda **kw: {"passed": True, **kw}
    result = {
        "passed": True, "failed": [], "fused_kernels_verified": kernels_verified, "timestamp": "2026-12-01T00:00:00",
        "layout": "text", "dtype": "bfloat16", "device": "cuda" if kernels_verified else "cpu",
        "sources": {"base": base, "adapter": {"path": str(source_path) + "-lora"} if source_path else None},
        "checks": {"vs_reference": check(reference="base, float32", rel_err=1e-3, bound=2e-3),
                   "fused_vs_stock": check(rel_err=1e-4, bound=5e-4),
                   "greedy": check(new_tokens=8),
                   "stock_load": check(error=f"OSError: {source_path}/x not found" if source_path else None)},
        "versions": {"transformers": "5.24.0"},
    }
    result["files"] = push_to_hub.sha256_files(folder, push_to_hub.hashed_files(folder))
    (folder / "verification.json").write_text(json.dumps(result))
    return folder


def http_error(cls, message: str, status: int):
    """A huggingface_hub HTTP error as the Hub client raises it (it needs the response), built with the HTTP library
    the installed huggingface_hub uses (httpx up to 1.x, httpx2 from 2.0)."""
    import importlib

    from huggingface_hub import errors

    http = importlib.import_module(errors.Response.__module__.split(".")[0])
    response = http.Response(status, request=http.Request("GET", "https://example.invalid"))
    return cls(message, response=response)


@pytest.fixture
def token(monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_test_token")


# What the Hub repo holds before the push: files of an older build (a single-file checkpoint, an older sharding, a
# .bin, a code module since removed, a tokenizer and generation config this build lacks), and the user's own files.
STALE_BUILD_FILES = ["generation_config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                     "model.safetensors", "old_module.py", "pytorch_model.bin", "tokenizer.json"]
USER_FILES = [".gitattributes", "LICENSE", "demo.ipynb", "images/diagram.png", "model-q4_k_m.gguf", "notes/extra.md",
              "notes/weights.safetensors", "old-chart.png"]


def test_push_deletes_stale_build_files_and_keeps_the_users(tmp_path, monkeypatch, capsys, token):
    """A 3-shard build pushed over a single-file one and a 2-shard one: the old model.safetensors (which transformers
    would load before the index), the old shards and the other files of kinds a build writes are deleted in the same
    commit; the user's files (a LICENSE, notes, images, a notebook, a GGUF, anything in a folder, .gitattributes) are
    kept and listed, in the dry run and in the plan."""
    folder = verified_folder(tmp_path, shards=3)
    remote = ["README.md", "config.json", "model.safetensors.index.json", "model-00001-of-00003.safetensors",
              *CODE_FILES, *STALE_BUILD_FILES, *USER_FILES]
    hub = FakeHub(monkeypatch, remote=remote, writes=False)
    assert push_to_hub.main([str(folder), "test-org/tiny-fused", "--dry-run"]) == 0
    out = capsys.readouterr().out
    for name in STALE_BUILD_FILES:
        assert f"CommitOperationDelete(path_in_repo={name!r})" in out, name
    for name in USER_FILES + ["README.md", "config.json", "model.safetensors.index.json"]:
        assert f"CommitOperationDelete(path_in_repo={name!r})" not in out, name
    (kept_line,) = [line for line in out.splitlines() if line.startswith("kept (not written by builds): ")]
    assert kept_line.split(": ", 1)[1].split(", ") == sorted(USER_FILES)

    hub = FakeHub(monkeypatch, remote=remote)
    plan = push_to_hub.push(folder, "test-org/tiny-fused")
    assert plan["create_commit"]["deletions"] == sorted(STALE_BUILD_FILES)
    assert plan["kept"] == sorted(USER_FILES)
    from huggingface_hub import CommitOperationAdd, CommitOperationDelete

    ops = hub.commit_operations()  # one commit holds the uploads and the deletions
    assert sorted(op.path_in_repo for op in ops if isinstance(op, CommitOperationDelete)) == sorted(STALE_BUILD_FILES)
    assert {op.path_in_repo for op in ops if isinstance(op, CommitOperationAdd)} == \
        {p.name for p in folder.iterdir()}


def test_push_single_file_over_sharded_deletes_shards_and_index(tmp_path, monkeypatch, token):
    folder = verified_folder(tmp_path, shards=1)
    remote = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json",
              "pytorch_model.bin.index.json", "LICENSE", *CODE_FILES]
    FakeHub(monkeypatch, remote=remote)
    plan = push_to_hub.push(folder, "test-org/tiny-fused")
    assert plan["create_commit"]["deletions"] == ["model-00001-of-00002.safetensors",
                                                  "model-00002-of-00002.safetensors", "model.safetensors.index.json",
                                                  "pytorch_model.bin.index.json"]
    assert plan["kept"] == ["LICENSE"]


def test_push_to_a_new_repo_deletes_nothing(tmp_path, monkeypatch, token):
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError

    folder = verified_folder(tmp_path, shards=1)
    hub = FakeHub(monkeypatch)

    def not_found(api, repo_id, **kwargs):
        raise http_error(RepositoryNotFoundError, "404 Client Error: Repository Not Found", 404)

    monkeypatch.setattr(HfApi, "list_repo_files", not_found)
    assert push_to_hub.push(folder, "test-org/new")["create_commit"]["deletions"] == []
    assert len(hub.commit_operations()) == len(list(folder.iterdir()))


def test_push_refuses_unverified_kernels_unless_told(tmp_path, monkeypatch, capsys, token):
    folder = verified_folder(tmp_path, kernels_verified=False)
    FakeHub(monkeypatch, writes=False)
    capsys.readouterr()
    with pytest.raises(push_to_hub.PushRefused, match="fused kernels .* were not verified"):
        push_to_hub.push(folder, "test-org/x")
    assert push_to_hub.main([str(folder), "test-org/x"]) == 1
    err = capsys.readouterr().err
    assert "--allow-unverified-kernels" in err and len(err.strip().splitlines()) == 1
    hub = FakeHub(monkeypatch)
    assert push_to_hub.main([str(folder), "test-org/x", "--allow-unverified-kernels"]) == 0
    commit = [kw for name, kw in hub.calls if name == "create_commit"][0]
    assert "fused kernels not verified" in commit["commit_message"]
    assert "fused kernels NOT verified" in commit["commit_description"]


def test_push_uploads_no_local_path(tmp_path, monkeypatch, token):
    """A folder verified before builds stopped recording local paths: the uploaded verification.json names a local
    base / adapter by its folder name, everywhere (an error text included); the commit description too. The file on
    disk is left as it is."""
    base = tmp_path / "my-base"
    folder = verified_folder(tmp_path, source_path=base)
    hub = FakeHub(monkeypatch)
    push_to_hub.push(folder, "test-org/x")
    uploaded = {op.path_in_repo: op.path_or_fileobj for op in hub.commit_operations()}
    public = uploaded["verification.json"]
    assert isinstance(public, bytes) and str(tmp_path).encode() not in public
    record = json.loads(public)
    assert record["sources"]["base"] == {"path": "my-base", "local": True}
    assert record["sources"]["adapter"] == {"path": "my-base-lora", "local": True}
    assert record["checks"]["stock_load"]["error"] == "OSError: my-base/x not found"
    assert record["files"] == json.loads((folder / "verification.json").read_text())["files"]
    commit = [kw for name, kw in hub.calls if name == "create_commit"][0]
    assert str(tmp_path) not in commit["commit_description"] + commit["commit_message"]
    assert "base: local folder my-base" in commit["commit_description"]
    for name, content in uploaded.items():
        if name != "verification.json" and name.endswith((".json", ".md")):
            assert str(tmp_path) not in Path(content).read_text(), name
    assert str(base) in (folder / "verification.json").read_text()


def test_push_names_a_local_source_by_name_and_hash(tmp_path, monkeypatch, token):
    """Sources as builds record a local folder (name, the Hub id it is a copy of, content hash) are uploaded as they
    are, and the commit description names them so."""
    folder = verified_folder(tmp_path)
    record = json.loads((folder / "verification.json").read_text())
    record["sources"] = {
        "base": {"kind": "local", "name": "my-base", "copy_of": "test-org/tiny-base", "sha256": "ab" * 32},
        "adapter": {"kind": "local", "name": "my-lora", "copy_of": None, "sha256": "cd" * 32},
    }
    (folder / "verification.json").write_text(json.dumps(record))
    hub = FakeHub(monkeypatch)
    push_to_hub.push(folder, "test-org/x")
    uploaded = {op.path_in_repo: op.path_or_fileobj for op in hub.commit_operations()}
    assert json.loads(uploaded["verification.json"])["sources"] == record["sources"]
    description = [kw for name, kw in hub.calls if name == "create_commit"][0]["commit_description"]
    assert f"base: local folder my-base (a copy of test-org/tiny-base, sha256 {'ab' * 32})" in description
    assert f"adapter (merged in float32, cast once): local folder my-lora (sha256 {'cd' * 32})" in description


def test_push_checks_the_token_before_any_work(tmp_path, monkeypatch, capsys):
    import huggingface_hub

    folder = verified_folder(tmp_path)
    FakeHub(monkeypatch, writes=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)

    def no_hashing(*args, **kwargs):
        raise AssertionError("files were hashed before the token was checked")

    monkeypatch.setattr(push_to_hub, "sha256_files", no_hashing)
    capsys.readouterr()
    assert push_to_hub.main([str(folder), "test-org/x"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("refused: no Hugging Face token") and "HF_TOKEN" in err and "\n" not in err


def test_push_hub_errors_are_one_line(tmp_path, monkeypatch, capsys, token):
    from huggingface_hub.errors import HfHubHTTPError

    folder = verified_folder(tmp_path)
    FakeHub(monkeypatch, fail_commit=http_error(HfHubHTTPError, "403 Forbidden: you cannot write to test-org/x\nmore "
                                                "detail", 403))
    assert push_to_hub.main([str(folder), "test-org/x"]) == 1
    err = capsys.readouterr().err.strip().splitlines()[-1]  # after the hashing bar
    assert err == "push failed: HfHubHTTPError: 403 Forbidden: you cannot write to test-org/x"


def test_code_files_follow_relative_imports(tmp_path):
    """Entry files plus what they reach by `from .x import y` / `import .x`, recursively; a stray .py is not a code
    file (and not uploaded); a missing import is named with its importer."""
    assert set(code_files(REPO)) == set(CODE_FILES)  # today's three files
    (tmp_path / "configuration_qwen3_5_fused.py").write_text("from transformers import PretrainedConfig\n")
    (tmp_path / "modeling_qwen3_5_fused.py").write_text(
        "from .configuration_qwen3_5_fused import X\nfrom .fused_layers import Y  # split out\n")
    (tmp_path / "fused_layers.py").write_text("import torch\n    from .fused_ops_norm import rms_norm\n")
    (tmp_path / "fused_ops_norm.py").write_text("import .fused_compat\n")
    (tmp_path / "fused_compat.py").write_text("")
    (tmp_path / "stray.py").write_text("")
    assert code_files(tmp_path) == ["configuration_qwen3_5_fused.py", "fused_compat.py", "fused_layers.py",
                                    "fused_ops_norm.py", "modeling_qwen3_5_fused.py"]
    upload, skipped = push_to_hub.select_files(tmp_path)
    assert "fused_compat.py" in upload and ("stray.py", "not in the allowlist") in skipped
    (tmp_path / "fused_compat.py").unlink()
    with pytest.raises(FileNotFoundError, match="fused_compat.py is missing .imported by fused_ops_norm.py"):
        code_files(tmp_path)
