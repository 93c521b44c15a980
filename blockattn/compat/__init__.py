"""Drop-in entry points with the signatures of other attention operators: ``blockattn.compat.npu`` (torch_npu's
npu_block_sparse_attention), ``blockattn.compat.fastvideo`` (FastVideo's block_sparse_attn_256 and
video_sparse_attn) and ``blockattn.compat.sage`` (SageAttention's sageattn and sageattn_varlen). Modules load on
first use, so importing one needs nothing from the others."""
