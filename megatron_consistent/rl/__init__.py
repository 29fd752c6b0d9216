"""RL post-training on the consistent path: the GRPO loop around a Megatron trainer and a live vLLM engine.

* :mod:`.session` — :class:`~.session.RLSession`: trainer + live engine (:func:`megatron_consistent.verify.rollout.engine`)
  + the in-place weight sync of :mod:`megatron_consistent.sync`, one GRPO step at a time.
* :mod:`.grpo` — group advantages and the clipped GRPO loss.
* :mod:`.toy_task` — the verifiable toy task and its tiny model config.

Import of this package does not import vLLM; :mod:`.session` does when an engine starts.
"""

from .grpo import group_advantages, grpo_loss
from .toy_task import TINY_RL_HF_CONFIG, ModTask

__all__ = ["TINY_RL_HF_CONFIG", "ModTask", "group_advantages", "grpo_loss"]
