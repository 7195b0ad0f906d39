"""``ShardedKVCache``: a ``KVCache`` spread over the ranks of a process group.

Each rank owns a local ``mmha.KVCache`` (the kernel on a GPU, the reference on a CPU) and steps it
with the same per-layer calls; what differs is which part of each layer's cache it holds
(``mmha.distributed.sharding``) and what crosses ranks:

- ``heads`` (tensor parallelism): ``Hkv / world`` kv heads and their query heads per rank; a
  step is the local step on the rank's slice of qkv, with no communication, and returns the
  rank's heads (``output="full"`` gathers every head: one all-gather).
- ``sequence`` (context parallelism): every head, and each row's tokens dealt out in blocks.
  Every rank attends over its shard (``KVCache.attend_only`` rows: the rank that owns the row's
  next slot appends the new token, the others only read; q and k are rotated at the global
  position, ``positions``), returning ``(out, lse)``; one all-gather of ``[B, Hq, D + 1]`` fp32
  and ``merge.merge`` give every rank the exact output (``output="heads"``: one all-to-all sends
  each rank the partials of its ``Hq / world`` heads). A step issues no host synchronisation and
  can be captured in a CUDA graph with its collectives; ``advance`` cannot.

Collectives run on the group's backend (NCCL on GPUs, gloo on CPUs) and wait with the group's
timeout: a rank that fails before a step's collective leaves the others with
``CollectiveError`` rather than a hang (with NCCL, set ``TORCH_NCCL_BLOCKING_WAIT=1`` for an
exception; otherwise NCCL's watchdog ends the process at the timeout).
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..cache import KVCache
from ..scales import check_margin
from ..spec import AttentionSpec, Rotary, layer_specs
from . import merge, sharding

MODES = ("heads", "sequence")
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


_all_to_all = dist.all_to_all_single


def _code(value) -> int:
    """A number for ``value`` (a dtype, a list of settings) that is the same in every process."""
    return zlib.crc32(str(value).encode())


class CollectiveError(RuntimeError):
    """A step's collective failed: another rank raised before joining it, died, or did not join
    within the process group's timeout."""


class ShardedKVCache:
    """``KVCache``'s API (``prefill``, ``step``, ``advance``, ``admit``, ``release``, ``reset``,
    ``check``, ``set_scales``) over the ranks of ``group`` (default: the world).

    Parameters are ``KVCache``'s, for the whole model (every head, ``max_seq_len`` tokens per row;
    ``attention``: each layer's spec for every head), plus ``mode`` (``"heads"`` or ``"sequence"``,
    module docstring), ``group``, and ``block``: tokens per block of sequence sharding. Every rank
    constructs the cache with the same arguments and makes the same calls in the same order.

    Heads mode gives each rank's local cache its heads' part of each spec (ALiBi slopes, sinks,
    epilogue channels). Sequence mode takes no ``window`` or ``alibi_slopes`` (a shard's slots are
    not the row's positions); its ranks attend with the spec's rotary, scale and soft-cap, and the
    sinks and the epilogue apply after the merge, to the channels a step returns.

    Attributes: ``local`` (this rank's ``KVCache``), ``world``, ``rank``, ``lengths`` (global
    int32 ``[max_batch]`` on ``device``), ``head_range`` / ``kv_head_range`` (heads of this rank in
    ``heads`` mode; every head in ``sequence`` mode).
    """

    def __init__(
        self,
        num_layers: int,
        max_batch: int,
        max_seq_len: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float16,
        device: str | torch.device = "cuda",
        *,
        mode: str = "sequence",
        group: dist.ProcessGroup | None = None,
        block: int = 64,
        attention: AttentionSpec | list[AttentionSpec] | None = None,
        rotary_dim: int = 0,
        rotary_theta: float = 10000.0,
        rotary_interleaved: bool = False,
        scale: float | None = None,
        dispatch_on: str = "length",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("ShardedKVCache needs torch.distributed initialised (init_process_group)")
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if not isinstance(block, int) or isinstance(block, bool) or block <= 0:
            raise ValueError(f"block must be a positive int, got {block!r}")
        self.group = group
        self.world = dist.get_world_size(group)
        self._gloo = dist.get_backend(group) == "gloo"
        self.rank = dist.get_rank(group)
        self.mode = mode
        self.block = block
        self.num_layers, self.max_batch, self.max_seq_len = num_layers, max_batch, max_seq_len
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype = dtype
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be divisible by num_kv_heads ({num_kv_heads})")
        if mode == "heads":
            if num_kv_heads % self.world:
                raise ValueError(
                    f"num_kv_heads ({num_kv_heads}) must be divisible by the world size ({self.world}) "
                    "in heads mode"
                )
            self.kv_head_range = sharding.head_range(num_kv_heads, self.world, self.rank)
            self.head_range = sharding.head_range(num_heads, self.world, self.rank)
            local_heads, local_kv, local_seq = (
                num_heads // self.world,
                num_kv_heads // self.world,
                max_seq_len,
            )
        else:
            self.kv_head_range, self.head_range = (0, num_kv_heads), (0, num_heads)
            local_heads, local_kv = num_heads, num_kv_heads
            local_seq = sharding.local_capacity(max_seq_len, self.world, block)
        self.attention = layer_specs(
            attention, num_layers, Rotary(rotary_dim, rotary_theta, rotary_interleaved), scale
        )
        self.local = KVCache(
            num_layers, max_batch, local_seq, local_heads, local_kv, head_dim, dtype, device,
            attention=[self._local_spec(i, a) for i, a in enumerate(self.attention)], dispatch_on=dispatch_on,
            kv_dtype=kv_dtype,
        )  # fmt: skip
        # Sequence mode turns rows attend-only and back as their next slot moves between ranks: the
        # kernel gets the row modes on every step, so a captured graph replays right either way.
        self.local.pass_row_modes = mode == "sequence"
        self.device = self.local.device
        self.fp8 = self.local.fp8
        self._host_lengths = [0] * max_batch
        self._active_mask = torch.ones(max_batch, dtype=torch.int32, device=self.device)
        self.lengths = self.local.lengths if mode == "heads" else torch.zeros_like(self.local.lengths)
        self._sync_modes(range(max_batch))
        self._agree(
            mode=MODES.index(mode), block=block, num_layers=num_layers, max_batch=max_batch,
            max_seq_len=max_seq_len, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            dtype=_code(dtype), kv_dtype=_code(kv_dtype),
            rotary_dims=_code([a.rotary.dim for a in self.attention]),
            qk_norms=_code([a.qk_norm is not None for a in self.attention]),
        )  # fmt: skip

    def _local_spec(self, layer: int, spec: AttentionSpec) -> AttentionSpec:
        """What this rank's local cache computes of layer ``layer``'s spec (class docstring)."""
        if self.mode == "heads":
            return spec.select_heads(*self.head_range, self.head_dim)
        if spec.window is not None or spec.alibi_slopes is not None:
            raise ValueError(
                f"attention[{layer}].window and .alibi_slopes need every slot at its position: use "
                "mode='heads' (sequence mode holds a row's tokens in blocks on several ranks)"
            )
        return spec.replace(sinks=None, epilogue=None)

    def _agree(self, **fields: int) -> None:
        """One all-gather of this rank's configuration when the cache is built: a field that
        differs between ranks raises ValueError naming it on every rank, and the group's
        communicator exists before the first step (NCCL makes it at the first collective, where a
        rank waiting for a peer that failed would block past the group's timeout)."""
        mine = torch.tensor(list(fields.values()), dtype=torch.int64, device=self.device)
        every = mine.new_empty(self.world * mine.numel())
        self._run(_all_gather, every, mine, "configuration check", None)
        every = every.view(self.world, -1).tolist()
        for i, name in enumerate(fields):
            values = [row[i] for row in every]
            if len(set(values)) > 1:
                raise ValueError(
                    f"ShardedKVCache: every rank must build the same cache, but {name} differs between "
                    f"ranks (per rank: {values})"
                )

    # ----------------------------------------------------------------- bookkeeping
    @property
    def host_lengths(self) -> list[int]:
        """Global tokens per row (host mirror)."""
        return list(self._host_lengths)

    @property
    def active_rows(self) -> list[int]:
        return self.local.active_rows  # the local cache's rows are the sharded cache's

    @property
    def free_rows(self) -> list[int]:
        return self.local.free_rows

    @property
    def nbytes(self) -> int:
        """Bytes of this rank's caches."""
        return self.local.nbytes

    def _set(self, rows: list[int], lengths: list[int], active: bool) -> None:
        for r, n in zip(rows, lengths, strict=True):
            self._host_lengths[r] = n
        if rows and self.mode == "sequence":
            idx = torch.tensor(rows, dtype=torch.long).to(self.device)
            self.lengths[idx] = torch.tensor(lengths, dtype=torch.int32).to(self.device)
            self._active_mask[idx] = int(active)
        self._sync_modes(rows)

    def _sync_modes(self, rows: Sequence[int]) -> None:
        """Sequence mode: each active row steps on the rank that owns its next slot and only
        attends elsewhere (KVCache.attend_only), changed where it differs."""
        if self.mode != "sequence":
            return
        attend, active = set(self.local.attend_rows), set(self.local.active_rows)
        to_attend, to_step = [], []
        for r in rows:
            if r not in active or self._host_lengths[r] >= self.max_seq_len:  # free or full: no next slot
                continue
            owns = sharding.owner(self._host_lengths[r], self.world, self.block) == self.rank
            if owns and r in attend:
                to_step.append(r)
            elif not owns and r not in attend:
                to_attend.append(r)
        if to_attend:
            self.local.attend_only(to_attend, True)
        if to_step:
            self.local.attend_only(to_step, False)

    def release(self, rows: Sequence[int]) -> None:
        """Free rows (``KVCache.release``)."""
        self.local.release(rows)
        rows = [int(r) for r in rows]
        self._set(rows, [0] * len(rows), False)

    def admit(self, rows: Sequence[int] | None = None, count: int | None = None) -> list[int]:
        """Take free rows for new sequences, length 0 (``KVCache.admit``)."""
        rows = self.local.admit(rows, count)
        self._set(rows, [0] * len(rows), True)
        return rows

    def reset(self) -> None:
        """All rows active with length 0."""
        self.local.reset()
        self._set(list(range(self.max_batch)), [0] * self.max_batch, True)

    def check(self) -> None:
        """This rank's status flags (``KVCache.check``)."""
        self.local.check()

    def advance(self) -> None:
        """Every active row's length moves on by one (after the last layer's ``step``). Sequence
        mode moves the owner's local length and hands a row whose next slot starts a new block to
        that block's rank (host bookkeeping: not inside CUDA-graph capture)."""
        if self.mode == "heads":
            self.local.advance()
            self._host_lengths = self.local.host_lengths
            return
        if self.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("ShardedKVCache.advance in sequence mode cannot be captured in a CUDA graph")
        over = [r for r in self.active_rows if self._host_lengths[r] + 1 > self.max_seq_len]
        if over:
            raise ValueError(f"rows {over} would exceed max_seq_len ({self.max_seq_len}) after 1 more step")
        self.local.advance()
        for r in self.active_rows:
            self._host_lengths[r] += 1
        self.lengths.add_(self._active_mask)
        self._sync_modes([r for r in self.active_rows if self._host_lengths[r] % self.block == 0])

    # ----------------------------------------------------------------- prefill and scales
    def _local_heads(self, t: torch.Tensor, dim: int, full: int, name: str) -> torch.Tensor:
        """Heads mode: this rank's heads of ``t`` along ``dim`` (``full`` heads there, or already
        the rank's share)."""
        share = full // self.world
        first = (self.kv_head_range if full == self.num_kv_heads else self.head_range)[0]
        if t.shape[dim] == full:
            return t.narrow(dim, first, share)
        if t.shape[dim] == share:
            return t
        raise ValueError(
            f"{name} must hold {full} heads (or this rank's {share}) along dim {dim}, got {t.shape[dim]}"
        )

    def set_scales(self, layer: int, k_scale, v_scale) -> None:
        """fp8 caches: layer ``layer``'s scales (``KVCache.set_scales``) for every kv head."""
        if self.mode == "heads":
            k_scale, v_scale = (
                self._local_heads(
                    torch.as_tensor(s, dtype=torch.float32).reshape(-1), 0, self.num_kv_heads, name
                )
                if torch.as_tensor(s).dim() > 0
                else s
                for s, name in ((k_scale, "k_scale"), (v_scale, "v_scale"))
            )
        self.local.set_scales(layer, k_scale, v_scale)

    def prefill(
        self,
        layer: int,
        k: torch.Tensor,
        v: torch.Tensor,
        lengths: Sequence[int] | torch.Tensor | None = None,
        rows: Sequence[int] | None = None,
        *,
        scales: str = "auto",
        scale_margin: float = 1.0,
    ) -> None:
        """Write prompt K/V ``[n, S, Hkv, D]`` (every head; in heads mode this rank's ``Hkv /
        world`` also do) of ``n`` rows, rotated as ``KVCache.prefill`` takes them; each rank keeps
        its part. fp8 scales (``scales``, ``scale_margin``: as ``KVCache.prefill``) come from the
        whole prompt, so every rank of sequence mode sets the same ones."""
        if self.mode == "heads":
            k = self._local_heads(k, 2, self.num_kv_heads, "k") if k.dim() == 4 else k
            v = self._local_heads(v, 2, self.num_kv_heads, "v") if v.dim() == 4 else v
            self.local.prefill(layer, k, v, lengths, rows, scales=scales, scale_margin=scale_margin)
            self._host_lengths = self.local.host_lengths
            return
        for name, t in (("k", k), ("v", v)):
            if t.dim() != 4 or t.shape[2:] != (self.num_kv_heads, self.head_dim):
                raise ValueError(
                    f"{name} must have shape [n, S, {self.num_kv_heads}, {self.head_dim}], "
                    f"got {tuple(t.shape)}"
                )
        if k.shape != v.shape:
            raise ValueError(f"v must have k's shape {tuple(k.shape)}, got {tuple(v.shape)}")
        n, s = k.shape[:2]
        lens = (
            [s] * n
            if lengths is None
            else [int(x) for x in (lengths.tolist() if isinstance(lengths, torch.Tensor) else lengths)]
        )
        if len(lens) != n:
            raise ValueError(f"lengths must have {n} entries, got {len(lens)}")
        for i, length in enumerate(lens):
            if not 0 <= length <= min(s, self.max_seq_len):
                raise ValueError(
                    f"lengths[{i}] must be in [0, {min(s, self.max_seq_len)}] (prompt width {s}, max_seq_len "
                    f"{self.max_seq_len}), got {length}"
                )
        rows = list(range(n)) if rows is None else [int(r) for r in rows]
        if len(rows) != n:
            raise ValueError(f"rows must name {n} rows (one per prompt), got {len(rows)}")
        local_lens = sharding.local_lengths(lens, self.world, self.rank, self.block)
        width = max(local_lens, default=0)
        k_loc = k.new_zeros((n, width, self.num_kv_heads, self.head_dim))
        v_loc = v.new_zeros((n, width, self.num_kv_heads, self.head_dim))
        for i, length in enumerate(lens):
            pos = sharding.local_positions(length, self.world, self.rank, self.block).to(k.device)
            k_loc[i, : pos.numel()] = k[i, pos]
            v_loc[i, : pos.numel()] = v[i, pos]
        if self.fp8 and scales in ("auto", "amax"):
            if scales == "amax" or not self.local.scales.was_set[layer]:
                kept = [i for i, length in enumerate(lens) if length]
                if kept:  # the whole prompt's maxima: the same scales on every rank
                    k_amax = torch.stack([k[i, : lens[i]].float().abs().amax(dim=(0, 2)) for i in kept]).amax(
                        dim=0
                    )
                    v_amax = torch.stack([v[i, : lens[i]].float().abs().amax(dim=(0, 2)) for i in kept]).amax(
                        dim=0
                    )
                    self.local.check_scales_unused(layer, rows)
                    self.local.scales.calibrate(layer, k_amax, v_amax, check_margin(scale_margin))
            scales = "keep"
        self.local.prefill(layer, k_loc, v_loc, local_lens, rows, scales=scales, scale_margin=scale_margin)
        self._set(rows, lens, True)

    # ----------------------------------------------------------------- decode
    def _local_qkv(self, qkv: torch.Tensor, name: str) -> torch.Tensor:
        """Heads mode: this rank's q, k and v columns of a full qkv (or bias) row, or the rank's
        own slice as a column-parallel projection gives it."""
        d, world = self.head_dim, self.world
        full = (self.num_heads + 2 * self.num_kv_heads) * d
        share = full // world
        if qkv.shape[-1] == share or world == 1:
            return qkv
        if qkv.shape[-1] != full:
            raise ValueError(
                f"{name} must have {full} columns (every head) or this rank's {share}, got {qkv.shape[-1]}"
            )
        (h0, h1), (g0, g1) = self.head_range, self.kv_head_range
        hq, hkv = self.num_heads, self.num_kv_heads
        return torch.cat(
            [
                qkv[..., h0 * d : h1 * d],
                qkv[..., (hq + g0) * d : (hq + g1) * d],
                qkv[..., (hq + hkv + g0) * d : (hq + hkv + g1) * d],
            ],
            dim=-1,
        )

    def _run(self, collective, out: torch.Tensor, inp: torch.Tensor, what: str, layer: int, **kw) -> None:
        """``collective(out, inp, group=..., async_op=True, **kw)``, waited on; gloo carries CUDA
        tensors through host copies (several ranks on one GPU)."""
        host = self._gloo and inp.is_cuda
        o, i = (out.cpu(), inp.cpu()) if host else (out, inp)
        self._wait(collective(o, i, group=self.group, async_op=True, **kw), what, layer)
        if host:
            out.copy_(o)

    def _wait(self, work, what: str, layer: int) -> None:
        try:
            work.wait()
        except Exception as e:  # the backends raise RuntimeError / DistBackendError subclasses
            where = "the cache's construction" if layer is None else f"layer {layer}'s step"
            raise CollectiveError(
                f"mmha.distributed: the {what} of {where} failed on rank {self.rank} of "
                f"{self.world} (another rank failed before joining it, or did not join within the "
                f"process group's timeout): {e}"
            ) from e

    def step(
        self,
        layer: int,
        qkv: torch.Tensor,
        *,
        qkv_bias: torch.Tensor | None = None,
        return_lse: bool = False,
        output: str | None = None,
        variant: str = "auto",
        num_splits: int | None = None,
        stages: int | None = None,
        tile_source: str = "auto",
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``layer`` for rows ``0..B-1`` (``KVCache.step``'s arguments), as the
        layer's spec says (class docstring).

        ``qkv [B, (Hq + 2 Hkv) D]`` on every rank (heads mode: or the rank's ``[B, (Hq + 2 Hkv) D /
        world]``, as a column-parallel projection gives it; ``qkv_bias`` likewise). ``output``:
        ``"full"`` returns ``out [B, Hq * D]`` (and ``lse [B, Hq]``) on every rank, ``"heads"`` this
        rank's heads ``[B, Hq * D / world]`` (and ``[B, Hq / world]``); default ``"heads"`` in heads
        mode (no communication) and ``"full"`` in sequence mode.
        """
        mode_out = output if output is not None else ("heads" if self.mode == "heads" else "full")
        if mode_out not in ("heads", "full"):
            raise ValueError(f"output must be 'heads' or 'full', got {output!r}")
        if mode_out == "heads" and self.num_heads % self.world:
            raise ValueError(f"output='heads' needs num_heads ({self.num_heads}) divisible by the world size")
        kw = dict(variant=variant, num_splits=num_splits, stages=stages, tile_source=tile_source)
        if self.mode == "heads":
            return self._step_heads(layer, qkv, qkv_bias, return_lse, mode_out, kw)
        self.local.attention_of(layer)  # checks layer
        spec = self.attention[layer]
        batch = qkv.shape[0] if qkv.dim() == 2 else -1
        full = [r for r in range(max(batch, 0)) if self._host_lengths[r] >= self.max_seq_len]
        if full:  # their ranks only attend (no next slot): refused here, as KVCache.step does
            raise ValueError(
                f"rows {full} are full: length {self.max_seq_len} == max_seq_len leaves no slot "
                "for the new token; release them or use a larger cache"
            )
        positions = self.lengths[:batch] if 1 <= batch <= self.max_batch else None
        out, lse = self.local.step(layer, qkv, qkv_bias=qkv_bias, return_lse=True, positions=positions, **kw)
        out, lse = self._exchange_merge(out, lse, spec, layer, mode_out)
        return (out, lse) if return_lse else out

    def _exchange_merge(self, out, lse, spec: AttentionSpec, layer: int, mode_out: str):
        """Every rank's ``(out, lse)`` over its shard -> the merged output of ``mode_out``'s heads:
        one all-gather of ``[B, Hq, D + 1]`` (``"full"``), or one all-to-all that sends each rank
        its heads' partials (``"heads"``), then ``merge.merge`` with the spec's sinks and epilogue
        (of those heads)."""
        groups = 1 if mode_out == "full" else self.world
        parts = merge.pack(out, lse, self.num_heads, groups)
        if self.world > 1:
            received = parts.new_empty((self.world, *parts.shape[1:]))
            if groups == 1:
                self._run(_all_gather, received, parts, "all-gather", layer)
            else:
                self._run(_all_to_all, received, parts, "all-to-all", layer)
            parts = received
        if groups > 1:
            per = self.num_heads // self.world
            spec = spec.select_heads(self.rank * per, (self.rank + 1) * per, self.head_dim)
        epilogue = spec.epilogue
        out, lse = merge.merge(parts, spec.sinks, self.dtype if epilogue is None else torch.float32)
        return (out if epilogue is None else epilogue.apply(out, self.dtype)), lse

    def _step_heads(self, layer, qkv, qkv_bias, return_lse, output, kw):
        qkv = self._local_qkv(qkv, "qkv")
        if qkv_bias is not None:
            qkv_bias = self._local_qkv(qkv_bias, "qkv_bias")
        out, lse = self.local.step(layer, qkv, qkv_bias=qkv_bias, return_lse=True, **kw)
        if output == "full" and self.world > 1:
            out, lse = self._gather_heads(out, layer), self._gather_heads(lse, layer)
        return (out, lse) if return_lse else out

    def _gather_heads(self, t: torch.Tensor, layer: int) -> torch.Tensor:
        """``[B, X]`` of this rank's heads -> ``[B, world * X]``, ranks' heads in order."""
        t = t.contiguous()
        gathered = t.new_empty((self.world * t.shape[0], *t.shape[1:]))
        self._run(_all_gather, gathered, t, "all-gather", layer)
        return gathered.view(self.world, *t.shape).transpose(0, 1).reshape(t.shape[0], -1)
