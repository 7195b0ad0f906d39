"""Run a Hugging Face causal LM's decode steps through mmha.

``HFDecoder(model, max_batch, max_seq_len)`` takes a ``transformers`` decoder-only causal LM whose
attention mmha computes (``mmha.models.hf_layers``: the projections, q/k norms, the rotation probed
against the model's own, scale, windows, soft-caps, sinks; anything else is refused, named) and
keeps its K/V in a ``KVCache``. Prompts are prefilled by the model's own forward, several rows at a
time (their rotated K/V are copied into the cache); each decode step runs the model's own forward
(embedding, norms, MLPs or experts, multipliers) with each layer's ``self_attn`` swapped for an
``MmhaSelfAttention``: one fused q/k/v matmul, the model's q/k norms, ``KVCache.step`` appending
and attending in one kernel, ``o_proj``. The logits are ``lm_head`` and what the model's forward
does after it (``hf_layers.output_head``).

On a GPU, ``generate`` replays each decode step as one CUDA graph: one graph per batch-size
bucket (powers of two up to ``max_batch``), captured at its first use with the cache's capacity
dispatch; the greedy pick, the end-of-sequence bookkeeping and the token history stay on the
device, and the host reads them every ``sync_every`` steps. ``graphs=False`` runs the same steps
eagerly.

Nothing is downloaded: build the model from a config (``AutoModelForCausalLM.from_config``) or
load your own. ``mmha.models.hf_attention`` is the other route: mmha inside transformers' own
``generate`` (``attn_implementation="mmha"``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .._ext import extension_available
from ..cache import KVCache
from . import speculative
from .hf_layers import (
    MmhaSelfAttention,
    attention_modules,
    check_attention_kinds,
    drops_cache_at_switch,
    layer_attention,
    output_head,
    reset_rotary_state,
    swapped_attention,
)
from .hf_norms import layer_norms, qk_kernel_norm, qk_row_norm

# Token history kept on the device between host reads (sync_every <= HISTORY).
HISTORY = 64
# End-of-sequence ids a generate call may name.
MAX_EOS_IDS = 8


def _layer_kv(past, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated keys and values ``[n, Hkv, L, D]`` of one layer from a transformers cache."""
    if hasattr(past, "layers"):  # transformers >= 4.56
        return past.layers[layer].keys, past.layers[layer].values
    return past.key_cache[layer], past.value_cache[layer]


def _full_length(t: torch.Tensor, n: int) -> torch.Tensor:
    """A layer's prompt K or V ``[1, Hkv, L, D]`` as ``n`` slots: a sliding-window layer's cache
    keeps only its last ``L < n`` tokens, which go to slots ``n - L .. n - 1`` (the slots before
    are outside every later token's window, and are zero)."""
    if t.shape[2] >= n:
        return t[:, :, :n]
    full = t.new_zeros(t.shape[0], t.shape[1], n, t.shape[3])
    full[:, :, n - t.shape[2] :] = t
    return full


def _fused_norms(fuse_norms: bool | None, on_gpu: bool) -> bool:
    """``HFDecoder``'s ``fuse_norms``: by default on a GPU with the extension built."""
    if fuse_norms is None:
        return on_gpu and extension_available()
    if fuse_norms and not (on_gpu and extension_available()):
        raise ValueError("fuse_norms=True needs the model on a CUDA device and the extension built")
    return bool(fuse_norms)


def _with_kernel_norms(layer, head_dim: int):
    """``layer`` (a ``LayerAttention``) with its per-head q/k norms moved into its spec, for the
    kernel's q/k build (``hf_norms.qk_kernel_norm``), or as it is."""
    qk = qk_kernel_norm(layer.q_norm, layer.k_norm, head_dim, layer.weight.dtype)
    if qk is None:
        return layer
    return dataclasses.replace(layer, spec=layer.spec.replace(qk_norm=qk), q_norm=None, k_norm=None)


def _until_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """``tokens`` up to and including the first end-of-sequence id."""
    for i, t in enumerate(tokens):
        if t in eos:
            return tokens[: i + 1]
    return tokens


def buckets(max_batch: int) -> list[int]:
    """Batch sizes that get a CUDA graph: powers of two below ``max_batch``, and ``max_batch``."""
    out, b = [], 1
    while b < max_batch:
        out.append(b)
        b *= 2
    return [*out, max_batch]


def _free_generator_from_capture(device: torch.device) -> None:
    """A capture that fails leaves the device's default CUDA generator in capture mode (torch ends
    that only when the capture succeeds), and every later random op of the process then fails
    ("Offset increment outside graph capture"): give it a fresh state at the same seed and offset."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    gen = torch.cuda.default_generators[index]
    gen.graphsafe_set_state(gen.clone_state())


@dataclass
class _GreedyState:
    """Device state of greedy decoding, at fixed addresses (captured graphs read and write it)."""

    tokens: torch.Tensor  # [max_batch] int64: each row's next input token
    done: torch.Tensor  # [max_batch] bool: the row has emitted an end-of-sequence token
    history: torch.Tensor  # [max_batch, HISTORY] int64: picks, column = step % HISTORY
    step: torch.Tensor  # [] int64: steps taken
    eos: torch.Tensor  # [MAX_EOS_IDS] int64: end-of-sequence ids, -1 where unused
    pad: torch.Tensor  # [] int64: what a finished row emits

    @classmethod
    def allocate(cls, max_batch: int, device) -> _GreedyState:
        def z(*shape, dtype=torch.int64):
            return torch.zeros(shape, dtype=dtype, device=device)

        return cls(
            z(max_batch), z(max_batch, dtype=torch.bool), z(max_batch, HISTORY), z(), z(MAX_EOS_IDS), z()
        )


class HFDecoder:
    """Greedy / step decoding of a Hugging Face causal LM with mmha's decode kernel (module docstring)."""

    def __init__(
        self, model, max_batch: int, max_seq_len: int, *, graphs: bool | None = None,
        dispatch_on: str | None = None, kv_dtype: torch.dtype | str | None = None,
        kv_scale_margin: float = 1.0, paged: bool = False, block_size: int = 16,
        num_blocks: int | None = None, prefill_tokens: int = 32768, fuse_norms: bool | None = None,
    ):  # fmt: skip
        """``graphs``: decode steps of ``generate`` as CUDA graphs (default: on a GPU with the
        extension built, except mixture-of-experts models, whose expert routing has data-dependent
        shapes that a graph cannot hold); they need ``dispatch_on="capacity"`` (the default with
        graphs, else ``"length"``). ``kv_dtype``: the caches' dtype (default the model's);
        ``torch.float8_e4m3fn`` stores K/V in fp8 with per-layer, per-kv-head scales taken from
        the first prompts' absolute maxima times ``kv_scale_margin`` (``KVCache.prefill``) or set by
        ``self.cache.set_scales`` first; ``torch.int8``: per-token scales; ``"int4"``: ``mmha.int4``
        (no speculative trees on a GPU). ``paged``, ``block_size``, ``num_blocks``: a paged
        cache (``KVCache(paged=True)``; eager steps). ``prefill_tokens``: prompts are prefilled
        together, right-padded, in groups of at most this many (padded) tokens. ``fuse_norms``
        (default: on a GPU with the extension built): decode steps run the model's RMSNorms (each
        layer's, the final one, the q/k norms) as one launch each (``mmha.models.hf_norms``) where
        the module's form allows; per-head q/k norms in the kernel's q/k build (``AttentionSpec.qk_norm``)."""
        config = model.config
        attns = attention_modules(model)
        self.model = model
        self.body = model.model
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        param = next(model.parameters())
        heads = (self.num_heads, self.num_kv_heads, self.head_dim)
        self.layers = [layer_attention(model, i, a, heads, max_seq_len) for i, a in enumerate(attns)]
        check_attention_kinds(config, self.head_dim)
        on_gpu = param.device.type == "cuda"
        if fuse_norms := _fused_norms(fuse_norms, on_gpu):  # per-head q/k norms in the kernel
            self.layers = [_with_kernel_norms(a, self.head_dim) for a in self.layers]
        specs = [layer.spec for layer in self.layers]
        self.head = output_head(model)
        self.windowed = any(s.window is not None for s in specs)
        # Rotary that follows the sequence's length (dynamic NTK, longrope past their switch): the
        # length from which the frequencies change, and whether transformers' generate then
        # recomputes every key (Phi-3's longrope drops the cache there).
        starts = [s.rotary.table_start for s in specs if s.rotary.by_length]
        self.rope_switch = min(starts) if starts else None
        self.recompute_at_switch = self.rope_switch is not None and drops_cache_at_switch(model)
        self.modified = any(s.has_mods for s in specs)
        if graphs is None:
            moe = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
            graphs = on_gpu and extension_available() and not paged and not moe
        if graphs and not on_gpu:
            raise ValueError("graphs=True needs the model on a CUDA device")
        if dispatch_on is None:
            dispatch_on = "capacity" if graphs else "length"
        if graphs and dispatch_on != "capacity":
            raise ValueError(
                f"graphs=True needs dispatch_on='capacity' (one plan for every step), got {dispatch_on!r}"
            )
        if not isinstance(prefill_tokens, int) or prefill_tokens < 1:
            raise ValueError(f"prefill_tokens must be a positive int, got {prefill_tokens!r}")
        self.graphs = graphs
        self.prefill_tokens = prefill_tokens
        self.cache = KVCache(
            config.num_hidden_layers, max_batch, max_seq_len, self.num_heads, self.num_kv_heads,
            self.head_dim, param.dtype, param.device, attention=specs, dispatch_on=dispatch_on,
            kv_dtype=kv_dtype, paged=paged, block_size=block_size, num_blocks=num_blocks,
        )  # fmt: skip
        self.kv_scale_margin = kv_scale_margin
        # Set during a tree step: the parents the layers' MmhaSelfAttention pass to step_tree.
        self.parents: torch.Tensor | None = None
        self.node_counts = None
        # The model's RMSNorms (layers, final; q/k norms the kernel does not take) as one launch each
        # during decode steps.
        self._norms = layer_norms(model) if fuse_norms else []
        self._attention = [
            MmhaSelfAttention(
                self, i, a, qk_row_norm(a.q_norm, a.k_norm, *heads, a.weight.dtype) if fuse_norms else None
            )
            for i, a in enumerate(self.layers)
        ]
        self._state: _GreedyState | None = None
        self._prompts: dict[int, list[int]] = {}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._pool = None

    # ------------------------------------------------------------------ prefill
    def _prefill_groups(self, lengths: list[int]) -> list[list[int]]:
        """Prompt indices in groups of at most ``prefill_tokens`` padded tokens (one prompt a
        group where sliding windows cut the model's own prompt cache, or where a prompt is past
        the length from which the rotary frequencies follow the length: a group's forward takes
        its longest prompt's)."""
        groups: list[list[int]] = []
        switch = self.rope_switch
        for i, n in enumerate(lengths):
            g = groups[-1] if groups else None
            if (
                g
                and not self.windowed
                and (switch is None or max(n, *(lengths[j] for j in g)) <= switch)
                and (len(g) + 1) * max(n, *(lengths[j] for j in g)) <= self.prefill_tokens
            ):
                g.append(i)
            else:
                groups.append([i])
        return groups

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]], rows: Sequence[int] | None = None) -> torch.Tensor:
        """Run the prompts through the model's own forward (right-padded groups) and copy their
        K/V into cache ``rows`` (default ``0..n-1``; they must be free, e.g. released). Returns
        the logits at each prompt's last token ``[n, vocab]``."""
        rows = list(range(len(prompts))) if rows is None else list(rows)
        if len(rows) != len(prompts):
            raise ValueError(f"rows must name {len(prompts)} rows (one per prompt), got {len(rows)}")
        dev = self.cache.device
        for r, prompt in zip(rows, prompts, strict=True):
            if len(prompt) == 0:
                raise ValueError(f"prompts must be non-empty, got an empty prompt for row {r}")
            if len(prompt) >= self.cache.max_seq_len:
                raise ValueError(
                    f"prompt for row {r} has {len(prompt)} tokens; the cache holds max_seq_len "
                    f"{self.cache.max_seq_len} including the tokens still to generate"
                )
        self.cache.admit(rows)
        for r, prompt in zip(rows, prompts, strict=True):
            self._prompts[r] = list(prompt)  # what a row's recompute at longrope's switch starts from
        lengths = [len(p) for p in prompts]
        logits = [None] * len(prompts)
        for group in self._prefill_groups(lengths):
            n = [lengths[i] for i in group]
            # Right padding: causal attention keeps the pads out of every real token's K/V.
            ids = torch.zeros(len(group), max(n), dtype=torch.long, device=dev)
            for j, i in enumerate(group):
                ids[j, : n[j]] = torch.tensor(list(prompts[i]), device=dev)
            if self.rope_switch is not None:
                reset_rotary_state(self.body)  # each group's forward as a fresh sequence's
            res = self.body(input_ids=ids, use_cache=True)
            for layer in range(len(self.body.layers)):
                k, v = _layer_kv(res.past_key_values, layer)
                if self.windowed:  # one prompt: a window layer's cache may hold its last tokens only
                    k, v = _full_length(k, n[0]), _full_length(v, n[0])
                self.cache.prefill(layer, k.transpose(1, 2), v.transpose(1, 2), n, [rows[i] for i in group],
                                   scale_margin=self.kv_scale_margin)  # fmt: skip
            last = res.last_hidden_state[
                torch.arange(len(group), device=dev), torch.tensor(n, device=dev) - 1
            ]
            for j, i in enumerate(group):
                logits[i] = last[j]
        return self.head(torch.stack(logits))

    # ------------------------------------------------------------------ decode steps
    def _layers(self, tokens: torch.Tensor) -> torch.Tensor:
        """Every layer's step for one token per row (lengths unchanged): the model's own forward
        with each layer's attention on the cache. The final-normed hidden states ``[B, hidden]``."""
        with swapped_attention(self.model, self._attention, self._norms):
            return self.body(input_ids=tokens[:, None], use_cache=False).last_hidden_state[:, 0]

    @torch.no_grad()
    def step(self, tokens: torch.Tensor) -> torch.Tensor:
        """One token per row ``tokens [B]`` through every layer; lengths advance. Returns fp32
        logits ``[B, vocab]``."""
        h = self._layers(tokens)
        self.cache.advance()
        return self.head(h)

    @torch.no_grad()
    def step_tree(self, tokens: torch.Tensor, parents: torch.Tensor, node_counts=None) -> torch.Tensor:
        """A tree of tokens per row through every layer (``KVCache.step_tree``): ``tokens [B, T]``
        as the nodes of ``parents [B, T]``, row ``b`` its first ``node_counts[b]`` (default all).
        Returns fp32 logits ``[B, T, vocab]`` (node t's prediction of the token after it; a row's
        nodes past its count are not meaningful); lengths do not move (``self.cache.accept``)."""
        if self.modified:
            raise ValueError("tree steps do not take score modifiers yet (sliding windows, soft-caps, sinks)")
        self.parents, self.node_counts = parents, node_counts
        try:
            with swapped_attention(self.model, self._attention, self._norms):
                h = self.body(input_ids=tokens, use_cache=False).last_hidden_state
        finally:
            self.parents = self.node_counts = None
        return self.head(h)

    def _greedy_step(self, rows: int) -> None:
        """A greedy step of rows ``0..rows-1`` on the device state alone (what a graph captures):
        the pick, a finished row's pad, the end-of-sequence flags, the history, the next input."""
        st = self._state
        tok = st.tokens[:rows]
        nxt = self.step(tok).argmax(-1)
        done = st.done[:rows]
        nxt = torch.where(done, st.pad, nxt)
        done |= (nxt[:, None] == st.eos[None, :]).any(-1)
        st.history[:rows].scatter_(1, (st.step % HISTORY).expand(rows, 1), nxt[:, None])
        st.step += 1
        tok.copy_(nxt)

    def _graph(self, rows: int) -> torch.cuda.CUDAGraph:
        """The captured greedy step of a bucket of ``rows`` rows (captured at its first use)."""
        graph = self._graphs.get(rows)
        if graph is None:
            if not self._graphs:  # every bucket's plans fit the workspace the graphs will share
                self.cache.reserve_workspace(buckets(self.cache.max_batch))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):  # one eager round: writes only what the step writes again
                self._layers(self._state.tokens[:rows])
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(graph, pool=self._pool):
                    self._greedy_step(rows)
            except RuntimeError as e:
                _free_generator_from_capture(self._state.tokens.device)
                raise RuntimeError(
                    "the model's decode step could not be captured in a CUDA graph (e.g. an operation "
                    "in it synchronises with the host or has data-dependent shapes; the cause is "
                    "chained below); use HFDecoder(..., graphs=False)"
                ) from e
            self._pool = graph.pool()
            self._graphs[rows] = graph
        return graph

    # ------------------------------------------------------------------ generation
    def _eos_ids(self, eos_token_id) -> list[int]:
        if eos_token_id is None:
            eos_token_id = getattr(getattr(self.model, "generation_config", None), "eos_token_id", None)
        ids = (
            []
            if eos_token_id is None
            else [eos_token_id]
            if isinstance(eos_token_id, int)
            else list(eos_token_id)
        )
        if len(ids) > MAX_EOS_IDS:
            raise ValueError(f"eos_token_id may name at most {MAX_EOS_IDS} ids, got {len(ids)}")
        return [int(i) for i in ids]

    @torch.no_grad()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        draft: HFDecoder | None = None,
        tree_shape: Sequence[int] | Sequence[Sequence[int]] = (2, 2, 1),
        eos_token_id: int | Sequence[int] | None = None,
        sync_every: int = 16,
    ) -> list[list[int]]:
        """Greedy decoding of a ragged batch (``len(prompts) <= max_batch``): up to
        ``max_new_tokens`` new tokens per prompt (the first from the prefill logits, the rest from
        mmha steps). A row stops after its first end-of-sequence token (``eos_token_id``, default
        the model's ``generation_config``; the token is kept); the batch stops when every row has.
        The host reads the tokens every ``sync_every`` steps (``<= 64``): between reads, steps
        (CUDA graphs by default on a GPU) run without a host synchronisation.

        With ``draft`` (an ``HFDecoder`` of a model with the same tokenizer): speculative decoding.
        Each round the draft grows a tree under the last token, ``tree_shape[d]`` children per
        node at depth ``d`` (its top tokens; ``tree_shape`` may instead hold one shape per prompt:
        ragged trees, each row its own node count in one step), and the target verifies the whole tree in one
        ``step_tree``: the longest root path whose tokens are the target's own greedy picks is
        accepted in both caches (``KVCache.accept``), plus the target's next pick. The tokens are
        exactly those of plain greedy decoding with the target (no end-of-sequence stop)."""
        if not 1 <= len(prompts) <= self.cache.max_batch:
            raise ValueError(
                f"prompts must hold 1..{self.cache.max_batch} prompts (max_batch), got {len(prompts)}"
            )
        longest = max(len(p) for p in prompts)
        if longest + max_new_tokens > self.cache.max_seq_len:
            raise ValueError(
                f"max_new_tokens ({max_new_tokens}) plus the longest prompt ({longest}) must fit in "
                f"max_seq_len ({self.cache.max_seq_len})"
            )
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not isinstance(sync_every, int) or not 1 <= sync_every <= HISTORY:
            raise ValueError(f"sync_every must be an int in [1, {HISTORY}], got {sync_every!r}")
        if draft is not None:
            return self._speculate(prompts, max_new_tokens, draft, list(tree_shape))
        eos = self._eos_ids(eos_token_id)
        self.cache.release(range(self.cache.max_batch))
        first = self.prefill(prompts).argmax(-1)
        return self._decode(first, max_new_tokens, eos, sync_every)

    def _decode(
        self, first: torch.Tensor, max_new_tokens: int, eos: list[int], sync_every: int
    ) -> list[list[int]]:
        n = first.shape[0]
        if self._state is None:
            self._state = _GreedyState.allocate(self.cache.max_batch, self.cache.device)
        st = self._state
        st.eos.fill_(-1)
        if eos:
            st.eos[: len(eos)] = torch.tensor(eos, device=st.eos.device)
        st.pad.fill_(eos[0] if eos else 0)
        st.tokens.zero_()
        st.tokens[:n] = first
        st.done.fill_(True)  # rows past the prompts (a bucket's spare rows) count as finished
        st.done[:n] = (first[:, None] == st.eos[None, :]).any(-1)
        st.step.zero_()
        out = [[t] for t in first.tolist()]
        rows = next(b for b in buckets(self.cache.max_batch) if b >= n) if self.graphs else n
        # The step at which each row's sequence reaches the switch + 1 tokens (where transformers
        # recomputes it), if it does.
        crossing = self._crossing_steps(n) if self.recompute_at_switch else {}
        taken, pending = 0, 0
        while taken + pending < max_new_tokens - 1:
            if self.graphs:
                self._graph(rows).replay()
            else:
                self._greedy_step(rows)
            pending += 1
            step = taken + pending - 1
            if pending == sync_every or taken + pending == max_new_tokens - 1 or step in crossing.values():
                if self.graphs:
                    self.cache.account_replay(pending)
                history = st.history[:n].tolist()  # one read, whatever the number of steps
                cols = [(taken + j) % HISTORY for j in range(pending)]
                for r in range(n):
                    out[r].extend(history[r][c] for c in cols)
                taken, pending = taken + pending, 0
                for r in [r for r, s in crossing.items() if s == step]:
                    self._recompute(r, out[r], step, eos)
                if bool(st.done[:n].all()):
                    break
        return [_until_eos(row, eos) for row in out]

    def _crossing_steps(self, n: int) -> dict[int, int]:
        """Row -> the decode step whose input token sits at position ``rope_switch`` (the step at
        which the row's sequence has switch + 1 tokens), for rows whose prompt is shorter."""
        switch = self.rope_switch
        return {r: switch - len(self._prompts[r]) for r in range(n) if len(self._prompts[r]) <= switch}

    def _recompute(self, r: int, tokens: list[int], step: int, eos: list[int]) -> None:
        """What transformers' generate does when a sequence first passes longrope's switch: row
        ``r``'s K/V recomputed by the model's forward over its whole sequence (the prompt and
        ``tokens`` but the last, which the step just picked with the short factors) and its pick
        replaced by that forward's. The device state (next input, history, end flag) follows."""
        st = self._state
        if any(t in eos for t in tokens[:-1]):
            return  # finished before the switch: its tokens after the end are cut anyway
        prompt = self._prompts[r]
        self.cache.release([r])
        pick = int(self.prefill([list(prompt) + tokens[:-1]], rows=[r]).argmax(-1)[0])
        tokens[-1] = pick
        st.tokens[r] = pick
        st.history[r, step % HISTORY] = pick
        st.done[r] = pick in eos

    def _speculate(
        self, prompts: Sequence[Sequence[int]], max_new_tokens: int, draft: HFDecoder, shape
    ) -> list[list[int]]:
        shapes = speculative.row_shapes(shape, len(prompts))
        nodes = max(speculative.tree_nodes(s) for s in shapes)
        depth = max(len(s) for s in shapes)
        longest = max(len(p) for p in prompts)
        for name, dec in (("the target", self), ("the draft", draft)):
            if longest + max_new_tokens + depth + nodes > dec.cache.max_seq_len:
                raise ValueError(
                    f"max_seq_len of {name} ({dec.cache.max_seq_len}) must hold the longest prompt "
                    f"({longest}), max_new_tokens ({max_new_tokens}) and a tree of {nodes} nodes past "
                    f"up to {depth} extra accepted tokens"
                )
        for dec in (self, draft):
            dec.cache.release(range(dec.cache.max_batch))
        cur = self.prefill(prompts).argmax(-1)  # emitted, not yet cached
        draft.prefill(prompts)
        first = [[int(t)] for t in cur.tolist()]
        out, _ = speculative.speculate(self, draft, cur, first, max_new_tokens, shapes)
        return out


@torch.no_grad()
def compare_kv_dtypes(
    model,
    prompts: Sequence[Sequence[int]],
    steps: int,
    kv_dtype: torch.dtype,
    *,
    kv_scale_margin: float = 1.0,
) -> dict:
    """Teacher-forced decoding of ``prompts`` with caches of the model's dtype (A) and of
    ``kv_dtype`` (B): both are fed A's greedy tokens for ``steps`` steps, and each step's logits
    are compared. A step of a row is a top-1 flip when B's pick differs from A's, and a decisive
    mismatch when A's pick beats B's under A's logits by more than twice that row's largest logit
    difference. Returns per-step max |logit difference| and the counts."""
    longest = max(len(p) for p in prompts)
    a = HFDecoder(model, len(prompts), longest + steps + 1)
    b = HFDecoder(
        model, len(prompts), longest + steps + 1, kv_dtype=kv_dtype, kv_scale_margin=kv_scale_margin
    )
    for dec in (a, b):
        dec.cache.release(range(dec.cache.max_batch))
    tok = a.prefill(prompts).argmax(-1)
    b.prefill(prompts)
    diffs, flips, decisive = [], 0, 0
    for _ in range(steps):
        la, lb = a.step(tok), b.step(tok)
        d = (la - lb).abs().amax(-1)
        pa, pb = la.argmax(-1), lb.argmax(-1)
        rows = (pa != pb).nonzero().flatten()
        flips += len(rows)
        if len(rows):
            margin = la[rows, pa[rows]] - la[rows, pb[rows]]
            decisive += int((margin > 2 * d[rows]).sum())
        diffs.append(d.max().item())
        tok = pa
    return {
        "steps": steps,
        "rows": len(prompts),
        "max_logit_diff": max(diffs),
        "mean_step_max_logit_diff": sum(diffs) / len(diffs),
        "logit_diff_per_step": diffs,
        "top1_flips": flips,
        "decisive_mismatches": decisive,
        "logit_scale": float(la.abs().max()),
    }
