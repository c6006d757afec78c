"""Compiled kernels of RoPE-Relay attention; :func:`kvlab.relay.attention.ragged_attention` is
the torch reference they are tested against (docs/design.md, "RoPE-Relay: Attention")."""
