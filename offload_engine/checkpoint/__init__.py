"""Reading Hugging Face checkpoint folders in place: headers, config, unit naming. Never loads tensor data."""
from .index import CheckpointIndex, ShardInfo, TensorRecord, DTYPES

__all__ = ["CheckpointIndex", "ShardInfo", "TensorRecord", "DTYPES"]
