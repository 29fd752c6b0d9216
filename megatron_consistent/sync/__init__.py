"""In-place weight sync from the Megatron trainer into a live vLLM engine (no pickle, no restart).

* :mod:`.protocol` — wire format: raw bytes in ``/dev/shm`` + a JSON schema; whole-update validation.
* :mod:`.worker` — :class:`~.worker.WeightSyncExtension`, the vLLM ``worker_extension_cls`` receiving updates.
* :mod:`.channel` — :class:`~.channel.WeightSyncChannel`, the trainer side (``push_model``, versions, pointers).

Transport only: the GRPO session that uses it is :mod:`megatron_consistent.rl`.  Import of this package does not
import vLLM; :mod:`.worker` does when used.
"""

from .channel import WORKER_EXTENSION, SyncReport, WeightSyncChannel
from .protocol import WeightSyncError, hf_tensor_specs, pack_update, validate_update

__all__ = ["WORKER_EXTENSION", "SyncReport", "WeightSyncChannel", "WeightSyncError", "hf_tensor_specs", "pack_update", "validate_update"]
