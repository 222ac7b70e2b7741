"""Train the multi-token-prediction (MTP) head of the small Qwen3.5 shipped at the repo root, and measure how often
its drafts would be accepted.

The base model stays frozen: only the head (``fused_mtp.Qwen3_5MultiTokenPredictor``: ``mtp.fc``, its two input
norms, one full-attention decoder layer with its own MLP, ``mtp.norm``; the embedding and the LM head are the base's)
learns, with the next-next-token loss on the corpus the base was trained on (``data/train.txt``, rebuilt by
``scripts/make_corpus.py`` when missing): at position t the head reads the base's last hidden state (after its final
norm) and the embedding of token t + 1, and is scored on token t + 2. Deterministic (fixed seeds, two CPU threads by
default); progress lines every ``--log-every`` steps.

Then, on the files as written (``model.safetensors`` with the ``mtp.*`` tensors added, ``config.json`` with
``text_config.mtp_num_hidden_layers: 1``), loaded through the repo's fused classes on CPU, the acceptance of the
head's drafts on the held-out text (``mtp_acceptance``, procedure in ``ACCEPTANCE_PROCEDURE``): one drafted token at
temperature 0 (the draft's argmax equals the model's) and 1 (speculative sampling's acceptance probability
``sum_x min(p(x), q(x))``), and chains of 2 and 3 drafted tokens. The numbers, the run and the command go into the
``"mtp"`` section of ``training_report.json``.

Reproduce the shipped head (the base first, as the README says)::

    python scripts/make_corpus.py && python scripts/train_tiny_model.py && python scripts/train_mtp_head.py
"""

import argparse
import copy
import datetime
import json
import math
import os
import platform
import random
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train_tiny_model.py: a waiting OpenMP worker sleeps

import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from scripts.common import import_module, import_repo  # noqa: E402
from scripts.train_tiny_model import (  # noqa: E402
    EOS,
    add_optimisation_args,
    lr_at,
    tokenize_corpus,
    torch_linear_attention,
)

MTP_LAYERS = 1  # mtp_num_hidden_layers of the real Qwen3.5 checkpoints

ACCEPTANCE_PROCEDURE = (
    "Tokenise the held-out text with the shipped tokenizer (no special tokens added) and cut the stream into "
    "consecutive non-overlapping windows of `window` tokens (a last, shorter window is kept if it has at least 3 "
    "tokens); run each window, in fp32 and without a cache, through the base (its last hidden state h, after the "
    "final norm, and its logits) and through the MTP head fed h[t] and token t+1. One drafted token, over every "
    "position t with a token t+1 in the window: the head's distribution q_t (softmax of its logits) against the "
    "model's p_{t+1} (the verifying step: the model after token t+1). Temperature 0: the fraction of positions where "
    "argmax q_t == argmax p_{t+1}. Temperature 1: the mean over positions of sum_x min(p_{t+1}(x), q_t(x)), "
    "speculative sampling's acceptance probability. Chains, at positions t = every-1, 2*every-1, ... of each window "
    "(t+1 inside it): the model runs the window in chunks with its cache up to token t+1; the head drafts d1 from "
    "(h[t], token t+1) with its own cache over positions 0..t, then d2 from (its own draft hidden state, d1) at "
    "position t+1, d3 likewise; a copy of the model's cache verifies d1 d2 (one forward of 2 tokens), giving p1 p2 "
    "p3. Temperature 0 (drafts are argmaxes): chain-k acceptance = the fraction of positions whose first k drafts "
    "all equal the model's argmax at their step. Temperature 1 (drafts sampled from q, a seeded generator): chain-k "
    "acceptance = the mean of prod_{j<=k} min(1, p_j(d_j) / q_j(d_j)), the probability that speculative sampling "
    "accepts all k (one sample a position). Also reported: the head's own next-next-token NLL and top-1 accuracy "
    "against the text at the positions t with a token t+2."
)


def _repo():
    configuration, modeling, _ = import_repo()
    return configuration, modeling, import_module("fused_mtp"), import_module("fused_compat")


# --------------------------------------------------------------------------------------------------------------
# the model: the shipped base, frozen, with a head
# --------------------------------------------------------------------------------------------------------------


def load_model(repo: Path, with_head_config: bool = True):
    """The shipped repo as the fused causal LM (``Qwen3_5FusedForCausalLMLoader``, CPU: stock's layers), fp32, eval.

    ``with_head_config``: the config names one MTP layer (as the real checkpoints do) even where ``config.json`` does
    not yet; a checkpoint without ``mtp.*`` tensors then still loads without a head (the load drops it), and
    :func:`attach_head` builds one."""
    configuration, modeling, _, _ = _repo()
    config = configuration.Qwen3_5FusedConfig.from_pretrained(str(repo))
    if with_head_config:
        config.text_config.mtp_num_hidden_layers = MTP_LAYERS
    model = modeling.Qwen3_5FusedForCausalLMLoader.from_pretrained(str(repo), config=config, dtype=torch.float32)
    return model.eval()


def init_head_like_stock(head, std: float) -> None:
    """Stock's ``_init_weights`` for the head's modules: linears normal(0, std), zero-centred norms zero."""
    for name, p in head.named_parameters():
        if p.ndim >= 2:
            torch.nn.init.normal_(p, mean=0.0, std=std)
        else:  # the (1 + w) RMSNorm weights
            torch.nn.init.zeros_(p)


def attach_head(model, seed: int) -> None:
    """Give ``model`` a freshly initialised head (stock's init, seeded)."""
    _, _, fused_mtp, _ = _repo()
    torch.manual_seed(seed)
    model.mtp = fused_mtp.Qwen3_5MultiTokenPredictor(model.config)
    init_head_like_stock(model.mtp, model.config.initializer_range)


def backbone(model, ids: torch.Tensor, **kwargs):
    """The base's last hidden state [B, T, H] (after its final norm) for ``ids`` [B, T] and the output object."""
    out = model.model(input_ids=ids, **kwargs)
    return out.last_hidden_state, out


def mtp_loss(model, ids: torch.Tensor) -> torch.Tensor:
    """Mean next-next-token cross entropy of the head on ``ids`` [B, T] (positions t = 0..T-3, target token t+2),
    the base run without gradients."""
    with torch.no_grad():
        hidden, _ = backbone(model, ids, use_cache=False)
    logits, _ = model.mtp_draft(hidden[:, :-2], ids[:, 1:-1])  # [B, T-2, V]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), ids[:, 2:].flatten())


# --------------------------------------------------------------------------------------------------------------
# acceptance
# --------------------------------------------------------------------------------------------------------------


def _windows(tokenizer, text: str, window: int) -> list[torch.Tensor]:
    ids = torch.tensor(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"], dtype=torch.long)
    out = [ids[i:i + window] for i in range(0, ids.numel(), window)]
    return [w for w in out if w.numel() >= 3]


def _pick(logits: torch.Tensor, temperature: float, generator: torch.Generator) -> torch.Tensor:
    """A drafted token [B] from logits [B, V]: the argmax at temperature 0, else a sample of softmax(logits / T)."""
    if temperature == 0:
        return logits.argmax(-1)
    return torch.multinomial(torch.softmax(logits.float() / temperature, -1), 1, generator=generator)[:, 0]


@torch.no_grad()
def _chains(model, window: torch.Tensor, positions: list[int], depth: int, generator: torch.Generator) -> dict:
    """Per position t (ascending) of one window [L]: the accepted-chain indicators at temperature 0 and the chain
    acceptance products at temperature 1 (``ACCEPTANCE_PROCEDURE``), each a list of ``depth`` values."""
    _, _, _, compat = _repo()
    from transformers.cache_utils import DynamicCache

    lm_head = model.lm_head
    cache, done, hidden = None, 0, []
    out = {0.0: [], 1.0: []}
    for t in positions:
        kwargs = {compat.GENERATE_CACHE_KW: cache} if cache is not None else {}
        h, o = backbone(model, window[None, done:t + 2], use_cache=True, **kwargs)
        cache, done = getattr(o, compat.OUTPUT_CACHE_FIELD), t + 2
        hidden.append(h)
        h_all = torch.cat(hidden, dim=1)  # [1, t+2, H]
        p_first = lm_head(h_all[:, t + 1]).float()  # the model after token t+1: verifies the first draft
        for temperature in out:
            head_cache = DynamicCache()
            q, draft = model.mtp_draft(h_all[:, :t + 1], window[None, 1:t + 2], cache=head_cache)
            qs, ds = [q[:, -1].float()], [_pick(q[:, -1], temperature, generator)]
            for _ in range(depth - 1):
                q, draft = model.mtp_draft(draft[:, -1:], ds[-1][:, None], cache=head_cache)
                qs.append(q[:, -1].float())
                ds.append(_pick(q[:, -1], temperature, generator))
            branch = copy.deepcopy(cache)
            hv, _ = backbone(model, torch.stack(ds[:-1], dim=1), use_cache=True,
                             **{compat.GENERATE_CACHE_KW: branch})
            ps = [p_first] + [lm_head(hv[:, j]).float() for j in range(depth - 1)]
            if temperature == 0:
                ok = [bool((d == p.argmax(-1)).all()) for d, p in zip(ds, ps)]
                out[temperature].append([float(all(ok[:k + 1])) for k in range(depth)])
            else:
                ratio = [min(1.0, (torch.softmax(p, -1)[0, d] / torch.softmax(q, -1)[0, d]).item())
                         for d, p, q in zip(ds, ps, qs)]
                out[temperature].append([math.prod(ratio[:k + 1]) for k in range(depth)])
    return out


@torch.no_grad()
def mtp_acceptance(model, tokenizer, text: str, window: int = 256, batch_size: int = 8, chain_every: int = 32,
                   chain_depth: int = 3, max_windows: int | None = None, seed: int = 0) -> dict:
    """Acceptance of the MTP head's drafts on ``text`` (procedure: ``ACCEPTANCE_PROCEDURE``), for a causal LM with
    ``mtp_draft`` (the repo's fused classes) in fp32. ``max_windows``: only the first that many windows (a quicker
    check; None: all). ``chain_every`` 0: no chains. On CPU run it inside ``torch_linear_attention()``."""
    windows = _windows(tokenizer, text, window)[:max_windows]
    generator = torch.Generator().manual_seed(seed)
    was_training = model.training
    model.eval()
    greedy = soft = n = 0.0
    nll = top1 = n2 = 0.0
    chains = {0.0: [], 1.0: []}
    try:
        full = [w for w in windows if w.numel() == window]
        batches = [torch.stack(full[i:i + batch_size]) for i in range(0, len(full), batch_size)]
        batches += [w[None] for w in windows if w.numel() != window]
        for batch in batches:
            hidden, _ = backbone(model, batch, use_cache=False)
            p = model.lm_head(hidden[:, 1:]).float()  # the model after token t+1, t = 0..L-2
            q, _ = model.mtp_draft(hidden[:, :-1], batch[:, 1:])
            q = q.float()
            greedy += (q.argmax(-1) == p.argmax(-1)).sum().item()
            soft += torch.minimum(torch.softmax(p, -1), torch.softmax(q, -1)).sum(-1).double().sum().item()
            n += q.shape[0] * q.shape[1]
            logq = torch.log_softmax(q[:, :-1], -1)
            target = batch[:, 2:]
            nll += -logq.gather(-1, target[..., None]).double().sum().item()
            top1 += (q[:, :-1].argmax(-1) == target).sum().item()
            n2 += target.numel()
        if chain_every:
            for w in windows:
                positions = list(range(chain_every - 1, w.numel() - 1, chain_every))
                for temperature, values in _chains(model, w, positions, chain_depth, generator).items():
                    chains[temperature] += values
    finally:
        model.train(was_training)
    result = {
        "temperature_0": greedy / n,
        "temperature_1": soft / n,
        "positions": int(n),
        "windows": len(windows),
        "window": window,
        "head_nll_next_next_token": nll / n2,
        "head_top1_next_next_token": top1 / n2,
    }
    if chain_every:
        count = len(chains[0.0])
        result["chain"] = {
            "positions": count,
            "every": chain_every,
            "temperature_0": [sum(v[k] for v in chains[0.0]) / count for k in range(chain_depth)],
            "temperature_1": [sum(v[k] for v in chains[1.0]) / count for k in range(chain_depth)],
        }
    return result


# --------------------------------------------------------------------------------------------------------------
# writing the head into the repo
# --------------------------------------------------------------------------------------------------------------


def write_head(model, repo: Path) -> list[str]:
    """Add the head to ``repo/model.safetensors`` as ``mtp.*`` (every other tensor copied as it is, bit for bit;
    a head already there is replaced) and ``mtp_num_hidden_layers`` to ``config.json``'s text config. Returns the
    head's keys."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    _, _, fused_mtp, _ = _repo()
    path = repo / "model.safetensors"
    with safe_open(str(path), framework="pt") as f:
        metadata = f.metadata()
        tensors = {k: f.get_tensor(k) for k in f.keys() if not k.startswith(fused_mtp.MTP_PREFIX)}
    head = {fused_mtp.MTP_PREFIX + k: v.detach().to(torch.float32).contiguous().clone()
            for k, v in model.mtp.state_dict().items()}
    save_file({**tensors, **head}, str(path), metadata=metadata)
    cfg_path = repo / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["text_config"]["mtp_num_hidden_layers"] = len(model.mtp.layers)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    return sorted(head)


# --------------------------------------------------------------------------------------------------------------
# training
# --------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description="Train the MTP head of the small Qwen3.5 shipped at the repo root.")
    ap.add_argument("--repo", default=str(REPO), help="the model folder: read, and written back (default: repo root)")
    ap.add_argument("--data-dir", default=str(REPO / "data"), help="folder with train.txt and heldout.txt")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    add_optimisation_args(ap, steps=1100, warmup_steps=30, max_train_seconds=2400.0)
    ap.add_argument("--chain-every", type=int, default=32, help="chain acceptance at every N-th position (0: none)")
    ap.add_argument("--check-windows", type=int, default=4,
                    help="also measure on the first N held-out windows alone (what the tests re-run)")
    ap.add_argument("--measure-only", action="store_true",
                    help="no training: measure the head the repo already holds and rewrite the report's acceptance")
    return ap.parse_args(argv)


def measure(repo: Path, tokenizer, heldout: str, args) -> tuple[dict, dict]:
    """The acceptance of the head in ``repo``'s files over the whole held-out text, and over its first
    ``--check-windows`` windows (what the tests re-run). On one thread, as the tests run it: the sampled chains
    (temperature 1) follow the logits' last bits."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch_linear_attention():
            shipped = load_model(repo, with_head_config=False)
            if shipped.mtp is None:
                raise SystemExit(f"{repo} holds no MTP head (config.json's mtp_num_hidden_layers, mtp.* tensors)")
            t0 = time.time()
            full = mtp_acceptance(shipped, tokenizer, heldout, window=args.eval_window, chain_every=args.chain_every,
                                  seed=args.seed)
            print(f"acceptance: {json.dumps(full)} ({time.time() - t0:.1f}s)", flush=True)
            check = mtp_acceptance(shipped, tokenizer, heldout, window=args.eval_window,
                                   chain_every=args.chain_every, max_windows=args.check_windows, seed=args.seed)
            print(f"check ({args.check_windows} windows): {json.dumps(check)}", flush=True)
    finally:
        torch.set_num_threads(threads)
    return full, check


def acceptance_report(full: dict, check: dict, args) -> dict:
    return {
        "file": "data/heldout.txt",
        "procedure": ACCEPTANCE_PROCEDURE,
        "function": "scripts/train_mtp_head.py:mtp_acceptance(model, tokenizer, text, window=256, batch_size=8, "
                    f"chain_every={args.chain_every}, chain_depth=3, seed={args.seed})",
        "evaluated_with": "the repo's Qwen3_5FusedForCausalLMLoader from the written files, fp32, CPU (stock's "
                          "layers), torch linear-attention path, 1 thread",
        **full,
        "check": {"max_windows": args.check_windows, **check},
    }


def main(argv=None):
    args = parse_args(argv)
    t_start = time.time()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    repo, data_dir = Path(args.repo), Path(args.data_dir)
    if not (data_dir / "train.txt").exists():
        sys.path.insert(0, str(REPO / "scripts"))
        import make_corpus

        make_corpus.main(["--out-dir", str(data_dir)])
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(repo))
    heldout = (data_dir / "heldout.txt").read_text(encoding="utf-8")
    report_path = repo / "training_report.json"
    if args.measure_only:
        report = json.loads(report_path.read_text())
        report["mtp"]["acceptance"] = acceptance_report(*measure(repo, tokenizer, heldout, args), args)
        report_path.write_text(json.dumps(report, indent=2) + "\n")
        return
    train_ids = torch.tensor(tokenize_corpus(tokenizer, (data_dir / "train.txt").read_text(encoding="utf-8")),
                             dtype=torch.long)
    print(f"train tokens: {train_ids.numel()}", flush=True)

    with torch_linear_attention():
        model = load_model(repo)
        attach_head(model, args.seed)
        for name, p in model.named_parameters():
            p.requires_grad_(name.startswith("mtp."))
        head_params = [p for p in model.mtp.parameters()]
        n_head = sum(p.numel() for p in head_params)
        print(f"head: {n_head} parameters; base frozen", flush=True)
        decay = [p for p in head_params if p.ndim >= 2]
        no_decay = [p for p in head_params if p.ndim < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                 {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
        gen = torch.Generator().manual_seed(args.seed)
        max_start = train_ids.numel() - args.seq_len
        log, loss_acc, n_acc, tokens_seen, steps_done = [], 0.0, 0, 0, 0
        model.eval()  # no dropout anywhere; the head still learns (its parameters are the only ones with grads)
        t_train = t_log = time.time()
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args)
            starts = torch.randint(0, max_start + 1, (args.batch_size,), generator=gen)
            batch = torch.stack([train_ids[s:s + args.seq_len] for s in starts.tolist()])
            loss = mtp_loss(model, batch)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head_params, args.grad_clip)
            opt.step()
            tokens_seen += batch.numel()
            steps_done = step + 1
            loss_acc += loss.item()
            n_acc += 1
            out_of_time = time.time() - t_train > args.max_train_seconds
            if (step + 1) % args.log_every == 0 or step + 1 == args.steps or out_of_time:
                now = time.time()
                mean = loss_acc / n_acc
                print(f"step {step + 1:5d}/{args.steps} loss {mean:.4f} lr {lr_at(step, args):.2e} "
                      f"tok/s {n_acc * batch.numel() / (now - t_log):7.1f} elapsed {now - t_start:7.1f}s", flush=True)
                log.append({"step": step + 1, "loss": round(mean, 5)})
                loss_acc, n_acc, t_log = 0.0, 0, now
            if out_of_time and step + 1 < args.steps:
                print(f"safety stop: {args.max_train_seconds:.0f}s of training reached at step {step + 1}", flush=True)
                break
        train_seconds = time.time() - t_train
        keys = write_head(model, repo)
        print(f"wrote {len(keys)} mtp.* tensors into {repo / 'model.safetensors'}", flush=True)

    # measure the SHIPPED files, reloaded through the fused classes (the head loads because the checkpoint has it)
    full, check = measure(repo, tokenizer, heldout, args)

    report = json.loads(report_path.read_text()) if report_path.is_file() else {}
    report["model_safetensors_bytes"] = (repo / "model.safetensors").stat().st_size
    report["mtp"] = {
        "head": f"fused_mtp.Qwen3_5MultiTokenPredictor, mtp_num_hidden_layers {MTP_LAYERS} (mtp.fc, "
                "mtp.pre_fc_norm_embedding / _hidden, mtp.layers.0 full attention + MLP, mtp.norm; embedding and LM "
                "head shared with the base)",
        "keys": len(keys),
        "parameters": n_head,
        "base": "frozen (the shipped checkpoint's tensors are unchanged)",
        "objective": "next-next-token cross entropy: head(h_t after the final norm, embedding of token t+1) -> token "
                     "t+2, on random windows of the tokenised train split (the base's corpus)",
        "training": {
            "device": "cpu", "threads": args.threads, "dtype": "float32", "seed": args.seed,
            "steps": steps_done, "steps_planned": args.steps, "stopped_by_time_limit": steps_done < args.steps,
            "batch_size": args.batch_size, "seq_len": args.seq_len, "tokens_seen": tokens_seen,
            "optimizer": f"AdamW betas (0.9, 0.95), weight decay {args.weight_decay} (matrices), lr {args.lr} warmup "
                         f"{args.warmup_steps} cosine to {args.min_lr_ratio}x, grad clip {args.grad_clip}",
            "init": "stock's: linears normal(0, initializer_range), norms zero",
            "train_wall_seconds": round(train_seconds, 1),
            "final_train_loss": log[-1]["loss"],
            "final_train_loss_note": f"mean next-next-token loss over the last {args.log_every} steps",
            "log": log,
        },
        "acceptance": acceptance_report(full, check, args),
        "date": datetime.date.today().isoformat(),
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__,
                     "python": platform.python_version()},
        "reproduce": " ".join(["python scripts/train_mtp_head.py"] + list(sys.argv[1:] if argv is None else argv)),
    }
    report_path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"done in {time.time() - t_start:.1f}s", flush=True)


if __name__ == "__main__":
    main()
