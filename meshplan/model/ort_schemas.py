"""Operators onnxruntime registers in onnx's own domains that onnx does not define.

onnxruntime runs ``SimplifiedLayerNormalization`` (the RMSNorm of onnxruntime-genai's
model builder) and the pre-opset-17 ``LayerNormalization`` in the default domain; onnx's
checker rejects any default-domain operator it has no schema for ("No Op registered for
SimplifiedLayerNormalization with domain_version of 22"). ``register_onnxruntime_schemas``
copies onnxruntime's own schema of each such operator (inputs, outputs, type
constraints, attributes) into onnx's schema registry, so the checker checks those nodes
the way onnxruntime accepts them, and every other node as before. Operators of other
domains (``com.microsoft``) need nothing: onnx's checker does not look into domains it
does not know.

The registration is process-wide and done once; it adds schemas only where onnx has none
for that operator at that version.
"""

from __future__ import annotations

import functools

import onnx
from onnx.defs import OpSchema

# The operators onnxruntime runs in the default domain and onnx lacks (at these versions):
# onnxruntime-genai's RMSNorm, and the LayerNormalization that onnxruntime's transformer
# fusions write at opsets before onnx's own (17). onnxruntime lists more default-domain
# schemas (experimental and internal ones: Affine, Crop, MemcpyToHost…) that it does not
# run on the CPU provider or that no exporter writes; they are not added.
ONNXRUNTIME_DEFAULT_DOMAIN_OPS = ("SimplifiedLayerNormalization", "LayerNormalization")


def _onnxruntime_schemas() -> list:
    """onnxruntime's registered operator schemas (its Python binding lists them)."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as state
    except ImportError:   # onnxruntime not installed: the checker then judges alone
        return []
    listing = getattr(state, "get_all_operator_schema", None)
    return list(listing()) if listing is not None else []


def _defined_by_onnx(name: str, domain: str, version: int) -> bool:
    try:
        return onnx.defs.get_schema(name, version, domain).since_version == version
    except onnx.defs.SchemaError:
        return False


def _parameter(formal) -> OpSchema.FormalParameter:
    return OpSchema.FormalParameter(formal.name, formal.typeStr, formal.description or "",
                                    param_option=OpSchema.FormalParameterOption(int(formal.option)),
                                    is_homogeneous=bool(formal.isHomogeneous))


def _attribute(attribute) -> OpSchema.Attribute:
    if attribute.required:
        return OpSchema.Attribute(attribute.name, OpSchema.AttrType(int(attribute.type)), attribute.description or "",
                                  required=True)
    default = attribute._default_value if hasattr(attribute, "_default_value") else b""
    if default:
        proto = onnx.AttributeProto()
        proto.ParseFromString(default)
        if proto.type:
            return OpSchema.Attribute(attribute.name, proto, attribute.description or "")
    return OpSchema.Attribute(attribute.name, OpSchema.AttrType(int(attribute.type)), attribute.description or "",
                              required=False)


def _copy(schema) -> OpSchema:
    return OpSchema(
        schema.name, schema.domain, schema.since_version, schema.doc or "",
        inputs=[_parameter(p) for p in schema.inputs],
        outputs=[_parameter(p) for p in schema.outputs],
        type_constraints=[(c.type_param_str, list(c.allowed_type_strs), c.description or "")
                          for c in schema.type_constraints],
        attributes=[_attribute(a) for a in schema.attributes.values()],
    )


@functools.cache
def register_onnxruntime_schemas() -> tuple[tuple[str, str, int], ...]:
    """Register onnxruntime's schemas of ``ONNXRUNTIME_DEFAULT_DOMAIN_OPS`` where onnx has
    none; the (domain, op type, since version) registered (once per process)."""
    added = []
    for schema in sorted(_onnxruntime_schemas(), key=lambda s: (s.domain, s.name, s.since_version)):
        domain = "" if schema.domain == "ai.onnx" else schema.domain
        if domain or schema.name not in ONNXRUNTIME_DEFAULT_DOMAIN_OPS or schema.deprecated:
            continue
        if _defined_by_onnx(schema.name, domain, schema.since_version):
            continue
        try:
            onnx.defs.register_schema(_copy(schema))
        except Exception:  # onnx refuses a schema it cannot take (an unusual attribute type): left to the checker
            continue
        added.append((domain, schema.name, schema.since_version))
    return tuple(added)
