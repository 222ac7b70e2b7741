"""The kernel choices shipped per card (`fused_tuning`, `fused_tuned_choices.TUNED`, written by
scripts/record_tuning.py): the table is current for this code and the installed fla, is used only on its own card,
seeds fla's autotuners without overriding them, and `small_linear` reads it after the card's own record."""

import importlib.metadata
import importlib.util
import logging
import types

import pytest
import torch

from helpers import fused_ops
from scripts import record_tuning
from scripts.common import import_module

fused_tuning = import_module("fused_tuning")
fused_ops_gemv = import_module("fused_ops_gemv")
TUNED = import_module("fused_tuned_choices").TUNED
CARD = "Test Card X1"
FLA_KERNEL = "fla.ops.common.chunk_o:chunk_fwd_kernel_o"


def props(name=CARD, major=9, minor=0):
    return types.SimpleNamespace(name=name, major=major, minor=minor)


# fla's autotuners exist only where flash-linear-attention is installed: a GPU machine (requirements-gpu.txt), not
# the README's CPU set-up, which CI runs.
needs_fla = pytest.mark.skipif(importlib.util.find_spec("fla") is None,
                               reason="needs flash-linear-attention, which the README's CPU set-up (CI) leaves out")


def entry(choices=None, fla_kernels=None, candidates=None, pdl=True, fla_version=None, capability=(9, 0)):
    installed = importlib.metadata.version("flash-linear-attention") if importlib.util.find_spec("fla") else None
    return {"name": CARD, "capability": list(capability),
            "small_linear": {"candidates": candidates or fused_ops_gemv.candidates_fingerprint(), "pdl": pdl,
                             "choices": choices or {}},
            "fla": {"version": fla_version or installed or "absent", "kernels": fla_kernels or {}}}


@pytest.fixture
def card(monkeypatch):
    """A fake CUDA card named CARD (sm_90) and an empty table; returns a setter for the table's entry."""
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props())
    monkeypatch.setattr(fused_tuning, "TUNED", {})
    monkeypatch.setattr(fused_tuning, "_seeded", set())
    monkeypatch.setattr(fused_ops_gemv, "_shipped", {})
    monkeypatch.setattr(fused_ops_gemv, "pdl_enabled", lambda device: True)
    return lambda e: fused_tuning.TUNED.__setitem__(CARD, e)


CUDA0 = torch.device("cuda", 0)
KEY = (1, 2560, 4096, False, torch.bfloat16, CUDA0)


def test_the_shipped_table_is_current():
    """Every card in the table was timed over this code's candidate lists, and every choice is a current candidate:
    a change of `_GEMV_CONFIGS` / `_SKINNY_CONFIGS` without re-running scripts/record_tuning.py fails here."""
    assert TUNED, "fused_tuned_choices.TUNED is empty: run scripts/record_tuning.py on a GPU"
    for name, card_entry in TUNED.items():
        assert card_entry["name"] == name and len(card_entry["capability"]) == 2
        linears = card_entry["small_linear"]
        assert linears["candidates"] == fused_ops_gemv.candidates_fingerprint(), name
        assert linears["choices"], name
        for key, saved in linears["choices"].items():
            assert fused_ops_gemv._parse_choice(saved) is not None, (name, key, saved)


def _shipped_fla_kernels():
    """(card name, kernel name, autotuner, rows) of every shipped fla entry, when the installed fla matches."""
    for name, card_entry in TUNED.items():
        flas = card_entry["fla"]
        if not fused_tuning.fla_versions_match(flas["version"]):
            pytest.skip(f"the table's fla is {flas['version']}; the installed one differs")
        assert flas["kernels"], name
        for kernel, rows in flas["kernels"].items():
            yield name, kernel, fused_tuning._autotuner(kernel), rows


def test_the_shipped_fla_kernels_are_autotuners_of_the_installed_fla():
    """Each recorded fla kernel is an autotuner of the installed fla (same minor version), each key at least as long
    as its key names (the tensors' dtypes follow them)."""
    for _, kernel, tuner, rows in _shipped_fla_kernels():
        assert tuner is not None, kernel
        for key, _ in rows:
            assert len(key) >= len(tuner.keys), (kernel, key)


@pytest.mark.cuda
def test_the_shipped_fla_configs_are_configs_of_the_installed_fla_on_the_card():
    """On the card the table names: each recorded config is one of the autotuner's configs (fla builds its config
    list from the card's shared memory, so only a GPU of that kind can check this)."""
    card = torch.cuda.get_device_properties(0).name
    if card not in TUNED:
        pytest.skip("the table does not name this card")
    for name, kernel, tuner, rows in _shipped_fla_kernels():
        for _, saved in rows if name == card else ():
            assert any(fused_tuning._same_config(c, saved) for c in tuner.configs), (kernel, saved)


def test_shipped_choices_only_for_the_same_card_candidates_and_pdl(card, monkeypatch):
    config = fused_ops_gemv._GEMV_CONFIGS[2]
    card(entry(choices={fused_ops_gemv._record_key(KEY): list(config)}))
    assert fused_ops_gemv.shipped_choice(KEY) == config
    assert fused_ops_gemv.shipped_choice((2, *KEY[1:])) is None  # not recorded: timed
    for other in (entry(choices={fused_ops_gemv._record_key(KEY): list(config)}, candidates="0" * 16),
                  entry(choices={fused_ops_gemv._record_key(KEY): list(config)}, pdl=False)):
        card(other)
        fused_ops_gemv._shipped.clear()
        assert fused_ops_gemv.shipped_choice(KEY) is None
    card(entry(choices={fused_ops_gemv._record_key(KEY): list(config)}))
    fused_ops_gemv._shipped.clear()
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props(major=8))
    assert fused_tuning.card_entry(CUDA0) is None and fused_ops_gemv.shipped_choice(KEY) is None
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props())
    monkeypatch.setattr(fused_tuning, "USE_SHIPPED", False)
    fused_ops_gemv._shipped.clear()
    assert fused_ops_gemv.shipped_choice(KEY) is None
    monkeypatch.setattr(fused_tuning, "USE_SHIPPED", True)
    monkeypatch.setattr(fused_ops_gemv, "RECORD_CHOICES", False)  # a benchmark that times every shape
    fused_ops_gemv._shipped.clear()
    assert fused_ops_gemv.shipped_choice(KEY) is None
    assert fused_tuning.card_entry(torch.device("cpu")) is None


def _fla_tuner():
    tuner = fused_tuning._autotuner(FLA_KERNEL)
    assert tuner is not None and len(tuner.configs) > 1
    return tuner


@needs_fla
def test_fla_autotuners_are_seeded_once_and_keep_what_they_hold(card, monkeypatch, caplog):
    tuner = _fla_tuner()
    first, second = tuner.configs[0], tuner.configs[-1]
    saved = lambda c: {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}  # noqa: E731
    new_key, held_key = ["test-key", 1], ["test-held", 2]
    monkeypatch.setattr(tuner, "cache", {tuple(held_key): first})
    card(entry(fla_kernels={FLA_KERNEL: [[new_key, saved(second)], [held_key, saved(second)],
                                         [["test-unknown"], {"kwargs": {"BK": -1}, "num_warps": 1, "num_stages": 1}]],
                            "fla.ops.not_a_module:kernel": [[["x"], saved(first)]]}))
    with caplog.at_level(logging.INFO, logger=fused_tuning.__name__):
        assert fused_tuning.seed_fla_autotuners(CUDA0) == 1
    assert tuner.cache[tuple(new_key)] is second  # the autotuner's own Config object
    assert tuner.cache[tuple(held_key)] is first  # what it held is kept
    assert tuple(["test-unknown"]) not in tuner.cache  # a config this fla does not have is skipped
    assert f"measured on {CARD} for 1 tuning keys" in caplog.text
    assert fused_tuning.seed_fla_autotuners(CUDA0) == 0  # once per process and card


@needs_fla
@pytest.mark.parametrize("why", ["fla_cache_mode", "fla_version", "switched_off"])
def test_fla_autotuners_are_left_alone(card, monkeypatch, why):
    tuner = _fla_tuner()
    monkeypatch.setattr(tuner, "cache", {})
    c = tuner.configs[0]
    rows = [[["test-key"], {"kwargs": dict(c.kwargs), "num_warps": c.num_warps, "num_stages": c.num_stages}]]
    card(entry(fla_kernels={FLA_KERNEL: rows}, fla_version="0.1.0" if why == "fla_version" else None))
    if why == "fla_cache_mode":  # the user turned fla's own config cache on: its configs win
        monkeypatch.setenv("FLA_CACHE_MODE", "fuzzy")
    if why == "switched_off":
        monkeypatch.setattr(fused_tuning, "USE_SHIPPED", False)
    assert fused_tuning.seed_fla_autotuners(CUDA0) == 0
    assert tuner.cache == {}


def test_record_tuning_writes_a_table_that_reads_back_and_keeps_other_cards(tmp_path):
    path = tmp_path / "fused_tuned_choices.py"
    a = {"name": "Card A", "capability": [9, 0], "small_linear": {"choices": {"1x8x8-bfloat16": "cublas"}},
         "fla": {"kernels": {"fla.x:k": [[[16, True, "torch.bfloat16"], {"kwargs": {"BV": 32}, "num_warps": 4,
                                                                           "num_stages": 2}]]}}}
    record_tuning.write_table(path, a)
    record_tuning.write_table(path, {**a, "name": "Card B"})
    record_tuning.write_table(path, {**a, "capability": [9, 1]})  # Card A again: replaced
    scope = {}
    exec(path.read_text(), scope)  # noqa: S102 - the file the test just wrote
    assert scope["TUNED"]["Card A"] == {**a, "capability": [9, 1]} and scope["TUNED"]["Card B"]["name"] == "Card B"
    assert path.read_text().startswith(record_tuning.HEADER)


def _recorded_entry(shapes, choices, fla_rows, torch_version="2.11.0"):
    return {"name": "Card A", "capability": [9, 0],
            "recorded": {"date": "2026-12-02", "torch": torch_version, "triton": "3.6.0", "fla": "0.6.0",
                         "shapes": shapes, "rows": [1, 32], "dtype": "bfloat16"},
            "small_linear": {"candidates": "abc", "pdl": True, "choices": choices},
            "fla": {"version": "0.6.0", "kernels": {"fla.x:k": fla_rows}}}


def test_record_tuning_add_extends_the_cards_entry_only_when_recorded_alike(tmp_path):
    path = tmp_path / "fused_tuned_choices.py"
    cfg = {"kwargs": {"BV": 32}, "num_warps": 4, "num_stages": 2}
    record_tuning.write_table(path, _recorded_entry(["4B"], {"1x8x8-bfloat16": "cublas"}, [[[16], cfg]]))
    later = _recorded_entry(["27B"], {"1x9x9-bfloat16": ["gemv", 8, 512, 4, False, 1]},
                            [[[16], {**cfg, "num_warps": 8}], [[48], cfg]])
    record_tuning.write_table(path, later, add=True)
    scope = {}
    exec(path.read_text(), scope)  # noqa: S102 - the file the test just wrote
    entry = scope["TUNED"]["Card A"]
    assert entry["recorded"]["shapes"] == ["4B", "27B"]
    assert entry["small_linear"]["choices"] == {"1x8x8-bfloat16": "cublas",
                                                "1x9x9-bfloat16": ["gemv", 8, 512, 4, False, 1]}
    assert entry["fla"]["kernels"]["fla.x:k"] == [[[16], {**cfg, "num_warps": 8}], [[48], cfg]]  # this run's wins
    with pytest.raises(SystemExit, match=r"recorded\.torch: '2\.11\.0' in the table, '2\.12\.0' now"):
        record_tuning.write_table(path, _recorded_entry(["9B"], {}, [], torch_version="2.12.0"), add=True)
    record_tuning.write_table(path, _recorded_entry(["9B"], {}, []))  # without --add: replaced
    exec(path.read_text(), scope)  # noqa: S102
    assert scope["TUNED"]["Card A"]["recorded"]["shapes"] == ["9B"]


@pytest.mark.parametrize("shape, cls, hidden", [("4B", "Qwen3_5FusedForCausalLM", 2560),
                                                ("35B-A3B", "Qwen3_5MoeFusedForCausalLM", 2048)])
def test_record_tuning_builds_each_shape_at_its_real_widths_with_4_layers(shape, cls, hidden):
    model = record_tuning.build(shape, "meta")
    assert type(model).__name__ == cls and model.config.hidden_size == hidden
    assert model.config.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert model.lm_head.weight.dtype == torch.bfloat16 and model.config.fused_kernels


def test_record_tuning_arguments():
    assert record_tuning.parse_rows("1-4,8") == [1, 2, 3, 4, 8]
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="needs a CUDA GPU"):
            record_tuning.main(["--shapes", "4B"])


@pytest.mark.cuda
def test_a_shipped_choice_is_run_without_timing(card, tmp_path, monkeypatch):
    """On the GPU, with no record on disk: a shape the table names runs the shipped kernel, untimed, and the skinny
    configs 2-16 rows may run are compiled in the same pool: here both candidates (its 2-row choice among them),
    since the table has no choice for 3-16 rows."""
    import triton

    monkeypatch.setattr(triton.knobs.cache, "dir", str(tmp_path))
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})
    monkeypatch.setattr(fused_ops_gemv, "_records", {})
    real = torch.cuda.get_device_properties(0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda device=None: props(major=real.major, minor=real.minor))
    monkeypatch.setattr(fused_ops_gemv, "pdl_enabled", fused_ops.pdl_enabled)
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(1, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    w = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    one, two = fused_ops_gemv._GEMV_CONFIGS[1], fused_ops_gemv._SKINNY_CONFIGS[0]
    key1, key2 = (1, 1024, 512, False, x.dtype, x.device), (2, 1024, 512, False, x.dtype, x.device)
    card(entry(choices={fused_ops_gemv._record_key(key1): list(one),
                        fused_ops_gemv._record_key(key2): ["skinny", *two]}, capability=(real.major, real.minor)))
    fused_tuning.TUNED[CARD]["small_linear"]["pdl"] = fused_ops.pdl_enabled(x.device)
    monkeypatch.setattr(fused_ops_gemv, "_time_candidates",
                        lambda *a: (_ for _ in ()).throw(AssertionError("timed a shipped choice")))
    pooled = []
    real_compile = fused_ops_gemv.compile_in_parallel
    monkeypatch.setattr(fused_ops_gemv, "compile_in_parallel", lambda w_: (pooled.extend(w_), real_compile(w_)))
    y = fused_ops.small_linear(x, w)
    assert fused_ops_gemv._small_linear_choice[key1] == one
    # the 1-row kernel and the 2-16 row candidates (the 2-row pick among them), compiled together
    assert [p.args[4] for p in pooled] == [one, *fused_ops_gemv._skinny_candidates(False)]
    assert two in fused_ops_gemv._skinny_candidates(False)
    torch.testing.assert_close(y, fused_ops.small_linear_ref(x, w), rtol=2e-2, atol=2e-2)
    x2 = torch.randn(2, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
    fused_ops.small_linear(x2, w)
    assert fused_ops_gemv._small_linear_choice[key2] == two


@pytest.mark.cuda
def test_a_real_width_model_on_the_named_card_runs_fla_on_the_shipped_configs(monkeypatch):
    """On a card the table names: a fused model at 0.8B's widths (4 layers) says so in `describe()`, and its prompt
    and decode call fla with exactly the recorded tuning keys (a key the autotuner had to add itself would mean the
    recorded keys do not match the real calls, so fla would autotune), and its decode linears take the shipped picks."""
    from scripts.common import real_text_kwargs

    card = torch.cuda.get_device_properties(0).name
    if card not in TUNED:
        pytest.skip("the table does not name this card")
    configuration, modeling = import_module("configuration_qwen3_5_fused"), import_module("modeling_qwen3_5_fused")
    tuners = {}
    for kernel, rows in TUNED[card]["fla"]["kernels"].items():
        tuner = fused_tuning._autotuner(kernel)
        recorded = {tuple(key) for key, _ in rows}
        monkeypatch.setattr(tuner, "cache", {k: v for k, v in tuner.cache.items() if k not in recorded})
        tuners[kernel] = (tuner, recorded | set(tuner.cache))
    monkeypatch.setattr(fused_tuning, "_seeded", set())
    monkeypatch.setattr(fused_ops_gemv, "_small_linear_choice", {})
    monkeypatch.setattr(fused_ops_gemv, "_time_candidates",
                        lambda *a: (_ for _ in ()).throw(AssertionError("timed a shape the table names")))
    config = configuration.Qwen3_5FusedTextConfig(**real_text_kwargs("0.8B", num_hidden_layers=4), fused_kernels=True)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = modeling.Qwen3_5FusedForCausalLM._from_config(config, dtype=torch.bfloat16).eval()
    assert model.describe()["decode"]["shipped_choices"] == card
    ids = torch.randint(3, config.vocab_size, (1, 40), device="cuda")
    with torch.inference_mode():
        model.generate(input_ids=ids, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    for kernel, (tuner, allowed) in tuners.items():
        assert set(tuner.cache) <= allowed, (kernel, set(tuner.cache) - allowed)
    assert fused_ops_gemv.small_linear_choices()  # the decode linears ran, on shipped picks (no timing)
