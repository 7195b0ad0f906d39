"""A soak of ``KVCache`` under continuous batching: thousands of steps on a paged cache whose rows
are admitted with ragged prompts, forked, stepped, verified in trees and accepted, finished at an
end-of-sequence draw and released, with per-layer attention settings and fp8 or 16-bit caches.

A contiguous mirror holds what every row should hold (its own tokens only, in the cache's dtype):
prompts are written into it, and each step's new slots are copied into it from the row's own
blocks. The soak checks, as it goes:

- the page pool's invariants after every operation, and that a block is shared only by rows of
  one fork family; free blocks are filled with NaN, so a row that read one would show it;
- on sampled steps, every layer's output against ``mmha.reference`` run on the mirror (the
  kernel on a GPU, the paged reference on a CPU), and the appended slots against the reference's;
- on sampled steps, every active row's tokens in every layer equal the mirror's bit for bit
  (nothing a row still reads was overwritten: forks, accepts and appends went where they should);
- at the end, with every row released, the pool's free blocks are back at their start count.

``tests/test_soak.py`` runs a short soak on the CPU (CI) and a long one on a GPU.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from mmha import layout, reference, spec, tree
from mmha.cache import KVCache
from mmha.epilogue import OutEpilogue
from mmha.spec import AttentionSpec, Rotary

FP8 = torch.float8_e4m3fn
# Tolerance of an output against the reference on the mirror, in units of max(1, max|ref|): the
# kernel's fp16 q and P and fp32 accumulation (tests/helpers.py FLOOR, with room for a rotated k
# one rounding step from torch's).
TOLERANCE = {torch.float16: 4e-3, torch.bfloat16: 3.2e-2}


@dataclass
class SoakConfig:
    scenario: str = "modifiers"  # "modifiers": one-token steps; "speculative": tree rounds too
    steps: int = 120
    max_batch: int = 4
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 32
    max_seq_len: int = 96
    block_size: int = 16
    dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype | None = None
    check_every: int = 6
    seed: int = 0


def layer_settings(scenario: str, num_heads: int, head_dim: int, device) -> list[AttentionSpec]:
    """Each layer's attention: rotary everywhere (NeoX over the head, or GPT-J over half of it),
    and score modifiers or an output epilogue per layer. Tree steps take no score modifiers, so the
    speculative scenario's layers have rotary and epilogues only."""
    g = torch.Generator().manual_seed(7)
    channels = num_heads * head_dim
    epilogue = OutEpilogue(
        shift=(torch.randn(channels, generator=g) * 0.1).to(device),
        smooth=(torch.rand(channels, generator=g) + 0.5).to(device),
    )
    plain = Rotary(head_dim, 10000.0, False)
    half = Rotary(head_dim // 2, 500.0, True)
    if scenario == "speculative":
        return [AttentionSpec(rotary=plain), AttentionSpec(rotary=half, epilogue=epilogue)]
    sinks = torch.linspace(-1.0, 2.0, num_heads).to(device)
    return [
        AttentionSpec(rotary=plain),
        AttentionSpec(rotary=plain, window=21, sinks=sinks),
        AttentionSpec(rotary=half, softcap=8.0, alibi_slopes=spec.alibi_slopes(num_heads).to(device)),
        AttentionSpec(rotary=plain, epilogue=epilogue),
    ]


class Soak:
    """One soak run (``run()``); ``stats`` counts what it did."""

    def __init__(self, cfg: SoakConfig, device: str | torch.device):
        self.cfg, self.device = cfg, torch.device(device)
        self.rng = random.Random(cfg.seed)
        self.gen = torch.Generator().manual_seed(cfg.seed)
        self.layers = layer_settings(cfg.scenario, cfg.num_heads, cfg.head_dim, self.device)
        max_blocks = -(-cfg.max_seq_len // cfg.block_size)
        cache = KVCache(
            len(self.layers), cfg.max_batch, cfg.max_seq_len, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.dtype, self.device, attention=self.layers, kv_dtype=cfg.kv_dtype, paged=True,
            block_size=cfg.block_size, num_blocks=cfg.max_batch * max_blocks,
        )  # fmt: skip
        # Every layer in one cache, each with its own spec (the soak's helpers take several caches
        # stepped in lockstep: the same rows, lengths, forks and accepts).
        self.group_caches = [cache]
        self.caches: list[tuple[KVCache, int]] = [(cache, layer) for layer in range(len(self.layers))]
        kv = cfg.kv_dtype or cfg.dtype
        hkv, d, s = cfg.num_kv_heads, cfg.head_dim, cfg.max_seq_len
        self.mk = [torch.zeros(layout.k_cache_shape(cfg.max_batch, hkv, s, d, kv), dtype=kv, device=self.device)
                   for _ in self.layers]  # fmt: skip
        self.mv = [torch.zeros(layout.v_cache_shape(cfg.max_batch, hkv, s, d), dtype=kv, device=self.device)
                   for _ in self.layers]  # fmt: skip
        self.family: dict[int, int] = {}
        self.next_family = 0
        self.stats = dict(steps=0, tree_rounds=0, admitted=0, forked=0, released=0, checked=0, tokens=0)

    # ------------------------------------------------------------------ helpers
    @property
    def lead(self) -> KVCache:
        return self.group_caches[0]

    def each_cache(self, fn) -> None:
        for cache in self.group_caches:
            fn(cache)

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen).to(self.cfg.dtype).to(self.device)

    def poison_free_blocks(self) -> None:
        """NaN in every block no row owns: a row that reads one gets NaN."""
        for cache in self.group_caches:
            owned = {b for r in range(cache.max_batch) for b in cache.pool.rows[r]}
            free = [b for b in range(cache.pool.num_blocks) if b not in owned]
            if not free:
                continue
            idx = torch.tensor(free, dtype=torch.long, device=self.device)
            for kc, vc in zip(cache.k_caches, cache.v_caches, strict=True):
                kc[idx] = torch.full_like(kc[idx], float("nan"))
                vc[idx] = torch.full_like(vc[idx], float("nan"))

    def check_pool(self) -> None:
        for cache in self.group_caches:
            cache.pool.check()
            owners: dict[int, set[int]] = {}
            for r in cache.active_rows:
                for blk in cache.pool.rows[r]:
                    owners.setdefault(blk, set()).add(self.family[r])
            shared = [b for b, f in owners.items() if len(f) > 1]
            assert not shared, f"blocks {shared} are shared by rows that never forked from each other"
        lengths = [c.host_lengths for c in self.group_caches]
        assert all(x == lengths[0] for x in lengths), "the caches' lengths drifted apart"

    def row_tokens(self, layer: int, row: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Slots ``0 .. n - 1`` of a row in the paged cache, as packed contiguous ``[Hkv, D/x, n, x]``
        and ``[Hkv, n, D]``."""
        cache, j = self.caches[layer]
        blocks = cache.pool.rows[row]
        k = layout.gather_k(cache.k_caches[j], blocks)[0, :, :, :n]
        v = layout.gather_v(cache.v_caches[j], blocks)[0, :, :n]
        return k, v

    def copy_new_slots(self, layer: int, rows: list[int], starts: list[int], counts: list[int]) -> None:
        """The mirror takes slots ``starts[i] .. starts[i] + counts[i] - 1`` of each row from the
        row's own blocks (what the step or the accept wrote)."""
        cache, j = self.caches[layer]
        bs = cache.pool.block_size
        rr, ss = [], []
        for r, n, c in zip(rows, starts, counts, strict=True):
            rr += [r] * c
            ss += list(range(n, n + c))
        if not rr:
            return
        blk = torch.tensor(
            [cache.pool.rows[r][s // bs] for r, s in zip(rr, ss, strict=True)], device=self.device
        )
        off = torch.tensor([s % bs for s in ss], device=self.device)
        r_idx, s_idx = torch.tensor(rr, device=self.device), torch.tensor(ss, device=self.device)
        self.mk[layer][r_idx, :, :, s_idx] = cache.k_caches[j][blk, :, :, off]
        self.mv[layer][r_idx, :, s_idx] = cache.v_caches[j][blk, :, off]

    def scales(self, layer: int) -> dict:
        cache, j = self.caches[layer]
        if not cache.fp8:
            return {}
        return dict(k_scale=cache.k_scales[j], v_scale=cache.v_scales[j])

    def close(self, out: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        assert out.shape == ref.shape and out.dtype == ref.dtype, f"{what}: {out.shape} {out.dtype}"
        o, r = out.double(), ref.double()
        assert torch.isfinite(o).all(), f"{what}: non-finite output"
        err = (o - r).abs().max().item() if o.numel() else 0.0
        tol = TOLERANCE[self.cfg.dtype] * max(1.0, r.abs().max().item())
        assert err <= tol, f"{what}: max error {err:.3e} > {tol:.3e}"

    def close_k(self, k: torch.Tensor, ref: torch.Tensor, what: str) -> None:
        """Appended k: within one rounding step of the reference's (the kernel's rotation and
        torch's differ in the last fp32 bit)."""
        diff = (k.float() - ref.float()).abs()
        step = ref.float().abs() * (2.0**-3 if k.dtype == FP8 else 2.0**-7) + 2.0**-9
        assert bool((diff <= step).all()), f"{what}: appended k more than one step from the reference"

    # ------------------------------------------------------------------ the lifecycle
    def admit(self) -> None:
        """Ragged prompts into some free rows (all layers)."""
        cfg, free = self.cfg, self.lead.free_rows
        if not free:
            return
        rows = self.rng.sample(free, self.rng.randint(1, len(free)))
        lens = [self.rng.randint(1, cfg.max_seq_len // 2) for _ in rows]
        width = max(lens)
        for layer in range(len(self.layers)):
            cache, j = self.caches[layer]
            k = self.randn(len(rows), width, cfg.num_kv_heads, cfg.head_dim)
            v = self.randn(len(rows), width, cfg.num_kv_heads, cfg.head_dim)
            cache.prefill(j, k, v, lens, rows)
            for i, (r, n) in enumerate(zip(rows, lens, strict=True)):
                got_k, got_v = self.row_tokens(layer, r, n)
                want_k, want_v = k[i : i + 1, :n], v[i : i + 1, :n]
                if cache.fp8:
                    want_k = spec.quantize_fp8(want_k, cache.k_scales[j])
                    want_v = spec.quantize_fp8(want_v, cache.v_scales[j])
                want_k = layout.pack_k(want_k.to(got_k.dtype))[0]
                want_v = layout.pack_v(want_v.to(got_v.dtype))[0]
                assert torch.equal(got_k.view(torch.uint8), want_k.view(torch.uint8)), "prefill wrote k wrong"
                assert torch.equal(got_v.view(torch.uint8), want_v.view(torch.uint8)), "prefill wrote v wrong"
                self.mk[layer][r, :, :, :n] = got_k
                self.mv[layer][r, :, :n] = got_v
        for r in rows:
            self.family[r] = self.next_family
            self.next_family += 1
        self.stats["admitted"] += len(rows)

    def fork(self) -> None:
        active, free = self.lead.active_rows, self.lead.free_rows
        if not active or not free:
            return
        src = self.rng.choice(active)
        dsts = self.rng.sample(free, self.rng.randint(1, len(free)))
        self.each_cache(lambda c: c.fork(src, dsts))
        n = self.lead.host_lengths[src]
        for layer in range(len(self.layers)):
            for d in dsts:
                self.mk[layer][d, :, :, :n] = self.mk[layer][src, :, :, :n]
                self.mv[layer][d, :, :n] = self.mv[layer][src, :, :n]
        for d in dsts:
            self.family[d] = self.family[src]
        self.stats["forked"] += len(dsts)

    def finish(self, margin: int) -> None:
        """Rows that drew an end-of-sequence token, or are near the capacity, are released."""
        done = [
            r
            for r in self.lead.active_rows
            if self.rng.random() < 0.04 or self.lead.host_lengths[r] >= self.cfg.max_seq_len - margin
        ]
        if done:
            self.each_cache(lambda c: c.release(done))
            self.stats["released"] += len(done)

    # ------------------------------------------------------------------ steps
    def step(self, check: bool) -> None:
        """One token for rows ``0 .. B - 1`` through every layer, then ``advance``."""
        cfg, lead = self.cfg, self.lead
        active = lead.active_rows
        batch = max(active) + 1
        lengths = lead.host_lengths[:batch]
        modes = [spec.ROW_STEP if r in active else spec.ROW_IDLE for r in range(batch)]
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        for layer, attention in enumerate(self.layers):
            cache, j = self.caches[layer]
            qkv = self.randn(batch, width)
            if check:
                mk, mv = self.mk[layer][:batch].clone(), self.mv[layer][:batch].clone()
                ref = reference.decode_step(
                    qkv, mk, mv, torch.tensor(lengths, dtype=torch.int32, device=self.device),
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, attention=attention,
                    row_active=torch.tensor(modes, dtype=torch.int32, device=self.device), **self.scales(layer),
                )  # fmt: skip
            out = cache.step(j, qkv)
            self.copy_new_slots(layer, active, [lengths[r] for r in active], [1] * len(active))
            if check:
                rows = torch.tensor(active, device=self.device)
                self.close(out[rows], ref[rows], f"step {self.stats['steps']} layer {layer}")
                idx = torch.tensor(active, device=self.device)
                pos = torch.tensor([lengths[r] for r in active], device=self.device)
                self.close_k(self.mk[layer][idx, :, :, pos], mk[idx, :, :, pos], f"layer {layer} k")
                assert torch.equal(
                    self.mv[layer][idx, :, pos].view(torch.uint8), mv[idx, :, pos].view(torch.uint8)
                ), f"layer {layer}: appended v differs from the reference's"
        self.each_cache(lambda c: c.advance())
        self.stats["steps"] += 1
        self.stats["tokens"] += len(active)

    def tree_round(self, check: bool) -> None:
        """A tree of 2-6 nodes per row (ragged node counts) through every layer, then ``accept``
        of a random root path per active row (host lists or a device tensor)."""
        cfg, lead = self.cfg, self.lead
        active = lead.active_rows
        batch = max(active) + 1
        lengths = lead.host_lengths[:batch]
        t = self.rng.randint(2, 6)
        parents = [[-1] + [self.rng.randint(-1, i - 1) for i in range(1, t)] for _ in range(batch)]
        counts = [self.rng.randint(1, t) for _ in range(batch)]
        par = torch.tensor(parents, dtype=torch.int32, device=self.device)
        width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        expected = {}
        for layer, attention in enumerate(self.layers):
            cache, j = self.caches[layer]
            qkv = self.randn(batch, t, width)
            out = cache.step_tree(j, qkv, par, node_counts=counts)
            if check:
                mk, mv = self.mk[layer][:batch].clone(), self.mv[layer][:batch].clone()
                ref = reference.decode_tree(
                    qkv, mk, mv, torch.tensor(lengths, dtype=torch.int32, device=self.device), par,
                    num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, node_counts=counts, attention=attention,
                    **self.scales(layer),
                )  # fmt: skip
                for r in active:
                    self.close(out[r, : counts[r]], ref[r, : counts[r]], f"tree round layer {layer} row {r}")
                expected[layer] = (mk, mv)
        paths = []
        for r in active:
            if self.rng.random() < 0.2:
                paths.append([])
            else:
                node = self.rng.randrange(counts[r])
                paths.append(tree.ancestors(parents[r][: counts[r]])[node])
        if self.rng.random() < 0.5:
            self.each_cache(lambda c: c.accept(active, paths))
        else:
            width_p = max((len(p) for p in paths), default=0) or 1
            dev_paths = torch.full((len(active), width_p), -1, dtype=torch.int32, device=self.device)
            for i, p in enumerate(paths):
                dev_paths[i, : len(p)] = torch.tensor(p, dtype=torch.int32)
            self.each_cache(lambda c: c.accept(active, dev_paths))
        starts = [lengths[r] for r in active]
        counts_kept = [len(p) for p in paths]
        for layer in range(len(self.layers)):
            self.copy_new_slots(layer, active, starts, counts_kept)
            if check:
                mk, mv = expected[layer]
                for r, n, p in zip(active, starts, paths, strict=True):
                    for i, node in enumerate(p):
                        self.close_k(self.mk[layer][r, :, :, n + i], mk[r, :, :, n + node], "accepted k")
                        assert torch.equal(
                            self.mv[layer][r, :, n + i].view(torch.uint8),
                            mv[r, :, n + node].view(torch.uint8),
                        ), f"layer {layer} row {r}: accepted v differs from node {node}'s"
        for cache in self.group_caches[1:]:
            assert cache.host_lengths == lead.host_lengths
        self.stats["tree_rounds"] += 1
        self.stats["tokens"] += sum(counts_kept)

    def check_contents(self) -> None:
        """Every active row's tokens, every layer, equal the mirror's bit for bit."""
        for layer in range(len(self.layers)):
            for r in self.lead.active_rows:
                n = self.lead.host_lengths[r]
                k, v = self.row_tokens(layer, r, n)
                assert torch.equal(k.view(torch.uint8), self.mk[layer][r, :, :, :n].view(torch.uint8)), (
                    f"layer {layer} row {r}: cached k differs from the row's own tokens"
                )
                assert torch.equal(v.view(torch.uint8), self.mv[layer][r, :, :n].view(torch.uint8)), (
                    f"layer {layer} row {r}: cached v differs from the row's own tokens"
                )
        self.stats["checked"] += 1

    # ------------------------------------------------------------------ the run
    def run(self) -> dict:
        cfg = self.cfg
        self.each_cache(lambda c: c.release(range(cfg.max_batch)))
        start_free = [c.pool.free_blocks for c in self.group_caches]
        assert start_free == [c.pool.num_blocks for c in self.group_caches]
        self.poison_free_blocks()
        speculative = cfg.scenario == "speculative"
        for it in range(cfg.steps):
            check = it % cfg.check_every == 0
            self.finish(margin=8)
            if self.rng.random() < 0.25 or not self.lead.active_rows:
                self.admit()
            if self.rng.random() < 0.1:
                self.fork()
            self.poison_free_blocks()
            self.check_pool()
            if not self.lead.active_rows:
                continue
            if speculative and self.rng.random() < 0.35:
                self.tree_round(check)
            else:
                self.step(check)
            self.check_pool()
            if check:
                self.check_contents()
        self.each_cache(lambda c: c.release(range(cfg.max_batch)))
        self.check_pool()
        end_free = [c.pool.free_blocks for c in self.group_caches]
        assert end_free == start_free, f"free blocks {end_free} after the soak, {start_free} before"
        for cache in self.group_caches:
            cache.check()  # the kernel's status flags: no row was refused
        return self.stats
