"""The primitive-name sets the conversion's stages read, in one place.

Each set says what its primitives have in common for one question a stage asks (is it free to
recompute? does its derivative read its inputs? does it only move or re-type a value?).
"""
from __future__ import annotations

__all__ = ["COMMUTATIVE", "DEVICE_SUMS", "IDENTITY", "SHAPE", "FREE", "ELEMENTWISE", "KEEPS_INPUTS",
           "CONSTANT", "RECOMPUTED", "LINEAR", "MATMULS", "DOT", "CALLS", "CUSTOM_CALLS",
           "NESTED", "RADICALS", "SQUARES", "LINEAR_UNARY", "HEAD_SAME", "SHARDING"]

#: Binary primitives whose operands may be matched in either order.
COMMUTATIVE = frozenset({"add", "mul", "max", "min", "and", "or"})
#: Unary primitives that pass a value on unchanged or only re-type/re-mark it.
IDENTITY = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "reduce_precision"})
#: Primitives that change a value's shape only (broadcasts included).
SHAPE = frozenset({"broadcast_in_dim", "reshape", "squeeze", "expand_dims"})
#: Unary primitives that only move, copy or re-type values: recomputed for nothing.
FREE = frozenset({"reshape", "transpose", "copy", "copy_p", "squeeze", "expand_dims",
                  "convert_element_type", "reduce_precision"})
#: Elementwise primitives recomputed in the backward (cheap next to a matmul).
ELEMENTWISE = frozenset({"mul", "add", "sub", "div", "max", "min", "neg", "square",
                         "integer_pow", "abs", "sign", "exp", "log", "log1p", "expm1", "tanh",
                         "logistic", "sin", "cos", "sqrt", "rsqrt", "erf", "erfc", "select_n"})
#: Elementwise primitives whose own backward keeps their (non-constant) inputs.
KEEPS_INPUTS = frozenset({"mul", "div", "max", "min", "square", "integer_pow", "abs", "exp",
                          "log", "log1p", "expm1", "tanh", "logistic", "sin", "cos", "sqrt",
                          "rsqrt", "erf", "erfc", "select_n"})
#: Primitives that make a constant from literals alone (recomputed rather than kept).
CONSTANT = FREE | ELEMENTWISE | {"broadcast_in_dim", "iota"}
#: What the floor recomputes rather than keeps (elementwise, index and layout arithmetic).
RECOMPUTED = FREE | ELEMENTWISE | frozenset({
    "broadcast_in_dim", "iota", "eq", "ne", "lt", "le", "gt", "ge", "and", "or", "not",
    "xor", "select_n", "clamp", "floor", "ceil", "round", "is_finite", "concatenate", "pad",
    "slice", "squeeze", "rev", "stop_gradient", "shift_left", "shift_right_logical", "rem",
    "pow", "atan2", "cumsum", "split", "pvary", "nextafter", "imag", "real"})
#: A sum over a mesh axis, by its names across JAX's versions: an accumulation across devices.
DEVICE_SUMS = frozenset({"psum", "psum_invariant", "psum2"})
#: Primitives whose derivative needs none of their inputs.
LINEAR = DEVICE_SUMS | frozenset({"add", "sub", "neg", "reshape", "transpose", "copy", "copy_p", "squeeze",
                    "expand_dims", "convert_element_type", "broadcast_in_dim", "reduce_sum",
                    "concatenate", "pad", "slice", "dynamic_slice", "rev", "select_n",
                    "stop_gradient", "pvary", "all_gather", "reduce_precision",
                    "cumsum", "split", "real", "imag", "dynamic_update_slice", "gather",
                    "scatter-add", "iota"})
#: Matmuls: their inputs are the floor.
MATMULS = frozenset({"dot_general", "conv_general_dilated"})
DOT = "dot_general"
#: Calls with their own derivative rule (whose residuals the floor counts as they are).
CALLS = frozenset({"custom_vjp_call", "custom_vjp_call_jaxpr"})
#: Custom-derivative calls whose outputs an attention kernel's backward typically keeps.
CUSTOM_CALLS = CALLS | {"custom_jvp_call"}
#: Calls whose bodies the floor walks into.
NESTED = frozenset({"pjit", "jit", "checkpoint", "remat", "remat2", "custom_jvp_call",
                    "closed_call", "core_call", "shard_map"})
#: Primitives that make a norm's radical.
RADICALS = frozenset({"rsqrt", "sqrt"})
#: What a norm's statistic is traced back through to its input (a square, a difference).
SQUARES = frozenset({"convert_element_type", "square", "integer_pow", "pow", "mul", "sub"})
#: Unary primitives of a weighted sum of per-token losses (one operand computed from them).
LINEAR_UNARY = frozenset({"convert_element_type", "copy", "copy_p", "pvary", "reshape",
                          "squeeze", "expand_dims", "broadcast_in_dim", "transpose",
                          "reduce_sum", "neg", "sharding_constraint"})
#: What a cross-entropy's values pass through unchanged (``abs`` of a sum of exponentials is
#: the sum).
HEAD_SAME = IDENTITY | {"abs"}
#: Primitives that only say how a value is laid out over devices (MaxText constrains its
#: logits' sharding): a value passes through them unchanged.
SHARDING = frozenset({"sharding_constraint", "reshard", "mesh_cast"})
