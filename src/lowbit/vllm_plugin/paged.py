"""Write to and attend over vLLM's paged cache of packed slots (pure torch; the vLLM glue is backend.py).

Cache view: uint8 [num_blocks, H_kv, block_size, slot_bytes] (vLLM's head-major LBHNC layout),
token t of a request lives in block block_table[t // block_size] at offset t % block_size;
`slot_mapping[i] = block * block_size + offset` for each new token (negative = padding, skipped).

`write` encodes the new tokens through SlotFormat.encode (rotate -> lowbit's quantizer -> pack).
The exact tiers: the first `sink` and the last `recent` tokens of every request are also kept
dense (rotated, model dtype) in a TierArena owned by the backend, keyed by the physical block
that holds them, and `attend` reads those rows from it instead of from their codes -- lowbit's
sink and recent tiers (page 1), outside vLLM's block budget ((sink + recent) x KV heads x
(D_k + D_v) x dtype bytes per layer per request).
`attend` runs, per request, exact softmax attention of its new queries over the history stored
before them, read back from the packed cache (and the dense tiers), plus their own chunk as it
arrived (rotated, model dtype) -- lowbit's runtime semantics (QuantizedKVLayer.blocks): a prompt
attends to itself exactly during its prefill, later steps read it as stored. The history streams
`chunk_tokens` tokens at a time through lowbit.backends.torch_stream.online_attention, so a long history
is never dequantized at once.

Sliding-window layers (window W: a query at position p sees keys in (p - W, p], HF's and vLLM's
convention). vLLM frees -- and may hand to another request -- every block whose tokens all lie
before `num_computed_tokens - W + 1`, i.e. before the lowest key the first query of the step can
see (`visible_from`). So for such a layer `attend` reads a request's cache and arena only from
the block holding that position on (never a block vLLM may have freed), the window mask drops
the rows of that first block that are out of reach, and the arena keeps a dense row only while
a future query can still see it. This is lowbit's runtime (QuantizedKVLayer._evict_before): on a
sliding layer the sink tokens are exact while inside the window and not attended once they
leave it, and the recent tier is exact inside the window.
Queries are rotated by R_k, the output is un-rotated by R_v^T. Query head j reads KV head j // G.
"""

from __future__ import annotations

import torch

from lowbit.vllm_plugin.slot import SlotFormat

DEFAULT_CHUNK_TOKENS = 4096  # keys scored per pass; longer histories are merged by log-sum-exp


class BlockPool:
    """{block id: rows [H, block_size, D]} held in one tensor `data` [capacity, block_size, H, D] plus a
    block -> slot map, so the attention gathers any set of rows with one index op (`rows`), while
    code that thinks in blocks reads and writes `pool[b]` (a [H, block_size, D] view) as a dict.
    Capacity doubles when full; a freed slot is reused. Device and dtype follow the first rows."""

    def __init__(self, dtype: torch.dtype):
        self.dtype = dtype
        self.data: torch.Tensor | None = None  # [cap, bs, H, D]
        self.valid: torch.Tensor | None = None  # bool [cap, bs]: the row was stored (a block may be partly stored)
        self.slot: dict[int, int] = {}
        self.free: list[int] = []
        self.map = torch.full((0,), -1, dtype=torch.long)  # block id -> slot, -1 = absent

    def _alloc(self, b: int, H: int, bs: int, D: int, device) -> int:
        if b in self.slot:
            return self.slot[b]
        if self.data is None:
            self.data = torch.zeros(4, bs, H, D, dtype=self.dtype, device=device)
            self.valid = torch.zeros(4, bs, dtype=torch.bool, device=device)
            self.free = list(range(3, -1, -1))
            self.map = self.map.to(device)
        if not self.free:
            cap = self.data.shape[0]
            self.data = torch.cat([self.data, torch.zeros_like(self.data)])
            self.valid = torch.cat([self.valid, torch.zeros_like(self.valid)])
            self.free = list(range(2 * cap - 1, cap - 1, -1))
        s = self.free.pop()
        self.data[s] = 0
        self.valid[s] = False
        self.slot[b] = s
        if b >= self.map.numel():
            grown = torch.full((max(2 * self.map.numel(), b + 1),), -1, dtype=torch.long, device=self.map.device)
            grown[: self.map.numel()] = self.map
            self.map = grown
        self.map[b] = s
        return s

    def ensure(self, blocks, H: int, bs: int, D: int, device) -> None:
        for b in blocks:
            self._alloc(int(b), H, bs, D, device)

    def lookup(self, blocks: torch.Tensor) -> torch.Tensor:
        """blocks (any shape, long) -> slots (-1 where the block holds no rows)."""
        inside = (blocks >= 0) & (blocks < self.map.numel())
        if self.map.numel() == 0:
            return torch.full_like(blocks, -1)
        return torch.where(inside, self.map[blocks.clamp(0, self.map.numel() - 1)], -1)

    def present(self, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """slots (from lookup), offsets [...] -> bool [...]: that row itself was stored. A block shared through
        vLLM's prefix cache can hold some rows (its sink rows) and not others (its middle)."""
        if self.valid is None:
            return torch.zeros_like(slots, dtype=torch.bool)
        return (slots >= 0) & self.valid[slots.clamp(min=0), offsets]

    def rows(self, slots: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """slots, offsets [...] -> rows [..., H, D] (slot < 0 reads slot 0: mask it)."""
        cap, bs, H, D = self.data.shape
        flat = (slots.clamp(min=0) * bs + offsets).reshape(-1)
        return self.data.view(cap * bs, H, D).index_select(0, flat).reshape(*slots.shape, H, D)

    # ---- the dict view (block id -> [H, bs, D])
    def __getitem__(self, b: int) -> torch.Tensor:
        return self.data[self.slot[int(b)]].transpose(0, 1)

    def __setitem__(self, b: int, rows: torch.Tensor) -> None:
        H, bs, D = rows.shape
        s = self._alloc(int(b), H, bs, D, rows.device)
        self.data[s] = rows.transpose(0, 1).to(self.dtype)
        self.valid[s] = True

    def __contains__(self, b) -> bool:
        return int(b) in self.slot

    def __iter__(self):
        return iter(list(self.slot))

    def __len__(self) -> int:
        return len(self.slot)

    def values(self):
        return [self[b] for b in self.slot]

    def pop(self, b: int, default=None):
        b = int(b)
        if b not in self.slot:
            return default
        s = self.slot.pop(b)
        self.map[b] = -1
        self.free.append(s)
        return None

    def __delitem__(self, b: int) -> None:
        if int(b) not in self.slot:
            raise KeyError(b)
        self.pop(b)


class TierArena:
    """Dense copies of the exact tiers of one layer: each request's first `sink` tokens and its last
    `recent` tokens, per physical block (BlockPool: {block id: [H, block_size, D]}) in the model dtype,
    rotated. `window`: the layer's sliding window (None: full attention).

    lowbit's runtime with page 1 holds a token dense when its position p < sink or
    p >= seq_len - recent (seq_len: tokens stored after this step), and packed otherwise; so does
    this arena. A row that is dense when read was dense when written (seq_len only grows), so
    `write` stores exactly the rows that satisfy the rule at write time, `attend` reads them back,
    and `evict` drops the blocks of a request that have fallen behind its recent window.
    Entries are keyed by the physical block: a block reused by a later request is overwritten by
    that request's own writes before it reads them. `retain(live)` drops blocks no live request
    needs (finished requests). A row missing when read that the request wrote before this step (it
    was left out of a step, or a prefix-cache case below) is decoded from its codes into the arena
    (`_fill_missing`: logged once, counted in `refilled`); a row of this step missing raises.
    Sliding window: only rows at positions >= visible_from(first query) are ever read, and a
    request's blocks below that position are never touched (vLLM may have given them to another
    request); `evict` drops what the next query can no longer see.

    Prefix caching (hold_prefix): vLLM hands a request whose prompt starts with cached full blocks
    those same physical blocks (block ids in its table) and skips computing them. The hit's sink
    rows are in the first blocks, so `hold` keeps every block that holds a request's sink rows after
    the request is done, for as long as vLLM may still hand it out: until the block shows up at a
    later index of some table (vLLM reallocated it and dropped its hash), at most `hold_cap` blocks
    (the least recently seen go first; a hit on one of those reads its sink rows from codes, logged).
    The hit's recent rows are
    not stored: vLLM's scheduler holds back the last `recent` tokens of every hit (prefix.py), so the
    request computes -- and stores dense -- every row its recent window holds, as a miss whose
    prefill had a chunk boundary at the hit does. Only when the step's token budget cuts that first
    chunk below `recent` tokens would the window reach into the shared prefix: those rows are then
    decoded from their codes into the arena (`_fill_missing`, counted in `refilled`, logged once).
    Each held block costs a dense block (bs x H x (D_k + D_v) x dtype bytes) per layer.
    """

    def __init__(self, sink: int, recent: int, block_size: int, dtype: torch.dtype, window: int | None = None,
                 hold_prefix: bool = False, hold_cap: int | None = None):
        self.sink, self.recent, self.bs, self.dtype = int(sink), int(recent), int(block_size), dtype
        self.window = int(window) if window else None
        self.k = BlockPool(dtype)
        self.v = BlockPool(dtype)
        self.hold_prefix = bool(hold_prefix)
        self.hold_cap = hold_cap
        self.held: dict[int, None] = {}  # blocks holding some request's sink rows that vLLM may hand out again
        # (insertion order = last seen: the first ones go when over hold_cap)
        self.refilled = 0  # rows decoded from codes into the arena (a hit whose first chunk was cut short)

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (blocks in use), not of the pools' spare capacity."""
        per = 0
        for pool in (self.k, self.v):
            if pool.data is not None:
                per += pool.data[0].numel() * pool.data.element_size()
        return per * len(self.k)

    def dense_from(self, seq_len: int) -> int:
        """First position of the recent window when the request holds seq_len tokens."""
        return max(self.sink, seq_len - self.recent) if self.recent else seq_len

    def visible_from(self, q0: int) -> int:
        """Lowest key position a query at position >= q0 can see (0 on a full-attention layer)."""
        return visible_from(q0, self.window)

    def dense_rows(self, lo: int, hi: int, seq_len: int) -> list[int]:
        """Positions in [lo, hi) held dense when the request holds seq_len tokens (sink, recent)."""
        return list(range(lo, min(self.sink, hi))) + list(range(max(lo, self.dense_from(seq_len)), hi))

    def store(self, slots: torch.Tensor, positions: torch.Tensor, seq_lens_of_rows: torch.Tensor,
              k: torch.Tensor, v: torch.Tensor) -> None:
        """k [T, H, D_k], v [T, H, D_v] rotated; keeps rows with position < sink or in the recent window."""
        sel = (positions < self.sink) | ((positions >= seq_lens_of_rows - self.recent) & (self.recent > 0))
        n_sel = int(sel.sum())
        if n_sel == 0:
            return
        if n_sel < sel.numel():  # else (every decode row is in its recent window): no boolean indexing
            slots, k, v = slots[sel], k[sel], v[sel]
        self.put(slots // self.bs, slots % self.bs, k, v)

    def put(self, blocks: torch.Tensor, offs: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            block_set: set | None = None) -> None:
        """Store rows k [n, H, D_k], v [n, H, D_v] at (block, offset) [n] and mark them present.
        block_set: set(blocks.tolist()) when the caller has it (built once per step for all layers)."""
        H = k.shape[1]
        new = [b for b in (set(blocks.tolist()) if block_set is None else block_set) if b not in self.k.slot]
        if new:
            self.k.ensure(new, H, self.bs, k.shape[2], k.device)
            self.v.ensure(new, H, self.bs, v.shape[2], v.device)
        s = self.k.map[blocks]
        self.k.data[s, offs] = k if k.dtype == self.dtype else k.to(self.dtype)  # [n, H, D]
        self.v.data[self.v.map[blocks], offs] = v if v.dtype == self.dtype else v.to(self.dtype)
        if self.hold_prefix:  # only shared blocks (prefix caching) are ever read partly stored: see `missing`
            self.k.valid[s, offs] = True

    def missing(self, slots: torch.Tensor, offs: torch.Tensor, wanted: torch.Tensor) -> torch.Tensor:
        """bool [...]: the rows `wanted` whose dense copy is not held. Without prefix caching a request's blocks
        are its own and hold every dense row it reads once they hold any (TierArena), so the block-level map
        is enough (two ops fewer per layer-step); with it, a shared block may hold some rows only (row flags)."""
        if self.hold_prefix:
            return wanted & ~self.k.present(slots, offs)
        return wanted & (slots < 0)

    def overlay(self, table_row: torch.Tensor, lo: int, seq_len: int, k: torch.Tensor, v: torch.Tensor,
                vis_lo: int = 0):
        """Replace the rows of k/v [1, H, n, D] (positions lo..lo+n) that are dense tiers by their copies.
        Rows before vis_lo (out of every query's window: masked) are left as they are."""
        n = k.shape[2]
        rows = self.dense_rows(max(lo, vis_lo), lo + n, seq_len)
        if not rows:
            return k, v
        j = torch.tensor(rows, dtype=torch.long, device=k.device)
        slots = self.k.lookup(table_row.long()[j // self.bs])
        if bool((slots < 0).any()):
            bad = rows[int(torch.nonzero(slots < 0)[0])]
            raise RuntimeError(f"lowbit plugin: the dense copy of position {bad} (block "
                               f"{int(table_row[bad // self.bs])}) is gone; the request was not scheduled for too long")
        k[0, :, j - lo] = self.k.rows(slots, j % self.bs).transpose(0, 1).to(k.dtype)
        v[0, :, j - lo] = self.v.rows(slots, j % self.bs).transpose(0, 1).to(v.dtype)
        return k, v

    def needed_blocks(self, table_row: torch.Tensor, seq_len: int, lo: int = 0) -> set[int]:
        """Blocks holding a request's dense rows (sink and recent window) at positions >= lo."""
        bs, out = self.bs, set()
        for a, b in ((lo, min(self.sink, seq_len)), (max(lo, self.dense_from(seq_len)), seq_len)):
            if a < b:
                out.update(table_row[a // bs: -(-b // bs)].tolist())
        return out

    def evict(self, table_row: torch.Tensor, seq_len: int, lo: int = 0) -> None:
        """Drop this request's blocks, from position lo on (the blocks this step could read: vLLM may
        have freed those below), that hold no dense row a future query (at >= seq_len) can see."""
        keep = self.needed_blocks(table_row, seq_len, self.visible_from(seq_len))
        for b in table_row[lo // self.bs: -(-seq_len // self.bs)].tolist():
            if b not in keep and b in self.k.slot and b not in self.held:
                self.k.pop(b)
                self.v.pop(b)

    def retain(self, live: set[int]) -> None:
        """Keep only blocks in `live` (the dense blocks of the requests vLLM is running) and the held ones."""
        for b in [b for b in self.k if b not in live and b not in self.held]:
            self.k.pop(b)
            self.v.pop(b)

    def hold(self, heads: set[int], others: set[int]) -> None:
        """Prefix caching: `heads` are blocks at a table index below ceil(sink / block_size) (they hold a
        request's sink rows), `others` blocks at a later index of some running request's table (reallocated:
        vLLM dropped their hash, no hit can hand them out as a first block any more). See sink_blocks."""
        if self.hold_prefix and self.sink:
            for b in others:
                self.held.pop(b, None)
            for b in heads:  # seen now: last in line
                self.held.pop(b, None)
                self.held[b] = None
            while self.hold_cap is not None and len(self.held) > self.hold_cap:
                self.held.pop(next(iter(self.held)))


def sink_blocks(table: torch.Tensor, lens: list[int], sink: int, bs: int) -> tuple[set[int], set[int]]:
    """(blocks at a table index < ceil(sink / bs), blocks at a later index) over the requests of one step:
    table [R, max_blocks], lens [R] their lengths after the step (TierArena.hold)."""
    sb = -(-sink // bs)
    heads, others = set(), set()
    for r, n in enumerate(lens):
        row = table[r, : -(-n // bs)].tolist()
        heads.update(row[:sb])
        others.update(row[sb:])
    return heads - others, others


def retain_step(arenas: list, table: torch.Tensor, lens: list[int], q_lens: list[int]) -> None:
    """Once per step (the backend's metadata builder; tests call it the same way): drop the dense blocks no
    running request needs (finished requests, rows out of a sliding window), except the blocks held for
    vLLM's prefix cache (TierArena.hold). table [R, max_blocks]; lens [R] after the step; q_lens [R] new tokens."""
    live_by_window: dict = {}  # one group may mix windows when vLLM unifies the specs
    held = None
    for a in arenas:
        if a.window not in live_by_window:
            live = set()
            for r, (n, lq) in enumerate(zip(lens, q_lens)):  # from the lowest position this step's queries see
                live |= a.needed_blocks(table[r], n, a.visible_from(n - lq))
            live_by_window[a.window] = live
        if a.hold_prefix and a.sink:
            held = held or sink_blocks(table, lens, a.sink, a.bs)
            a.hold(*held)
        a.retain(live_by_window[a.window])


def _fill_missing(arena: TierArena, cache_u8: torch.Tensor, fmt: SlotFormat, blk: torch.Tensor, off: torch.Tensor,
                  jpos: torch.Tensor, missing: torch.Tensor, first: torch.Tensor) -> None:
    """Dense rows the step needs but the arena lacks (missing [R, n] over positions jpos, blocks blk, offsets
    off). Rows before the request's first new token (not written in this step): decoded from their codes into
    the arena, i.e. read as a middle row would be. That happens when a prefix-cache hit's first chunk was cut
    below `recent` tokens by the step's token budget, for a hit on a prompt start beyond the `hold_cap` held
    ones (its sink rows), or for a request vLLM left out of a step (its blocks were not live). A row of this
    step missing is a bug (raises)."""
    shared = missing & (jpos < first[:, None])
    if not torch.equal(shared, missing):
        r_, c_ = (int(x) for x in torch.nonzero(missing & ~shared)[0])
        raise RuntimeError(f"lowbit plugin: the dense copy of position {int(jpos[r_, c_])} (block "
                           f"{int(blk[r_, c_])}) is gone; the request was not scheduled for too long")
    b, o = blk[missing], off[missing]
    k, v = fmt.decode(cache_u8[b, :, o].transpose(0, 1))  # cells [n, H, C] -> [1, H, n, D] rotated
    arena.put(b, o, k[0].transpose(0, 1), v[0].transpose(0, 1))
    if not arena.refilled:
        import logging

        logging.getLogger("lowbit.vllm_plugin").warning(
            "lowbit plugin: %d dense rows (sink %d / recent %d tiers) were not held and are read from their codes, "
            "where a miss would read them exact: a prefix-cache hit whose first chunk the step's token budget cut "
            "below the recent window (raise --max-num-batched-tokens), a hit on a prompt start older than the %s "
            "held, or a request left out of a step (counted in TierArena.refilled; logged once)", int(b.numel()),
            arena.sink, arena.recent, arena.hold_cap)
    arena.refilled += int(b.numel())


def visible_from(q0: int, window: int | None) -> int:
    """Lowest key position a query at position >= q0 sees: q0 - (W - 1) for a window W, else 0."""
    return max(0, q0 - (window - 1)) if window else 0


def _write_index(slot_mapping: torch.Tensor, n: int, bs: int, positions, row_seq_lens, arena, memo) -> dict:
    """What `write` indexes with, from the step's slot_mapping (and positions / lengths for the arena): the
    same for every layer of a KV cache group in a step, so it is built once and kept in `memo` (the step's
    metadata). keep: None (no padding row) or bool [n]; blk / off [m]: cache block and offset of each kept
    row; a_*: the rows the arena keeps (a_sel None: all of them; a_blk None: none) and their block set."""
    key = ("write", slot_mapping.data_ptr(), n, bs, arena.sink if arena is not None else -1,
           arena.recent if arena is not None else -1, positions is not None)
    if memo is not None and key in memo:
        return memo[key]
    slots = slot_mapping[:n].long()
    keep = slots >= 0
    if bool(keep.all()):
        keep = None
    else:
        slots = slots[keep]
    ix = {"keep": keep, "count": int(slots.numel()), "blk": slots // bs, "off": slots % bs, "a_blk": None}
    if arena is not None and (arena.sink > 0 or arena.recent > 0) and positions is not None and ix["count"]:
        if row_seq_lens is None:
            raise ValueError("a tier arena needs the token positions and their requests' lengths")
        pos = positions[:n].long() if keep is None else positions[:n].long()[keep]
        lens = row_seq_lens[:n].long() if keep is None else row_seq_lens[:n].long()[keep]
        sel = (pos < arena.sink) | ((pos >= lens - arena.recent) & (arena.recent > 0))
        n_sel = int(sel.sum())
        if n_sel:
            whole = n_sel == sel.numel()  # every decode row is in its recent window: no boolean indexing
            ix["a_sel"] = None if whole else sel
            ix["a_blk"] = ix["blk"] if whole else ix["blk"][sel]
            ix["a_off"] = ix["off"] if whole else ix["off"][sel]
            ix["a_blocks"] = set(ix["a_blk"].tolist())
    if memo is not None:
        memo[key] = ix
    return ix


def map_token_keys(key: torch.Tensor, ka) -> torch.Tensor:
    """key [T, H, D] -> (key - shift) / scale (lowbit.kv.key_affine, float32 math) in key's dtype; ka None: key."""
    if ka is None:
        return key
    return ((key.float() - ka.shift.to(key.device)) / ka.scale.to(key.device)).to(key.dtype)


def map_token_queries(query: torch.Tensor, ka) -> torch.Tensor:
    """query [T, Hq, D] (the G query heads of KV head h at h*G..h*G+G-1) -> query * scale of its KV head
    (the key map's inverse transpose: q' . k' = q . k - q . shift), in query's dtype; ka None: query."""
    if ka is None:
        return query
    T, Hq, D = query.shape
    H = ka.scale.shape[0]
    s = ka.scale.to(query.device)[None, :, None, :]  # [1, H, 1, D]
    return (query.float().reshape(T, H, Hq // H, D) * s).reshape(T, Hq, D).to(query.dtype)


def write(cache_u8: torch.Tensor, fmt: SlotFormat, key: torch.Tensor, value: torch.Tensor,
          slot_mapping: torch.Tensor, rot_k=None, rot_v=None, *, positions: torch.Tensor | None = None,
          row_seq_lens: torch.Tensor | None = None, arena: TierArena | None = None,
          rotated: dict | None = None, memo: dict | None = None, k_affine=None) -> int:
    """Store key [T, H, D_k], value [T, H, D_v] at slot_mapping [T]; returns the tokens written.

    k_affine: the layer's lowbit.kv.key_affine.KeyAffine (or None): keys are stored as ((k - shift) / scale)
    R_k, every tier, as lowbit's caches store them; `attend` then needs the same k_affine for the queries.

    rotated: a dict that receives "k" / "v" [n, H, D] (the rows as rotated here, in the input dtype) when no
    row was padding, so `attend(new_kr=..., new_vr=...)` of the same step need not rotate them again.
    memo: the step's dict shared by the layers of one KV cache group (the backend's metadata): the index
    tensors built from slot_mapping / positions (_write_index) are built by the first layer only.

    With an arena, `positions` [T] (each token's index in its request) and `row_seq_lens` [T]
    (its request's length after this step) pick the rows also kept dense (TierArena). Every row
    is packed either way: the paged cache holds all tokens. Rows are rotated once, for both."""
    from lowbit.kv.rotations import rotate

    if arena is not None and (arena.sink > 0 or arena.recent > 0) and (positions is None or row_seq_lens is None):
        raise ValueError("a tier arena needs the token positions and their requests' lengths")
    n = min(key.shape[0], slot_mapping.shape[0])
    bs = cache_u8.shape[2]
    ix = _write_index(slot_mapping, n, bs, positions, row_seq_lens, arena, memo)
    if ix["count"] == 0:
        return 0
    keep = ix["keep"]
    key, value = (key[:n], value[:n]) if keep is None else (key[:n][keep], value[:n][keep])
    key = map_token_keys(key, k_affine)
    kr = rotate(key.transpose(0, 1).unsqueeze(0), rot_k)  # [1, H, T, D_k]
    vr = rotate(value.transpose(0, 1).unsqueeze(0), rot_v)
    fmt.write_rotated(cache_u8, ix["blk"], ix["off"], kr, vr)  # cache[blk, :, off, :] = the cells
    kd = vd = None  # the rotated rows in the input dtype (what attend's own row and the arena hold)
    if rotated is not None:
        rotated.clear()
        if keep is None:
            kd, vd = kr[0].transpose(0, 1).to(key.dtype), vr[0].transpose(0, 1).to(value.dtype)
            rotated.update(k=kd, v=vd, n=n)
    if arena is not None and ix["a_blk"] is not None:
        if kd is None or kd.dtype != arena.dtype or vd.dtype != arena.dtype:  # else: the same rounding, done
            kd, vd = kr[0].transpose(0, 1), vr[0].transpose(0, 1)
        sel = ix["a_sel"]
        if sel is not None:
            kd, vd = kd[sel], vd[sel]
        arena.put(ix["a_blk"], ix["a_off"], kd, vd, block_set=ix["a_blocks"])
    return ix["count"]


def _blocks(cache_u8, fmt: SlotFormat, table_row: torch.Tensor, seq_len: int, chunk_tokens: int,
            arena: TierArena | None = None, upto: int | None = None, start: int = 0):
    """Yield (k [1,H,n,D], v [1,H,n,Dv], first slot) for one request's stored rows [start, upto),
    chunk by chunk, from the block holding `start` on (blocks before it are never indexed: on a
    sliding layer vLLM may have freed them); seq_len (the request's length after this step)
    decides which rows are dense tiers. The dequantized view of what `attend` reads (tests)."""
    bs = cache_u8.shape[2]
    per = max(1, chunk_tokens // bs)  # vLLM blocks per chunk
    upto = seq_len if upto is None else upto
    n_blocks = -(-upto // bs)
    for b0 in range(start // bs, n_blocks, per):
        ids = table_row[b0:min(n_blocks, b0 + per)].long()
        raw = cache_u8[ids]  # [nb, H, bs, C]
        H, C = raw.shape[1], raw.shape[3]
        raw = raw.permute(1, 0, 2, 3).reshape(H, -1, C)  # [H, nb*bs, C]
        lo = b0 * bs
        n = min(upto - lo, raw.shape[1])
        k, v = fmt.decode(raw[:, :n])
        if arena is not None:
            k, v = arena.overlay(table_row, lo, seq_len, k, v, vis_lo=start)
        yield k, v, lo


# ------------------------------------------------------------------ the fused attention over packed cells
def _unpack_float(packed: torch.Tensor, cbits: int) -> torch.Tensor:
    """uint8 [..., D*cbits/8] in the `strided` layout -> codes float32 [..., D] (dims in order)."""
    if cbits == 8:
        return packed.float()
    P, mask = 8 // cbits, (1 << cbits) - 1
    parts = [packed if i == 0 and P == 1 else (packed >> (i * cbits)) & mask for i in range(P)]
    return torch.cat(parts, dim=-1).float()  # part i holds dims [i*S, (i+1)*S)


def _tensor_fields(fmt: SlotFormat, which: str, cells: torch.Tensor, valid: torch.Tensor):
    """cells uint8 [R, H, N, C], valid bool [R, N] -> ("dense", x [R,H,N,D]) or
    ("codes", codes float [R,H,N,D], scale, zero float [R,H,N,ng]) with the invalid rows' floats zeroed
    (a freed block may hold another request's or NaN bytes; 0 * NaN would leak into the sums)."""
    c = fmt.codecs[which]
    ok = valid[:, None, :, None]
    if not c.quantized:
        x = fmt.read_field(cells, which, "dense").float()
        return ("dense", torch.where(ok, x, 0.0))
    codes = _unpack_float(fmt.read_field(cells, which, "codes"), c.cbits)
    scale = torch.where(ok, fmt.read_field(cells, which, "scale").float(), 0.0)
    zero = torch.where(ok, fmt.read_field(cells, which, "zero").float(), 0.0)
    return ("codes", codes, scale, zero)


def _scores_packed(q: torch.Tensor, kf, group: int) -> torch.Tensor:
    """q [R,H,M,D] float32 . K held as codes: sum_g s_g (q_g . c_g) + z_g sum(q_g): the scale and zero
    of each (token, group) are applied to the dot, never to the D codes -> [R,H,M,N]."""
    if kf[0] == "dense":
        return q @ kf[1].transpose(-1, -2)
    _, codes, scale, zero = kf
    D = q.shape[-1]
    out = None
    for g in range(D // group):
        sl = slice(g * group, (g + 1) * group)
        s = (q[..., sl] @ codes[..., sl].transpose(-1, -2)) * scale[..., g].unsqueeze(-2)
        s = s + q[..., sl].sum(-1, keepdim=True) * zero[..., g].unsqueeze(-2)
        out = s if out is None else out + s
    return out


def _values_packed(p: torch.Tensor, vf, group: int) -> torch.Tensor:
    """p [R,H,M,N] . V held as codes: per group (p * s_g) @ c_g + p @ z_g -> [R,H,M,Dv]."""
    if vf[0] == "dense":
        return p @ vf[1]
    _, codes, scale, zero = vf
    outs = []
    for g in range(codes.shape[-1] // group):
        sl = slice(g * group, (g + 1) * group)
        o = (p * scale[..., g].unsqueeze(-2)) @ codes[..., sl] + (p @ zero[..., g:g + 1])
        outs.append(o)
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


class _Online:
    """Streaming softmax over pieces of keys (log-sum-exp merge; an all-masked piece adds nothing)."""

    def __init__(self, R, H, M, Dv, device):
        self.m = torch.full((R, H, M), float("-inf"), device=device)
        self.l = torch.zeros(R, H, M, device=device)
        self.acc = torch.zeros(R, H, M, Dv, device=device)

    def add(self, s: torch.Tensor, values) -> None:
        m_new = torch.maximum(self.m, s.amax(-1))
        m_safe = torch.where(torch.isinf(m_new), 0.0, m_new)
        alpha = torch.exp(self.m - m_safe)
        p = torch.exp(s - m_safe.unsqueeze(-1))
        self.l = self.l * alpha + p.sum(-1)
        self.acc = self.acc * alpha.unsqueeze(-1) + values(p)
        self.m = m_new

    def result(self) -> torch.Tensor:
        return self.acc / self.l.clamp(min=1e-30).unsqueeze(-1)


def _mask_scores(s, kpos, valid, qpos, window, causal, scale, softcap):
    """s [R,H,M,N] raw dots -> scaled, soft-capped, masked (-inf) scores. kpos [R,N], valid [R,N], qpos [R,M]."""
    s = s * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    ok = valid[:, None, :]  # [R, 1, N]
    if causal:
        ok = ok & (kpos[:, None, :] <= qpos[:, :, None])
    if window:
        ok = ok & (kpos[:, None, :] > qpos[:, :, None] - window)
    return s.masked_fill(~ok[:, None], float("-inf"))


def _attend_group(reqs, qr, kr_new, vr_new, cache_u8, fmt, block_table, window, softcap, scale,
                  chunk_tokens, arena, G):
    """Attention for requests with the same number of new queries lq (one batched pass).

    reqs: [(r, q0, lq, seq_len)]; qr [T, Hkv, G, D] rotated queries; kr_new/vr_new [T, Hkv, D] rotated
    new rows (None: the new rows are read back from the cache like the history)."""
    dev = qr.device
    R, lq = len(reqs), reqs[0][2]
    Hkv, D = qr.shape[1], qr.shape[3]
    Dv = fmt.codecs["v"].head_dim
    bs, nbt = cache_u8.shape[2], block_table.shape[1]
    M = G * lq
    rows = torch.tensor([x[0] for x in reqs], dtype=torch.long, device=dev)
    q0s = torch.tensor([x[1] for x in reqs], dtype=torch.long, device=dev)
    seq = torch.tensor([x[3] for x in reqs], dtype=torch.long, device=dev)
    own = kr_new is not None
    hist = seq - lq if own else seq  # rows read from the cache / arena
    first = seq - lq  # position of each request's first query
    tok = q0s[:, None] + torch.arange(lq, device=dev)[None]  # [R, lq] rows of the batch
    q = qr[tok]  # [R, lq, Hkv, G, D]
    q = q.permute(0, 2, 3, 1, 4).reshape(R, Hkv, M, D)  # m = g * lq + i
    qpos = (first[:, None] + torch.arange(lq, device=dev)[None]).repeat(1, G)  # [R, M]
    vis = (first - (window - 1)).clamp(min=0) if window else torch.zeros_like(first)
    sink = arena.sink if arena is not None else 0
    recent = arena.recent if arena is not None else 0
    dense_from = torch.maximum(torch.full_like(seq, sink), seq - recent) if recent else seq
    mid_lo = torch.maximum(vis, torch.full_like(vis, sink))
    mid_hi = torch.minimum(hist, dense_from)
    acc = _Online(R, Hkv, M, Dv, dev)
    gk, gv = fmt.codecs["k"].group, fmt.codecs["v"].group
    table = block_table.long()

    # 1. the packed middle, from the block holding mid_lo on (never a block before the window)
    b0 = mid_lo // bs
    b1 = torch.maximum(-(-mid_hi // bs), b0)
    nb = int((b1 - b0).max())
    per = max(1, chunk_tokens // bs)
    for j0 in range(0, nb, per):
        j = torch.arange(j0, min(nb, j0 + per), device=dev)
        bidx = b0[:, None] + j[None]  # [R, nc] block index in each request's table
        ids = table[rows[:, None], bidx.clamp(max=nbt - 1)].clamp(0, cache_u8.shape[0] - 1)
        cells = cache_u8[ids]  # [R, nc, H, bs, C]
        nc = cells.shape[1]
        cells = cells.transpose(1, 2).reshape(R, Hkv, nc * bs, -1)
        kpos = (bidx[:, :, None] * bs + torch.arange(bs, device=dev)).reshape(R, nc * bs)
        valid = (kpos >= mid_lo[:, None]) & (kpos < mid_hi[:, None])
        kf = _tensor_fields(fmt, "k", cells, valid)
        vf = _tensor_fields(fmt, "v", cells, valid)
        s = _mask_scores(_scores_packed(q, kf, gk), kpos, valid, qpos, window, not own, scale, softcap)
        acc.add(s, lambda p, vf=vf: _values_packed(p, vf, gv))

    # 2. the dense tiers (sink, recent window) from the arena, and the step's own rows as they arrived
    ks, vs, kp, ok = [], [], [], []
    hmax = int(hist.max())
    n_s, n_r = min(sink, hmax), min(recent, hmax)
    if arena is not None and n_s + n_r:
        jpos = torch.cat([torch.arange(n_s, device=dev)[None].expand(R, n_s),
                          torch.maximum(dense_from, vis)[:, None] + torch.arange(n_r, device=dev)[None]], dim=1)
        jvalid = torch.cat([(jpos[:, :n_s] >= vis[:, None]) & (jpos[:, :n_s] < torch.minimum(hist, torch.full_like(hist, sink))[:, None]),
                            jpos[:, n_s:] < hist[:, None]], dim=1)
        jc = torch.where(jvalid, jpos, 0)
        blk = table[rows[:, None], (jc // bs).clamp(max=nbt - 1)]
        off = jc % bs
        slots = arena.k.lookup(blk)
        missing = arena.missing(slots, off, jvalid)
        if bool(missing.any()):  # a prefix-cache hit's shared rows (or a bug: raises)
            _fill_missing(arena, cache_u8, fmt, blk, off, jpos, missing, first)
            slots = arena.k.lookup(blk)
        if arena.k.data is not None:
            okd = jvalid[:, None, :, None]
            ks.append(torch.where(okd, arena.k.rows(slots, off).transpose(1, 2).float(), 0.0))  # [R, H, n, D]
            vs.append(torch.where(okd, arena.v.rows(slots, off).transpose(1, 2).float(), 0.0))
            kp.append(jpos)
            ok.append(jvalid)
    if own:
        ks.append(kr_new[tok].permute(0, 2, 1, 3).float())  # [R, H, lq, D]
        vs.append(vr_new[tok].permute(0, 2, 1, 3).float())
        kp.append(first[:, None] + torch.arange(lq, device=dev)[None])
        ok.append(torch.ones(R, lq, dtype=torch.bool, device=dev))
    if ks:
        k_d, v_d = torch.cat(ks, dim=2), torch.cat(vs, dim=2)
        kpos, valid = torch.cat(kp, dim=1), torch.cat(ok, dim=1)
        s = _mask_scores(q @ k_d.transpose(-1, -2), kpos, valid, qpos, window, True, scale, softcap)
        acc.add(s, lambda p: p @ v_d)
    return acc.result()  # [R, Hkv, M, Dv] rotated


def kernel_meta(fmt: SlotFormat) -> torch.Tensor | None:
    """The fused kernel's view of a slot: int64 [12] (K: codes/scale/zero offsets, container bits,
    group, dim; V: same), or None when a tensor is stored dense (16-bit): the torch path serves it."""
    if getattr(fmt, "_kernel_meta", False) is not False:
        return fmt._kernel_meta
    meta = []
    for which in ("k", "v"):
        c = fmt.codecs[which]
        if not c.quantized or c.cbits not in (2, 4, 8):
            fmt._kernel_meta = None
            return None
        meta += [fmt.field(which, "codes").offset, fmt.field(which, "scale").offset, fmt.field(which, "zero").offset,
                 c.cbits, c.group, c.head_dim]
    fmt._kernel_meta = torch.tensor(meta, dtype=torch.long)
    return fmt._kernel_meta


def _decode_index(reqs, block_table: torch.Tensor, num_blocks: int, bs: int, window, sink: int, recent: int,
                  own: bool, memo: dict | None) -> dict:
    """What one decode step reads, per request, as index tensors (the same for every layer of a KV cache
    group with this window; memoised in `memo`, the step's metadata): the packed middle's block ids
    [R, nb] from the block holding max(sink, window start) on, (b0, lo, hi) [R, 3], and the dense tier
    positions' blocks / offsets / validity [R, sink + recent]."""
    key = ("decode", window, sink, recent, bs, own)
    if memo is not None and key in memo:
        return memo[key]
    dev = block_table.device
    table = block_table.long()
    nbt = table.shape[1]
    rows = torch.tensor([x[0] for x in reqs], dtype=torch.long, device=dev)
    seq = torch.tensor([x[3] for x in reqs], dtype=torch.long, device=dev)
    first = seq - 1
    hist = first if own else seq
    vis = (first - (window - 1)).clamp(min=0) if window else torch.zeros_like(first)
    dense_from = torch.clamp(seq - recent, min=sink) if recent else seq
    mid_lo = vis.clamp(min=sink)
    mid_hi = torch.minimum(hist, dense_from)
    b0 = mid_lo // bs
    b1 = torch.maximum(-(-mid_hi // bs), b0)
    nb = int((b1 - b0).max())
    bidx = b0[:, None] + torch.arange(nb, device=dev)[None]
    ids = table[rows[:, None], bidx.clamp(max=nbt - 1)].clamp(0, num_blocks - 1).contiguous()
    out = {"q0s": torch.tensor([x[1] for x in reqs], dtype=torch.long, device=dev), "ids": ids,
           "mid": torch.stack([b0, mid_lo, mid_hi], dim=1).contiguous(), "first": first}
    if sink or recent:
        hmax = int(hist.max())
        n_s, n_r = min(sink, hmax), min(recent, hmax)
        rs = torch.maximum(dense_from, vis)
        jpos = torch.cat([torch.arange(n_s, device=dev)[None].expand(len(reqs), n_s),
                          rs[:, None] + torch.arange(n_r, device=dev)[None]], dim=1)
        sink_hi = hist.clamp(max=sink)
        jvalid = torch.cat([(jpos[:, :n_s] >= vis[:, None]) & (jpos[:, :n_s] < sink_hi[:, None]),
                            jpos[:, n_s:] < hist[:, None]], dim=1)
        jc = torch.where(jvalid, jpos, 0)
        out.update(jpos=jpos, jvalid=jvalid, off=jc % bs, blk=table[rows[:, None], (jc // bs).clamp(max=nbt - 1)])
    if memo is not None:
        memo[key] = out
    return out


def _fused_decode(mod, reqs, qr, kr_new, vr_new, cache_u8, fmt, block_table, window, softcap, scale, arena,
                  memo, rot_k=None, rot_v=None) -> torch.Tensor:
    """Decode requests (one query each) through the fused kernel -> [R, Hkv, G, Dv].

    qr [T, Hkv, G, D]: the batch's queries, rotated by R_k -- or unrotated (any float dtype) with rot_k given,
    which the kernel then applies per row; rot_v given: the kernel un-rotates the output (else it stays
    rotated). Both are what attend's torch glue did around the kernel, in one op."""
    NB, H, bs, _ = cache_u8.shape
    sink = arena.sink if arena is not None else 0
    recent = arena.recent if arena is not None else 0
    own = kr_new is not None
    idx = _decode_index(reqs, block_table, NB, bs, window, sink, recent, own, memo)
    in_order = idx.get("in_order")
    if in_order is None:  # the batch is exactly these requests' queries, in order: no gather of q / own rows
        in_order = idx["in_order"] = (qr.shape[0] == len(reqs)
                                      and all(x[1] == i for i, x in enumerate(reqs)))
    q = qr if in_order else qr.index_select(0, idx["q0s"])  # [R, Hkv, G, D]
    R, D, Dv = q.shape[0], q.shape[3], fmt.codecs["v"].head_dim
    empty = torch.zeros(0, dtype=torch.float32, device=q.device)
    pool_k = pool_v = empty
    rows = idx.get("no_rows")
    if rows is None:
        rows = idx["no_rows"] = torch.zeros(R, 0, dtype=torch.long, device=q.device)
    if "blk" in idx:
        jvalid = idx["jvalid"]
        if not arena.hold_prefix and arena.k.data is not None:  # block-level map: one op (TierArena.missing)
            rows, n_missing = mod.dense_rows(arena.k.map, idx["blk"], idx["off"], jvalid, bs)
        else:
            n_missing = None
        if n_missing is None or n_missing:
            slots = arena.k.lookup(idx["blk"])
            missing = arena.missing(slots, idx["off"], jvalid)
            if bool(missing.any()):  # a prefix-cache hit's shared rows (or a bug: raises)
                _fill_missing(arena, cache_u8, fmt, idx["blk"], idx["off"], idx["jpos"], missing, idx["first"])
                slots = arena.k.lookup(idx["blk"])
            if arena.k.data is not None:
                rows = torch.where(jvalid, slots * bs + idx["off"], -1).contiguous()
        if arena.k.data is not None:
            pool_k = arena.k.data.view(-1, H, D)
            pool_v = arena.v.data.view(-1, H, Dv)
    if own:
        own_k = kr_new if in_order else kr_new.index_select(0, idx["q0s"])
        own_v = vr_new if in_order else vr_new.index_select(0, idx["q0s"])
    else:
        own_k = own_v = empty
    rk = empty if rot_k is None else rot_k
    rv = empty if rot_v is None else rot_v
    return mod.paged_decode(q, cache_u8, idx["ids"], idx["mid"], kernel_meta(fmt), pool_k, pool_v, rows, own_k,
                            own_v, float(scale), float(softcap or 0.0), rk, rv)


def attend(query: torch.Tensor, cache_u8: torch.Tensor, fmt: SlotFormat, *, block_table: torch.Tensor,
           seq_lens: torch.Tensor, query_start_loc: torch.Tensor, scale: float, rot_k=None, rot_v=None,
           window: int | None = None, softcap: float | None = None,
           chunk_tokens: int = DEFAULT_CHUNK_TOKENS, arena: TierArena | None = None,
           new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None, kernel: str = "torch",
           memo: dict | None = None, evict: bool = True, new_kr: torch.Tensor | None = None,
           new_vr: torch.Tensor | None = None, k_affine=None) -> torch.Tensor:
    """query [T, Hq, D] (the batch's new tokens, request after request) -> output [T, Hq, D_v] float32.

    k_affine: the KeyAffine the keys were written with (write(k_affine=...)): queries become q * scale and
    new_k is mapped like the stored keys (new_kr from write already is).

    seq_lens [R]: tokens each request holds after this step (its new ones included);
    query_start_loc [R + 1]: where each request's queries start in `query`;
    new_k [T, Hkv, D], new_v: the new tokens' K/V as they arrived -- their own chunk is attended
    exactly (lowbit's runtime); without them it is read back from the cache like the history.
    window: the layer's sliding window; the history is read from visible_from(first query) on.

    Requests with one new token (decode) run as one batched pass; each longer chunk (prefill) as its
    own. Per pass: the packed middle is gathered through the block table (chunk_tokens at a time,
    log-sum-exp merged) and scored on its codes (scale/zero applied to the dots, not to the codes);
    the dense tiers come from the arena's pool with one gather; no Python loop over blocks or rows.
    kernel "cpu-fused": the decode requests run through csrc/paged_decode.cpp instead (same inputs,
    index tensors from _decode_index, memoised per step in `memo` across layers); prefill chunks and
    dense (16-bit) tensors always take the torch path. evict=False leaves dropping the arena's stale
    blocks to the caller (the backend does it once per step in its metadata builder: TierArena.retain).
    """
    from lowbit.kv.rotations import rotate, unrotate

    T, Hq, D = query.shape
    Hkv = cache_u8.shape[1]
    G = Hq // Hkv
    Dv = fmt.codecs["v"].head_dim
    if k_affine is not None:
        query = map_token_queries(query, k_affine)
        new_k = None if new_k is None else map_token_keys(new_k, k_affine)
    if arena is not None and (arena.window or None) != (window or None):
        raise ValueError(f"the tier arena is for window {arena.window}, the attention for {window}")
    rk_ = ("reqs", query_start_loc.data_ptr(), seq_lens.data_ptr(), T)  # the same for every layer of a step
    if memo is not None and rk_ in memo:
        reqs, nq, decode_in_order = memo[rk_]
    else:
        qsl = query_start_loc.tolist()
        lens = seq_lens.tolist()
        reqs = [(r, qsl[r], qsl[r + 1] - qsl[r], n) for r, n in enumerate(lens) if qsl[r + 1] > qsl[r] and n > 0]
        nq = qsl[len(lens)]
        # a decode-only batch, request i's query at row i: the fused kernel reads q and writes out as they lie
        decode_in_order = (bool(reqs) and T == nq == len(reqs)
                           and all(x[2] == 1 and x[1] == i for i, x in enumerate(reqs)))
        if memo is not None:
            memo[rk_] = (reqs, nq, decode_in_order)
    if not reqs:
        return torch.zeros(T, Hq, Dv, dtype=torch.float32, device=query.device)
    mod = None
    if kernel == "cpu-fused":
        from lowbit.vllm_plugin import cpu_kernel

        mod, why = cpu_kernel.load()
        if mod is None:
            raise RuntimeError(f"lowbit plugin: kernel cpu-fused asked but {why}")
        if kernel_meta(fmt) is None or not cache_u8.is_contiguous():
            mod = None  # dense 16-bit tensors or a strided cache view: the torch path (same math)
    elif kernel != "torch":
        raise ValueError(f"kernel {kernel!r}: 'torch' or 'cpu-fused'")
    if mod is not None and decode_in_order and all(r is None or r.dim() == 2 or r.shape[0] == Hkv
                                                   for r in (rot_k, rot_v)):
        # the decode step: q rotated, attended and the output un-rotated inside the kernel (one op)
        if new_kr is not None and new_kr.shape[0] >= nq:  # rotated by `write` in this step
            kr_new, vr_new = new_kr[:nq], new_vr[:nq]
        elif new_k is not None:
            kr_new = rotate(new_k[:nq].transpose(0, 1).unsqueeze(0), rot_k).to(new_k.dtype)[0].transpose(0, 1)
            vr_new = rotate(new_v[:nq].transpose(0, 1).unsqueeze(0), rot_v).to(new_v.dtype)[0].transpose(0, 1)
        else:
            kr_new = vr_new = None
        o = _fused_decode(mod, reqs, query[:nq].reshape(nq, Hkv, G, D), kr_new, vr_new, cache_u8, fmt, block_table,
                          window, softcap, scale, arena, memo, rot_k=rot_k, rot_v=rot_v)  # [R, Hkv, G, Dv]
        if arena is not None and evict:
            for r, q0, lq, n in reqs:
                arena.evict(block_table[r], n, visible_from(n - lq, window))
        return o.view(nq, Hq, Dv)
    out = torch.zeros(T, Hq, Dv, dtype=torch.float32, device=query.device)
    # every query rotated by R_k once: [T, Hq, D] -> [1, Hkv, T*G, D] -> [T, Hkv, G, D]
    qr = rotate(query[:nq].float().reshape(nq, Hkv, G, D).permute(1, 0, 2, 3).reshape(1, Hkv, nq * G, D), rot_k)
    qr = qr.reshape(Hkv, nq, G, D).permute(1, 0, 2, 3)
    kr_new = vr_new = None
    if new_kr is not None and new_kr.shape[0] >= nq:  # rotated by `write` in this step (write(rotated=...))
        kr_new, vr_new = new_kr[:nq], new_vr[:nq]
    elif new_k is not None:
        kr_new = rotate(new_k[:nq].transpose(0, 1).unsqueeze(0), rot_k).to(new_k.dtype)[0].transpose(0, 1)
        vr_new = rotate(new_v[:nq].transpose(0, 1).unsqueeze(0), rot_v).to(new_v.dtype)[0].transpose(0, 1)
    groups = [[x for x in reqs if x[2] == 1]] + [[x] for x in reqs if x[2] > 1]
    for grp in groups:
        if not grp:
            continue
        lq = grp[0][2]
        if mod is not None and lq == 1:
            o = _fused_decode(mod, grp, qr, kr_new, vr_new, cache_u8, fmt, block_table, window, softcap, scale,
                              arena, memo)  # [R, Hkv, G, Dv]
        else:
            o = _attend_group(grp, qr, kr_new, vr_new, cache_u8, fmt, block_table, window, softcap, scale,
                              chunk_tokens, arena, G)  # [R, Hkv, G*lq, Dv]
        R = len(grp)
        o = unrotate(o.reshape(1, R * Hkv, G * lq, Dv) if rot_v is None or rot_v.dim() == 2 else
                     o.reshape(R, Hkv, G * lq, Dv), rot_v)
        o = o.reshape(R, Hkv, G, lq, Dv).permute(0, 3, 1, 2, 4).reshape(R * lq, Hq, Dv)
        if len(grp) == len(reqs) and lq == 1 and T == nq == len(grp) and all(x[1] == i for i, x in enumerate(grp)):
            out = o  # a decode-only batch in order: the output as computed
            continue
        tok = torch.cat([torch.arange(x[1], x[1] + lq) for x in grp]).to(query.device)
        out[tok] = o
    if arena is not None and evict:
        table = block_table
        for r, q0, lq, n in reqs:
            arena.evict(table[r], n, visible_from(n - lq, window))
    return out


def token_positions(query_start_loc: torch.Tensor, seq_lens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(position of each of the batch's n new tokens in its request: seq_len - q_len + i, and that
    request's seq_len), -1 / 0 for padding tokens."""
    qsl = query_start_loc.long().cpu()
    q_lens = qsl[1:] - qsl[:-1]
    starts = seq_lens.long().cpu() - q_lens  # position of each request's first new token
    req = torch.repeat_interleave(torch.arange(len(q_lens)), q_lens)
    pos = starts[req] + (torch.arange(int(q_lens.sum())) - qsl[:-1][req])
    out = torch.full((n,), -1, dtype=torch.long)
    out[: min(n, pos.numel())] = pos[:n]
    lens = torch.zeros(n, dtype=torch.long)
    lens[: min(n, pos.numel())] = seq_lens.long().cpu()[req][:n]
    return out, lens
