"""Paged attention: the pure-torch reference (``paged``), the fused CPU kernel (``kernel``,
C++ sources in ``csrc/``) and the dispatcher between them (``dispatch``)."""

from pagedkv.attention.dispatch import paged_attention
from pagedkv.attention.metadata import AttentionMetadata, SeqAttention
from pagedkv.attention.reference import paged_attention_reference

__all__ = ["paged_attention", "paged_attention_reference", "AttentionMetadata", "SeqAttention"]
