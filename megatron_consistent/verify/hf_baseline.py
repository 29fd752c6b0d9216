"""Stock trainer-side recompute for hybrid Mamba-2 models: HF transformers' PyTorch path.

Megatron-Core's own Mamba mixer needs ``mamba_ssm`` / ``causal_conv1d`` CUDA
packages (not installable here), so the baseline's "stock trainer" for
``NemotronHForCausalLM`` / ``Mamba2ForCausalLM`` is the HF transformers model
(its pure-PyTorch ``torch_forward`` path, selected automatically when the
``mamba-ssm`` package is absent) loaded from the same exported checkpoint.
Log-probs: ``log_softmax(float32(logits) / temperature)``, as vLLM's processed
log-probs.
"""

from __future__ import annotations

import torch
from tqdm import tqdm


def load_hf_model(model_dir: str, dtype: torch.dtype):
    """The HF causal LM of ``model_dir`` in ``dtype``, eval mode (no download: the folder holds everything)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, local_files_only=True)
    return model.eval()


@torch.no_grad()
def hf_recompute(model, prompts: list[list[int]], responses: list[list[int]], temperature: float, batch: int) -> torch.Tensor:
    """Log-probs of every response token under the HF model, concatenated in prompt order (right padding: causal)."""
    out = []
    for b0 in tqdm(range(0, len(prompts), batch), desc="recompute (stock HF)", leave=False):
        seqs = [p + r for p, r in zip(prompts[b0 : b0 + batch], responses[b0 : b0 + batch])]
        width = max(len(s) for s in seqs)
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        logits = model(input_ids=ids, use_cache=False).logits.to(torch.float32)
        lp = torch.log_softmax(logits / temperature, dim=-1)
        for i, (p, r) in enumerate(zip(prompts[b0 : b0 + batch], responses[b0 : b0 + batch])):
            pos = torch.arange(len(p) - 1, len(p) - 1 + len(r))
            out.append(lp[i, pos, torch.tensor(r)])
    return torch.cat(out)
