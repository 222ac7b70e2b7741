"""Train the small Qwen3.5 that ships at the repo root (the "embedded default" checkpoint).

Steps, all deterministic (fixed seeds, two CPU threads by default):

1. corpus: ``data/train.txt`` / ``data/heldout.txt`` from ``scripts/make_corpus.py`` (built here when missing):
   the source code of the Python standard library plus the ``pydoc`` help topics, one document after another, each
   followed by the text ``<|endoftext|>``;
2. tokenizer: byte-level BPE trained with the ``tokenizers`` library on the train documents (vocab 4096,
   Qwen-style pre-tokenisation, so indentation runs become single tokens; Qwen-style special tokens and a ChatML
   chat template);
3. model: a stock ``transformers`` ``Qwen3_5ForCausalLM`` text backbone trained in fp32 on random 256-token
   windows of the tokenised train split (``<|endoftext|>`` between documents, so the model learns to stop);
4. export: a stock composite ``Qwen3_5ForConditionalGeneration`` (the layout of real Qwen3.5 checkpoints) holding
   the trained backbone as ``model.language_model.*`` and a tiny, randomly initialised (untrained) vision tower
   as ``model.visual.*``, saved with ``save_pretrained``; then the fused-repo keys are added to ``config.json``;
5. evaluation: held-out NLL per token and top-1 accuracy of the SAVED checkpoint, reloaded as a stock
   ``AutoModelForCausalLM`` in fp32 (``heldout_nll``), written with the run's facts to ``training_report.json``.

Reproduce the shipped checkpoint (writes into the repo root)::

    python scripts/train_tiny_model.py

The checkpoint written here has no multi-token-prediction head; ``scripts/train_mtp_head.py`` trains the shipped one
for it afterwards and adds it (``mtp.*``, ``mtp_num_hidden_layers``) to the same files.

On CPU the stock Qwen3.5 linear-attention layers would call flash-linear-attention's Triton kernels when ``fla``
is installed, which cannot run on CPU tensors; ``torch_linear_attention()`` swaps in the plain torch
implementations that transformers ships for the duration of the run.
"""

import argparse
import contextlib
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

# Sleep instead of spinning while an OpenMP worker waits for the others. On a shared box (other processes on the
# same cores) spinning workers starve the descheduled one and a step can get 10x slower; numerics do not change.
# Read once, when torch starts OpenMP, so it is set before the import.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]

EOS = "<|endoftext|>"  # document separator in data/*.txt, end-of-sequence and padding token
SPECIAL_TOKENS = [
    EOS,
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# ChatML, as Qwen models use it. Message content may be a string or a list of parts
# ({"type": "text", "text": ...}, {"type": "image"}, {"type": "video"}); images and videos become
# <|vision_start|><|image_pad|><|vision_end|> (resp. <|video_pad|>) placeholders for a processor to expand.
CHAT_TEMPLATE = (
    "{%- macro render(content) -%}"
    "{%- if content is string -%}{{- content -}}"
    "{%- else -%}{%- for part in content -%}"
    "{%- if part.type == 'image' or 'image' in part or 'image_url' in part -%}"
    "{{- '<|vision_start|><|image_pad|><|vision_end|>' -}}"
    "{%- elif part.type == 'video' or 'video' in part -%}"
    "{{- '<|vision_start|><|video_pad|><|vision_end|>' -}}"
    "{%- elif 'text' in part -%}{{- part.text -}}"
    "{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{%- endmacro -%}"
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message.role + '\\n' -}}{{- render(message.content) -}}{{- '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\\n' -}}{%- endif -%}"
)

def torch_linear_attention():
    """Make the stock Qwen3.5 linear-attention layers use transformers' plain torch code (CPU-safe).

    transformers wraps these functions so that they dispatch to flash-linear-attention / causal-conv1d when
    installed; those are Triton/CUDA kernels and fail on CPU tensors. The repo's modeling file has the context
    manager that routes them back to torch (its CPU fallback uses it); this is that one.
    """
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from scripts.common import import_module

    return import_module("fused_compat").torch_reference_kernels()


def _repo_modules():
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from scripts.common import import_repo

    return import_repo()


# --------------------------------------------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------------------------------------------

EVAL_PROCEDURE = (
    "Tokenise the whole held-out text with the shipped tokenizer (no special tokens added); cut the token "
    "stream into consecutive non-overlapping windows of `window` tokens (the last, shorter window is kept if it "
    "has at least 2 tokens); run each window independently (no cache, no carried state) through the model in "
    "fp32, in batches of `batch_size` full windows; score every position except the first of each window "
    "(NLL of the true next token under log_softmax of the fp32 logits, summed in float64); report the mean NLL "
    "per scored token and the fraction of scored tokens whose argmax prediction is the true token. Also reported, "
    "from the same logits: the mean over scored positions of the largest softmax probability (how confident the "
    "argmax is)."
)


@torch.no_grad()
def heldout_nll(model, tokenizer, text: str, window: int = 256, batch_size: int = 8) -> dict:
    """Held-out NLL per token and top-1 accuracy of a causal LM on ``text`` (procedure: ``EVAL_PROCEDURE``).

    ``model`` is any causal LM returning ``.logits`` (e.g. the stock ``Qwen3_5ForCausalLM``); on CPU run it inside
    ``torch_linear_attention()``. Returns a dict with ``nll_per_token``, ``perplexity``, ``top1_accuracy``,
    ``tokens_scored``, ``windows``, ``window``, ``tokens`` and ``mean_top1_prob``.
    """
    if window < 2:
        raise ValueError(f"window must be at least 2, got {window}")
    ids = tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]
    ids = torch.tensor(ids, dtype=torch.long)
    n_full = ids.numel() // window
    full = ids[: n_full * window].view(n_full, window)
    tail = ids[n_full * window :]
    batches = [full[i : i + batch_size] for i in range(0, n_full, batch_size)]
    if tail.numel() >= 2:
        batches.append(tail.unsqueeze(0))

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll_sum, correct, scored, top1_prob_sum = 0.0, 0, 0, 0.0
    try:
        for batch in batches:
            batch = batch.to(device)
            logits = model(input_ids=batch, use_cache=False).logits.float()
            logp = torch.log_softmax(logits[:, :-1], dim=-1)
            target = batch[:, 1:]
            nll = -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
            nll_sum += nll.double().sum().item()
            correct += (logits[:, :-1].argmax(-1) == target).sum().item()
            top1_prob_sum += logp.max(-1).values.double().exp().sum().item()
            scored += target.numel()
    finally:
        model.train(was_training)
    mean = nll_sum / scored
    return {
        "nll_per_token": mean,
        "perplexity": math.exp(mean),
        "top1_accuracy": correct / scored,
        "tokens_scored": scored,
        "windows": n_full + (1 if tail.numel() >= 2 else 0),
        "window": window,
        "tokens": ids.numel(),
        "mean_top1_prob": top1_prob_sum / scored,
    }


# --------------------------------------------------------------------------------------------------------------
# tokenizer
# --------------------------------------------------------------------------------------------------------------


def split_documents(text: str) -> list[str]:
    """The documents of a corpus file: ``make_corpus.py`` ends every document with ``<|endoftext|>``."""
    docs = text.split(EOS)
    if docs and docs[-1] == "":
        docs.pop()
    return docs


def tokenize_corpus(tokenizer, text: str) -> list[int]:
    """Token ids of a corpus file: each document's tokens, then the ``<|endoftext|>`` id.

    Equal to tokenising the whole text at once (the tokenizer cuts its input at special tokens); done per document
    so that the fast tokenizer can batch it.
    """
    eos = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    for doc_ids in tokenizer(split_documents(text), add_special_tokens=False, verbose=False)["input_ids"]:
        ids.extend(doc_ids)
        ids.append(eos)
    return ids


def train_tokenizer(train_text: str, vocab_size: int, out_dir: Path):
    """Byte-level BPE over the train split; saves tokenizer.json, tokenizer_config.json, chat_template.jinja."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    try:  # split words the way Qwen3.5's tokenizer does (regex taken from the installed transformers)
        from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

        split = [pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False)]
        use_regex = False
    except ImportError:  # pragma: no cover - older transformers: GPT-2 style split built into ByteLevel
        split, use_regex = [], True

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        split + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # one "sentence" per document keeps training independent of batching inside the trainer; the end-of-text
    # marker between documents is a special token, never part of a merge
    tok.train_from_iterator(split_documents(train_text), trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        bos_token=None,
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=4096,
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    out_dir.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out_dir))
    # make the class explicit and loadable without remote code in every transformers 5.x
    cfg_path = out_dir / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")
    return fast


# --------------------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------------------


def text_config(args, tokenizer):
    from transformers import Qwen3_5TextConfig

    rotary_dim = int(args.head_dim * args.partial_rotary_factor)
    mrope = [int(x) for x in args.mrope_section.split(",")]
    if sum(mrope) != rotary_dim // 2:
        raise ValueError(f"mrope_section {mrope} must sum to rotary_dim/2 = {rotary_dim // 2}")
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    return Qwen3_5TextConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden_size,
        intermediate_size=args.intermediate_size,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        linear_num_key_heads=args.linear_key_heads,
        linear_num_value_heads=args.linear_value_heads,
        linear_key_head_dim=args.linear_head_dim,
        linear_value_head_dim=args.linear_head_dim,
        linear_conv_kernel_dim=4,
        full_attention_interval=4,  # layer_types: 3 linear_attention : 1 full_attention
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        hidden_act="silu",
        initializer_range=0.02,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 1e7,
            "partial_rotary_factor": args.partial_rotary_factor,
            "mrope_section": mrope,
            "mrope_interleaved": True,
        },
        eos_token_id=eos,
        pad_token_id=eos,
        bos_token_id=None,
        dtype="float32",
    )


VISION_CONFIG = {
    # deliberately tiny and UNTRAINED: it only gives the checkpoint the real composite layout
    "depth": 1,
    "hidden_size": 32,
    "num_heads": 2,
    "intermediate_size": 64,
    "patch_size": 4,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "in_channels": 3,
    "num_position_embeddings": 256,  # a 16 x 16 grid of learned position embeddings
    "hidden_act": "gelu_pytorch_tanh",
    "initializer_range": 0.02,
}



def export_composite(text_model, tokenizer, out_dir: Path, seed: int) -> dict:
    """Save the trained backbone inside a stock Qwen3_5ForConditionalGeneration (+ fused-repo config keys)."""
    from transformers import GenerationConfig, Qwen3_5Config, Qwen3_5ForConditionalGeneration

    tcfg = text_model.config
    ids = {name: tokenizer.convert_tokens_to_ids(tok) for name, tok in [
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ]}
    config = Qwen3_5Config(
        text_config=tcfg.to_dict(),
        vision_config=dict(VISION_CONFIG, out_hidden_size=tcfg.hidden_size),
        tie_word_embeddings=True,
        **ids,
    )
    config.architectures = ["Qwen3_5ForConditionalGeneration"]
    torch.manual_seed(seed + 1)
    model = Qwen3_5ForConditionalGeneration(config).float().eval()
    missing, unexpected = model.model.language_model.load_state_dict(text_model.model.state_dict(), strict=True)
    assert not missing and not unexpected
    model.tie_weights()
    assert model.lm_head.weight.data_ptr() == model.model.language_model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.lm_head.weight, text_model.lm_head.weight)

    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(out_dir), safe_serialization=True)

    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["fused_kernels"] = True
    cfg["cuda_graphs"] = True
    cfg["auto_map"] = _repo_modules()[0].AUTO_MAP_COMPOSITE
    cfg["text_config"]["fused_kernels"] = True
    cfg["text_config"]["cuda_graphs"] = True
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")

    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    GenerationConfig(
        do_sample=False,
        eos_token_id=[eos, im_end],
        pad_token_id=eos,
        repetition_penalty=1.0,  # no max_new_tokens: it would override a caller's max_length (lm-eval's max_gen_toks)
    ).save_pretrained(str(out_dir))
    return {
        "parameters_total": sum(p.numel() for p in model.parameters()),
        "parameters_vision": sum(p.numel() for p in model.model.visual.parameters()),
    }


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------


def lr_at(step: int, args) -> float:
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = (step - args.warmup_steps) / max(1, args.steps - args.warmup_steps)
    floor = args.lr * args.min_lr_ratio
    return floor + 0.5 * (args.lr - floor) * (1 + math.cos(math.pi * min(1.0, progress)))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the tiny Qwen3.5 shipped at the repo root.")
    ap.add_argument("--out", default=str(REPO), help="folder for the checkpoint + tokenizer (default: repo root)")
    ap.add_argument("--data-dir", default=str(REPO / "data"), help="folder with train.txt and heldout.txt")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    # tokenizer
    ap.add_argument("--vocab-size", type=int, default=4096)
    # model
    ap.add_argument("--hidden-size", type=int, default=256)
    ap.add_argument("--intermediate-size", type=int, default=384)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--partial-rotary-factor", type=float, default=0.25)
    ap.add_argument("--mrope-section", default="3,3,2")
    ap.add_argument("--linear-key-heads", type=int, default=2)
    ap.add_argument("--linear-value-heads", type=int, default=4)
    ap.add_argument("--linear-head-dim", type=int, default=32)
    add_optimisation_args(ap, steps=1400, warmup_steps=50, max_train_seconds=2700.0)
    return ap.parse_args(argv)


def add_optimisation_args(ap, steps: int, warmup_steps: int, max_train_seconds: float) -> None:
    """The optimisation options both trainers take (this one and scripts/train_mtp_head.py), with their defaults."""
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-ratio", type=float, default=0.1)
    ap.add_argument("--warmup-steps", type=int, default=warmup_steps)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--grad-clip", type=float, default=1.0)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--max-train-seconds", type=float, default=max_train_seconds,
                    help="safety stop: end training after this much wall time even if --steps are not done (the "
                    "report then says so; the run is only reproducible when it does not trigger)")
    ap.add_argument("--eval-window", type=int, default=256)


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda asked for, but no GPU is visible")
    device = torch.device(args.device)
    out = Path(args.out)

    data_dir = Path(args.data_dir)
    if not (data_dir / "train.txt").exists() or not (data_dir / "heldout.txt").exists():
        sys.path.insert(0, str(REPO / "scripts"))
        import make_corpus

        make_corpus.main(["--out-dir", str(data_dir)])
    train_text = (data_dir / "train.txt").read_text(encoding="utf-8")
    heldout_text = (data_dir / "heldout.txt").read_text(encoding="utf-8")

    t0 = time.time()
    tokenizer = train_tokenizer(train_text, args.vocab_size, out)
    print(f"tokenizer: vocab {len(tokenizer)} trained in {time.time() - t0:.1f}s", flush=True)
    train_ids = torch.tensor(tokenize_corpus(tokenizer, train_text), dtype=torch.long)
    n_docs = int((train_ids == tokenizer.convert_tokens_to_ids(EOS)).sum())
    print(f"train tokens: {train_ids.numel()} ({len(train_text) / train_ids.numel():.2f} chars/token, "
          f"{n_docs} documents)", flush=True)

    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen3_5ForCausalLM

    tcfg = text_config(args, tokenizer)
    torch.manual_seed(args.seed)
    model = Qwen3_5ForCausalLM(tcfg).float().to(device)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"text model: {n_params} parameters, layer_types {tcfg.layer_types}", flush=True)

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )
    gen = torch.Generator().manual_seed(args.seed)
    max_start = train_ids.numel() - args.seq_len

    cpu_patch = torch_linear_attention() if device.type == "cpu" else contextlib.nullcontext()
    log, loss_acc, n_acc, tokens_seen, steps_done = [], 0.0, 0, 0, 0
    t_train = time.time()
    t_log = t_train
    with cpu_patch:
        model.train()
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            starts = torch.randint(0, max_start + 1, (args.batch_size,), generator=gen)
            batch = torch.stack([train_ids[s : s + args.seq_len] for s in starts.tolist()]).to(device)
            loss = model(input_ids=batch, labels=batch, use_cache=False).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            opt.step()
            tokens_seen += batch.numel()
            steps_done = step + 1
            loss_acc += loss.item()
            n_acc += 1
            out_of_time = time.time() - t_train > args.max_train_seconds
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps or out_of_time:
                now = time.time()
                tps = n_acc * batch.numel() / (now - t_log)
                mean = loss_acc / n_acc
                print(
                    f"step {step + 1:5d}/{args.steps} loss {mean:.4f} lr {lr_at(step, args):.2e} "
                    f"tok/s {tps:7.1f} elapsed {now - t_start:7.1f}s",
                    flush=True,
                )
                log.append({"step": step + 1, "loss": round(mean, 5), "tokens_per_s": round(tps, 1)})
                loss_acc, n_acc, t_log = 0.0, 0, now
            if out_of_time and step + 1 < args.steps:
                print(f"safety stop: {args.max_train_seconds:.0f}s of training reached at step {step + 1}", flush=True)
                break
        train_seconds = time.time() - t_train
        final_train_loss = log[-1]["loss"]

        model.eval()
        extra = export_composite(model.cpu(), tokenizer, out, args.seed)
        print(f"saved composite checkpoint to {out} ({extra['parameters_total']} parameters)", flush=True)

    # evaluate the SHIPPED files, reloaded with stock classes (no remote code), in fp32 on CPU
    with torch_linear_attention():
        tok = AutoTokenizer.from_pretrained(str(out))
        shipped = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
        t0 = time.time()
        ev = heldout_nll(shipped, tok, heldout_text, window=args.eval_window)
        print(f"held-out: {ev} ({time.time() - t0:.1f}s)", flush=True)

    st = out / "model.safetensors"
    report = {
        "corpus": {
            "source": "source code (.py files, docstrings and comments in place) of the CPython standard library, "
            "without test suites, generated files and files under another licence, + pydoc_data/topics.py (Python "
            "Language Reference help topics) as prose; built by scripts/make_corpus.py; see data/SOURCE.md",
            "document_separator": EOS,
            "license": "Python Software Foundation License Version 2 (PSF-2.0)",
            "python_version": platform.python_version(),
            "train_bytes": len(train_text.encode()),
            "heldout_bytes": len(heldout_text.encode()),
            "train_tokens": train_ids.numel(),
            "train_documents": n_docs,
        },
        "tokenizer": {"type": "byte-level BPE (tokenizers)", "vocab_size": len(tokenizer),
                      "special_tokens": SPECIAL_TOKENS},
        "model": {
            "architecture": "Qwen3_5ForConditionalGeneration (stock transformers layout)",
            "text_backbone": "Qwen3_5ForCausalLM, trained",
            "vision_tower": "tiny, randomly initialised, UNTRAINED",
            "hidden_size": tcfg.hidden_size,
            "intermediate_size": tcfg.intermediate_size,
            "num_hidden_layers": tcfg.num_hidden_layers,
            "layer_types": tcfg.layer_types,
            "num_attention_heads": tcfg.num_attention_heads,
            "num_key_value_heads": tcfg.num_key_value_heads,
            "head_dim": tcfg.head_dim,
            "linear_num_key_heads": tcfg.linear_num_key_heads,
            "linear_num_value_heads": tcfg.linear_num_value_heads,
            "linear_key_head_dim": tcfg.linear_key_head_dim,
            "linear_value_head_dim": tcfg.linear_value_head_dim,
            "linear_conv_kernel_dim": tcfg.linear_conv_kernel_dim,
            "rope_parameters": tcfg.rope_parameters,
            "vocab_size": tcfg.vocab_size,
            "tie_word_embeddings": True,
            "vision_config": VISION_CONFIG,
            "dtype_on_disk": "float32",
        },
        "parameters": {"text": n_params, "vision": extra["parameters_vision"], "total": extra["parameters_total"]},
        "model_safetensors_bytes": st.stat().st_size if st.exists() else None,
        "training": {
            "device": args.device,
            "threads": args.threads,
            "dtype": "float32",
            "steps": steps_done,
            "steps_planned": args.steps,
            "stopped_by_time_limit": steps_done < args.steps,
            "batch_size": args.batch_size,
            "seq_len": args.seq_len,
            "tokens_seen": tokens_seen,
            "epochs_over_train_split": round(tokens_seen / train_ids.numel(), 3),
            "optimizer": f"AdamW betas (0.9, 0.95), weight decay {args.weight_decay} (matrices), "
            f"lr {args.lr} warmup {args.warmup_steps} cosine to {args.min_lr_ratio}x, grad clip {args.grad_clip}",
            "train_wall_seconds": round(train_seconds, 1),
            "total_wall_seconds": round(time.time() - t_start, 1),
            "final_train_loss": final_train_loss,
            "final_train_loss_note": f"mean training loss over the last {args.log_every} steps",
            "log": log,
        },
        "heldout": {
            "file": "data/heldout.txt",
            "procedure": EVAL_PROCEDURE,
            "function": "scripts/train_tiny_model.py:heldout_nll(model, tokenizer, text, window=256, batch_size=8)",
            "evaluated_with": "AutoModelForCausalLM.from_pretrained(<repo root>, dtype=torch.float32), stock "
            "transformers, no remote code, CPU, torch linear-attention path",
            **ev,
        },
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "tokenizers": __import__("tokenizers").__version__, "python": platform.python_version()},
        "reproduce": " ".join(
            ["python scripts/make_corpus.py && python scripts/train_tiny_model.py"]
            + list(sys.argv[1:] if argv is None else argv)
        ),
    }
    (out / "training_report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
