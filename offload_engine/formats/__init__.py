"""Weight formats, one module per family: how a quantized weight is recognised in a checkpoint, its component
bytes, its kernel forms and their room, and its dequantization (formats/base.py: WeightFormat). The rest of the
engine asks `registry.format_of(q)` instead of testing QuantSpec.kind."""
from .. import checkpoint  # noqa: F401,E402  (the readers there use the formats: they load first, whichever is asked)
