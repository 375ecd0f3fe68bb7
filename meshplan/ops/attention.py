"""onnxruntime's attention operators (``com.microsoft``): GroupQueryAttention as
onnxruntime-genai's model builder writes it, MultiHeadAttention, RotaryEmbedding.

Attention splits by batch, or by heads: each device computes its query heads with the
key/value heads they read, and holds those heads' past and present cache. Heads are
never cut, so a head split rewrites the head-count attributes per device.

GroupQueryAttention (inputs: query, key, value, past_key, past_value, seqlens_k,
total_sequence_length, cos_cache, sin_cache, position_ids, attention_bias, head_sink, …;
outputs: output, present_key, present_value). Query heads ``h`` read key/value head
``h // (num_heads / kv_num_heads)``, so device ``i`` of ``t`` holds query heads
``[i·Nq/t, (i+1)·Nq/t)`` and key/value heads ``[i·Nkv/t, …)`` when ``t`` divides
``kv_num_heads``; with more devices than key/value heads, head ``j`` is held by the
``t / Nkv`` devices whose query heads read it (``sharding.segment_count``). The query's
packed form (key and value omitted: ``[batch, seq, (Nq + 2·Nkv)·head_size]``, the query,
key and value columns one after the other) is split per segment (``intra.segments``), so
the projection that computes it is split so too. seqlens_k, total_sequence_length and the
cos/sin caches are read whole by every device.

The present key and value are the operator's ``cache_outputs``: memory a device holds for
as long as the model runs, so the planner counts each device's share with its weights.
"""

from __future__ import annotations

from meshplan.ops.registry import ATTENTION, define, per_element, rule
from meshplan.ops.view import R, OpView, Rule, need

MICROSOFT = "com.microsoft"

# GroupQueryAttention's inputs
QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE, SEQLENS_K, TOTAL_LENGTH, COS, SIN, POSITION_IDS, ATTENTION_BIAS, HEAD_SINK = \
    range(12)
UNSPLIT_INPUTS = range(12, 16)   # k_scale, v_scale (quantized cache), q/k norm weights: no rule with them
OUTPUT, PRESENT_KEY, PRESENT_VALUE, OUTPUT_QK = range(4)


def _gqa_sizes(op: OpView) -> tuple[int, int, int]:
    """(num_heads, kv_num_heads, head_size)."""
    heads, kv_heads = op.attr("num_heads"), op.attr("kv_num_heads")
    width = op.shape(QUERY)[-1]
    packed = not op.has_input(KEY)
    return heads, kv_heads, width // (heads + 2 * kv_heads) if packed else width // heads


def _gqa_segments(op: OpView) -> dict:
    """The packed query's three segments; the cache's and key/value's heads; the output's."""
    heads, kv_heads, size = _gqa_sizes(op)
    found = {len(op.ins) + OUTPUT: {2: ((heads * size, heads),)}}
    if op.has_input(KEY):
        found[QUERY] = {2: ((heads * size, heads),)}
        found[KEY] = found[VALUE] = {2: ((kv_heads * size, kv_heads),)}
    else:
        found[QUERY] = {2: ((heads * size, heads), (kv_heads * size, kv_heads), (kv_heads * size, kv_heads))}
    for index in (PAST_KEY, PAST_VALUE):
        if op.has_input(index):
            found[index] = {1: ((kv_heads, kv_heads),)}
    for index in (PRESENT_KEY, PRESENT_VALUE):
        if index < len(op.outs) and op.outs[index] is not None:
            found[len(op.ins) + index] = {1: ((kv_heads, kv_heads),)}
    return found


def _gqa_flops(op: OpView) -> float:
    """QKᵀ and the weighted sum over the present length: 4·batch·seq·length·heads·head_size."""
    heads, _, size = _gqa_sizes(op)
    batch, seq = op.shape(QUERY)[:2]
    length = op.outs[PRESENT_KEY].shape[2] if len(op.outs) > PRESENT_KEY and op.outs[PRESENT_KEY] is not None else seq
    return 4.0 * batch * seq * length * heads * size


def _gqa_local_attrs(op: OpView, ins: list, outs: list) -> dict:
    heads, kv_heads, size = _gqa_sizes(op)
    local_heads = outs[OUTPUT][2] // size
    if op.has_input(KEY):
        local_kv = ins[KEY][2] // size
    else:
        local_kv = (ins[QUERY][2] // size - local_heads) // 2
    return {"num_heads": local_heads, "kv_num_heads": local_kv}


@rule("GroupQueryAttention", domain=MICROSOFT, flops=_gqa_flops, heavy=True, policy=ATTENTION, segments=_gqa_segments,
      local_attrs=_gqa_local_attrs, cache_outputs=(PRESENT_KEY, PRESENT_VALUE))
def _group_query_attention(op: OpView) -> list[Rule]:
    """Batch: every batched operand's dim 0 (seqlens_k [batch] too). Heads: the query
    (packed or not), key, value and output on their last dim, the cache on dim 1, the
    attention bias on its heads dim when it has one, head_sink [num_heads] on its only
    dim; seqlens_k, total_sequence_length, cos/sin caches and position ids whole."""
    need(len(op.shape(QUERY)) == 3 and not any(op.has_input(i) for i in UNSPLIT_INPUTS))
    need(len(op.outs) <= OUTPUT_QK or op.outs[OUTPUT_QK] is None)
    need(op.attr("kv_cache_bit_width", 0) in (0, None) and not op.attr("sliding_window_cache", 0))
    heads, kv_heads, _ = _gqa_sizes(op)
    need(heads % kv_heads == 0)
    batch = op.shape(QUERY)[0]
    ins: list = [R] * len(op.ins)
    for index in (QUERY, KEY, VALUE, PAST_KEY, PAST_VALUE, SEQLENS_K, POSITION_IDS, ATTENTION_BIAS):
        if op.has_input(index) and op.shape(index) and op.shape(index)[0] == batch:
            ins[index] = 0
    rules: list[Rule] = []
    if op.shape(SEQLENS_K) and op.shape(SEQLENS_K)[0] == batch and (not op.has_input(POSITION_IDS) or ins[POSITION_IDS] == 0):
        rules.append((tuple(ins), (0, 0, 0)))
    by_heads: list = [R] * len(op.ins)
    for index in (QUERY, KEY, VALUE):
        if op.has_input(index):
            by_heads[index] = 2
    for index in (PAST_KEY, PAST_VALUE):
        if op.has_input(index):
            by_heads[index] = 1
    if op.has_input(ATTENTION_BIAS):
        need(op.shape(ATTENTION_BIAS)[1] in (1, heads))
        by_heads[ATTENTION_BIAS] = 1 if op.shape(ATTENTION_BIAS)[1] == heads else R
    if op.has_input(HEAD_SINK):
        by_heads[HEAD_SINK] = 0
    rules.append((tuple(by_heads), (2, 1, 1)))
    return rules


# --- MultiHeadAttention ------------------------------------------------------------------
# Inputs: query, key, value, bias, key_padding_mask, attention_bias, past_key, past_value,
# past_sequence_length, cache_indirection; outputs: output, present_key, present_value, qk.

def _mha_flops(op: OpView) -> float:
    batch, seq, width = op.shape(0)
    length = op.outs[1].shape[2] if len(op.outs) > 1 and op.outs[1] is not None else op.shape(1)[1]
    return 4.0 * batch * seq * length * width


def _mha_local_attrs(op: OpView, ins: list, outs: list) -> dict:
    return {"num_heads": ins[0][2] // (op.shape(0)[2] // op.attr("num_heads"))}


def _mha_whole_heads(op: OpView, inputs, outputs, mesh) -> tuple | None:
    """A heads split leaves each device whole heads."""
    size = op.shape(0)[2] // op.attr("num_heads")
    return () if inputs[0].local_shape(op.shape(0), mesh)[2] % size == 0 else None


@rule("MultiHeadAttention", domain=MICROSOFT, flops=_mha_flops, heavy=True, policy=ATTENTION,
      local_attrs=_mha_local_attrs, rewrite=_mha_whole_heads, cache_outputs=(1, 2))
def _multi_head_attention(op: OpView) -> list[Rule]:
    """Separate 3-D query, key and value (no packed forms, no bias, no cache indirection):
    batch everywhere it is; heads on the query, key, value and output's last dim and the
    cache's dim 1 (attention bias on its heads dim when it has one)."""
    need(all(op.has_input(i) and len(op.shape(i)) == 3 for i in (0, 1, 2)))
    need(not any(op.has_input(i) for i in (3, 8, 9)) and (len(op.outs) < 4 or op.outs[3] is None))
    heads = op.attr("num_heads")
    batch = op.shape(0)[0]
    batched: list = [0 if op.has_input(i) and op.shape(i)[0] == batch else R for i in range(len(op.ins))]
    by_heads: list = [2, 2, 2, R, R, R, 1, 1][:len(op.ins)]
    if op.has_input(5):
        need(op.shape(5)[1] in (1, heads))
        by_heads[5] = 1 if op.shape(5)[1] == heads else R
    return [(tuple(batched), (0, 0, 0)), (tuple(by_heads), (2, 1, 1))]


# --- RotaryEmbedding ---------------------------------------------------------------------
# com.microsoft: (input, position_ids, cos_cache, sin_cache); input [batch, seq, hidden] or
# [batch, heads, seq, head_size]; position_ids [batch, seq] (or one offset).

def _rotary_head_size(op: OpView) -> int:
    x = op.shape(0)
    if len(x) == 4:
        return x[3]
    heads = op.attr("num_heads", 0)
    return x[2] // heads if heads else 2 * op.shape(2)[-1]


def _rotary_local_attrs(op: OpView, ins: list, outs: list) -> dict:
    if len(op.shape(0)) == 4 or not op.attr("num_heads", 0):
        return {}
    return {"num_heads": ins[0][2] // _rotary_head_size(op)}


def _rotary_whole_heads(op: OpView, inputs, outputs, mesh) -> tuple | None:
    """A split of the 3-D input's hidden dim keeps whole heads."""
    if len(op.shape(0)) == 4:
        return ()
    local = inputs[0].local_shape(op.shape(0), mesh)[2]
    return () if local % _rotary_head_size(op) == 0 else None


@rule("RotaryEmbedding", domain=MICROSOFT, flops=per_element(3), local_attrs=_rotary_local_attrs,
      rewrite=_rotary_whole_heads)
def _rotary_embedding(op: OpView) -> list[Rule]:
    """Batch and sequence (with position ids [batch, seq]); heads (the 4-D input's dim 1,
    or the 3-D input's hidden dim in whole heads); the caches whole."""
    need(not op.attr("is_packed_batching", 0))
    x, positions = op.shape(0), op.shape(1)
    seq_dim = 2 if len(x) == 4 else 1
    per_token = len(positions) == 2
    rules: list[Rule] = []
    if per_token:
        rules.append(((0, 0, R, R), (0,)))
        rules.append(((seq_dim, 1, R, R), (seq_dim,)))
    else:
        rules.append(((0, R, R, R), (0,)))
    rules.append(((1 if len(x) == 4 else 2, R, R, R), (1 if len(x) == 4 else 2,)))
    return rules
