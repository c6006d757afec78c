"""The random-initialized single-layer byte-level RoPE GQA model of the PN-Mix diagnostic.

docs/diagnostics.md, "PN-Mix": ``nn.Embedding(256, 128)`` and bias-free ``nn.Linear`` q/k/v
projections with PyTorch's default initializations, RMS-normalized input, 4 query heads, 2 kv heads,
head_dim 32, full rotary (half layout, as Llama), base 10000. Built on the CPU under
``torch.manual_seed(seed)`` so every device gets the same weights for a seed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvlab.rope import RotaryConfig, apply_rotary

__all__ = ["ByteRopeGQA", "ByteRopeGQAConfig", "ProjectedSequence"]


@dataclass(frozen=True)
class ByteRopeGQAConfig:
    vocab_size: int = 256
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 32
    rope_base: float = 10000.0


@dataclass(frozen=True)
class ProjectedSequence:
    """Rotated queries ``[1, H_q, S, D]``, rotated keys ``[1, H_kv, S, D]`` and values
    ``[1, H_kv, S, D]`` of a byte sequence, float32, positions ``0..S-1``."""

    queries: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor


class ByteRopeGQA(nn.Module):
    """Embedding → RMSNorm → q/k/v projections → RoPE; attention is done by the caller."""

    def __init__(self, config: ByteRopeGQAConfig | None = None) -> None:
        super().__init__()
        self.config = config or ByteRopeGQAConfig()
        c = self.config
        self.embed = nn.Embedding(c.vocab_size, c.hidden_size)
        self.norm = nn.RMSNorm(c.hidden_size)
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.rotary = RotaryConfig(head_dim=c.head_dim, base=c.rope_base)

    @classmethod
    def from_seed(cls, seed: int, device: torch.device | str = "cpu") -> ByteRopeGQA:
        """Build under ``torch.manual_seed(seed)`` on the CPU, then move to ``device``."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = cls()
        return model.to(device).eval()

    @torch.no_grad()
    def project(self, token_ids: torch.Tensor) -> ProjectedSequence:
        """Project byte ids ``[S]`` (int64, values 0..255) to rotated q/k and v.

        Raises:
            ValueError: ``token_ids`` is not 1-D or holds ids outside the vocabulary.
        """
        c = self.config
        if token_ids.dim() != 1:
            raise ValueError(f"token_ids must be 1-D [S], got shape {tuple(token_ids.shape)}")
        if token_ids.numel() and (token_ids.min() < 0 or token_ids.max() >= c.vocab_size):
            raise ValueError(f"token ids must lie in [0, {c.vocab_size})")
        seq = token_ids.shape[0]
        hidden = self.norm(self.embed(token_ids))

        def heads(x: torch.Tensor, n: int) -> torch.Tensor:
            return x.view(seq, n, c.head_dim).transpose(0, 1).unsqueeze(0)

        positions = torch.arange(seq, device=token_ids.device)
        queries = apply_rotary(
            heads(self.q_proj(hidden), c.num_attention_heads), positions, self.rotary
        )
        keys = apply_rotary(
            heads(self.k_proj(hidden), c.num_key_value_heads), positions, self.rotary
        )
        values = heads(self.v_proj(hidden), c.num_key_value_heads)
        return ProjectedSequence(queries=queries, keys=keys, values=values)

    def parameter_sha256(self) -> str:
        """sha256 over all parameters' float32 bytes (CPU), in ``state_dict`` order."""
        import hashlib

        digest = hashlib.sha256()
        for name, tensor in self.state_dict().items():
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().contiguous().numpy().tobytes())
        return digest.hexdigest()
