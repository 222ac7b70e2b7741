"""The scripts run end to end on CPU at tiny sizes (no timing is asserted: speed lives in the benchmark output)."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import fused_on_cpu, generate_mod, modeling  # noqa: F401 - fused_on_cpu: the fixture
from scripts import ab_decode, benchmark_latency, benchmark_speculative, eval_quality, generate
from scripts.common import import_module

REPO = Path(__file__).resolve().parents[2]


def test_benchmark_runs_on_cpu(tmp_path):
    results = benchmark_latency.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "8,16",
                                      "--repeats", "2", "--requests", "3", "--max-request-len", "40",
                                      "--decode-batches", "1", "--new-tokens", "3", "--decode-repeats", "2",
                                      "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "results.json").read_text())
    tiny = saved["models"]["tiny"]
    assert set(tiny["forward"]) == {"stock", "fused-eager", "fused"} and set(tiny["forward"]["fused"]) == {"8", "16"}
    assert tiny["requests"]["fused"]["all"]["n"] == 3
    assert set(tiny["plain_forward"]) == {"stock", "fused-eager", "fused"} and set(tiny["plain_forward"]["fused"]) == {"8", "16"}
    # fields only: ms/token is a difference of two wall times, noise (even negative) for 3 tokens on a busy CPU
    assert set(tiny["decode"]) == {"1"} and math.isfinite(tiny["decode"]["1"]["fused"]["ms_per_token"])
    fused_decode = tiny["decode"]["1"]["fused"]
    assert fused_decode["ms_per_token_stats"]["n"] == 2  # --decode-repeats
    assert len(fused_decode["warmup_calls_ms"]) == 2 and all(t > 0 for t in fused_decode["warmup_calls_ms"])
    low, high = fused_decode["ms_per_token_range"]
    assert low <= fused_decode["ms_per_token"] <= high
    assert tiny["params"]["tied"] and tiny["params"]["weight_bytes"] > 0
    assert (tmp_path / "latency.png").stat().st_size > 1000
    md = (tmp_path / "results.md").read_text()
    assert "| tiny | 16 |" in md and results["meta"]["command"].startswith("python scripts/benchmark_latency.py")


def test_benchmark_speculative_runs_on_cpu(tmp_path, fused_on_cpu):
    """The tiny config through the CPU emulation, at forced acceptances 0 and 1: fields only, no timing (wall times
    of a few tokens on a busy CPU are noise), and each round's time split into draft / verify / rest."""
    results = benchmark_speculative.main(["--device", "cpu", "--tiny", "--dtype", "float32", "--new-tokens", "6",
                                          "--repeats", "1", "--k", "1,3", "--acceptance", "0,1", "--out",
                                          str(tmp_path)])
    tiny = results["models"]["tiny"]
    assert set(tiny["speculative"]) == {"k1-a0.0", "k1-a1.0", "k3-a0.0", "k3-a1.0"}
    assert tiny["speculative"]["k3-a0.0"]["acceptance"] == 0 and tiny["speculative"]["k3-a1.0"]["acceptance"] == 1
    assert tiny["speculative"]["k3-a1.0"]["tokens_per_round"] > tiny["speculative"]["k1-a1.0"]["tokens_per_round"]
    assert math.isfinite(tiny["plain"]["ms_per_token"]) and tiny["floor_ms"] is None  # no bandwidth on CPU
    assert "| tiny | 3 | 1.0 |" in (tmp_path / "speculative.md").read_text()
    for r in tiny["speculative"].values():
        assert r["per_round"]["rounds"] > 0 and r["per_round"]["draft_ms"] > 0 and r["per_round"]["verify_ms"] > 0


def test_benchmark_speculative_sets_constants_for_the_run(tmp_path, fused_on_cpu, monkeypatch):
    """``--set MODULE.CONSTANT=VALUE``: the MoE head's static drafter off for the run (its rounds then draft with
    stock's layer, eagerly: no drafter), the shipped value (on) back afterwards."""
    from scripts.common import import_module

    mtp_decode, spec = import_module("fused_mtp_decode"), import_module("fused_speculative")
    drafters = []
    real = spec.drafter_for
    monkeypatch.setattr(spec, "drafter_for", lambda *a: drafters.append(real(*a)) or drafters[-1])
    benchmark_speculative.main(["--device", "cpu", "--dtype", "float32", "--new-tokens", "4",
                                "--repeats", "1", "--k", "1", "--acceptance", "1", "--shapes", "tiny-moe",
                                "--set", "fused_mtp_decode.STATIC_MOE_DRAFTS=False", "--out", str(tmp_path)])
    assert mtp_decode.STATIC_MOE_DRAFTS is True
    assert drafters and all(d is None for d in drafters)



def test_benchmark_speculative_variants_in_one_process(tmp_path, fused_on_cpu, monkeypatch):
    """``--variant``: each (k, a) under each variant's constants in turn (the verify pass's attention at once in one
    of them, token by token in the other, as the pass reports), the shipped values back afterwards, each row named
    by its variant."""
    from scripts.common import import_module

    decode_mod = import_module("fused_decode")
    seen = set()
    at_once, per_token = decode_mod.DecodeState._attention_verify_at_once, decode_mod.DecodeState._attention_verify
    monkeypatch.setattr(decode_mod.DecodeState, "_attention_verify_at_once",
                        lambda self, *a: seen.add("at once") or at_once(self, *a))
    monkeypatch.setattr(decode_mod.DecodeState, "_attention_verify",
                        lambda self, *a: seen.add("per token") or per_token(self, *a))
    results = benchmark_speculative.main([
        "--device", "cpu", "--tiny", "--dtype", "float32", "--new-tokens", "5", "--repeats", "1", "--k", "2",
        "--acceptance", "0,1", "--variant", "base:", "--variant", "at-once:fused_decode.VERIFY_ATTENTION_AT_ONCE=True",
        "--out", str(tmp_path)])
    rows = results["models"]["tiny"]["speculative"]
    assert list(rows) == ["base/k2-a0.0", "at-once/k2-a0.0", "base/k2-a1.0", "at-once/k2-a1.0"]
    assert rows["at-once/k2-a1.0"]["acceptance"] == 1 and rows["base/k2-a0.0"]["acceptance"] == 0
    assert seen == {"at once", "per token"}  # each variant's verify passes ran its own way
    assert decode_mod.VERIFY_ATTENTION_AT_ONCE is False
    assert "| tiny | 2 (at-once) | 1.0 |" in (tmp_path / "speculative.md").read_text()


def test_benchmark_speculative_runs_the_shipped_checkpoint_on_cpu(tmp_path, fused_on_cpu):
    """``--checkpoint .``: the shipped model's trained head on held-out prompts through the CPU emulation, plain and
    k = 1 / 2 as a user gets it and speculating throughout: fields only (no timing). The head drafts some right
    (training_report.json: 60.6% of first drafts at T=0); speculating throughout, every call's tokens come from its
    rounds; a folder without a head is refused in one line."""
    results = benchmark_speculative.main(["--device", "cpu", "--checkpoint", str(REPO), "--dtype", "float32",
                                          "--prompts", "2", "--prompt-len", "16", "--new-tokens", "8",
                                          "--repeats", "1", "--k", "1,2", "--out", str(tmp_path)])
    rows = results["checkpoint"]
    assert set(rows) == {"plain", "k1-user", "k1-throughout", "k2-user", "k2-throughout"}
    for name in ("k1-throughout", "k2-throughout"):
        row = rows[name]
        assert row["drafted"] > 0 and 0 < row["acceptance"] <= 1 and row["handed_over"] == 0, (name, row)
        assert 1 <= row["tokens_per_round"] <= row["k"] + 1
    assert all(math.isfinite(row["ms_per_token"]) for row in rows.values())
    assert "| 2 | speculating throughout |" in (tmp_path / "speculative_checkpoint.md").read_text()
    with pytest.raises(SystemExit, match="no MTP head"):
        _no_head(tmp_path)


def _no_head(tmp_path):
    """A copy of the shipped config and weights without the head, handed to ``load_checkpoint``."""
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "no-head"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(REPO / name, folder / name)
    weights = {k: v for k, v in load_file(str(REPO / "model.safetensors")).items() if not k.startswith("mtp.")}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return benchmark_speculative.load_checkpoint(str(folder), torch.device("cpu"), torch.float32)

def test_benchmark_reads_the_issue_targets_from_its_rows():
    """The targets table: each target of a measured shape read from the run's own rows (met / missed and by how
    much); targets whose shape or row the run lacks are left out. The rows are the 2026-12-02 H200 figures of
    docs/BENCHMARKS.md."""
    floors = lambda decode_ms, forward=None: {"decode_ms": decode_ms, "forward_ms": forward or {}}  # noqa: E731
    fwd = lambda stock, fused: {"stock": {T: {"median": v} for T, v in stock.items()},  # noqa: E731
                                "fused": {T: {"median": v} for T, v in fused.items()}}
    results = {"models": {
        "4B": {"floors": floors(2.001, {"128": 2.001, "2048": 18.63}),
               "decode": {"1": {"fused": {"ms_per_token": 2.614}}, "8": {"fused": {"ms_per_token": 3.332}}},
               "forward": fwd({"128": 84.49, "2048": 87.13}, {"128": 5.20, "2048": 27.28}),
               "new_shapes": {"2x32": {"fused": {"stall_s": 0.81}}, "4x1152": {"fused": {"stall_s": 0.41}}},
               "cold_start": {"fused": {"cold": {"first_s": 14.45}, "warm": {"first_s": 1.29, "repeat_s": 0.24}}},
               "long_context": {"32768": {"fused": {"decode_ms_per_token": 3.069}, "floor": {"decode_ms": 2.318}}}},
        "9B": {"floors": floors(4.270, {"2048": 37.35}), "forward": fwd({"2048": 79.41}, {"2048": 49.31}),
               "long_context": {"32768": {"fused": {"oom": "out of memory"}, "floor": {"decode_ms": 4.626}}}},
        "tiny": {"floors": floors(0.001), "decode": {"8": {"fused": {"ms_per_token": 1.0}}}},
    }}
    rows = [line for line in benchmark_latency.targets_markdown(results) if line.startswith("| ") and "---" not in line]
    got = {(cells[1], cells[2], cells[3]): (cells[4], cells[6])
           for cells in ([c.strip() for c in row.split("|")] for row in rows[1:])}
    assert got == {
        ("batch-8 decode within 1.25x the weight-read floor", "4B", "batch 8"): ("1.67x", "missed (by 0.42x)"),
        ("forward T=2048 within 1.35x its floor", "4B", "T=2048"): ("1.46x", "missed (by 0.11x)"),
        ("forward T=128 within 1.6x its floor", "4B", "T=128"): ("2.60x", "missed (by 1.00x)"),
        ("forward T=2048 at least 2x stock", "9B", "T=2048"): ("1.61x", "missed (by 0.39x)"),
        ("a new shape at most 2 s over its repeat", "4B", "2x32"): ("0.81 s", "met"),
        ("a new shape at most 2 s over its repeat", "4B", "4x1152"): ("0.41 s", "met"),
        ("cold machine: first generate within 15 s", "4B", "cold"): ("14.45 s", "met"),
        ("warm Triton cache: first generate within 1 s of a repeat", "4B", "warm"): ("1.05 s", "missed (by 0.05 s)"),
        ("decode at a 32k context within 1.4x its floor", "4B", "32768 tokens"): ("1.32x", "met"),
    }
    assert benchmark_latency.targets_markdown({"models": {"tiny": results["models"]["tiny"]}}) == []


@pytest.mark.parametrize("value", ["fused,stok", ","])
def test_benchmark_rejects_unknown_profile_variants(value, capsys):
    with pytest.raises(SystemExit):
        benchmark_latency.main(["--shapes", "tiny", "--device", "cpu", "--profile-variants", value])
    assert f"--profile-variants {value!r}: choose from stock,fused-eager,fused" in capsys.readouterr().err


def test_benchmark_weight_accounting_counts_shared_storage_once():
    stock, fused = benchmark_latency.build_pair("tiny", None, torch.device("cpu"), torch.float32)
    assert benchmark_latency.param_counts(fused) == benchmark_latency.param_counts(stock)
    counts = benchmark_latency.param_counts(stock)
    assert counts["tied"] and counts["read_bytes"] == counts["weight_bytes"]  # the tied table is read as the LM head


def test_benchmark_floor_leaves_out_an_untied_input_embedding():
    """9B's input embedding is its own 2 GB table, of which a step gathers a few rows: not in the read floor."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_5_text", vocab_size=64, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8,
                                  layer_types=["full_attention"], tie_word_embeddings=False)
    counts = benchmark_latency.param_counts(AutoModelForCausalLM.from_config(config))
    assert not counts["tied"] and counts["read_bytes"] == counts["weight_bytes"] - 64 * 16 * 4


def test_eval_quality_builds_the_moe_pair(tmp_path, fused_on_cpu):
    """`--shapes tiny-moe`: a stock and a fused Qwen3.5-MoE model sharing their weights (the fused path emulated on
    CPU, every kernel its torch reference), compared as the dense ones are."""
    results = eval_quality.main(["--shapes", "tiny-moe", "--device", "cpu", "--dtype", "float32", "--max-windows", "2",
                                 "--window", "32", "--new-tokens", "6", "--out", str(tmp_path)])
    (r,) = results["models"]
    assert r["path"]["moe"]["path"] == "fused" and "mlp" not in r["path"]
    assert r["rel_logit_err"] <= 2e-5 and r["top1_agreement"] == 1.0
    assert r["greedy"]["first_divergence"] is None and len(r["greedy"]["fused"]) == 6
    assert "| random tiny-moe |" in (tmp_path / "quality.md").read_text()


def test_benchmark_pair_is_stock_bit_for_bit_in_bf16_when_stock_runs():
    """`build_pair`'s fused model on CPU (stock's code) gives stock's logits exactly in bf16: same weights and the same
    float32 rotary buffers (a cast of the pair's fused half once rounded them to bf16)."""
    for shape in ("tiny", "tiny-moe"):
        stock, fused = benchmark_latency.build_pair(shape, None, torch.device("cpu"), torch.bfloat16)
        assert fused.model.rotary_emb.inv_freq.dtype == stock.model.rotary_emb.inv_freq.dtype == torch.float32
        ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(0))
        with torch.inference_mode(), benchmark_latency.stock_cpu_guard(torch.device("cpu")):
            assert torch.equal(fused(input_ids=ids).logits, stock(input_ids=ids).logits), shape


def test_eval_quality_against_fp32(tmp_path, fused_on_cpu):
    """`--fp32-reference --layers 4`: each bf16 path's error against stock's fp32 answer on the same weights (the
    fused path emulated on CPU); a --layers leaving no attention layer is refused."""
    results = eval_quality.main(["--shapes", "tiny-moe", "--device", "cpu", "--dtype", "bfloat16", "--max-windows",
                                 "2", "--window", "32", "--new-tokens", "4", "--layers", "4", "--fp32-reference",
                                 "--out", str(tmp_path)])
    (r,) = results["models"]
    stock, fused = r["vs_fp32"]["stock"], r["vs_fp32"]["fused"]
    assert 0 < stock["rel_logit_err"] < 0.05 and 0 < fused["rel_logit_err"] <= 1.5 * stock["rel_logit_err"]
    assert 0.9 <= fused["top1_agreement"] <= 1 and r["model"] == "random tiny-moe, 4 layers"
    assert f"| {stock['rel_logit_err']:.2e} / {fused['rel_logit_err']:.2e} |" in (tmp_path / "quality.md").read_text()
    with pytest.raises(SystemExit):
        eval_quality.main(["--shapes", "tiny-moe", "--device", "cpu", "--layers", "2"])


def test_eval_quality_on_shipped_model_cpu(tmp_path):
    results = eval_quality.main(["--model", str(REPO), "--shapes", "tiny", "--device", "cpu", "--dtype", "float32",
                                 "--max-windows", "2", "--window", "64", "--new-tokens", "6", "--fp32-reference",
                                 "--out", str(tmp_path)])
    shipped, tiny = results["models"]
    # On CPU the fused classes run stock's code: exact agreement is the only right answer (in fp32, with the fp32
    # answer too).
    for r in (shipped, tiny):
        assert r["rel_logit_err"] == 0.0 and r["top1_agreement"] == 1.0
        assert r["greedy"]["first_divergence"] is None
        assert all(v == {"rel_logit_err": 0.0, "top1_agreement": 1.0} for v in r["vs_fp32"].values()), r["vs_fp32"]
    assert shipped["nll_per_token"]["stock"] == shipped["nll_per_token"]["fused"] < 8
    assert tiny["nll_per_token"] is None
    assert "| random tiny |" in (tmp_path / "quality.md").read_text()


def test_generate_main_on_shipped_model(capsys):
    result = generate.main(["--max-new-tokens", "5", "--device", "cpu"])
    assert result["new_tokens"] == 5
    out = capsys.readouterr().out
    assert "paths:" in out and "stock" in out


def test_pipeline_text_generation_with_remote_code():
    """`pipeline("text-generation", model=repo, trust_remote_code=True)` builds the fused class and generates what
    stock generates (CPU: through the stock fallback)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, pipeline

    from helpers import generate_stock

    pipe = pipeline("text-generation", model=str(REPO), trust_remote_code=True, dtype=torch.float32)
    assert type(pipe.model).__name__ == "Qwen3_5FusedForCausalLM"
    text = pipe("Return a new list", max_new_tokens=8, do_sample=False, return_full_text=False)[0]["generated_text"]
    tok = AutoTokenizer.from_pretrained(REPO)
    stock = AutoModelForCausalLM.from_pretrained(REPO, dtype=torch.float32).eval()
    ids = tok("Return a new list", return_tensors="pt")
    with torch.no_grad():
        ref = generate_stock(stock, **ids, max_new_tokens=8, do_sample=False)
    assert text == tok.decode(ref[0, ids["input_ids"].shape[1]:], skip_special_tokens=True)
    chat = pipe([{"role": "user", "content": "What does len() return?"}], max_new_tokens=4, do_sample=False)
    assert chat[0]["generated_text"][-1]["role"] == "assistant"


def test_benchmark_batch_runs_on_cpu(tmp_path):
    """The generate_batch benchmark's plumbing at the tiny shape on CPU: stock and fused static batches and
    generate_batch (here each request through generate: no GPU) over one seeded workload, stock on a subset."""
    from scripts import benchmark_batch

    results = benchmark_batch.main(["--device", "cpu", "--tiny", "--requests", "8", "--stock-requests", "5",
                                    "--batch", "4", "--out", str(tmp_path)])
    runs = results["runs"]
    assert runs["(1) stock static, subset"]["requests"] == runs["(2) fused static, subset"]["requests"] == 5
    batch = runs["(3) fused generate_batch, 32 rows, chunk None"]
    assert runs["(2) fused static"]["requests"] == batch["requests"] == 8
    assert runs["(2) fused static"]["tokens"] == batch["tokens"]  # EOS off: every count
    assert results["batch_path"].startswith("generate per request") and not results["failed"]
    md = (tmp_path / "batch.md").read_text()
    assert "first 5 requests only (a subset)" in md and "chunk None / (1) stock static" in md
    assert json.loads((tmp_path / "batch.json").read_text())["requests"] == 8


def test_benchmark_batch_split_over_two_processes_cpu(tmp_path, capsys):
    """--static-only runs (1) and (2) and no generate_batch; --batch-only --static-from takes them (and their ratios)
    from that report for (3)'s ratios, and refuses a report of another workload or a run without --batch-only."""
    from scripts import benchmark_batch

    common = ["--device", "cpu", "--tiny", "--requests", "6", "--stock-requests", "3", "--batch", "4"]
    static = benchmark_batch.main([*common, "--static-only", "--out", str(tmp_path / "s")])
    assert sorted(static["runs"]) == ["(1) stock static, subset", "(2) fused static", "(2) fused static, subset"]
    report = tmp_path / "s" / "batch.json"
    batch = benchmark_batch.main([*common, "--batch-only", "--static-from", str(report),
                                  "--out", str(tmp_path / "b")])
    for name in static["runs"]:
        assert batch["runs"][name] == json.loads(report.read_text())["runs"][name]
    third = batch["runs"]["(3) fused generate_batch, 32 rows, chunk None"]
    ratio, _ = batch["ratios"]["(3) fused generate_batch, 32 rows, chunk None / (2) fused static"]
    assert ratio == pytest.approx(third["tokens_per_s"] / static["runs"]["(2) fused static"]["tokens_per_s"])
    assert "(2) / (1) on the same subset" in batch["ratios"]
    assert str(report) in (tmp_path / "b" / "batch.md").read_text()
    with pytest.raises(SystemExit, match=r"--static-from .*its requests is 6, this run's 7"):
        benchmark_batch.main(["--device", "cpu", "--tiny", "--requests", "7", "--stock-requests", "3", "--batch", "4",
                              "--batch-only", "--static-from", str(report), "--out", str(tmp_path / "c")])
    capsys.readouterr()
    with pytest.raises(SystemExit):  # argparse's one-line error
        benchmark_batch.main([*common, "--static-from", str(report)])
    assert f"--static-from {report} needs --batch-only" in capsys.readouterr().err


def test_benchmark_batch_variants_cpu(tmp_path, fused_on_cpu):
    """--variant: every generate_batch setting under each variant's constants in turn, named by the variant, the
    shipped values back afterwards; a constant no module has is an error naming it."""
    from scripts import benchmark_batch
    from scripts.common import import_module

    state = import_module("fused_batch_state")
    shipped = state.ROW_BUCKETS
    seen = []
    real = state.row_bucket

    def spy(rows, most):
        seen.append(state.ROW_BUCKETS)
        return real(rows, most)

    state.row_bucket = spy
    try:
        results = benchmark_batch.main([
            "--device", "cpu", "--tiny", "--requests", "5", "--stock-requests", "2", "--batch", "4", "--rows", "3",
            "--variant", "base:", "--variant", "fine:fused_batch_state.ROW_BUCKETS=(1, 3)", "--out", str(tmp_path)])
    finally:
        state.row_bucket = real
    assert state.ROW_BUCKETS == shipped and not results["failed"]
    names = [n for n in results["runs"] if n.startswith("(3)") and "subset" not in n]
    assert names == ["(3) fused generate_batch, 3 rows, chunk None [base]",
                     "(3) fused generate_batch, 3 rows, chunk None [fine]"]
    assert len({results["runs"][n]["tokens"] for n in names}) == 1
    assert shipped in seen and (1, 3) in seen  # each variant's value reached the scheduler
    with pytest.raises(ValueError, match="NO_SUCH"):
        benchmark_batch.parse_variants(["x:fused_batch_state.NO_SUCH=1"])


def test_benchmark_batch_on_the_fused_scheduler_cpu(tmp_path, fused_on_cpu):
    """The same at the tiny MoE shape through the fused scheduler (the CPU emulation), two row counts, with and
    without chunked prefill: no request fails, each generates its own count in every setting, latencies come from the
    scheduler's timestamps."""
    from scripts import benchmark_batch

    results = benchmark_batch.main(["--device", "cpu", "--tiny", "--model", "35b-a3b", "--requests", "6",
                                    "--stock-requests", "3", "--batch", "4", "--rows", "3,2", "--prefill-chunk", "16,none",
                                    "--out", str(tmp_path)])
    assert results["model"] == "tiny-moe" and results["batch_path"] == "fused scheduler" and not results["failed"]
    requests = benchmark_batch.workload(6, (4, 40), (2, 12), 256, seed=0)
    assert requests == benchmark_batch.workload(6, (4, 40), (2, 12), 256, seed=0)  # seeded
    assert all(4 <= len(p) <= 40 and 2 <= n <= 12 for p, n in requests)
    warm = benchmark_batch.bucket_warmup(requests, 3)  # the timed call's first shapes
    assert max(requests, key=lambda r: len(r[0]) + r[1]) in warm  # its buffers' sizes
    assert [n for p, n in warm[-3:]] == [2, 3, 4] and all(p == requests[0][0][:32] for p, _ in warm[-3:])  # rows 3..1
    names = [f"(3) fused generate_batch, {rows} rows, chunk {chunk}" for rows in (2, 3)
             for chunk in ("16, riding", None)]  # off a GPU, chunks always ride on the decode step
    assert [n for n in results["runs"] if n.startswith("(3)") and "subset" not in n] == names  # fewest rows first
    for name in names:
        run = results["runs"][name]
        assert run["tokens"] == sum(n for _, n in requests) and run["per_token_ms_p50"] > 0


def test_benchmark_batch_warms_the_group_prefill_graphs(monkeypatch):
    """With ``PREFILL_GROUP`` 4, ``CAPTURE_AFTER`` warm-up calls per group batch (2, then 4): b prompts of each length
    bucket that has b, and the largest request (the timed call's buffers); none with the group off."""
    from scripts import benchmark_batch

    batch_mod, graphs = import_module("fused_batch"), import_module("fused_graphs")
    requests = benchmark_batch.workload(64, (4, 300), (2, 12), 256, seed=0)
    largest = max(requests, key=lambda r: len(r[0]) + r[1])
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 1)
    assert benchmark_batch.group_warmups(requests, 256) == []
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", 4)
    assert benchmark_batch.group_warmups(requests, 16) == []  # below GROUP_HOLD_GROUPS groups of rows: no groups
    calls = benchmark_batch.group_warmups(requests, 256)
    assert [b for b, _ in calls] == [2] * graphs.CAPTURE_AFTER + [4] * graphs.CAPTURE_AFTER
    have = {}
    for p, _ in requests:
        have[graphs.forward_len_bucket(len(p))] = have.get(graphs.forward_len_bucket(len(p)), 0) + 1
    for b, warm in calls:
        assert warm[-1] == largest and all(n == 2 for _, n in warm[:-1])
        counts = {}
        for p, _ in warm[:-1]:
            counts[graphs.forward_len_bucket(len(p))] = counts.get(graphs.forward_len_bucket(len(p)), 0) + 1
        assert counts == {k: b for k, v in have.items() if v >= b}


@pytest.mark.parametrize("group", [1, 4])
def test_benchmark_batch_warm_up_leaves_no_prompt_forward_cold(monkeypatch, fused_on_cpu, group):
    """After ``warm_up`` (``--warm buckets``), every prompt forward of the timed call, alone or in a group, finds its
    (batch, length bucket) run at least ``CAPTURE_AFTER`` times, so on a GPU it replays a captured graph: the group's
    first A/B lost 0.73 s of prefills to batch-1 graphs its warm-up had left uncaptured (the warm-up's prompts formed
    groups), as this check found on the scheduler run on CPU."""
    from helpers import stock_and_fused_lm
    from scripts import benchmark_batch

    batch_mod, graphs, runner_mod = (import_module(m) for m in ("fused_batch", "fused_graphs", "fused_runner"))
    monkeypatch.setattr(batch_mod, "PREFILL_GROUP", group)
    monkeypatch.setattr(batch_mod, "GROUP_HOLD_GROUPS", 1)  # groups at the 16 rows here
    _, fused = stock_and_fused_lm(seed=0)
    requests = benchmark_batch.workload(40, (4, 300), (2, 6), fused.config.vocab_size, seed=1)
    rows, device = 16, torch.device("cpu")
    forwards = []
    bucketed = runner_mod.FusedRunner._bucketed_prefill

    def recording(self, text_model, cache, input_ids, *args, **kwargs):
        st = cache._state
        length = graphs.forward_len_bucket(input_ids.shape[1])
        forwards.append((st.batch, length, st.prefill_calls.get(length, 0)))
        return bucketed(self, text_model, cache, input_ids, *args, **kwargs)

    monkeypatch.setattr(runner_mod.FusedRunner, "_bucketed_prefill", recording)
    benchmark_batch.warm_up(fused, requests, rows, device, None, "buckets", requests[:4])
    forwards.clear()
    run = benchmark_batch.continuous(fused, requests, rows, device, None)
    assert not run["failed"] and len(forwards) >= (len(requests) if group == 1 else 1)
    assert group == 1 or any(b > 1 for b, _, _ in forwards), "no group formed"
    cold = [(b, length) for b, length, before in forwards if before < graphs.CAPTURE_AFTER]
    assert not cold, cold


def test_benchmark_batch_times_the_prefills_by_group_batch(monkeypatch, fused_on_cpu):
    """``time_parts`` on a (faked) CUDA device: events around every prompt prefill, by batch (1: alone, b: a group of
    b), their calls and prompt tokens adding up to the requests', and the report's table of them."""
    from types import SimpleNamespace

    from helpers import stock_and_fused_lm
    from scripts import benchmark_batch

    class Event:  # each span reads 2 ms
        def __init__(self, enable_timing=False):
            pass

        def record(self, stream=None):
            pass

        def elapsed_time(self, other):
            return 2.0

    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    monkeypatch.setattr(import_module("fused_batch"), "PREFILL_GROUP", 4)
    monkeypatch.setattr(import_module("fused_batch"), "GROUP_HOLD_GROUPS", 1)  # groups at the 8 rows here
    _, fused = stock_and_fused_lm(seed=0)
    requests = [([5 + i] * n, 3) for i, n in enumerate((9, 10, 11, 12, 13, 70, 20))]
    run = benchmark_batch.continuous(fused, requests, 8, SimpleNamespace(type="cuda"), None)
    by_batch = run["parts"]["prefill_by_batch"]
    # the 64-token bucket's prompts as [9, 10, 11, 12] and [13, 20] (20 found down the queue), 70 alone
    assert sorted(by_batch) == [1, 2, 4]
    assert [by_batch[b]["prompt_tokens"] for b in (1, 2, 4)] == [70, 33, 42]
    assert by_batch[4] == {"calls": 1, "prompt_tokens": 42, "replayed": 0, "eager": 1, "gpu_s": 0.002,
                           "us_per_token": 1e6 * 0.002 / 42}  # the emulation's prompt forwards: eager, no graphs
    assert all(e["replayed"] + e["eager"] == e["calls"] for e in by_batch.values())
    report = benchmark_batch.to_markdown({"model": "tiny", "dtype": "fp32", "device": "cpu", "requests": 7,
                                          "prompt_range": (9, 70), "new_range": (3, 3), "seed": 0, "batch": 4,
                                          "rows": [8], "prefill_chunk": [None], "batch_path": "fused scheduler",
                                          "stock_requests": 0, "batch_only": True, "runs": {}, "ratios": {},
                                          "parts": {"x": {"wall_s": 1.0, **run["parts"]}}, "decode_steps": {},
                                          "failed": []})
    assert "| x | 4 | 1 | 42 | 0.00 |" in report


def test_profile_chunked_prefill_runs_on_cpu(tmp_path):
    """The chunk profiler's plumbing at the tiny shape: a prompt in chunks of 16 (the last one shorter) and whole, a
    warm-up pass and the medians per chunk position, a host-time profile; the report names each chunk."""
    from scripts import profile_chunked_prefill

    results = profile_chunked_prefill.main(["--device", "cpu", "--tiny", "--prompt", "40", "--chunks", "16,40",
                                            "--repeats", "2", "--profile", "--rows", "5", "--out", str(tmp_path)])
    assert [r["tokens"] for r in results["chunks"]["16"]["median"]] == [16, 16, 8]
    assert [r["tokens"] for r in results["chunks"]["40"]["first"]] == [40]
    assert all(r["wall_ms"] > 0 for c in results["chunks"].values() for r in c["median"])
    assert "aten::" in results["by_host_time"] and "by_device_time" not in results
    md = (tmp_path / "chunks.md").read_text()
    assert "| 16 | 2 | 8 |" in md and "operators by host time" in md


def test_benchmark_moe_model_runs_on_cpu(tmp_path):
    """The whole-model MoE benchmark's plumbing at the tiny shape: the variants switched on one model, decode and
    prefill rows, the experts the router picks (no floors without a GPU's measured ceilings)."""
    from scripts import benchmark_moe_model

    results = benchmark_moe_model.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--batches", "1,3",
                                        "--new-tokens", "2", "--prefill", "8", "--repeats", "1",
                                        "--variants", "fused,stock-eager", "--out", str(tmp_path)])
    assert set(results["variants"]) == {"fused", "stock-eager"} and results["floors"] == {}
    for row in results["variants"].values():
        assert set(row["decode_ms"]) == {"1", "3"} and isinstance(row["prefill_ms"], float)
    hit = results["experts_hit"]
    assert hit["1"] == 2 and 2 < hit["3"] <= 6  # top-2 of 8: one token picks 2; three pick more (a random router)
    assert results["weights"]["expert"] == 3 * 32 * 64 * 4
    assert "| stock-eager |" in (tmp_path / "moe_model.md").read_text()
    assert 6 <= hit["prefill"] <= 8  # 8 tokens, top-2 of 8 experts each
    # the table with a GPU's floors: the prefill floor is the larger of its FLOP and read floors
    floors = {"decode_ms": {"1": 1.0, "3": 2.0}, "prefill_matmul_ms": 3.0, "prefill_read_ms": 4.0, "prefill_ms": 4.0}
    md = benchmark_moe_model.table(dict(results, floors=floors))
    assert "| floor | 1.000 | 2.000 | 4.00 |" in md and "(3.00 ms)" in md and "(4.00 ms)" in md
    assert "MoE issue's targets" not in md  # the targets are the 35B-A3B shape's


def test_benchmark_moe_model_reads_the_issue_targets():
    """The MoE targets table from a 35B-A3B run's rows (the 2026-12-02 H200 figures of docs/BENCHMARKS.md): the
    floors, stock's fastest implementation (a failed one left out), met or missed by how much."""
    from scripts import benchmark_moe_model

    results = {"meta": {"shape": "35B-A3B"}, "floors": {"decode_ms": {"1": 1.410, "8": 4.363}, "prefill_matmul_ms": 13.01},
               "variants": {"fused": {"decode_ms": {"1": 2.329, "8": 6.683}, "prefill_ms": 40.14},
                            "stock-grouped_mm": {"decode_ms": {"1": 105.94, "8": 100.26}},
                            "stock-batched_mm": {"decode_ms": {"1": 109.55, "8": "failed: out of memory"}}}}
    rows = [line for line in benchmark_moe_model.moe_targets_markdown(results) if line.startswith("| ")][1:]
    assert rows == [
        "| batch-1 decode within 1.6x its floor | 1.65x | at most 1.6x | missed (by 0.05x) |",
        "| batch-1 decode at least 20x stock's fastest experts implementation | 45.49x | at least 20x | met |",
        "| batch-8 decode within 2x its floor | 1.53x | at most 2x | met |",
        "| prefill within 2x the active-FLOP floor | 3.09x | at most 2x | missed (by 1.09x) |",
    ]


def _children_in_process(monkeypatch, capsys):
    """Make `subprocess.run` (as `benchmark_latency.cold_start` calls it) run the script's `main` in this process on
    the child's own arguments, recording each call's command line and Triton cache directory: a fresh interpreter per
    child costs ~15 s on CI's cores, and the script's own argument handling is what is under test."""
    calls = []

    def run(cmd, env, capture_output, text):
        assert cmd[:2] == [sys.executable, str(REPO / "scripts" / "benchmark_latency.py")], cmd
        calls.append((cmd[2:], env["TRITON_CACHE_DIR"]))
        capsys.readouterr()
        benchmark_latency.main(cmd[2:])
        return subprocess.CompletedProcess(cmd, 0, capsys.readouterr().out, "")

    monkeypatch.setattr(subprocess, "run", run)
    return calls


def test_benchmark_decode_only_on_cpu(tmp_path, monkeypatch, capsys):
    """`--lengths ''` skips the forward runs; decode reports stock, fused without graphs and fused; `--new-shapes`
    times the first and the repeat call at each new shape for both models, and profiles the fused first call;
    `--long-context` times prefill and decode at a long prompt; `--cold-start` runs its children (here in this
    process, with the command line and environment the real subprocess would get: see `_children_in_process`)."""
    children = _children_in_process(monkeypatch, capsys)
    benchmark_latency.main(["--shapes", "tiny", "--device", "cpu", "--dtype", "float32", "--lengths", "",
                            "--requests", "0", "--decode-batches", "2", "--new-tokens", "3", "--decode-repeats", "1",
                            "--new-shapes", "3x5", "--long-context", "40", "--cold-start", "fused",
                            "--out", str(tmp_path)])
    tiny = json.loads((tmp_path / "results.json").read_text())["models"]["tiny"]
    assert tiny["forward"] == {"stock": {}, "fused-eager": {}, "fused": {}} and "memory" not in tiny
    assert set(tiny["decode"]["2"]) == {"stock", "fused-eager", "fused"}
    new = tiny["new_shapes"]["3x5"]
    assert set(new) == {"stock", "fused"} and all(r["first_s"] > 0 and r["repeat_s"] > 0 for r in new.values())
    assert all(math.isclose(r["stall_s"], r["first_s"] - r["repeat_s"]) for r in new.values())
    assert "cumulative" in (tmp_path / "profile_tiny" / "first_call_3x5.txt").read_text()
    long = tiny["long_context"]["40"]
    assert set(long) == {"stock", "fused"}  # no floor row without a GPU's measured ceilings
    assert all(r["prefill_ms"] > 0 and math.isfinite(r["decode_ms_per_token"]) for r in long.values())
    assert all(r["decode_ms_range"][0] <= r["decode_ms_per_token"] <= r["decode_ms_range"][1] for r in long.values())
    assert all(r["first_call_s"] > 0 and math.isfinite(r["first_call_extra_s"]) for r in long.values())
    cold = tiny["cold_start"]["fused"]
    assert set(cold) == {"cold", "warm"} and all(c["build_s"] > 0 and c["first_s"] > 0 for c in cold.values())
    (cold_argv, cold_dir), (warm_argv, warm_dir) = children
    assert cold_argv == warm_argv and cold_argv[:2] == ["--cold-child", "fused"] and "tiny" in cold_argv
    assert cold_dir == warm_dir and not Path(cold_dir).exists()  # one cache for both phases, removed afterwards
    md = (tmp_path / "results.md").read_text()
    assert "| tiny | 2 |" in md and "| tiny | 3x5 |" in md and "| tiny | fused |" in md and "| tiny | 40 |" in md
    assert (tmp_path / "decode.png").stat().st_size > 1000


def test_benchmark_floors_of_long_contexts():
    """The decode floor's extra bytes at 4B and 32,768 tokens: 8 full-attention layers' K and V (4 heads of 256, bf16)
    plus 24 DeltaNet layers' fp32 states (32 heads of 128 x 128) and conv windows (8,192 channels x 4, bf16)."""
    from transformers import Qwen3_5TextConfig

    from scripts.common import real_text_kwargs

    config = Qwen3_5TextConfig(**real_text_kwargs("4B"))
    kv = 8 * 2 * 32768 * 4 * 256 * 2
    deltanet = 24 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 4 * 2)
    assert benchmark_latency.context_bytes(config, 32768, torch.bfloat16) == kv + deltanet
    assert benchmark_latency.attention_flops(config, 32768) == 8 * 2.0 * 32768**2 * 16 * 256


def test_benchmark_gpu_device_map_splits_layers_evenly():
    """`--gpus N`: the map handed to accelerate (the dispatch itself needs the GPUs; see tests/model/test_multi_gpu.py)."""
    stock, _ = benchmark_latency.build_pair("tiny", None, torch.device("cpu"), torch.float32)
    device_map = benchmark_latency.gpu_device_map(stock, 2)
    layers = [device_map[f"model.layers.{i}"] for i in range(len(stock.model.layers))]
    assert layers == sorted(layers) and layers.count(0) == layers.count(1)
    assert device_map["model.embed_tokens"] == 0 and device_map["model.norm"] == 1
    assert device_map["lm_head"] == 0  # tied to the embeddings: kept with them
    every = {f"model.{name}" for name, _ in stock.model.named_children() if name != "layers"} | {"lm_head"}
    assert every <= set(device_map)  # accelerate needs every module placed


def test_benchmark_gemv_shapes_and_cpu_refusal():
    """The decode linears of the 4B shape as the fused step on the H200 recorded them (describe()['decode']
    ['linears'], 2026-11-30: 12352x2560, 2560x4096, 18432x2560 gate|up, 2560x9216, 10240x2560), and a clear refusal
    without a GPU."""
    from scripts import benchmark_gemv

    shapes = benchmark_gemv.decode_linears("4B")
    assert shapes["deltanet_in"] == (12352, 2560, False)
    assert shapes["deltanet_out"] == shapes["attn_out"] == (2560, 4096, False)
    assert shapes["gate_up"] == (18432, 2560, True)
    assert shapes["down"] == (2560, 9216, False)
    assert shapes["attn_in"] == (10240, 2560, False)
    assert shapes["lm_head"] == (248320, 2560, False)
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            benchmark_gemv.main(["--shapes", "0.8B"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_probe_batch_overlap_refuses_without_a_gpu():
    from scripts import probe_batch_overlap

    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        probe_batch_overlap.main(["--model", "4b"])


def test_benchmark_moe_runs_on_cpu(tmp_path):
    """The MoE block benchmark end to end at the tiny shape (our kernels under the interpreter): a decode and a
    prefill token count, every variant timed or its failure reported, the floors, and ours equal to stock's block."""
    from scripts import benchmark_moe

    results = benchmark_moe.main(["--shape", "tiny", "--device", "cpu", "--dtype", "float32", "--tokens", "1,17",
                                  "--repeats", "1", "--out", str(tmp_path)])
    decode, prefill = results["tokens"]["1"], results["tokens"]["17"]
    assert decode["floor"]["kind"] == "weight read" and prefill["floor"]["kind"] == "active flops"
    for r in (decode, prefill):
        assert {"fused", "experts-ours", "stock-eager", "experts-stock-eager"} <= set(r["times"]), r["errors"]
        for impl in results["meta"]["stock_impls"]:
            assert f"stock-{impl}" in {**r["times"], **r["errors"]}
        assert r["rel_err_vs_stock_eager"] < 2e-5 and r["floor"]["block_ms"] > 0
    assert "| 17 | fused |" in (tmp_path / "moe.md").read_text()


def test_tune_moe_gemm_runs_on_cpu(tmp_path, monkeypatch):
    """The MoE tile tuner end to end at the tiny shape (interpreter), two candidates of each kind: every candidate
    timed, each prefill candidate's output the default tiles' up to summation order (float32), the floors."""
    from scripts import tune_moe_gemm

    monkeypatch.setattr(tune_moe_gemm, "GATE_UP_CANDIDATES", [(64, 64, 64, 4, 4), (16, 16, 32, 4, 1)])
    monkeypatch.setattr(tune_moe_gemm, "DOWN_CANDIDATES", [(64, 128, 64, 4, 3), (16, 16, 32, 4, 1)])
    monkeypatch.setattr(tune_moe_gemm, "DECODE_CANDIDATES", [((16, 256, 4, 1), (4, 256, 4, 1)),
                                                             ((4, 64, 4, 2), (2, 64, 4, 2))])
    results = tune_moe_gemm.main(["--shape", "tiny", "--device", "cpu", "--tokens", "40", "--decode-tokens", "1",
                                  "--repeats", "1", "--out", str(tmp_path)])
    prefill, decode = results["prefill"]["40"], results["decode"]["1"]
    assert len(prefill["candidates"]) == 4 and len(decode["candidates"]) == 2
    for row in prefill["candidates"]:
        assert row.get("ms", 0) > 0 and row["rel_diff_vs_default"] < 1e-6, row
    assert all(row.get("ms", 0) > 0 for row in decode["candidates"]), decode
    assert prefill["floors"]["read_ms"] > 0 and decode["floor_ms"] > 0
    assert "| 40 | gate_up | (16, 16, 32, 4, 1) |" in (tmp_path / "tune_moe.md").read_text()


def _ab(tmp_path, *variants, batches="1,2", shape="tiny"):
    args = ["--shapes", shape, "--device", "cpu", "--dtype", "float32", "--batches", batches, "--new-tokens", "3",
            "--repeats", "1", "--out", str(tmp_path)]
    for v in variants:
        args += ["--variant", v]
    return ab_decode.main(args)


def test_ab_decode_runs_the_fused_decode_on_cpu(tmp_path, fused_on_cpu):
    """Through the fused decode loop (kernels swapped for their references): a setting that changes only how often
    the host reads the stop flags gives the baseline's tokens, and every constant is restored afterwards."""
    results = _ab(tmp_path, "base:", "every1:fused_generate.STOP_CHECK_EVERY=1,fused_ops_attention._DA_MIN_SPLIT=32")
    tiny = results["models"]["tiny"]
    assert set(tiny) == {"1", "2"} and set(tiny["2"]) == {"base", "every1"}
    assert tiny["1"]["base"]["delta_ms"] == 0.0 and tiny["1"]["base"]["first_divergence"] is None
    assert tiny["2"]["every1"]["first_divergence"] is None
    assert tiny["2"]["every1"]["min"] <= tiny["2"]["every1"]["ms_per_token"] <= tiny["2"]["every1"]["max"]
    assert generate_mod.STOP_CHECK_EVERY == 8 and import_module("fused_ops_attention")._DA_MIN_SPLIT == 64
    assert "| tiny | 2 | every1 |" in (tmp_path / "ab.md").read_text()
    assert json.loads((tmp_path / "ab.json").read_text())["meta"]["variants"][1].startswith("every1:")


def test_ab_decode_takes_the_moe_shapes(tmp_path, fused_on_cpu):
    """The MoE model through the same A/B (the method that chose the MoE decode GEMVs' tiles): its decode step runs
    fused (emulated), a tile variant is applied and undone."""
    moe = import_module("fused_ops_moe")
    shipped = (moe._DECODE_GATE_UP, moe._DECODE_DOWN_ONE_TOKEN)
    results = _ab(tmp_path, "base:", "tiles:fused_ops_moe._DECODE_GATE_UP=(16, 256, 4, 1),"
                  "fused_ops_moe._DECODE_DOWN_ONE_TOKEN=(4, 256, 4, 1)", shape="tiny-moe")
    rows = results["models"]["tiny-moe"]
    assert set(rows) == {"1", "2"} and rows["2"]["tiles"]["first_divergence"] is None
    assert (moe._DECODE_GATE_UP, moe._DECODE_DOWN_ONE_TOKEN) == shipped


def test_ab_decode_applies_settings_and_restores_them_on_error(tmp_path, fused_on_cpu):
    """A setting the decode loop cannot run with fails inside the run (so it was applied), and is undone."""
    with pytest.raises(ZeroDivisionError):
        _ab(tmp_path, "base:", "broken:fused_generate.STOP_CHECK_EVERY=0", batches="1")
    assert generate_mod.STOP_CHECK_EVERY == 8


@pytest.mark.parametrize("spec, match", [
    ("nocolon", "a variant is NAME:"),
    ("x:torch.cuda=1", "module 'torch' is not one of"),
    ("x:fused_ops_gemv._NO_SUCH=1", "fused_ops_gemv has no constant '_NO_SUCH'"),
    ("x:fused_ops._GDR_BLOCK_V=16", "module 'fused_ops' is not one of"),  # the facade: constants are set where read
    ("x:fused_ops_deltanet._GDR_BLOCK_V=sixteen", "must be a Python literal, got 'sixteen'"),
    ("x:fused_ops_deltanet._GDR_BLOCK_V", "expected MODULE.CONSTANT=VALUE"),
])
def test_ab_decode_rejects_bad_variants(spec, match):
    with pytest.raises(ValueError, match=match):
        ab_decode.main(["--shapes", "tiny", "--device", "cpu", "--variant", spec])


def test_ab_decode_variant_values_may_hold_commas():
    """A tuple or set value keeps its commas; the next item starts only at `MODULE.CONSTANT=`."""
    name, settings = ab_decode.parse_variant(
        "v:fused_ops_attention._DA_MIN_SPLIT=32, fused_ops_runtime.PDL_ENABLED=False,fused_generate.STOP_CHECK_EVERY=(1, 2),"
        "fused_ops_gemv._GEMV_MAX_M={'a', 'b'}", ab_decode.variant_modules())
    assert name == "v"
    assert [(c, v) for _, c, v in settings] == [("_DA_MIN_SPLIT", 32), ("PDL_ENABLED", False),
                                                ("STOP_CHECK_EVERY", (1, 2)), ("_GEMV_MAX_M", {"a", "b"})]


def test_ab_decode_rejects_repeated_names():
    with pytest.raises(ValueError, match="variant names must differ"):
        ab_decode.main(["--shapes", "tiny", "--device", "cpu", "--variant", "a:", "--variant", "a:"])


def _run_shards(root, env_extra, *paths):
    """`scripts/run_cuda_tests.sh` copied into `root`, a stand-in repository of its own, and run there."""
    (root / "scripts").mkdir(parents=True, exist_ok=True)
    shutil.copy(REPO / "scripts" / "run_cuda_tests.sh", root / "scripts")
    (root / "pytest.ini").write_text("[pytest]\nmarkers =\n    cuda: needs a GPU\n")
    env = {**os.environ, "PYTHON": sys.executable, "LOGS": str(root / "logs"), **env_extra}
    return subprocess.run(["bash", "scripts/run_cuda_tests.sh", *paths], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_run_cuda_tests_deals_every_id_once_and_reports_failures(tmp_path):
    """`run_cuda_tests.sh` gives each collected test to exactly one shard, runs them all, and fails when one fails
    (on CPU, with the marker filter off, over a test file made here: two shards pass, one fails)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_probe.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(4))\ndef test_ok(i):\n    pass\n\n"
        "def test_bad():\n    assert 1 == 2, 'probe failure'\n")
    res = _run_shards(tmp_path, {"SHARDS": "3", "MARK": ""})
    assert res.returncode == 1, res.stdout + res.stderr
    assert "collected 5 tests" in res.stdout
    logs = tmp_path / "logs"
    dealt = [line for i in range(3) for line in (logs / f"ids_{i}.txt").read_text().splitlines()]
    assert sorted(dealt) == sorted((logs / "ids.txt").read_text().splitlines()) and len(set(dealt)) == 5
    assert res.stdout.count("FAILED (pytest exit 1)") == 1 and "test_bad" in res.stdout
    assert res.stdout.count(": ok: ") == 2


def test_run_cuda_tests_parts_split_the_ids_between_calls(tmp_path):
    """PART=i/n: the n parts together hold every collected id once (a suite longer than one device call)."""
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_probe.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(7))\ndef test_ok(i):\n    pass\n")
    parts = []
    for i in (1, 2, 3):
        res = _run_shards(tmp_path, {"SHARDS": "2", "MARK": "", "PART": f"{i}/3"})
        assert res.returncode == 0 and f"part {i}/3" in res.stdout, res.stdout + res.stderr
        parts.append((tmp_path / "logs" / "ids.txt").read_text().splitlines())
    assert [len(p) for p in parts] == [3, 2, 2] and len({i for p in parts for i in p}) == 7
    res = _run_shards(tmp_path, {"PART": "3/2"})
    assert res.returncode == 2 and "PART must be i/n" in res.stderr


def test_run_cuda_tests_refuses_bad_settings_and_empty_collections(tmp_path):
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "test_plain.py").write_text("def test_plain():\n    pass\n")
    res = _run_shards(tmp_path, {})  # no CUDA-marked test in it
    assert res.returncode == 2 and "nothing collected" in res.stderr
    res = _run_shards(tmp_path, {"SHARDS": "0"})
    assert res.returncode == 2 and "SHARDS must be a positive integer, got '0'" in res.stderr
    res = _run_shards(tmp_path, {"CAP": "ten"})
    assert res.returncode == 2 and "got 'ten'" in res.stderr



def test_profile_rows_are_per_token_differences_of_two_calls():
    """`--profile-decode` and benchmark_moe_model's profile: a kernel's launches and GPU time per generated token are
    those of the long call minus the 1-token call over the extra tokens (the prompt cancels); a kernel only the
    prompt runs is left out; largest time first. `kernel_times` reads the profiler's CUDA rows only."""
    import types

    short = {"prompt_gemm": (10, 500.0), "gemv": (4, 40.0)}
    long = {"prompt_gemm": (10, 500.0), "gemv": (44, 440.0), "norm": (9, 18.0)}
    rows = benchmark_latency.per_token_kernels(short, long, 4)
    assert rows == {"gemv": (10.0, 100.0), "norm": (2.25, 4.5)} and list(rows) == ["gemv", "norm"]
    cuda, cpu = types.SimpleNamespace(name="CUDA"), types.SimpleNamespace(name="CPU")
    events = [types.SimpleNamespace(key="k", count=3, self_device_time_total=7.5, device_type=cuda),
              types.SimpleNamespace(key="aten::mm", count=1, self_device_time_total=0.0, device_type=cpu)]
    assert benchmark_latency.kernel_times(types.SimpleNamespace(key_averages=lambda: events)) == {"k": (3, 7.5)}
