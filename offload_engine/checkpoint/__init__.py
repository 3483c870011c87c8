"""Reading Hugging Face checkpoint folders in place: headers, config, unit naming. Never loads tensor data."""
from .index import DTYPES, CheckpointIndex, ShardInfo, TensorRecord
from .model import ModelCheckpoint, open_model

__all__ = ["CheckpointIndex", "ShardInfo", "TensorRecord", "DTYPES", "ModelCheckpoint", "open_model"]
