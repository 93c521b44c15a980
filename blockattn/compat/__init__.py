"""Drop-in entry points with the signatures of other block-sparse attention operators:
``blockattn.compat.npu`` (torch_npu's npu_block_sparse_attention) and ``blockattn.compat.fastvideo``
(FastVideo's block_sparse_attn_256). Modules load on first use, so importing one needs nothing from the other."""
