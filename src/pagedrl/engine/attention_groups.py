"""How the fast path cuts a step's sequences into groups, each attended in one batched op.

A group's gather indices, rows and additive masks are computed once per step here, not once per
layer. Decodes (one query each) and prefills (several) are planned apart: decodes are the common
step, and their plan is a few tensor ops whatever the batch (`_plan_decodes`), with masks read from a
kept table; prefills pad their queries to the group's longest and may skip the mask when they are
fresh prompts (see `QueryGroup`). On a CPU the cut keeps a group's gathered keys in cache and its
padding small; on a GPU there is one group per kind. A planned group is then attended here too: its
blocks gathered whole (`gather_blocks`), then one fused attention call (`decode_attention`,
`prefill_attention`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedrl.engine.host_tensors import long_tensor


@dataclass
class QueryGroup:
    """Sequences the fast path attends in one batched op, with everything that op needs precomputed.

    Queries are padded to `q_pad` per sequence (1 for decodes); a padded query repeats its sequence's
    last real query and may see key 0 only, so its softmax stays finite; its output is dropped.
    A group of fresh prompts (nothing cached before them) needs no mask: query i sits at position i,
    so plain top-left causal attention is exact for every real query, and it lets the attention
    kernel skip the blocks above the diagonal (half the work). Its padded queries then see padded
    keys, which hold finite stale values (the cache starts zeroed), and are dropped as before."""

    is_decode: bool
    num_seqs: int
    q_pad: int
    num_blocks: int  # block-table columns read; keys per sequence = num_blocks * block_size
    block_ids: torch.Tensor  # [num_seqs * num_blocks] long; padding columns read block 0, masked out
    mask: torch.Tensor | None  # additive [num_seqs, 1, q_pad, keys]: 0 where allowed, -inf elsewhere;
    # None for a group of fresh prompts: causal attention
    rows: torch.Tensor | None  # [num_seqs * q_pad] batch row of each padded query; None = all rows, in order
    keep: torch.Tensor | None  # padded rows that are real queries; None = every padded row is real
    out_rows: torch.Tensor | None  # batch row of each real query's output; None = all rows, in order


def plan_groups(q_lens: list[int], seq_lens: list[int], block_tables: torch.Tensor, block_size: int,
                device: torch.device, dtype: torch.dtype, chunk_tokens: int | None = None,
                query_start_loc: torch.Tensor | None = None) -> list[QueryGroup]:
    """Split the batch into decodes (one new token) and prefills (more), and precompute each group's
    gather indices and masks. Index arithmetic happens on the CPU; masks are built on `device`.
    `query_start_loc` (CPU, [S + 1]) is the cumulative q_lens, computed when not given.

    With `chunk_tokens`, each kind is further cut, longest sequences first, into groups that gather
    at most that many key positions and spend at most a fifth of their work on padding: on a CPU a
    group's gathered keys then stay in cache between the gather and the matmuls that read them, and
    a few long sequences do not pad a batch of short ones. Fresh prompts are kept apart from
    continued prefills, so their groups can skip the mask (see `QueryGroup`). Without it (GPUs),
    one group per kind."""
    if query_start_loc is None:
        query_start_loc = long_tensor([0, *itertools.accumulate(q_lens)])
    seq_lens_t = long_tensor(seq_lens)
    if max(q_lens) == 1:  # only decodes: the common step, planned without the prefill machinery
        return _plan_decodes(None, seq_lens_t, query_start_loc, block_tables, block_size, device, dtype,
                             chunk_tokens)
    groups = []
    decodes = [s for s, n in enumerate(q_lens) if n == 1]
    if decodes:
        groups += _plan_decodes(long_tensor(decodes), seq_lens_t, query_start_loc, block_tables, block_size, device,
                                dtype, chunk_tokens)
    members = [s for s, n in enumerate(q_lens) if n > 1]
    if chunk_tokens is None:
        chunks = [members]
    else:
        # Continued prefills first, then fresh prompts (which may skip the mask), longest first.
        order = sorted(members, key=lambda s: (seq_lens[s] == q_lens[s], -seq_lens[s]))
        chunks = _chunk(order, q_lens, seq_lens, block_size, chunk_tokens)
    starts = query_start_loc.tolist()
    groups += [_plan_group(chunk, q_lens, seq_lens, starts, block_tables, block_size, device, dtype)
               for chunk in chunks]
    return groups


def _plan_decodes(members: torch.Tensor | None, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  block_tables: torch.Tensor, block_size: int, device: torch.device, dtype: torch.dtype,
                  chunk_tokens: int | None) -> list[QueryGroup]:
    """The decode groups (`members`: which sequences decode; None: all of them, so the batch's row s
    is sequence s). One query each, at the sequence's last position, so a group needs its block
    ids, its rows and a mask hiding the keys past each length. They are computed for all decodes at
    once, in group order, with tensor ops whose number does not grow with the batch, and each group
    takes a slice. The masks are rows of a kept table (`decode_mask_rows`)."""
    every = members is None
    seqs = torch.arange(seq_lens.shape[0]) if every else members
    lengths = seq_lens if every else seq_lens[members]
    rows = query_start_loc[:-1] if every else query_start_loc[members]
    blocks = (lengths + block_size - 1) // block_size
    if chunk_tokens is None:
        spans = [(0, seqs.shape[0], int(blocks.max()))]
    else:
        every = False  # the groups come in length order, not batch order
        blocks, order = blocks.sort(descending=True, stable=True)  # stable: ties keep batch order
        seqs, lengths, rows = seqs[order], lengths[order], rows[order]
        values, counts = torch.unique_consecutive(blocks, return_counts=True)
        spans = cut_decodes(values.tolist(), counts.tolist(), block_size, chunk_tokens)
    max_blocks = max(num_blocks for _, _, num_blocks in spans)
    tables = block_tables.cpu()[:, :max_blocks].index_select(0, seqs)
    masks = decode_mask_rows(lengths, max_blocks * block_size, device, dtype)
    rows = rows.to(device)
    groups = []
    for first, last, num_blocks in spans:
        out_rows = None if every else rows[first:last]
        groups.append(QueryGroup(
            is_decode=True, num_seqs=last - first, q_pad=1, num_blocks=num_blocks,
            block_ids=tables[first:last, :num_blocks].reshape(-1).to(device),
            mask=masks[first:last, None, None, :num_blocks * block_size],
            rows=out_rows, keep=None, out_rows=out_rows))
    return groups


def cut_decodes(num_blocks: list[int], counts: list[int], block_size: int,
                chunk_tokens: int) -> list[tuple[int, int, int]]:
    """Decode groups as (first, last, blocks read) over decodes sorted longest first, given as runs:
    `counts[i]` sequences of `num_blocks[i]` blocks. `_chunk`'s greedy cut (at most `chunk_tokens`
    keys gathered, at most a fifth of the work padding), taken a run at a time in closed form, with
    one change: a sequence's own keys count in whole blocks, since it reads its last block whole in
    any group; the padding bounded is what grouping adds (else every sequence a few tokens into a
    new block would be a group of its own)."""
    spans: list[tuple[int, int, int]] = []
    start = pos = size = keys = real = 0
    for blocks, count in zip(num_blocks, counts, strict=True):
        own = blocks * block_size
        while count:
            if size == 0:  # a new group: its first sequence sets the keys every member reads
                start, keys, real = pos, own, 0
                take = min(count, max(1, chunk_tokens // keys))
            else:
                take = min(count, chunk_tokens // keys - size)
                if 4 * keys > 5 * own:  # 4 (size + m) keys <= 5 (real + m own), solved for m
                    take = min(take, (5 * real - 4 * size * keys) // (4 * keys - 5 * own))
                take = max(take, 0)
            size, real, pos, count = size + take, real + take * own, pos + take, count - take
            if count:  # the rest of the run does not fit: the group is complete
                spans.append((start, pos, keys // block_size))
                size = 0
    if size:
        spans.append((start, pos, keys // block_size))
    return spans


_DECODE_MASKS: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
DECODE_MASK_TABLE_KEYS = 2048  # widest kept table: (2049 x 2048) float32 is 16 MiB


def decode_mask_rows(lengths: torch.Tensor, num_keys: int, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """Additive masks [len(lengths), num_keys]: 0 for keys [0, length), -inf from there on. Up to
    DECODE_MASK_TABLE_KEYS keys they are rows of a kept table, read with one `index_select`
    (a tenth of the time of comparing and filling them anew every step)."""
    if num_keys > DECODE_MASK_TABLE_KEYS:
        hidden = torch.arange(num_keys, device=device)[None, :] >= lengths.to(device)[:, None]
        return torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
    table = _DECODE_MASKS.get((device, dtype))
    if table is None or table.shape[1] < num_keys:
        width = min(DECODE_MASK_TABLE_KEYS, 1 << (num_keys - 1).bit_length())
        with torch.inference_mode(False):  # kept across steps: usable in and out of inference mode
            hidden = torch.arange(width, device=device)[None, :] >= torch.arange(width + 1, device=device)[:, None]
            table = torch.zeros(hidden.shape, dtype=dtype, device=device).masked_fill_(hidden, float("-inf"))
        _DECODE_MASKS[(device, dtype)] = table
    return table[:, :num_keys].index_select(0, lengths.to(device))


def _chunk(members: list[int], q_lens: list[int], seq_lens: list[int], block_size: int,
           chunk_tokens: int) -> list[list[int]]:
    """Greedy cut of `members` (longest first) under the gather budget and the padding bound."""
    chunks: list[list[int]] = []
    current: list[int] = []
    real_work = current_q_pad = 0
    for s in members:
        keys = math.ceil(seq_lens[current[0] if current else s] / block_size) * block_size
        q_pad = max(q_lens[s], current_q_pad)
        work = q_lens[s] * seq_lens[s]
        size = len(current) + 1
        fresh_changes = current and (seq_lens[s] == q_lens[s]) != (seq_lens[current[0]] == q_lens[current[0]])
        if current and (size * keys > chunk_tokens or 4 * size * q_pad * keys > 5 * (real_work + work)
                        or fresh_changes):
            chunks.append(current)
            current, real_work, current_q_pad = [], 0, 0
        current.append(s)
        real_work += work
        current_q_pad = max(current_q_pad, q_lens[s])
    if current:
        chunks.append(current)
    return chunks


def _plan_group(members: list[int], q_lens: list[int], seq_lens: list[int], starts: list[int],
                block_tables: torch.Tensor, block_size: int, device: torch.device,
                dtype: torch.dtype) -> QueryGroup:
    """One group of prefills (decodes are planned by `_plan_decodes`)."""
    num_seqs = len(members)
    covers_batch = members == list(range(len(q_lens)))
    q_pad = max(q_lens[s] for s in members)
    num_blocks = max(math.ceil(seq_lens[s] / block_size) for s in members)
    index = torch.tensor(members)
    block_ids = block_tables.cpu()[index, :num_blocks].reshape(-1)
    q_len = torch.tensor([q_lens[s] for s in members])[:, None]
    seq_len = torch.tensor([seq_lens[s] for s in members])[:, None]
    start = torch.tensor([starts[s] for s in members])[:, None]
    i = torch.arange(q_pad)[None, :]
    real = i < q_len  # [S, q_pad]
    rows = (start + torch.minimum(i, q_len - 1)).reshape(-1)
    query_pos = torch.where(real, seq_len - q_len + i, 0)
    all_real = bool(real.all())
    keep = None if all_real else real.reshape(-1).nonzero().squeeze(1)
    out_rows = None if covers_batch else (rows if keep is None else rows[keep])
    mask = None
    if any(seq_lens[s] != q_lens[s] for s in members):
        key_pos = torch.arange(num_blocks * block_size, device=device)
        allowed = key_pos[None, None, :] <= query_pos.to(device)[:, :, None]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))[:, None]

    def to_device(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return QueryGroup(
        is_decode=False, num_seqs=num_seqs, q_pad=q_pad, num_blocks=num_blocks,
        block_ids=block_ids.to(device), mask=mask,
        rows=None if covers_batch and all_real else rows.to(device),
        keep=to_device(keep), out_rows=to_device(out_rows),
    )


def gather_blocks(key_cache: torch.Tensor, value_cache: torch.Tensor, group: QueryGroup,
                  scratch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [num_seqs, num_blocks * block_size, Hkv, D]: each sequence's blocks, copied
    whole with one `index_select` apiece (contiguous rows, the cheapest gather there is), into
    `scratch` (2 * that many elements) when given."""
    num_blocks_total, block_size, num_kv_heads, head_dim = key_cache.shape
    shape = (group.num_seqs, group.num_blocks * block_size, num_kv_heads, head_dim)
    out = []
    for i, cache in enumerate((key_cache, value_cache)):
        rows = cache.view(num_blocks_total, -1)
        if scratch is None:
            gathered = rows.index_select(0, group.block_ids)
        else:
            size = group.block_ids.numel() * rows.shape[1]
            gathered = scratch[i * size:(i + 1) * size].view(-1, rows.shape[1])
            torch.index_select(rows, 0, group.block_ids, out=gathered)
        out.append(gathered.view(shape))
    return out[0], out[1]


def gathered_numel(key_cache: torch.Tensor, group: QueryGroup) -> int:
    """Elements `gather_blocks` needs in its scratch buffer (keys and values)."""
    return 2 * group.block_ids.numel() * key_cache[0].numel()


def decode_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: QueryGroup,
                     scale: float, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """One query per sequence. The G query heads that share a KV head sit at the same position, so
    they are attended as G queries of one head: one fused attention call over [S, Hkv, G, D]
    queries and strided [S, Hkv, L, D] views of the gathered blocks, so keys and values are read
    once, never copied again, never repeated per query head, and one mask row serves all of them.
    Returns [S, Hq, D]."""
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    num_seqs, num_heads = group.num_seqs, q.shape[1]
    queries = q if group.rows is None else q.index_select(0, group.rows)
    queries = queries.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys, values = gather_blocks(key_cache, value_cache, group, scratch)
    out = F.scaled_dot_product_attention(queries, keys.transpose(1, 2), values.transpose(1, 2),
                                         attn_mask=group.mask, scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, group: QueryGroup,
                      scale: float, scratch: torch.Tensor | None = None) -> torch.Tensor:
    """Several queries per sequence, padded to the group's longest; one fused attention call with
    grouped-query heads left unexpanded. Returns [real queries, Hq, D]."""
    num_kv_heads = key_cache.shape[2]
    num_heads, head_dim = q.shape[1], q.shape[2]
    queries = q if group.rows is None else q.index_select(0, group.rows)
    queries = queries.reshape(group.num_seqs, group.q_pad, num_heads, head_dim).transpose(1, 2)
    keys, values = (t.transpose(1, 2) for t in gather_blocks(key_cache, value_cache, group, scratch))
    out = F.scaled_dot_product_attention(queries, keys, values, attn_mask=group.mask, is_causal=group.mask is None,
                                         scale=scale, enable_gqa=num_heads != num_kv_heads)
    out = out.transpose(1, 2).reshape(group.num_seqs * group.q_pad, num_heads, head_dim)
    return out if group.keep is None else out.index_select(0, group.keep)
