"""Generate text with a (fused) Qwen3.5 repo: the README's main command.

    python scripts/generate.py                      # the small model shipped in this repo, on CPU or GPU
    python scripts/generate.py --model org/repo --prompt "Hello" --max-new-tokens 64

Loads with `trust_remote_code=True`, so the fused path runs wherever it can (GPU with triton + fla) and the stock
path elsewhere (announced once). Prints the completion, tokens/s and what ran fused (`describe()`).
"""

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

REPO = Path(__file__).resolve().parents[1]
DEFAULT_PROMPT = "Return a new list containing"


def load(model_id: str, device: str, dtype: str, fused_kernels: bool | None = None):
    kwargs = {"trust_remote_code": True, "dtype": getattr(torch, dtype)}
    if fused_kernels is not None:
        kwargs["fused_kernels"] = fused_kernels
    tokenizer = AutoTokenizer.from_pretrained(model_id)
    model = AutoModelForCausalLM.from_pretrained(model_id, **kwargs).to(device).eval()
    return tokenizer, model


def generate(tokenizer, model, prompt: str, max_new_tokens: int, chat: bool) -> dict:
    if chat:
        text = tokenizer.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True)
    else:
        text = prompt
    inputs = tokenizer(text, return_tensors="pt").to(model.device)
    start = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    if model.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    new = out[0, inputs["input_ids"].shape[1]:]
    return {"prompt": text, "completion": tokenizer.decode(new, skip_special_tokens=True),
            "new_tokens": int(new.numel()), "seconds": seconds, "tokens_per_s": new.numel() / seconds}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=str(REPO), help="repo id or folder (default: this repo's small model)")
    parser.add_argument("--prompt", default=DEFAULT_PROMPT)
    parser.add_argument("--max-new-tokens", type=int, default=40)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    parser.add_argument("--no-fused", action="store_true", help="load with fused_kernels=False")
    args = parser.parse_args(argv)
    tokenizer, model = load(args.model, args.device, args.dtype, False if args.no_fused else None)
    result = generate(tokenizer, model, args.prompt, args.max_new_tokens, args.chat)
    print(result["prompt"] + result["completion"])
    print(f"\n[{result['new_tokens']} tokens in {result['seconds']:.2f} s = {result['tokens_per_s']:.1f} tokens/s "
          f"on {args.device}, {args.dtype}]")
    paths = {kind: v["path"] + (f" ({v['reason']})" if v["reason"] else "") for kind, v in model.describe()["layers"].items()}
    print("paths: " + json.dumps(paths))
    return result


if __name__ == "__main__":
    main()
