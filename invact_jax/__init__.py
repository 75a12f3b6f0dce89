"""invact_jax: inverted activations for JAX — keep the output, not the input.

Drop-in replacements for ``jax.nn`` activations whose backward pass needs only the
output ``y`` (plus one bit per element, packed 8 per byte, for GELU/SiLU/Mish).
"""
from invact_jax._activations import (  # noqa: F401
    elu, elu_reference, gelu, gelu_reference, leaky_relu, leaky_relu_reference, mish,
    mish_reference, relu, relu_reference, sigmoid, sigmoid_reference, silu, silu_reference,
    softplus, softplus_reference, swish, tanh, tanh_reference,
)
from invact_jax._norms import (  # noqa: F401
    layer_norm, layer_norm_dense, layer_norm_reference, norm_dense_reference, rms_norm,
    rms_norm_dense, rms_norm_reference,
)
from invact_jax._softmax import dropout, dropout_reference, softmax, softmax_reference  # noqa: F401
from invact_jax._dispatch import Implementation, available  # noqa: F401
from invact_jax._bitpack import pack_bits, packed_shape, unpack_bits  # noqa: F401

__version__ = "0.1.0"
from invact_jax._convert import ConversionReport, invert, inverted  # noqa: F401,E402
