"""An LLM as a plan sees it: which inputs are the tokens, the mask, the positions and the
key/value cache, how the cache grows, and what its folder says (context length, end
tokens, tokenizer).

Two forms ship:

- onnxruntime-genai's model builder: ``input_ids``, ``attention_mask`` ``[batch,
  total_sequence_length]``, ``past_key_values.N.key/value`` ``[batch, kv_heads,
  past_sequence_length, head_size]`` and GroupQueryAttention, which finds each sequence's
  end from the mask and writes the new positions into a buffer of fixed capacity that
  past and present share (``genai_config.json``: ``past_present_share_buffer``). Prompts
  of a batch are padded on the right (the cache of every sequence starts at position 0).
- optimum and torch exports in plain operators: ``position_ids`` too, and a cache that
  grows by the new positions each call (present = past + new). Prompts are padded on the
  left, their positions counted from the first real token.

``LlmLayout.read`` finds which is which from the model's inputs and the state pairs;
``ModelFolder`` reads the files beside the model; ``generation_dims`` gives the sizes a
plan for generation is made for (``meshplan plan --generate``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from meshplan.errors import ModelError
from meshplan.model.sizes import DimRange

SHARED, GROWING = "shared", "growing"


@dataclass
class ModelFolder:
    """What the files beside a model say about generating with it."""

    path: Path
    context_length: int | None = None
    eos_ids: list[int] = field(default_factory=list)
    pad_id: int | None = None
    vocab_size: int | None = None
    head_size: int | None = None
    share_buffer: bool | None = None
    tokenizer: Path | None = None

    @classmethod
    def read(cls, model_path: str | Path) -> "ModelFolder":
        folder = Path(model_path).resolve().parent
        found = cls(folder)
        genai = _json(folder / "genai_config.json")
        model = genai.get("model", {})
        search = genai.get("search", {})
        hf = _json(folder / "config.json")
        generation = _json(folder / "generation_config.json")
        found.context_length = _first_int(model.get("context_length"), search.get("max_length"),
                                          hf.get("max_position_embeddings"), generation.get("max_length"))
        found.eos_ids = _ids(model.get("eos_token_id")) or _ids(generation.get("eos_token_id")) or \
            _ids(hf.get("eos_token_id"))
        found.pad_id = _first_int(model.get("pad_token_id"), generation.get("pad_token_id"), hf.get("pad_token_id"))
        found.vocab_size = _first_int(model.get("vocab_size"), hf.get("vocab_size"))
        found.head_size = _first_int(model.get("decoder", {}).get("head_size"))
        if "past_present_share_buffer" in search:
            found.share_buffer = bool(search["past_present_share_buffer"])
        if (folder / "tokenizer.json").is_file():
            found.tokenizer = folder / "tokenizer.json"
        return found


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ModelError(f"cannot read {path}: {exc}") from None
    return data if isinstance(data, dict) else {}


def _first_int(*values) -> int | None:
    for value in values:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _ids(value) -> list[int]:
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, list):
        return [v for v in value if isinstance(v, int)]
    return []


@dataclass
class LlmLayout:
    """The roles of an LLM's inputs. ``cache`` is ``SHARED`` (a buffer of fixed capacity
    that past and present share) or ``GROWING`` (present = past + the new positions);
    ``cache_axis`` the positions' axis of the cache inputs; ``dims`` the names of the
    batch, new positions, past and total lengths where the model names them."""

    input_ids: str
    attention_mask: str | None
    position_ids: str | None
    state: dict[str, str]          # output → input
    cache: str
    cache_axis: int
    dims: dict[str, str | None]    # "batch", "sequence", "past", "total" → dim name
    other_dims: dict[str, int] = field(default_factory=dict)   # further symbolic dims of the cache (head size)

    @property
    def padding_side(self) -> str:
        """Where a batch's shorter prompts are padded: GroupQueryAttention's shared buffer
        keeps every sequence from position 0 (right); positions count past left padding."""
        return "right" if self.cache == SHARED else "left"

    @classmethod
    def read(cls, header: onnx.ModelProto, state: dict[str, str], folder: ModelFolder | None = None) -> "LlmLayout":
        initializers = {t.name for t in header.graph.initializer}
        inputs = {v.name: v for v in header.graph.input if v.name not in initializers}
        if not state:
            raise ModelError("the model has no key/value cache (no present.N.* output paired with a past input): "
                             "generation needs one", hint="pair them with --state OUT=IN when planning")
        ids = next((n for n in ("input_ids", "input_ids_0") if n in inputs), None)
        if ids is None:
            raise ModelError(f"the model has no input_ids input (inputs: {', '.join(inputs)}): generation needs "
                             "token ids")
        known = {ids, "attention_mask", "position_ids"} | set(state.values())
        extra = [n for n in inputs if n not in known]
        if extra:
            raise ModelError(f"generation does not know what to feed input '{extra[0]}' "
                             "(it feeds input_ids, attention_mask, position_ids and the cache)")
        ids_dims = _dim_names(inputs[ids])
        first = next(iter(state.values()))
        cache_dims = _dim_names(inputs[first])
        gqa = any(n.op_type == "GroupQueryAttention" and first in n.input for n in header.graph.node)
        share = folder.share_buffer if folder is not None and folder.share_buffer is not None else gqa
        axis = 2 if len(cache_dims) == 4 else len(cache_dims) - 2
        mask = "attention_mask" if "attention_mask" in inputs else None
        dims = {"batch": ids_dims[0], "sequence": ids_dims[1] if len(ids_dims) > 1 else None,
                "past": cache_dims[axis] if axis < len(cache_dims) else None,
                "total": _dim_names(inputs[mask])[1] if mask and len(_dim_names(inputs[mask])) > 1 else None}
        other = {}
        for index, name in enumerate(cache_dims):
            if isinstance(name, str) and index not in (0, axis) and name not in dims.values():
                if index == len(cache_dims) - 1 and folder is not None and folder.head_size:
                    other[name] = folder.head_size
        return cls(ids, mask, "position_ids" if "position_ids" in inputs else None, dict(state),
                   SHARED if share and gqa else GROWING, axis, dims, other)


def _dim_names(value: onnx.ValueInfoProto) -> list:
    return [d.dim_param if d.dim_param else d.dim_value for d in value.type.tensor_type.shape.dim]


def generation_dims(layout: LlmLayout, batch: int, max_length: int, chunk: int) -> dict:
    """The sizes a plan for generation is made for: 1 to ``batch`` sequences (costed at
    ``batch``: a call of fewer runs at its own size, and a server prefills one sequence's
    row alone), prompts fed in pieces of up to ``chunk`` positions, every call costed at a
    decode step (one new position) with the cache at ``max_length`` — the longest it gets,
    counted in memory."""
    if max_length < 2:
        raise ModelError(f"--max-length must be at least 2, got {max_length}")
    chunk = max(1, min(chunk, max_length))
    dims: dict = {}
    names = layout.dims
    if isinstance(names["batch"], str):   # any number of sequences up to ``batch``, costed at it
        dims[names["batch"]] = DimRange(1, batch, 1, batch) if batch > 1 else 1
    if isinstance(names["sequence"], str):
        dims[names["sequence"]] = DimRange(1, chunk, 1, 1) if chunk > 1 else 1
    if layout.cache == SHARED:
        if isinstance(names["past"], str):
            dims[names["past"]] = max_length
        if isinstance(names["total"], str) and names["total"] not in dims:
            dims[names["total"]] = DimRange(1, max_length, 1, max_length)
    elif isinstance(names["past"], str):
        dims[names["past"]] = DimRange(0, max_length - 1, 1, max_length - 1)
    dims.update(layout.other_dims)
    return dims
