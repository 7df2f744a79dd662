"""Paged attention in Triton: what the engine runs on a GPU.

Two kernels, both reading the cache through the block table where it lies (nothing is gathered
into a contiguous copy first, so keys and values cross memory once):

- `store_kv`: each new token's key and value rows go to their slot (block * block_size + offset);
  a negative slot is skipped, which is how the padded rows of a captured CUDA graph write nothing.
- `paged_attention`: one kernel for every kind of row the scheduler mixes in a step. A program
  takes one sequence, one KV head and a tile of that sequence's new queries; query i of a
  sequence with q_len new tokens and seq_len in all sits at position seq_len - q_len + i and sees
  keys 0..that position. So a one-token decode, a fresh prompt, a chunk of a prompt whose earlier
  chunks are cached (chunked prefill) and a prompt whose prefix came from the prefix cache are
  one case; the tile stops reading keys at its last query's position, which skips the blocks above
  the causal diagonal. The G query heads that share a KV head are rows of one tile (row r is
  query r // G, head r % G), so each key is loaded once for all of them (grouped-query attention
  without repeating keys). Keys are walked in tiles of TILE_N positions, each position finding its
  block through the table, so any block size works; the softmax is the online (flash) one in
  float32, with exp2 and the scale folded in. head_dim need not be a power of two (Qwen3's tiny
  24): dimensions are padded to one and masked.

Inputs are the engine's metadata as `PagedAttention` holds it; no Python loop over sequences, no
host synchronisation, and every size the grid depends on (max_query_len) is known on the host, so
a decode step can be captured in a CUDA graph. Float32 products use IEEE precision (no TF32): the
float32 path is the one checked token for token against transformers.

On a CPU the kernels run only under Triton's interpreter (TRITON_INTERPRET=1 set before triton is
imported), which is how the test suite holds them to the reference path.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Keys read per inner iteration. On a GPU 32 rows of up to 128 dims keep the tile in registers.
TILE_N = 32


@triton.jit
def _store_kv_kernel(key_ptr, value_ptr, key_cache_ptr, value_cache_ptr, slot_mapping_ptr,
                     stride_key_token, stride_value_token,
                     ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        ok = offs < ROW
        k = tl.load(key_ptr + token * stride_key_token + offs, mask=ok)
        v = tl.load(value_ptr + token * stride_value_token + offs, mask=ok)
        tl.store(key_cache_ptr + slot * ROW + offs, k.to(key_cache_ptr.dtype.element_ty), mask=ok)
        tl.store(value_cache_ptr + slot * ROW + offs, v.to(value_cache_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, key_cache_ptr, value_cache_ptr, block_tables_ptr, seq_lens_ptr, query_start_loc_ptr,
    scale_log2, window, softcap, sinks_ptr,
    stride_q_token, stride_q_head, stride_out_token, stride_out_head,
    stride_cache_block, stride_cache_token, stride_cache_head, stride_table_seq,
    QUERIES_PER_KV: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
    PRECISION: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_loc_ptr + seq).to(tl.int64)
    q_len = tl.load(query_start_loc_ptr + seq + 1).to(tl.int64) - q_start
    if q_tile * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq).to(tl.int64)
        context = seq_len - q_len
        rows = tl.arange(0, BLOCK_M)
        q_idx = q_tile * BLOCK_Q + rows // QUERIES_PER_KV
        head = kv_head * QUERIES_PER_KV + rows % QUERIES_PER_KV
        row_ok = (rows < BLOCK_Q * QUERIES_PER_KV) & (q_idx < q_len)
        dims = tl.arange(0, HEAD_DIM_PAD)
        dim_ok = dims < HEAD_DIM
        io_mask = row_ok[:, None] & dim_ok[None, :]
        q = tl.load(q_ptr + (q_start + q_idx)[:, None] * stride_q_token + head[:, None] * stride_q_head
                    + dims[None, :], mask=io_mask, other=0.0)
        q_pos = context + q_idx
        # Keys the tile's last real query sees: nothing past it is read.
        num_keys = context + tl.minimum((q_tile + 1) * BLOCK_Q, q_len)
        if HAS_SINKS:  # one more softmax column per head with no value: max starts at it, sum at 1
            m_i = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
            l_i = tl.full([BLOCK_M], 1.0, tl.float32)
        else:
            m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
            l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        table = block_tables_ptr + seq * stride_table_seq
        first_key = 0
        if HAS_WINDOW:  # keys below the window of the tile's first query are never read
            first_key = tl.maximum(context + q_tile * BLOCK_Q - window + 1, 0)
        for start in range(first_key, num_keys, TILE):
            k_pos = start + tl.arange(0, TILE)
            k_ok = k_pos < num_keys
            block = tl.load(table + k_pos // BLOCK_SIZE, mask=k_ok, other=0).to(tl.int64)
            offset = block * stride_cache_block + (k_pos % BLOCK_SIZE) * stride_cache_token \
                + kv_head * stride_cache_head
            kv_mask = k_ok[:, None] & dim_ok[None, :]
            k = tl.load(key_cache_ptr + offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2
            if HAS_SOFTCAP:  # cap · tanh(s / cap) on the natural-log scores, tanh from exp2 (sign kept)
                x = s / (1.4426950408889634 * softcap)
                e = tl.exp2(-2.8853900817779268 * tl.abs(x))
                s = tl.where(x < 0, -1.0, 1.0) * (1.0 - e) / (1.0 + e) * (softcap * 1.4426950408889634)
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :] & row_ok[:, None]
            if HAS_WINDOW:
                allowed = allowed & (q_pos[:, None] - k_pos[None, :] < window)
            s = tl.where(allowed, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing seen yet
            p = tl.exp2(s - m_safe[:, None])
            alpha = tl.exp2(m_i - m_safe)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(value_cache_ptr + offset[:, None] + dims[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m_i = m_new
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        tl.store(out_ptr + (q_start + q_idx)[:, None] * stride_out_token + head[:, None] * stride_out_head
                 + dims[None, :], out.to(out_ptr.dtype.element_ty), mask=io_mask)


def _on(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Triton launches on the current CUDA device: make it the tensors' (an engine on cuda:1)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def _rows(t: torch.Tensor, name: str) -> torch.Tensor:
    """[N, H, D] with each token's H * D values contiguous (what both kernels index)."""
    if t.dim() != 3:
        raise ValueError(f"{name} must be [tokens, heads, head_dim], got shape {tuple(t.shape)}")
    if t.stride(2) != 1 or t.stride(1) != t.shape[2]:
        t = t.contiguous()
    return t


def store_kv(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Write key and value [N, Hkv, D] into caches [blocks, block_size, Hkv, D] at `slot_mapping`
    [N] (negative: skip), converting to the cache's dtype."""
    key, value = _rows(key, "key"), _rows(value, "value")
    if not (key_cache.is_contiguous() and value_cache.is_contiguous()):
        raise ValueError("key_cache and value_cache must be contiguous")
    num_tokens = slot_mapping.shape[0]
    if num_tokens == 0:
        return
    row = key.shape[1] * key.shape[2]
    with _on(key_cache.device):
        _store_kv_kernel[(num_tokens,)](key, value, key_cache, value_cache, slot_mapping, key.stride(0),
                                        value.stride(0), ROW=row, ROW_PAD=triton.next_power_of_2(row))


def paged_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                    max_query_len: int, scale: float, out: torch.Tensor | None = None,
                    tile: int | None = None, window: int | None = None, softcap: float | None = None,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [N, Hq, D] (in the cache's dtype) attends causally over each sequence's cached keys →
    [N, Hq, D]. Metadata as in `PagedAttention`: block_tables [S, W], seq_lens [S] and
    query_start_loc [S + 1] on q's device; `max_query_len` the largest q_len (sizes the grid);
    `tile` the keys read per inner iteration (default TILE_N). `window`: a query at position p sees
    keys p - window + 1 .. p, and a tile reads none below its first query's window (so a decode costs
    O(window), and freed blocks below it are never touched); `softcap`: scores become
    cap · tanh(s / cap); `sinks` [Hq]: a logit per head in each query's softmax denominator."""
    q = _rows(q, "q")
    num_blocks, block_size, num_kv_heads, head_dim = key_cache.shape
    num_heads = q.shape[1]
    if q.shape[2] != head_dim or num_heads % num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache of {num_kv_heads} kv heads of dim {head_dim}")
    if value_cache.shape != key_cache.shape or value_cache.stride() != key_cache.stride() or key_cache.stride(3) != 1:
        raise ValueError("key_cache and value_cache must share one layout, head_dim contiguous")
    if q.dtype != key_cache.dtype:
        raise ValueError(f"q is {q.dtype}, the cache {key_cache.dtype}: convert q first")
    if out is None:
        out = torch.empty_like(q)
    num_seqs = seq_lens.shape[0]
    if num_seqs == 0 or q.shape[0] == 0:
        return out
    per_kv = num_heads // num_kv_heads
    # A tile holds BLOCK_M rows (query, head) pairs: 16 at least (the smallest matrix product), more
    # for prompts, where many queries share each key read.
    block_m = max(16 if max_query_len == 1 else 64, triton.next_power_of_2(per_kv))
    block_q = block_m // per_kv
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    with _on(q.device):
        _paged_attention_kernel[grid](
            out, q, key_cache, value_cache, block_tables, seq_lens, query_start_loc,
            scale * 1.4426950408889634,  # log2(e): the kernel uses exp2
            window or 0, float(softcap or 0.0), sinks if sinks is not None else q,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            key_cache.stride(0), key_cache.stride(1), key_cache.stride(2), block_tables.stride(0),
            QUERIES_PER_KV=per_kv, HEAD_DIM=head_dim, HEAD_DIM_PAD=max(16, triton.next_power_of_2(head_dim)),
            BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_Q=block_q, TILE=tile or TILE_N, PRECISION=precision,
            HAS_WINDOW=window is not None, HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        )
    return out
