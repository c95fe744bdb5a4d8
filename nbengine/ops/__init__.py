"""Compute kernels: paged attention, RMSNorm, rotary embeddings, sampling.

Each op has a plain-torch reference (``*_ref``) and the fast path used by the models.
"""
