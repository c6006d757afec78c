"""kvlab: KV-cache compression for RoPE transformers (RoPE-Relay and PN-Mix)."""

__version__ = "0.1.0"
