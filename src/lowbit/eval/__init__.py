"""Evaluation: what a KV (or weight) recipe costs, measured under one harness that cannot fool itself.

`lowbit eval` (runner.py) — the protocol:
  - the corpus is tokenized as a whole (no special tokens) and cut into N consecutive windows of L
    tokens (default 2048, capped by the model context);
  - every row (the bf16 DynamicCache reference, lowbit schemes, peers) gets a fresh cache per window
    and is fed the window C tokens at a time (default 128), so later chunks attend to quantized
    history exactly as in serving; rows run in lockstep, chunk by chunk (harness.py);
  - scored: positions 0..L-2 of each window predict tokens 1..L-1 (L-1 per window);
  - per row: PPL, KL(bf16 || row) per token and top-1 agreement against the reference's chunk,
    bits/elt of the quantized tier and over all tiers (from the tensors the cache holds), quantized
    K/V rows (zero for a quantized row aborts: dead hook), wall and CPU seconds of its forwards;
  - check: the reference's chunked PPL against a plain full-window forward (perplexity.py), to 0.5%.

Modules: perplexity (scoring, full-window reference), peers (rows: reference, lowbit, HF QuantizedCache),
harness (the loop), plan (--kv / --peers parsing), report (JSON, table, markdown, PNG), runner (CLI glue);
layer_error (per-layer attention-output error, a separate harness).
"""
