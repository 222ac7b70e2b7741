# Copyright 2026 The Qwen3.5 fused-kernels authors. Licensed under the Apache License, Version 2.0.
"""The MTP head's drafting on fixed-address buffers with the fused decode ops, replayed from a CUDA graph per
(rows fed, drafts) pair: what a speculative round spends outside its verify pass.

The head (``fused_mtp``) is stock's decoder layer over a ``DynamicCache``; eagerly that is ~60 launches from Python a
drafted token plus the cache's bookkeeping, 2.4-4.0 plain decode steps a round at 4B on the H200 (BENCHMARKS). Here
the same math runs on a :class:`MTPDecodeState`:

- ``keys`` / ``values`` [1, KV, L, D]: the head's attention cache, at fixed addresses; cache index s holds the pair
  whose hidden state is the backbone's at position s (so the head's position of a row is its index, as the eager
  head's positions count its cache);
- ``slot`` [1] int64: the index the next fed pair is written to (the host keeps the same count and writes it before
  each call: no device read);
- the head's projection groups packed (q|k|v, gate|up) as the fused layers pack theirs: its Linears hold
  views of the packed matrices.

One call (:meth:`MTPDecodeState.draft`) feeds R true pairs (backbone hidden state, the token after it) at slot ..
slot + R - 1, then drafts k tokens: the first from the last fed row, each next one from the head's own draft hidden
state and drafted token, written at the indices after the fed rows (the next call's fed rows overwrite them, as the
eager path crops its chained cache entries). Per row: embedding, the two pre-fc norms, ``fc``, the layer (norm,
q|k|v GEMM, ``attn_prep`` writing K/V at the row's index, ``decode_attention`` over the keys up to it, ``o_proj``,
norm, SwiGLU MLP), ``mtp.norm``; the LM head over the drafted rows; argmax. The rows of one call are one sequence's
consecutive tokens, so each row's attention runs token by token (R <= k + 1), the linears once over all rows.

Greedy drafting without logits processors is captured (its second call per (R, k); the first, eager, warms every
kernel) and replayed; a chooser that runs Python per draft (processors, sampling) runs the same code eagerly. The
prompt's pairs, hundreds to thousands of rows, are fed through the stock head once (``prefill``) and its cache copied
in. Runs for a head of one layer (every real Qwen3.5 checkpoint) with a static rotary type and a dense MLP, or the
MoE models' sparse block (``STATIC_MOE_DRAFTS``: the router's GEMV, ``moe_route``, the shared expert's SwiGLU and
``moe_experts`` over the picked experts, as the MoE decode step runs its block); :func:`static_draft_blocker` says
why not otherwise, and the eager stock head drafts then.
"""

import torch
import torch.nn.functional as F
from transformers.cache_utils import DynamicCache

from .fused_decode import rope_plan
from .fused_graphs import WeightsSnapshot, capture_graph
from .fused_layers import pack_linears

# The MoE head (35B-A3B) drafts on the static drafter too: its sparse block by the MoE decode step's ops. Against
# stock's layer run eagerly, at 35B-A3B on an H100 (one process, each (k, a) interleaved; BENCHMARKS "The MoE head on
# the static drafter"): 1.2-4.5x faster a token at every k = 1..3 and acceptance 0 / 0.8 / 1.0 (k = 2, a = 0.8: 3.206
# against 12.537 ms). Off, the MoE head drafts with stock's layer, eagerly.
STATIC_MOE_DRAFTS = True


def _is_moe(mlp) -> bool:
    return all(hasattr(mlp, name) for name in ("gate", "experts", "shared_expert", "shared_expert_gate"))


def static_draft_blocker(model) -> str | None:
    """None when ``model``'s MTP head can draft on a :class:`MTPDecodeState`, else why not."""
    head = model.mtp
    if len(head.layers) != 1:
        return f"the head has {len(head.layers)} layers (the static drafter runs one, as every real checkpoint has)"
    mlp = head.layers[0].mlp
    if _is_moe(mlp):
        if not STATIC_MOE_DRAFTS:
            return ("the head's layer has a mixture-of-experts MLP and fused_mtp_decode.STATIC_MOE_DRAFTS is off "
                    "(the static drafter runs it only with that switch on)")
    elif not all(hasattr(mlp, name) for name in ("gate_proj", "up_proj", "down_proj")):
        return "the head's layer has an MLP that is neither the dense nor the MoE block"
    device = model.lm_head.weight.device
    if rope_plan(head.rotary_emb, device) is None:
        return "the head's rotary embedding is not a static type on the model's device"
    if any(p.device != device for p in head.parameters()):
        return "the head's weights are not on the LM head's device"
    if type(model.lm_head) is not torch.nn.Linear or model.lm_head.bias is not None:
        return "the LM head is not a plain bias-free Linear"
    return None


class MTPDecodeState:
    """The head's cache and drafting for one row, cache length ``max_len`` (see the module docstring)."""

    def __init__(self, model, max_len: int, max_rows: int):
        head = model.mtp
        attn = head.layers[0].self_attn
        weight = model.lm_head.weight
        self.ops = model.fused_plan.ops
        self.max_len, self.max_rows, self.dtype, self.device = max_len, max_rows, weight.dtype, weight.device
        self.H, self.KV, self.D = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
        with torch.inference_mode(False):  # normal tensors: later calls may run outside inference mode
            shape = (1, self.KV, max_len, self.D)
            self.keys = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.values = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.valid = torch.ones(1, max_len, dtype=torch.bool, device=self.device)  # no padding: masked by slot
            self.slot = torch.zeros(1, dtype=torch.long, device=self.device)
            self.positions = torch.zeros(3, 1, 1, dtype=torch.long, device=self.device)
            self.hidden_in = torch.zeros(max_rows, head.config.hidden_size, dtype=self.dtype, device=self.device)
            self.tokens_in = torch.zeros(max_rows, dtype=torch.long, device=self.device)
            self.drafts_in = torch.zeros(1, max_rows, dtype=torch.long, device=self.device)  # a tail's drafts
            self.forced = torch.full((1,), -1, dtype=torch.long, device=self.device)  # a set acceptance; -1: the rule's
        self.rope = rope_plan(head.rotary_emb, self.device)
        self.count = 0  # the host's copy of the pairs the cache holds (what `slot` is set to before a call)
        self.host_copies = {}  # pinned host buffers a round's results are read through (fused_speculative.read_later)
        self._pack(model)

    def _pack(self, model) -> None:
        """Pack q|k|v and gate|up as the fused layers pack theirs (``pack_linears``: each Linear's weight becomes a
        view of the packed matrix, so an in-place update of a weight, ``load_state_dict`` without ``assign``, reaches
        the matrix the drafts read; a replaced weight is caught by the snapshot)."""
        layer = model.mtp.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        self.moe = _is_moe(mlp)
        swiglu = mlp.shared_expert if self.moe else mlp  # the dense MLP, or the MoE block's shared expert
        with torch.no_grad(), torch.inference_mode(False):
            self.w_qkv = pack_linears([attn.q_proj, attn.k_proj, attn.v_proj])[0]
            self.w_gate_up = pack_linears([swiglu.gate_proj, swiglu.up_proj])[0]
        self.weights = WeightsSnapshot(model.mtp, model.lm_head, model.get_input_embeddings())
        self.graphs, self.calls = {}, {}
        self.tails, self.tail_calls = {}, {}

    def refresh(self, model) -> None:
        """Pack again and drop the graphs when a weight the head reads was replaced or moved (once per ``generate``
        call)."""
        if not self.weights.unchanged():
            self._pack(model)

    def set_count(self, count: int) -> None:
        """The cache holds ``count`` true pairs: the next fed row is written at ``count``."""
        self.count = count
        self.slot.fill_(count)
        self.positions.fill_(count)

    def _check_room(self, rows: int, k: int) -> None:
        if self.count + rows + k > self.max_len:
            raise ValueError(f"The MTP head's cache holds {self.max_len} tokens; {rows} fed and {k} drafted after "
                             f"{self.count} do not fit.")

    # -- feeding and drafting ------------------------------------------------------------------------------------------

    def prefill(self, model, hidden: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed the prompt's P pairs (``hidden`` [1, P, H], ``tokens`` [1, P]) through the stock head over a fresh
        cache and copy that cache in; returns the last row's ``(logits [1, V], draft hidden [1, H])``."""
        P = hidden.shape[1]
        self.count = 0
        self._check_room(P, self.max_rows)
        cache = DynamicCache()
        draft = model.mtp(hidden, tokens, model.get_input_embeddings(), cache=cache)[0, -1:]  # [1, H]
        layer = cache.layers[0]
        self.keys[:, :, :P].copy_(layer.keys)
        self.values[:, :, :P].copy_(layer.values)
        self.set_count(P)
        return self.logits(model, draft), draft

    def draft(self, model, hidden: torch.Tensor, tokens: torch.Tensor, k: int, choose, prompt: bool) -> list:
        """Eagerly: feed the pairs (``hidden`` [1, R, H], ``tokens`` [1, R]; with ``prompt``, the whole prompt's,
        through :meth:`prefill`), then k drafts by ``choose`` (see :meth:`chain`); the count moves on by R."""
        if prompt:
            logits, draft = self.prefill(model, hidden, tokens)
            return self.chain(model, draft, logits, 0, k, choose)
        R = hidden.shape[1]
        self._check_room(R, k)
        self.set_count(self.count)
        draft = self.rows(model, hidden[0], tokens[0], 0)[-1:]
        drafts = self.chain(model, draft, self.logits(model, draft), R, k, choose)
        self.count += R
        return drafts

    def rows(self, model, hidden: torch.Tensor, tokens: torch.Tensor, offset) -> torch.Tensor:
        """The head over R consecutive pairs (``hidden`` [R, H], ``tokens`` [R]) written at ``slot + offset + t``
        (``offset`` an int, or a [1] int64 tensor on the device): the draft hidden states [R, H] (after
        ``mtp.norm``). No host read: capturable."""
        head, ops = model.mtp, self.ops
        layer = head.layers[0]
        attn, mlp = layer.self_attn, layer.mlp
        R = hidden.shape[0]
        embeds = F.embedding(tokens, model.get_input_embeddings().weight)  # [R, H]
        ne, nh = head.pre_fc_norm_embedding, head.pre_fc_norm_hidden
        x = torch.cat([ops.rms_norm(embeds, ne.weight, ne.eps), ops.rms_norm(hidden, nh.weight, nh.eps)], dim=-1)
        h = ops.small_linear(x, head.fc.weight)  # [R, H]: the layer's residual stream
        ln = layer.input_layernorm
        qkv = ops.small_linear(ops.rms_norm(h, ln.weight, ln.eps), self.w_qkv)  # [R, H*2*D + 2*KV*D]
        sections, freqs, scaling = self.rope
        outs = []
        for t in range(R):
            at = offset + t
            slot = self.slot + at
            cos, sin = ops.mrope_step(self.positions + at, sections, freqs, scaling, h.dtype)
            q, _, _, gate = ops.attn_prep(qkv[t : t + 1].view(1, 1, -1), cos[:, None], sin[:, None], attn.q_norm.weight,
                                          attn.k_norm.weight, attn.q_norm.eps, self.H, self.KV, self.D,
                                          kv_cache=(self.keys, self.values, slot))
            outs.append(ops.decode_attention(q.reshape(1, self.H, self.D), self.keys, self.values, self.valid, slot,
                                             gate.view(1, self.H * self.D), attn.scaling))
        y = ops.small_linear(torch.cat(outs), attn.o_proj.weight)  # [R, H]
        ln = layer.post_attention_layernorm
        x, h = ops.rms_norm(y, ln.weight, ln.eps, residual=h)
        y = self._moe(mlp, x) if self.moe else \
            ops.small_linear(ops.small_linear(x, self.w_gate_up, gate_up=True), mlp.down_proj.weight)
        return ops.rms_norm(y, head.norm.weight, head.norm.eps, residual=h)[0]

    def _moe(self, mlp, x: torch.Tensor) -> torch.Tensor:
        """Stock's sparse MoE block (``Qwen3_5MoeSparseMoeBlock``) over the head's rows ``x`` [R, H] -> [R, H] with
        the MoE decode step's ops: the router's linear and ``moe_route`` (softmax, top-k, renormalised), the shared
        expert's SwiGLU MLP and its gate logit, ``moe_experts`` (the picked experts' SwiGLU MLPs, weighted and summed,
        plus the gated shared expert). No host read: capturable."""
        ops = self.ops
        weights, ids = ops.moe_route(ops.small_linear(x, mlp.gate.weight), mlp.gate.top_k)
        shared = ops.small_linear(ops.small_linear(x, self.w_gate_up, gate_up=True),
                                  mlp.shared_expert.down_proj.weight)
        shared_gate = ops.small_linear(x, mlp.shared_expert_gate.weight)  # [R, 1]
        return ops.moe_experts(x, mlp.experts.gate_up_proj, mlp.experts.down_proj, weights, ids, shared, shared_gate)

    def logits(self, model, draft: torch.Tensor) -> torch.Tensor:
        """The LM head over draft hidden states [N, H]: [N, V] in the model's dtype."""
        return self.ops.small_linear(draft, model.lm_head.weight)

    def chain(self, model, draft: torch.Tensor, logits: torch.Tensor, fed: int, k: int, choose) -> list:
        """k drafts from the last fed row's ``draft`` [1, H] and ``logits`` [1, V]: ``choose(logits [1, V], j)``
        gives draft j [1] (argmax, or the caller's processors and sampling); draft j > 0 runs the head on
        (draft hidden j - 1, draft j - 1) at ``slot + fed + j - 1``."""
        drafts = []
        for j in range(k):
            if j:
                draft = self.rows(model, draft, drafts[-1], fed + j - 1)
                logits = self.logits(model, draft)
            drafts.append(choose(logits, j))
        return drafts

    def _greedy(self, model, R: int, k: int) -> torch.Tensor:
        draft = self.rows(model, self.hidden_in[:R], self.tokens_in[:R], 0)[-1:]
        drafts = self.chain(model, draft, self.logits(model, draft), R, k, lambda logits, j: logits.argmax(dim=-1))
        return torch.cat(drafts)  # [k]

    def draft_greedy(self, model, hidden: torch.Tensor, tokens: torch.Tensor, k: int, use_graph: bool) -> torch.Tensor:
        """Feed R pairs (``hidden`` [R, H], ``tokens`` [R]) after the ``count`` held, then k greedy drafts [k]; the
        count moves on by R. From a CUDA graph per (R, k) with ``use_graph`` on CUDA (captured on the second call;
        the output lives in the graph's memory until its next replay)."""
        R = hidden.shape[0]
        self._check_room(R, k)
        self.hidden_in[:R].copy_(hidden)
        self.tokens_in[:R].copy_(tokens)
        self.set_count(self.count)  # slot and positions: written before the replay, read on the device
        key = (R, k)
        entry = self.graphs.get(key)
        if entry is None and use_graph and self.device.type == "cuda":
            self.calls[key] = calls = self.calls.get(key, 0) + 1
            if calls >= 2:
                captured = capture_graph(model._text_model(), lambda: self._greedy(model, R, k), None,
                                         f"MTP draft ({R} fed, {k} drafted)", warm=False)
                self.graphs[key] = entry = False if captured is None else captured
        if entry:
            graph, out = entry
            graph.replay()
        else:
            out = self._greedy(model, R, k)
        self.count += R
        return out

    # -- a whole greedy round's tail on the device -----------------------------------------------------------------

    def round_tail(self, model, st, verified, logits: torch.Tensor, drafts: torch.Tensor):
        """After a verify pass over [x, d_1 .. d_k] on decode state ``st`` (``logits`` [1, T, V], ``verified`` its
        ``Verified``, ``drafts`` [1, k] the drafts it checked), all on the device: greedy acceptance (n leading drafts
        equal to the model's argmax, or ``forced`` when >= 0), the model's next token after them, the backbone rolled
        back to after token n (the saved states selected by n, slot, positions and key marks), the head fed the T
        pairs (hidden state i, emitted token i) at ``slot`` .. (rows past n are overwritten by the next round), and k
        new drafts chained from row n. Returns ``(packed [1 + T + k] int64: n, the T emitted-token slots (the first
        n + 1 true), the k new drafts; the next verify input [1, T]: the next token, the new drafts)``. No host read:
        capturable."""
        T = logits.shape[1]
        k = T - 1
        targets = logits[0].argmax(dim=-1)  # [T]
        hits = (drafts[0] == targets[:k]).long().cumprod(dim=0).sum().view(1)
        n = torch.where(self.forced >= 0, self.forced, hits)  # [1]
        steps = torch.arange(T, device=logits.device)
        following = targets.index_select(0, n)  # [1]: the model's token after the n accepted drafts
        emitted = torch.where(steps < n, torch.cat([drafts[0], following]), following)  # [T]
        # the backbone after token n: the state the pass saved after it (one gather a state, written in place)
        for i, saved in verified.conv.items():
            for state, kept in ((st.conv[i], saved), (st.recurrent[i], verified.recurrent[i])):
                torch.index_select(kept, 0, n, out=state[None])
        st.slot.copy_(verified.slot + n + 1)
        st.positions.copy_(verified.positions + n + 1)
        st.key_valid[:, verified.slot + steps] = (steps <= n)[None]
        # the head: the confirmed pairs, then k drafts from row n
        draft = self.rows(model, verified.hidden[0], emitted, 0).index_select(0, n)  # [1, H]
        new = [self.logits(model, draft).argmax(dim=-1)]
        for j in range(1, k):
            draft = self.rows(model, draft, new[-1], n + j)
            new.append(self.logits(model, draft).argmax(dim=-1))
        new = torch.cat(new)  # [k]
        return torch.cat([n, emitted, new]), torch.cat([following, new])[None]

    def tail(self, model, st, verified, logits, drafts, use_graph: bool, graphed: bool):
        """:meth:`round_tail`, from a CUDA graph per verify length when the verify pass ran from its graph
        (``graphed``: its outputs and drafts then sit at fixed addresses) and ``use_graph`` on CUDA (captured on the
        second such call; a recaptured verify graph is captured again). The count moves on by n + 1 on the host,
        once the caller has read n."""
        T = logits.shape[1]
        self._check_room(T, T - 1)
        self.set_count(self.count)  # slot and positions: written before the replay, read on the device
        # the drafts at an address of the drafter's own: a graph reads the address it was captured with, and the
        # caller's drafts come from wherever the last round's were made (a draft graph, the last tail, an override)
        self.drafts_in[:, : T - 1].copy_(drafts)
        drafts = self.drafts_in[:, : T - 1]
        key = (T, id(verified))
        entry = self.tails.get(key)
        if entry is None and graphed and use_graph and self.device.type == "cuda":
            self.tail_calls[key] = calls = self.tail_calls.get(key, 0) + 1
            if calls >= 2:
                live = {id(graph.out[1]) for graph in st.verify_graphs.values() if graph}
                for old in [other for other in self.tails if other[1] not in live]:
                    del self.tails[old]  # the verify graph it read was captured again
                captured = capture_graph(model._text_model(),
                                         lambda: self.round_tail(model, st, verified, logits, drafts), None,
                                         f"speculative round tail ({T} tokens)", warm=False)
                # the entry holds `verified`: its id cannot be reused while the entry lives
                self.tails[key] = entry = False if captured is None else (*captured, verified)
        if entry:
            graph, out, _ = entry
            graph.replay()
            return out
        return self.round_tail(model, st, verified, logits, drafts)
