"""Int4 weights in the AWQ "gemm" checkpoint format.

- ``awq_format``  pack/unpack the format (qweight/qzeros/scales) and round-to-nearest group quantization.
- ``int4_linear`` ``Int4Linear``: an ``nn.Linear`` replacement on torch's own int4 kernels.
- ``awq_load``    load any ``quant_method: awq`` checkpoint into a transformers model.
- ``awq_search``  ``flashguard quantize``: the activation-aware scale search that writes such checkpoints.
- ``gguf_int4`` / ``gguf_load``  a GGUF's own 4- and 8-bit codes straight into ``Int4Linear``.
- ``lm_head``     the ``lm_head`` key: the output matrix in 16 bits, as Q8_0 codes, or as int4 codes whose top
                  logits are recomputed from the head's rows in host RAM.
"""

# Group size of the int4 weights ``flashguard quantize`` writes (``weights: int4`` on a float model); the VRAM planner
# assumes it where the engine has no int4 model to ask (``flashguard plan``). GGUF Q4 tensors keep their own 32.
AWQ_GROUP_SIZE = 64
