"""Pure-jnp reference for decode attention over a paged KV cache."""

from __future__ import annotations

from jaxrl_kernels.decode_attention.reference import decode_attention_reference


def gather_pages(pages, page_table):
    """pages [N, page_size, Hkv, D] + page_table [B, P] -> contiguous [B, P * page_size, Hkv, D]."""
    B, P = page_table.shape
    _, page_size, Hkv, D = pages.shape
    return pages[page_table].reshape(B, P * page_size, Hkv, D)


def paged_decode_attention_reference(
    q, k_pages, v_pages, lengths, page_table, *, sm_scale=None, window=None, softcap=None
):
    """The contiguous reference on the gathered pages (``window``, ``softcap`` as there)."""
    k = gather_pages(k_pages, page_table)
    v = gather_pages(v_pages, page_table)
    return decode_attention_reference(
        q, k, v, lengths, sm_scale=sm_scale, window=window, softcap=softcap
    )
